"""The demo tokenizer (disagg_tools/launcher/demo_tokenizer.py) and the sim's `--tokenizer DIR`
(disagg_tools/sim/kv_events.py): the router (router.tokens, settings `tokenizers`) and the
simulated workers name a text prompt's tokens, hence its KV blocks, by the same ids, so the
router places chat and completions traffic on the workers' KV events (issue 22).

Real tokenizers (the `tokenizers` library), real sim workers on loopback sockets, a real router
and Redis; no mocks.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from disagg_tools.launcher.demo_tokenizer import UNK, build_demo_tokenizer, demo_vocab
from disagg_tools.sim import textgen
from disagg_tools.sim.kv_events import load_tokenizer, prompt_token_ids
from disagg_tools.sim.worker import (
    add_worker_arguments,
    config_from_args,
)
from disagg_tools.traces import TraceRequest, prompt_text
from router.tokens.tokenizer import PromptTokenizer
from tests.conftest import MODEL
from tests.router.workers.test_kv_events import kv_cluster, until

BS = 16  # the sim's block size
CHAT, COMPLETIONS = textgen.CHAT_PATH, textgen.COMPLETIONS_PATH


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_tokenizer(tmp_path_factory.mktemp("demo-tokenizer"))


def _trace_prompt(index: int, tokens: int, hashes: tuple[int, ...] = ()) -> str:
    req = TraceRequest(
        arrival_s=0.0, prompt_tokens=tokens, output_tokens=8, prefix_hash_ids=hashes, index=index
    )
    return prompt_text(req)


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    """Chat and completions bodies of trace prompts: one turn, several turns with the sim's own
    answers between them, a system prompt, text parts, shared prefix blocks."""
    a, b, c = _trace_prompt(1, 300), _trace_prompt(2, 57), _trace_prompt(3, 1, (4, 5))
    shared = _trace_prompt(4, 700, (11, 12))  # two hashed blocks, cut to fit
    turn1 = [{"role": "user", "content": a}]
    answer, _, _ = textgen.expected_answer(
        CHAT, {"messages": turn1, "max_tokens": 40}, mean_tokens=0
    )
    multi = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": b}]
    parts = [{"type": "text", "text": b}, {"type": "text", "text": c}]
    return [
        (CHAT, {"model": MODEL, "messages": turn1}),
        (CHAT, {"model": MODEL, "messages": multi}),
        (CHAT, {"model": MODEL, "messages": [{"role": "system", "content": c}, *multi]}),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": parts}]}),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": shared}]}),
        (COMPLETIONS, {"model": MODEL, "prompt": a}),
        (COMPLETIONS, {"model": MODEL, "prompt": [shared]}),
        (COMPLETIONS, {"model": MODEL, "prompt": c}),
    ]


def _router_ids(tok: PromptTokenizer, path: str, body: dict[str, Any]) -> tuple[int, ...] | None:
    return tok.chat_ids(body) if path == CHAT else tok.completion_ids(body)


def test_rebuilding_the_demo_tokenizer_writes_the_same_bytes(tmp_path: Path) -> None:
    one, two = build_demo_tokenizer(tmp_path / "one"), build_demo_tokenizer(tmp_path / "two")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    build_demo_tokenizer(one)  # over an existing directory: the same again
    assert (one / "tokenizer.json").read_bytes() == (two / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("case", range(len(_bodies())))
def test_the_router_and_the_sim_give_a_prompt_the_same_token_ids(demo_dir: Path, case: int) -> None:
    path, body = _bodies()[case]
    router = _router_ids(PromptTokenizer.load(demo_dir), path, body)
    sim = prompt_token_ids(path, body, load_tokenizer(demo_dir))
    assert router is not None  # exact: the template rendered, the text encoded
    assert list(router) == sim
    vocab = demo_vocab()
    assert vocab[UNK] not in sim  # every word of the demo's prompts is in the vocabulary
    if (
        path == COMPLETIONS
        or len(body["messages"]) == 1
        and isinstance(body["messages"][0]["content"], str)
    ):
        # Trace words are 4 characters a token: the sim's usage count (the character
        # estimate, kept as it is) and the router's exact count agree.
        assert len(sim) == textgen.count_prompt_tokens(path, body)


def test_the_chat_template_renders_the_sims_text(demo_dir: Path) -> None:
    tok = PromptTokenizer.load(demo_dir)
    assert tok.template is not None
    for path, body in _bodies():
        if path == CHAT:
            rendered = tok.template.render(body["messages"])
            assert rendered == textgen.prompt_context(path, body)
    # continue_final_message on an assistant turn: the router cuts where the sim stops.
    messages = [
        {"role": "user", "content": _trace_prompt(5, 20)},
        {"role": "assistant", "content": " bada"},
    ]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    assert list(tok.chat_ids(body) or ()) == prompt_token_ids(CHAT, body, load_tokenizer(demo_dir))


def test_without_a_tokenizer_the_ids_are_as_before(demo_dir: Path) -> None:
    body = {"messages": [{"role": "user", "content": "hello there"}]}
    text = textgen.prompt_context(CHAT, body)
    crc = [zlib.crc32(text[i : i + 4].encode()) % 32_000 for i in range(0, len(text), 4)]
    assert prompt_token_ids(CHAT, body) == crc
    # Token-id prompts are their own ids, with the tokenizer or without.
    ids = {"prompt": [5, 6, 7]}
    assert prompt_token_ids(COMPLETIONS, ids, load_tokenizer(demo_dir)) == [5, 6, 7]
    assert prompt_token_ids(COMPLETIONS, {"prompt": [[8, 9]]}, load_tokenizer(demo_dir)) == [8, 9]


def test_the_worker_flag(demo_dir: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert config_from_args(parser.parse_args([])).tokenizer is None
    cfg = config_from_args(parser.parse_args(["--tokenizer", str(demo_dir)]))
    assert cfg.tokenizer == str(demo_dir)
    with pytest.raises(Exception):  # noqa: B017 - the Rust parser raises its own error type
        load_tokenizer(demo_dir / "missing")


# --- through the router -------------------------------------------------------------------------

# Two prefill and one decode sim worker naming text prompts with the demo tokenizer, and a router
# counting prompts with the same directory (tests/router/workers/test_kv_events.py kv_cluster).
ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode"}


async def _chat(s: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        answer: str = (await r.json())["choices"][0]["message"]["content"]
    return answer


async def test_a_chat_follow_up_is_placed_on_the_holder_of_its_first_turn(
    redis_prefix: str, demo_dir: Path
) -> None:
    """Text chat through the router: the workers' caches hold the blocks the router names for
    the first turn, and the second turn (the first, the sim's answer, a new question) is
    prefilled on the prefill worker that holds the first."""
    tok = PromptTokenizer.load(demo_dir)
    async with (
        kv_cluster(redis_prefix, roles=ROLES, tokenizer=demo_dir) as c,
        aiohttp.ClientSession() as s,
    ):
        turn1 = [{"role": "user", "content": _trace_prompt(21, 960)}]
        answer = await _chat(s, c.router_url, turn1)
        ids1 = tok.chat_ids({"messages": turn1})
        assert ids1 is not None and len(ids1) == 966  # 960 words and the markers' 6 pieces
        full = len(ids1) // BS
        holders = [w for w in ("p0", "p1") if len(await c.cache(w)) == full]
        assert len(holders) == 1, {w: len(await c.cache(w)) for w in ("p0", "p1")}
        for w in ("p0", "p1", "d0"):
            await c.wait_equal(w)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": _trace_prompt(22, 40)},
        ]
        ids2 = tok.chat_ids({"messages": turn2})
        assert ids2 is not None and ids2[: full * BS] == ids1[: full * BS]
        view = c.parts.pools.placement.snapshot(prompt_token_ids=ids2)
        assert {p.worker_id: p.cached_prefix_tokens for p in view.prefill} == {
            w: (full * BS if w in holders else 0) for w in ("p0", "p1")
        }
        assert [d.cached_prefix_tokens for d in view.decode] == [full * BS]
        for w in ("p0", "p1"):
            async with s.delete(c.urls[w] + "/sim/requests") as r:
                assert r.status == 204
        await _chat(s, c.router_url, turn2)
        got = {w: await c.sim(w, "/sim/requests") for w in ("p0", "p1")}
        assert [w for w, reqs in got.items() if reqs] == holders, (got, holders)

        async def all_equal() -> bool:
            caches = [await c.cache(w) for w in ("p0", "p1", "d0")]
            return [c.index(w) for w in ("p0", "p1", "d0")] == caches

        await until(all_equal, "every index equals its worker's cache after turn 2")
        async with s.get(c.router_url + "/admin/state") as r:
            state = await r.json()
        assert {w["id"]: w["prefix_cache"]["source"] for w in state["workers"]} == dict.fromkeys(
            ("p0", "p1", "d0"), "events"
        )
        assert state["prompt_tokens"][MODEL]["source"] == "tokenizer"
        assert state["prompt_tokens"][MODEL]["loaded"] is True
