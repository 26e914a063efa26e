"""SpecPipe: pipelined speculative token trees over pipeline stages (pipeline_backend.py).

Plain pipelined decoding of one request keeps one stage busy at a time: a
token enters stage 0 and its successor can enter only once the last stage
has produced it, S pipeline steps later. SpecPipe (Yin et al.,
arXiv 2504.04104, ../shared/papers/002_specpipe.txt) fills the pipeline with
a speculative tree instead. Every pipeline step:

1. layer appending: draft nodes enter stage 0 under the in-flight tree
   (up to `width` nodes, at most `levels` levels beyond its deepest one:
   levels=1 is the paper's one tree layer per step), while every stage k > 0
   computes the nodes stage k - 1 computed the step before;
2. node-wise computation, all stages at once (each its own process);
3. verification at the last stage: the root (the last committed token) has
   just left it, so the target's next token there is known. If a child of
   the root holds it, that child is accepted and, if the last stage has
   computed it too (it entered with the root), the walk goes on from it;
   the first accepted node still in flight becomes the new root. If no child
   holds it, it is the bonus token and the pipeline is flushed: it enters
   stage 0 next step as the new root;
4. pruning propagation: every node off the new root's subtree is dropped:
   the next step's stages take only the surviving rows of what they received
   (pipeline_backend.Work.take), and their arena positions are reused;
   accepted nodes' K/V move (in every stage that holds them) to their
   places in the slot's committed prefix.

So one token is committed per pipeline step while the drafts hold, and per
S steps (plain pipelined decoding) after a flush. With no draft sources it
is plain pipelined decoding, in the same code.

Drafting goes through the engine's DraftPipeline (retrieval, model:<name>,
any DraftSource): each step drafts a tree from the committed tokens, finds
the in-flight nodes in it by token path and appends the best-scored draft
nodes hanging under them (scores: the merged tree's priorities, the
cumulative probability of the paper's fixed-width beam rule).

Acceptance follows the engine's rules (acceptance.py): greedy rows take the
target's argmax; sampled rows draw each token with `accept_sampled` over the
node alone (one uniform from the request's generator per token, as plain
decoding), and the draw only decides which child, if any, the walk enters:
every emitted token is the target's own draw.

KV layout (per slot, in every stage): committed tokens at their positions
[0, root); the root at its position; in-flight nodes in the slot's arena
(PipelineBackend.arena positions after `capacity`), each stage reading per
row exactly the positions its queries may see.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass

import numpy as np

from sssd.serving.backends.pipeline_backend import PipelineBackend, PipelineError, Work
from sssd.serving.verify.acceptance import Sampler, accept_sampled
from sssd.serving.verify.tree_batch import pack

log = logging.getLogger("sssd.serving")

#: Draft nodes entering stage 0 per request and pipeline step, unless the engine's budget says.
DEFAULT_WIDTH = 4
#: Tree levels a step may add below the deepest in-flight node (1: the paper's layer per step).
DEFAULT_LEVELS = 1


class _Node:
    __slots__ = ("token", "parent", "pos", "home", "stage", "children", "alive", "source")

    def __init__(self, token: int, parent: _Node | None, pos: int, home: int, source: int = -1):
        self.token, self.parent, self.pos, self.home, self.source = token, parent, pos, home, source
        self.stage = 0  # stages that have computed it
        self.children: list[_Node] = []
        self.alive = True

    def child(self, token: int) -> _Node | None:
        for c in self.children:
            if c.alive and c.token == token:
                return c
        return None

    def path(self) -> list[_Node]:
        """Itself and its in-flight ancestors up to the root."""
        out, n = [], self
        while n is not None:
            out.append(n)
            n = n.parent
        return out


class _Flight:
    """One request's in-flight tree."""

    def __init__(self, token: int, pos: int, arena: range):
        self.root = _Node(token, None, pos, pos)
        self.entered = False  # the root has entered stage 0
        self.free = list(reversed(arena))

    def subtree(self) -> list[_Node]:
        out, todo = [], [self.root]
        while todo:
            n = todo.pop()
            if n.alive:
                out.append(n)
                todo.extend(n.children)
        return out

    def drop(self, keep: _Node | None, capacity: int) -> None:
        """Kills every node outside `keep`'s subtree (all of them if None), freeing arena positions."""
        kept = set()
        if keep is not None:
            todo = [keep]
            while todo:
                n = todo.pop()
                kept.add(id(n))
                todo.extend(c for c in n.children if c.alive)
        todo = [self.root]
        while todo:
            n = todo.pop()
            todo.extend(n.children)
            if id(n) in kept or not n.alive:
                continue
            n.alive = False
            if n.home >= capacity:
                self.free.append(n.home)


@dataclass
class PipeStats:
    """Counts of the pipelined schedule (for benchmarks)."""

    steps: int = 0  # pipeline steps
    emitted: int = 0  # tokens committed
    verified: int = 0  # (request, step) pairs whose root left the last stage
    flushes: int = 0  # verifications whose token no child held (the pipeline refills)
    nodes: int = 0  # nodes computed by stage 0 (roots and drafts)
    seconds: float = 0.0  # wall time in decode steps


class SpecPipe:
    """The pipelined decode loop of an LLMEngine over a PipelineBackend (LLMEngine.step delegates).

    Args:
        engine: the engine (its requests, drafting, emission and metrics are used as they are).
        width: draft nodes per request entering per step (default: the engine's fixed budget, else
            DEFAULT_WIDTH; 0 without draft sources: plain pipelined decoding).
        levels: tree levels a step may add (1: the paper's one layer per step).
    """

    def __init__(self, engine, width: int | None = None, levels: int = DEFAULT_LEVELS):
        backend = engine.backend
        if not isinstance(backend, PipelineBackend):
            raise ValueError(f"pipeline_stages > 1 needs a PipelineBackend, got {type(backend).__name__}")
        if backend.stages != engine.config.pipeline_stages:
            raise ValueError(
                f"the backend has {backend.stages} pipeline stages, the engine config {engine.config.pipeline_stages}"
            )
        self.engine, self.backend = engine, backend
        self.S = backend.stages
        if width is None:
            width = engine.config.budget if engine.config.budget is not None else DEFAULT_WIDTH
        self.width = width if engine.drafting is not None else 0
        if levels < 1:
            raise ValueError(f"levels must be >= 1, got {levels}")
        self.levels = levels
        self.flights: dict[int, _Flight] = {}
        self.inbox: list[list[_Node]] = [[] for _ in range(self.S)]  # what stage k received last step, in order
        self.stats = PipeStats()

    # -- one pipeline step ----------------------------------------------------------------------
    def decode(self) -> None:
        try:
            self._step()
        except PipelineError:
            self.flights.clear()
            self.inbox = [[] for _ in range(self.S)]
            raise

    def _step(self) -> None:
        eng, be, S = self.engine, self.backend, self.S
        t0 = time.perf_counter()
        reqs = eng.decoding()
        live = {r.id for r in reqs}
        for rid in [rid for rid in self.flights if rid not in live]:
            self.flights.pop(rid).drop(None, be.capacity)
        arena = range(be.capacity, be.capacity + be.arena)
        for r in reqs:
            if r.id not in self.flights:
                self.flights[r.id] = _Flight(int(r.tokens[-1]), r.cached, arena)
                r.cached += 1  # the root's position is in use (slot swaps copy it)
        # 1. layer appending
        packets: dict[int, list[_Node]] = {}
        for r in reqs:
            f = self.flights[r.id]
            if not f.entered:
                packets[r.id] = [f.root]
                f.entered = True
        added = self._draft(reqs)
        for rid, nodes in added.items():
            packets.setdefault(rid, []).extend(nodes)
        t_draft = time.perf_counter() - t0
        # 2. every stage's nodes, grouped by request in slot order
        order = sorted(reqs, key=lambda r: r.slot)
        per_stage: list[list[tuple[object, list[_Node]]]] = []
        per_stage.append([(r, packets[r.id]) for r in order if packets.get(r.id)])
        for k in range(1, S):
            alive = {}
            for n in self.inbox[k]:
                if n.alive:
                    alive.setdefault(id(self._root_of(n)), []).append(n)
            per_stage.append(
                [(r, alive[id(self.flights[r.id].root)]) for r in order if id(self.flights[r.id].root) in alive]
            )
        index = [{id(n): i for i, n in enumerate(self.inbox[k])} for k in range(S)]
        greedy = {r.id: r.params.greedy for r in reqs}
        works = []
        for k in range(S):
            prev = sum(len(ns) for _, ns in per_stage[k - 1]) if k > 0 else 0
            works.append(self._work(k, per_stage[k], index[k], prev, greedy))
        be.submit(works)
        for k in range(S):
            for _, ns in per_stage[k]:
                for n in ns:
                    n.stage = k + 1
        self.inbox = [[]] + [[n for _, ns in per_stage[k - 1] for n in ns] for k in range(1, S)]
        self.stats.steps += 1
        entered = sum(len(ns) for _, ns in per_stage[0])
        self.stats.nodes += entered
        # 3. verification where a root left the last stage
        outputs: dict[int, tuple[int, int]] = {}
        logits = None
        last = [n for _, ns in per_stage[S - 1] for n in ns]
        if last:
            _, am, logits, _ = be.result("a pipeline step")
            s = 0
            for i, n in enumerate(last):
                outputs[id(n)] = (int(am[i]), -1 if am[i] >= 0 else s)
                s += am[i] < 0
        t_forward = time.perf_counter() - t0 - t_draft
        emitted: dict[int, list[int]] = {}
        accepted: list[int] = []
        moves: list[tuple[list, list, list]] = [([], [], []) for _ in range(S)]
        for r, _ in per_stage[S - 1]:
            f = self.flights[r.id]
            if id(f.root) not in outputs:
                continue
            try:
                toks, a, tags = self._verify(r, f, outputs, logits, moves)
            except _RowError as e:
                eng.finish_request(r, "error", retire=False, error=str(e))
                self.flights.pop(r.id).drop(None, be.capacity)
                continue
            accepted.append(a)
            try:
                emitted[r.id] = eng.emit(r, toks)
                self._count(r, emitted[r.id], tags[: len(emitted[r.id])])  # what a stop cut off is not counted
            except Exception as e:  # noqa: BLE001 - this request's failure is its own
                log.exception("request %s failed in its decode step", r.id)
                eng.finish_request(r, "error", retire=False, error=f"{type(e).__name__}: {e}")
            if r.finished:
                self.flights.pop(r.id).drop(None, be.capacity)
        be.move(
            [
                (np.asarray(sl, dtype=np.int64), np.asarray(sr, dtype=np.int64), np.asarray(ds, dtype=np.int64))
                for sl, sr, ds in moves
            ]
        )
        for r in reqs:  # slots move only now that every row is done
            if r.finished:
                eng.retire(r)
        n_emitted = sum(len(v) for v in emitted.values())
        self.stats.emitted += n_emitted
        self.stats.seconds += time.perf_counter() - t0
        eng.metrics.decode_step(len(reqs), entered, self.width, t_draft, t_forward, n_emitted, accepted)
        if eng.drafting is not None:
            upd = [
                (rid, t)
                for rid, t in emitted.items()
                if t and not eng.requests[rid].finished and eng.requests[rid].draft
            ]
            if upd:
                try:
                    eng.drafting.extend_batch([rid for rid, _ in upd], [np.asarray(t, dtype=np.int64) for _, t in upd])
                except Exception as e:  # noqa: BLE001 - rebuild each state from the request's own tokens
                    log.warning("drafter update failed (%s); reopening the requests' drafter states", e)
                    for rid, _ in upd:
                        eng.reopen_draft(eng.requests[rid])

    def _count(self, r, toks: list[int], tags: list[int]) -> None:
        """A verification in the request's stats: one step emitting len(toks) tokens (RequestStats
        counts every token past a step's first as accepted), and the tree tokens by source."""
        st = r.stats
        st.steps += 1
        st.accepted += max(len(toks) - 1, 0)
        st.accepted_per_step.append(max(len(toks) - 1, 0))
        st.budgets.append(self.width)
        drafting = self.engine.drafting
        names = drafting.source_names if drafting is not None else {}
        for tag in tags:
            name = names.get(tag, "external")
            st.accepted_by_source[name] = st.accepted_by_source.get(name, 0) + 1
            by = self.engine.metrics.accepted_by_source
            by[name] = by.get(name, 0) + 1

    def _root_of(self, n: _Node) -> _Node:
        while n.parent is not None and n.parent.alive:
            n = n.parent
        return n

    # -- verification -----------------------------------------------------------------------------
    def _verify(self, r, f: _Flight, outputs: dict, logits, moves) -> tuple[list[int], int, list[int]]:
        """Walks from the root through nodes the last stage computed this step; returns the tokens
        to emit, the draft tokens accepted and their sources' tags, re-roots the flight and queues
        the KV moves."""
        eng, S, cap = self.engine, self.S, self.backend.capacity
        u, toks, a, tags = f.root, [], 0, []
        while True:
            am, row = outputs[id(u)]
            if am >= 0:
                x = am
            else:
                one = pack(np.array([u.token]), np.array([0]), None)
                p = r.params
                acc, errs = accept_sampled(
                    one,
                    np.array([0]),
                    [Sampler(p.temperature, p.top_k, p.top_p, r.generator)],
                    lambda rows, idx: _row(logits, row),
                    eng.generator,
                )
                if errs[0]:
                    raise _RowError(errs[0])
                x = int(acc.bonus[0])
            toks.append(x)
            c = u.child(x)
            self.stats.verified += u is f.root
            if c is None:  # flush: the bonus token is the new root, entering stage 0 next step
                self.stats.flushes += 1
                new = _Node(x, None, u.pos + 1, u.pos + 1)
                f.drop(None, cap)
                f.root, f.entered = new, False
                r.cached = new.pos + 1
                return toks, a, tags
            a += 1
            tags.append(c.source)
            _commit(r.slot, c, c.stage, moves)
            if c.stage == S:  # computed by every stage this step too: go on from it
                u = c
                continue
            f.drop(c, cap)
            if c.home >= cap:
                f.free.append(c.home)
            c.home = c.pos
            c.parent = None
            f.root = c
            r.cached = c.pos + 1
            return toks, a, tags

    # -- drafting ----------------------------------------------------------------------------------
    def _draft(self, reqs) -> dict[int, list[_Node]]:
        eng = self.engine
        if not self.width or eng.drafting is None:
            return {}
        from sssd import _core
        from sssd.sources import DraftRequest

        asked = [r for r in reqs if r.params.speculate and r.draft and self.flights[r.id].free]
        if not asked:
            return {}
        trees = [self.flights[r.id].subtree() for r in asked]
        budget = lambda n: int(min(int(_core.MAX_BUDGET), len(n) + 2 * self.width))  # noqa: E731
        try:
            drafts = eng.drafting.draft(
                [
                    DraftRequest(
                        r.id,
                        r.history(),
                        budget(t),
                        0.0 if r.params.greedy else r.params.temperature,
                        r.params.top_k,
                        r.params.top_p,
                    )
                    for r, t in zip(asked, trees)
                ]
            )
        except Exception as e:  # noqa: BLE001 - drafting is an optimisation
            log.warning("drafting failed for this pipeline step (%s); no tree layer enters", e)
            return {}
        out = {}
        for b, (r, tree) in enumerate(zip(asked, trees)):
            s, e = int(drafts.offsets[b]), int(drafts.offsets[b + 1])
            if e > s:
                nodes = self._append(
                    self.flights[r.id],
                    tree,
                    drafts.tokens[s:e],
                    drafts.parents[s:e],
                    drafts.scores[s:e],
                    drafts.sources[s:e],
                )
                if nodes:
                    out[r.id] = nodes
                    r.stats.drafted += len(nodes)
        return out

    def _append(self, f: _Flight, tree: list[_Node], tokens, parents, scores, sources) -> list[_Node]:
        """Appends the best-scored draft nodes hanging under the in-flight tree (found by token path)."""
        vocab = self.engine.backend.info.vocab_size
        kids: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
        for k, p in enumerate(parents.tolist()):
            kids[p + 1].append(k)
        root = f.root
        frontier = max(n.pos for n in tree) - root.pos
        heap: list = []

        def expand(slot: int, node: _Node) -> None:
            for k in kids[slot]:
                t = int(tokens[k])
                if not 0 <= t < vocab:
                    continue
                have = node.child(t)
                if have is not None:
                    expand(k + 1, have)
                else:
                    heapq.heappush(heap, (-float(scores[k]), k, id(node), node))

        expand(0, root)
        added: list[_Node] = []
        while heap and len(added) < self.width and f.free:
            _, k, _, par = heapq.heappop(heap)
            if par.pos + 1 - root.pos > frontier + self.levels or par.child(int(tokens[k])) is not None:
                continue
            n = _Node(int(tokens[k]), par, par.pos + 1, f.free.pop(), int(sources[k]))
            par.children.append(n)
            added.append(n)
            expand(k + 1, n)
        return added

    # -- a stage's work ----------------------------------------------------------------------------
    def _work(self, k: int, groups, index: dict, recv_after: int, greedy: dict) -> Work:
        be = self.backend
        S = self.S
        trash = be.trash
        R = len(groups)
        T = max((len(ns) for _, ns in groups), default=0)
        tokens = np.zeros((R, T), dtype=np.int64) if k == 0 else None
        take = np.full((R, T), -1, dtype=np.int64) if k > 0 else None
        positions = np.zeros((R, T), dtype=np.int64)
        writes = np.full((R, T), trash, dtype=np.int64)
        valid = np.zeros((R, T), dtype=bool)
        slots = np.zeros(R, dtype=np.int64)
        rows_gather, rows_mask = [], []
        for i, (r, ns) in enumerate(groups):
            slots[i] = r.slot
            base = self.flights[r.id].root.pos  # positions [0, base) are committed in every stage
            homes = sorted({a.home for n in ns for a in n.path()})
            g = np.concatenate(
                [
                    np.arange(base, dtype=np.int64),
                    np.asarray(homes, dtype=np.int64),
                    np.asarray([trash], dtype=np.int64),
                ]
            )
            col = {h: base + j for j, h in enumerate(homes)}
            m = np.zeros((T, len(g)), dtype=bool)
            m[:, -1] = True  # padding queries see the scratch position only
            for t, n in enumerate(ns):
                if k == 0:
                    tokens[i, t] = n.token
                else:
                    take[i, t] = index[id(n)]
                positions[i, t] = n.pos
                writes[i, t] = n.home
                valid[i, t] = True
                m[t, -1] = False
                m[t, :base] = True
                for a in n.path():
                    m[t, col[a.home]] = True
            rows_gather.append(g)
            rows_mask.append(m)
        L = max((len(g) for g in rows_gather), default=1)
        gather = np.full((R, L), trash, dtype=np.int64)
        mask = np.zeros((R, T, L), dtype=bool)
        for i, (g, m) in enumerate(zip(rows_gather, rows_mask)):
            gather[i, : len(g) - 1] = g[:-1]
            mask[i, :, : len(g) - 1] = m[:, :-1]
            mask[i, :, L - 1] = m[:, -1]  # the scratch column is the last one in every row
        result = None
        if k == S - 1 and R:
            result = (np.array([greedy[r.id] for r, _ in groups], dtype=bool), 0)
        return Work(
            slots=slots,
            tokens=tokens,
            take=take,
            positions=positions,
            writes=writes,
            gather=gather,
            mask=mask,
            valid=valid,
            recv_after=recv_after if k > 0 else 0,
            send=k < S - 1,
            result=result,
        )


class _RowError(Exception):
    """A failure of one request's verification (its sampling distribution)."""


def _row(logits, row: int):
    import torch

    return torch.from_numpy(logits[row : row + 1])


def _commit(slot: int, c: _Node, computed: int, moves) -> None:
    """Queues the move of an accepted node's K/V from the arena to its committed position in the
    stages that computed it (the others will write it there)."""
    if c.home == c.pos:
        return
    for k in range(computed):
        moves[k][0].append(slot)
        moves[k][1].append(c.home)
        moves[k][2].append(c.pos)
