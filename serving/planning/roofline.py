"""A roofline model of a forward pass on named hardware: a projection, not a measurement.

Each operator of a decoding step (SSSD paper, Table 1: the four attention
projections, the MLP, the output head, and attention over the KV cache)
costs the larger of its FLOPs over the device's peak and its memory traffic
over the device's bandwidth, plus a fixed per-pass overhead. Batch size b
and speculation length s_q (1 + draft tokens) enter every weight matmul as
b x s_q, so verifying more tokens is nearly free until b x s_q reaches the
compute-bound threshold (the paper's bs_q ~ 435 for Llama2-7b on an Ascend
910B4); attention's ratio grows with s_q alone. The result is a
planner.ForwardProfile, so the budget planner can project the budget per
batch size and the speedup from a replayed mean accepted length: `sssd
plan`. Real kernels are slower than the roofline for tall-skinny matmuls
(the paper's Figure 3a); `efficiency` scales the peak down.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sssd.serving.planning.profile import PROFILE_ROWS, ForwardProfile


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense 16-bit FLOP/s
    bandwidth: float  # memory bytes/s
    overhead_s: float = 20e-6  # per forward pass (launches, sync)


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, path: str | Path) -> ModelShape:
        """From a Hugging Face config.json (or the folder holding one)."""
        p = Path(path)
        cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        cfg = cfg.get("text_config", cfg)
        heads = cfg["num_attention_heads"]
        return cls(
            p.name,
            cfg["num_hidden_layers"],
            cfg["hidden_size"],
            heads,
            cfg.get("num_key_value_heads", heads),
            cfg.get("head_dim") or cfg["hidden_size"] // heads,
            cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
            cfg["vocab_size"],
        )

    @property
    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.intermediate) + 2 * self.vocab * self.hidden


HARDWARE = {
    "h100": Hardware("NVIDIA H100 SXM", 989e12, 3.35e12),
    "h200": Hardware("NVIDIA H200 SXM", 989e12, 4.8e12),
    "a100": Hardware("NVIDIA A100 80GB SXM", 312e12, 2.04e12),
    "l4": Hardware("NVIDIA L4", 121e12, 0.30e12),
    "ascend-910b4": Hardware("Huawei Ascend 910B4 (the SSSD paper's device)", 280e12, 0.8e12),
}

MODELS = {
    "llama-2-7b": ModelShape("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-3-8b": ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "qwen2.5-coder-1.5b": ModelShape("Qwen2.5-Coder-1.5B", 28, 1536, 12, 2, 128, 8960, 151936),
    "smollm2-135m": ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152),
}

#: The SSSD paper's end-to-end figures, for side-by-side reading (Llama2-7b, Ascend 910B4).
PAPER = {"batch 1": "2.05-2.61x", "batch 64": "1.37-1.80x", "free budget": "b x s_q ~ 435 (s_q = 54 at batch 8)"}


def operators(m: ModelShape, batch: int, s_q: int, context: int) -> list[tuple[float, float, int]]:
    """The operators of one forward pass as (FLOPs, bytes moved, how many times it runs), in the
    order OPERATORS names them."""
    w = m.dtype_bytes
    tokens = batch * s_q
    h, hq, hkv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    ops = [
        (2 * tokens * h * out_dim, w * (h * out_dim + tokens * (h + out_dim)), m.layers) for out_dim in (hq, hkv, hkv)
    ]  # Q, K, V projections
    ops.append((2 * tokens * hq * h, w * (hq * h + tokens * (hq + h)), m.layers))  # O projection
    ops.append(
        (2 * tokens * h * m.intermediate, w * (h * m.intermediate + tokens * (h + m.intermediate)), 3 * m.layers)
    )  # gate, up, down
    kv = context + s_q
    ops.append(
        (
            4 * batch * m.heads * s_q * kv * m.head_dim,  # attention: QK^T and AV
            w * (2 * batch * m.kv_heads * kv * m.head_dim + 2 * tokens * hq),
            m.layers,
        )
    )
    ops.append((2 * tokens * h * m.vocab, w * (h * m.vocab + tokens * h), 1))  # output head
    return ops


#: What `operators` returns, in order.
OPERATORS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp", "attention", "head")


def breakdown(m: ModelShape, hw: Hardware, batch: int, s_q: int, context: int, efficiency: float = 1.0) -> dict:
    """Where one pass's roofline time goes: seconds of the weight matmuls, attention over the KV
    cache, the output head and the per-pass overhead, each part compute- or memory-bound."""
    peak = hw.peak_flops * efficiency
    parts: dict = {}
    for name, (f, io, n) in zip(OPERATORS, operators(m, batch, s_q, context)):
        group = "weights" if name.endswith("proj") or name == "mlp" else name
        sec, bound = parts.get(group, (0.0, {}))
        kind = "compute" if f / peak > io / hw.bandwidth else "memory"
        bound[kind] = bound.get(kind, 0.0) + n * max(f / peak, io / hw.bandwidth)
        parts[group] = (sec + n * max(f / peak, io / hw.bandwidth), bound)
    out = {g: {"seconds": sec, "bound": max(b, key=b.get)} for g, (sec, b) in parts.items()}
    out["overhead"] = {"seconds": hw.overhead_s, "bound": "fixed"}
    return out


def step_seconds(m: ModelShape, hw: Hardware, batch: int, s_q: int, context: int, efficiency: float = 1.0) -> float:
    """Roofline time of one forward pass: batch rows of s_q query tokens over `context` cached ones."""
    peak = hw.peak_flops * efficiency
    return sum(n * max(f / peak, io / hw.bandwidth) for f, io, n in operators(m, batch, s_q, context)) + hw.overhead_s


def fit(m: ModelShape, hw: Hardware, measured: ForwardProfile) -> tuple[Hardware, float]:
    """The roofline corrected to a measured profile: the fraction of peak FLOP/s, the bandwidth
    and the per-pass overhead that make it closest to the measurement (the smallest worst-case
    log ratio over the measured points, by grid search). Returns (hardware, efficiency)."""
    import numpy as np

    pts = [(r, t) for r in measured.rows for t in measured.tokens]
    want = np.array([measured.time(r, t) for r, t in pts])
    ops = [operators(m, r, t, measured.context) for r, t in pts]
    flops = np.array([[f * n for f, _, n in o] for o in ops])  # [points, operators]
    io = np.array([[b * n for _, b, n in o] for o in ops])
    overheads = np.concatenate([[0.0], np.geomspace(1e-5, 0.1, 120)])
    best = (np.inf, hw, 1.0)
    for eff in np.geomspace(0.05, 1.0, 60):
        t_f = flops / (hw.peak_flops * eff)
        for bw in np.linspace(0.3, 1.0, 29) * hw.bandwidth:
            base = np.maximum(t_f, io / bw).sum(axis=1)
            err = np.abs(np.log((base[None, :] + overheads[:, None]) / want[None, :])).max(axis=1)
            i = int(err.argmin())
            if err[i] < best[0]:
                best = (
                    err[i],
                    Hardware(f"{hw.name}, fitted", hw.peak_flops, float(bw), float(overheads[i])),
                    float(eff),
                )
    return best[1], best[2]


def roofline_profile(
    m: ModelShape, hw: Hardware, context: int = 512, efficiency: float = 1.0, max_tokens: int = 65
) -> ForwardProfile:
    rows = list(PROFILE_ROWS)
    tokens = list(range(1, max_tokens + 1))
    seconds = [[step_seconds(m, hw, b, t, context, efficiency) for t in tokens] for b in rows]
    return ForwardProfile(
        rows,
        tokens,
        seconds,
        context,
        {"kind": "roofline", "hardware": hw.name, "model": m.name, "efficiency": efficiency},
    )


def projection(
    m: ModelShape,
    hw: Hardware,
    mat: dict[int, float],
    batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    context: int = 512,
    efficiency: float = 1.0,
) -> list[dict]:
    """Per batch size: the planner's budget under the roofline profile and the projected speedup
    MAT(b) / (t(B, b + 1) / t(B, 1))."""
    from sssd.serving.planning.planner import BudgetPlanner

    prof = roofline_profile(m, hw, context, efficiency)
    planner = BudgetPlanner(None, mat, prof, adaptive=False)
    out = []
    for B in batches:
        b = planner.budget(B)
        cost = prof.time(B, b + 1) / prof.time(B, 1)
        out.append(
            {
                "batch": B,
                "budget": b,
                "mat": round(planner.mat[b], 3),
                "cost_ratio": round(cost, 3),
                "speedup": round(planner.mat[b] / cost, 3),
                "plain_tokens_per_s": round(B / prof.time(B, 1), 1),
                "tokens_per_s": round(B * planner.mat[b] / prof.time(B, b + 1), 1),
            }
        )
    return out
