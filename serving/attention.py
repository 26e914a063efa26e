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
"""

from __future__ import annotations

import torch

ATTENTION = "sssd_pool"
STEP_KWARG = "sssd_step"


class PoolStep:
    """One forward pass's view of the pool: which slots, where new K/V go, how far to read."""

    def __init__(self, pool, rows: slice, positions: torch.Tensor, length: int):
        self.pool, self.rows, self.length = pool, rows, length
        self.index = pool.flat_index(rows, positions)  # the same for every layer

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores this step's keys/values [B, H_kv, T, D]; returns the slots' K/V [B, H_kv, S, D]."""
        self.pool.write(layer, self.index, key, value)
        return self.pool.view(layer, self.rows, self.length)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * groups, S, D] for grouped-query attention (a view until reshape)."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def pool_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], this step's key/value
    [B, H_kv, T, D], a boolean mask [B, 1, T, S] (True = visible); returns [B, T, H, D]."""
    step: PoolStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"the {ATTENTION!r} attention runs only inside a TorchBackend forward pass (no {STEP_KWARG} given)")
    k, v = step.update(key, value, module.layer_idx)
    groups = query.shape[1] // k.shape[1]
    if softcap:  # logit soft-capping (Gemma 2) has no fused kernel: the plain computation
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
        scores = torch.matmul(query, k.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, v)
    else:
        # grouped-query heads read their shared K/V in place: copying them out per head (the expand above)
        # cost 5-16x the attention itself at long contexts on this CPU, with bit-identical results
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=attention_mask, scale=scaling,
                                                               enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Registers `pool_attention` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, pool_attention)
    return ATTENTION
