"""Verification of packed draft trees: which draft tokens the target accepts.

Greedy: a node is accepted when its token is the target's argmax at its
parent and its parent is accepted; each row keeps its deepest accepted node
(siblings carry distinct tokens, so the accepted nodes form one path) and
adds the target's argmax there as the bonus token. One vectorised pass per
packed index over the whole batch.

Sampling (SSSD paper, section 4.2): walking down from the root, the
target's token is drawn at each visited node from its own processed
distribution; the walk follows the child holding that token, else stops
with it as the bonus token. Every emitted token is therefore drawn from the
target's conditional distribution: the output is distributed exactly as
without speculation (the drafts are deterministic; their scores never enter
the sampler). The walk advances every sampled row of the batch together,
one depth per iteration. Draws use inverse-CDF sampling with one uniform
per visited node from the request's own generator (on the CPU, whatever the
logits' device), so a seeded request consumes its random stream exactly as
plain decoding does and gives the same tokens with or without speculation.

Multi-step speculative sampling (SpecInfer, Algorithm 2 and Theorem 4.2) for
candidates a source drew at random from a draft distribution q (a model
drafter; sources.DraftDistributions): at a visited node u holding such
draws x_1..x_k (independent draws from q_u, duplicates kept, made without
seeing the target), with the target's processed distribution p at u:

    for each draw x_i in order: with probability min(1, p(x_i) / q_u(x_i))
        emit x_i (descend into its node if the tree kept it, else stop with
        x_i as the bonus token); otherwise p := norm(max(0, p - q_u));
    if every draw was rejected: draw y from the residual p and continue as
        the sampling walk does (descend into u's child holding y, any
        source's, else stop with y).

Each trial is the classic rejection step (draft x ~ q, accept with
min(1, p/q), else resample from the normalised residual): the token it
emits, drawn directly or from the residual, is distributed as p exactly.
Chaining trials with independent draws keeps that true for the residual at
each stage, so whatever stage emits it, the node's token is a draw from the
target's p. Several sources with draws at u (merge-based trees) chain their
trials one after another, each with its own q_u.

A mixed parent (model draws and retrieval or other deterministic children
under one node) stays exact: the deterministic children play no part in
the trials; they only decide where the walk goes once a token is emitted.
Descending into a child never changes what was emitted, only where the
next token is drawn: below a deterministic child the walk goes on as
before; below a drawn child the draws there are independent of everything
that led the walk to it (they were made from q at that path before the
target ran, and the merge keeps or drops a node before it sees anything
below it: children enter its queue only once their parent is taken). A
draw whose node the merge dropped (the budget) still takes part in the
trials: if accepted it is emitted as the bonus token. Draws cost one
uniform each from the request's own generator, so a seeded request is
reproducible; it no longer draws exactly the tokens plain decoding would
(the proof is about distributions, not streams), which only the sampling
walk over deterministic drafts guarantees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sssd.serving.verify.tree_batch import TreeBatch


@dataclass
class Accepted:
    """Per row: the deepest accepted node (packed index; 0 = the root: nothing accepted),
    how many draft tokens were accepted, and the bonus token that follows them."""

    node: np.ndarray  # [B] int64
    count: np.ndarray  # [B] int64
    bonus: np.ndarray  # [B] int64

    def path_mask(self, batch: TreeBatch) -> np.ndarray:
        """[B, T] bool: the accepted draft nodes (the root excluded); in packed order they
        are in path order, since a parent precedes its children."""
        B, T = batch.shape
        mask = batch.ancestors[np.arange(B), self.node].copy()
        mask[:, 0] = False
        return mask


def accept_greedy(batch: TreeBatch, argmax: np.ndarray, rows: np.ndarray | None = None) -> Accepted:
    """Greedy acceptance of `rows` (default all) given the target's argmax [B, T] at every node."""
    B, T = batch.shape
    rows = np.arange(B) if rows is None else np.asarray(rows, dtype=np.int64)
    tok, par, am = batch.tokens[rows], batch.parents[rows], argmax[rows]
    ok = np.zeros((len(rows), T), dtype=bool)
    ok[:, 0] = True
    r = np.arange(len(rows))
    for i in range(1, T):
        p = par[:, i]
        has = p >= 0
        pp = np.where(has, p, 0)
        ok[:, i] = has & ok[r, pp] & (tok[:, i] == am[r, pp])
    depth = np.where(ok, batch.depths[rows], -1)
    node = depth.argmax(axis=1)
    return Accepted(node, batch.depths[rows][r, node], am[r, node])


@dataclass
class Sampler:
    """One row's sampling parameters and random stream."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def processed_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Sampling distributions for rows of logits [A, V] (float32) with per-row temperature,
    top-k (0: off) and top-p (1: off).

    Raises:
        ValueError: a distribution is not finite (NaN or infinite logits).
    """
    x = logits.float() / temperature[:, None]
    V = x.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V))
        kth = sorted_x.gather(1, (k - 1)[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        sorted_p = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(sorted_p, dim=-1)
        cut = (cum - sorted_p >= top_p[:, None]) & (
            top_p[:, None] < 1
        )  # drop tokens once the mass before them reaches top_p
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(sorted_p).scatter_(1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    else:
        probs = torch.softmax(x, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("the sampling distribution is not finite (NaN or infinite logits)")
    return probs


def _uniforms(samplers: Sequence[Sampler], default: torch.Generator) -> torch.Tensor:
    return torch.cat([torch.rand(1, generator=s.generator or default, dtype=torch.float64) for s in samplers])


#: One source's draws at a node, for multi-step speculative sampling: its draft distribution
#: q [V] (float32), the drawn tokens [k] in order, and the packed index of the node holding
#: each (-1: not in the verified tree).
Trials = tuple[np.ndarray, np.ndarray, np.ndarray]


def mss_trials(
    drafts: Any, proposals: Sequence[Sequence[tuple[int, Any]]], rows: np.ndarray, use: np.ndarray | None = None
) -> list[dict[int, list[Trials]] | None]:
    """Per row in `rows`: packed node index -> the trials of every source that drew candidates
    at random there (sources.Candidates.dists), found in the merged tree by token path.

    Args:
        drafts: the merged DraftBatch (packed index = local node index + 1; 0 the root).
        proposals: per request of the batch, (source tag, checked Candidates) as proposed.
        use: [B] rows whose draft is packed (others: root only, so no trials).
    """
    out: list[dict[int, list[Trials]] | None] = []
    for b in np.asarray(rows, dtype=np.int64).tolist():
        drawn = [c for _, c in proposals[b] if c.dists is not None] if proposals else []
        if not drawn or (use is not None and not use[b]):
            out.append(None)
            continue
        s, e = int(drafts.offsets[b]), int(drafts.offsets[b + 1])
        child = {
            (p + 1, t): k + 1 for k, (t, p) in enumerate(zip(drafts.tokens[s:e].tolist(), drafts.parents[s:e].tolist()))
        }
        trials: dict[int, list[Trials]] = {}
        for c in drawn:
            where: list[int] = []  # packed index of each candidate in the merged tree (-1: dropped)
            for t, p in zip(c.tokens.tolist(), c.parents.tolist()):
                up = 0 if p < 0 else where[p]
                where.append(child.get((up, t), -1) if up >= 0 else -1)
            d = c.dists
            for j, p in enumerate(d.parents.tolist()):
                node = 0 if p < 0 else where[p]
                if node < 0:
                    continue  # the walk never reaches it
                draws = d.draws[j][d.draws[j] >= 0]
                kids = np.fromiter((child.get((node, x), -1) for x in draws.tolist()), np.int64, len(draws))
                trials.setdefault(node, []).append((d.q[j], draws, kids))
        out.append(trials or None)
    return out


def _speculative_trials(
    p: torch.Tensor, trials: Sequence[Trials], gen: torch.Generator
) -> tuple[int, int] | torch.Tensor:
    """MSS at one node: (token, packed child or -1) if a draw is accepted, else the residual
    distribution [V] (float64) to draw the node's token from."""
    p = p.double()
    for q, draws, kids in trials:
        qd = torch.from_numpy(q).to(p.device, torch.float64)
        for x, kid in zip(draws.tolist(), kids.tolist()):
            u = float(torch.rand(1, generator=gen, dtype=torch.float64))
            if u * float(qd[x]) < float(p[x]):  # accept with probability min(1, p(x) / q(x))
                return x, kid
            residual = (p - qd).clamp_(min=0.0)
            mass = float(residual.sum())
            # mass 0 means p == q, where rejecting has probability 0: only rounding gets here
            p = residual / mass if mass > 1e-12 else p
    return p


def accept_sampled(
    batch: TreeBatch,
    rows: np.ndarray,
    samplers: Sequence[Sampler],
    logits_at: Callable[[np.ndarray, np.ndarray], torch.Tensor],
    default: torch.Generator,
    trials: Sequence[dict[int, list[Trials]] | None] | None = None,
) -> tuple[Accepted, list[str | None]]:
    """The sampling walk for `rows` (one Sampler each), all rows one depth at a time; at nodes
    holding randomly drawn candidates, multi-step speculative sampling first.

    Args:
        logits_at: (rows, packed indices) -> their logits [A, V].
        default: the generator of rows without their own.
        trials: per row, packed node -> its trials (mss_trials), or None.

    Returns:
        the acceptance, and per row None or the error that failed it (its sampling
        distribution was not finite): such a row gets count 0 and bonus -1.
    """
    n = len(rows)
    rows = np.asarray(rows, dtype=np.int64)
    cur = np.zeros(n, dtype=np.int64)
    bonus = np.full(n, -1, dtype=np.int64)
    errors: list[str | None] = [None] * n
    active = np.ones(n, dtype=bool)
    temp = torch.tensor([s.temperature for s in samplers], dtype=torch.float32)
    top_k = torch.tensor([s.top_k for s in samplers], dtype=torch.int64)
    top_p = torch.tensor([s.top_p for s in samplers], dtype=torch.float32)
    toks, pars = batch.tokens[rows], batch.parents[rows]
    while active.any():
        a = np.flatnonzero(active)
        logits = logits_at(rows[a], cur[a])
        dev = logits.device
        sel = torch.from_numpy(a)
        try:
            probs = processed_probs(logits, temp[sel].to(dev), top_k[sel].to(dev), top_p[sel].to(dev))
        except ValueError:  # find the rows at fault, sample the others
            good = []
            for j, i in enumerate(a):
                try:
                    processed_probs(
                        logits[j : j + 1], temp[i : i + 1].to(dev), top_k[i : i + 1].to(dev), top_p[i : i + 1].to(dev)
                    )
                    good.append(j)
                except ValueError as e:
                    errors[i] = str(e)
                    active[i] = False
            if not good:
                continue
            a, logits = a[good], logits[good]
            sel = torch.from_numpy(a)
            probs = processed_probs(logits, temp[sel].to(dev), top_k[sel].to(dev), top_p[sel].to(dev))
        if trials is not None:  # multi-step speculative sampling where a source drew candidates
            keep = np.ones(len(a), dtype=bool)
            for j, i in enumerate(a.tolist()):
                at = trials[i].get(int(cur[i])) if trials[i] else None
                if not at:
                    continue
                got = _speculative_trials(probs[j], at, samplers[i].generator or default)
                if isinstance(got, tuple):
                    x, kid = got
                    keep[j] = False
                    if kid > 0:
                        cur[i] = kid
                    else:
                        bonus[i] = x
                        active[i] = False
                else:
                    probs[j] = got.to(probs.dtype)
            if not keep.all():
                a, probs = a[keep], probs[torch.from_numpy(keep).to(dev)]
                if not a.size:
                    continue
        u = _uniforms([samplers[i] for i in a], default).to(dev)
        cdf = torch.cumsum(probs.double(), dim=-1)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=probs.shape[-1] - 1)[:, 0]
        # never draw a zero-probability token (a uniform landing exactly on a flat step of the CDF)
        drawn = torch.where(probs.gather(1, drawn[:, None])[:, 0] > 0, drawn, probs.argmax(dim=-1))
        drawn = drawn.cpu().numpy()
        # the child of the current node holding the drawn token, if any
        match = (pars[a] == cur[a][:, None]) & (toks[a] == drawn[:, None])
        found = match.any(axis=1)
        child = match.argmax(axis=1)
        cur[a[found]] = child[found]
        stop = a[~found]
        bonus[stop] = drawn[~found]
        active[stop] = False
    depth = batch.depths[rows, cur]
    return Accepted(cur, np.where(bonus >= 0, depth, 0), bonus), errors
