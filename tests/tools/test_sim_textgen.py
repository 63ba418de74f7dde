"""The toy model's contract: deterministic, resumable, and countable like the router counts."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_tools.sim import textgen
from disagg_tools.sim.textgen import (
    VOCAB,
    advance,
    context_state,
    count_prompt_tokens,
    expected_answer,
    generate,
    is_natural_end,
    next_token,
    prompt_context,
)

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def test_vocabulary_is_distinct_short_lowercase_words() -> None:
    assert len(VOCAB) == len(set(VOCAB)) == 512
    assert all(w.isalpha() and w.islower() and len(w) <= 6 for w in VOCAB)


def test_generation_is_deterministic_and_context_dependent() -> None:
    a = generate("Hello there", 50, mean_tokens=0)
    assert a == generate("Hello there", 50, mean_tokens=0)
    assert a != generate("Hello where", 50, mean_tokens=0)
    tokens, reason = a
    assert reason == "length" and len(tokens) == 50
    assert all(t.startswith(" ") and t[1:] in VOCAB for t in tokens)


def test_whitespace_is_not_part_of_the_state() -> None:
    assert context_state("a  b\n\tc ") == context_state("a b c")
    toks, _ = generate("x y", 5, mean_tokens=0)
    assert context_state("x y" + "".join(toks)) == advance(context_state("x y"), toks)


@settings(max_examples=60, deadline=None)
@given(
    ctx=st.text(max_size=40),
    n=st.integers(min_value=1, max_value=60),
    data=st.data(),
)
def test_resume_continues_exactly(ctx: str, n: int, data: st.DataObject) -> None:
    full, reason = generate(ctx, n, mean_tokens=16)
    k = data.draw(st.integers(min_value=0, max_value=len(full) - 1))
    rest, rest_reason = generate(ctx + "".join(full[:k]), n - k, mean_tokens=16, already=k)
    assert full[:k] + rest == full
    assert rest_reason == reason


@pytest.mark.parametrize("natural", [1, 7, 40])
def test_natural_tokens_override_and_resume(natural: int) -> None:
    full, reason = generate("replay me", 100, natural_tokens=natural)
    assert len(full) == natural and reason == "stop"
    k = natural // 2
    rest, rest_reason = generate(
        "replay me" + "".join(full[:k]), 100 - k, natural_tokens=natural, already=k
    )
    assert full[:k] + rest == full and rest_reason == "stop"
    capped, capped_reason = generate("replay me", 3, natural_tokens=natural)
    assert capped == full[:3]
    assert capped_reason == ("stop" if natural <= 3 else "length")


def test_natural_tokens_always_give_at_least_one_more_token() -> None:
    toks, reason = generate("ctx", 10, natural_tokens=4, already=9)
    assert len(toks) == 1 and reason == "stop"


def test_natural_lengths_have_the_configured_mean() -> None:
    lengths = [len(generate(f"prompt number {i}", 10_000, mean_tokens=20)[0]) for i in range(600)]
    assert 15 < statistics.mean(lengths) < 25
    assert min(lengths) >= 1


def test_natural_end_edge_means() -> None:
    assert is_natural_end(12345, 1)
    assert not any(is_natural_end(s, 0) for s in range(100))
    tok, state = next_token(0)
    assert tok[1:] in VOCAB and state == context_state(tok)


def test_chat_rendering_strings_and_parts() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Hi "},
                    {"type": "image_url"},
                    {"type": "text", "text": "there"},
                ],
            },
        ]
    }
    assert prompt_context(CHAT, body) == (
        "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    )


def test_chat_continue_final_message_resumes_the_answer() -> None:
    user = {"role": "user", "content": "Tell me a story"}
    body = {"messages": [user], "max_tokens": 30, "ignore_eos": True}
    text, n, reason = expected_answer(CHAT, body)
    assert n == 30 and reason == "length"
    toks, _ = generate(prompt_context(CHAT, body), 30, mean_tokens=0)
    partial = "".join(toks[:12])
    resumed = {
        "messages": [user, {"role": "assistant", "content": partial}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 18,
        "ignore_eos": True,
    }
    assert prompt_context(CHAT, resumed).endswith("<|assistant|>\n" + partial)
    rest, m, rest_reason = expected_answer(CHAT, resumed)
    assert partial + rest == text and m == 18 and rest_reason == "length"


def test_completion_prompt_forms() -> None:
    assert prompt_context(COMPL, {"prompt": "abc"}) == "abc"
    assert prompt_context(COMPL, {"prompt": ["abc"]}) == "abc"
    assert prompt_context(COMPL, {"prompt": [1, 22, 333]}) == "t1 t22 t333"
    assert prompt_context("/generate", {"text": "sg"}) == "sg"
    for bad in ({}, {"prompt": ["a", "b"]}, {"prompt": 5}, {"prompt": [1, "x"]}):
        with pytest.raises(ValueError):
            prompt_context(COMPL, bad)


def test_prompt_token_count_rule() -> None:
    assert count_prompt_tokens(COMPL, {"prompt": [5, 6, 7]}) == 3
    assert count_prompt_tokens(COMPL, {"prompt": ""}) == 1
    assert count_prompt_tokens(COMPL, {"prompt": "abcd"}) == 1
    assert count_prompt_tokens(COMPL, {"prompt": "abcde"}) == 2
    body = {"messages": [{"role": "user", "content": "hi"}]}
    rendered = prompt_context(CHAT, body)
    assert count_prompt_tokens(CHAT, body) == (len(rendered) + 3) // 4


def test_expected_answer_limits_and_headers() -> None:
    body = {"prompt": "x" * 40, "max_tokens": 5, "max_completion_tokens": 3, "ignore_eos": True}
    assert expected_answer(COMPL, body)[1:] == (3, "length")
    replay = {"prompt": "x", "max_tokens": 100}
    assert expected_answer(COMPL, replay, {"x-sim-output-tokens": "9"})[1:] == (9, "stop")
    resumed = expected_answer(
        COMPL, replay, {"X-Sim-Output-Tokens": "9", "X-Resumed-Output-Tokens": "4"}
    )
    assert resumed[1:] == (5, "stop")
    # ignore_eos beats the replay header: generate to max_tokens.
    assert expected_answer(COMPL, {**replay, "ignore_eos": True}, {"X-Sim-Output-Tokens": "9"})[
        1:
    ] == (100, "length")
    # No max_tokens: the rest of the context window.
    text, n, reason = expected_answer(
        COMPL, {"prompt": "x" * 400, "ignore_eos": True}, max_model_len=164
    )
    assert (n, reason) == (64, "length")


def test_requests_vllm_would_refuse_raise_value_error() -> None:
    with pytest.raises(ValueError, match="maximum context length"):
        expected_answer(COMPL, {"prompt": "x" * 400, "max_tokens": 100}, max_model_len=150)
    with pytest.raises(ValueError):
        expected_answer(COMPL, {"prompt": "x", "max_tokens": 0})
    with pytest.raises(ValueError):
        expected_answer(COMPL, {"prompt": "x"}, {"X-Sim-Output-Tokens": "many"})
    with pytest.raises(ValueError):
        expected_answer(CHAT, {"messages": []})
    assert textgen.DEFAULT_MAX_MODEL_LEN == 131_072
