"""SpecPipe: pipelined token trees vs plain pipelined decoding vs non-pipelined speculation.

One model split into --stages stage processes (serving/backends/pipeline_backend.py, gloo,
--threads torch threads each) serves every variant, side by side on the same
prompts (greedy, float32), rounds interleaved so that a noisy neighbour hits
all of them alike:

* plain-pp: plain pipelined decoding (one token per trip through the stages);
* spec-seq: non-pipelined speculation on the same stages: the engine's own
  loop, a draft tree of --budget nodes passing stage after stage;
* specpipe-L<levels>: SpecPipe's schedule (serving/drafting/specpipe.py), --width draft
  nodes entering stage 0 per request and step, at most <levels> tree levels
  per step (1: the paper's one layer per step).

Per variant and batch size: output tokens per second (decode and prefill, wall
clock), tokens per pipeline step (a stage-time: plain-pp and specpipe count
their steps; spec-seq counts each of its passes as --stages steps), seconds
per pipeline step, accepted draft tokens, flushes, and whether the outputs equal
plain-pp's (they must).

Usage:
  python benchmarks/bench_specpipe.py                                  # SmolLM2-135M, 2 stages, bs 1 and 4
  python benchmarks/bench_specpipe.py --model qwen2.5-coder-1.5b-instruct \\
      --datastore ~/.cache/sssd/datastores/sharegpt-qwen2.5 --sets humaneval --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import load_prompts  # noqa: E402
from common import Recorder, machine  # noqa: E402

from sssd.serving.backends.pipeline_backend import PipelineBackend  # noqa: E402
from sssd.serving.engine import EngineConfig, LLMEngine  # noqa: E402
from sssd.serving.engine.factory import resolve_model  # noqa: E402
from sssd.serving.engine.params import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target: model name or folder")
    ap.add_argument("--datastore", default="default", help="retrieval's datastore ('none': the prompts only)")
    ap.add_argument("--draft", default="retrieval", help="draft sources, comma-separated (retrieval, model:NAME)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    ap.add_argument("--sets", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompts-per-row", type=int, default=1, help="B x this prompts per set at batch B")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=8, help="spec-seq's draft tree budget")
    ap.add_argument("--width", type=int, default=4, help="specpipe's draft nodes per request and step")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4], help="specpipe variants: levels per step")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repetitions (the faster kept)")
    args = ap.parse_args()
    rec = Recorder("specpipe", vars(args))
    max_b = max(args.batch_sizes)
    path = resolve_model(args.model)
    t0 = time.perf_counter()
    backend = PipelineBackend(path, args.stages, slots=max_b, capacity=args.max_model_len, threads=args.threads)
    print(
        f"{path.name}: {args.stages} stages {backend.ranges}, started in {time.perf_counter() - t0:.1f} s", flush=True
    )
    draft = [d for d in args.draft.split(",") if d]
    ds = None if args.datastore == "none" else args.datastore

    def engine(stages: int, sources: list, budget: int) -> LLMEngine:
        cfg = EngineConfig(
            max_running=max_b,
            max_model_len=args.max_model_len,
            budget=budget,
            pipeline_stages=stages,
            threads=args.threads,
        )
        return LLMEngine(path, datastore=ds if sources else None, draft=sources, config=cfg, backend=backend)

    costs = {T: pass_seconds(backend, T) for T in sorted({1, args.width + 1, args.budget + 1})}
    print(
        "one pass through all stages, one stage at a time (context 256): "
        + ", ".join(f"{T} token(s) {1e3 * c:.1f} ms" for T, c in costs.items()),
        flush=True,
    )
    rec.add(kind="pass_seconds", model=path.name, stages=args.stages, seconds={str(k): v for k, v in costs.items()})
    variants = {"plain-pp": engine(args.stages, [], 0), "spec-seq": engine(1, draft, args.budget)}
    for lv in args.levels:
        e = engine(args.stages, draft, args.width)
        e.pipeline.levels = lv
        variants[f"specpipe-L{lv}"] = e
    rows = []
    try:
        for dataset in args.sets:
            for B in args.batch_sizes:
                prompts = load_prompts(dataset, B * args.prompts_per_row)
                results: dict[str, dict] = {}
                for _ in range(args.rounds):
                    for name, eng in variants.items():
                        s = run(eng, prompts, B, args.max_tokens, args.stages)
                        if name not in results or s["tokens_per_s"] > results[name]["tokens_per_s"]:
                            results[name] = s
                base = results["plain-pp"]
                for name, s in results.items():
                    row = {
                        "model": path.name,
                        "stages": args.stages,
                        "set": dataset,
                        "batch": B,
                        "prompts": len(prompts),
                        "variant": name,
                        **{k: v for k, v in s.items() if k != "ids"},
                        "vs_plain_pp": round(s["tokens_per_s"] / base["tokens_per_s"], 3),
                        "identical": s["ids"] == base["ids"],
                    }
                    rows.append(row)
                    rec.add(**row)
                    print(
                        f"{dataset:9s} B={B:<2d} {name:12s} {s['tokens_per_s']:7.2f} tok/s "
                        f"({row['vs_plain_pp']:.2f}x)  {s['tokens_per_step']:.3f} tok/step  "
                        f"{1e3 * s['seconds_per_step']:.1f} ms/step  accepted {s['accepted']}  "
                        f"flushes {s.get('flushes', '-')}  identical={row['identical']}",
                        flush=True,
                    )
    finally:
        backend.close()
    print(table(rows))
    print(f"machine: {machine()}; records: {rec.path}")
    return 0


def pass_seconds(backend: PipelineBackend, T: int, context: int = 256, repeats: int = 5) -> float:
    """Median seconds of one pass of T chained tokens at `context` through every stage in turn (each
    stage alone on the CPU: the per-stage cost C(T) / stages without the contention of running at once)."""
    import numpy as np

    from sssd.serving.verify.tree_batch import pack_chain

    backend.prefill(slice(0, 1), pack_chain(np.array([0]), [np.arange(context, dtype=np.int64) % 1000 + 10]))
    times = []
    for _ in range(repeats):
        batch = pack_chain(np.array([context]), [np.arange(T, dtype=np.int64) + 10])
        t0 = time.perf_counter()
        backend.collect(backend.launch(slice(0, 1), batch, np.ones(1, dtype=bool)))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(eng: LLMEngine, prompts, B: int, max_tokens: int, stages: int) -> dict:
    """Generates the prompts B at a time; tokens/s and per-pipeline-step figures."""
    import dataclasses

    eng.limit_running(B)
    m = eng.metrics
    steps0, fwd0, acc0 = m.steps, m.forward_seconds + m.draft_seconds, m.num_accepted_tokens
    pipe = eng.pipeline
    p0 = dataclasses.replace(pipe.stats) if pipe is not None else None
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens))
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    out = {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3),
        "accepted": m.num_accepted_tokens - acc0,
        "ids": [o.token_ids for o in outs],
    }
    if pipe is not None:
        st = pipe.stats
        n = st.steps - p0.steps
        out.update(
            pipeline_steps=n,
            tokens_per_step=round((st.emitted - p0.emitted) / n, 4),
            seconds_per_step=round((st.seconds - p0.seconds) / n, 5),
            flushes=st.flushes - p0.flushes,
            nodes_per_step=round((st.nodes - p0.nodes) / n, 2),
        )
    else:
        n = (m.steps - steps0) * stages  # each pass goes stage after stage
        out.update(
            pipeline_steps=n,
            tokens_per_step=round(tokens / n, 4),
            seconds_per_step=round((m.forward_seconds + m.draft_seconds - fwd0) / n, 5),
        )
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| set | batch | variant | tok/s | vs plain-pp | tokens/pipeline step | ms/pipeline step | accepted | "
        "flushes | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['set']} | {r['batch']} | {r['variant']} | {r['tokens_per_s']:.2f} | "
            f"{r['vs_plain_pp']:.2f}x | {r['tokens_per_step']:.3f} | {1e3 * r['seconds_per_step']:.1f} | "
            f"{r['accepted']} | {r.get('flushes', '-')} | {r['identical']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
