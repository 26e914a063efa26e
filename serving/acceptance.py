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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from sssd.serving.tree_batch import TreeBatch


@dataclass
class Accepted:
    """Per row: the deepest accepted node (packed index; 0 = the root: nothing accepted),
    how many draft tokens were accepted, and the bonus token that follows them."""

    node: np.ndarray    # [B] int64
    count: np.ndarray   # [B] int64
    bonus: np.ndarray   # [B] int64

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


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
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
        cut = (cum - sorted_p >= top_p[:, None]) & (top_p[:, None] < 1)  # drop tokens once the mass before them reaches top_p
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


def accept_sampled(batch: TreeBatch, rows: np.ndarray, samplers: Sequence[Sampler],
                   logits_at: Callable[[np.ndarray, np.ndarray], torch.Tensor],
                   default: torch.Generator) -> tuple[Accepted, list[str | None]]:
    """The sampling walk for `rows` (one Sampler each), all rows one depth at a time.

    Args:
        logits_at: (rows, packed indices) -> their logits [A, V].
        default: the generator of rows without their own.

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
                    processed_probs(logits[j : j + 1], temp[i : i + 1].to(dev), top_k[i : i + 1].to(dev),
                                    top_p[i : i + 1].to(dev))
                    good.append(j)
                except ValueError as e:
                    errors[i] = str(e)
                    active[i] = False
            if not good:
                continue
            a, logits = a[good], logits[good]
            sel = torch.from_numpy(a)
            probs = processed_probs(logits, temp[sel].to(dev), top_k[sel].to(dev), top_p[sel].to(dev))
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
