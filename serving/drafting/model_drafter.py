"""ModelDrafter: a small causal LM drafting token trees for the target (SpecInfer's SSM).

The draft spec `model:<name or folder>` makes one (sssd.LLM(model,
draft=["retrieval", "model:qwen2.5-coder-0.5b-instruct"]), `sssd serve
--draft retrieval,model:...`). The drafter must speak the target's tokens:
the same tokenizer vocabulary and the same number of ids, or it is refused
when the engine starts, naming both.

Its KV cache is its own pool of per-request slots (a TorchBackend of the
drafter, with the same pool attention as the target): a request's slot
holds its tokens so far (the prefix, kept across steps); a step's tree is
written after them and simply overwritten by the next step (discarded). One
step drafts for every running request at once, in passes over the whole
batch:

1. catch up: one pass over every request's tokens not yet in its slot (the
   whole prompt the first time, later the tokens the target accepted and its
   bonus token); the last one is the tree's root, whose logits give q there;
2. expand: SpecInfer's expansion-based tree <k1, ..., km>: each node at depth
   d - 1 gets k_d children; one pass per level over the new nodes of every
   request (each sees its prefix and its own tree ancestors) gives their q.
   So an m-level tree costs m passes of the drafter, whatever the batch size.

A greedy request's children are the k likeliest tokens of q (deterministic:
verified by the greedy walk). A sampled request's are k independent draws
from q processed as the target samples that request (temperature, top-k,
top-p), its distinct tokens becoming the children; q and the draws at every
expanded node go with them (sources.DraftDistributions), and verification
runs SpecInfer's multi-step speculative sampling over them
(serving.acceptance: exact for any q, also under a parent that holds
retrieval children as well, and whatever the merge drops). Every node
carries its real q(token | path) (Candidates.probs).

In the merge, a node ranks by its measured acceptance rate, not by q: how
often the target's token at a node of depth d - 1 equals the drafter's
rank-r child there, per (d, r), counted from the tokens each request
appends after every step (extend walks them down the request's last tree,
whether or not the merge kept its nodes), shrunk toward q by RATE_PRIOR
pseudo-observations. Retrieval's calibrated priorities are acceptance
probabilities too, so the two sources compare (times the discount); raw q
undersells a drafter whose top choice the target shares (SmolLM2 drafting
for itself: q of its argmax is often 0.4, accepted every time).

Beside retrieval the drafter defers to it (sources.DraftSource
defers_to_retrieval): it drafts only in steps where its expected accepted
tokens (expected_accepted: its tree's nodes weighted by the measured
rates) beside retrieval's promises pay for its passes, whose cost
relative to a target pass (relative_cost) is its levels times the models'
parameter ratio until its own steps and the target's are measured
(sssd.serving.planning.deferral). A step where retrieval has long confident matches (a
prompt being copied) then costs no drafter pass, and a drafter as large as
the target drafts beside retrieval only in the deferral's exploration
steps (complement=False drafts always).

The slot holds [verified prefix | tree] (SwiftSpec's layout): when the
target's tokens (accepted path and bonus) walk down the last tree through
nodes that were fed (their K/V written, their hidden state kept), those
K/V move down to the prefix positions in one compaction instead of being
computed again; when the whole walk is fed, the next step needs no
catch-up pass at all, the new root's hidden state being kept. Under async
drafting (serving.async_draft) the engine sets `grow`: past its expansion
the tree keeps adding chain levels, one pass each, while grow() says the
verifier is still busy, so the next root is often a fed node of the tree.

A pass that fails costs that step's drafts (the pipeline logs it and the
other sources draft); the slots stay consistent, since a request's prefix
length advances only after its catch-up pass succeeded.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from sssd.config import SourceDiscount
from sssd.serving.drafting.draft_trees import RATE_DEPTHS, RATE_PRIOR, RATE_RANKS, Tree, TreePass, carried
from sssd.serving.drafting.slots import SlotTable
from sssd.serving.planning.measured_choice import bucket
from sssd.serving.verify.acceptance import processed_probs
from sssd.serving.verify.tree_batch import pack_chain
from sssd.sources import Candidates, DraftRequest, DraftSource

log = logging.getLogger("sssd.drafting")

#: Children per level (SpecInfer's <k1, ..., km>): two candidates for the next token, then a
#: chain. Each level costs one drafter pass, so depth is what a drafter a third of the
#: target's size can afford on a CPU (benchmarks/RESULTS.md, hybrid drafting).
DEFAULT_EXPANSION = (2, 1, 1, 1)
#: Tokens a catch-up pass feeds at most across the batch (a long prompt takes several passes).
CATCHUP_TOKENS = 1024
#: Chain levels a growing tree (async drafting) adds at most past its expansion.
MAX_GROW_LEVELS = 16


def parse_expansion(text: str | Sequence[int]) -> tuple[int, ...]:
    """An expansion <k1, ..., km> from "1,1,3,1" or a sequence; ValueError if malformed."""
    parts = [p for p in text.replace(" ", "").split(",") if p] if isinstance(text, str) else list(text)
    try:
        ks = tuple(int(k) for k in parts)
    except (TypeError, ValueError):
        raise ValueError(f"an expansion is comma-separated children per level, e.g. 1,1,3,1; got {text!r}") from None
    if not ks or any(k < 1 for k in ks) or len(ks) > 32:
        raise ValueError(f"an expansion needs 1-32 levels of at least one child each, got {text!r}")
    return ks


def check_same_tokens(drafter: Path, target: Path, target_tokenizer: Any = None) -> None:
    """Refuses a drafter whose token ids mean something else than the target's.

    Raises:
        ValueError: the tokenizers' vocabularies (token -> id) or the models' vocabulary
            sizes (logit rows) differ; the message names both models.
    """
    from transformers import AutoConfig, AutoTokenizer

    def size(path: Path) -> int:
        c = AutoConfig.from_pretrained(path, local_files_only=True)
        return int((getattr(c, "text_config", None) or c).vocab_size)

    dv, tv = size(drafter), size(target)
    dvocab = AutoTokenizer.from_pretrained(drafter, local_files_only=True).get_vocab()
    tvocab = (target_tokenizer or AutoTokenizer.from_pretrained(target, local_files_only=True)).get_vocab()
    if dv != tv or dvocab != tvocab:
        differ = sorted(set(dvocab.items()) ^ set(tvocab.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"the draft model {drafter} does not speak the target {target}'s tokens: the drafter has a "
            f"{len(dvocab):,}-token tokenizer and {dv:,} logits, the target a {len(tvocab):,}-token tokenizer and "
            f"{tv:,} logits" + (f" (e.g. {differ})" if differ else "") + "; draft with a model of the same "
            "tokenizer (e.g. a smaller one of the target's family)"
        )


def _param_estimate(path: Path) -> float:
    """Weights of a decoder from its config (embeddings, attention and MLP per layer): enough to
    compare two models' pass costs without loading either."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path, local_files_only=True)
    c = getattr(c, "text_config", None) or c
    h, layers = c.hidden_size, c.num_hidden_layers
    head = getattr(c, "head_dim", None) or h // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", c.num_attention_heads) * head
    inter = getattr(c, "intermediate_size", 4 * h)
    attn = h * c.num_attention_heads * head * 2 + h * kv * 2
    return float(c.vocab_size * h + layers * (attn + 3 * h * inter))


class ModelDrafter(DraftSource):
    """Drafts SpecInfer expansion trees with a small causal LM over its own per-request KV slots.

    Args:
        model: a model name (`sssd models list`) or a local Hugging Face model folder.
        target: the target's model folder: refused unless the drafter speaks its tokens
            (check_same_tokens); None skips the check.
        target_tokenizer: the target's loaded tokenizer (saves loading it again).
        slots: requests drafted for at once (the engine's max_running).
        capacity: tokens per request (the engine's max_model_len).
        expansion: children per level, <k1, ..., km> (DEFAULT_EXPANSION).
        dtype / device / threads: how the drafter runs (as TorchBackend takes them).
        seed: of the drafter's own random draws (sampled requests).
        temperature: the temperature of the drafter's draws for sampled requests (None: each
            request's own; any q keeps sampling exact, a closer one is accepted more).
        discount: its weight in the merge.
        name: in per-source metrics (default "model:<folder name>").
        complement: beside retrieval, draft only where retrieval promises less (see above).

    Raises:
        ValueError: not a causal LM folder or registered name, or another tokenizer.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        target: str | Path | None = None,
        target_tokenizer: Any = None,
        slots: int = 32,
        capacity: int = 2048,
        expansion: Sequence[int] | str = DEFAULT_EXPANSION,
        dtype: str = "float32",
        device: str | None = None,
        threads: int | None = None,
        seed: int = 0,
        temperature: float | None = None,
        discount: SourceDiscount | None = None,
        name: str | None = None,
        complement: bool = True,
    ):
        from sssd.models import resolve_model
        from sssd.serving.backends.torch_backend import TorchBackend

        path = Path(resolve_model(str(model)))
        #: the drafter's parameters over the target's (1 without a target): what one pass costs
        self.size_ratio = 1.0
        if target is not None:
            check_same_tokens(path, Path(target), target_tokenizer)
            self.size_ratio = _param_estimate(path) / _param_estimate(Path(target))
        self.expansion = parse_expansion(expansion)
        if temperature is not None and not temperature > 0:
            raise ValueError(f"the drafter's temperature must be > 0 (None: each request's), got {temperature!r}")
        self.temperature = temperature
        self.defers_to_retrieval = bool(complement)
        self.path = path
        self.name = name or f"model:{path.name}"
        if discount is not None:
            self.discount = discount
        self.backend = TorchBackend(path, slots=slots, capacity=capacity, dtype=dtype, device=device, threads=threads)
        self.capacity = min(capacity, self.backend.info.max_positions)
        self._slot = SlotTable(slots, "draft-model")
        self._cached: dict[int, int] = {}  # request id -> tokens in its slot
        self._gen = torch.Generator(device="cpu").manual_seed(seed)
        self._last: dict[int, Tree] = {}  # request id -> its last tree (for the rates)
        self._length: dict[int, int] = {}  # request id -> its tokens so far (prompt + appended)
        #: [seen, hit] per (depth - 1, child rank): children offered at reached nodes, and the target's choices
        self.rates = np.zeros((2, RATE_DEPTHS, RATE_RANKS), np.float64)
        self.passes = 0  # forward passes so far (for benchmarks)
        self._seconds: dict[int, float] = {}  # batch bucket -> smoothed seconds per propose
        self._root_hidden: dict[int, tuple[int, torch.Tensor]] = {}  # request id -> (its length, its root's state)
        self._carry: dict[int, Tree] = {}  # request id -> the grown subtree its next tree starts from
        #: set by async drafting: while grow() is True, a tree keeps adding chain levels past its expansion
        self.grow = None
        self.promoted = 0  # tokens whose K/V moved to the prefix uncomputed

    def __repr__(self) -> str:
        return f"ModelDrafter({str(self.path)!r}, expansion={list(self.expansion)})"

    # -- request lifecycle ------------------------------------------------------------------
    def open(self, request_id: int, prompt: np.ndarray) -> None:
        if request_id in self._slot:
            self.close(request_id)
        self._slot.acquire(request_id)
        self._cached[request_id] = 0
        self._length[request_id] = len(prompt)

    def extend(self, request_id: int, tokens: np.ndarray) -> None:
        tree = self._last.pop(request_id, None)
        length = self._length.get(request_id)
        if tree is not None and tree.prefix == length:  # the tree of this step, not of an earlier one
            tree.observe(tokens, self.rates)
            self._promote(request_id, tree, np.asarray(tokens))
        if length is not None:
            self._length[request_id] = length + len(tokens)

    def _promote(self, request_id: int, tree: Tree, tokens: np.ndarray) -> None:
        """Moves the K/V of the appended tokens that walk down the tree through fed nodes to the
        prefix positions (one compaction, nothing recomputed); if all of them did, keeps the new
        root's hidden state so the next step needs no catch-up pass."""
        s = self._slot.get(request_id)
        if s is None or self._cached.get(request_id) != tree.prefix or not tree.hidden:
            return
        child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
        node, src = -1, []
        for tok in tokens.tolist():
            node = child.get((node, tok))
            if node is None or node not in tree.hidden:
                break
            src.append(tree.prefix + node)
        if not src:
            return
        dst = list(tree.prefix + np.arange(len(src)))
        carry = None
        if len(src) == len(tokens) and tree.grown:  # the fed subtree below the new root goes on growing
            carry = carried(tree, node, tree.prefix + len(tokens))
            src += [tree.prefix + i for i in carry.origin]
            dst += [carry.prefix + j for j in range(len(carry.tokens))]
        src, dst = np.asarray(src), np.asarray(dst)
        moved = src != dst
        if moved.any():  # one gather, one scatter: sources are read before anything is written
            self.backend.compact(np.full(int(moved.sum()), s), src[moved], dst[moved])
        self._cached[request_id] = tree.prefix + len(src) - (0 if carry is None else len(carry.tokens))
        self.promoted += len(tokens) if carry is not None else len(src)
        if len(src) >= len(tokens):
            self._root_hidden[request_id] = (tree.prefix + len(tokens), tree.hidden[node])
        if carry is not None and carry.tokens:
            self._carry[request_id] = carry

    @property
    def relative_cost(self) -> float:
        """A step's drafter passes in target passes: levels x the parameter ratio."""
        return len(self.expansion) * self.size_ratio

    def expected_accepted(self, budget: int) -> float:
        """Accepted tokens this drafter's tree of `budget` nodes is expected to get: the sum over
        its nodes of their paths' products of measured (depth, rank) rates, each rate shrunk
        toward a prior of 0.5 for the first child and 0.1 for the others."""
        seen, hit = self.rates
        prior = np.where(np.arange(RATE_RANKS) == 0, 0.5, 0.1)[None, :]
        rate = (hit + RATE_PRIOR * prior) / (seen + RATE_PRIOR)
        total, level, nodes = 0.0, [1.0], 0
        for depth, k in enumerate(self.expansion):
            d = min(depth, RATE_DEPTHS - 1)
            nxt = []
            for w in level:
                for r in range(k):
                    if nodes >= budget:
                        return total
                    nxt.append(w * rate[d, min(r, RATE_RANKS - 1)])
                    total += nxt[-1]
                    nodes += 1
            level = nxt
        return total

    def acceptance_rates(self) -> np.ndarray:
        """[depth, rank] the measured rate at which the target's token is the rank-r child of a
        reached node at that depth (NaN where nothing was seen)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.rates[1] / self.rates[0]

    def close(self, request_id: int) -> None:
        self._last.pop(request_id, None)
        self._root_hidden.pop(request_id, None)
        self._carry.pop(request_id, None)
        self._length.pop(request_id, None)
        self._slot.release(request_id)
        self._cached.pop(request_id, None)

    def lag(self, request_id: int) -> int:
        """The request's tokens not yet in its slot (its next catch-up pass)."""
        return self._length.get(request_id, 0) - self._cached.get(request_id, 0)

    def measured_seconds(self, batch: int) -> float | None:
        """Measured seconds per drafting step at this batch size (its power-of-two bucket), if any."""
        return self._seconds.get(bucket(batch))

    def draft_seconds(self, batch: int, profile: Any = None, target_params: int | None = None) -> float:
        """Seconds this drafter adds to a step of `batch` requests (the planner's cost): measured
        (smoothed, per power-of-two batch bucket) once it has drafted at that size; before that,
        one target pass per level over the level's nodes (the target's forward profile), scaled
        by the drafter's share of the target's parameters."""
        measured = self.measured_seconds(batch)
        if measured is not None:
            return measured
        if profile is None or not target_params:
            return 0.0
        ratio = self.backend.info.shape.get("params", target_params) / target_params
        return ratio * sum(profile.time(batch, k) for k in (1, *self.expansion[:-1]))

    def _arrange(self, request_ids: list[int]) -> None:
        """Moves the requests to slots 0..n-1 in order (one pass reads its slots as a slice)."""

        def swap(a: int, b: int, rid: int, other: int | None) -> None:
            self.backend.swap(a, b, max(self._extent(rid), self._extent(other) if other is not None else 0))
            for moved in (rid, other):  # a swap moves prefixes only: trees past them are left behind
                if moved is not None and moved in self._last:
                    self._last[moved].hidden.clear()

        self._slot.arrange(request_ids, swap)

    def _extent(self, request_id: int) -> int:
        """Slot positions a request's state spans: its prefix and any carried subtree."""
        carry = self._carry.get(request_id)
        return self._cached[request_id] + (len(carry.tokens) if carry is not None else 0)

    def _k(self, depth: int) -> int:
        """Children of a node at `depth` (0: the root): the expansion's, then chains."""
        return self.expansion[depth] if depth < len(self.expansion) else 1

    # -- drafting ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Candidates | None]:
        out: list[Candidates | None] = [None] * len(requests)
        # a tree (and the padding of a pass) needs room past the prefix
        todo = [
            k
            for k, r in enumerate(requests)
            if r.request_id in self._slot and r.budget > 0 and len(r.tokens) + 2 * r.budget + 1 <= self.capacity
        ]
        if not todo:
            return out
        reqs = [requests[k] for k in todo]
        started = time.perf_counter()
        self._arrange([r.request_id for r in reqs])
        carried = [self._carry.pop(r.request_id, None) for r in reqs]
        hidden, fed = self._catch_up(reqs)
        grow, levels = self.grow, len(self.expansion)
        trees = [
            Tree(len(r.tokens), int(r.budget), [], [], [], [], [], [], [], [], [], {}, grown=grow is not None)
            for r in reqs
        ]
        frontier: list[list[int]] = [[-1] for _ in reqs]  # nodes whose q `hidden` gives, per row (-1: the root)
        if not fed and any(c is not None and c.prefix == len(r.tokens) for c, r in zip(carried, reqs)):
            # carried subtrees (no catch-up pass wrote over them) grow from their leaves
            states = []
            for b, (c, r) in enumerate(zip(carried, reqs)):
                if c is not None and c.prefix == len(r.tokens):
                    c.budget, c.grown = max(int(r.budget), len(c.tokens)), grow is not None
                    trees[b] = c
                    frontier[b] = [i for i in range(len(c.tokens)) if not c.kids.get(i)]
                    states += [c.hidden[i] for i in frontier[b]]
                else:
                    states.append(hidden[b])
            hidden = torch.stack(states)
        sampled = [r.temperature >= 1e-5 for r in reqs]
        # growing: levels until every tree is twice the expansion deep (the next step's tree starts
        # below the verified one, about an expansion deep; a carried tree may be deep enough), then
        # more while the verifier runs; else the expansion's levels
        need = levels
        if grow is not None:
            need = 2 * levels - min(max(t.depths, default=0) for t in trees)
        for level in range(1, levels + MAX_GROW_LEVELS + 1):
            if grow is not None and level > need and not grow():
                break
            ks = [[self._k(0 if n < 0 else t.depths[n]) for n in f] for t, f in zip(trees, frontier)]
            new = self._expand(reqs, trees, frontier, hidden, ks, sampled)
            if not any(new) or level >= need and (grow is None or not grow()):
                break
            h = self.backend.hidden_states(slice(0, len(reqs)), TreePass.of(trees, new))
            self.passes += 1
            b = np.repeat(np.arange(len(reqs)), [len(n) for n in new])
            j = np.concatenate([np.arange(len(n)) for n in new])
            hidden = h[torch.from_numpy(b), torch.from_numpy(j)]
            for row, node, state in zip(b.tolist(), [n for ns in new for n in ns], hidden):
                trees[row].hidden[node] = state
            frontier = new
        for k, r, t in zip(todo, reqs, trees):
            out[k] = t.candidates(self.rates)
            self._last[r.request_id] = t
        if grow is None:  # a step's drafting as it costs serially (grown trees take as long as the verifier)
            key = bucket(len(reqs))
            took = time.perf_counter() - started
            self._seconds[key] = took if key not in self._seconds else 0.8 * self._seconds[key] + 0.2 * took
        return out

    def _catch_up(self, reqs: list[DraftRequest]) -> tuple[torch.Tensor, bool]:
        """Feeds every request's tokens not yet in its slot; the hidden state at each root [B, H],
        and whether a pass ran (its padding writes past the prefixes)."""
        B = len(reqs)
        n = np.array([len(r.tokens) for r in reqs], dtype=np.int64)
        kept = [self._root_hidden.pop(r.request_id, None) for r in reqs]
        if all(k is not None and k[0] == len(r.tokens) == self._cached[r.request_id] for k, r in zip(kept, reqs)):
            return torch.stack([k[1] for k in kept]), False  # every root's state was kept: no pass
        # at least the root is fed (its logits are the first level's q)
        start = np.minimum(np.array([self._cached[r.request_id] for r in reqs], dtype=np.int64), n - 1)
        # propose leaves room for 2 * budget + 1 past every prefix: padding stays inside the slots
        cap = min(max(8, CATCHUP_TOKENS // B), self.capacity - int(n.max()))
        while True:
            end = np.minimum(n, start + cap)
            last = bool((end == n).all())
            # rows already done re-feed their root (the same K/V again) until the long ones are in
            lo = np.where(start < n, start, n - 1)
            hi = np.where(start < n, end, n)
            chunks = [np.asarray(r.tokens[a:b], dtype=np.int64) for r, a, b in zip(reqs, lo, hi)]
            h = self.backend.hidden_states(slice(0, B), pack_chain(lo, chunks))
            self.passes += 1
            for r, b in zip(reqs, hi):
                self._cached[r.request_id] = int(b)
            start = hi
            if last:
                idx = torch.from_numpy(np.array([len(c) - 1 for c in chunks], dtype=np.int64))
                return h[torch.arange(B), idx], True

    def _expand(
        self,
        reqs: list[DraftRequest],
        trees: list[Tree],
        frontier: list[list[int]],
        hidden: torch.Tensor,
        ks: list[list[int]],
        sampled: list[bool],
    ) -> list[list[int]]:
        """Gives every frontier node up to its k children (ks, per frontier node; within each tree's
        budget); the new nodes."""
        flat_k = [k for row in ks for k in row]
        if not flat_k:
            return [[] for _ in reqs]
        k = max(flat_k)
        logits = self.backend.logits(hidden).cpu()  # [F, V]: drawn on the CPU, like the target's tokens
        owner = np.repeat(np.arange(len(reqs)), [len(f) for f in frontier])
        q = torch.softmax(logits, dim=-1)
        top = torch.topk(q, min(k, q.shape[-1]), dim=-1)
        top_tok, top_p = top.indices.numpy(), top.values.numpy()
        srows = np.flatnonzero(np.asarray(sampled)[owner])
        qs: dict[int, torch.Tensor] = {}
        draws: dict[int, np.ndarray] = {}
        if srows.size:
            rs = [reqs[owner[j]] for j in srows]
            processed = processed_probs(
                logits[torch.from_numpy(srows)],
                torch.tensor([self.temperature or r.temperature for r in rs], dtype=torch.float32),
                torch.tensor([r.top_k for r in rs], dtype=torch.int64),
                torch.tensor([r.top_p for r in rs], dtype=torch.float32),
            )
            drawn = torch.multinomial(processed, k, replacement=True, generator=self._gen).numpy()
            for m, j in enumerate(srows.tolist()):
                qs[j], draws[j] = processed[m], drawn[m]
        new: list[list[int]] = [[] for _ in reqs]
        j = 0
        for b, nodes in enumerate(frontier):
            t = trees[b]
            for node in nodes:
                room, kj = t.budget - len(t.tokens), flat_k[j]
                if room > 0 and j in qs:
                    row, drawn_j = qs[j], draws[j][:kj]  # its first kj of k independent draws
                    kids = list(dict.fromkeys(drawn_j.tolist()))[:room]  # distinct, in drawing order
                    t.dist_parents.append(node)
                    t.dist_q.append(row.numpy())
                    t.dist_draws.append(drawn_j)
                    new[b] += [t.add(node, x, float(row[x])) for x in kids]
                elif room > 0:
                    n = min(room, kj)
                    new[b] += [t.add(node, int(x), float(p)) for x, p in zip(top_tok[j][:n], top_p[j][:n])]
                j += 1
        return new
