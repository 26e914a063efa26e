"""KV cache for the engine: a pool of per-request slots, kept dense.

K and V of every layer live in one tensor [layers, 2, slots, kv_heads,
capacity, head_dim], so that moving entries (compacting accepted paths,
swapping slots) is one gather and one scatter for all layers at once. The
running requests occupy slots 0..n-1, decoding ones first (0..d-1) and
prefilling ones after them (d..n-1), so that a forward pass over either
group reads its keys as a plain slice (a view, no gather). Admitting,
promoting (prefill -> decode) and retiring requests keep that order by
swapping slots, which copies only the positions in use.

A request's tree tokens are written at positions [cached, cached + T); after
verification the accepted path is moved down to [cached, cached + 1 + a) and
the rejected nodes are simply overwritten by the next step (no recomputation
of accepted tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PoolShape:
    layers: int
    kv_heads: int
    head_dim: int
    slots: int
    capacity: int  # tokens per slot

    def bytes(self, dtype: torch.dtype) -> int:
        return (
            2 * self.layers * self.slots * self.kv_heads * self.capacity * self.head_dim * torch.finfo(dtype).bits // 8
        )


class KVPool:
    """K/V storage for up to `slots` requests of up to `capacity` tokens each."""

    def __init__(self, shape: PoolShape, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.shape = shape
        self.kv = torch.zeros(
            (shape.layers, 2, shape.slots, shape.kv_heads, shape.capacity, shape.head_dim), dtype=dtype, device=device
        )
        # every layer's K and V as rows of one matrix: [layers * 2, slots * heads * capacity, head_dim]
        self._rows = self.kv.view(shape.layers * 2, -1, shape.head_dim)

    def flat_index(self, rows: slice, positions: torch.Tensor) -> torch.Tensor:
        """Row indices into a layer's [slots * heads * capacity, head_dim] view for
        writing [B, H, T] new entries at positions [B, T] of slots `rows`."""
        sh = self.shape
        slot = torch.arange(rows.start, rows.stop, device=positions.device)[:, None, None]
        head = torch.arange(sh.kv_heads, device=positions.device)[None, :, None]
        return ((slot * sh.kv_heads + head) * sh.capacity + positions[:, None, :]).reshape(-1)

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores new keys/values k, v [B, H, T, D] at `index` (from flat_index)."""
        d = self.shape.head_dim
        self._rows[2 * layer].index_copy_(0, index, k.reshape(-1, d))
        self._rows[2 * layer + 1].index_copy_(0, index, v.reshape(-1, d))

    def view(self, layer: int, rows: slice, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of slots `rows`, positions [0, length): views, no copies."""
        return self.kv[layer, 0, rows, :, :length], self.kv[layer, 1, rows, :, :length]

    def move(self, slots: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        """Copies positions src[i] -> dst[i] within slot slots[i], every head and layer, in one
        gather and one scatter. Sources are read before anything is written."""
        if len(slots) == 0:
            return
        sh = self.shape
        dev = self.kv.device
        base = torch.from_numpy(np.asarray(slots, dtype=np.int64) * sh.kv_heads).to(dev)[:, None]
        heads = torch.arange(sh.kv_heads, device=dev)[None, :]
        cap = sh.capacity
        s = ((base + heads) * cap + torch.from_numpy(np.asarray(src, dtype=np.int64)).to(dev)[:, None]).reshape(-1)
        d = ((base + heads) * cap + torch.from_numpy(np.asarray(dst, dtype=np.int64)).to(dev)[:, None]).reshape(-1)
        self._rows[:, d] = self._rows[:, s]

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchanges the first `length` positions of slots a and b (all layers)."""
        if a == b or length <= 0:
            return
        ka, kb = self.kv[:, :, a, :, :length], self.kv[:, :, b, :, :length]
        tmp = ka.clone()
        ka.copy_(kb)
        kb.copy_(tmp)
