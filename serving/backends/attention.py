"""Attention over the engine's KV pool, plugged into Hugging Face models.

The engine owns the KV cache (kv_cache.KVPool); a model's layers only supply
projections, rotary embeddings, norms and MLPs. We register our own
attention function with transformers' AttentionInterface (the mechanism
vLLM's Transformers backend also uses) and load models with
``attn_implementation=ATTENTION``. Each attention layer then calls
`pool_attention` with its new keys and values; we write them into the pool at
this step's slot positions and attend over the pool with the step's mask.

So no cache object crosses the model's forward signature (whose cache
argument transformers renamed from ``past_key_values`` to ``cache``): the
forward pass carries a `PoolStep` as a keyword argument, which transformers
passes unchanged from the model's forward to every attention call.

Grouped-query heads (several query heads per K/V head) read their shared
K/V in place. On a CPU, torch's `enable_gqa` does that. On CUDA, torch's
fused kernels that take an arbitrary mask (memory-efficient attention) do
not take `enable_gqa`, and the one that does falls back to copying K/V per
head; there each K/V head's query heads are folded into one head of G x T
queries (G query heads per K/V head), the mask repeated G times along the
queries, built once per pass as an additive bias. SSSD_CUDA_ATTENTION=gqa
uses `enable_gqa` on CUDA too.
"""

from __future__ import annotations

import os

import torch

ATTENTION = "sssd_pool"
STEP_KWARG = "sssd_step"
#: How grouped-query attention runs on CUDA devices: "folded" or "gqa" (see above).
CUDA_MODES = ("folded", "gqa")


def cuda_mode() -> str:
    mode = os.environ.get("SSSD_CUDA_ATTENTION", "folded").strip().lower()
    if mode not in CUDA_MODES:
        raise ValueError(f"SSSD_CUDA_ATTENTION must be one of {', '.join(CUDA_MODES)}, got {mode!r}")
    return mode


class PoolStep:
    """One forward pass's view of the pool: which slots, where new K/V go, how far to read.

    `fold` (default: on CUDA, unless SSSD_CUDA_ATTENTION=gqa) runs grouped-query heads folded
    along the queries (folded_attention)."""

    def __init__(
        self,
        pool,
        rows: slice,
        positions: torch.Tensor,
        length: int,
        fold: bool | None = None,
        ragged: torch.Tensor | None = None,
        sizes=None,
        cached=None,
        head_rows: int | None = None,
    ):
        self.pool, self.rows, self.length = pool, rows, length
        self.index = pool.flat_index(rows, positions)  # the same for every layer
        #: ragged passes: the model's layers ran over the N real tokens only (one sequence of N), and
        #: `ragged` [N] says where each sits in the [B, T] layout (b * T + i); attention alone sees the
        #: rows, and only the real tokens' K/V are written
        self.ragged, self.shape = ragged, tuple(positions.shape)
        if ragged is not None:
            B, T = self.shape
            kv_heads = self.index.numel() // (B * T)
            self.index = self.index.view(B, kv_heads, T).transpose(0, 1).reshape(kv_heads, B * T)[:, ragged].reshape(-1)
        self.fold = (pool.kv.device.type == "cuda" and cuda_mode() == "folded") if fold is None else fold
        self._biases: dict = {}  # (mask id, groups, dtype) -> the folded additive mask, shared by the layers
        self.split = (
            split_plan(sizes, positions.device, length, cached, head_rows)
            if ragged is not None and sizes is not None
            else None
        )

    def folded_bias(self, mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask [B, 1, G x T, S] of the folded queries, built once per pass and mask."""
        key = (id(mask), groups, dtype)
        if key not in self._biases:
            self._biases[key] = (mask, fold_mask(mask, groups, dtype))  # the mask held: its id stays unique
        return self._biases[key][1]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores this step's keys/values [B, H_kv, T, D] (ragged: [1, H_kv, N, D]); returns the
        slots' K/V [B, H_kv, S, D]."""
        self.pool.write(layer, self.index, key, value)
        return self.pool.view(layer, self.rows, self.length)

    def rows_of(self, query: torch.Tensor) -> torch.Tensor:
        """Ragged queries [1, H, N, D] laid out in their rows [B, H, T, D] (padding: zeros)."""
        if self.ragged is None:
            return query
        B, T = self.shape
        H, D = query.shape[1], query.shape[3]
        out = query.new_zeros((H, B * T, D))
        out.index_copy_(1, self.ragged, query[0])  # index_copy_/index_select: 10-20x faster than [:, idx] here
        return out.view(H, B, T, D).transpose(0, 1)

    def tokens_of(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [B, H, T, D] back to the ragged tokens [1, H, N, D]."""
        if self.ragged is None:
            return out
        B, H, T, D = out.shape
        return out.transpose(0, 1).reshape(H, B * T, D).index_select(1, self.ragged)[None]


#: What one more attention call costs, in query rows of attention at CALL_CONTEXT keys or fewer (the
#: split's trade-off). A padded query row's cost grows with the keys it reads, a call's does not: at
#: longer contexts a call costs CALL_COST x CALL_CONTEXT / keys query rows (SmolLM2, 16 rows at 700
#: cached positions, one row verifying 2 tokens: padding every row to 2 queries cost 54 ms of attention
#: a pass, the split 45 ms).
CALL_COST = 16
CALL_CONTEXT = 256


class SplitPlan:
    """Attention of a ragged pass in 1 + R calls instead of one over rows padded to the largest
    tree: the first `width` queries of every head row in one call (no K/V copied), then each of the
    R rows with more queries attends with the rest alone (a one-row view of its K/V). With one row
    verifying 60 nodes beside rows of 1-3, attention costs what the real queries cost, not rows x 61
    (at long contexts, most of a padded pass). Rows from `heads` on (prompt chunks written by a
    decode pass) attend whole, alone. Each call reads keys only as far as its queries see (with
    `cached`: the rows' cached positions), not as far as the pass's longest row.

    Ragged tokens are in row-major order: row r's are [start[r], start[r] + sizes[r])."""

    def __init__(self, sizes, width: int, device: torch.device, cached=None, heads: int | None = None):
        import numpy as np

        sizes = np.asarray(sizes, dtype=np.int64)
        B = sizes.size
        H = B if heads is None else int(heads)
        start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        head = np.minimum(sizes[:H], width)
        rows = np.repeat(np.arange(H), head)
        idx = np.arange(int(head.sum())) - np.repeat(np.cumsum(head) - head, head)
        self.width, self.rows = int(width), H
        self.src = torch.from_numpy(np.repeat(start[:H], head) + idx).to(device)  # ragged position
        self.dst = torch.from_numpy(rows * width + idx).to(device)  # position in [H x width]
        ends = None if cached is None else np.asarray(cached, dtype=np.int64) + sizes  # keys each row's queries see
        #: keys the head call reads (None: all of them)
        self.head_keys = None if ends is None or not H else int((ends[:H] - sizes[:H] + head).max())
        #: (row, first ragged token, end, the first one's query index in its row, keys it reads or None)
        self.tails = [
            (int(r), int(start[r] + q0), int(start[r] + sizes[r]), q0, None if ends is None else int(ends[r]))
            for r in range(B)
            for q0 in [width if r < H else 0]
            if sizes[r] > q0
        ]


def split_plan(
    sizes, device: torch.device, keys: int | None = None, cached=None, heads: int | None = None
) -> SplitPlan | None:
    """The split that costs least (rows x width + the tails' queries + a call's cost per extra call, in
    query rows: CALL_COST, less past CALL_CONTEXT `keys`); None when padding every row costs no more.
    Rows from `heads` on (prompt chunks) always attend alone (see SplitPlan)."""
    import numpy as np

    call = CALL_COST * CALL_CONTEXT / max(int(keys or 0), CALL_CONTEXT)
    sizes = np.asarray(sizes, dtype=np.int64)
    H = sizes.size if heads is None else int(heads)
    T = int(sizes[:H].max()) if H else 1
    best_w, best = T, H * T
    for w in np.unique(sizes[:H]):
        longer = sizes[:H] > w
        cost = H * int(w) + int((sizes[:H][longer] - w).sum()) + call * int(longer.sum())
        if cost < best:
            best_w, best = int(w), cost
    if best_w < T or H < sizes.size:
        return SplitPlan(sizes, best_w, device, cached, H)
    return None


def split_attention(step: PoolStep, query, k, v, mask, scaling, groups: int) -> torch.Tensor:
    """Attention of ragged queries [1, H, N, D] by the step's SplitPlan; returns [1, H, N, D]."""
    plan = step.split
    B, W = plan.rows, plan.width
    _, H, N, D = query.shape
    out = query.new_empty((H, N, D))
    if B:
        S = plan.head_keys or k.shape[2]
        q = query.new_zeros((H, B * W, D))
        q.index_copy_(1, plan.dst, query[0].index_select(1, plan.src))
        head = torch.nn.functional.scaled_dot_product_attention(
            q.view(H, B, W, D).transpose(0, 1),
            k[:B, :, :S],
            v[:B, :, :S],
            attn_mask=mask[:B, :, :W, :S],
            scale=scaling,
            enable_gqa=groups > 1,
        )
        out.index_copy_(1, plan.src, head.transpose(0, 1).reshape(H, B * W, D).index_select(1, plan.dst))
    for r, j0, j1, q0, keys in plan.tails:
        S = keys or k.shape[2]
        out[:, j0:j1] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, j0:j1],
            k[r : r + 1, :, :S],
            v[r : r + 1, :, :S],
            attn_mask=mask[r : r + 1, :, q0 : q0 + j1 - j0, :S],
            scale=scaling,
            enable_gqa=groups > 1,
        )[0]
    return out[None]


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * groups, S, D] for grouped-query attention (a view until reshape)."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def fold_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask [B, 1, T, S] (True = visible) as the additive bias [B, 1, G x T, S] of queries
    folded G to a head: 0 where visible, -inf elsewhere. Its rows are padded to a multiple of 16
    elements in memory (the fused kernel's alignment), so no kernel copies it again."""
    B, _, T, S = mask.shape
    padded = -(-S // 16) * 16
    out = torch.empty((B, 1, groups * T, padded), dtype=dtype, device=mask.device)[..., :S]
    out.view(B, 1, groups, T, S).copy_(
        torch.where(mask, 0.0, float("-inf")).to(dtype)[:, :, None].expand(B, 1, groups, T, S)
    )
    return out


def folded_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Grouped-query attention with each K/V head's G query heads folded into one head of G x T
    queries: query [B, H, T, D], key/value [B, H_kv, S, D], bias from fold_mask; returns
    [B, H, T, D]. The same numbers as attending per query head (each query row is computed alone)."""
    B, H, T, D = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(B, kv_heads, (H // kv_heads) * T, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=bias, scale=scaling)
    return out.reshape(B, H, T, D)  # the kernel may lay its output out by its own strides


def pool_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], this step's key/value
    [B, H_kv, T, D], a boolean mask [B, 1, T, S] (True = visible); returns [B, T, H, D]."""
    step: PoolStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(
            f"the {ATTENTION!r} attention runs only inside a TorchBackend forward pass (no {STEP_KWARG} given)"
        )
    k, v = step.update(key, value, module.layer_idx)
    groups = query.shape[1] // k.shape[1]
    if getattr(step, "split", None) is not None and not softcap and not step.fold and attention_mask is not None:
        return split_attention(step, query, k, v, attention_mask, scaling, groups).transpose(1, 2).contiguous(), None
    query = step.rows_of(query) if hasattr(step, "rows_of") else query
    if softcap:  # logit soft-capping (Gemma 2) has no fused kernel: the plain computation
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
        scores = torch.matmul(query, k.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, v)
    elif getattr(step, "fold", False) and attention_mask is not None:  # (other steps: pipeline stages, self-drafting)
        bias = step.folded_bias(attention_mask, groups, query.dtype)
        out = folded_attention(query, k, v, bias, scaling)
    else:
        # grouped-query heads read their shared K/V in place: copying them out per head (the expand above)
        # cost 5-16x the attention itself at long contexts on this CPU, with bit-identical results
        out = torch.nn.functional.scaled_dot_product_attention(
            query, k, v, attn_mask=attention_mask, scale=scaling, enable_gqa=groups > 1
        )
    if hasattr(step, "tokens_of"):
        out = step.tokens_of(out)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Registers `pool_attention` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, pool_attention)
    return ATTENTION
