"""KV cache for the engine: a pool of per-request slots, kept dense.

Every layer holds K and V as [slots, kv_heads, capacity, head_dim] tensors.
The running requests occupy slots 0..n-1, decoding ones first (0..d-1) and
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

import torch


@dataclass
class PoolShape:
    layers: int
    kv_heads: int
    head_dim: int
    slots: int
    capacity: int  # tokens per slot

    def bytes(self, dtype: torch.dtype) -> int:
        return 2 * self.layers * self.slots * self.kv_heads * self.capacity * self.head_dim * torch.finfo(dtype).bits // 8


class KVPool:
    """K/V storage for up to `slots` requests of up to `capacity` tokens each."""

    def __init__(self, shape: PoolShape, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.shape = shape
        s = (shape.slots, shape.kv_heads, shape.capacity, shape.head_dim)
        self.k = [torch.zeros(s, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.v = [torch.zeros(s, dtype=dtype, device=device) for _ in range(shape.layers)]

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
        self.k[layer].view(-1, d).index_copy_(0, index, k.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, index, v.reshape(-1, d))

    def view(self, layer: int, rows: slice, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of slots `rows`, positions [0, length): views, no copies."""
        return self.k[layer][rows, :, :length], self.v[layer][rows, :, :length]

    def move(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Within a slot, copies positions src -> dst (all layers); src, dst 1-D, same length."""
        for k, v in zip(self.k, self.v):
            k[slot, :, dst] = k[slot, :, src]
            v[slot, :, dst] = v[slot, :, src]

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchanges the first `length` positions of slots a and b (all layers)."""
        if a == b or length <= 0:
            return
        for k, v in zip(self.k, self.v):
            for t in (k, v):
                tmp = t[a, :, :length].clone()
                t[a, :, :length] = t[b, :, :length]
                t[b, :, :length] = tmp
