"""The allocation's forward pricing, replayed offline on steps recorded from real runs.

On a 2-core VM a run's pace drifts +-5-10% from one half-minute to the next, so two pricings of the
forward pass (planning/allocation.py, planning/forward_fit.py) compared in two live runs differ by
more than either errs. Here one run's steps are recorded once (every step the allocator observed:
rows, draft nodes, cached positions, measured forward seconds, in order) and then fed to a fresh
allocator: before each drafted pass of a fitted bucket, its price against what the pass took. Any
pricing can be replayed on the same steps (the selection, the gate and the tokens are the recorded
run's: this scores the price, not the decisions made on it).

Usage:
  python benchmarks/bench_allocation_replay.py record --set mtbench --batch 32 \\
      --runs plain sssd plain sssd sssd sssd --out benchmarks/out/steps-mtbench32.json
  python benchmarks/bench_allocation_replay.py replay benchmarks/out/steps-mtbench32.json ...

`record` writes the steps with the engine's forward profile and the machine; `replay` prints, per
file, the drafted passes' price over their seconds (median, mean absolute log error, the share within
10%), split into passes priced past the bucket's fit (ForwardFit.known_tokens) and within it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, machine  # noqa: E402

from sssd.serving.planning.allocation import BatchAllocator  # noqa: E402
from sssd.serving.planning.profile import ForwardProfile  # noqa: E402


def replay(steps: list, time_fn, allocator: BatchAllocator | None = None) -> list[dict]:
    """Feeds recorded steps (BatchAllocator.record) to `allocator` (a fresh BatchAllocator over
    `time_fn` by default); returns, for each drafted pass of a fitted bucket, its price before it
    was observed, what it took, and whether it was priced past the bucket's fit."""
    a = allocator if allocator is not None else BatchAllocator(time_fn)
    out = []
    for e in steps:
        if e[0] == "plain":
            _, batch, step_seconds, forward_seconds, cached = e
            a.observe_plain(batch, step_seconds, forward_seconds, cached)
            continue
        _, batch, drafted, forward_seconds, step_seconds, tokens, predicted, expected, cached = e
        if drafted and forward_seconds > 0 and a.fitted(batch):
            out.append(
                {
                    "batch": batch,
                    "drafted": drafted,
                    "price": float(a.forward_seconds(batch, np.array([float(drafted)]), cached)[0]),
                    "took": forward_seconds,
                    "past_edge": batch + drafted > a.fit_edge(batch),
                }
            )
        expect = None if expected is None else tuple(expected)
        a.observe(batch, drafted, forward_seconds, step_seconds, tokens, predicted, expect, cached)
    return out


def summary(prices: list[dict]) -> dict:
    """Price over seconds of the replayed passes: all, past the fit's edge, within it."""
    out = {}
    for name, keep in (
        ("all", lambda p: True),
        ("past edge", lambda p: p["past_edge"]),
        ("within", lambda p: not p["past_edge"]),
    ):
        r = np.array([p["price"] / p["took"] for p in prices if keep(p)])
        if r.size:
            out[name] = {
                "passes": int(r.size),
                "median": round(float(np.median(r)), 3),
                "mean_abs_log": round(float(np.mean(np.abs(np.log(r)))), 3),
                "within_10pct": round(float(np.mean(np.abs(r - 1) <= 0.1)), 2),
            }
    return out


def record(args) -> None:
    """Runs the engine on one set at `--batch` rows, plain and SSSD as `--runs` says, and writes
    every step its allocator observed."""
    import bench_mixed as bm

    from sssd.serving.engine import EngineConfig, LLMEngine
    from sssd.serving.engine.params import SamplingParams

    eng = LLMEngine(
        args.model,
        datastore="default",
        draft=bm.DEFAULT_DRAFT,
        config=EngineConfig(max_running=args.batch, max_model_len=args.max_model_len, allocation="batch"),
    )
    if eng.allocator is None:
        raise SystemExit("this engine has no batch allocation to record (no draft sources?)")
    fits = bm.prompt_fits(eng.tokenizer, args.max_model_len, args.max_tokens)
    sets = bm.MIXED if args.set == "mixed" else [args.set]
    for speculate in (False, True):  # first calls (prefill shapes, the profile) stay out
        eng.generate(
            [p for _, p in bm.mixed_prompts(sets, 2, skip=50, fits=fits)],
            SamplingParams(max_tokens=8, speculate=speculate),
        )
    prompts = [p for _, p in bm.mixed_prompts(sets, 3 * args.batch, fits=fits)]
    eng.allocator.record = steps = []
    runs = []
    for mode in args.runs:
        eng.limit_running(args.batch)
        eng.forget_history()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, SamplingParams(max_tokens=args.max_tokens, speculate=mode == "sssd"))
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        runs.append({"mode": mode, "seconds": round(seconds, 3), "tokens": tokens, "steps_recorded": len(steps)})
        print(f"{mode:5s} {tokens / seconds:7.2f} tok/s  {seconds:6.2f} s  {len(steps)} steps recorded", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": machine(),
                "args": vars(args),
                "runs": runs,
                "profile": eng.planner.profile.to_dict(),
                "steps": steps,
            }
        )
    )
    print(f"steps: {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the engine and write the steps its allocator observed")
    rec.add_argument("--model", default="smollm2-135m-instruct")
    rec.add_argument("--set", default="mtbench", help="a prompt set (bench_mixed's names), or 'mixed' for all six")
    rec.add_argument("--batch", type=int, default=32)
    rec.add_argument(
        "--runs", nargs="+", default=["plain", "sssd", "plain", "sssd", "sssd", "sssd"], choices=["plain", "sssd"]
    )
    rec.add_argument("--max-tokens", type=int, default=64)
    rec.add_argument("--max-model-len", type=int, default=2048)
    rec.add_argument("--out", default=str(OUT_DIR / "allocation-steps.json"))
    rep = sub.add_parser("replay", help="price the recorded drafted passes with this code's allocator")
    rep.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.command == "record":
        record(args)
        return 0
    for path in args.files:
        d = json.loads(Path(path).read_text())
        profile = ForwardProfile.from_dict(d["profile"])
        print(path, json.dumps(summary(replay(d["steps"], profile.times)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
