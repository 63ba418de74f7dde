"""LoRA adapters and prefix caches: a prompt's KV under an adapter is not the base model's KV
(vLLM folds the adapter into its block hashes; its KV events carry `lora_id` / `lora_name`), so
the router names such blocks in the adapter's own space (docs/lora.md).

    lora_root(adapter)              the parent of an adapter's first block, where the base
                                    model's chains start at `token_blocks.ROOT_HASH`
    lora_prefixes(hashes, adapter)  the estimated prefix hashes (router/openai/prompt_text.py)
                                    moved into the adapter's space

Names of different adapters (and of the base model) never compare equal, so a prompt under
adapter A never counts a base-model or adapter-B prefix hit; under one adapter they chain as
any other (a prefix is still a prefix).
"""

from __future__ import annotations

import hashlib

from policies.token_blocks import ROOT_HASH

__all__ = ["lora_prefixes", "lora_root"]


def lora_root(adapter: str | None) -> int:
    """The chain root of `adapter`'s blocks (`ROOT_HASH` for none: the base model)."""
    if not adapter:
        return ROOT_HASH
    digest = hashlib.blake2b(b"lora\0" + adapter.encode(), digest_size=8).digest()
    root = int.from_bytes(digest, "little", signed=True)
    return root if root != ROOT_HASH else 1


def lora_prefixes(hashes: tuple[int, ...], adapter: str | None) -> tuple[int, ...]:
    """`hashes` (a prompt's chained prefix hashes) in `adapter`'s space; unchanged for none.
    XOR with one salt keeps equality exactly: two prompts under one adapter share leading
    hashes exactly as far as they share a prefix."""
    if not adapter or not hashes:
        return hashes
    salt = lora_root(adapter)
    return tuple(h ^ salt for h in hashes)
