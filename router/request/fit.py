"""A request that can never fit on any decode worker: a 400 at once, not a 429 to retry.

The rule (issue 31, item 6b): a request never fits when even the smallest reservation the router
could ever make for it does not fit the largest decode worker serving its model, empty: its
prompt, plus each of its `n` choices' own copy of the prompt's last partial block and one output
token (the estimate at its floor). Counted per worker in that worker's block size, as
`RequestInfo.reserve_output_tokens` counts a reservation (policies/base.py).

Not the reservation the router would make now (the estimator's upper quantile per choice, or
`max_tokens` while it has no history): that one shrinks as the estimator learns (or with a
trusted `X-Expected-Output-Tokens` hint), and an answer may then outgrow it, counted past
capacity (docs/policies.md, overruns) — even one forced long by `ignore_eos`. A request over
capacity by its estimate alone is still refused at once, with the 429 that says when to retry
(router/request/reserve.py `_never_fits`).

The 400 names what to change: the prompt when one token after it does not fit, else `n`.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.base import RequestInfo, blocks_for, extra_choice_tokens
from router.errors import InvalidRequest
from router.openai.api import CHAT, RESPONSES, ParsedRequest
from router.workers.worker_state import WorkerState

__all__ = ["never_fits"]

_PROMPT_PARAMS = ("messages", "prompt", "input")


def _blocks(prompt: int, n: int, block_size: int) -> int:
    """KV blocks `prompt` and `n` choices of one token each hold (policies/base.py)."""
    return blocks_for(prompt + n + extra_choice_tokens(prompt, n, block_size), block_size)


def never_fits(
    parsed: ParsedRequest, info: RequestInfo, decode_workers: Iterable[WorkerState]
) -> InvalidRequest | None:
    """The 400 for a request that cannot fit on any of `decode_workers` even when it is empty
    (the module docstring), or None. None too when that cannot be told: no decode worker for
    the model (room comes with a worker), or one whose KV layout is not known yet."""
    workers = [
        w for w in decode_workers if not w.spec.layout.model or w.spec.layout.model == info.model
    ]
    if not workers or not all(w.layout_known for w in workers):
        return None
    prompt, n = info.prompt_tokens, max(1, info.n)

    def fits(choices: int) -> bool:
        return any(
            _blocks(prompt, choices, w.spec.layout.block_size) <= w.capacity_blocks for w in workers
        )

    if fits(n):
        return None
    largest = max(workers, key=lambda w: w.capacity_blocks * w.spec.layout.block_size)
    size = largest.spec.layout.block_size
    if not fits(1):
        param = (
            "messages" if parsed.path == CHAT else "input" if parsed.path == RESPONSES else "prompt"
        )
        why, need = f"its prompt (about {prompt} tokens) and one token", _blocks(prompt, 1, size)
    else:
        param, need = "n", _blocks(prompt, n, size)
        why = f"its prompt and {n} choices, each with its own last prompt block and one token"
    return InvalidRequest(
        f"This request can never fit on a decode worker: it needs at least {need} KV blocks of "
        f"{size} tokens for {why}, and the largest decode worker holds {largest.capacity_blocks} "
        f"blocks even when empty. {'Shorten' if param in _PROMPT_PARAMS else 'Lower'} "
        f"'{param}'.",
        param=param,
        code="exceeds_decode_capacity",
    )
