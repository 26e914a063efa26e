"""Engine overhead: a decode step's wall time beyond its forward pass.

For each batch size, the engine decodes the same greedy chat prompts with a
fixed budget (default 32) and the default datastore; after every request
has been prefilled, it times each step() call and, inside it, the
transformer's forward pass (the model body) and the output head (logits or
argmax), by timing those modules' calls. Reported per batch size: mean
step, forward and head ms, and the overhead (step - forward) / forward,
split into the head, drafting (the engine's drafting histogram) and the
rest (packing, acceptance, compaction, emission, drafter updates, Python).

It runs against whatever engine is importable, so the same command measures
an older checkout (install it in another environment) for a before/after.

Usage:
  python benchmarks/bench_engine_overhead.py                      # batch 1 and 64, budget 32
  python benchmarks/bench_engine_overhead.py --batch-sizes 1 8 64 --budget 16 --steps 30
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder, machine  # noqa: E402

PROMPTS = [
    "Write a haiku about the sea.",
    "Explain what a suffix array is.",
    "Give me three tips for learning Python.",
    "What is the capital of France, and why is it famous?",
    "Describe a sunset over the mountains.",
    "How do I boil an egg?",
    "Summarise the plot of Hamlet.",
    "Why is the sky blue?",
]


class Timed:
    """Wraps a module's forward and sums the seconds spent in it."""

    def __init__(self, module):
        self.seconds = 0.0
        inner = module.forward

        def forward(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        module.forward = forward


def model_of(engine):
    backend = getattr(engine, "backend", None) or engine.runner  # older engines: engine.runner
    return backend.model


def measure(engine, timers, batch: int, steps: int, max_tokens: int) -> dict:
    from sssd.serving.engine.params import SamplingParams

    body, head = timers
    for i in range(batch):
        engine.add_request(
            [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} ({i})"}],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
    while len(engine.decoding()) < batch:  # admit and prefill everyone first
        engine.step()
    m = engine.metrics
    b0, h0, d0, n0 = body.seconds, head.seconds, m.draft_time.sum, m.steps
    wall = 0.0
    timed = 0
    while timed < steps and len(engine.decoding()) == batch:
        t0 = time.perf_counter()
        engine.step()
        wall += time.perf_counter() - t0
        timed += 1
    forward, head_s, draft = body.seconds - b0, head.seconds - h0, m.draft_time.sum - d0
    n = m.steps - n0
    for rid in list(engine.requests):  # drain
        engine.abort(rid)
    engine.step()
    return {
        "batch": batch,
        "steps": n,
        "step_ms": round(1e3 * wall / n, 2),
        "forward_ms": round(1e3 * forward / n, 2),
        "head_ms": round(1e3 * head_s / n, 2),
        "draft_ms": round(1e3 * draft / n, 3),
        "overhead": round((wall - forward) / forward, 4),
        "overhead_head": round(head_s / forward, 4),
        "overhead_drafting": round(draft / forward, 4),
        "overhead_rest": round((wall - forward - head_s - draft) / forward, 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per batch size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="sssd/data/calibration-smollm2.json")
    args = ap.parse_args()
    from sssd.serving.engine import EngineConfig, LLMEngine

    engine = LLMEngine(
        args.model,
        datastore="default",
        drafter=args.drafter,
        config=EngineConfig(
            max_running=max(args.batch_sizes), max_model_len=1024, budget=args.budget, threads=args.threads
        ),
    )
    model = model_of(engine)
    timers = (Timed(model.model), Timed(model.get_output_embeddings()))
    rec = Recorder("engine_overhead", vars(args))
    rows = []
    measure(engine, timers, 1, 3, 8)  # warm-up
    for B in args.batch_sizes:
        row = measure(engine, timers, B, args.steps, max_tokens=args.steps * 4 + 16)
        rows.append(row)
        rec.add(**row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"machine": machine()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
