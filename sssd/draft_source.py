"""The draft source interface: what proposes candidate tokens (DraftSource), what it is
asked (DraftRequest) and what it proposes (Candidates, DraftDistributions); retrieval's
place among the sources (RetrievalSource); and the spec grammar naming sources.

A DraftSource proposes, for a batch of requests (request id, token history,
budget), a small tree of candidate tokens per request, and may attach a
real draft probability q(token | parent path) to each node (a model drafter
does; retrieval attaches empirical probabilities as scores). Every source's
candidates enter the same C++ priority queue (sssd.Drafter's merge) with its
per-source discount, which builds one tree per request within its budget;
sssd.sources's DraftPipeline runs them (and gives every name here too).

Retrieval (the suffix-array datastore plus the request's own tokens,
SSSD's drafting) is the first source, `RetrievalSource`. A user's own
source is any subclass of DraftSource implementing `propose`; the engine
takes a list of sources or spec strings::

    sssd.LLM(model, draft=["retrieval", "recent"])  # the default
    sssd.LLM(model, draft=["retrieval"])            # retrieval alone
    sssd.LLM(model, draft=[])                       # plain decoding, the same engine
    sssd.LLM(model, draft=["retrieval", MySource()])
    sssd serve --draft retrieval

The spec grammar is fixed; later kinds plug into it: `retrieval`,
`model:<name or folder>` (a draft model), `self:streamingllm` and
`self:snapkv` (the target over a sparse view of its own KV cache;
`self:snapkv:<kv budget>` sets its size),
`recycle[:<k>]` (Token Recycling: the target's own top-k predictions,
sssd.token_recycling) and `recent` (other requests' recent outputs,
sssd.recent_outputs).

This module never imports torch or the engine.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from sssd.config import SourceDiscount

#: Kinds of the draft spec grammar, and what each names.
SPEC_KINDS = {
    "retrieval": "the datastore and the request's own tokens (SSSD's drafting)",
    "model:<name or folder>": "a small causal LM drafting for the target",
    "self:streamingllm": "the target over a StreamingLLM view of its own KV cache",
    "self:snapkv": "the target over a SnapKV view of its own KV cache",
    "recycle[:<k>]": "Token Recycling: the target's own top-k next tokens at every verified node",
    "recent": "the recent outputs of the other requests",
}


@dataclass(frozen=True)
class DraftRequest:
    """One request to draft for.

    Attributes:
        request_id: the engine's id of the request.
        tokens: its tokens so far, prompt and output (int64, read-only); the last
            one is the root the draft continues.
        budget: the most candidate nodes the merged tree may hold.
        temperature / top_k / top_p: how the target samples this request (temperature 0:
            greedy). A model source may draw its candidates from its own distribution
            processed the same way, and hand that distribution over (DraftDistributions).
    """

    request_id: int
    tokens: np.ndarray
    budget: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class DraftDistributions:
    """What multi-step speculative sampling (SpecInfer's MSS) needs from a source that drew
    its candidates at random: at every node it expanded, the whole draft distribution q and
    the draws, in order, that it made from it.

    The draws at a node must be independent draws from its q row (with replacement: a
    token drawn twice is listed twice), made independently of anything the target
    computes; the node's children in the Candidates are the distinct drawn tokens.
    Verification then accepts exactly (serving.acceptance), whatever the merge keeps.

    Attributes:
        parents: [m] the expanded candidate's index (-1: the root).
        q: [m, V] float32: each expanded node's draft distribution over the target's
            vocabulary (rows sum to 1).
        draws: [m, k] int64: the tokens drawn from each row, in drawing order (-1: padding).
    """

    parents: np.ndarray
    q: np.ndarray
    draws: np.ndarray

    def check(self, n: int, vocab_size: int | None) -> DraftDistributions:
        """The distributions as int32/float32/int64 arrays, or ValueError saying what is malformed."""
        parents = np.asarray(self.parents)
        q = np.asarray(self.q, dtype=np.float32)
        draws = np.asarray(self.draws)
        m = parents.shape[0] if parents.ndim == 1 else -1
        if m < 0 or q.ndim != 2 or q.shape[0] != m or draws.ndim != 2 or draws.shape[0] != m:
            raise ValueError(
                f"dists: parents [m], q [m, V] and draws [m, k] expected, got {parents.shape}, "
                f"{q.shape} and {draws.shape}"
            )
        if m and ((parents < -1).any() or (parents >= n).any()):
            raise ValueError(f"dists: parents must be -1 or a candidate index below {n}")
        if vocab_size is not None and q.shape[1] != vocab_size:
            raise ValueError(f"dists: q rows must cover the target's vocabulary ({vocab_size}), got {q.shape[1]}")
        if m and (not np.isfinite(q).all() or (q < 0).any() or not np.allclose(q.sum(axis=1), 1.0, atol=1e-3)):
            raise ValueError("dists: every q row must be a probability distribution")
        if draws.size and ((draws < -1).any() or (draws >= q.shape[1]).any()):
            raise ValueError(f"dists: drawn tokens must be in [0, {q.shape[1]}) (-1: padding)")
        rows = np.broadcast_to(np.arange(m)[:, None], draws.shape)
        drawn = draws >= 0
        if drawn.any() and not (q[rows[drawn], draws[drawn]] > 0).all():
            raise ValueError("dists: a drawn token has probability 0 under its q row")
        return DraftDistributions(parents.astype(np.int32), q, draws.astype(np.int64))


@dataclass(frozen=True)
class Candidates:
    """A source's proposal for one request: a tree over the root.

    Attributes:
        tokens: [n] candidate token ids.
        parents: [n] parent node index, -1 for children of the root; a parent
            precedes its children.
        probs: [n] q(token | parent path) when the source has a real draft
            distribution (a model), else None. Sampled acceptance uses them as
            the draft distribution, so they must be honest.
        weights: [n] how the merge ranks each candidate: the conditional
            probability, in [0, 1], that it follows its parent (e.g. a
            retrieval source's empirical frequency), times the source's
            discount. None: `probs`, or 1 for every candidate without them.
        dists: for candidates drawn at random from a draft distribution, that
            distribution at every expanded node and the draws
            (DraftDistributions): sampled requests then verify them by
            multi-step speculative sampling. None: the candidates are taken as
            deterministic (verified by the sampling walk, exact for any choice).
    """

    tokens: np.ndarray
    parents: np.ndarray
    probs: np.ndarray | None = None
    weights: np.ndarray | None = None
    dists: DraftDistributions | None = None

    def check(self, vocab_size: int | None) -> Candidates:
        """The proposal as int64/int32/float32 arrays, or ValueError saying what is malformed."""
        tokens = np.asarray(self.tokens)
        parents = np.asarray(self.parents)
        if tokens.ndim != 1 or parents.shape != tokens.shape:
            raise ValueError(f"tokens and parents must be 1-D of one length, got {tokens.shape} and {parents.shape}")
        if tokens.size and (tokens.dtype.kind not in "iu" or parents.dtype.kind not in "iu"):
            raise ValueError(f"tokens and parents must be integers, got {tokens.dtype} and {parents.dtype}")
        n = tokens.shape[0]
        if n and (tokens.min() < 0 or (vocab_size is not None and tokens.max() >= vocab_size)):
            raise ValueError(f"token ids must be in [0, {vocab_size}), got {int(tokens.min())}..{int(tokens.max())}")
        if n and ((parents < -1).any() or (parents >= np.arange(n)).any()):
            raise ValueError("parents must be -1 or the index of an earlier node")
        probs, weights = (None if v is None else np.asarray(v, dtype=np.float32) for v in (self.probs, self.weights))
        for name, v in (("probs", probs), ("weights", weights)):
            if v is not None and (v.shape != tokens.shape or not np.all((v >= 0) & (v <= 1))):
                raise ValueError(f"{name} must be one probability in [0, 1] per node")
        dists = None if self.dists is None else self.dists.check(n, vocab_size)
        return Candidates(tokens.astype(np.int64), parents.astype(np.int32), probs, weights, dists)


@dataclass(frozen=True)
class CandidateBatch:
    """Proposals for a batch of requests in one set of CSR arrays (what a C++ source returns
    from one call): request k's candidates are ``tokens[offsets[k]:offsets[k + 1]]``, with
    parents indexing within that slice (-1: the root) and float32 weights as Candidates.weights.
    Well-formed by construction (DraftSource.well_formed): no probs, no dists.

    Attributes:
        offsets: [R + 1] int64, from 0, non-decreasing. tokens: [N] int64. parents: [N] int32.
        weights: [N] float32 in [0, 1].
    """

    offsets: np.ndarray
    tokens: np.ndarray
    parents: np.ndarray
    weights: np.ndarray

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def split(self) -> list[Candidates | None]:
        """One Candidates (or None where a request got none) per request."""
        bounds = self.offsets.tolist()
        out: list[Candidates | None] = []
        for a, b in zip(bounds, bounds[1:]):
            out.append(Candidates(self.tokens[a:b], self.parents[a:b], weights=self.weights[a:b]) if b > a else None)
        return out


class DraftSource(abc.ABC):
    """Something that proposes draft candidates for a batch of requests.

    Subclasses implement `propose`; `open`, `extend` and `close` let a
    stateful source follow each request (the default ignores them), and a
    source with `observe_topk` > 0 also sees what the target predicted at
    every node it verified (`observe_verified`). A source that raises, or
    returns malformed candidates, costs only that step's drafts of the
    requests concerned: the engine logs it and decodes them plainly.

    A costly source (a draft model: forward passes every step) may set
    `defers_to_retrieval`: beside retrieval it is then asked only in steps
    where it pays. Retrieval's own trees are drafted first; each promises
    A_r accepted tokens (the sum of its nodes' priorities), the source
    A_s (`expected_accepted`) at a cost of c target forward passes
    (measured: `measured_seconds(batch)` over the target's forward time;
    `relative_cost` until then); the step asks it, for every request (a
    pass costs about the same for one request as for the batch), when
    sum(1 + max(A_r, A_s)) > (1 + c) sum(1 + A_r) over the batch, A_r
    corrected by what retrieval's promises were measured to get
    (sssd.serving.planning.deferral). A step it sits out costs it nothing.

    Attributes:
        name: reported in per-source acceptance metrics.
        discount: the source's weight in the merge (scale, depth decay); a calibration
            file's discount for its `calibration_key` replaces it (DraftPipeline.discount_of).
        observe_topk: how many of the target's likeliest next tokens per
            verified node the source observes (0: none; the backend then
            computes none for it).
        well_formed: the source's candidates are int64 tokens of the requests' own
            vocabulary (tokens it was given), int32 parents before their children and
            float32 weights in [0, 1], without probs or dists, by construction (a C++
            source): the pipeline skips their per-request check (Candidates.check), and
            the merge still refuses a malformed batch as a whole.
        recent_store: a C++ store of recent outputs (sssd._core.RecentStore) that the merge asks
            itself, inside its own call, for each request's context as the merge holds it: its
            proposals never reach Python (sssd.RecentOutputs). None (the default): the pipeline
            asks `propose_batch` / `propose`.
    """

    name: str = "custom"
    discount: SourceDiscount = SourceDiscount()
    observe_topk: int = 0
    defers_to_retrieval: bool = False
    well_formed: bool = False
    recent_store: Any = None

    relative_cost: float = 0.0

    def lag(self, request_id: int) -> int:
        """Tokens of the request the source must take in before it can draft for it (a draft
        model's catch-up pass; 0: none). Trees grown ahead (asynchronous drafting) ask a deferring
        source only where its lag is within their budget: a long catch-up pass on the drafting
        thread would outlast the verifier and leave the next step without drafts."""
        return 0

    def measured_seconds(self, batch: int) -> float | None:
        """For a deferring source: its measured seconds per drafting step at this batch size
        (None: not measured yet; the deferral then uses `relative_cost`)."""
        return None

    @property
    def calibration_key(self) -> str:
        """What `sssd calibrate --draft` files the discount it fits for this source under, and what
        a DraftPipeline looks it up by (default: the name)."""
        return self.name

    def expected_accepted(self, budget: int) -> float:
        """For a deferring source: the draft tokens its tree of `budget` nodes is expected to get
        accepted (the default: as many as it may hold)."""
        return float(budget)

    def open(self, request_id: int, prompt: np.ndarray) -> None:
        """A request starts, with its prompt."""

    def extend(self, request_id: int, tokens: np.ndarray) -> None:
        """Tokens the target produced were appended to a request."""

    def extend_batch(self, request_ids: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> bool:
        """Tokens appended to many requests at once: request_ids[b] got tokens[offsets[b]:offsets[b + 1]]
        (int64 arrays, offsets [B + 1] from 0). A source that takes them in one call (a C++ store)
        returns True; one that raises must have changed nothing. False (the default): the pipeline
        calls `extend` once per request instead."""
        return False

    def close(self, request_id: int) -> None:
        """A request ended."""

    def forget_history(self) -> None:
        """Drops what earlier requests left behind for later ones (the recent outputs' store), as
        if the source were new; requests still open may lose their state too. Nothing by default.
        A benchmark that generates the same prompts again calls it between runs: otherwise the
        second run drafts the first run's answers."""

    def observe_verified(self, request_ids: np.ndarray, tokens: np.ndarray, topk: np.ndarray) -> None:
        """After a decode step, every node the target verified (roots included), whether or not
        it was accepted: its request id [N], its token [N], and the target's `observe_topk`
        likeliest next tokens after it, likeliest first [N, observe_topk]."""

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> Sequence[Candidates | None]:
        """One proposal (or None) per request, in order."""

    def propose_batch(self, requests: Sequence[DraftRequest]) -> CandidateBatch | None:
        """The same proposals as `propose`, as one CandidateBatch, for a `well_formed` source that
        makes them in one call: the pipeline then hands them to the merge without a Candidates
        object a request. None (the default): the pipeline asks `propose`."""
        return None


class RetrievalSource:
    """SSSD's own drafting: the datastore and the request's tokens (an input trie).

    It is also the merge: other sources' candidates join its priority queue.
    Not a DraftSource subclass: its candidates never leave C++.

    Args:
        datastore: a Datastore, a directory, "default", or None (the request's tokens only).
        config: a DrafterConfig (its discounts weigh every source).
    """

    name = "retrieval"

    def __init__(self, datastore: Any = "default", config: Any = None, **overrides: Any):
        self.datastore = datastore
        self.config = config
        self.overrides = overrides


def parse_spec(spec: str | DraftSource | RetrievalSource) -> DraftSource | RetrievalSource | tuple[str, str]:
    """A DraftSource, RetrievalSource, or (kind, argument) for a spec string.

    Raises:
        ValueError: an unknown kind (the message lists the known ones) or a malformed spec.
    """
    if isinstance(spec, (DraftSource, RetrievalSource)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a draft source is a DraftSource or a spec string, got {type(spec).__name__}")
    text = spec.strip()
    kind, _, arg = text.partition(":")
    known = ", ".join(SPEC_KINDS)
    if kind == "retrieval" and not arg:
        return ("retrieval", "")
    if kind == "model" and arg:
        return ("model", arg)
    method, _, kv_budget = arg.partition(":")
    if kind == "self" and method in ("streamingllm", "snapkv") and (not kv_budget or kv_budget.isdigit()):
        return ("self", arg)
    if kind == "recycle" and (not arg or arg.isdigit() and int(arg) >= 1):
        return ("recycle", arg)
    if kind == "recent" and not arg:
        return ("recent", "")
    if kind in ("model", "self", "retrieval", "recycle", "recent"):
        raise ValueError(f"malformed draft source {spec!r}; the kinds are: {known}")
    raise ValueError(f"unknown draft source {spec!r}; the kinds are: {known}")


def parse_specs(draft: Sequence[str | DraftSource] | str | None) -> list:
    """Parses a list of sources (or one comma-separated string, as `sssd serve --draft` takes)."""
    if draft is None:
        return []
    if isinstance(draft, str):
        draft = [s for s in draft.split(",") if s.strip()] if draft.strip() else []
    out = [parse_spec(s) for s in draft]
    names = [
        ("retrieval" if isinstance(s, (tuple,)) and s[0] == "retrieval" or isinstance(s, RetrievalSource) else None)
        for s in out
    ]
    if names.count("retrieval") > 1:
        raise ValueError("retrieval is listed twice")
    return out


__all__ = [
    "CandidateBatch",
    "Candidates",
    "DraftDistributions",
    "DraftRequest",
    "DraftSource",
    "RetrievalSource",
    "SPEC_KINDS",
    "parse_spec",
    "parse_specs",
]
