"""The prefixes a prefill worker has recently seen (their hashes: router/openai/prompt_text.py).

No tokenizer is at hand, so blocks are cut on characters (4 characters a token, 512-token
blocks, as Mooncake's traces count them). Each hash covers the whole prompt up to the end of its
block, so two prompts share their leading hashes exactly as far as they share a prefix — what a
prefill worker's prefix cache would reuse. The two-sided policy prefers a prefill worker that
recently prefilled the same prefix.
"""

from __future__ import annotations

__all__ = ["RecentPrefixes"]


class RecentPrefixes:
    """A bounded, insertion-ordered set of prefix hashes, with a frozen view for snapshots."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._order: dict[int, None] = {}
        self._frozen: frozenset[int] = frozenset()

    def __repr__(self) -> str:
        return f"RecentPrefixes({len(self._order)}/{self.limit})"

    def add(self, hashes: tuple[int, ...]) -> None:
        if not hashes:
            return
        for h in hashes:
            self._order.pop(h, None)
            self._order[h] = None
        while len(self._order) > self.limit:
            del self._order[next(iter(self._order))]
        self._frozen = frozenset(self._order)

    @property
    def frozen(self) -> frozenset[int]:
        return self._frozen
