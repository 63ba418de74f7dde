"""The simulated workers' "model": a deterministic greedy toy language model.

The next token is a pure function of the whole context (folded into a 32-bit state), so a
resumed request — prompt plus the tokens already generated — continues exactly as the original
would have, like greedy decoding of a real model. Tests use `expected_answer` to check that an
answer arrived exactly right, with no token repeated or lost across a resume.

    text ──split()──> crc32 fold ──> state ──next_token──> (" word", state')
                                       └──is_natural_end──> EOS after this token?

Whitespace is not part of the state (only `text.split()` is folded), and every generated token
is `" " + word`, hence `context_state(ctx + "".join(toks)) == advance(context_state(ctx), toks)`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

__all__ = [
    "VOCAB",
    "DEFAULT_MAX_MODEL_LEN",
    "AnswerSpec",
    "prompt_context",
    "count_prompt_tokens",
    "context_state",
    "advance",
    "next_token",
    "is_natural_end",
    "iter_tokens",
    "generate",
    "answer_spec",
    "expected_answer",
    "expected_choice",
]

DEFAULT_MAX_MODEL_LEN = 131_072
CHARS_PER_TOKEN = 4  # the router estimates prompt length with the same rule
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
SGLANG_PATH = "/generate"
_SEP = b"\x1f"
_MASK64 = (1 << 64) - 1
_EOS_SALT = 0x5EED_E05


def _build_vocab(size: int = 512) -> tuple[str, ...]:
    # Two-syllable words; stepping by a number coprime with 70*70 picks `size` distinct ones
    # spread over the whole syllable table instead of 512 words that all start with "ba".
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = [a + b for a in syllables for b in syllables]
    return tuple(words[(i * 2377) % len(words)] for i in range(size))


VOCAB: tuple[str, ...] = _build_vocab()


def _mix64(x: int) -> int:
    """splitmix64 finaliser: crc32 states are not uniform enough to index or threshold directly."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _fold(word: str, state: int) -> int:
    return zlib.crc32(word.encode() + _SEP, state)


def context_state(text: str) -> int:
    """The model's state after reading `text` (whitespace-separated tokens, whitespace ignored)."""
    state = 0
    for tok in text.split():
        state = _fold(tok, state)
    return state


def advance(state: int, tokens: Sequence[str]) -> int:
    """The state after appending generated `tokens` (or any text pieces) to a context."""
    for piece in tokens:
        for tok in piece.split():
            state = _fold(tok, state)
    return state


def next_token(state: int) -> tuple[str, int]:
    """Greedy next token for `state`: (token text with its leading space, new state)."""
    word = VOCAB[_mix64(state) % len(VOCAB)]
    return " " + word, _fold(word, state)


def is_natural_end(state: int, mean_tokens: int) -> bool:
    """Whether the model emits EOS after reaching `state`; fires with probability 1/mean_tokens.

    A salted, independent hash of the state, so natural lengths are geometric with that mean and a
    resumed request ends exactly where the original would have. `mean_tokens <= 0` never ends.
    """
    if mean_tokens <= 0:
        return False
    if mean_tokens == 1:
        return True
    return _mix64(state ^ _EOS_SALT) * mean_tokens < (1 << 64)


def iter_tokens(
    state: int,
    max_tokens: int,
    mean_tokens: int = 128,
    natural_tokens: int | None = None,
    already: int = 0,
) -> Iterator[tuple[str, str | None]]:
    """Yield (token, finish_reason) pairs; finish_reason is None except on the last token.

    `natural_tokens` (trace replay) overrides the hash EOS: the answer's total natural length,
    of which `already` tokens came before a resume. A natural end on the same token that hits
    `max_tokens` reports "stop", as an EOS sampled at the last allowed position would.
    """
    if max_tokens <= 0:
        return
    budget = None if natural_tokens is None else max(1, natural_tokens - already)
    n = 0
    while True:
        tok, state = next_token(state)
        n += 1
        if budget is not None:
            natural = n >= budget
        else:
            natural = is_natural_end(state, mean_tokens)
        if natural:
            yield tok, "stop"
            return
        if n >= max_tokens:
            yield tok, "length"
            return
        yield tok, None


def generate(
    context: str,
    max_tokens: int,
    mean_tokens: int = 128,
    natural_tokens: int | None = None,
    already: int = 0,
) -> tuple[list[str], str]:
    """The greedy answer to `context`: its tokens and finish reason ("length" or "stop")."""
    tokens: list[str] = []
    reason = "length"
    for tok, finish in iter_tokens(
        context_state(context), max_tokens, mean_tokens, natural_tokens, already
    ):
        tokens.append(tok)
        if finish is not None:
            reason = finish
    return tokens, reason


# --- requests -> contexts ------------------------------------------------------------------


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise ValueError("message content parts must be objects")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError("a text content part needs a string 'text'")
                parts.append(text)
        return "".join(parts)
    raise ValueError("message content must be a string or a list of parts")


def _chat_context(body: Mapping[str, object]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    rendered = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError("each message needs a string 'role'")
        rendered.append((msg["role"], _content_text(msg.get("content"))))
    if body.get("continue_final_message"):
        # The assistant's partial answer is continued: no newline, no new generation prompt.
        *head, (_, last_text) = rendered
        return "".join(f"<|{r}|>\n{t}\n" for r, t in head) + "<|assistant|>\n" + last_text
    return "".join(f"<|{r}|>\n{t}\n" for r, t in rendered) + "<|assistant|>\n"


def _is_token_ids(value: object) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    )


def _completion_prompt(body: Mapping[str, object]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        (only,) = prompt
        if isinstance(only, str):
            return only
        if _is_token_ids(only):
            return only
    raise ValueError("'prompt' must be a string, a list of token ids, or a list of one string")


def prompt_context(path: str, body: Mapping[str, object]) -> str:
    """The text the model reads for a request (chat rendered with a simple template)."""
    if path == CHAT_PATH:
        return _chat_context(body)
    if path == COMPLETIONS_PATH:
        prompt = _completion_prompt(body)
        if isinstance(prompt, list):
            return " ".join(f"t{i}" for i in prompt)
        return prompt
    if path == SGLANG_PATH:
        text = body.get("text")
        if not isinstance(text, str):
            raise ValueError("'text' must be a string")
        return text
    raise ValueError(f"unsupported path {path!r}")


def count_prompt_tokens(path: str, body: Mapping[str, object]) -> int:
    """Prompt length in tokens: the count of token ids, else 4 characters per token."""
    if path == COMPLETIONS_PATH:
        prompt = _completion_prompt(body)
        if isinstance(prompt, list):
            return len(prompt)
        return _text_tokens(prompt)
    return _text_tokens(prompt_context(path, body))


def _text_tokens(text: str) -> int:
    return max(1, (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN)


# --- the whole answer ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AnswerSpec:
    """Everything that decides a request's answer, parsed and validated once."""

    context: str
    prompt_tokens: int
    max_tokens: int
    mean_tokens: int  # 0 = no natural end (ignore_eos)
    natural_tokens: int | None
    already: int
    n: int = 1  # choices (the request's `n`)
    seed: int | None = None

    @property
    def state(self) -> int:
        return context_state(self.context)

    def tokens(self, choice: int = 0) -> Iterator[tuple[str, str | None]]:
        """Choice 0 is the greedy answer (the one an n=1 request gets); each other choice
        starts from the state with its index and the seed folded in, so the n choices differ
        from each other and are the same for the same request and seed (as vLLM seeds choice
        i with seed + i)."""
        state = self.state
        if choice:
            state = _fold(f"choice {choice} seed {self.seed}", state)
        return iter_tokens(
            state, self.max_tokens, self.mean_tokens, self.natural_tokens, self.already
        )


def _header(headers: Mapping[str, str] | None, name: str) -> str | None:
    if not headers:
        return None
    value = headers.get(name)
    if value is None:
        lowered = name.lower()
        for key, val in headers.items():
            if key.lower() == lowered:
                return val
    return value


def _int_header(headers: Mapping[str, str] | None, name: str) -> int | None:
    raw = _header(headers, name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"header {name} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"header {name} must not be negative")
    return value


def _optional_positive_int(body: Mapping[str, object], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"'{key}' must be a positive integer")
    return value


def answer_spec(
    path: str,
    body: Mapping[str, object],
    headers: Mapping[str, str] | None = None,
    mean_tokens: int = 128,
    max_model_len: int | None = None,
) -> AnswerSpec:
    """Parse a request into its AnswerSpec; raises ValueError for a request vLLM would refuse."""
    max_model_len = max_model_len or DEFAULT_MAX_MODEL_LEN
    context = prompt_context(path, body)
    prompt_tokens = count_prompt_tokens(path, body)
    resumed = _int_header(headers, "X-Resumed-Output-Tokens") or 0
    if path == CHAT_PATH and resumed and body.get("continue_final_message"):
        # A real engine's tokenizer reads its own answer back as the tokens it wrote: the
        # continued prompt is the original one plus `resumed` tokens. Counting the partial
        # answer's characters instead would make a resumed stream's usage drift.
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > 1:
            original = _chat_context({"messages": messages[:-1]})
            prompt_tokens = _text_tokens(original) + resumed
    max_tokens = _optional_positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_positive_int(body, "max_tokens")
    if max_tokens is None:
        if path == SGLANG_PATH:
            params = body.get("sampling_params")
            if isinstance(params, dict):
                max_tokens = _optional_positive_int(params, "max_new_tokens")
        if max_tokens is None:
            max_tokens = max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len or max_tokens < 1:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion."
        )
    natural = _int_header(headers, "X-Sim-Output-Tokens")
    already = _int_header(headers, "X-Resumed-Output-Tokens") or 0
    if body.get("ignore_eos"):
        mean_tokens, natural = 0, None
    n = _optional_positive_int(body, "n") or 1
    seed = body.get("seed")
    return AnswerSpec(
        context,
        prompt_tokens,
        max_tokens,
        mean_tokens,
        natural,
        already,
        n,
        seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
    )


def expected_answer(
    path: str,
    body: Mapping[str, object],
    headers: Mapping[str, str] | None = None,
    mean_tokens: int = 128,
    max_model_len: int | None = None,
) -> tuple[str, int, str]:
    """The full answer text, its token count and finish reason: what the worker would stream."""
    return expected_choice(path, body, 0, headers, mean_tokens, max_model_len)


def expected_choice(
    path: str,
    body: Mapping[str, object],
    choice: int,
    headers: Mapping[str, str] | None = None,
    mean_tokens: int = 128,
    max_model_len: int | None = None,
) -> tuple[str, int, str]:
    """`expected_answer` of the request's choice number `choice` (0 .. n-1)."""
    spec = answer_spec(path, body, headers, mean_tokens, max_model_len)
    tokens: list[str] = []
    reason = "length"
    for tok, finish in spec.tokens(choice):
        tokens.append(tok)
        if finish is not None:
            reason = finish
    return "".join(tokens), len(tokens), reason
