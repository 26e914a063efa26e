"""Recent outputs: what the other requests generated lately, served as drafts.

Requests that run side by side, or one after another, often say the same
things (one answer format, one code idiom, the same question twice). This
source keeps the latest generated tokens of every request (and the last
few tokens of its prompt, so that an output's first tokens can be matched)
in one bounded store, and drafts for a request what followed the longest
recent occurrence of its context's suffix in the *other* requests' outputs
(its own tokens are the input trie's business).

The store and the drafting are C++ (sssd._core.RecentStore,
cpp/include/sssd/recent_store.h); this module is their DraftSource. The
store is a ring of `capacity` tokens shared by all requests. Requests write
into it interleaved, so each stored token links to its request's previous
and next token; a token is indexed under the hash of the two tokens that
end at it, in hash chains (zlib's: `head` holds the newest position of each
bucket, `chain` the one before it). Writing the ring forgets the oldest
tokens; a link to an overwritten position is recognised by its age and
ignored. Memory: 40 bytes per token of capacity, plus 8 bytes per bucket
head (as many buckets as the next power of two >= capacity): 48 MiB at the
default capacity, in zero pages that cost memory only as they are written.

Drafting, for all requests at once (one call, the GIL released): walk the
chain of the context's last two tokens (newest first, at most `max_chain`
positions), measure each occurrence's match length backwards (at most
`max_match`), keep the occurrences with the longest match among other
requests' tokens that have a continuation (at most `max_matches`, newest
first), follow each for `depth` tokens (adaptive: longer matches further,
up to 64), and merge the paths into a trie whose weights are counts (a
child's weight: the share of its parent's occurrences that continue with
it; the first level is damped for matches shorter than `max_match`).
tests/reference.py keeps the numpy implementation this replaced
(RecentOutputsReference); the C++ reproduces it operation for operation.

Thread-safe: one lock around the store (in C++).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sssd import _core
from sssd.config import SourceDiscount
from sssd.draft_source import CandidateBatch, Candidates, DraftRequest, DraftSource

#: Tokens the store holds (the oldest are forgotten beyond it).
DEFAULT_CAPACITY = 1 << 20
#: Longest context suffix matched; also the prompt tokens stored before a request's output.
MAX_MATCH = 8
#: Shortest match that drafts (the hash key's length).
MIN_MATCH = 2
#: Occurrences merged into one request's draft.
MAX_MATCHES = 16
#: Tokens followed after each occurrence: DEPTH_PER_MATCH per token of the request's longest match,
#: at least MIN_DEPTH and at most DEPTH (a full match is followed as deep as a copy of the request's own text).
DEPTH = 64
MIN_DEPTH = int(_core.RecentStore.MIN_DEPTH)  # 16
DEPTH_PER_MATCH = 8.0
#: Hash-chain positions examined per request and step.
MAX_CHAIN = 64
#: First-level weight factor per token a match falls short of MAX_MATCH.
MATCH_DAMPING = 0.8


class RecentOutputs(DraftSource):
    """Drafts from the other requests' recent tokens (one bounded store per engine).

    Args:
        capacity: tokens the store holds; the oldest are forgotten first.
        max_match / min_match: longest suffix matched, shortest that drafts (>= 2).
        max_matches: occurrences merged per draft; depth: tokens followed after each, at most (a request
            whose longest match is m tokens follows max(MIN_DEPTH, m * depth_per_match) of them).
        max_chain: hash-chain positions examined per request and step.
        discount: the source's weight in the merge.

    Raises:
        ValueError: for a bad parameter; `extend`/`open` for a negative token id, `propose` for a
            negative token id in a context or a negative budget.
    """

    name = "recent"
    discount = SourceDiscount(scale=1.0, depth_decay=0.95)
    well_formed = True  # its C++ store builds them from the tokens the requests were given

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        max_match: int = MAX_MATCH,
        min_match: int = MIN_MATCH,
        max_matches: int = MAX_MATCHES,
        depth: int = DEPTH,
        max_chain: int = MAX_CHAIN,
        discount: SourceDiscount | None = None,
        depth_per_match: float = DEPTH_PER_MATCH,
    ):
        self._store = _core.RecentStore(
            int(capacity),
            int(max_match),
            int(min_match),
            int(max_matches),
            int(depth),
            int(max_chain),
            float(depth_per_match),
            MATCH_DAMPING,
        )  # checks every value (ValueError)
        self.capacity = int(capacity)
        self.max_match, self.min_match = int(max_match), int(min_match)
        self.max_matches, self.depth, self.max_chain = int(max_matches), int(depth), int(max_chain)
        self.depth_per_match = float(depth_per_match)
        if discount is not None:
            self.discount = discount
        #: the store the merge asks itself, in its own call (DraftSource.recent_store)
        self.recent_store = self._store

    def __len__(self) -> int:
        """Tokens held."""
        return len(self._store)

    @property
    def written(self) -> int:
        """Tokens ever written."""
        return self._store.written

    def memory_bytes(self) -> int:
        """Bytes the store allocated (zero pages until written)."""
        return self._store.memory_bytes()

    def history(self, request_id: int) -> np.ndarray:
        """The request's tokens still held, oldest first (for tests and inspection)."""
        return self._store.history(request_id)

    # -- following requests ----------------------------------------------------------------
    def open(self, request_id: int, prompt: np.ndarray) -> None:
        """Stores the prompt's last `max_match` tokens: the context its output will follow."""
        self._store.open(request_id, _token_ids(prompt)[-self.max_match :])

    def extend(self, request_id: int, tokens: np.ndarray) -> None:
        self._store.extend(request_id, _token_ids(tokens))

    def extend_batch(self, request_ids: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> bool:
        """Every request's new tokens in one C++ call (one lock; checked before any request changes)."""
        self._store.extend_batch(request_ids, offsets, tokens)
        return True

    def close(self, request_id: int) -> None:
        """The request's tokens stay in the store (for the others) until the ring overwrites them."""
        self._store.close(request_id)

    def forget_history(self) -> None:
        """Empties the store (its memory kept): every request's tokens and place are forgotten."""
        self._store.clear()

    # -- drafting ---------------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> list[Candidates | None]:
        """Every request's trie of continuations after its longest recent match, at once."""
        batch = self.propose_batch(requests)
        return batch.split() if batch is not None else []

    def propose_batch(self, requests: Sequence[DraftRequest]) -> CandidateBatch | None:
        """`propose`'s tries as one CandidateBatch (one C++ call, the GIL released; None for no requests)."""
        R = len(requests)
        if not R:
            return None
        ids = np.fromiter((r.request_id for r in requests), dtype=np.int64, count=R)
        budgets = np.fromiter((r.budget for r in requests), dtype=np.int64, count=R)
        contexts = [r.tokens for r in requests]  # C++ reads the last max_match of each
        return CandidateBatch(*self._store.propose(ids, contexts, budgets))


def _token_ids(tokens) -> np.ndarray:
    """An integer array as it is (C++ checks the range), anything else as int64 (an empty list too)."""
    if isinstance(tokens, np.ndarray) and (tokens.dtype.kind in "iu" or tokens.size):
        return tokens
    return np.asarray(tokens, dtype=np.int64)


__all__ = ["RecentOutputs"]
