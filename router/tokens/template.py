"""A model's chat template, rendered the way Hugging Face's `apply_chat_template` renders it for
vLLM's chat endpoint, so the text the router tokenizes is the text the engine tokenizes.

What is matched, and why each matters to the count:
- the jinja2 environment: sandboxed, `trim_blocks` and `lstrip_blocks` (whitespace around tags is
  not in the prompt), the loop controls, a `tojson` that keeps non-ASCII text as it is, and the
  `raise_exception` / `strftime_now` globals templates call;
- the variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
  (`bos_token`, `eos_token`, ...) and the request's `chat_template_kwargs`;
- the messages as vLLM hands them over: text parts joined with a newline when the template
  reads `content` as a string, kept as `{"type": "text"}` parts when it loops over them;
  a missing content is empty; a tool call's JSON `arguments` are parsed into an object;
- `continue_final_message`: the rendered text ends where the last message's text ends.

Anything the router cannot render exactly (images, audio, a part it does not know) raises
`NotRenderable`, and the caller falls back to the character estimate.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "NotRenderable"]

# Parts whose text reaches the prompt (chat's and the Responses API's names for them).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
# A loop over a message's content (`for part in message['content']`, `... in m.content`): vLLM
# then passes the parts as a list (its "openai" content format), else one joined string.
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+\s*(?:\[\s*['\"]content['\"]\s*\]|\.content)"
)
# Message keys the template may read besides role and content.
_MESSAGE_EXTRAS = ("name", "tool_call_id", "tool_calls", "reasoning_content", "reasoning")


class NotRenderable(Exception):
    """This request's prompt cannot be rendered exactly here (the estimate is used)."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's own filter: jinja2's built-in escapes HTML and sorts keys, which would
    # change the text (and the count) of every template that serializes tools.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise NotRenderable(f"the chat template refused the request: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_texts(i: int, content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):  # a Responses item is not validated before it comes here
        raise NotRenderable(f"messages[{i}].content is neither text nor parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise NotRenderable(f"messages[{i}] has a {kind!r} part")
        texts.append(part["text"])
    return texts


def _tool_calls(calls: Any) -> Any:
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            # vLLM parses the arguments before rendering: templates print them as an object.
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass
        out.append(call)
    return out


class ChatTemplate:
    """One model's compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from exc
        self._special = dict(special_tokens)
        self.content_as_parts = bool(_LOOPS_OVER_CONTENT.search(source))

    def __repr__(self) -> str:
        return f"ChatTemplate(content_as_parts={self.content_as_parts})"

    def messages(self, raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as vLLM passes them to the template."""
        out = []
        for i, msg in enumerate(raw):
            texts = _content_texts(i, msg.get("content"))
            content: Any = (
                [{"type": "text", "text": t} for t in texts]
                if self.content_as_parts
                else "\n".join(texts)
            )
            m: dict[str, Any] = {"role": msg["role"], "content": content}
            for key in _MESSAGE_EXTRAS:
                if msg.get(key) is not None:
                    m[key] = msg[key]
            if "tool_calls" in m:
                m["tool_calls"] = _tool_calls(m["tool_calls"])
            out.append(m)
        return out

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text (raises NotRenderable when the template or the request refuses)."""
        if add_generation_prompt and continue_final_message:
            raise NotRenderable("add_generation_prompt and continue_final_message together")
        conversation = self.messages(messages)
        variables = {**self._special, **(kwargs or {})}
        try:
            text = self._template.render(
                messages=conversation,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except NotRenderable:
            raise
        except Exception as exc:  # a template's own error: the engine answers it, not us
            raise NotRenderable(f"the chat template failed: {exc}") from exc
        if continue_final_message:
            final = _content_texts(len(messages) - 1, messages[-1].get("content"))
            text = _cut_after_final(text, final)
        return text


def _cut_after_final(text: str, final_texts: list[str]) -> str:
    """The rendered chat up to the end of the last message's text (whatever the template puts
    after a message, the end-of-turn token above all, is not there: the model continues it)."""
    if not final_texts:
        raise NotRenderable("continue_final_message needs a final message with text")
    final = final_texts[-1]
    at = text.rfind(final.strip())
    if at < 0:
        raise NotRenderable("the final message is not in the rendered chat")
    if text[at : at + len(final.lstrip())] == final.lstrip():
        return text[: at + len(final.lstrip())]  # the template kept the message's spacing
    return text[: at + len(final.strip())]
