"""Evaluation (prompt, answer) token pairs for replay benchmarks.

Sources, in order of preference:
  * a datastore directory with a held-out split (heldout.jsonl, written by
    ``sssd build --default``), tokenized with the datastore's tokenizer;
  * a raw token stream (uint32 file, separators between documents): every
    ``holdout_every``-th document is an answer, the one before it its prompt,
    and a datastore is built from the remaining documents.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import sssd


def heldout_pairs(datastore: sssd.Datastore, max_prompt: int = 1024, max_answer: int = 512, limit: int | None = None):
    """(prompt, answer) token arrays from the datastore's held-out conversations."""
    from sssd.tokenizer import load_tokenizer

    path = Path(datastore.path) / "heldout.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build the default datastore with `sssd build --default`")
    tok = load_tokenizer(datastore.manifest["tokenizer"]["path"])
    pairs = []
    with open(path) as f:
        for line in f:
            conv = json.loads(line)
            turns = conv.get("turns") or conv.get("conversations") or []
            history: list[np.ndarray] = []
            for turn in turns:
                text = turn.get("text") if "text" in turn else turn.get("value", "")
                role = turn.get("role") or turn.get("from")
                ids = np.asarray(tok.encode(text or ""), dtype=np.int64)
                if role in ("gpt", "assistant") and history and len(ids) > 8:
                    prompt = np.concatenate(history)[-max_prompt:]
                    pairs.append((prompt, ids[:max_answer]))
                history.append(ids)
            if limit and len(pairs) >= limit:
                break
    return pairs


def stream_pairs(tokens: np.ndarray, holdout_every: int = 50, max_prompt: int = 1024, max_answer: int = 512):
    """Splits a token stream: returns (datastore tokens, [(prompt, answer)])."""
    sep = sssd.SEPARATOR
    ends = np.flatnonzero(tokens == sep)
    starts = np.concatenate([[0], ends[:-1] + 1])
    keep, pairs = [], []
    for i, (s, e) in enumerate(zip(starts, ends)):
        if i % holdout_every == 0 and i > 0:
            ps, pe = starts[i - 1], ends[i - 1]
            if e - s > 8 and pe > ps:
                pairs.append((tokens[ps:pe][-max_prompt:].astype(np.int64), tokens[s:e][:max_answer].astype(np.int64)))
        elif (i + 1) % holdout_every != 0:  # the held-out answer's prompt stays out too
            keep.append(tokens[s : e + 1])
    return np.concatenate(keep), pairs
