"""The request parse with the served models' tokenizers: exact prompt token counts where a
tokenizer is configured (setting `estimates.tokenizers: {model: dir}`), the character estimate
elsewhere.

Tokenizing is CPU work in the request's path, so it must not stall the event loop: a body over
`THREAD_ABOVE_BYTES` is parsed and tokenized in a worker thread (`asyncio.to_thread`), as is the
first request that needs a tokenizer not yet loaded (reading tokenizer.json takes tens to
hundreds of milliseconds for a real model). The threshold is measured
(scripts/tokenize_cost.py; docs/benchmarks-overhead.md "Exact prompt tokens").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

from router.config import Settings
from router.metrics import RouterMetrics
from router.openai.api import ParsedRequest, parse_request
from router.openai.responses_pd import RESPONSES, parse_responses
from router.tokens.loaded import LOADED, tokenizer_for

__all__ = ["THREAD_ABOVE_BYTES", "parse_generation", "prompt_token_modes"]

# Bodies larger than this are tokenized off the event loop: at ~1-3 µs of CPU per prompt token,
# a body of this size holds the loop ~0.3-1 ms, several times the ~60 µs a thread hop costs
# (docs/benchmarks-overhead.md "Exact prompt tokens").
THREAD_ABOVE_BYTES = 1024


def _parse(
    path: str, raw: bytes, settings: Settings, models: tuple[str, ...]
) -> Callable[[], ParsedRequest]:
    lookup = (
        partial(tokenizer_for, settings.estimates.tokenizers)
        if settings.estimates.tokenizers
        else None
    )
    common: dict[str, Any] = {
        "models": models,
        "max_model_len": settings.max_model_len,
        "chars_per_token": settings.estimates.chars_per_token,
        "tokenizer_for": lookup,
    }
    if path == RESPONSES:
        return partial(parse_responses, raw, **common)
    return partial(parse_request, path, raw, max_n=settings.api.max_n, **common)


async def parse_generation(
    path: str,
    raw: bytes,
    settings: Settings,
    models: tuple[str, ...],
    metrics: RouterMetrics,
) -> ParsedRequest:
    """The generation request (chat, completions, Responses) parsed and validated, its prompt
    counted by the model's tokenizer when one is configured."""
    parse = _parse(path, raw, settings, models)
    on_loop = not settings.estimates.tokenizers or (
        len(raw) <= THREAD_ABOVE_BYTES
        and all(LOADED.ready(d) for d in settings.estimates.tokenizers.values())
    )
    parsed = parse() if on_loop else await asyncio.to_thread(parse)
    metrics.prompt_tokens_source.labels(parsed.prompt_tokens_source).inc()
    return parsed


def prompt_token_modes(settings: Settings) -> dict[str, dict[str, object]]:
    """Per served model, how its prompts are counted (for /admin/state): `tokenizer` (exact,
    from the directory; `loaded` once a request has read it, false if it failed) or `estimate`
    (characters / chars_per_token). Token-id prompts are exact in either mode."""
    out: dict[str, dict[str, object]] = {}
    for model in dict.fromkeys((*settings.models, *settings.estimates.tokenizers)):
        directory = settings.estimates.tokenizers.get(model)
        if directory is None:
            out[model] = {
                "source": "estimate",
                "chars_per_token": settings.estimates.chars_per_token,
            }
        else:
            loaded = LOADED.get(directory) is not None if LOADED.ready(directory) else None
            out[model] = {"source": "tokenizer", "tokenizer_dir": directory, "loaded": loaded}
    return out
