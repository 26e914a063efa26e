"""Grouped-query attention over the KV pool: K/V copied out per head (before) vs read in place (after).

SmolLM2-135M-Instruct (9 query heads, 3 KV heads), batch 4, four ~4.2k-token prompts cut from the
standard library's argparse.py, 24 greedy tokens each, plain decoding, 2 threads. The two attention
functions alternate in one process over one engine (two rounds); the engine's metrics give prefill
tokens/s and the forward time per decode step.

Usage: python benchmarks/bench_gqa_attention.py
"""

import sysconfig
from pathlib import Path

import torch
from transformers import AttentionInterface

from sssd.serving.backends import attention as A
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams


def old(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kw):
    step = kw.get(A.STEP_KWARG)
    k, v = step.update(key, value, module.layer_idx)
    g = query.shape[1] // k.shape[1]
    k, v = A._expand_kv(k, g), A._expand_kv(v, g)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


code = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
eng = LLMEngine(
    "smollm2-135m-instruct", datastore=None, draft=[], config=EngineConfig(max_model_len=8192, max_running=4, threads=2)
)
prompts = [[{"role": "user", "content": code[i * 3000 : i * 3000 + 18000] + "\nSummarise."}] for i in range(4)]
print("prompt tokens", [len(eng.encode(p)) for p in prompts])
from sssd.serving.engine import EngineMetrics  # noqa: E402

for rnd in range(2):
    for name, fn in (("expand (before)", old), ("enable_gqa (after)", A.pool_attention)):
        AttentionInterface.register(A.ATTENTION, fn)
        eng.metrics = EngineMetrics()
        eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        m = eng.metrics
        print(
            f"round {rnd} {name}: prefill {m.prefill_tokens} tok in {m.prefill_seconds:.1f} s "
            f"({m.prefill_tokens / m.prefill_seconds:.0f} tok/s); decode {m.steps} steps, forward "
            f"{m.forward_seconds / m.steps * 1000:.0f} ms/step",
            flush=True,
        )
