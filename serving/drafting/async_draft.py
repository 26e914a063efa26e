"""Asynchronous drafting (SwiftSpec, ../shared/papers/000_swiftspec.txt): the next step's trees
grow beside the target's forward pass.

With `draft_mode="async"` a step runs so:

1. prepare: every request whose last step's outcome lies inside the tree grown during that
   step takes the subtree below its accepted path and bonus token (re-rooted), joins it
   with retrieval's fresh tree (one C++ call of tens of microseconds: retrieval's trees
   re-rooted from an older root are shallower than fresh ones) and keeps its best nodes up
   to the step's budget (best-first by merge priority: a set closed under parents); the
   others (misses, new requests) are topped up by drafting serially, the same call a
   serial step makes. The merged trees are packed.
2. the drafting worker (one thread) starts growing, from this step's root, a tree of
   GROW times the budget (sources that can grow deeper, the model drafter, keep adding
   levels until the verifier is done), while
3. the main thread runs the target's forward pass (torch and the C++ drafter both release
   the GIL) and accepts;
4. finish waits for the worker (a deadline: `stall_seconds`), then re-roots its tree on each
   request's accepted path and bonus token for the next step.

The next root is the bonus token, which the verified tree never holds below the accepted
path (it would have been accepted); a grown tree holds it when the drafter guessed one
token further, or another branch, than the verified tree. Where it does not, the request
drafts serially next step, so async costs acceptance, never correctness: the trees are
drafted from the same tokens a serial step would see, and they are verified as any
other (sampled requests by the walk, which is exact for candidates chosen independently
of the target's draws; the grown tree's own draws are not carried over).

Sources' state (open / extend / close) is only touched while the worker is idle: the
engine waits for it before emitting, and mutations that come while a stalled worker still
runs are queued (`mutate`) and applied, in order, once it is free. A worker that stalls
past the deadline leaves its step without grown trees (logged); one that dies turns
async drafting off (logged); no request waits on it.

Whether async pays is measured (`ModeChooser`): per batch-size bucket it runs blocks of
steps in each mode and keeps the faster in tokens per second, probing the other now and
then; where nothing is hidden (one core, a drafter slower than the forward pass, or
drafting too cheap to matter), steps run serially.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from sssd.serving.planning.measured_choice import MeasuredChoice, bucket
from sssd.tree import DraftBatch

log = logging.getLogger("sssd.serving")

#: The grown tree's budget, in multiples of the step's (capped by the drafter's largest).
GROW = 4
#: Seconds finish waits for the worker beyond which it is taken as stalled.
STALL_SECONDS = 5.0
#: Steps per measured block of one mode (ModeChooser), and blocks of the winner between probes.
BLOCK_STEPS, PROBE_EVERY = 8, 8


# -- re-rooting ------------------------------------------------------------------------------
def reroot(drafts: DraftBatch, row: int, path: Sequence[int], budget: int) -> dict[str, np.ndarray] | None:
    """Row `row`'s subtree below the node reached by `path` (tokens from the root), its best
    `budget` nodes, re-indexed as a tree of its own (parents precede children, depths from
    the new root); None if the tree does not hold the whole path.

    Best-first by the merge's scores (a path's priority): the kept set is closed under
    parents whatever the scores, since a node enters only after its parent.
    """
    s, e = int(drafts.offsets[row]), int(drafts.offsets[row + 1])
    toks = drafts.tokens[s:e].tolist()
    pars = drafts.parents[s:e].tolist()
    children: dict[int, list[int]] = {}
    for i, p in enumerate(pars):
        children.setdefault(p, []).append(i)
    node = -1
    for t in path:
        node = next((c for c in children.get(node, ()) if toks[c] == t), None)
        if node is None:
            return None
    if budget <= 0:
        return _subtree(drafts, s, [], {})
    scores = drafts.scores[s:e]
    heap = [(-float(scores[c]), c) for c in children.get(node, ())]
    heapq.heapify(heap)
    kept: list[int] = []
    while heap and len(kept) < budget:
        _, c = heapq.heappop(heap)
        kept.append(c)
        for k in children.get(c, ()):
            heapq.heappush(heap, (-float(scores[k]), k))
    kept.sort()  # original order: parents still precede children
    return _subtree(drafts, s, kept, {node: -1})


def _subtree(drafts: DraftBatch, start: int, kept: list[int], index: dict[int, int]) -> dict[str, np.ndarray]:
    idx = np.asarray(kept, dtype=np.int64)
    for j, i in enumerate(kept):
        index[i] = j
    parents = np.fromiter((index[int(p)] for p in drafts.parents[start + idx]), dtype=np.int32, count=len(kept))
    depths = np.zeros(len(kept), dtype=np.int32)
    for j, p in enumerate(parents.tolist()):
        depths[j] = 1 if p < 0 else depths[p] + 1
    out = {
        "tokens": drafts.tokens[start + idx],
        "parents": parents,
        "depths": depths,
        "scores": drafts.scores[start + idx],
        "sources": drafts.sources[start + idx],
        "draft_probs": drafts.draft_probs[start + idx],
    }
    for name in ("probs", "match_lens"):
        v = getattr(drafts, name)
        if v is not None:
            out[name] = v[start + idx]
    return out


def union(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Two trees over one root as one: a token path in both appears once, with the fields of
    the higher-scored of its two nodes; a's nodes first, then b's new ones (parents still
    precede children). Fields that only one tree has are dropped."""
    keys = [
        k
        for k in ("tokens", "parents", "depths", "scores", "sources", "draft_probs", "probs", "match_lens")
        if k in a and k in b
    ]
    out = {k: a[k].tolist() for k in keys}
    node = {(p, t): i for i, (p, t) in enumerate(zip(out["parents"], out["tokens"]))}
    mine: list[int] = []  # b's node j -> its index in out
    b_vals = {k: b[k].tolist() for k in keys}
    for j, (pb, t) in enumerate(zip(b_vals["parents"], b_vals["tokens"])):
        p = -1 if pb < 0 else mine[pb]
        i = node.get((p, t))
        if i is None:
            i = node[(p, t)] = len(out["tokens"])
            for k in keys:
                out[k].append(b_vals[k][j])
            out["parents"][i] = p
            out["depths"][i] = 1 if p < 0 else out["depths"][p] + 1
        elif b_vals["scores"][j] > out["scores"][i]:
            for k in keys:
                if k not in ("tokens", "parents", "depths"):
                    out[k][i] = b_vals[k][j]
        mine.append(i)
    return {k: np.asarray(out[k], dtype=a[k].dtype) for k in keys}


def best(tree: dict[str, np.ndarray], budget: int) -> dict[str, np.ndarray]:
    """A tree's best `budget` nodes (best-first by score, closed under parents), itself if it fits."""
    if len(tree["tokens"]) <= budget:
        return tree
    return reroot(combine([tree]), 0, [], budget)


def combine(rows: Sequence[dict[str, np.ndarray] | None], like: DraftBatch | None = None) -> DraftBatch:
    """One DraftBatch from per-row trees (None: an empty tree), in row order."""
    sizes = np.array([0 if r is None else len(r["tokens"]) for r in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    dtypes = {
        "tokens": np.int64,
        "parents": np.int32,
        "depths": np.int32,
        "scores": np.float32,
        "sources": np.uint8,
        "draft_probs": np.float32,
    }
    out: dict[str, Any] = {"offsets": offsets}
    for name, dt in dtypes.items():
        parts = [r[name] for r in rows if r is not None]
        out[name] = np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)
    for name, dt in (("probs", np.float32), ("match_lens", np.uint8)):
        if all(r is None or name in r for r in rows) and any(r is not None for r in rows):
            out[name] = np.concatenate([r[name] for r in rows if r is not None]).astype(dt)
    return DraftBatch(**out)


def row_of(drafts: DraftBatch, b: int) -> dict[str, np.ndarray]:
    """Row b of a DraftBatch as a per-row tree (combine's input)."""
    s = slice(int(drafts.offsets[b]), int(drafts.offsets[b + 1]))
    out = {k: getattr(drafts, k)[s] for k in ("tokens", "parents", "depths", "scores", "sources", "draft_probs")}
    for name in ("probs", "match_lens"):
        if getattr(drafts, name) is not None:
            out[name] = getattr(drafts, name)[s]
    return out


# -- the worker ------------------------------------------------------------------------------
@dataclass
class _Job:
    step: int
    requests: list
    lengths: dict[int, int]  # request id -> its tokens when the job was drafted (the root's)
    submitted: float
    started: float = 0.0
    ended: float = 0.0
    drafts: DraftBatch | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class AsyncDrafter:
    """One drafting thread growing the next step's trees beside the verifier.

    Args:
        pipeline: the engine's DraftPipeline (sssd.sources): the worker calls its
            draft_with_proposals; every other call goes through `mutate`.
        threads: torch threads of the worker (a model drafter's passes); None: torch's default.
        cores: CPU cores the worker (and the threads it starts) runs on; None: any.
        stall_seconds: how long `wait` waits before taking the worker as stalled.

    Placement (`place`) applies from the next job on: on two cores, `threads=1, cores={1}`
    beside a verifier on one torch thread pinned to core 0 gives each its own core.
    """

    def __init__(
        self,
        pipeline: Any,
        threads: int | None = None,
        cores: set[int] | None = None,
        stall_seconds: float = STALL_SECONDS,
    ):
        self.pipeline = pipeline
        self.threads, self.cores = threads, cores
        self._placed: tuple = (None, None)
        self.stall_seconds = float(stall_seconds)
        self.prepared: dict[int, tuple[int, dict[str, np.ndarray]]] = {}  # request id -> (its length, tree)
        self.verifying = threading.Event()  # set while the verifier runs: growing sources may keep going
        self.dead: str | None = None  # why the worker is gone (async drafting then stops)
        self.stalls = self.hits = self.misses = 0
        self._lock = threading.Lock()  # held by whoever touches the pipeline
        self._pending: list[tuple[Callable, tuple]] = []
        self._job: _Job | None = None  # the one job submitted and not yet waited for or abandoned
        self._busy: _Job | None = None  # the job the worker runs (maybe an abandoned one)
        self._wake = threading.Condition()
        self._queue: list[_Job] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sssd-drafter", daemon=True)
        self._thread.start()

    # -- the pipeline's state ----------------------------------------------------------------
    def mutate(self, fn: Callable, *args: Any) -> None:
        """Calls fn(*args) on the pipeline now if the worker is idle, else once it is (in order)."""
        if self._pending or not self._lock.acquire(blocking=False):
            self._pending.append((fn, args))
            return
        try:
            fn(*args)
        finally:
            self._lock.release()

    def idle(self) -> bool:
        """True (with queued mutations applied) if the worker holds nothing: the pipeline may be used."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._flush()
        finally:
            self._lock.release()
        return self._busy is None and not self._queue

    def _flush(self) -> None:
        while self._pending:
            fn, args = self._pending.pop(0)
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - as the direct call would have: logged by the caller's wrapper
                log.warning("a deferred drafter update failed (%s)", e)

    # -- jobs ----------------------------------------------------------------------------------
    def submit(self, step: int, requests: list, lengths: dict[int, int]) -> bool:
        """Starts growing trees for `requests` (DraftRequests at this step's roots); False if the
        worker is dead or still busy (stalled): then this step grows nothing."""
        if self.dead is not None or self._busy is not None or self._queue or self._pending:
            return False
        job = _Job(step, requests, lengths, time.perf_counter())
        self._job = job
        self.verifying.set()
        with self._wake:
            self._queue.append(job)
            self._wake.notify()
        return True

    def wait(self) -> _Job | None:
        """The submitted job once done (None: none submitted, or stalled past the deadline, or
        failed: logged). The verifier is done: growing sources stop at their next level."""
        self.verifying.clear()
        job, self._job = self._job, None
        if job is None:
            return None
        if not job.done.wait(self.stall_seconds):
            self.stalls += 1
            alive = self._thread.is_alive()
            if not alive:
                self.dead = self.dead or "the drafting thread died"
            log.warning(
                "the drafting worker %s after %.1f s; this step goes on without grown trees",
                "died" if not alive else "stalled",
                self.stall_seconds,
            )
            return None
        if job.error is not None and self.dead is not None:
            return None  # logged by the dying thread
        if job.error is not None:
            log.warning("asynchronous drafting failed this step (%s); the next step drafts serially", job.error)
            return None
        return job

    def place(self, threads: int | None = None, cores: set[int] | None = None) -> None:
        """The worker's torch threads and cores from its next job on (None: as they are)."""
        self.threads, self.cores = threads, cores

    def _apply_placement(self) -> None:
        want = (self.threads, None if self.cores is None else frozenset(self.cores))
        if want == self._placed:
            return
        import os

        import torch

        if self.threads:
            torch.set_num_threads(self.threads)  # per thread: the verifier's are its own
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)  # this thread only (Linux: 0 is the calling thread)
        self._placed = want

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._queue and not self._closed:
                        self._wake.wait()
                    if self._closed:
                        return
                    job = self._queue.pop(0)
                    self._busy = job
                self._apply_placement()
                with self._lock:
                    job.started = time.perf_counter()
                    growers = [s for s in getattr(self.pipeline, "external", ()) if hasattr(s, "grow")]
                    try:
                        for s in growers:  # a model drafter adds levels while the verifier runs
                            s.grow = self.verifying.is_set
                        job.drafts, _ = self.pipeline.draft_with_proposals(job.requests, verified_next=False)
                    except Exception as e:  # noqa: BLE001 - a failed draft costs that step's grown trees
                        job.error = f"{type(e).__name__}: {e}"
                    except BaseException as e:  # the thread goes: its job says why at once
                        job.error = self.dead = f"{type(e).__name__}: {e}"
                        job.done.set()
                        raise
                    finally:
                        for s in growers:
                            s.grow = None
                    job.ended = time.perf_counter()
                    self._flush()
                    self._busy = None
                job.done.set()
        except BaseException as e:  # noqa: BLE001 - the thread dies: say why; the engine drafts serially
            self.dead = f"{type(e).__name__}: {e}"
            log.error("the drafting worker died (%s); drafting serially from now on", self.dead)
            self._busy = None  # the thread ends here (said, not raised again: nobody joins it)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    # -- re-rooting ----------------------------------------------------------------------------
    def reroot_all(self, job: _Job, outcomes: dict[int, list[int]]) -> None:
        """Keeps, per request in `outcomes` (request id -> the tokens it appended: accepted path and
        bonus), the grown tree's subtree below them for the next step (at most the grown budget)."""
        self.prepared.clear()
        if job.drafts is None:
            return
        where = {r.request_id: k for k, r in enumerate(job.requests)}
        for rid, path in outcomes.items():
            k = where.get(rid)
            if k is None or not path:
                continue
            sub = reroot(job.drafts, k, path, int(job.requests[k].budget))
            if sub is not None and len(sub["tokens"]):
                self.prepared[rid] = (job.lengths[rid] + len(path), sub)
                self.hits += 1
            else:
                self.misses += 1

    def take(self, request_id: int, length: int) -> dict[str, np.ndarray] | None:
        """The prepared tree of a request whose tokens number `length`, whole (`best` cuts it)."""
        got = self.prepared.pop(request_id, None)
        if got is None or got[0] != length:
            return None
        return got[1]


# -- measured mode choice ------------------------------------------------------------------
class ModeChooser(MeasuredChoice):
    """Chooses, per batch-size bucket, serial or async drafting by measured tokens per second
    (sssd.serving.planning.measured_choice): blocks of BLOCK_STEPS steps in one mode, serial first (the known
    cost), then the faster, the other probed every PROBE_EVERY blocks."""

    bucket = staticmethod(bucket)

    def __init__(self, block: int = BLOCK_STEPS, probe_every: int = PROBE_EVERY, fixed: str | None = None):
        super().__init__(("serial", "async"), block, probe_every, fixed)

    def mode(self, batch: int) -> str:
        return self.choose(batch)
