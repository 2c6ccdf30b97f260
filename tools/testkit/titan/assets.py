"""A tiny tokenizer and text dataset for TorchTitan runs, made locally (nothing downloaded)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = 400  # well under the llama3 debug model's 2048-entry vocabulary


def make_tokenizer(dest: Path) -> Path:
    """A word-level ``tokenizer.json`` + ``tokenizer_config.json`` with BOS/EOS tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    dest.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    for i in range(WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "add_bos_token": True, "add_eos_token": True,
    }))
    return dest


def make_dataset(dest: Path, *, documents: int = 400, seed: int = 0) -> Path:
    """A JSON-lines ``{"text": ...}`` dataset that ``datasets.load_dataset(dir)`` reads."""
    dest.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with open(dest / "train.jsonl", "w") as f:
        for _ in range(documents):
            # a little structure (repeated phrases) so the loss visibly falls
            start = rng.randrange(WORDS - 40)
            words = [f"w{start + (j * 7 + rng.randrange(3)) % 40}"
                     for j in range(rng.randrange(30, 120))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return dest
