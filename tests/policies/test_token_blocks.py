"""The router's chained block hashes (policies/token_blocks.py): equal hashes, equal prefixes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.token_blocks import ROOT_HASH, block_hashes, cached_prefix_blocks

TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300)


@given(TOKENS, st.sampled_from([1, 16, 32]))
def test_only_full_blocks_are_named_and_a_prefix_keeps_its_hashes(
    tokens: list[int], bs: int
) -> None:
    hashes = block_hashes(tokens, bs)
    assert len(hashes) == len(tokens) // bs
    cut = (len(tokens) // 2) // bs * bs
    assert block_hashes(tokens[:cut], bs) == hashes[: cut // bs]


@given(TOKENS, TOKENS)
def test_a_block_hash_depends_on_everything_before_it(a: list[int], b: list[int]) -> None:
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    for i, (x, y) in enumerate(zip(ha, hb, strict=False)):
        assert (x == y) == (a[: 16 * (i + 1)] == b[: 16 * (i + 1)])


def test_hashes_continue_from_a_parent_and_are_stable_across_runs() -> None:
    tokens = list(range(64))
    whole = block_hashes(tokens, 32)
    assert block_hashes(tokens[32:], 32, parent=whole[0]) == whole[1:]
    assert block_hashes(tokens, 32, parent=ROOT_HASH) == whole
    # No per-process seed: the value is a function of the tokens alone.
    assert whole[0] == block_hashes(list(range(32)), 32)[0]
    with pytest.raises(ValueError):
        block_hashes(tokens, 0)


def test_the_cached_prefix_is_the_leading_run_only() -> None:
    hashes = block_hashes(list(range(128)), 32)
    assert cached_prefix_blocks(hashes, set(hashes)) == 4
    assert cached_prefix_blocks(hashes, {hashes[0], hashes[1], hashes[3]}) == 2
    assert cached_prefix_blocks(hashes, {hashes[1]}) == 0
    assert cached_prefix_blocks((), set()) == 0
