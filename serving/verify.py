"""Packing a batch of draft trees for one forward pass, and verifying them.

Row b of a step holds the request's root (its last token, not yet in the KV
cache) followed by its draft nodes in tree order: node k of the draft sits
at packed index k + 1. Each query sees the request's cached context and its
own ancestors (SpecInfer's topology-aware mask); its model position is
cached + depth; its K/V are written at slot position cached + packed index,
and verification then moves the accepted path down to consecutive slots.

Greedy verification follows the target's argmax from the root while a child
matches. Sampling verification (SSSD paper, section 4.2) samples the target's
token at each visited node and follows the child holding that token; every
emitted token is therefore drawn from the target's own conditional
distribution, so the output is distributed exactly as without speculation
(the drafts are deterministic, so their scores never enter the sampler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

import sssd


@dataclass
class Packed:
    """One forward pass's inputs. B rows, T query slots, S KV positions."""

    tokens: np.ndarray      # [B, T] int64
    positions: np.ndarray   # [B, T] model positions
    writes: np.ndarray      # [B, T] KV slot positions
    visible: np.ndarray     # [B, T, S] bool
    kv_positions: np.ndarray  # [B, S] model position held at each KV slot position
    sizes: np.ndarray       # [B] real query tokens per row

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.visible.shape


def pack_trees(roots: Sequence[int], cached: Sequence[int], trees: Sequence[sssd.DraftTree | None]) -> Packed:
    """Packs each request's root + draft tree (None: root only)."""
    B = len(roots)
    sizes = np.array([1 + (len(t) if t is not None else 0) for t in trees], dtype=np.int64)
    cached = np.asarray(cached, dtype=np.int64)
    T = int(sizes.max())
    S = int((cached + T).max())
    tokens = np.zeros((B, T), np.int64)
    positions = np.zeros((B, T), np.int64)
    writes = cached[:, None] + np.arange(T)[None, :]
    visible = np.zeros((B, T, S), bool)
    kv_positions = np.broadcast_to(np.arange(S), (B, S)).copy()
    for b, (root, c, tree, n) in enumerate(zip(roots, cached, trees, sizes)):
        tokens[b, 0] = root
        positions[b, :] = c
        visible[b, :n, :c] = True
        if tree is not None and len(tree):
            tokens[b, 1:n] = tree.tokens
            positions[b, 1:n] = c + tree.depths
            visible[b, :n, c : c + n] = tree.attention_mask(include_root=True)
            kv_positions[b, c : c + n] = positions[b, :n]
        else:
            visible[b, 0, c] = True
        # padding queries see only themselves (their writes land past the real nodes)
        for i in range(n, T):
            visible[b, i, c + i] = True
    return Packed(tokens, positions, writes, visible, kv_positions, sizes)


def pack_chunks(cached: Sequence[int], chunks: Sequence[np.ndarray]) -> Packed:
    """Packs prefill chunks: row b feeds chunks[b] at positions cached[b] + i, causally."""
    B = len(chunks)
    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
    cached = np.asarray(cached, dtype=np.int64)
    T = int(sizes.max())
    S = int((cached + T).max())
    tokens = np.zeros((B, T), np.int64)
    positions = cached[:, None] + np.arange(T)[None, :]
    visible = np.zeros((B, T, S), bool)
    causal = np.tril(np.ones((T, T), bool))
    for b, (c, chunk, n) in enumerate(zip(cached, chunks, sizes)):
        tokens[b, :n] = chunk
        visible[b, :, :c] = True
        visible[b, :, c : c + T] = causal
    kv_positions = np.broadcast_to(np.arange(S), (B, S)).copy()
    return Packed(tokens, positions, positions.copy(), visible, kv_positions, sizes)


def children_of(tree: sssd.DraftTree | None) -> list[dict[int, int]]:
    """children[packed index] = {token: packed index of the child}."""
    n = 1 + (len(tree) if tree is not None else 0)
    children: list[dict[int, int]] = [dict() for _ in range(n)]
    if tree is not None:
        for k, (tok, par) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
            children[par + 1][tok] = k + 1
    return children


def greedy_walk(argmax: Sequence[int], children: list[dict[int, int]]) -> tuple[list[int], int]:
    """Accepted path (packed indices) and the target's next token after it."""
    path, cur = [], 0
    while True:
        nxt = children[cur].get(int(argmax[cur]))
        if nxt is None:
            return path, int(argmax[cur])
        path.append(nxt)
        cur = nxt


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Sampling distribution for one position: logits [V] -> probabilities [V] (float32)."""
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        cut = cum - sorted_p >= top_p  # drop tokens once the mass before them reaches top_p
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        probs = probs / probs.sum()
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("the sampling distribution is not finite (NaN or infinite logits)")
    return probs


def sample_walk(logits_of, children: list[dict[int, int]], temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """The paper's sampling rule: at each visited node draw the target's token;
    follow the child holding it, else stop with it as the bonus token.

    Args:
        logits_of: packed index -> logits [V] of that node.
    """
    path, cur = [], 0
    while True:
        probs = process_logits(logits_of(cur), temperature, top_k, top_p)
        token = int(torch.multinomial(probs, 1, generator=generator))
        nxt = children[cur].get(token)
        if nxt is None:
            return path, token
        path.append(nxt)
        cur = nxt
