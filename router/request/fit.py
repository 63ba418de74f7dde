"""A request that can never fit on any decode worker: a 400 at once, not a 429 to retry.

The rule (issue 31, item 6b): a request never fits when even the least KV it could hold does
not fit the largest decode worker serving its model, empty — its prompt, plus each of its `n`
choices' own copy of the prompt's last partial block and the fewest output tokens that choice
can produce: 1, or `min_tokens`, or `max_tokens` itself with `ignore_eos` (vLLM's and SGLang's
extensions: the answer then has exactly that length). Counted per worker in that worker's block
size, as `RequestInfo.reserve_output_tokens` counts a reservation (policies/base.py).

Not the reservation the router would make now (`RequestInfo.reserve_output_tokens`: the
estimator's upper quantile per choice, or `max_tokens` while it has no history): that one may
shrink as the estimator learns, and a request whose real answers are short would then fit. A
request over capacity by its estimate alone is still refused at once, but with the 429 that
says when to retry (router/request/reserve.py `_never_fits`).

The 400 names what to change: the prompt when one token after it does not fit, `max_tokens`
(or `min_tokens`) when one choice of that forced length does not, else `n`.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.base import RequestInfo, blocks_for, extra_choice_tokens
from router.api import CHAT, RESPONSES, ParsedRequest
from router.errors import InvalidRequest
from router.workers.worker_state import WorkerState

__all__ = ["never_fits"]

_PROMPT_PARAMS = ("messages", "prompt", "input")


def _least_output(parsed: ParsedRequest, max_tokens: int) -> tuple[int, str | None]:
    """The fewest output tokens one choice can produce, and the parameter that forces them
    (None: nothing does, one token)."""
    body = parsed.body
    cap_param = "max_output_tokens" if parsed.path == RESPONSES else "max_tokens"
    if body.get("ignore_eos") is True:
        return max(1, max_tokens), cap_param
    least = body.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least > 1:
        return min(max_tokens, least), "min_tokens"
    return 1, None


def _blocks(prompt: int, n: int, output: int, block_size: int) -> int:
    """KV blocks `n` choices of `output` tokens each hold after `prompt` (policies/base.py)."""
    return blocks_for(prompt + n * output + extra_choice_tokens(prompt, n, block_size), block_size)


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
    output, forced_by = _least_output(parsed, info.max_tokens)

    def fits(choices: int, each: int) -> bool:
        return any(
            _blocks(prompt, choices, each, w.spec.layout.block_size) <= w.capacity_blocks
            for w in workers
        )

    if fits(n, output):
        return None
    largest = max(workers, key=lambda w: w.capacity_blocks * w.spec.layout.block_size)
    size = largest.spec.layout.block_size
    if not fits(1, 1):
        param = (
            "messages" if parsed.path == CHAT else "input" if parsed.path == RESPONSES else "prompt"
        )
        why, need = f"its prompt (about {prompt} tokens) alone", _blocks(prompt, 1, 1, size)
    elif forced_by is not None and not fits(1, output):
        param, why = forced_by, f"one choice of {output} output tokens ('{forced_by}')"
        need = _blocks(prompt, 1, output, size)
    else:
        param, need = "n", _blocks(prompt, n, output, size)
        why = f"its {n} choices of at least {output} output token{'s' if output > 1 else ''} each"
    return InvalidRequest(
        f"This request can never fit on a decode worker: {why} needs at least {need} KV blocks "
        f"of {size} tokens, and the largest decode worker holds {largest.capacity_blocks} "
        f"blocks even when empty. {'Shorten' if param in _PROMPT_PARAMS else 'Lower'} "
        f"'{param}'.",
        param=param,
        code="exceeds_decode_capacity",
    )
