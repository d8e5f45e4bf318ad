"""Regenerates the shipped `corpus.txt` and `tokenizer.json` (offline, by hand).

Run as `python -m rollout_service.embedded.build_tokenizer` in a developer's shell
and commit the two files. Nothing at runtime calls this: training a tokenizer on
every start would make the model directory depend on the `tokenizers` version
installed, and the recipe hash in `tiny_mimo` hashes the shipped file instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from rollout_service.embedded.corpus import corpus_text

MODEL_DIR = Path(__file__).resolve().parent
CORPUS_PATH = MODEL_DIR / "corpus.txt"
TOKENIZER_PATH = MODEL_DIR / "tokenizer.json"
VOCAB_SIZE = 1024
"""Total vocabulary including the special token; also the model's vocab_size."""
EOS_TOKEN = "<|endoftext|>"
"""The only special token: end of sequence, and also used as bos and pad."""


def train_tokenizer(text: str, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Trains a GPT-2 style byte-level BPE tokenizer on `text`.

    Byte-level means every string round-trips, including text the corpus never
    saw; the special token takes id 0.

    Raises:
        ValueError: if the corpus is too small to learn `vocab_size` tokens.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"corpus yields {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}"
        )
    return tokenizer


def main() -> None:
    """Writes corpus.txt and tokenizer.json next to this module (or to --out-dir)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=MODEL_DIR)
    args = parser.parse_args()
    text = corpus_text()
    tokenizer = train_tokenizer(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / CORPUS_PATH.name).write_text(text, encoding="utf-8")
    tokenizer.save(str(args.out_dir / TOKENIZER_PATH.name), pretty=True)
    print(f"wrote {args.out_dir}: {len(text.encode())} corpus bytes, "
          f"{tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
