"""The interface the generation path formats an answer through, whatever API it speaks.

Three classes implement it: `openai_format.AnswerFormat` (vLLM's OpenAI shapes),
`sglang_protocol.SglangFormat` (SGLang's `/generate`) and `extra_endpoints.ResponsesFormat`
(the Responses API). `sim.generation` picks the class per request and then only calls what is
declared here, so a fourth API is one more class, checked against this protocol.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["AnswerShapes", "AnswerShapesClass"]


class AnswerShapes(Protocol):
    """One request's answer: its stream events, or the whole non-streaming object."""

    @property
    def stream(self) -> bool:
        """Whether the client asked for a stream."""
        ...

    def role_event(self) -> bytes:
        """What a stream opens with, before the first token (may be empty)."""
        ...

    def events(self, tok: str, finish: str | None, sent: int) -> bytes:
        """Bytes for one produced token (`sent` counts it); with the stream's tail when
        `finish` ends it."""
        ...

    def full(
        self,
        text: str,
        finish: str,
        completion_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming answer object (JSON)."""
        ...


class AnswerShapesClass(Protocol):
    """How a request's `AnswerShapes` is made: the constructor the three classes share."""

    def __call__(
        self, path: str, request_id: str, model: str, prompt_tokens: int, body: dict[str, Any]
    ) -> AnswerShapes: ...
