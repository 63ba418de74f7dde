"""Build the tiny word-level tokenizer aiperf counts tokens with (examples/aiperf/tokenizer/).

aiperf needs a Hugging Face tokenizer to size its synthetic prompts and count output tokens;
fetching one from the hub is not possible offline. This one splits on whitespace and
punctuation, knows the simulated workers' filler words (disagg_tools/sim/textgen.py `VOCAB`, so an
answer's
token count is its word count, as the simulated worker counts it) and the most frequent words of
aiperf's own prompt corpus (its shakespeare.txt). Run it with a Python that has `tokenizers`
(the aiperf venv of scripts/install_aiperf.sh has it):

    ~/.cache/disagg-router/aiperf/bin/python scripts/build_aiperf_tokenizer.py

The output is checked in; rebuilding gives the same files (the training is deterministic).
"""

from __future__ import annotations

import json
import sys
from importlib.util import find_spec
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "examples" / "aiperf" / "tokenizer"
VOCAB_SIZE = 6000
UNK = "[UNK]"


def _corpus() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from disagg_tools.sim.textgen import VOCAB  # stdlib-only module: importable from any venv

    lines = [" ".join(VOCAB)] * 50  # frequent enough to be kept whatever the cut
    spec = find_spec("aiperf")
    if spec is not None and spec.origin is not None:
        text = Path(spec.origin).parent / "dataset" / "generator" / "assets" / "shakespeare.txt"
        if text.exists():
            lines += text.read_text(encoding="utf-8").splitlines()
    return lines


def main() -> None:
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, glues punctuation
    trainer = trainers.WordLevelTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[UNK, "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (OUT / "special_tokens_map.json").write_text(
        json.dumps({"unk_token": UNK, "bos_token": "<s>", "eos_token": "</s>"}, indent=2) + "\n"
    )
    print(f"{OUT}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
