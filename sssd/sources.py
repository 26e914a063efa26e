"""Draft sources merged: DraftPipeline, the drafting stage of an engine.

Every source's candidates for a batch (the source interface: sssd.draft_source,
whose names are all importable from here too) enter the same C++ priority queue
(sssd.Drafter's merge) with its per-source discount, which builds one tree per
request within its budget. Retrieval, when listed, drafts and merges in the same
call; with a calibration file, each step drafts with the entry of its budget
(sssd.drafter.draft_with_entries).

This module never imports torch or the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import numpy as np

from sssd._tokens import pack_tokens
from sssd.calibration_file import drafter_config_for, entries_of, source_discount
from sssd.config import SOURCE_COPY, SourceDiscount
from sssd.draft_source import (  # noqa: F401  (the interface, importable from here too, where its users import it)
    SPEC_KINDS,
    CandidateBatch,
    Candidates,
    DraftDistributions,
    DraftRequest,
    DraftSource,
    RetrievalSource,
    parse_spec,
    parse_specs,
)
from sssd.drafter import Drafter, draft_with_entries, resolve_datastore
from sssd.source_evidence import DEFAULT_EVIDENCE, EvidenceSettings, SourceEvidence

log = logging.getLogger("sssd.drafting")

#: Draft sources a pipeline merges besides retrieval (source tags 2..14 in the C++ merge; 15 is the copy source's).
MAX_EXTERNAL = 13


class AlwaysDraft:
    """The deferral policy of a pipeline given none: sources that defer to retrieval always draft,
    and nothing is measured (the engine gives its pipelines a measuring one:
    sssd.serving.planning.deferral.Deferral)."""

    def pays(self, *args, **kwargs) -> bool:
        return True

    def drafted(self, *args, **kwargs) -> None:
        pass

    def begin_step(self, *args, **kwargs) -> None:
        pass

    def observe_step(self, *args, **kwargs) -> None:
        pass


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
        evidence: how each request's own acceptance by source corrects its sources' scores
            (sssd.source_evidence); None: every request drafts with the calibration's scores alone.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        config: Any,
        vocab_size: int | None = None,
        deferral: Any = None,
        evidence: EvidenceSettings | None = DEFAULT_EVIDENCE,
    ):
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
        #: source tag -> name, for the merged trees' `sources` (the copy source is retrieval's too)
        self.source_names = self._names()
        #: the target's top-k next tokens per verified node that the sources observe (0: none)
        self.observe_topk = max((int(s.observe_topk) for s in self.external), default=0)
        self._failed: set[tuple[int, int]] = set()  # (source index, request id) whose state is lost
        self.config = cfg  # what a source added later drafts with (sssd.datastore_source)
        self._discounts = discounts  # the external discounts the merge's score table holds
        #: when sources that defer to retrieval draft: the engine's measured policy
        #: (sssd.serving.planning.deferral.Deferral), or always (AlwaysDraft) without one
        self.deferral = deferral if deferral is not None else AlwaysDraft()
        #: each request's own acceptance by source, correcting the merge's scores for it (None: off)
        self.evidence = SourceEvidence(evidence) if evidence is not None else None

    @property
    def defers(self) -> bool:
        """Whether a source defers to retrieval here (the deferral policy decides when it drafts)."""
        return self.retrieval and any(s.defers_to_retrieval for s in self.external)

    def __bool__(self) -> bool:
        return self.retrieval or bool(self.external)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self.drafter

    def __len__(self) -> int:
        return len(self.drafter)

    def open(self, request_id: int, prompt: np.ndarray) -> None:
        self.drafter.open(request_id, prompt)
        if self.evidence is not None:
            self.evidence.open(request_id, len(prompt))
        for i, s in enumerate(self.external):
            self._call(i, s.open, request_id, prompt)

    def extend_batch(self, request_ids: Sequence[int], tokens: Sequence[np.ndarray]) -> None:
        ids = np.asarray(request_ids, dtype=np.int64)
        if len(tokens) != ids.shape[0]:
            raise ValueError(f"got {ids.shape[0]} request ids but {len(tokens)} token lists")
        offsets, flat = pack_tokens(tokens)  # packed once for every consumer
        self.drafter.extend_packed(ids, offsets, flat)
        if self.evidence is not None:
            self.evidence.extended_packed(ids, offsets, flat)
        for i, s in enumerate(self.external):
            if not self._failed or not any((i, rid) in self._failed for rid in ids.tolist()):
                try:
                    if s.extend_batch(ids, offsets, flat):
                        continue  # one call for the batch
                except Exception as e:  # noqa: BLE001 - it changed nothing: one request at a time finds the culprit
                    log.warning("draft source %r failed to take a batch's tokens (%s); trying each request", s.name, e)
            for rid, t in zip(request_ids, tokens):
                if (i, rid) not in self._failed:
                    self._call(i, s.extend, rid, t)

    def close(self, request_id: int) -> None:
        if request_id in self.drafter:
            self.drafter.close(request_id)
        if self.evidence is not None:
            self.evidence.close(request_id)
        for i, s in enumerate(self.external):
            self._call(i, s.close, request_id)
            self._failed.discard((i, request_id))

    def forget_history(self) -> None:
        """Every source drops what earlier requests left for later ones (DraftSource.forget_history).
        Between steps, with no request open: open ones may lose their state in a source."""
        for s in self.external:
            try:
                s.forget_history()
            except Exception as e:  # noqa: BLE001 - a source's failure costs its own drafts only
                log.warning("draft source %r failed to forget its history (%s)", s.name, e)

    def discount_of(self, source: DraftSource) -> SourceDiscount:
        """The discount `source`'s candidates merge with: the one the calibration file fitted for its
        `calibration_key` (``sssd calibrate --draft``), else the source's own."""
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
                raise ValueError(
                    f"{name!r} is retrieval's own source (the primary datastore and the requests' "
                    f"tokens); it cannot be removed"
                )
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

    def _names(self) -> dict[int, str]:
        return {0: "datastore", 1: "input", **{2 + i: s.name for i, s in enumerate(self.external)}, SOURCE_COPY: "copy"}

    def _sources_changed(self) -> None:
        self.source_names = self._names()
        self.observe_topk = max((int(s.observe_topk) for s in self.external), default=0)

    def _fit_merge(self, sources: Sequence[DraftSource]) -> None:
        """Makes the merge's score table hold `sources`' discounts (tag 2 + i: sources[i]'s).

        The table is fixed when a drafter is made, so unless the present one already fits
        (tags past its end use its last entry), a new drafter takes over, with every open
        request reopened from its tokens so far. Raises, changing nothing, if that fails.
        """
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
            log.warning(
                "draft source %r failed for request %s (%s); it skips that request from now on",
                self.external[i].name,
                request_id,
                e,
            )
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
        ids = np.fromiter((r.request_id for r in requests), dtype=np.int64, count=len(requests))
        budgets = np.fromiter((r.budget for r in requests), dtype=np.int32, count=len(requests))
        factors = self.evidence.factors(ids) if self.evidence is not None else None
        return draft_with_entries(self.drafter, self.entries, ids, budgets, None, factors)

    def draft_with_proposals(
        self, requests: Sequence[DraftRequest], verified_next: bool = True
    ) -> tuple[Any, list[list[tuple[int, Candidates]]]]:
        """The merged DraftBatch, and per request every external source's checked proposal
        (source tag, Candidates) as it was before the merge: sampled verification needs the
        draft distributions and draws of randomly drawn candidates (Candidates.dists).

        verified_next: these trees are the next step's as drafted (False: trees grown ahead,
        asynchronous drafting): only such trees teach the deferral what retrieval's promises get."""
        ids = np.fromiter((r.request_id for r in requests), dtype=np.int64, count=len(requests))
        budgets = np.fromiter((r.budget for r in requests), dtype=np.int32, count=len(requests))
        factors = self.evidence.factors(ids) if self.evidence is not None else None
        external = None
        per_request: list[list[tuple[int, Candidates]]] = [[] for _ in requests]
        blocks: list[tuple[int, np.ndarray, CandidateBatch]] = []  # (tag, batch rows, proposals) of propose_batch
        alone = promised = None  # retrieval's own trees, and what each promises (for deferring sources)
        source_seconds = 0.0  # the deferring sources' drafting time
        if self.retrieval and any(s.defers_to_retrieval for s in self.external):
            alone = draft_with_entries(self.drafter, self.entries, ids, budgets, None, factors)
            promised = np.zeros(len(requests))
            has = alone.sizes > 0
            if has.any():
                promised[has] = np.add.reduceat(alone.scores.astype(np.float64), alone.offsets[:-1][has])
        recent = None  # (store, tag, budgets): a recent-outputs source the merge asks in its own call
        if self.external:
            where = {r.request_id: k for k, r in enumerate(requests)}
            for i, s in enumerate(self.external):
                if recent is None and s.recent_store is not None and not s.defers_to_retrieval:
                    asks = budgets.astype(np.int64)
                    if self._failed:
                        asks[[(i, r.request_id) in self._failed for r in requests]] = 0
                    recent = (s.recent_store, 2 + i, asks)
                    continue
                asked = [r for r in requests if r.budget > 0 and (i, r.request_id) not in self._failed]
                if s.defers_to_retrieval and not verified_next and any(s.lag(r.request_id) > r.budget for r in asked):
                    continue  # grown ahead: it catches up in a step of its own (the serial rule's)
                if promised is not None and s.defers_to_retrieval and not self.deferral.pays(i, s, requests, promised):
                    continue  # retrieval alone promises more tokens per second
                if not asked:
                    continue
                try:
                    t0 = time.perf_counter()
                    flat = s.propose_batch(asked) if s.well_formed else None
                    got = list(s.propose(asked)) if flat is None else []
                    if s.defers_to_retrieval:
                        source_seconds += time.perf_counter() - t0
                    n = len(flat) if flat is not None else len(got)
                    if n != len(asked):
                        raise ValueError(f"returned {n} proposals for {len(asked)} requests")
                except Exception as e:  # noqa: BLE001
                    log.warning("draft source %r failed this step (%s); drafting without it", s.name, e)
                    continue
                if flat is not None:  # one batch for the merge as it is (CandidateBatch)
                    blocks.append((2 + i, np.array([where[r.request_id] for r in asked], dtype=np.int64), flat))
                    continue
                for r, c in zip(asked, got):
                    if c is None:
                        continue
                    try:
                        per_request[where[r.request_id]].append(
                            (2 + i, c if s.well_formed else c.check(self.vocab_size))
                        )
                    except (ValueError, TypeError) as e:
                        log.warning(
                            "draft source %r proposed malformed candidates for request %s (%s); dropped",
                            s.name,
                            r.request_id,
                            e,
                        )
            external = _merge_input(len(requests), per_request, blocks) if blocks or any(per_request) else None
        proposed = (external is not None and len(external["tokens"]) > 0) or (recent is not None and recent[2].any())
        if verified_next:
            self.deferral.drafted(
                requests, promised, retrieval_only=not proposed, alone=alone, source_seconds=source_seconds
            )
        if alone is not None and not proposed:
            batch = alone  # nothing to merge beside retrieval's own trees
        else:
            batch = draft_with_entries(self.drafter, self.entries, ids, budgets, external, factors, recent)
        if verified_next and self.evidence is not None:
            self.evidence.drafted(ids, [len(r.tokens) for r in requests], batch, factors)
        return batch, per_request


def _merge_input(
    n: int, per_request: list[list[tuple[int, Candidates]]], blocks: list[tuple[int, np.ndarray, CandidateBatch]]
) -> dict:
    """The merge's external input for `n` requests from both kinds of proposal: Candidates per
    request, and CandidateBatches over some of the requests' rows (tag, rows, batch). One batch
    and nothing else (the default sources: the recent outputs) goes in as it is, widened to the
    `n` rows; otherwise each batch is split into its requests' Candidates first."""
    if len(blocks) == 1 and not any(per_request):
        tag, rows, c = blocks[0]
        sizes = np.zeros(n, dtype=np.int64)
        sizes[rows] = np.diff(c.offsets)
        m = len(c.tokens)
        return {
            "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            "tokens": c.tokens,
            "parents": c.parents,
            "weights": c.weights,
            "q": np.full(m, np.nan, np.float32),
            "sources": np.full(m, tag, np.uint8),
        }
    for tag, rows, c in blocks:
        for row, cands in zip(rows.tolist(), c.split()):
            if cands is not None:
                per_request[row].append((tag, cands))
    return _concat_candidates(per_request)


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
            weights.append(
                c.weights if c.weights is not None else c.probs if c.probs is not None else np.ones(n, np.float32)
            )
            qs.append(c.probs if c.probs is not None else np.full(n, np.nan, np.float32))
            tags.append(np.full(n, tag, np.uint8))
            n0 += n
        sizes.append(n0)

    def cat(parts, dt):
        return np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)

    return {
        "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        "tokens": cat(toks, np.int64),
        "parents": cat(pars, np.int32),
        "weights": cat(weights, np.float32),
        "q": cat(qs, np.float32),
        "sources": cat(tags, np.uint8),
    }


__all__ = [
    "CandidateBatch",
    "Candidates",
    "DraftDistributions",
    "DraftPipeline",
    "DraftRequest",
    "DraftSource",
    "RetrievalSource",
    "SPEC_KINDS",
    "parse_spec",
    "parse_specs",
]
