"""Trace loaders on the real published files, and the prompt-length rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg_tools.traces import (
    CHARS_PER_TOKEN,
    MOONCAKE_BLOCK_TOKENS,
    TraceFormatError,
    TraceRequest,
    detect_format,
    load_trace,
    prompt_text,
    scale_arrivals,
)

TRACES = Path("/work/shared/traces")
AZURE_CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = TRACES / "AzureLLMInferenceTrace_code.csv"
MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
SHAREGPT = TRACES / "sharegpt_lengths.csv"

pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason="shared traces not present")


def _monotonic(reqs: list[TraceRequest]) -> bool:
    return all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))


def test_detect_formats() -> None:
    assert detect_format(AZURE_CONV) == "azure"
    assert detect_format(AZURE_CODE) == "azure"
    assert detect_format(MOONCAKE) == "mooncake"
    assert detect_format(SHAREGPT) == "lengths"


def test_azure_conv_full_and_first_rows() -> None:
    reqs = load_trace(AZURE_CONV)
    assert len(reqs) == 19_366
    # 18:15:46.6805900 -> 18:15:50.9951690: all 7 fractional digits kept.
    assert reqs[0] == TraceRequest(0.0, 374, 44, (), 0)
    assert reqs[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert (reqs[1].prompt_tokens, reqs[1].output_tokens, reqs[1].index) == (396, 109, 1)
    assert _monotonic(reqs)
    assert 3400 < reqs[-1].arrival_s < 3700  # about one hour


def test_azure_code_start_and_limit_rebase_arrivals() -> None:
    reqs = load_trace(AZURE_CODE, start=1, limit=5)
    assert [r.index for r in reqs] == [1, 2, 3, 4, 5]
    assert reqs[0].arrival_s == 0.0  # relative to the first selected row
    assert (reqs[0].prompt_tokens, reqs[0].output_tokens) == (3180, 8)
    assert _monotonic(reqs)
    assert len(load_trace(AZURE_CODE)) == 8_819


def test_mooncake_rows() -> None:
    reqs = load_trace(MOONCAKE)
    assert len(reqs) == 3_993
    first = reqs[0]
    assert (first.arrival_s, first.prompt_tokens, first.output_tokens) == (0.0, 40160, 6)
    assert first.prefix_hash_ids == tuple(range(79))
    assert _monotonic(reqs)
    assert reqs[-1].arrival_s == pytest.approx(1022.025)
    for r in reqs[:50]:
        assert len(r.prefix_hash_ids) == -(-r.prompt_tokens // MOONCAKE_BLOCK_TOKENS)


def test_sharegpt_needs_a_rate_and_gets_seeded_poisson_arrivals() -> None:
    with pytest.raises(TraceFormatError, match="poisson_rate"):
        load_trace(SHAREGPT, limit=10)
    a = load_trace(SHAREGPT, limit=2000, poisson_rate=4.0, seed=7)
    b = load_trace(SHAREGPT, limit=2000, poisson_rate=4.0, seed=7)
    c = load_trace(SHAREGPT, limit=2000, poisson_rate=4.0, seed=8)
    assert a == b and a != c
    assert (a[0].arrival_s, a[0].prompt_tokens, a[0].output_tokens) == (0.0, 74, 918)
    assert _monotonic(a)
    mean_rate = (len(a) - 1) / a[-1].arrival_s
    assert 3.5 < mean_rate < 4.5
    assert len(load_trace(SHAREGPT, poisson_rate=1.0)) == 30_731


def test_missing_file_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_trace(tmp_path / "nope.csv")
    odd = tmp_path / "odd.csv"
    odd.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(odd)
    odd_json = tmp_path / "odd.jsonl"
    odd_json.write_text('{"prompt": "hi"}\n')
    with pytest.raises(TraceFormatError, match="Mooncake"):
        load_trace(odd_json)


def test_scale_arrivals_divides_gaps() -> None:
    reqs = load_trace(AZURE_CONV, limit=20)
    fast = scale_arrivals(reqs, 2.0)
    assert [f.arrival_s for f in fast] == pytest.approx([r.arrival_s / 2 for r in reqs])
    assert [f.index for f in fast] == [r.index for r in reqs]
    with pytest.raises(ValueError):
        scale_arrivals(reqs, 0)


@pytest.mark.parametrize("tokens", [0, 1, 7, 511, 512, 513, 3000])
def test_prompt_length_rule(tokens: int) -> None:
    text = prompt_text(TraceRequest(0.0, tokens, 1, (), 3))
    assert len(text) == CHARS_PER_TOKEN * tokens
    assert len(text.split()) == tokens
    assert all(len(w) == 3 for w in text.split())
    assert text == prompt_text(TraceRequest(5.0, tokens, 9, (), 3))  # deterministic per request


def test_prompts_differ_between_requests() -> None:
    a = prompt_text(TraceRequest(0.0, 64, 1, (), 1))
    b = prompt_text(TraceRequest(0.0, 64, 1, (), 2))
    assert a != b


def test_mooncake_shared_prefix_is_shared_text() -> None:
    reqs = load_trace(MOONCAKE, limit=200)
    pairs = []
    for i, a in enumerate(reqs):
        for b in reqs[i + 1 :]:
            k = 0
            while (
                k < min(len(a.prefix_hash_ids), len(b.prefix_hash_ids))
                and a.prefix_hash_ids[k] == b.prefix_hash_ids[k]
            ):
                k += 1
            if k >= 1 and (a.prompt_tokens > k * 512 and b.prompt_tokens > k * 512):
                pairs.append((a, b, k))
    assert pairs, "the first 200 Mooncake rows share prefixes"
    block_chars = MOONCAKE_BLOCK_TOKENS * CHARS_PER_TOKEN
    for a, b, k in pairs[:5]:
        ta, tb = prompt_text(a), prompt_text(b)
        assert len(ta) == a.prompt_tokens * CHARS_PER_TOKEN
        assert len(tb) == b.prompt_tokens * CHARS_PER_TOKEN
        assert ta[: k * block_chars] == tb[: k * block_chars]
        assert (
            ta[k * block_chars : (k + 1) * block_chars]
            != tb[k * block_chars : (k + 1) * block_chars]
        )


def test_last_partial_block_is_a_prefix_of_the_full_block() -> None:
    full = prompt_text(TraceRequest(0.0, 1024, 1, (42, 43), 0))
    part = prompt_text(TraceRequest(0.0, 700, 1, (42, 43), 1))
    assert len(part) == 700 * CHARS_PER_TOKEN
    assert full.startswith(part)
