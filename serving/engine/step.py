"""One decode step for every decoding request: prepare (CPU), launch (the forward pass), finish.

    prepare   choose the budget, draft every request's tree from every draft source (one batched
              merge), pack the trees (tree_batch.pack)
    launch    the backend's forward pass over all trees at once (on a GPU it only enqueues)
    finish    accept (vectorised over the batch), move every accepted path's K/V into place in one
              operation, emit tokens, update the draft sources and the controllers that measure
              (planner, deferral, mode chooser)

The split lets a later step's drafting overlap a forward pass (async drafting grows the next
step's trees between launch and finish). The step reads and changes the engine only through its
public interface (see LLMEngine: requests, emit, finish_request, retire, reopen_draft, ...).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import sssd
from sssd.serving.engine.metrics import timeline_entry
from sssd.serving.engine.requests import Request
from sssd.serving.planning.acceptance import trials
from sssd.serving.planning.counterfactual import Counterfactuals, Resolved
from sssd.serving.verify.acceptance import Sampler, accept_greedy, accept_sampled, mss_trials
from sssd.serving.verify.tree_batch import NO_SOURCE, TreeBatch, pack, stack
from sssd.sources import DraftRequest

log = logging.getLogger("sssd.serving")


@dataclass
class StepPlan:
    """A decode step prepared on the CPU, ready to launch."""

    requests: list[Request]
    budget: int  # the step's largest per-request budget (0: a plain step)
    budgets: np.ndarray  # [B] draft nodes verified per request (0: not drafting)
    batch: TreeBatch
    greedy: np.ndarray  # [B] bool
    started: float  # perf_counter at prepare's start
    draft_seconds: float
    launched: float = 0.0  # perf_counter when the forward pass started
    trials: list | None = None  # [B] per row: packed node -> randomly drawn candidates' trials (acceptance.mss_trials)
    mode: str = "serial"  # how this step drafts the next one (async: a tree grows beside its forward pass)
    grown: bool = False  # the drafting thread grows the next step's trees beside this step's forward pass
    times: dict = field(default_factory=dict)  # perf_counter marks for the timeline (EngineMetrics.timeline)
    allocation: Any = None  # the batch-wide allocation (planning.allocation.Allocation), if it decided
    scores: list | None = None  # [B] the verified nodes' scores per row (what the allocation learns from)
    cap: int = 0  # how deep every row was drafted before the allocation cut its tree
    cached: int = 0  # the rows' cached positions, summed (what the forward pass reads beside its tokens)
    prefill: Any = None  # a prompt chunk (scheduler.PrefillChunk) written in this step's pass, after its rows
    counterfactual: float = 0.0  # seconds spent drafting trees this plain step does not verify (counterfactual.py)


@dataclass
class _Outcome:
    """What verification decided per row: the deepest accepted node, accepted count, bonus token,
    and the rows whose own sampling failed."""

    node: np.ndarray
    count: np.ndarray
    bonus: np.ndarray
    errors: dict[int, str]


class DecodeStep:
    """The decode step of one engine (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self._said_nothing_pays: set[int] = set()
        #: the trees of steps the allocation's gate kept plain, checked against what their rows emit
        self.counterfactuals = Counterfactuals()
        self._ended: set[int] = set()  # requests ended since their counterfactual rows were last walked

    def request_ended(self, rid: int) -> None:
        """Request `rid` finished: its counterfactual rows resolve once this step's tokens are walked."""
        if len(self.counterfactuals):
            self._ended.add(int(rid))

    # -- prepare ---------------------------------------------------------------------------
    def prepare(self, reqs: list[Request], prefill: Any = None) -> StepPlan:
        """Chooses the budget, drafts every decoding request's tree, packs them (CPU only). `prefill`:
        a prompt chunk (scheduler.PrefillChunk) the same pass writes, in the slots after the rows."""
        eng = self.engine
        B = len(reqs)
        t0 = time.perf_counter()
        chunk_tokens = prefill.tokens if prefill is not None else 0
        allocator = eng.allocator if eng.drafting is not None else None
        greedy = np.fromiter((r.params.greedy for r in reqs), dtype=bool, count=B)
        counterfactual = 0.0
        if allocator is not None:  # drafted as deep as any row could use, then cut batch-wide
            self._walk_ended()
            if allocator.drafts(B):
                budget = allocator.candidate_budget(B)
            else:
                budget = 0
                if prefill is None and allocator.counterfactual(B):
                    counterfactual = self._draft_counterfactual(reqs, greedy)
        else:
            budget = eng.planner.budget(B) if eng.drafting is not None else 0
        cap = budget
        budgets = np.fromiter((budget if r.params.speculate and r.draft else 0 for r in reqs), dtype=np.int32, count=B)
        if budget and allocator is not None:  # each row as deep as its request was last given (DEPTH_MIN)
            budgets = np.minimum(budgets, allocator.candidate_depths([r.id for r in reqs], B))
        if not budgets.any():
            budget = 0  # nobody drafts: the step is plain decoding (for the planner and the metrics too)
        mode = eng.mode_chooser.mode(B) if eng.mode_chooser is not None and budget else "serial"
        if budget and eng.drafting.defers:  # whether a draft model drafts beside retrieval: measured
            eng.drafting.deferral.begin_step(B, mode)
        if not budget:
            drafts, use, proposals = None, None, None
        elif eng.async_drafter is not None:
            drafts, use, proposals = self._draft_async(reqs, budgets)
        else:
            drafts, use, proposals = self._draft(reqs, budgets)
        allocation = scores = None
        if allocator is not None and drafts is not None:
            drafts, use, budgets, allocation, scores = self._allocate(reqs, greedy, drafts, use, budgets, chunk_tokens)
            budget = int(budgets.max()) if budgets.size else 0
            if not budget:
                drafts, use, proposals = None, None, None
        elif allocator is not None:
            budgets[:] = 0
        trials = None
        if proposals is not None and any(c.dists is not None for cands in proposals for _, c in cands):
            trials = [None] * B
            sampled = np.flatnonzero(~greedy)
            for b, t in zip(sampled.tolist(), mss_trials(drafts, proposals, sampled, use)):
                trials[b] = t
        t_draft = time.perf_counter() - t0
        cached = np.fromiter((r.cached for r in reqs), dtype=np.int64, count=B)
        batch = pack(np.fromiter((r.tokens[-1] for r in reqs), dtype=np.int64, count=B), cached, drafts, use)
        plan = StepPlan(reqs, budget, budgets, batch, greedy, t0, t_draft, trials=trials, mode=mode)
        plan.allocation, plan.scores, plan.cap, plan.cached = allocation, scores, cap, int(cached.sum())
        plan.prefill, plan.counterfactual = prefill, counterfactual
        plan.times["prepared"] = time.perf_counter()
        return plan

    def _candidates(self, reqs: list[Request], drafts: Any, use: np.ndarray, budgets: np.ndarray) -> list[np.ndarray]:
        """Per row, the scores of the nodes it may be given: at most its budget, short enough that
        every row's padded tree stays inside its KV slot (rows are padded to the largest tree), and
        none deeper than the row's tokens left (a row with L tokens left before max_tokens emits
        at most L this step, its bonus token among them, so a node deeper than L - 1 could never
        count); empty for a row that does not speculate."""
        B = len(reqs)
        off = drafts.offsets
        room = self.engine.max_model_len - 1 - max(r.cached for r in reqs)
        limit = np.minimum(np.minimum(budgets, max(room, 0)), np.diff(off))
        left = np.fromiter((r.tokens_left for r in reqs), dtype=np.int64, count=B)
        for b in np.flatnonzero(left <= limit):  # (a node's depth is at most its index + 1)
            too_deep = drafts.depths[off[b] : off[b] + limit[b]] >= left[b]
            if too_deep.any():
                limit[b] = int(np.argmax(too_deep))
        empty = np.zeros(0, dtype=np.float32)
        return [drafts.scores[off[b] : off[b] + limit[b]] if use[b] else empty for b in range(B)]

    def _draft_counterfactual(self, reqs: list[Request], greedy: np.ndarray) -> float:
        """A step the allocation's gate keeps plain: drafts and cuts its trees as a drafting step
        would, and keeps them to be checked against the tokens the rows go on to emit
        (planning/counterfactual.py). Greedy batches only (a sampled row's counterfactual depends
        on draws never made); where a draft model defers to retrieval, retrieval's trees alone.
        Returns the seconds it took."""
        eng = self.engine
        if not greedy.all() or (eng.async_drafter is not None and not eng.async_drafter.idle()):
            return 0.0
        t0 = time.perf_counter()
        B = len(reqs)
        depths = eng.allocator.candidate_depths([r.id for r in reqs], B)
        budgets = np.fromiter((d if r.params.speculate and r.draft else 0 for r, d in zip(reqs, depths)), np.int32, B)
        if not budgets.any():
            return 0.0
        if eng.drafting.defers:  # a draft model's pass is no price for a counterfactual: retrieval's trees
            try:
                drafts = eng.drafting.draft_retrieval(
                    [DraftRequest(r.id, r.history(), int(b)) for r, b in zip(reqs, budgets)]
                )
            except Exception as e:  # noqa: BLE001 - a counterfactual is never worth a failed step
                log.warning("drafting a counterfactual tree failed (%s); this step learns nothing", e)
                drafts = None
            use = (budgets > 0) & self._in_vocab(reqs, drafts) if drafts is not None else None
        else:
            drafts, use, _ = self._draft(reqs, budgets)
        if drafts is None:
            return time.perf_counter() - t0
        cands = self._candidates(reqs, drafts, use, budgets)
        a = eng.allocator.allocate(
            [r.id for r in reqs], greedy, cands, cached=int(sum(r.cached for r in reqs)), count=False
        )
        off = drafts.offsets
        rows = [
            (
                r.id,
                drafts.tokens[off[b] : off[b] + c],
                drafts.parents[off[b] : off[b] + c],
                drafts.scores[off[b] : off[b] + c],
            )
            for b, (r, c) in enumerate(zip(reqs, a.counts.tolist()))
            if c and use[b]
        ]
        self._learn_counterfactual(self.counterfactuals.add(B, a.seconds, rows, a.raw_worth))
        return time.perf_counter() - t0

    def _walk_counterfactuals(self, emitted: dict[int, list[int]]) -> None:
        """This step's emitted tokens walk the open counterfactual trees; ended requests' resolve."""
        if not len(self.counterfactuals):
            self._ended.clear()
            return
        done: list = []
        for rid, toks in emitted.items():
            if toks:
                done.extend(self.counterfactuals.advance(rid, toks))
        self._learn_counterfactual(done)
        self._walk_ended()

    def _walk_ended(self) -> None:
        if self._ended:
            done: list = []
            for rid in self._ended:
                done.extend(self.counterfactuals.close(rid))
            self._ended.clear()
            self._learn_counterfactual(done)

    def _learn_counterfactual(self, done: list) -> None:
        """Resolved counterfactual rows teach the acceptance model (live requests only: an ended
        one's counts are forgotten) and resolved steps the gate."""
        if not done:
            return
        allocator, requests = self.engine.allocator, self.engine.requests
        rows = [d for d in done if isinstance(d, tuple) and d[0] in requests and not requests[d[0]].finished]
        if rows:
            allocator.acceptance.observe(
                [rid for rid, _, _ in rows],
                np.ones(len(rows), dtype=bool),
                [c for _, c, _ in rows],
                [y for _, _, y in rows],
            )
        for d in done:
            if isinstance(d, Resolved):
                allocator.observe_counterfactual(d.batch, d.tokens, d.seconds, d.worth)

    def _allocate(
        self, reqs: list[Request], greedy: np.ndarray, drafts: Any, use: np.ndarray, budgets: np.ndarray, prefill: int
    ):
        """The batch-wide cut of the drafted trees (planning/allocation.py): per row a prefix of
        its candidates (`_candidates`). `prefill`: prompt
        tokens the same pass writes (they make verifying cheaper against the step). Returns the cut
        drafts, the rows that keep a draft, nodes per row, the allocation, and the verified nodes'
        scores per row."""
        B = len(reqs)
        cands = self._candidates(reqs, drafts, use, budgets)
        allocation = self.engine.allocator.allocate(
            [r.id for r in reqs], greedy, cands, cached=int(sum(r.cached for r in reqs)), prefill=prefill
        )
        counts = np.where(use, allocation.counts, 0).astype(np.int32)
        if not counts.any() and allocation.candidates:
            key = self.engine.allocator.bucket(B)
            if key not in self._said_nothing_pays:  # once per batch-size bucket, in words
                self._said_nothing_pays.add(key)
                log.info(
                    "batch %d: no draft node is expected to pay for its verification (%d drafted; plain step "
                    "predicted %.1f tok/s); drafts resume when one does. `--budget N` drafts N regardless",
                    B,
                    allocation.candidates,
                    allocation.tokens_per_second,
                )
        drafts = drafts.prefix(counts)
        scores = [cands[b][: counts[b]] for b in range(B)]
        return drafts, use & (counts > 0), counts, allocation, scores

    def grow(self, plan: StepPlan) -> None:
        """Async drafting: hands the drafting thread this step's roots, to grow the next step's trees
        from while the target verifies (serving.drafting.async_draft); nothing in serial mode."""
        a = self.engine.async_drafter
        if a is None or plan.mode != "async" or not plan.budget or a.dead is not None:
            return
        from sssd.serving.drafting.async_draft import GROW

        grow = min(
            GROW * max(plan.budget, plan.cap), int(sssd._core.MAX_BUDGET)
        )  # drafter-side only: the step packs <= budget
        reqs = [r for r, b in zip(plan.requests, plan.budgets) if b > 0]
        asks = [
            DraftRequest(
                r.id,
                r.history(),
                grow,
                0.0 if r.params.greedy else r.params.temperature,
                r.params.top_k,
                r.params.top_p,
            )
            for r in reqs
        ]
        plan.grown = a.submit(self.engine.step_count, asks, {r.id: len(r.tokens) for r in reqs})

    def _draft(self, reqs: list[Request], budgets: np.ndarray) -> tuple[Any, np.ndarray | None, list | None]:
        """The merged drafts of the batch, which rows may use theirs, and every source's
        proposals per row. A drafting failure, or a tree holding ids the model does not know,
        costs only drafts: those rows decode plainly this step."""
        try:
            drafts, proposals = self.engine.drafting.draft_with_proposals(
                [
                    DraftRequest(
                        r.id,
                        r.history(),
                        int(b),
                        0.0 if r.params.greedy else r.params.temperature,
                        r.params.top_k,
                        r.params.top_p,
                    )
                    for r, b in zip(reqs, budgets)
                ]
            )
        except Exception as e:  # noqa: BLE001
            log.warning("drafting failed for this step (%s); decoding without drafts", e)
            return None, None, None
        return drafts, (budgets > 0) & self._in_vocab(reqs, drafts), proposals

    def _draft_async(self, reqs: list[Request], budgets: np.ndarray) -> tuple[Any, np.ndarray | None, list | None]:
        """This step's trees under async drafting: each request's tree grown during the last step,
        re-rooted on its outcome, where it holds one, joined with retrieval's fresh tree (one
        cheap C++ call: a re-rooted tree is shallower than a fresh one) and cut to the budget;
        the others drafted now (serially), unless the drafting thread still holds the pipeline
        (stalled): then they go without."""
        from sssd.serving.drafting.async_draft import best, combine, row_of, union

        eng = self.engine
        a = eng.async_drafter
        B = len(reqs)
        rows: list = [None] * B
        need = np.zeros(B, dtype=bool)
        for b, r in enumerate(reqs):
            if budgets[b] > 0:
                rows[b] = a.take(r.id, len(r.tokens))
                need[b] = rows[b] is None
        hits = np.flatnonzero((budgets > 0) & ~need).tolist()
        if hits and eng.drafting.retrieval and a.idle():
            try:
                fresh = eng.drafting.draft_retrieval(
                    [DraftRequest(reqs[b].id, reqs[b].history(), int(budgets[b])) for b in hits]
                )
            except Exception as e:  # noqa: BLE001 - the re-rooted trees alone are still good drafts
                log.warning("retrieval failed to top up the re-rooted trees (%s); using them alone", e)
                fresh = None
            if fresh is not None:
                for k, b in enumerate(hits):
                    rows[b] = union(rows[b], row_of(fresh, k))
        for b in hits:
            rows[b] = best(rows[b], int(budgets[b]))
        proposals: list = [[] for _ in reqs]
        if need.any() and a.idle():
            drafts, use, props = self._draft(reqs, np.where(need, budgets, 0).astype(np.int32))
            if drafts is not None:
                for b in np.flatnonzero(need & use):
                    rows[b], proposals[b] = row_of(drafts, b), props[b]
        elif need.any():
            log.debug("the drafting thread is busy: %d requests decode without drafts this step", int(need.sum()))
        drafts = combine(rows)
        return drafts, (budgets > 0) & self._in_vocab(reqs, drafts), proposals

    def _in_vocab(self, reqs: list[Request], drafts: Any) -> np.ndarray:
        """[B] rows whose tree holds only ids the model knows (the others are logged)."""
        vocab = self.engine.backend.info.vocab_size
        use = np.ones(len(reqs), dtype=bool)
        if drafts.tokens.size:
            sizes = np.diff(drafts.offsets)
            nonempty = sizes > 0
            top = np.zeros(len(reqs), dtype=np.int64)
            top[nonempty] = np.maximum.reduceat(drafts.tokens, drafts.offsets[:-1][nonempty])
            bad = top >= vocab
            if bad.any():
                for b in np.flatnonzero(bad):
                    log.warning(
                        "request %s: the draft holds token id %d outside the model's vocabulary (%d); dropped",
                        reqs[b].id,
                        int(top[b]),
                        vocab,
                    )
                use &= ~bad
        return use

    # -- launch ----------------------------------------------------------------------------
    def launch(self, plan: StepPlan) -> Any:
        """Starts the forward pass over the plan's trees."""
        eng = self.engine
        plan.launched = plan.times["launched"] = time.perf_counter()
        topk = eng.drafting.observe_topk if eng.drafting is not None else 0
        B = len(plan.requests)
        batch, rows, greedy, extra = plan.batch, slice(0, B), plan.greedy, {}
        if plan.prefill is not None:  # the prompt chunk's slots follow the rows': one pass writes both
            chunk = plan.prefill
            assert chunk.slots.start == B, "a fused prompt chunk must sit in the slots right after the rows"
            batch, rows = stack(plan.batch, chunk.batch), slice(0, chunk.slots.stop)
            greedy = np.concatenate([plan.greedy, np.ones(len(chunk.requests), dtype=bool)])
            extra["heads"] = B
        if topk:  # a source observes the target's top-k next tokens (asked for only then)
            extra["topk"] = topk
        return eng.backend.launch(rows, batch, greedy, **extra)

    # -- finish ----------------------------------------------------------------------------
    def finish(self, plan: StepPlan, handle: Any) -> None:
        """Accepts, compacts the KV cache, emits tokens and updates the drafters.

        Shared work (the forward pass) failing fails the step; a failure that belongs
        to one request (its sampling, its stop check, its output) finishes that request
        with an error and the others go on.
        """
        eng = self.engine
        out = eng.backend.collect(handle)
        t_forward = time.perf_counter() - plan.launched
        plan.times["forward"] = time.perf_counter()
        if plan.prefill is not None:  # before any slot moves: a swap copies only the positions cached
            out = out.cropped(plan.batch.shape[1])
            eng.scheduler.written(plan.prefill)
            eng.metrics.prefill(plan.prefill.tokens, 0.0, fused=True)
        outcome = self._accept(plan, out)
        if plan.scores is not None:
            self._learn_acceptance(plan, outcome)
        plan.times["accepted"] = time.perf_counter()
        # async: the drafting thread must let go of the pipeline before requests stop or extend
        job = eng.async_drafter.wait() if plan.grown else None
        plan.times["waited"] = time.perf_counter()
        path_tokens, path_sources = self._compact(plan.batch, outcome)
        emitted, verified, accepted = self._emit(plan, outcome, path_tokens, path_sources)
        self._walk_counterfactuals(emitted)
        for req in plan.requests:  # slots move only now that every row is done
            if req.finished:
                eng.retire(req)
        n_emitted = sum(len(v) for v in emitted.values())
        eng.metrics.decode_step(
            len(plan.requests),
            int(plan.batch.sizes.sum()),
            plan.budget,
            plan.draft_seconds,
            t_forward,
            n_emitted,
            accepted,
        )
        self._update_sources(plan, out, outcome.errors, emitted, job)
        self._measure(plan, t_forward, accepted, n_emitted, verified, job)

    def _accept(self, plan: StepPlan, out) -> _Outcome:
        """Greedy rows by the argmax, sampled rows by the sampling walk (and multi-step speculative
        sampling where a source drew candidates)."""
        reqs, batch = plan.requests, plan.batch
        B = len(reqs)
        node, count, bonus = (np.zeros(B, dtype=np.int64) for _ in range(3))
        errors: dict[int, str] = {}
        g = np.flatnonzero(plan.greedy)
        if g.size:
            acc = accept_greedy(batch, out.argmax, g)
            node[g], count[g], bonus[g] = acc.node, acc.count, acc.bonus
        s = np.flatnonzero(~plan.greedy)
        if s.size:
            samplers = [
                Sampler(reqs[b].params.temperature, reqs[b].params.top_k, reqs[b].params.top_p, reqs[b].generator)
                for b in s
            ]
            logits, index = out.logits, out.logit_index
            acc, errs = accept_sampled(
                batch,
                s,
                samplers,
                lambda rows, idx: logits[torch.from_numpy(index[rows, idx])],
                self.engine.generator,
                None if plan.trials is None else [plan.trials[b] for b in s],
            )
            node[s], count[s], bonus[s] = acc.node, acc.count, acc.bonus
            errors.update({int(s[j]): e for j, e in enumerate(errs) if e})
        return _Outcome(node, count, bonus, errors)

    def _learn_acceptance(self, plan: StepPlan, outcome: _Outcome) -> None:
        """Which verified nodes were accepted, per row, for the allocation's acceptance model."""
        batch = plan.batch
        rows = [b for b in range(len(plan.requests)) if plan.budgets[b] > 0 and b not in outcome.errors]
        if not rows:
            return
        conds, outcomes = [], []
        for b in rows:
            n = int(plan.budgets[b])
            accepted = batch.ancestors[b, outcome.node[b], 1 : 1 + n]
            c, y = trials(plan.scores[b], batch.parents[b, 1 : 1 + n] - 1, accepted)  # packed -> local
            conds.append(c)
            outcomes.append(y)
        self.engine.allocator.acceptance.observe(
            [plan.requests[b].id for b in rows], plan.greedy[rows], conds, outcomes
        )

    def _compact(self, batch: TreeBatch, outcome: _Outcome) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Moves every accepted path's K/V down to consecutive positions, in one move; returns each
        row's accepted path tokens and their sources."""
        B = batch.shape[0]
        path = batch.ancestors[np.arange(B), outcome.node]
        path[:, 0] = False
        for b in outcome.errors:
            path[b] = False
        pb, pi = np.nonzero(path)
        rank = (np.cumsum(path, axis=1) - 1)[pb, pi]
        src, dst = batch.cached[pb] + pi, batch.cached[pb] + 1 + rank
        moved = src != dst
        if moved.any():
            self.engine.backend.compact(pb[moved], src[moved], dst[moved])
            self.engine.metrics.kv_moves += int(np.unique(pb[moved]).size)
        cuts = np.cumsum(np.bincount(pb, minlength=B))[:-1]
        return np.split(batch.tokens[pb, pi], cuts), np.split(batch.sources[pb, pi], cuts)

    def _emit(self, plan: StepPlan, outcome: _Outcome, path_tokens, path_sources):
        """Each row's accepted tokens and bonus token into its request (stop conditions honoured),
        with its stats. Returns the tokens kept per request, the greedy rows' verified tokens (for
        the deferral) and the accepted draft tokens per row."""
        eng, batch = self.engine, plan.batch
        names = eng.drafting.source_names if eng.drafting is not None else {}
        emitted: dict[int, list[int]] = {}
        verified: dict[int, tuple[list[int], int | None]] = {}
        accepted = []
        for b, req in enumerate(plan.requests):
            if b in outcome.errors:
                eng.finish_request(req, "error", retire=False, error=outcome.errors[b])
                accepted.append(0)
                continue
            try:
                a = int(outcome.count[b])
                req.cached += 1 + a
                st = req.stats
                st.steps += 1
                st.drafted += int(batch.sizes[b]) - 1
                st.accepted += a
                st.accepted_per_step.append(a)
                st.budgets.append(int(plan.budgets[b]))
                for src_tag in path_sources[b].tolist():
                    if src_tag != NO_SOURCE:
                        name = names.get(src_tag, "external")
                        st.accepted_by_source[name] = st.accepted_by_source.get(name, 0) + 1
                        eng.metrics.accepted_by_source[name] = eng.metrics.accepted_by_source.get(name, 0) + 1
                toks = path_tokens[b].tolist() + [int(outcome.bonus[b])]
                emitted[req.id] = eng.emit(req, toks)
                if plan.greedy[b]:
                    verified[req.id] = (toks, len(emitted[req.id]) if req.finished else None)
                accepted.append(a)
            except Exception as e:  # noqa: BLE001 - this request's failure is this request's alone
                log.exception("request %s failed in its decode step", req.id)
                eng.finish_request(req, "error", retire=False, error=f"{type(e).__name__}: {e}")
                accepted.append(0)
        return emitted, verified, accepted

    def _update_sources(
        self, plan: StepPlan, out, errors: dict[int, str], emitted: dict[int, list[int]], job: Any
    ) -> None:
        """The draft sources learn what was verified (top-k observers) and what was emitted."""
        eng = self.engine
        if eng.drafting is None:
            return
        if out.topk is not None:
            eng.drafting_call(self._observe, plan.requests, plan.batch, out.topk, errors)
        live = [
            (rid, toks)
            for rid, toks in emitted.items()
            if toks and not eng.requests[rid].finished and eng.requests[rid].draft
        ]
        if eng.async_drafter is not None:  # the next step's trees: the grown ones, re-rooted
            if job is not None:
                eng.async_drafter.reroot_all(job, dict(live))
            else:
                eng.async_drafter.prepared.clear()
        if live:
            eng.drafting_call(self._extend, live)

    def _measure(
        self, plan: StepPlan, t_forward: float, accepted: list[int], n_emitted: int, verified: dict, job: Any
    ) -> None:
        """What the measuring controllers see of the step: its wall time and tokens."""
        eng = self.engine
        B = len(plan.requests)
        seconds = time.perf_counter() - plan.started
        if plan.prefill is not None:
            # the pass also wrote a prompt chunk: its times are no decode step's, so the cost models
            # do not see them (only what the chunk added, and how the drafts' worth compared with
            # what they gave)
            if eng.allocator is not None:
                eng.allocator.observe_prefill(B, int(plan.budgets.sum()), plan.cached, plan.prefill.tokens, t_forward)
            if plan.allocation is not None:
                a = plan.allocation
                eng.allocator.observe(
                    B, int(plan.budgets.sum()), 0.0, 0.0, n_emitted, expected=(a.expected_tokens, a.seconds)
                )
            if eng.metrics.timeline is not None:
                eng.metrics.timeline.append(timeline_entry(plan, job, n_emitted, sum(accepted), time.perf_counter()))
            return
        if plan.allocation is not None:
            a = plan.allocation
            eng.allocator.observe(
                B,
                int(plan.budgets.sum()),
                t_forward,
                seconds,
                n_emitted,
                a.tokens_per_second,
                expected=(a.expected_tokens, a.seconds),
                cached=plan.cached,
            )
        elif eng.allocator is not None:  # (plain decoding spends no counterfactual drafting)
            eng.allocator.observe_plain(B, seconds - plan.counterfactual, t_forward, plan.cached)
        else:
            eng.planner.observe(B, plan.budget, seconds, n_emitted)
        if eng.drafting is not None and plan.budget:  # what the deferral of costly sources measures
            eng.drafting.deferral.observe_step(
                B, t_forward, {r.id: a for r, a in zip(plan.requests, accepted)}, seconds, n_emitted, verified
            )
        if eng.mode_chooser is not None and plan.budget:
            eng.mode_chooser.observe(B, plan.mode, seconds, n_emitted)
        if eng.metrics.timeline is not None:
            eng.metrics.timeline.append(timeline_entry(plan, job, n_emitted, sum(accepted), time.perf_counter()))

    def _extend(self, live: list[tuple[int, list[int]]]) -> None:
        eng = self.engine
        try:
            eng.drafting.extend_batch([rid for rid, _ in live], [toks for _, toks in live])
        except Exception as e:  # noqa: BLE001 - rebuild each state from the request's own tokens
            log.warning("drafter update failed (%s); reopening the requests' drafter states", e)
            for rid, _ in live:
                eng.reopen_draft(eng.requests[rid])

    def _observe(self, reqs: list[Request], batch: TreeBatch, topk: np.ndarray, errors: dict[int, str]) -> None:
        """Shows the observing draft sources every node verified this step (rows that failed aside)."""
        seen = batch.valid & (topk[:, :, 0] >= 0)
        for b in errors:
            seen[b] = False
        b, i = np.nonzero(seen)
        if b.size:
            ids = np.fromiter((r.id for r in reqs), dtype=np.int64, count=len(reqs))
            self.engine.drafting.observe_verified(ids[b], batch.tokens[b, i], topk[b, i])
