"""Request traces: load the published formats into one shape, and make prompts for them.

Three formats are recognised by their header, not by the file name:

    Azure CSV       TIMESTAMP,ContextTokens,GeneratedTokens   wall clock, 7 fractional digits
    Mooncake JSONL  {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}
    length-only CSV num_prefill_tokens,num_decode_tokens,...  (ShareGPT; no arrival times)

Arrivals are seconds from the first *selected* request, so a replay that starts at row K does
not sit idle for row K's offset. Length-only traces get Poisson arrivals at `poisson_rate`.

Prompts follow the simulated workers' token rule "4 characters = 1 token": a prompt of N tokens
is N three-letter words, each followed by a space. Mooncake's `hash_ids` name 512-token blocks;
block i of the prompt is generated from hash id i alone, so requests whose leading hash ids are
equal really share a text prefix and a prefix cache can hit on them.

The published traces live in `TRACE_DIR`: ../shared/traces beside the repository, or
$DISAGG_TRACES.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import orjson

__all__ = [
    "CHARS_PER_TOKEN",
    "MOONCAKE_BLOCK_TOKENS",
    "TRACE_DIR",
    "TraceFormatError",
    "TraceRequest",
    "detect_format",
    "load_trace",
    "multi_turn",
    "prompt_text",
    "scale_arrivals",
]

CHARS_PER_TOKEN = 4
MOONCAKE_BLOCK_TOKENS = 512

# disagg_tools/traces.py is two levels below the directory that holds the repository.
TRACE_DIR = Path(
    os.environ.get("DISAGG_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces")
)

# 3-letter consonant-vowel-consonant words: pronounceable, so a real tokenizer sees word-like
# text, and 3 letters + 1 space is exactly one token under the 4-characters rule.
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_WORDS: tuple[str, ...] = tuple(
    a + b + c for a in _CONSONANTS for b in _VOWELS for c in _CONSONANTS
)

_EPOCH = datetime(2020, 1, 1)
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_LENGTHS_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")


class TraceFormatError(ValueError):
    """The file exists but is not one of the known trace formats, or a row is malformed."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    `arrival_s` is seconds after the first selected request; `index` is the 0-based data row in
    the file (stable across `start`/`limit`), which also seeds the request's prompt text.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hash_ids: tuple[int, ...] = ()
    index: int = 0
    # The client's max_tokens for this request; None: the run's (a simulator's config). A mix of
    # phases whose clients ask differently keeps them apart (the estimator's classes name it).
    max_tokens: int | None = None


def detect_format(path: str | Path) -> str:
    """Return "azure", "mooncake" or "lengths" from the file's first non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with path.open("r", encoding="utf-8-sig") as fh:
        first = next((line.strip() for line in fh if line.strip()), "")
    if first.startswith("{"):
        try:
            row = orjson.loads(first)
        except orjson.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}: first line is not valid JSON") from exc
        if isinstance(row, dict) and all(k in row for k in _MOONCAKE_KEYS):
            return "mooncake"
        raise TraceFormatError(
            f"{path}: JSONL rows need keys {', '.join(_MOONCAKE_KEYS)} (Mooncake format)"
        )
    header = [c.strip() for c in first.split(",")]
    if all(c in header for c in _AZURE_COLUMNS):
        return "azure"
    if all(c in header for c in _LENGTHS_COLUMNS):
        return "lengths"
    raise TraceFormatError(
        f"{path}: unknown trace format (header {first[:80]!r}); expected Azure CSV "
        f"({','.join(_AZURE_COLUMNS)}), Mooncake JSONL ({', '.join(_MOONCAKE_KEYS)}, hash_ids) "
        f"or a length-only CSV ({','.join(_LENGTHS_COLUMNS)})"
    )


def load_trace(
    path: str | Path,
    *,
    limit: int | None = None,
    start: int = 0,
    poisson_rate: float | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """Load rows `start .. start+limit` of a trace file, format detected from its header.

    `poisson_rate` (req/s) replaces the file's arrivals with a seeded Poisson process; it is
    required for length-only traces, which carry no times.
    """
    if start < 0 or (limit is not None and limit < 0):
        raise ValueError("start and limit must be >= 0")
    if poisson_rate is not None and poisson_rate <= 0:
        raise ValueError("poisson_rate must be > 0 req/s")
    fmt = detect_format(path)
    if fmt == "lengths" and poisson_rate is None:
        raise TraceFormatError(
            f"{path}: a length-only trace has no arrival times; give poisson_rate (req/s)"
        )
    stop = None if limit is None else start + limit
    with Path(path).open("r", encoding="utf-8-sig", newline="") as fh:
        rows: Iterable[tuple[float, int, int, tuple[int, ...]]]
        if fmt == "azure":
            rows = _azure_rows(csv.DictReader(fh))
        elif fmt == "mooncake":
            rows = _mooncake_rows(fh)
        else:
            rows = _length_rows(csv.DictReader(fh))
        selected = list(itertools.islice(_indexed(rows, path), start, stop))
    if not selected:
        return []
    if poisson_rate is not None:
        arrivals = _poisson_arrivals(len(selected), poisson_rate, seed)
    else:
        t0 = selected[0][1]
        arrivals = [max(0.0, t - t0) for _, t, *_ in selected]
    return [
        TraceRequest(arrival_s=a, prompt_tokens=p, output_tokens=o, prefix_hash_ids=h, index=i)
        for a, (i, _t, p, o, h) in zip(arrivals, selected, strict=True)
    ]


def multi_turn(
    path: str | Path,
    *,
    conversations: int,
    seed: int = 0,
    block_tokens: int = 64,
    mean_turns: float = 4.0,
    think_s: float = 20.0,
    followup_share: float = 0.25,
    system_tokens: int = 0,
    max_prompt_tokens: int = 32_768,
) -> list[TraceRequest]:
    """Conversations whose every turn extends the previous turn's prompt, from a trace's lengths.

    Deterministic under `seed`. The trace's rows are taken in order, one per turn: a
    conversation starts at its first row's arrival with that row's prompt; each later turn's
    prompt is the previous prompt + the previous answer + a follow-up of `followup_share` of its
    row's prompt length (follow-ups are shorter than opening contexts), and arrives an
    exponential think time (mean `think_s`) after the previous turn. Turns per conversation are
    geometric with mean `mean_turns`; a conversation ends early past `max_prompt_tokens`.

    `prefix_hash_ids` name the prompt's full `block_tokens`-token blocks along the
    conversation's token stream: turn k's ids extend turn k-1's, and the first
    `system_tokens // block_tokens` ids (a shared system prompt) are the same in every
    conversation, so a prefix cache hits exactly where the tokens are equal.
    """
    if conversations < 0 or block_tokens <= 0 or mean_turns < 1 or think_s <= 0:
        raise ValueError("conversations >= 0, block_tokens > 0, mean_turns >= 1, think_s > 0")
    rows = load_trace(path)
    if not rows and conversations:
        raise TraceFormatError(f"{path}: no rows to build conversations from")
    rng = random.Random(seed)
    system_blocks = system_tokens // block_tokens
    next_id = system_blocks  # ids 0..system_blocks-1 are the shared system prompt
    out: list[tuple[float, int, int, tuple[int, ...]]] = []
    row_at = 0
    for _ in range(conversations):
        turns = 1
        while rng.random() > 1.0 / mean_turns:
            turns += 1
        stream = list(range(system_blocks))  # this conversation's block ids, in token order
        arrival = rows[row_at % len(rows)].arrival_s
        prompt = 0
        for turn in range(turns):
            row = rows[row_at % len(rows)]
            row_at += 1
            if turn == 0:
                prompt = system_tokens + max(1, row.prompt_tokens)
            else:
                arrival += rng.expovariate(1.0 / think_s)
                prompt += max(1, round(row.prompt_tokens * followup_share))
            if prompt > max_prompt_tokens:
                break
            full = prompt // block_tokens
            while len(stream) < full:
                stream.append(next_id)
                next_id += 1
            out.append((arrival, prompt, row.output_tokens, tuple(stream[:full])))
            prompt += row.output_tokens  # the answer is part of the next turn's context
    out.sort(key=lambda r: r[0])
    t0 = out[0][0] if out else 0.0
    return [
        TraceRequest(arrival_s=a - t0, prompt_tokens=p, output_tokens=o, prefix_hash_ids=h, index=i)
        for i, (a, p, o, h) in enumerate(out)
    ]


def scale_arrivals(reqs: Sequence[TraceRequest], rate_scale: float) -> list[TraceRequest]:
    """Multiply the request rate by `rate_scale`: every arrival gap is divided by it."""
    if rate_scale <= 0:
        raise ValueError("rate_scale must be > 0")
    return [dataclasses.replace(r, arrival_s=r.arrival_s / rate_scale) for r in reqs]


def prompt_text(req: TraceRequest, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> str:
    """A deterministic prompt of exactly `req.prompt_tokens` tokens (4 characters each).

    With `prefix_hash_ids`, block i is drawn from hash id i alone (the last block cut to fit),
    so equal leading ids give an equal text prefix of `block_tokens * 4` characters per block.
    Tokens beyond the hashed blocks, and prompts without hashes, are drawn from the request's
    own index.
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be > 0")
    remaining = max(0, req.prompt_tokens)
    parts: list[str] = []
    for hash_id in req.prefix_hash_ids:
        if remaining <= 0:
            break
        n = min(block_tokens, remaining)
        parts.append(_words(f"block:{hash_id}", block_tokens)[: n * CHARS_PER_TOKEN])
        remaining -= n
    if remaining > 0:
        # A separate seed namespace, so request 7's text never equals hash block 7's.
        parts.append(_words(f"request:{req.index}", remaining))
    return "".join(parts)


def _words(seed: str, n: int) -> str:
    """n words of 3 letters + a space, seeded by a string (str seeds ignore PYTHONHASHSEED)."""
    rng = random.Random(seed)
    return " ".join(rng.choices(_WORDS, k=n)) + " " if n > 0 else ""


def _indexed(
    rows: Iterable[tuple[float, int, int, tuple[int, ...]]], path: str | Path
) -> Iterator[tuple[int, float, int, int, tuple[int, ...]]]:
    for i, (t, p, o, h) in enumerate(rows):
        if p < 0 or o < 0:
            raise TraceFormatError(f"{path}: row {i}: negative token count")
        yield i, t, p, o, h


def _azure_rows(reader: csv.DictReader[str]) -> Iterator[tuple[float, int, int, tuple[int, ...]]]:
    for n, row in enumerate(reader):
        try:
            t = _parse_wallclock(row["TIMESTAMP"])
            yield t, int(row["ContextTokens"]), int(row["GeneratedTokens"]), ()
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"Azure trace row {n}: {exc}") from exc


def _mooncake_rows(lines: Iterable[str]) -> Iterator[tuple[float, int, int, tuple[int, ...]]]:
    n = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
            hashes = tuple(int(h) for h in row.get("hash_ids") or ())
            yield (
                row["timestamp"] / 1000.0,
                int(row["input_length"]),
                int(row["output_length"]),
                hashes,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"Mooncake trace row {n}: {exc}") from exc
        n += 1


def _length_rows(reader: csv.DictReader[str]) -> Iterator[tuple[float, int, int, tuple[int, ...]]]:
    for n, row in enumerate(reader):
        try:
            yield 0.0, int(row["num_prefill_tokens"]), int(row["num_decode_tokens"]), ()
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"length-only trace row {n}: {exc}") from exc


def _parse_wallclock(text: str) -> float:
    """Seconds since 2020-01-01 (naive) of "YYYY-MM-DD HH:MM:SS.fffffff".

    Azure writes 7 fractional digits (100 ns); datetime keeps only 6, so the fraction is parsed
    on its own. Only differences matter, and a recent epoch keeps a float's resolution ~10 ns.
    """
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    seconds = (base - _EPOCH).total_seconds()
    if frac:
        if not frac.isdigit():
            raise ValueError(f"bad fractional seconds in {text!r}")
        seconds += int(frac) / 10 ** len(frac)
    return seconds


def _poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """n arrivals of a Poisson process at `rate` req/s, the first at 0."""
    rng = random.Random(seed)
    arrivals = [0.0]
    for _ in range(n - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    return arrivals
