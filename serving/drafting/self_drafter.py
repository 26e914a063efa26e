"""SelfDrafter: the target drafts for itself over a small sparse view of its KV (MagicDec).

The draft specs `self:streamingllm` and `self:snapkv` make one
(sssd.LLM(model, draft=["self:snapkv"]), `sssd serve --draft
retrieval,self:snapkv`; `self:snapkv:512` sets the KV budget). At long
contexts and large batches a decoding step is bound by reading the KV
cache, not the weights (MagicDec, ../shared/papers/001_magicdec.txt): the
target model itself, reading only `kv_budget` cached positions per request
instead of the whole context, drafts a chain of gamma tokens for a fraction
of a full step's cost, and the full model verifies the chain in one pass.

The draft KV is real gathered tensors in a pool of its own (a kv_cache.KVPool
of `kv_budget + MAX_GAMMA + 1` positions per request), never a mask over
the verifier's cache (a mask saves no memory traffic). Per slot:

    [0, fixed)           positions kept for the request's whole life:
                         StreamingLLM's attention sinks (the first `sinks`
                         positions), or SnapKV's selection (per layer and KV
                         head, the prompt positions the last `obs_window`
                         prompt queries attend to most, pooled over
                         neighbours), gathered once when the request's
                         prompt is in the verifier's cache;
    [fixed, kv_budget)   a ring of the most recent positions, fed every step
                         from the verifier's cache (the accepted tokens'
                         exact K/V: no pass of the drafter re-reads them);
    [kv_budget, ...)     this step's chain: the root and the draft tokens,
                         overwritten by the next step.

Keys are stored after rotary embedding, so a gathered key keeps its original
position and the draft's queries use the true positions. The verifier's
cache is only read: the engine hands the source a `locate(request_id)` ->
(verifier slot, tokens cached) callback. With a KV budget of at least the
context, the view holds every cached position exactly: the drafter is the
target itself and (greedy) every draft token is accepted (tested).

Each step drafts, for every running request at once, a chain of up to gamma
tokens in gamma passes of one token per request. A greedy request's chain is
the argmax at every step; a sampled request's is one draw per step from q
processed as the target samples that request, with q and the draw handed
over (sources.DraftDistributions) so verification by multi-step speculative
sampling stays exact (serving.acceptance). Every node carries q(token |
path), and ranks in the merge by the measured acceptance rate at its depth
(as model_drafter's nodes do).

How long a chain pays, and whether drafting pays at all, comes from the
cost model (planner.SelfSpecCostModel): the draft pass costs a fraction of
a target pass that shrinks as the context grows past the budget and as the
batch grows (more KV per pass), a chain is accepted at the measured
per-depth rates, and gamma maximises expected tokens per second. Below the
critical context (where no gamma beats plain decoding) the source proposes
nothing (beside retrieval, retrieval drafts alone there); above it the
chain drafts every step, merged with retrieval's tree.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sssd.serving.backends import attention
from sssd.serving.backends.kv_cache import KVPool, PoolShape
from sssd.serving.drafting.draft_trees import RATE_DEPTHS, RATE_PRIOR, RATE_RANKS, Tree
from sssd.serving.drafting.slots import SlotTable
from sssd.serving.verify.acceptance import processed_probs
from sssd.sources import Candidates, DraftRequest, DraftSource

log = logging.getLogger("sssd.drafting")

METHODS = ("streamingllm", "snapkv")
#: Positions of the draft KV per request unless told otherwise (MagicDec's budget for 8k contexts).
DEFAULT_KV_BUDGET = 512
#: The longest chain a step drafts (the pool keeps room for it past the budget).
MAX_GAMMA = 8
#: StreamingLLM's attention sinks: the first positions, always kept.
DEFAULT_SINKS = 4
#: SnapKV: the last prompt positions whose queries vote, and the pooling kernel over their votes.
DEFAULT_OBS_WINDOW = 32
POOL_KERNEL = 7
#: Prior acceptance rate of a self-drafted token before any is measured (the drafter is the target).
PRIOR_RATE = 0.7


def cost_file(backend: Any) -> Path:
    """Where the cost model measured for this backend's model, dtype and device is kept
    (benchmarks/bench_magicdec.py --fit writes it; the engine's self sources read it): beside the
    forward profiles, in $SSSD_PROFILE_DIR where that is set (the test suite's own folder)."""
    from sssd.paths import profiles_dir

    name = f"selfspec-{Path(backend.info.path).name}-{str(backend.dtype).replace('torch.', '')}-{backend.device}.json"
    return profiles_dir() / name


def load_cost(backend: Any, kv_budget: int) -> Any:
    """The measured cost model for this backend (None: not measured yet, or unreadable)."""
    from sssd.serving.planning.planner import SelfSpecCostModel

    path = cost_file(backend)
    if not path.is_file():
        return None
    try:
        return SelfSpecCostModel.from_dict(json.loads(path.read_text()), kv_budget=kv_budget)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s: unreadable self-speculation cost model (%s); using the roofline prior", path, e)
        return None


def parse_self_spec(arg: str) -> tuple[str, int | None]:
    """(method, kv budget or None) from a spec's argument: "snapkv", "streamingllm:1024".

    Raises:
        ValueError: an unknown method or a budget that is not a positive integer.
    """
    method, _, budget = str(arg).partition(":")
    if method not in METHODS:
        raise ValueError(
            f"self-speculation is self:streamingllm or self:snapkv (optionally :<kv budget>), got self:{arg}"
        )
    if not budget:
        return method, None
    if not budget.isdigit() or int(budget) < 1:
        raise ValueError(f"self:{method}:<kv budget> takes a positive number of KV positions, got {budget!r}")
    return method, int(budget)


@dataclass
class _View:
    """One request's sparse view of its context, in its draft slot."""

    fixed: int  # entries [0, fixed) hold the kept positions
    horizon: int  # positions >= horizon go through the ring
    ring: int  # ring entries: [fixed, fixed + ring)
    filled: int = 0  # positions < filled are synced from the verifier
    valid: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # [kv_budget] entry holds a position
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [kv_budget] its position (head 0)
    picked: Any = None  # SnapKV: [layers, kv heads, fixed] the kept positions per layer and head


class _ReadStep:
    """A forward pass's view of the verifier's cache for one request, read-only: the new K/V of
    the pass are dropped (they are already in the cache)."""

    def __init__(self, pool: KVPool, slot: int, length: int):
        self.pool, self.slot, self.length = pool, slot, length

    def update(self, key, value, layer):
        return self.pool.view(layer, slice(self.slot, self.slot + 1), self.length)


class SelfDrafter(DraftSource):
    """Drafts chains with the target model over a compact gathered KV of `kv_budget` positions.

    Args:
        backend: the engine's TorchBackend (its model drafts; its KV pool is read, never written).
        locate: request id -> (the request's slot in the backend's pool, tokens in that slot).
        method: "streamingllm" (sinks + recent window) or "snapkv" (observation-window selection
            + recent window).
        kv_budget: KV positions per request in the draft's view (a budget at least the
            context degrades to the full cache).
        slots: requests drafted for at once (the engine's max_running).
        gamma: the longest chain (None: the cost model chooses per batch and context, up to
            MAX_GAMMA).
        sinks / obs_window / window: StreamingLLM's sinks, SnapKV's voting queries, SnapKV's recent
            ring (default: a quarter of the budget, at least obs_window).
        cost: the planner's SelfSpecCostModel (default: the roofline prior, refined by
            measurement).
        seed / temperature: of the draws for sampled requests (None: each request's own).

    Raises:
        ValueError: an unknown method, a budget or gamma out of range.
    """

    def __init__(
        self,
        backend: Any,
        locate: Callable[[int], tuple[int, int]],
        method: str = "snapkv",
        *,
        kv_budget: int | None = None,
        slots: int = 32,
        gamma: int | None = None,
        sinks: int = DEFAULT_SINKS,
        obs_window: int = DEFAULT_OBS_WINDOW,
        window: int | None = None,
        cost: Any = None,
        seed: int = 0,
        temperature: float | None = None,
        name: str | None = None,
    ):
        from sssd.serving.planning.planner import SelfSpecCostModel

        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        kv_budget = DEFAULT_KV_BUDGET if kv_budget is None else int(kv_budget)
        if kv_budget < 1:
            raise ValueError(f"kv_budget must be >= 1, got {kv_budget}")
        if gamma is not None and not 1 <= int(gamma) <= MAX_GAMMA:
            raise ValueError(f"gamma must be in [1, {MAX_GAMMA}], got {gamma}")
        if temperature is not None and not temperature > 0:
            raise ValueError(f"the drafter's temperature must be > 0 (None: each request's), got {temperature!r}")
        self.backend, self.locate, self.method = backend, locate, method
        # a budget beyond the verifier's slots holds nothing more: the full cache
        self.kv_budget = min(kv_budget, int(backend.capacity))
        self.gamma = None if gamma is None else int(gamma)
        #: the engine's budget is explicit: draft chains of that length, whatever the cost model says
        self.fixed_budget = False
        self.sinks, self.obs_window = max(0, int(sinks)), max(1, int(obs_window))
        self.window = window
        self.temperature = temperature
        self.name = name or f"self:{method}"
        sh = backend.pool.shape
        self.pool = KVPool(
            PoolShape(
                layers=sh.layers,
                kv_heads=sh.kv_heads,
                head_dim=sh.head_dim,
                slots=slots,
                capacity=self.kv_budget + MAX_GAMMA + 1,
            ),
            backend.dtype,
            backend.device,
        )
        self.cost = cost or SelfSpecCostModel.prior(backend.info.shape, self.kv_budget)
        self._slot = SlotTable(slots, "self-draft")
        self._view: dict[int, _View] = {}
        self._last: dict[int, Tree] = {}
        self._length: dict[int, int] = {}
        self._gen = torch.Generator(device="cpu").manual_seed(seed)
        #: [seen, hit] per (depth - 1, rank 0): chain nodes reached, and the target's agreement
        self.rates = np.zeros((2, RATE_DEPTHS, RATE_RANKS), np.float64)
        self.passes = 0
        self._batch, self._context = 1, 0  # the last step's, for relative_cost

    def __repr__(self) -> str:
        return f"SelfDrafter({self.method!r}, kv_budget={self.kv_budget}, gamma={self.gamma})"

    @classmethod
    def for_engine(cls, engine: Any, arg: str) -> SelfDrafter:
        """The source for an engine's `self:<method>[:<kv budget>]` spec, reading its backend's cache."""
        method, budget = parse_self_spec(arg)
        if not hasattr(engine.backend, "pool") or not hasattr(engine.backend, "model"):
            raise ValueError(
                f"self:{arg} drafts with the target's own weights and KV cache: it needs the "
                f"torch backend, not {type(engine.backend).__name__}"
            )

        def locate(rid: int) -> tuple[int, int]:
            req = engine.requests[rid]
            return req.slot, req.cached

        measured = load_cost(engine.backend, budget or DEFAULT_KV_BUDGET)
        if budget is None and measured is not None and measured.acceptance.get(method):
            # no budget given: the measured one that pays best at full batch and context
            planned, _, _ = measured.best_plan(
                engine.config.max_running, engine.max_model_len, measured.acceptance[method]
            )
            if planned:
                budget = planned
                measured.kv_budget = planned
        src = cls(engine.backend, locate, method, kv_budget=budget, slots=engine.config.max_running)
        if measured is not None:
            src.cost = measured
        return src

    # -- request lifecycle ------------------------------------------------------------------
    def open(self, request_id: int, prompt: np.ndarray) -> None:
        if request_id in self._slot:
            self.close(request_id)
        self._slot.acquire(request_id)
        self._length[request_id] = len(prompt)

    def extend(self, request_id: int, tokens: np.ndarray) -> None:
        tree = self._last.pop(request_id, None)
        length = self._length.get(request_id)
        if tree is not None and tree.prefix == length:
            tree.observe(tokens, self.rates)
        if length is not None:
            self._length[request_id] = length + len(tokens)

    def close(self, request_id: int) -> None:
        self._last.pop(request_id, None)
        self._length.pop(request_id, None)
        self._view.pop(request_id, None)
        self._slot.release(request_id)

    # -- what a chain is worth ------------------------------------------------------------------
    #: Never deferred (sssd.serving.planning.deferral): each step's propose asks the cost model at that step's batch
    #: and context, and proposes nothing below the critical context (retrieval drafts alone there).
    defers_to_retrieval = False

    def acceptance_rates(self) -> np.ndarray:
        """[depth] measured rate at which the target takes the chain's token at that depth, given the
        chain got there (NaN where nothing was seen)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.rates[1][:, 0] / self.rates[0][:, 0]

    def depth_rates(self) -> np.ndarray:
        """[RATE_DEPTHS] acceptance rate per depth, shrunk toward PRIOR_RATE."""
        seen, hit = self.rates[0][:, 0], self.rates[1][:, 0]
        return (hit + RATE_PRIOR * PRIOR_RATE) / (seen + RATE_PRIOR)

    def choose_gamma(self, batch: int, context: int, budget: int) -> int:
        """The chain length for this step (0: drafting does not pay at this batch and context)."""
        cap = min(int(budget), self.gamma or MAX_GAMMA)
        if cap < 1:
            return 0
        if self.gamma is not None or self.fixed_budget:
            return cap
        return self.cost.best_gamma(batch, context, self.depth_rates(), cap)

    def expected_accepted(self, budget: int) -> float:
        g = min(int(budget), self.gamma or MAX_GAMMA)
        return float(np.cumprod(self.depth_rates()[:g]).sum())

    @property
    def relative_cost(self) -> float:
        """A step's draft passes in target passes, at the last step's batch and context."""
        g = self.gamma or self.cost.best_gamma(self._batch, self._context, self.depth_rates(), MAX_GAMMA) or 1
        return g * self.cost.ratio(self._batch, self._context)

    def draft_seconds(self, batch: int, profile: Any = None, target_params: int | None = None) -> float:
        """Seconds the chain's passes add to a step of `batch` requests (the budget planner's cost)."""
        return self.cost.draft_seconds(batch)

    # -- the sparse view ----------------------------------------------------------------------------
    def _arrange(self, request_ids: list[int]) -> None:
        """Moves the requests to draft slots 0..n-1 in order (a pass reads its slots as a slice)."""
        cap = self.pool.shape.capacity
        self._slot.arrange(request_ids, lambda a, b, rid, other: self.pool.swap(a, b, cap))

    def _build(self, rid: int, tokens: np.ndarray, vslot: int, cached: int) -> _View:
        """The request's kept positions, gathered from the verifier's cache of `cached` positions."""
        B = self.kv_budget
        mine = self._slot[rid]
        if self.method == "streamingllm" or cached <= B:
            # sinks, then the recent positions; a context within the budget is all kept, in order
            n = min(self.sinks, B - 1, cached) if self.method == "streamingllm" else 0
            view = _View(fixed=n, horizon=n, ring=B - n)
            self._copy(mine, vslot, np.arange(n), np.arange(n))
        else:
            ring = max(1, min(B - 1, max(self.obs_window, self.window or B // 4)))
            keep = B - ring
            horizon = cached - ring
            idx = self._snap_select(tokens, vslot, cached, horizon, keep)  # [layers, heads, keep]
            self._gather(mine, vslot, idx)
            view = _View(fixed=keep, horizon=horizon, ring=ring)
            view.positions = np.zeros(B, np.int64)
            view.positions[:keep] = idx[0, 0].cpu().numpy()
            view.picked = idx
        view.valid = np.zeros(B, bool)
        view.valid[: view.fixed] = True
        if view.positions.size == 0:
            view.positions = np.zeros(B, np.int64)
            view.positions[: view.fixed] = np.arange(view.fixed)
        view.filled = view.horizon
        return view

    def _sync(self, rid: int, view: _View, vslot: int, cached: int) -> None:
        """Copies the positions cached since the last step into the ring (the last `ring` of them)."""
        lo = max(view.filled, cached - view.ring, view.horizon)
        if lo < cached:
            pos = np.arange(lo, cached)
            entry = view.fixed + (pos - view.horizon) % view.ring
            self._copy(self._slot[rid], vslot, pos, entry)
            view.valid[entry] = True
            view.positions[entry] = pos
        view.filled = max(view.filled, cached)

    def _copy(self, mine: int, vslot: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Verifier slot vslot's positions src -> draft slot mine's entries dst (all layers and heads)."""
        if len(src) == 0:
            return
        dev = self.pool.kv.device
        s = torch.from_numpy(np.asarray(src, np.int64)).to(dev)
        d = torch.from_numpy(np.asarray(dst, np.int64)).to(dev)
        self.pool.kv[:, :, mine].index_copy_(3, d, self.backend.pool.kv[:, :, vslot].index_select(3, s))

    def _gather(self, mine: int, vslot: int, idx: torch.Tensor) -> None:
        """Per layer and KV head positions idx [layers, heads, n] -> draft entries [0, n)."""
        src = self.backend.pool.kv[:, :, vslot]  # [layers, 2, heads, cap, D]
        L, _, H, _, D = src.shape
        n = idx.shape[-1]
        index = idx[:, None, :, :, None].expand(L, 2, H, n, D)
        self.pool.kv[:, :, mine, :, :n] = torch.gather(src, 3, index)

    @torch.inference_mode()
    def _snap_select(self, tokens: np.ndarray, vslot: int, cached: int, horizon: int, keep: int) -> torch.Tensor:
        """SnapKV: per layer and KV head, the `keep` positions below `horizon` that the last
        obs_window cached positions' queries attend to most (summed over the window and the
        head's query group, pooled over POOL_KERNEL neighbours), in position order."""
        model = self.backend.model
        w = min(self.obs_window, cached)
        layers = model.model.layers
        queries: dict[int, torch.Tensor] = {}

        def hook(module, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim)
            if hasattr(module, "q_norm"):
                q = module.q_norm(q)
            rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
            q = q.transpose(1, 2)
            queries[module.layer_idx] = rope(q, q, cos, sin)[0]

        handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
        try:
            dev = self.backend.device
            pos = np.arange(cached - w, cached)
            tok = torch.from_numpy(np.array(tokens[cached - w : cached], np.int64)[None]).to(dev)
            mask = torch.from_numpy(np.arange(cached)[None, :] <= pos[:, None]).to(dev)[None, None]
            m: Any = mask
            if self.backend.info.layer_types is not None:
                m = {"full_attention": mask, "sliding_attention": mask}
            model.model(
                input_ids=tok,
                position_ids=torch.from_numpy(pos[None]).to(dev),
                attention_mask=m,
                use_cache=False,
                **{attention.STEP_KWARG: _ReadStep(self.backend.pool, vslot, cached)},
            )
        finally:
            for h in handles:
                h.remove()
        out = []
        for li, layer in enumerate(layers):
            q = queries[li][0].float()  # [Hq, w, D]
            k = self.backend.pool.kv[li, 0, vslot, :, :cached].float()  # [H, cached, D]
            groups = q.shape[0] // k.shape[0]
            k = k.repeat_interleave(groups, dim=0)
            scores = torch.matmul(q, k.transpose(1, 2)) * layer.self_attn.scaling
            scores = scores.masked_fill(~mask[0].to(scores.device), float("-inf"))
            votes = torch.softmax(scores, dim=-1).sum(dim=1)[:, :horizon]  # [Hq, horizon]
            votes = votes.view(k.shape[0] // groups, groups, horizon).sum(dim=1)
            votes = torch.nn.functional.avg_pool1d(
                votes[:, None], POOL_KERNEL, 1, POOL_KERNEL // 2, count_include_pad=False
            )[:, 0, :horizon]
            out.append(torch.topk(votes, min(keep, horizon), dim=-1).indices.sort(dim=-1).values)
        return torch.stack(out).to(self.pool.kv.device)

    # -- drafting -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Candidates | None]:
        out: list[Candidates | None] = [None] * len(requests)
        live = [k for k, r in enumerate(requests) if r.request_id in self._slot and r.budget > 0]
        if not live:
            return out
        context = int(np.mean([len(requests[k].tokens) for k in live]))
        self._batch, self._context = len(requests), context
        gamma = self.choose_gamma(len(requests), context, max(requests[k].budget for k in live))
        if gamma < 1:
            return out  # below the critical context: plain decoding (or retrieval) pays more
        started = time.perf_counter()
        reqs = [requests[k] for k in live]
        self._arrange([r.request_id for r in reqs])
        for r in reqs:
            vslot, cached = self.locate(r.request_id)
            cached = min(int(cached), len(r.tokens) - 1)  # the root is not in the verifier's cache yet
            view = self._view.get(r.request_id)
            if view is None:
                view = self._view[r.request_id] = self._build(r.request_id, r.tokens, vslot, cached)
            self._sync(r.request_id, view, vslot, cached)
        trees = self._chains(reqs, gamma)
        for k, r, t in zip(live, reqs, trees):
            out[k] = t.candidates(self.rates)
            self._last[r.request_id] = t
        self.cost.observe_draft(len(reqs), gamma, time.perf_counter() - started)
        return out

    def _chains(self, reqs: list[DraftRequest], gamma: int) -> list[Tree]:
        """Drafts every request's chain in gamma passes of one token per request."""
        B, K = len(reqs), self.kv_budget
        trees = [Tree(len(r.tokens), min(int(r.budget), gamma), [], [], [], [], [], [], [], [], [], {}) for r in reqs]
        valid = np.stack([self._view[r.request_id].valid for r in reqs])  # [B, K]
        kv_pos = np.stack([self._view[r.request_id].positions for r in reqs])  # [B, K]
        root = np.array([len(r.tokens) - 1 for r in reqs], np.int64)
        tok = np.array([r.tokens[-1] for r in reqs], np.int64)
        sampled = np.array([r.temperature >= 1e-5 for r in reqs])
        last = [-1] * B  # each chain's tip
        for j in range(gamma):
            S = K + j + 1
            visible = np.zeros((B, 1, S), bool)
            visible[:, 0, :K] = valid
            visible[:, 0, K:] = True
            positions = (root + j)[:, None]
            h = self._forward(
                B,
                tok[:, None],
                positions,
                np.full((B, 1), K + j, np.int64),
                S,
                visible,
                np.concatenate([kv_pos, root[:, None] + np.arange(j + 1)[None]], axis=1),
            )
            self.passes += 1
            logits = self.backend.logits(h[:, 0]).cpu()
            nxt = logits.argmax(dim=-1).numpy()
            q = torch.softmax(logits, dim=-1)
            if sampled.any():
                rows = np.flatnonzero(sampled)
                rs = [reqs[b] for b in rows]
                processed = processed_probs(
                    logits[torch.from_numpy(rows)],
                    torch.tensor([self.temperature or r.temperature for r in rs], dtype=torch.float32),
                    torch.tensor([r.top_k for r in rs], dtype=torch.int64),
                    torch.tensor([r.top_p for r in rs], dtype=torch.float32),
                )
                drawn = torch.multinomial(processed, 1, generator=self._gen).numpy()[:, 0]
                for m, b in enumerate(rows.tolist()):
                    t = trees[b]
                    if len(t.tokens) < t.budget:
                        t.dist_parents.append(last[b])
                        t.dist_q.append(processed[m].numpy())
                        t.dist_draws.append(drawn[m : m + 1].astype(np.int64))
                        last[b] = t.add(last[b], int(drawn[m]), float(processed[m, drawn[m]]))
                    nxt[b] = drawn[m]
            for b in np.flatnonzero(~sampled).tolist():
                t = trees[b]
                if len(t.tokens) < t.budget:
                    last[b] = t.add(last[b], int(nxt[b]), float(q[b, nxt[b]]))
            tok = nxt.astype(np.int64)
            if j + 1 >= max(t.budget for t in trees):
                break
        return trees

    def _forward(
        self,
        B: int,
        tokens: np.ndarray,
        positions: np.ndarray,
        writes: np.ndarray,
        length: int,
        visible: np.ndarray,
        kv_positions: np.ndarray,
    ) -> torch.Tensor:
        """Final hidden states [B, T, hidden] of the target over draft slots [0, B)."""
        be = self.backend
        dev = be.device
        full = torch.from_numpy(visible).to(dev)[:, None]
        mask: Any = full
        if be.info.layer_types is not None:
            mask = {"full_attention": full, "sliding_attention": full}
            if be.info.sliding_window:
                near = positions[:, :, None] - kv_positions[:, None, :] < be.info.sliding_window
                mask["sliding_attention"] = full & torch.from_numpy(near).to(dev)[:, None]
        step = attention.PoolStep(self.pool, slice(0, B), torch.from_numpy(writes).to(dev), length)
        out = be.model.model(
            input_ids=torch.from_numpy(tokens).to(dev),
            position_ids=torch.from_numpy(positions).to(dev),
            attention_mask=mask,
            use_cache=False,
            **{attention.STEP_KWARG: step},
        )
        return out.last_hidden_state
