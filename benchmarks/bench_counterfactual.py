"""The allocation's gate with and without counterfactual trees, end to end (serving/planning/counterfactual.py).

Two engines over one loaded model (one backend, so the same weights and threads), identical but
that one never drafts on the steps its gate keeps plain (`allocator.counterfactual` off: the
gate's probes come only at its interval, 1 in 8 up to 1 in 64 steps, and each request's acceptance
is learnt from verified nodes alone). Per set and batch size, the
same prompts (greedy, float32) are generated plainly, then by each engine, the order alternating
round by round (this machine drifts: compare within a round); the engines forget their recent
outputs before each run. Reported per run: tokens/s over the round's plain run, MAT, steps and
steps that verified nothing, the counterfactual steps and the probes they called, and whether
the output is plain's (it must be).

Usage:
  OMP_WAIT_POLICY=passive python benchmarks/bench_counterfactual.py --sets agent-traces:1,4 mtbench:1,4
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import load_prompts, run, summarize  # noqa: E402
from common import machine  # noqa: E402

from sssd.serving.engine import EngineConfig, LLMEngine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--sets",
        nargs="+",
        default=["agent-traces:1,4", "mtbench:1,4", "code-edits:1"],
        help="SET:BATCH,BATCH,... (prompts: max(4, 2 x batch) of the set's held-out split)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=3072)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    plan = []
    for item in args.sets:
        name, _, sizes = item.partition(":")
        try:
            plan.append((name, [int(b) for b in (sizes or "1").split(",")]))
        except ValueError:
            ap.error(f"--sets {item!r}: expected SET:BATCH,BATCH,... (e.g. agent-traces:1,4)")
    biggest = max(b for _, bs in plan for b in bs)
    config = EngineConfig(max_running=biggest, max_model_len=args.max_model_len, threads=args.threads)
    on = LLMEngine(args.model, config=config)
    off = LLMEngine(args.model, backend=on.backend, config=replace(config))
    off.allocator.counterfactual = lambda batch: False
    engines = {"without": off, "with": on}
    print(f"# {machine()}", flush=True)
    for name, sizes in plan:
        for B in sizes:
            prompts = load_prompts(name, max(4, 2 * B))
            for e in engines.values():
                e.limit_running(B)
            for rnd in range(args.rounds):
                on.forget_history()
                plain, seconds = run(on, prompts, args.max_tokens, speculate=False)
                plain_rate = sum(len(o.token_ids) for o in plain) / seconds
                for label in ("without", "with") if rnd % 2 == 0 else ("with", "without"):
                    eng = engines[label]
                    eng.forget_history()
                    cf0, called0 = eng.allocator.counterfactual_steps, eng.allocator.called_probes
                    outs, seconds = run(eng, prompts, args.max_tokens, speculate=True)
                    s = summarize(outs, seconds)
                    budgets = [b for o in outs for b in o.stats["budgets"]]
                    same = all(x.token_ids == y.token_ids for x, y in zip(outs, plain))
                    print(
                        f"{name:12s} batch {B} round {rnd} {label:7s}: {s['tokens_per_s'] / plain_rate:.3f}x plain "
                        f"({s['tokens_per_s']:.1f} vs {plain_rate:.1f} tok/s), MAT {s['mat'] or 0:.2f}, "
                        f"{sum(b == 0 for b in budgets)} of {len(budgets)} steps verified nothing, "
                        f"{eng.allocator.counterfactual_steps - cf0} counterfactual steps, "
                        f"{eng.allocator.called_probes - called0} probes called, identical: {same}",
                        flush=True,
                    )
                    if not same:
                        print("ERROR: speculative output differs from plain decoding", file=sys.stderr)
                        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
