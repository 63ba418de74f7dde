"""The demo's tokenizer: one model directory that the router (settings `tokenizers`) and the
simulated workers (`--tokenizer DIR`) both read, so both name a prompt's KV blocks by the same
token ids and the router places on the workers' KV events (docs/kv-events.md).

    tokenizer.json         a WordLevel model behind a Whitespace pre-tokenizer (`\\w+|[^\\w\\s]+`),
                           its vocabulary every word the demo's prompts hold: the trace prompts'
                           3-letter words (disagg_tools.traces.prompt_text: 3 letters and a space,
                           one token, as the router's 4-characters estimate counts them), the sim
                           model's answer words (textgen.VOCAB, in a multi-turn chat's assistant
                           turns), the chat markers' pieces (`<|`, `|>`, the role names), and
                           `[UNK]` for anything else; no special tokens added
    tokenizer_config.json  the chat template: the sim's own chat text, `<|role|>\\n{text}\\n` per
                           message then `<|assistant|>\\n` (textgen.prompt_context), a message's
                           text parts joined with nothing between them as the sim joins them

Built deterministically (`build_demo_tokenizer(dir)` writes the same bytes every time), into the
demo's workdir at start: nothing is checked in.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from disagg_tools.sim import textgen
from disagg_tools.traces import _WORDS

__all__ = ["CHAT_TEMPLATE", "ROLES", "UNK", "build_demo_tokenizer", "demo_vocab"]

UNK = "[UNK]"
ROLES = ("system", "user", "assistant", "tool", "developer")

# The sim's template (textgen._chat_context) in jinja2, as the router renders it (trim_blocks,
# lstrip_blocks: every newline is written as an expression). A loop over the content makes the
# router hand the text parts over as parts (router/tokens/template.py), joined here with nothing
# between them, as the sim joins them; a string content is one part. The generation prompt is
# written whatever add_generation_prompt says, as the sim writes it; with continue_final_message
# the router cuts the text after the last message's text, the sim's text when that message is
# the assistant's.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{{ '<|assistant|>\\n' }}"
)


def demo_vocab() -> dict[str, int]:
    """Token -> id: [UNK] 0, the markers' pieces, the trace words, the sim's answer words."""
    words = [UNK, "<|", "|>", *ROLES, *_WORDS, *textgen.VOCAB]
    return {w: i for i, w in enumerate(dict.fromkeys(words))}


def build_demo_tokenizer(directory: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `directory` (created if needed)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(WordLevel(vocab=demo_vocab(), unk_token=UNK))
    tokenizer.pre_tokenizer = Whitespace()
    (d / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        "model_max_length": textgen.DEFAULT_MAX_MODEL_LEN,
        "chat_template": CHAT_TEMPLATE,
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (d / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return d
