"""Exact prompt tokens (router/tokens/): a small real tokenizer built here with the `tokenizers`
library (word level, trained on a few strings: no download), its chat template in
tokenizer_config.json, and the router counting prompts with it as vLLM does.

Each expected count is the tokenizer's encoding of the text the chat template must produce,
written out by hand: the renderer is checked against the template's meaning, not against itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from policies.base import OutputHistograms, RequestInfo
from policies.estimators import MaxTokensEstimator
from router.config import ConfigError, settings_from_mapping
from router.errors import InvalidRequest
from router.metrics import RouterMetrics
from router.openai import prompt_tokens as counting
from router.openai.api import CHAT, COMPLETIONS, parse_request
from router.openai.prompt_tokens import parse_generation, prompt_token_modes
from router.openai.responses_pd import RESPONSES, parse_responses
from router.request.resume import resume_body
from router.tokens.tokenizer import PromptTokenizer
from tests.conftest import MODEL, sim_cluster

T = TypeVar("T")

_CORPUS = [
    "hello world how are you",
    "the quick brown fox jumps over the lazy dog",
    "system user assistant tools : get_weather city",
    "tell me a story about the router and the cache",
    "type function name description parameters object properties string",
]
# Role lines end with the end-of-turn token and a newline; tools, when given, lead as JSON.
_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}tools : {% for t in tools %}{{ t | tojson }} {% endfor %}{{ eos_token }}\n"
    "{% endif %}"
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def _build(directory: Path, *, template: str | None = _TEMPLATE) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated")]
    )
    tok.train_from_iterator(
        _CORPUS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    )
    # Completions get a BOS from the post-processor, as a Llama tokenizer.json has it.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    return _build(tmp_path / "tiny")


@pytest.fixture
def raw_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def _ids(tok: Tokenizer, text: str, special: bool = False) -> tuple[int, ...]:
    return tuple(tok.encode(text, add_special_tokens=special).ids)


def _parse(path: str, body: dict[str, Any], directory: Path | None) -> Any:
    lookup = (lambda m: PromptTokenizer.load(directory)) if directory is not None else None
    raw = orjson.dumps(body)
    if path == RESPONSES:
        return parse_responses(raw, models=(MODEL,), max_model_len=None, tokenizer_for=lookup)
    return parse_request(path, raw, models=(MODEL,), max_model_len=None, tokenizer_for=lookup)


def test_a_completion_text_is_encoded_with_the_tokenizers_special_tokens(
    tokenizer_dir: Path, raw_tokenizer: Tokenizer
) -> None:
    parsed = _parse(
        COMPLETIONS, {"model": MODEL, "prompt": "Hello world, how are you?"}, tokenizer_dir
    )
    want = _ids(raw_tokenizer, "hello world , how are you ?", special=True)
    assert want[0] == raw_tokenizer.token_to_id("<s>") and len(want) == 8
    assert parsed.prompt_token_ids == want and parsed.prompt_tokens == 8
    assert parsed.prompt_tokens_source == "tokenizer"
    off = _parse(
        COMPLETIONS,
        {"model": MODEL, "prompt": ["hello world"], "add_special_tokens": False},
        tokenizer_dir,
    )
    assert off.prompt_token_ids == _ids(raw_tokenizer, "hello world") and off.prompt_tokens == 2


def test_token_id_prompts_are_taken_as_they_are_with_or_without_a_tokenizer(
    tokenizer_dir: Path,
) -> None:
    for directory in (tokenizer_dir, None):
        flat = _parse(COMPLETIONS, {"model": MODEL, "prompt": [5, 6.0, 7]}, directory)
        assert flat.prompt_token_ids == (5, 6, 7) and flat.prompt_tokens == 3
        assert flat.prompt_tokens_source == "token_ids" and flat.body["prompt"] == [5, 6, 7]
        nested = _parse(COMPLETIONS, {"model": MODEL, "prompt": [[9, 8, 7, 6]]}, directory)
        assert nested.prompt_token_ids == (9, 8, 7, 6) and nested.prompt_tokens == 4


def test_a_multi_turn_chat_is_rendered_by_its_template_without_a_second_bos(
    tokenizer_dir: Path, raw_tokenizer: Tokenizer
) -> None:
    messages = [
        {"role": "system", "content": "tell me a story"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
        },
        {"role": "assistant", "content": "the quick brown fox"},
        {"role": "user", "content": "how are you?"},
    ]
    parsed = _parse(CHAT, {"model": MODEL, "messages": messages}, tokenizer_dir)
    text = (
        "<s>system : tell me a story </s>\n"
        "user : hello\nworld </s>\n"  # text parts joined by a newline (vLLM's string format)
        "assistant : the quick brown fox </s>\n"
        "user : how are you? </s>\n"
        "assistant :"
    )
    assert parsed.prompt_token_ids == _ids(raw_tokenizer, text)
    assert parsed.prompt_token_ids.count(raw_tokenizer.token_to_id("<s>")) == 1
    assert parsed.prompt_tokens == len(parsed.prompt_token_ids) == 29
    no_prompt = _parse(
        CHAT, {"model": MODEL, "messages": messages, "add_generation_prompt": False}, tokenizer_dir
    )
    assert no_prompt.prompt_tokens == 29 - 2  # without "assistant :"


def test_continue_final_message_ends_at_the_last_messages_text(
    tokenizer_dir: Path, raw_tokenizer: Tokenizer
) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "the quick"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    parsed = _parse(CHAT, body, tokenizer_dir)
    assert parsed.prompt_token_ids == _ids(
        raw_tokenizer, "<s>user : hello </s>\nassistant : the quick"
    )


def test_a_tools_request_renders_the_tools_as_vllm_hands_them_over(
    tokenizer_dir: Path, raw_tokenizer: Tokenizer
) -> None:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "tools": [tool]}
    parsed = _parse(CHAT, body, tokenizer_dir)
    # The dumped model: description is there (null) though the client left it out, before
    # parameters; the JSON keeps non-ASCII and is not HTML-escaped (Hugging Face's tojson).
    dumped = (
        '{"type": "function", "function": {"name": "get_weather", "description": null, '
        '"parameters": {"type": "object"}}}'
    )
    text = f"<s>tools : {dumped} </s>\nuser : hello </s>\nassistant :"
    assert parsed.prompt_token_ids == _ids(raw_tokenizer, text)
    assert parsed.prompt_tokens > _parse(CHAT, {**body, "tools": None}, tokenizer_dir).prompt_tokens


def test_a_responses_request_is_rendered_as_chat_messages(
    tokenizer_dir: Path, raw_tokenizer: Tokenizer
) -> None:
    body = {"model": MODEL, "instructions": "tell me a story", "input": "hello world"}
    parsed = _parse(RESPONSES, body, tokenizer_dir)
    text = "<s>system : tell me a story </s>\nuser : hello world </s>\nassistant :"
    assert parsed.prompt_token_ids == _ids(raw_tokenizer, text)
    assert parsed.prompt_tokens_source == "tokenizer"
    items = {
        "model": MODEL,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        ],
    }
    assert _parse(RESPONSES, items, tokenizer_dir).prompt_token_ids == _ids(
        raw_tokenizer, "<s>user : hi </s>\nassistant :"
    )


def test_what_cannot_be_rendered_exactly_falls_back_to_the_estimate(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    cases = [
        (CHAT, {"messages": [{"role": "user", "content": [image]}]}, tokenizer_dir),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"},
            tokenizer_dir,
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi"}]},
            _build(tmp_path / "plain", template=None),
        ),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, None),
        (COMPLETIONS, {"prompt": "hello world"}, None),
        (RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f"}]}, tokenizer_dir),
    ]
    for path, body, directory in cases:
        parsed = _parse(path, {"model": MODEL, **body}, directory)
        assert parsed.prompt_token_ids is None and parsed.prompt_tokens_source == "estimate"
        assert parsed.prompt_tokens >= 1


def test_a_resumed_exact_prompt_grows_by_the_tokens_sent(tokenizer_dir: Path) -> None:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 10}
    exact = _parse(COMPLETIONS, body, tokenizer_dir)
    _, tokens, remaining = resume_body(exact, " the quick brown fox jumps", 5, 4.0)
    assert (tokens, remaining) == (exact.prompt_tokens + 5, 5)
    estimated = _parse(COMPLETIONS, body, None)
    _, tokens, _ = resume_body(estimated, "x" * 40, 5, 4.0)
    assert tokens == estimated.prompt_tokens + 10  # 40 characters / 4


def test_a_tokenizer_directory_without_tokenizer_json_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.json"):
        settings_from_mapping({"model": MODEL, "estimates": {"tokenizers": {MODEL: str(tmp_path)}}})


async def test_large_bodies_are_tokenized_off_the_event_loop(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threaded: list[object] = []
    real = asyncio.to_thread

    async def recording(fn: Callable[[], T]) -> T:
        threaded.append(fn)
        return await real(fn)

    monkeypatch.setattr(counting.asyncio, "to_thread", recording)
    settings = settings_from_mapping(
        {"model": MODEL, "estimates": {"tokenizers": {MODEL: str(tokenizer_dir)}}}
    )
    metrics = RouterMetrics()
    small = orjson.dumps({"model": MODEL, "prompt": "hello"})
    await parse_generation(COMPLETIONS, small, settings, (MODEL,), metrics)  # loads: a thread
    assert len(threaded) == 1
    await parse_generation(COMPLETIONS, small, settings, (MODEL,), metrics)  # loaded, small
    assert len(threaded) == 1
    words = " ".join(["hello world"] * (counting.THREAD_ABOVE_BYTES // 10))
    big = orjson.dumps({"model": MODEL, "prompt": words})
    parsed = await parse_generation(COMPLETIONS, big, settings, (MODEL,), metrics)
    assert len(threaded) == 2 and parsed.prompt_tokens == 1 + 2 * (
        counting.THREAD_ABOVE_BYTES // 10
    )
    assert metrics.prompt_tokens_source.labels("tokenizer")._value.get() == 3


class RecordingEstimator(MaxTokensEstimator):
    """Reserves max_tokens (as its parent) and keeps each request's prompt tokens as
    placement saw them: what the decode reservation is sized from (prompt + reserved output)."""

    seen: list[int] = []

    def estimate(self, request: RequestInfo, histograms: OutputHistograms) -> Any:
        if request.model != "smoke":  # the load-time smoke test's probe
            RecordingEstimator.seen.append(request.prompt_tokens)
        return super().estimate(request, histograms)


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def test_the_router_reserves_by_the_exact_count_and_says_so(
    tokenizer_dir: Path, raw_tokenizer: Tokenizer, redis_prefix: str
) -> None:
    RecordingEstimator.seen = []
    # Long words: the character estimate (4 per token) is far above the exact count.
    prompt = "tell me a story about the router and the cache " * 20
    exact = len(_ids(raw_tokenizer, prompt, special=True))
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 4,
    }
    async with (
        sim_cluster(
            redis_prefix=redis_prefix,
            estimates={
                "tokenizers": {MODEL: str(tokenizer_dir)},
                "estimator": f"{__name__}:RecordingEstimator",
            },
        ) as c,
        aiohttp.ClientSession() as s,
    ):
        await _post(
            s, c.router_url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        )
        await _post(s, c.router_url + "/v1/chat/completions", chat)
        await _post(
            s,
            c.router_url + "/v1/completions",
            {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4},
        )
        async with s.get(c.router_url + "/metrics") as resp:
            metrics = await resp.text()
        async with s.get(c.router_url + "/admin/state") as resp:
            state = await resp.json()
    chat_text = "<s>user : hello world </s>\nassistant :"
    assert RecordingEstimator.seen == [exact, len(_ids(raw_tokenizer, chat_text)), 3]
    assert exact < len(prompt) / 4
    assert 'disagg_router_prompt_tokens_source_total{source="tokenizer"} 2.0' in metrics
    assert 'disagg_router_prompt_tokens_source_total{source="token_ids"} 1.0' in metrics
    assert state["prompt_tokens"][MODEL] == {
        "source": "tokenizer",
        "tokenizer_dir": str(tokenizer_dir),
        "loaded": True,
    }


async def test_without_a_tokenizer_the_router_estimates_and_says_so(redis_prefix: str) -> None:
    async with sim_cluster(redis_prefix=redis_prefix) as c, aiohttp.ClientSession() as s:
        await _post(
            s, c.router_url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        )
        async with s.get(c.router_url + "/metrics") as resp:
            metrics = await resp.text()
        async with s.get(c.router_url + "/admin/state") as resp:
            state = await resp.json()
    assert 'disagg_router_prompt_tokens_source_total{source="estimate"} 1.0' in metrics
    assert state["prompt_tokens"][MODEL] == {"source": "estimate", "chars_per_token": 4.0}
    assert (
        prompt_token_modes(settings_from_mapping({"model": MODEL}))[MODEL]["source"] == "estimate"
    )


def test_a_template_that_loops_over_content_gets_parts_and_parsed_tool_arguments(
    tmp_path: Path, raw_tokenizer: Tokenizer
) -> None:
    # vLLM's "openai" content format: a template that loops over a message's content is given
    # every content as a list of text parts, a plain string too; tool-call arguments as objects.
    template = (
        "{% for m in messages %}{{ m.role }} :"
        "{% for p in m.content %} {{ p.text }}{% endfor %}"
        "{% for c in m.tool_calls or [] %} {{ c.function.arguments.city }}{% endfor %}"
        " {{ eos_token }}\n{% endfor %}"
    )
    directory = _build(tmp_path / "parts", template=template)
    call = {"type": "function", "function": {"name": "f", "arguments": '{"city": "hello"}'}}
    messages = [
        {"role": "user", "content": "the quick"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "brown"}, {"type": "text", "text": "fox"}],
        },
    ]
    parsed = _parse(CHAT, {"model": MODEL, "messages": messages}, directory)
    text = "user : the quick </s>\nassistant : hello </s>\nuser : brown fox </s>\n"
    assert parsed.prompt_token_ids == _ids(raw_tokenizer, text)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(["hi", "text", "user", ""]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "tool_calls", "function"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    endpoint=st.sampled_from([CHAT, COMPLETIONS, RESPONSES]),
    fields=st.dictionaries(
        st.sampled_from(
            [
                "messages",
                "prompt",
                "input",
                "tools",
                "continue_final_message",
                "chat_template_kwargs",
            ]
        ),
        _JSON,
        max_size=4,
    ),
)
def test_any_body_is_counted_or_refused_never_an_error(
    tokenizer_dir: Path, endpoint: str, fields: dict[str, Any]
) -> None:
    try:
        parsed = _parse(endpoint, {"model": MODEL, **fields}, tokenizer_dir)
    except InvalidRequest:
        return
    assert parsed.prompt_tokens >= 1


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tokenizer_dir: Path) -> None:
    ids = _parse(
        COMPLETIONS, {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 2}, None
    )
    assert ids.prompt_token_ids == (4, 5) and ids.prompt_tokens == 2
    text = {"model": MODEL, "prompt": "hello world how are you", "truncate_prompt_tokens": 3}
    parsed = _parse(COMPLETIONS, text, tokenizer_dir)
    whole = _parse(COMPLETIONS, {**text, "truncate_prompt_tokens": None}, tokenizer_dir)
    assert parsed.prompt_token_ids == whole.prompt_token_ids[-3:] and parsed.prompt_tokens == 3


# A template of the common shape (Qwen's): tools as JSON, a system message folded in, tool calls
# with their arguments, whitespace control, loop controls.
_TOOLS_TEMPLATE = """{%- if tools %}
    {{- 'system : ' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- endif %}
    {%- for tool in tools %}{{- ' ' }}{{- tool | tojson }}{%- endfor %}
    {{- ' ' + eos_token + '\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- 'system : ' + messages[0]['content'] + ' ' + eos_token + '\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}
    {{- message.role + ' : ' + message.content }}
    {%- for tc in message.tool_calls or [] %}
        {{- ' ' + tc.function.name + ' ' }}{{- tc.function.arguments | tojson }}
    {%- endfor %}
    {{- ' ' + eos_token + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant :' }}{%- endif %}
"""


def test_the_rendering_equals_hugging_faces_apply_chat_template(tmp_path: Path) -> None:
    """The cross-check against the library vLLM renders with (run where transformers is
    installed; the project does not depend on it). Tools are given as vLLM dumps them, so the
    two see the same dicts."""
    transformers = pytest.importorskip("transformers")
    directory = _build(tmp_path / "hf", template=_TOOLS_TEMPLATE)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = _TOOLS_TEMPLATE
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "the wéather", "parameters": None},
    }
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"city": "x"}'}}
    cases = [
        {"messages": [{"role": "system", "content": "tell me"}, {"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hello"}], "tools": [tool]},
        {
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "1"},
            ],
            "tools": [tool],
        },
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a "}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ]
    for body in cases:
        ours = _parse(CHAT, {"model": MODEL, **body}, directory).prompt_token_ids
        messages = [
            {
                **m,
                "tool_calls": [
                    {**call, "function": {**call["function"], "arguments": {"city": "x"}}}
                ],
            }
            if m.get("tool_calls")
            else m
            for m in body["messages"]
        ]
        text = hf.apply_chat_template(
            messages,
            tools=body.get("tools"),
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
        )
        assert ours == tuple(hf(text, add_special_tokens=False)["input_ids"]), text
