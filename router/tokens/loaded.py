"""The served models' tokenizers, read once per directory per process (setting
`estimates.tokenizers: {model: dir}`): the request parse counts prompts with them
(router/openai/prompt_tokens.py), a resume counts the text already sent
(router/request/resume.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from router.tokens.tokenizer import PromptTokenizer

__all__ = ["LOADED", "tokenizer_for"]

log = logging.getLogger(__name__)


class _Loaded:
    """The tokenizers read so far, by directory: one read per directory per process, however
    many apps or models share it; a directory that fails to load is logged once and counted by
    estimate (the worker still serves the request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_dir: dict[str, PromptTokenizer | None] = {}

    def ready(self, directory: str) -> bool:
        return directory in self._by_dir

    def get(self, directory: str) -> PromptTokenizer | None:
        if directory in self._by_dir:
            return self._by_dir[directory]
        with self._lock:
            if directory not in self._by_dir:
                try:
                    self._by_dir[directory] = PromptTokenizer.load(directory)
                except Exception as exc:  # the Rust parser raises its own errors too
                    log.error("tokenizer %s unreadable (%s): prompts estimated", directory, exc)
                    self._by_dir[directory] = None
            return self._by_dir[directory]


LOADED = _Loaded()


def tokenizer_for(tokenizers: Mapping[str, str], model: str) -> PromptTokenizer | None:
    """The model's tokenizer (loaded on first use), or None when it has none."""
    directory = tokenizers.get(model)
    return None if directory is None else LOADED.get(directory)
