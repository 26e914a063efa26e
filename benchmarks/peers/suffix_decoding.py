"""SuffixDecoding (Snowflake ArcticInference): ``arctic-inference`` from PyPI, its
CPU suffix-tree extension, behind the replay interface.

``SuffixDecodingCache`` keeps a local suffix tree per request (its prompt and
output) and a global tree of earlier responses; ``speculate`` drafts from both
and returns whichever draft scores higher. Here the global tree is warmed with
every document of the SSSD datastore (the same corpus and tokenizer), added as
responses (:class:`WarmCache`, minutes and several GB for the default
datastore; build it once and share it between settings).

Within a replay each request's output so far goes into its local tree and, as
an active response, into the global tree, as in serving. When a request
closes its response is evicted from the global tree, so that replaying the
same examples again (another budget, another setting, the evaluation after
the development sweep) never drafts from an earlier copy of the answer.

Tree speculation (``use_tree_spec=True``) is used by default: the replay
verifies trees, and SSSD drafts trees. Its defaults (``max_spec_factor=1``,
``min_token_prob=0.1``) draft few tokens; benchmarks sweep both.

With ``keep_responses`` a closed request's response stays in the global tree
(SuffixDecoding's serving behaviour: later requests draft from earlier
answers); give each replay a fresh cache then.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import sssd
from sssd.tree import concat

from ._base import EMPTY_TREE, tree

NAME = "SuffixDecoding"


def available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        return False
    return True


class WarmCache:
    """A SuffixDecodingCache whose global tree holds a corpus's documents.

    Args:
        corpus_tokens: a token stream, documents separated by sssd.SEPARATOR.
        max_tree_depth: the suffix trees' depth (ArcticInference default 64).
    """

    def __init__(self, corpus_tokens: np.ndarray, max_tree_depth: int = 64):
        import time

        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.max_tree_depth = max_tree_depth
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth)
        tokens = np.asarray(corpus_tokens)
        ends = np.flatnonzero(tokens == sssd.SEPARATOR)
        if ends.size == 0 or ends[-1] != tokens.shape[0] - 1:
            ends = np.append(ends, tokens.shape[0])
        starts = np.concatenate([[0], ends[:-1] + 1])
        empty = np.zeros(0, dtype=np.int32)
        t0 = time.perf_counter()
        for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
            key = ("corpus", i)
            self.cache.start_request(key, empty)
            self.cache.add_active_response(key, np.ascontiguousarray(tokens[s:e], dtype=np.int32))
            self.cache.stop_request(key)
        self.warm_seconds = time.perf_counter() - t0
        self.documents = int(starts.shape[0])


class SuffixDecodingDrafter:
    """SuffixDecoding's ``speculate`` behind the replay interface.

    Args:
        warm: the shared, warmed cache (requests use it in turn; one drafter
            at a time).
        max_spec_factor / max_spec_offset / min_token_prob / use_tree_spec:
            ``SuffixDecodingCache.speculate`` arguments; ``max_spec_tokens`` is
            the budget.
    """

    name = NAME

    def __init__(
        self,
        warm: WarmCache,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_spec_offset: float = 0.0,
        use_tree_spec: bool = True,
        keep_responses: bool = False,
    ):
        self.warm = warm
        self.keep_responses = keep_responses
        self.cache = warm.cache
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_spec_offset = max_spec_offset
        self.use_tree_spec = use_tree_spec
        self._window = warm.max_tree_depth  # speculate() looks at this many last tokens
        self._ctx: dict[int, np.ndarray] = {}

    def settings(self) -> dict:
        return {
            "max_spec_factor": self.max_spec_factor,
            "min_token_prob": self.min_token_prob,
            "max_spec_offset": self.max_spec_offset,
            "use_tree_spec": self.use_tree_spec,
        }

    def with_settings(self, **settings: Any) -> SuffixDecodingDrafter:
        """Another drafter on the same warmed cache."""
        return SuffixDecodingDrafter(self.warm, keep_responses=self.keep_responses, **{**self.settings(), **settings})

    def open(self, request_id: int, prompt: Any) -> None:
        rid = int(request_id)
        prompt = np.ascontiguousarray(prompt, dtype=np.int32)
        self.cache.start_request(rid, prompt)
        self._ctx[rid] = prompt[-self._window :].copy()

    def extend_batch(self, request_ids: Sequence[int] | np.ndarray, token_lists: Sequence[Any]) -> None:
        for rid, toks in zip(np.asarray(request_ids).tolist(), token_lists):
            toks = np.ascontiguousarray(toks, dtype=np.int32)
            if toks.size:
                self.cache.add_active_response(rid, toks)
                self._ctx[rid] = np.concatenate([self._ctx[rid], toks])[-self._window :]

    def close(self, request_id: int) -> None:
        rid = int(request_id)
        self.cache.stop_request(rid)
        if not self.keep_responses:
            self.cache.evict_cached_response(rid)
        del self._ctx[rid]

    def draft_one(self, rid: int, budget: int):
        if budget <= 0:
            return EMPTY_TREE
        d = self.cache.speculate(
            rid,
            self._ctx[rid],
            max_spec_tokens=int(budget),
            max_spec_factor=self.max_spec_factor,
            max_spec_offset=self.max_spec_offset,
            min_token_prob=self.min_token_prob,
            use_tree_spec=self.use_tree_spec,
        )
        if not len(d.token_ids):
            return EMPTY_TREE
        return tree(
            np.asarray(d.token_ids, dtype=np.int64),
            np.asarray(d.parents, dtype=np.int32),
            np.asarray(d.probs, dtype=np.float32),
        )

    def draft(self, request_ids: Sequence[int] | np.ndarray, budget: int) -> sssd.DraftBatch:
        return concat([self.draft_one(rid, budget) for rid in np.asarray(request_ids).tolist()])

    def __len__(self) -> int:
        return len(self._ctx)
