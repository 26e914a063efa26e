"""Draft sources: what proposes candidate tokens, and how their proposals are merged.

A DraftSource proposes, for a batch of requests (request id, token history,
budget), a small tree of candidate tokens per request, and may attach a
real draft probability q(token | parent path) to each node (a model drafter
does; retrieval attaches empirical probabilities as scores). Every source's
candidates enter the same C++ priority queue (sssd.Drafter's merge) with its
per-source discount, which builds one tree per request within its budget.

Retrieval (the suffix-array datastore plus the request's own tokens,
SSSD's drafting) is the first source, `RetrievalSource`. A user's own
source is any subclass of DraftSource implementing `propose`; the engine
takes a list of sources or spec strings::

    sssd.LLM(model, draft=["retrieval"])            # the default
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
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from sssd.config import SOURCE_COPY, SourceDiscount

log = logging.getLogger("sssd.drafting")

#: Draft sources a pipeline merges besides retrieval (source tags 2..14 in the C++ merge; 15 is the copy source's).
MAX_EXTERNAL = 13

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
            raise ValueError(f"dists: parents [m], q [m, V] and draws [m, k] expected, got {parents.shape}, "
                             f"{q.shape} and {draws.shape}")
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
    (sssd.deferral). A step it sits out costs it nothing.

    Attributes:
        name: reported in per-source acceptance metrics.
        discount: the source's weight in the merge (scale, depth decay); a calibration
            file's discount for its `calibration_key` replaces it (DraftPipeline.discount_of).
        observe_topk: how many of the target's likeliest next tokens per
            verified node the source observes (0: none; the backend then
            computes none for it).
    """

    name: str = "custom"
    discount: SourceDiscount = SourceDiscount()
    observe_topk: int = 0
    defers_to_retrieval: bool = False

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

    def close(self, request_id: int) -> None:
        """A request ended."""

    def observe_verified(self, request_ids: np.ndarray, tokens: np.ndarray, topk: np.ndarray) -> None:
        """After a decode step, every node the target verified (roots included), whether or not
        it was accepted: its request id [N], its token [N], and the target's `observe_topk`
        likeliest next tokens after it, likeliest first [N, observe_topk]."""

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> Sequence[Candidates | None]:
        """One proposal (or None) per request, in order."""


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
    names = [("retrieval" if isinstance(s, (tuple,)) and s[0] == "retrieval" or isinstance(s, RetrievalSource)
              else None) for s in out]
    if names.count("retrieval") > 1:
        raise ValueError("retrieval is listed twice")
    return out


class DraftPipeline:
    """The drafting stage of an engine: every source for a batch, merged into one tree per request.

    Retrieval, when listed, drafts and merges in one C++ call; other sources'
    candidates join its queue as external candidates. Without retrieval a
    merge-only drafter does the same. A source that fails (raises, or
    proposes malformed candidates) loses that step's proposals for the
    requests concerned, with a log line; the other sources and requests go on.

    Args:
        sources: RetrievalSource and DraftSource objects (parse_specs resolved).
        config: the DrafterConfig (retrieval parameters and discounts), or a CalibrationFile:
            each step drafts with the entry of its budget (sssd.calibration_file).
        vocab_size: the target's vocabulary (candidate ids must be below it).
    """

    def __init__(self, sources: Sequence[Any], config: Any, vocab_size: int | None = None):
        from sssd.calibration_file import drafter_config_for, entries_of
        from sssd.drafter import Drafter, resolve_datastore

        self.vocab_size = vocab_size
        self.external: list[DraftSource] = [s for s in sources if isinstance(s, DraftSource)]
        retrieval = [s for s in sources if isinstance(s, RetrievalSource)]
        if len(self.external) > MAX_EXTERNAL:
            raise ValueError(f"at most {MAX_EXTERNAL} draft sources besides retrieval, got {len(self.external)}")
        entries = entries_of(config)  # budget -> config ({0: config} for one config)
        fix: dict[str, Any] = {"vocab_size": vocab_size} if vocab_size else {}
        self._calibrated = config  # a CalibrationFile may hold discounts fitted for the other sources
        discounts = tuple(self.discount_of(s) for s in self.external)
        if retrieval:
            r = retrieval[0]
            fix.update(r.overrides)
            use_ds = any(c.replace(**fix).use_datastore for c in entries.values())
            ds = resolve_datastore(r.datastore) if use_ds else None
            self.datastore = ds
            fix = fix if ds is not None else {**fix, "use_datastore": False}
        else:
            self.datastore = ds = None
            fix.update(use_datastore=False, use_input=False)
        #: budget -> the config drafting steps of that budget (the largest key <= it; the smallest below all)
        self.entries = {b: c.replace(**fix) if fix else c for b, c in entries.items()}
        cfg = drafter_config_for(self.entries)  # (for one config, that config; else tries deep enough for every entry)
        self.drafter = Drafter(ds, cfg, external_sources=discounts)
        self.retrieval = bool(retrieval)
        names = {0: "datastore", 1: "input"}
        names.update({2 + i: s.name for i, s in enumerate(self.external)})
        self.source_names = names
        #: the target's top-k next tokens per verified node that the sources observe (0: none)
        self.observe_topk = max((int(s.observe_topk) for s in self.external), default=0)
        self._failed: set[tuple[int, int]] = set()  # (source index, request id) whose state is lost
        self.config = cfg  # what a source added later drafts with (sssd.datastore_source)
        self._discounts = discounts  # the external discounts the merge's score table holds
        from sssd.deferral import Deferral

        #: the measured terms of when deferring sources draft (sssd.deferral)
        self.deferral = Deferral()

    @property
    def defers(self) -> bool:
        """Whether a source defers to retrieval here (sssd.deferral decides when it drafts)."""
        return self.retrieval and any(s.defers_to_retrieval for s in self.external)

    def __bool__(self) -> bool:
        return self.retrieval or bool(self.external)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self.drafter

    def __len__(self) -> int:
        return len(self.drafter)

    def open(self, request_id: int, prompt: np.ndarray) -> None:
        self.drafter.open(request_id, prompt)
        for i, s in enumerate(self.external):
            self._call(i, s.open, request_id, prompt)

    def extend_batch(self, request_ids: Sequence[int], tokens: Sequence[np.ndarray]) -> None:
        self.drafter.extend_batch(request_ids, tokens)
        for i, s in enumerate(self.external):
            for rid, t in zip(request_ids, tokens):
                if (i, rid) not in self._failed:
                    self._call(i, s.extend, rid, t)

    def close(self, request_id: int) -> None:
        if request_id in self.drafter:
            self.drafter.close(request_id)
        for i, s in enumerate(self.external):
            self._call(i, s.close, request_id)
            self._failed.discard((i, request_id))

    def discount_of(self, source: DraftSource) -> SourceDiscount:
        """The discount `source`'s candidates merge with: the one the calibration file fitted for its
        `calibration_key` (``sssd calibrate --draft``), else the source's own."""
        from sssd.calibration_file import source_discount

        return source_discount(self._calibrated, getattr(source, "calibration_key", None)) or source.discount

    @property
    def names(self) -> list[str]:
        """The names of the merge's sources: retrieval's (datastore, input), then the others in order."""
        return list(self.source_names.values())

    def add_source(self, source: DraftSource) -> None:
        """Adds a source while requests run: it is opened for every open request with its tokens
        so far, and the merge's score table learns its discount.

        Not safe beside a running step: call it between steps (the engine's lock).

        Raises:
            TypeError: not a DraftSource. ValueError: its name is taken, or the pipeline
            already merges MAX_EXTERNAL sources besides retrieval.
        """
        if not isinstance(source, DraftSource):
            raise TypeError(f"a draft source is a DraftSource, got {type(source).__name__}")
        if source.name in self.source_names.values() or source.name == "retrieval":
            raise ValueError(f"a draft source named {source.name!r} is already merged")
        if len(self.external) >= MAX_EXTERNAL:
            raise ValueError(f"at most {MAX_EXTERNAL} draft sources besides retrieval")
        self._fit_merge(self.external + [source])  # first: if it fails, nothing changed
        i = len(self.external)
        self.external.append(source)
        for rid in self.drafter.request_ids():
            self._call(i, source.open, rid, self.drafter.context(rid).astype(np.int64))
        self._sources_changed()

    def remove_source(self, name: str) -> DraftSource:
        """Removes the source named `name` (closing its requests) and returns it. Between steps only.

        Raises:
            KeyError: no source of that name. ValueError: retrieval's own sources cannot be removed.
        """
        i = next((k for k, s in enumerate(self.external) if s.name == name), None)
        if i is None:
            if name in ("datastore", "input", "retrieval"):
                raise ValueError(f"{name!r} is retrieval's own source (the primary datastore and the requests' "
                                 f"tokens); it cannot be removed")
            raise KeyError(name)
        for rid in self.drafter.request_ids():
            if (i, rid) not in self._failed:
                self._call(i, self.external[i].close, rid)
        source = self.external.pop(i)
        self._failed = {(j - (j > i), rid) for j, rid in self._failed if j != i}
        try:
            self._fit_merge(self.external)
        except Exception as e:  # noqa: BLE001 - removing succeeded; only the ranking of later sources suffers
            log.warning("the merge keeps its old discounts after removing %r (%s)", name, e)
        self._sources_changed()
        return source

    def _sources_changed(self) -> None:
        self.source_names = {0: "datastore", 1: "input", **{2 + i: s.name for i, s in enumerate(self.external)},
                             SOURCE_COPY: "copy"}
        self.observe_topk = max((int(s.observe_topk) for s in self.external), default=0)

    def _fit_merge(self, sources: Sequence[DraftSource]) -> None:
        """Makes the merge's score table hold `sources`' discounts (tag 2 + i: sources[i]'s).

        The table is fixed when a drafter is made, so unless the present one already fits
        (tags past its end use its last entry), a new drafter takes over, with every open
        request reopened from its tokens so far. Raises, changing nothing, if that fails.
        """
        from sssd.drafter import Drafter

        new = tuple(self.discount_of(s) for s in sources)
        old = self._discounts
        cfg = self.drafter.config
        if not old and cfg.discounts.calibration is None:
            old = (cfg.discounts.external,)  # what a drafter made without external discounts holds
        if not new or (old and all(old[min(i, len(old) - 1)] == d for i, d in enumerate(new))):
            return
        drafter = Drafter(self.datastore, cfg, external_sources=new)
        for rid in self.drafter.request_ids():
            drafter.open(rid, self.drafter.context(rid))
        self.drafter, self._discounts = drafter, new

    def observe_verified(self, request_ids: np.ndarray, tokens: np.ndarray, topk: np.ndarray) -> None:
        """Hands every observing source the step's verified nodes (its own top-k columns of `topk`);
        a source that fails is logged and the others go on."""
        for s in self.external:
            if s.observe_topk > 0:
                try:
                    s.observe_verified(request_ids, tokens, topk[:, : s.observe_topk])
                except Exception as e:  # noqa: BLE001 - observing is an optimisation
                    log.warning("draft source %r failed to observe a step (%s)", s.name, e)

    def _call(self, i: int, fn, request_id: int, *args) -> None:
        try:
            fn(request_id, *args)
        except Exception as e:  # noqa: BLE001 - a source's failure costs its own drafts only
            log.warning("draft source %r failed for request %s (%s); it skips that request from now on",
                        self.external[i].name, request_id, e)
            self._failed.add((i, request_id))

    def draft(self, requests: Sequence[DraftRequest]):
        """One merged DraftBatch for the requests (budgets 0: empty trees); its sources
        name the source of each node through `source_names`."""
        return self.draft_with_proposals(requests)[0]

    def draft_retrieval(self, requests: Sequence[DraftRequest]) -> Any | None:
        """Retrieval's own merged trees (datastore and request trie, no other source asked), one
        C++ call; None without retrieval. Asynchronous drafting tops up re-rooted trees with it."""
        if not self.retrieval:
            return None
        from sssd.calibration_file import draft_with_entries

        ids = np.fromiter((r.request_id for r in requests), dtype=np.int64, count=len(requests))
        budgets = np.fromiter((r.budget for r in requests), dtype=np.int32, count=len(requests))
        return draft_with_entries(self.drafter, self.entries, ids, budgets, None)

    def draft_with_proposals(self, requests: Sequence[DraftRequest],
                             verified_next: bool = True) -> tuple[Any, list[list[tuple[int, Candidates]]]]:
        """The merged DraftBatch, and per request every external source's checked proposal
        (source tag, Candidates) as it was before the merge: sampled verification needs the
        draft distributions and draws of randomly drawn candidates (Candidates.dists).

        verified_next: these trees are the next step's as drafted (False: trees grown ahead,
        asynchronous drafting): only such trees teach the deferral what retrieval's promises get."""
        from sssd.calibration_file import draft_with_entries

        ids = np.fromiter((r.request_id for r in requests), dtype=np.int64, count=len(requests))
        budgets = np.fromiter((r.budget for r in requests), dtype=np.int32, count=len(requests))
        external = None
        per_request: list[list[tuple[int, Candidates]]] = [[] for _ in requests]
        alone = promised = None  # retrieval's own trees, and what each promises (for deferring sources)
        source_seconds = 0.0     # the deferring sources' drafting time
        if self.retrieval and any(s.defers_to_retrieval for s in self.external):
            alone = draft_with_entries(self.drafter, self.entries, ids, budgets, None)
            promised = np.zeros(len(requests))
            has = alone.sizes > 0
            if has.any():
                promised[has] = np.add.reduceat(alone.scores.astype(np.float64), alone.offsets[:-1][has])
        if self.external:
            for i, s in enumerate(self.external):
                asked = [r for r in requests if r.budget > 0 and (i, r.request_id) not in self._failed]
                if s.defers_to_retrieval and not verified_next and any(s.lag(r.request_id) > r.budget for r in asked):
                    continue  # grown ahead: it catches up in a step of its own (the serial rule's)
                if promised is not None and s.defers_to_retrieval and not self.deferral.pays(i, s, requests, promised):
                    continue  # retrieval alone promises more tokens per second
                if not asked:
                    continue
                try:
                    t0 = time.perf_counter()
                    got = list(s.propose(asked))
                    if s.defers_to_retrieval:
                        source_seconds += time.perf_counter() - t0
                    if len(got) != len(asked):
                        raise ValueError(f"returned {len(got)} proposals for {len(asked)} requests")
                except Exception as e:  # noqa: BLE001
                    log.warning("draft source %r failed this step (%s); drafting without it", s.name, e)
                    continue
                where = {r.request_id: k for k, r in enumerate(requests)}
                for r, c in zip(asked, got):
                    if c is None:
                        continue
                    try:
                        per_request[where[r.request_id]].append((2 + i, c.check(self.vocab_size)))
                    except (ValueError, TypeError) as e:
                        log.warning("draft source %r proposed malformed candidates for request %s (%s); dropped",
                                    s.name, r.request_id, e)
            external = _concat_candidates(per_request)
        if verified_next:
            self.deferral.drafted(requests, promised, retrieval_only=not any(per_request), alone=alone,
                                  source_seconds=source_seconds)
        if alone is not None and not any(per_request):
            return alone, per_request  # nothing to merge beside retrieval's own trees
        return draft_with_entries(self.drafter, self.entries, ids, budgets, external), per_request


def _concat_candidates(per_request: list[list[tuple[int, Candidates]]]) -> dict:
    """The merge's external input: every request's candidates, each tagged with its source."""
    toks, pars, weights, qs, tags, sizes = [], [], [], [], [], []
    for cands in per_request:
        n0 = 0
        for tag, c in cands:
            n = len(c.tokens)
            toks.append(c.tokens)
            pars.append(np.where(c.parents >= 0, c.parents + n0, -1).astype(np.int32))
            # ranked by its weight, else its real probability, else as probability 1 (times its source's discount)
            weights.append(c.weights if c.weights is not None else c.probs if c.probs is not None
                           else np.ones(n, np.float32))
            qs.append(c.probs if c.probs is not None else np.full(n, np.nan, np.float32))
            tags.append(np.full(n, tag, np.uint8))
            n0 += n
        sizes.append(n0)

    def cat(parts, dt):
        return np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)

    return {"offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), "tokens": cat(toks, np.int64),
            "parents": cat(pars, np.int32), "weights": cat(weights, np.float32), "q": cat(qs, np.float32),
            "sources": cat(tags, np.uint8)}


__all__ = ["Candidates", "DraftDistributions", "DraftPipeline", "DraftRequest", "DraftSource", "RetrievalSource",
           "SPEC_KINDS", "parse_spec", "parse_specs"]
