"""Row-count-planned linear layers (serving/backends/linear_plan.py) against torch's own, end to end.

One copy of the model; its linear layers are switched between torch's
F.linear ("torch") and the measured plan ("planned") between runs. Each
kernel choice has its own engine over that one backend, so each plans its
budgets with a forward profile measured with its own kernels. For each
prompt set and batch size, four runs in one go, in this order: plain
torch, plain planned, SSSD torch, SSSD planned (greedy, float32).

Each configuration runs --repeats times, interleaved with the others (this
VM's speed drifts by 10-20% from one minute to the next); the median is
reported. Reported: tokens/s of each; planned over torch, for plain decoding and for
SSSD; SSSD over plain under each; and two checks: SSSD's output is
token-identical to plain decoding with the same kernels (the lossless
promise), and how many outputs the two kernels' plain runs share (they
round differently; a greedy near-tie can flip).

Usage:
  python benchmarks/bench_linear_plan.py --models smollm2-135m-instruct --batch-sizes 1 4 16
  python benchmarks/bench_linear_plan.py --models qwen2.5-coder-1.5b-instruct --datastores sharegpt-qwen2.5 \\
      --drafter /path/qwen.calibration.json --batch-sizes 1 4
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import load_prompts, run, summarize  # noqa: E402
from common import Recorder, machine  # noqa: E402

from sssd.serving.backends import linear_plan  # noqa: E402
from sssd.serving.engine import EngineConfig, LLMEngine  # noqa: E402


def use(backend, plan) -> None:
    """Switches the backend's linear layers to `plan` (None: torch's own)."""
    linear_plan.install(backend.model, plan)
    backend.linear_plan = plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"], help="model names or folders")
    ap.add_argument("--datastores", nargs="+", default=["default"], help="one per model (or one for all)")
    ap.add_argument("--drafter", default=None, help="drafter config / calibration file (all models)")
    ap.add_argument("--sets", nargs="+", default=["mtbench", "gsm8k", "humaneval"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set at batch 1 (fewest)")
    ap.add_argument("--prompts-per-row", type=int, default=2, help="at batch B, max(--prompts, B x this) prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=None, help="fixed draft budget (default: each engine's planner)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per configuration (median reported)")
    args = ap.parse_args()
    if len(args.datastores) == 1:
        args.datastores = args.datastores * len(args.models)
    rec = Recorder("linear_plan", vars(args))
    for model, ds in zip(args.models, args.datastores):
        config = EngineConfig(
            max_running=max(args.batch_sizes),
            max_model_len=args.max_model_len,
            budget=args.budget,
            threads=args.threads,
        )
        planned = LLMEngine(model, datastore=ds, drafter=args.drafter, config=config)
        backend, plan = planned.backend, planned.backend.linear_plan
        if plan is None:
            print("the linear plan is off (a GPU, or SSSD_LINEAR_PLAN=off): nothing to compare")
            return 2
        layers = sum(any(getattr(m, "_rows_table", ())) for m in linear_plan.linears(backend.model))
        use(backend, None)
        torch_engine = LLMEngine(model, datastore=ds, drafter=args.drafter, config=config, backend=backend)
        engines = {"torch": (torch_engine, None), "planned": (planned, plan)}
        name = Path(backend.info.path).name
        print(
            f"{name}: {layers} linear layers take the transposed form at some row count; "
            f"planner budgets torch {[r['budget'] for r in torch_engine.planner.table((1, 4, 16))]}, "
            f"planned {[r['budget'] for r in planned.planner.table((1, 4, 16))]} (batch 1, 4, 16)"
        )
        for engine, p in engines.values():  # warm-up: the first generate of a process pays one-off costs
            use(backend, p)
            for speculate in (False, True):
                run(engine, load_prompts(args.sets[0], 1), 16, speculate=speculate)
        for dataset in args.sets:
            prompts_all = load_prompts(
                dataset, max(max(args.prompts, args.prompts_per_row * B) for B in args.batch_sizes)
            )
            for B in args.batch_sizes:
                prompts = prompts_all[: max(args.prompts, args.prompts_per_row * B)]
                res, outs, rates = {}, {}, {}
                for _ in range(args.repeats):  # interleaved repeats: a slow spell slows every run alike
                    for speculate in (False, True):
                        for kind, (engine, p) in engines.items():
                            use(backend, p)
                            engine.limit_running(B)
                            o, t = run(engine, prompts, args.max_tokens, speculate=speculate)
                            key = ("sssd" if speculate else "plain", kind)
                            res[key], outs[key] = summarize(o, t), [x.token_ids for x in o]
                            rates.setdefault(key, []).append(res[key]["tokens_per_s"])
                for key, r in res.items():  # the median run's rate; every run's in "runs"
                    r["tokens_per_s"], r["repeats"] = round(float(np.median(rates[key])), 3), rates[key]
                lossless = {k: outs[("sssd", k)] == outs[("plain", k)] for k in engines}
                shared = sum(a == b for a, b in zip(outs[("plain", "torch")], outs[("plain", "planned")]))
                rate = {k: v["tokens_per_s"] for k, v in res.items()}
                row = {
                    "model": name,
                    "set": dataset,
                    "batch": B,
                    "prompts": len(prompts),
                    "runs": {f"{a}_{b}": v for (a, b), v in res.items()},
                    "planned_over_torch": {
                        "plain": round(rate[("plain", "planned")] / rate[("plain", "torch")], 3),
                        "sssd": round(rate[("sssd", "planned")] / rate[("sssd", "torch")], 3),
                    },
                    "sssd_over_plain": {k: round(rate[("sssd", k)] / rate[("plain", k)], 3) for k in engines},
                    "sssd_planned_over_plain_torch": round(rate[("sssd", "planned")] / rate[("plain", "torch")], 3),
                    "lossless": lossless,
                    "plain_outputs_shared": f"{shared}/{len(prompts)}",
                }
                rec.add(**row)
                print(
                    f"{name:24s} {dataset:9s} B={B:<3d} plain {rate[('plain', 'torch')]:6.2f} -> "
                    f"{rate[('plain', 'planned')]:6.2f} tok/s ({row['planned_over_torch']['plain']:.2f}x) | "
                    f"sssd {rate[('sssd', 'torch')]:6.2f} -> {rate[('sssd', 'planned')]:6.2f} "
                    f"({row['planned_over_torch']['sssd']:.2f}x; MAT {res[('sssd', 'planned')]['mat']}) | "
                    f"sssd/plain torch {row['sssd_over_plain']['torch']:.2f}x planned "
                    f"{row['sssd_over_plain']['planned']:.2f}x | planned sssd / torch plain "
                    f"{row['sssd_planned_over_plain_torch']:.2f}x | lossless {lossless} "
                    f"plain shared {row['plain_outputs_shared']}",
                    flush=True,
                )
        del planned, torch_engine, engines, backend
        gc.collect()
    print(f"machine: {machine()}; records: {rec.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
