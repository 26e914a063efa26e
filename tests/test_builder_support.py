"""Helpers shared by the test_builder_* modules (no tests here).

A tiny byte-level BPE tokenizer trained offline in milliseconds stands in for
a real one, so builder tests never need the 12-second GGUF conversion.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import sssd

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today?",
    "def reverse(xs): return xs[::-1]",
    "Suffix arrays index every position of a token stream.",
]


def make_tokenizer(path: Path, vocab_size: int = 300, extra: list[str] | None = None) -> Path:
    """Trains a small byte-level BPE tokenizer and saves it as tokenizer.json at ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator((SENTENCES + (extra or [])) * 5, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def expected_stream(tokenizer_path: Path, docs: list[str]) -> np.ndarray:
    """What the builder should produce: each document's ids then a separator."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    out: list[int] = []
    for d in docs:
        out.extend(tok.encode(d, add_special_tokens=False).ids)
        out.append(sssd.SEPARATOR)
    return np.array(out, dtype=np.uint32)


def conversations(n: int, start: int = 0) -> list[dict]:
    """ShareGPT-style records with distinct, recognisable turns."""
    return [
        {
            "id": f"conv{i}",
            "conversations": [
                {"from": "human", "value": f"question {i}: how do I reverse a list?"},
                {"from": "gpt", "value": f"answer {i}: use xs[::-1] or reversed(xs)."},
            ],
        }
        for i in range(start, start + n)
    ]


def turns_of(records: list[dict], roles: str = "all") -> list[str]:
    out = []
    for r in records:
        for t in r["conversations"]:
            if roles == "all" or t["from"] == "gpt":
                out.append(t["value"])
    return out


def truncated_json(records: list[dict], cut: int = 30) -> str:
    """The records as an indented JSON array, cut ``cut`` characters before its end (mid-record)."""
    text = json.dumps(records, indent=2, ensure_ascii=False)  # raw multi-byte characters
    return text[: len(text) - cut]
