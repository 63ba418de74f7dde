"""One served model's tokenizer: a validated request body in, its prompt token ids out, per
endpoint, as vLLM builds them.

    completions  the text encoded with the tokenizer's special tokens (its post-processor adds
                 a BOS where the model wants one), unless the request says
                 `add_special_tokens: false`; token-id prompts are not tokenized at all
                 (router/openai/api.py takes them as they are)
    chat         the chat template rendered (router/tokens/template.py), then encoded without
                 special tokens (the template already wrote them), unless the request says
                 `add_special_tokens: true`
    responses    `instructions` as a system message and the `input` items as messages, then as
                 chat; tools, function-call items and a previous response are not rendered

`None` means "not exactly": the caller uses the character estimate (a request-supplied
`chat_template`, a part that is not text, a template error).

The directory is a Hugging Face model directory, or any with the same files: `tokenizer.json`
(required), `tokenizer_config.json` (the special tokens, and the chat template in older
layouts) and `chat_template.jinja` (the chat template as transformers saves it now).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Tokenizer

from router.tokens.template import ChatTemplate, NotRenderable

__all__ = ["GIL_FREE_ABOVE_CHARS", "PromptTokenizer"]

# Longer texts are encoded through `encode_batch`, which lets go of the GIL while Rust works
# (`encode` holds it throughout: a thread running it would still stall the event loop). Below
# this its extra fixed cost (~0.1 ms) is more than it saves (docs/benchmarks-overhead.md).
GIL_FREE_ABOVE_CHARS = 1024

_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(directory: Path, config: dict[str, Any], tools: bool) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers picks "tool_use" for tools
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("tool_use") if tools and "tool_use" in named else named.get("default")
    return source if isinstance(source, str) else None


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM hands them to the template: its pydantic model dumped, so a
    function's `description` and `parameters` are there (null) even when the client left them
    out, in that order, followed by whatever else the client sent."""
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise NotRenderable("a tool is not a function tool")
        fn = tool["function"]
        dumped = {"name": fn.get("name"), "description": fn.get("description")}
        dumped["parameters"] = fn.get("parameters")
        dumped.update((k, v) for k, v in fn.items() if k not in dumped)
        out.append({"type": tool.get("type", "function"), "function": dumped})
    return out


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    if body.get("tools") or body.get("previous_response") is not None:
        raise NotRenderable("Responses tools and previous responses are not rendered here")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        return [*messages, {"role": "user", "content": raw}]
    for item in raw or ():
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise NotRenderable("a Responses input item that is not a message")
        if not isinstance(item.get("role"), str):
            raise NotRenderable("a Responses message without a role")
        messages.append({"role": item["role"], "content": item.get("content")})
    return messages


@dataclass(frozen=True, slots=True)
class PromptTokenizer:
    directory: Path
    tokenizer: Tokenizer
    config: dict[str, Any]  # tokenizer_config.json ({} when there is none)
    template: ChatTemplate | None
    tool_template: ChatTemplate | None  # a named "tool_use" template, else the same as template

    def __repr__(self) -> str:
        return f"PromptTokenizer({str(self.directory)!r})"

    @classmethod
    def load(cls, directory: str | Path) -> PromptTokenizer:
        """Read a model directory (raises OSError or ValueError when it is not one)."""
        d = Path(directory)
        tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        config_path = d / "tokenizer_config.json"
        config = orjson.loads(config_path.read_bytes()) if config_path.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_path} is not a JSON object")
        special: dict[str, Any] = {}
        for name in _SPECIAL_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                special[name] = text
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [_token_text(t) for t in extra]
        plain, tool = _template_source(d, config, False), _template_source(d, config, True)
        template = ChatTemplate(plain, special) if plain is not None else None
        tool_template = template if tool == plain else ChatTemplate(tool, special) if tool else None
        return cls(d, tokenizer, config, template, tool_template)

    def encode(self, text: str, *, add_special_tokens: bool) -> tuple[int, ...]:
        if len(text) > GIL_FREE_ABOVE_CHARS:
            batch = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
            return tuple(batch[0].ids)
        return tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def completion_ids(self, body: dict[str, Any]) -> tuple[int, ...] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        special = body.get("add_special_tokens", True) is not False  # vLLM's default: true
        return self.encode(prompt, add_special_tokens=special)

    def chat_ids(self, body: dict[str, Any]) -> tuple[int, ...] | None:
        if body.get("chat_template") is not None:
            return None  # the request brings its own template: the worker decides whether to use it
        try:
            return self._chat_ids(body["messages"], body, _chat_tools(body.get("tools")))
        except NotRenderable:
            return None

    def responses_ids(self, body: dict[str, Any]) -> tuple[int, ...] | None:
        try:
            return self._chat_ids(_responses_messages(body), {}, None)
        except NotRenderable:
            return None

    def _chat_ids(
        self,
        messages: list[dict[str, Any]],
        body: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> tuple[int, ...]:
        template = self.tool_template if tools else self.template
        if template is None:
            raise NotRenderable("the model has no chat template")
        kwargs = body.get("chat_template_kwargs")
        continue_final = body.get("continue_final_message") is True
        text = template.render(
            messages,
            tools=tools,
            documents=body.get("documents"),
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=continue_final,
            kwargs=kwargs if isinstance(kwargs, dict) else None,
        )
        return self.encode(text, add_special_tokens=body.get("add_special_tokens") is True)
