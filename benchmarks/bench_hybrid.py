"""Hybrid drafting: retrieval only / model only / both in one queue, side by side.

For one target model, a draft model with its tokenizer and a datastore, the
same prompts are generated (greedy, float32) by plain decoding and by three
draft-source sets over one loaded copy of the target: `retrieval` (SSSD's
datastore and the request's own tokens), `model` (the draft model's
SpecInfer expansion trees, serving.model_drafter) and `hybrid` (both, merged
in one priority queue). Per set and batch size: output tokens per second,
MAT (tokens per step, the bonus included), accepted draft tokens per step,
accepted tokens per source, the share of the step time spent drafting, and
whether the outputs equal plain decoding's (they must).

The budget is fixed (--budget) so that the sources compare at one budget (the
planner would choose one per source and batch size). Whether the draft model
drafts in a hybrid step is the engine's measured deferral (sssd.serving.planning.deferral); its
state carries over from one set and batch size to the next, as in a server. The
draft model is loaded once and serves both sets that use it.

This machine's speed drifts by tens of percent between runs minutes apart, more
than the sources differ by in some cells. With --rounds R every configuration
runs R times per set and batch size, interleaved, each round starting one
configuration later; the hybrid's ratio to the better single source is taken
within each round and reported per round and as the median.

Usage:
  python benchmarks/bench_hybrid.py                      # SmolLM2-135M drafting for itself, ShareGPT datastore
  python benchmarks/bench_hybrid.py --model qwen2.5-coder-1.5b-instruct \\
      --draft-model qwen2.5-coder-0.5b-instruct --datastore ~/.cache/sssd/datastores/sharegpt-qwen2.5 \\
      --sets humaneval --batch-sizes 1 4 --prompts-per-row 1 --max-tokens 48
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import load_prompts, summarize  # noqa: E402
from common import Recorder, machine  # noqa: E402

from sssd.serving.drafting.model_drafter import DEFAULT_EXPANSION, ModelDrafter  # noqa: E402
from sssd.serving.engine import EngineConfig, LLMEngine  # noqa: E402
from sssd.serving.engine.params import SamplingParams  # noqa: E402
from sssd.serving.planning.measured_choice import bucket  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target: model name or folder")
    ap.add_argument("--draft-model", default=None, help="draft model: name or folder (default: the target itself)")
    ap.add_argument("--datastore", default="default", help="retrieval's datastore, built with the target's tokenizer")
    ap.add_argument("--drafter", default=None, help="drafter config / `sssd calibrate` file for retrieval")
    ap.add_argument(
        "--expansion",
        default=",".join(map(str, DEFAULT_EXPANSION)),
        help="the draft model's tree: children per level, SpecInfer's <k1,...,km>",
    )
    ap.add_argument("--sets", nargs="+", default=["mtbench", "gsm8k", "humaneval"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompts-per-row", type=int, default=2, help="B x this prompts per set at batch B")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=8, help="fixed draft budget of every set")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every configuration per set and batch size, interleaved (each round starts one "
        "configuration later); ratios are taken within a round, and their median reported",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be 1 or more, got {args.rounds}")
    rec = Recorder("hybrid", vars(args))
    max_b = max(args.batch_sizes)
    config = EngineConfig(max_running=max_b, max_model_len=args.max_model_len, budget=args.budget, threads=args.threads)
    plain = LLMEngine(args.model, datastore=None, draft=[], config=config)
    backend = plain.backend  # one copy of the target for every set
    source = ModelDrafter(
        args.draft_model or args.model,
        target=backend.info.path,
        target_tokenizer=plain.tokenizer,
        slots=max_b,
        capacity=plain.max_model_len,
        expansion=args.expansion,
        threads=args.threads,
    )
    sets = {"retrieval": ["retrieval"], "model": [source], "hybrid": ["retrieval", source]}
    engines = {
        name: LLMEngine(
            args.model,
            datastore=args.datastore if "retrieval" in draft else None,
            drafter=args.drafter,
            draft=draft,
            backend=backend,
            config=config,
        )
        for name, draft in sets.items()
    }
    target, drafter = Path(backend.info.path).name, source.path.name
    print(
        f"target {target}, draft model {drafter} {list(source.expansion)}, budget {args.budget}, "
        f"datastore {args.datastore}",
        flush=True,
    )
    rows = []
    configs = [("plain", plain), *engines.items()]
    for _, eng in configs:  # warm-up, not measured: first-call costs (the planner's profile, allocations)
        eng.generate(load_prompts(args.sets[0], 1), SamplingParams(max_tokens=8))
    for dataset in args.sets:
        for B in args.batch_sizes:
            prompts = load_prompts(dataset, B * args.prompts_per_row)
            rounds = []
            for r in range(args.rounds):
                # each round starts one configuration later, so that none always runs first or last
                order = configs[r % len(configs) :] + configs[: r % len(configs)]
                results = {name: run(eng, B, prompts, args.max_tokens) for name, eng in order}
                rounds.append(results)
                base = results["plain"]
                for name, _ in configs:
                    s = results[name]
                    row = {
                        "target": target,
                        "draft_model": drafter,
                        "expansion": list(source.expansion),
                        "set": dataset,
                        "batch": B,
                        "prompts": len(prompts),
                        "round": r,
                        "sources": name,
                        **{k: v for k, v in s.items() if k != "ids"},
                        "speedup": round(s["tokens_per_s"] / base["tokens_per_s"], 3),
                        "identical": s["ids"] == base["ids"],
                    }
                    rows.append(row)
                    rec.add(**row)
                    print(
                        f"{dataset:9s} B={B:<3d} round {r} {name:9s} {s['tokens_per_s']:7.2f} tok/s "
                        f"({row['speedup']:.2f}x) MAT {s['mat']}  accepted/step {s['accepted_per_step']}  "
                        f"drafting {s['draft_share']:.0%}  model asked {s['model_asked']}  "
                        f"identical={row['identical']}  {s['accepted_by_source']}"
                        + (f"  arms {s['arm_rates']}" if s.get("arm_rates") else ""),
                        flush=True,
                    )
            ratios = [
                x["hybrid"]["tokens_per_s"] / max(x["retrieval"]["tokens_per_s"], x["model"]["tokens_per_s"])
                for x in rounds
            ]
            summary = {
                "set": dataset,
                "batch": B,
                "rounds": len(rounds),
                **{f"{name}_tokens_per_s": median([x[name]["tokens_per_s"] for x in rounds]) for name, _ in configs},
                "hybrid_over_better_single": [round(v, 3) for v in ratios],
                "hybrid_over_better_single_median": round(median(ratios), 3),
            }
            rec.add(**summary)
            print(
                f"{dataset:9s} B={B:<3d} hybrid tok/s / better single, per round: "
                f"{', '.join(f'{v:.2f}x' for v in ratios)} (median {median(ratios):.2f}x)",
                flush=True,
            )
    print(table(rows))
    print(f"machine: {machine()}; records: {rec.path}")
    return 0


def run(eng: LLMEngine, B: int, prompts: list, max_tokens: int) -> dict:
    """One configuration over the prompts at batch size B: speed, MAT, drafting share, the deferral's asks."""
    eng.limit_running(B)  # the slots stay allocated for the largest batch
    eng.metrics.draft_seconds = eng.metrics.forward_seconds = 0.0
    eng.metrics.accepted_by_source.clear()
    gate = eng.drafting.deferral if eng.drafting is not None else None
    if gate is not None:
        gate.asked = gate.deferred = 0
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens))
    s = summarize(outs, time.perf_counter() - t0)
    m = eng.metrics
    s["draft_share"] = round(m.draft_seconds / max(m.draft_seconds + m.forward_seconds, 1e-9), 3)
    s["accepted_by_source"] = dict(m.accepted_by_source)
    # hybrid: the share of steps the draft model drafted in (the deferral's choice)
    s["model_asked"] = (
        round(gate.asked / (gate.asked + gate.deferred), 3) if gate is not None and gate.asked + gate.deferred else None
    )
    if gate is not None:  # the deferral's measured tokens/s per arm at this batch size (serial steps)
        s["arm_rates"] = {a: round(r, 3) for a, r in gate.policy.rates().get(("serial", bucket(B)), {}).items()}
    s["ids"] = [o.token_ids for o in outs]
    return s


def table(rows: list[dict]) -> str:
    """Markdown: per set and batch size, each source set's tokens/s and MAT side by side."""
    lines = [
        "| set | batch | round | sources | tok/s | vs plain | MAT | accepted/step | drafting share | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['set']} | {r['batch']} | {r['round']} | {r['sources']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | "
            f"{r['mat']} | {r['accepted_per_step']} | {r['draft_share']:.0%} | {r['identical']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
