"""What an exact prompt count costs the router (router/tokens/): the request parse with the
model's tokenizer against the character estimate, by prompt size, and the thread hop that takes
a large prompt off the event loop (router/openai/prompt_tokens.py THREAD_ABOVE_BYTES).

    python scripts/tokenize_cost.py [--tokenizer DIR ...] [--repeats 200]

Tokenizers: any model directory given (`--tokenizer`, e.g. the real-vLLM tiny model's), the
repository's word-level aiperf tokenizer (examples/aiperf/tokenizer), and a byte-level BPE of
32,000 tokens trained here on the repository's own docs (a real model's kind of tokenizer;
nothing is downloaded). Each is given a chat template of the usual shape. For each prompt size
the whole `parse_request` of a chat and of a completion body is timed in-process (the parsing
thread's CPU time, time.thread_time_ns, so a busy machine's scheduling delays are not counted;
`--repeats` runs after a warm-up), reported as p50/p99 µs per request and µs per 1,000 prompt
tokens; the round trip of `asyncio.to_thread` with nothing to do, which is what moving a parse
to a thread adds to it; and the event loop's waits (wall time between its turns) while large
chat bodies go through the router's own parse (router/openai/prompt_tokens.py) on the loop and in a
thread. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from router.config import settings_from_mapping
from router.metrics import RouterMetrics
from router.openai import prompt_tokens as counting
from router.openai.api import CHAT, COMPLETIONS, ParsedRequest, parse_request
from router.openai.prompt_tokens import parse_generation
from router.tokens.tokenizer import PromptTokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "m"
_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SIZES_WORDS = (100, 250, 1000, 4000, 16000, 64000)


def _corpus() -> list[str]:
    return [
        line
        for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def build_bpe(directory: Path) -> Path:
    """A byte-level BPE (32,000 tokens) trained on the repository's docs, with a template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000, special_tokens=["<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    _write_config(directory, "<s>", "</s>")
    return directory


def _write_config(directory: Path, bos: str, eos: str) -> None:
    config = {"bos_token": bos, "eos_token": eos, "chat_template": _TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _with_template(source: Path, into: Path) -> Path:
    """A copy of a tokenizer directory whose config has a chat template (if it had none)."""
    into.mkdir(parents=True, exist_ok=True)
    (into / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    cfg_path = source / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if (source / "chat_template.jinja").is_file():
        (into / "chat_template.jinja").write_bytes((source / "chat_template.jinja").read_bytes())
    elif not cfg.get("chat_template"):
        cfg["chat_template"] = _TEMPLATE
    (into / "tokenizer_config.json").write_text(json.dumps(cfg))
    return into


def _words(n: int) -> str:
    text = " ".join(_corpus()).split()
    return " ".join(text[i % len(text)] for i in range(n))


def _cpu_us(fn: Callable[[], object], repeats: int) -> list[float]:
    """CPU µs of this thread per call: what a call holds the event loop for when it runs on it
    (thread CPU time, not wall: a busy machine's scheduling delays are not the parse's)."""
    for _ in range(min(10, repeats)):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        fn()
        out.append((time.thread_time_ns() - t0) / 1000)
    return out


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def _hop_cost(repeats: int) -> list[float]:
    def nothing() -> None:
        return None

    for _ in range(20):
        await asyncio.to_thread(nothing)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        await asyncio.to_thread(nothing)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def _parser(path: str, raw: bytes, tok: PromptTokenizer | None) -> Callable[[], ParsedRequest]:
    lookup = (lambda m: tok) if tok is not None else None
    return lambda: parse_request(
        path, raw, models=(MODEL,), max_model_len=None, tokenizer_for=lookup
    )


def _bodies(words: int) -> list[tuple[str, bytes]]:
    text = _words(words)
    chat = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})
    return [("chat", chat), ("completions", orjson.dumps({"model": MODEL, "prompt": text}))]


def measure(name: str, tok: PromptTokenizer, repeats: int) -> list[str]:
    rows = []
    for words in _SIZES_WORDS:
        for endpoint, raw in _bodies(words):
            path = CHAT if endpoint == "chat" else COMPLETIONS
            n = _parser(path, raw, tok)().prompt_tokens
            reps = max(5, repeats * 1000 // max(1000, words))
            exact = _cpu_us(_parser(path, raw, tok), reps)
            estimate = _cpu_us(_parser(path, raw, None), reps)
            p50 = statistics.median(exact)
            rows.append(
                f"| {name} | {endpoint} | {len(raw):,} | {n:,} | {p50:,.0f} | "
                f"{_p(exact, 0.99):,.0f} | {p50 * 1000 / n:,.0f} | "
                f"{statistics.median(estimate):,.0f} |"
            )
    return rows


async def _loop_gaps(directory: Path, raw: bytes, threshold: int, repeats: int) -> list[float]:
    """The event loop's longest waits (ms) while `repeats` chat bodies are parsed through the
    router's own path (router/openai/prompt_tokens.py parse_generation) at `threshold`."""
    settings = settings_from_mapping(
        {"model": MODEL, "estimates": {"tokenizers": {MODEL: str(directory)}}}
    )
    metrics = RouterMetrics()
    await parse_generation(CHAT, raw, settings, (MODEL,), metrics)  # the tokenizer is loaded
    counting.THREAD_ABOVE_BYTES = threshold
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append((now - last) * 1000)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    for _ in range(repeats):
        await parse_generation(CHAT, raw, settings, (MODEL,), metrics)
        await asyncio.sleep(0)  # the ticker runs between parses: a gap is one parse at most
    done.set()
    await task
    return gaps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tokenizer", action="append", default=[], type=Path)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    default_threshold = counting.THREAD_ABOVE_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        targets = [
            (d.name, _with_template(d, t / f"given{i}")) for i, d in enumerate(args.tokenizer)
        ]
        targets.append(
            ("aiperf word-level 6k", _with_template(ROOT / "examples/aiperf/tokenizer", t / "wl"))
        )
        targets.append(("byte-level BPE 32k", build_bpe(t / "bpe")))
        print(
            "| tokenizer | endpoint | body bytes | prompt tokens | exact p50 µs | exact p99 µs | "
            "µs / 1k tokens | estimate p50 µs |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for name, directory in targets:
            for row in measure(name, PromptTokenizer.load(directory), args.repeats):
                print(row)
        hop = asyncio.run(_hop_cost(args.repeats * 5))
        print(
            f"\nasyncio.to_thread round trip, nothing to do: p50 {statistics.median(hop):.0f} µs, "
            f"p99 {_p(hop, 0.99):.0f} µs ({len(hop)} hops)\n"
        )
        name, directory = targets[-1]
        print(f"| event loop, {name}: chat body of | parsed | longest wait ms | p99 wait ms |")
        print("|---|---|---:|---:|")
        for words in (4000, 16000):
            raw = _bodies(words)[0][1]
            for where, threshold in (("on the loop", 1 << 40), ("in a thread", default_threshold)):
                gaps = asyncio.run(_loop_gaps(directory, raw, threshold, 10))
                print(f"| {len(raw):,} bytes | {where} | {max(gaps):.2f} | {_p(gaps, 0.99):.2f} |")
        counting.THREAD_ABOVE_BYTES = default_threshold
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
