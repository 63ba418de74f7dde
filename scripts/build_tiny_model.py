"""Build a tiny Llama model offline, for tests against real vLLM engines.

Model: 2 layers, hidden 128, 4 heads, 2 KV heads, head dim 32 (one of the sizes vLLM's CPU
attention backend supports), vocabulary 2,048, random weights saved as safetensors, BF16.

Tokenizer: word level (lower-cased words, single punctuation characters, single digits), wrapped
as a `PreTrainedTokenizerFast` with bos/eos/unk/pad tokens and a chat template. Chosen over a
byte-level BPE because every token sequence the model can emit decodes to text that re-encodes
to the same tokens, so "prompt + the text so far" continues a greedy answer exactly, which a
router's mid-stream resume relies on (a BPE would re-tokenize the text differently and a random
model would emit invalid UTF-8 byte sequences). The special tokens' output rows are zeroed, so
greedy decoding never emits them: answers are always exactly max_tokens long, gibberish but
deterministic.

Takes a few seconds, needs no network:

    python scripts/build_tiny_model.py OUT_DIR      (with the real-vLLM venv's python)
"""

from __future__ import annotations

import itertools
import random
import string
import sys
from pathlib import Path

VOCAB_SIZE = 2048
# Room for answers long enough that a test can watch an engine abort one midway (a one-thread
# CPU engine makes a few hundred tokens a second).
MAX_POSITIONS = 8192
SEED = 1234
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]

# Role names come first so that chat prompts always tokenize without <unk>.
BASE_WORDS = (
    "system user assistant the a an and or of to in on for is are was be it this that with as "
    "router prefill decode cache block token stream request model server engine transfer "
    "handoff latency throughput queue batch lease reserve release worker cluster gateway policy "
    "place replica memory bandwidth compute layer head attention vector hello world what why "
    "how when where who which quick brown fox jumps over lazy dog one two three four five six "
    "seven eight nine ten red green blue count story tell me about write poem list explain "
    "simple answer question number letter word sentence prompt reply please say again"
).split()

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | map(attribute='text') | join(' ') %}{% endif %}"
    "{{ message['role'] }} : {{ text }} {{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def vocabulary() -> list[str]:
    punct = list(string.punctuation)
    digits = list(string.digits)
    words = list(dict.fromkeys(BASE_WORDS))
    rng = random.Random(SEED)
    onsets = [
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "z",
        "br",
        "ch",
        "st",
        "tr",
        "sh",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    syllables = [o + v for o, v in itertools.product(onsets, vowels)]
    seen = set(words)
    need = VOCAB_SIZE - len(SPECIAL) - len(punct) - len(digits)
    while len(words) < need:
        w = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return SPECIAL + punct + digits + words


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    out.mkdir(parents=True, exist_ok=True)

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    assert len(vocab) == VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation("isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Larger-than-default init so greedy decoding wanders instead of repeating one token.
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
        # Greedy decoding never picks a zero logit over ~2,000 random ones: no special tokens
        # in the output (they would vanish from the text), and no EOS.
        model.lm_head.weight[: len(SPECIAL)] = 0.0
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    print(
        f"build_tiny_model: wrote {out} (vocab {len(fast)}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters)"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build(Path(sys.argv[1]))
