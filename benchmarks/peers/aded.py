"""ADED's retriever, as published on PyPI: ``draftretriever==0.1.1``.

The PyPI name is REST's, but the package is ADED's (Liu et al., "Adaptive
Draft-Verification for Efficient LLM Decoding", github.com/liuxukun2000/ADED,
now Adaptix): its README says so, and its Rust module is built around a
tri-gram matrix and an MCTS (``src/mcts_sub.rs``). Checked by behaviour on
the 0.1.1 wheel:

* it matches only the context's **last 2 tokens** (a different earlier
  context gives the same draft);
* drafts are **at most 4 tokens deep** (MCTS sentences of 3 tokens plus one
  greedy extension), whatever ``choices`` is; ``k`` and ``long`` are accepted
  but have no effect;
* it **learns from every query**: the tri-grams of each searched context are
  added to its matrix, so a Reader is stateful (this adapter makes a fresh
  one per replay with ``reset``) and the MCTS is randomised (``thread_rng``),
  so drafts are not reproducible run to run.

Used as ADED's ``aded/model/utils.py`` uses it: the index is built with
``Writer.add_entry`` per document (here: every document of the SSSD datastore,
the same corpus and tokenizer), and each step calls
``Reader.search(whole context, choices=budget)``; its paths (leaf and inner
paths, padded with -2) form the tree; no result drafts token 100, as ADED's
caller does. The tree is cut to the budget breadth-first when it has more
nodes (``choices`` bounds the paths, not always the nodes).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import sssd
from sssd.tree import concat

from ._base import EMPTY_TREE, chain, paths_tree

#: The name this peer is reported under.
NAME = "ADED (draftretriever 0.1.1)"
#: ADED's draft when the search returns nothing (``random_index = 100``).
ADED_FALLBACK_TOKEN = 100


def available() -> bool:
    try:
        import draftretriever  # noqa: F401
    except ImportError:
        return False
    return True


def build_index(tokens: np.ndarray, path: str | Path, vocab_size: int) -> Path:
    """Writes ADED's index of a token stream (documents split at sssd.SEPARATOR), atomically."""
    import draftretriever

    tokens = np.asarray(tokens)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ends = np.flatnonzero(tokens == sssd.SEPARATOR)
    if ends.size == 0 or ends[-1] != tokens.shape[0] - 1:
        ends = np.append(ends, tokens.shape[0])
    starts = np.concatenate([[0], ends[:-1] + 1])
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        writer = draftretriever.Writer(file_path=tmp, vocab_size=int(vocab_size))
        for s, e in zip(starts.tolist(), ends.tolist()):
            if e > s:
                writer.add_entry(tokens[s:e].tolist())
        writer.finalize()
        del writer
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def cached_index(datastore: sssd.Datastore, cache_dir: str | Path | None = None) -> Path:
    """ADED's index of ``datastore``, built once and cached by the datastore's fingerprint."""
    fingerprint = datastore.manifest.get("fingerprint") or f"{datastore.native.fingerprint:016x}"
    cache = (
        Path(cache_dir)
        if cache_dir
        else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sssd" / "peers"
    )
    path = cache / f"aded-{fingerprint}.idx"
    if not path.exists():
        build_index(datastore.tokens, path, datastore.vocab_size)
    return path


class ADEDDrafter:
    """ADED's retriever behind the replay interface.

    Args:
        index_path: an index written by :func:`build_index`.
        fallback_token: drafted when the search finds nothing (ADED: 100).
    """

    name = NAME

    def __init__(self, index_path: str | Path, fallback_token: int | None = ADED_FALLBACK_TOKEN):
        self.index_path = Path(index_path)
        self.fallback_token = fallback_token
        self._ctx: dict[int, list[int]] = {}
        self.reset()

    def reset(self) -> None:
        """A fresh Reader: forgets everything learnt from earlier queries."""
        import draftretriever

        self._reader = draftretriever.Reader(index_file_path=str(self.index_path))

    def settings(self) -> dict:
        return {}

    def open(self, request_id: int, prompt: Any) -> None:
        if int(request_id) in self._ctx:
            raise ValueError(f"request {request_id} is already open")
        self._ctx[int(request_id)] = np.asarray(prompt, dtype=np.int64).tolist()

    def extend_batch(self, request_ids: Sequence[int] | np.ndarray, token_lists: Sequence[Any]) -> None:
        for rid, toks in zip(np.asarray(request_ids).tolist(), token_lists):
            self._ctx[rid].extend(np.asarray(toks, dtype=np.int64).tolist())

    def close(self, request_id: int) -> None:
        del self._ctx[int(request_id)]

    def draft_context(self, context: list[int], budget: int):
        if budget <= 0:
            return EMPTY_TREE
        paths = self._reader.search(context, choices=int(budget))[0]
        if not paths:
            return EMPTY_TREE if self.fallback_token is None else chain(np.array([self.fallback_token]))
        return paths_tree(paths, budget)

    def draft(self, request_ids: Sequence[int] | np.ndarray, budget: int) -> sssd.DraftBatch:
        return concat([self.draft_context(self._ctx[rid], budget) for rid in np.asarray(request_ids).tolist()])

    def __len__(self) -> int:
        return len(self._ctx)
