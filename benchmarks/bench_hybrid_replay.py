"""Hybrid drafting by replay: exact MAT of retrieval, a draft model and both, without the target.

The target's greedy outputs (`sssd groundtruth` files, one per prompt set) are
replayed with four draft setups at one budget; each replay follows its own
trajectory, so every MAT is exact (what the engine would measure; the
reference test is tests/test_hybrid_calibration.py):

  retrieval        the datastore and the request's own tokens (the calibration file's entry)
  model            the draft model alone (SpecInfer expansion trees)
  hybrid default   both, the draft model at its default discount
  hybrid fitted    both, the draft model at the discount `sssd calibrate --draft` fitted

Only the draft model runs (it proposes at every step), so this measures the
merge where the target is too slow to run the grid end to end on this CPU.
The draft model is always asked (no deferral: that is a speed decision, and
MAT is what is measured here).

Usage:
  python benchmarks/bench_hybrid_replay.py --groundtruth eval_humaneval.jsonl eval_mtbench.jsonl \\
      --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \\
      --datastore ~/.cache/sssd/datastores/sharegpt-qwen2.5 --drafter qwen.calibration.json --budget 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groundtruth", nargs="+", required=True, help="ground-truth files (one per prompt set)")
    ap.add_argument("--model", required=True, help="the target the ground truth came from (name or folder)")
    ap.add_argument("--draft-model", required=True, help="the draft model (name or folder; the target's tokenizer)")
    ap.add_argument("--datastore", default="default", help="retrieval's datastore")
    ap.add_argument("--drafter", default=None, help="`sssd calibrate` file (retrieval's entries, the fitted discount)")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--split", choices=("eval", "dev", "all"), default="eval", help="part of each file to replay")
    ap.add_argument("--limit", type=int, default=0, help="examples per file (0: all)")
    ap.add_argument("--expansion", default=None, help="the draft model's tree (default: serving.model_drafter's)")
    ap.add_argument("--batch-size", type=int, default=8, help="examples replayed in lockstep")
    args = ap.parse_args()

    import sssd
    from sssd.calibration.datasets import split
    from sssd.calibration.ground_truth import load_groundtruth
    from sssd.calibration.hybrid import fit_source_discount
    from sssd.calibration.replay import replay
    from sssd.calibration_file import CalibrationFile, source_discount
    from sssd.config import DrafterConfig
    from sssd.drafter import resolve_datastore
    from sssd.models import resolve_model
    from sssd.serving.drafting.model_drafter import DEFAULT_EXPANSION, ModelDrafter

    rec = Recorder("hybrid_replay", vars(args))
    ds = resolve_datastore(args.datastore)
    cal = CalibrationFile.load(args.drafter) if args.drafter else None
    cfg = cal.config(args.budget) if cal else DrafterConfig(budget=args.budget)
    target = resolve_model(args.model)
    expansion = args.expansion or ",".join(map(str, DEFAULT_EXPANSION))

    def drafter(longest: int) -> ModelDrafter:
        return ModelDrafter(
            args.draft_model,
            target=target,
            slots=args.batch_size,
            expansion=expansion,
            capacity=longest + 2 * args.budget + 2,
            complement=False,
        )

    rows = []
    for path in args.groundtruth:
        _, examples = load_groundtruth(path, tokenizer=ds)
        if args.split != "all":
            examples = split(examples, args.split)
        examples = examples[: args.limit or None]
        if not examples:
            print(f"{path}: no examples in the {args.split} split", file=sys.stderr)
            continue
        longest = max(len(e.prompt) + len(e.output) for e in examples)
        name = Path(path).stem
        mats = {}
        t0 = time.perf_counter()
        mats["retrieval"] = replay(sssd.Drafter(ds, cfg), examples, args.budget, batch_size=args.batch_size).mat
        alone_cfg = cfg.replace(use_datastore=False, use_input=False)
        d = drafter(longest)
        mats["model"] = fit_source_discount(
            examples,
            None,
            alone_cfg,
            d,
            args.budget,
            [d.discount],
            batch_size=args.batch_size,
            vocab_size=d.backend.info.vocab_size,
        ).reference_mat
        d = drafter(longest)
        default = d.discount
        mats["hybrid default"] = fit_source_discount(
            examples,
            ds,
            cfg,
            d,
            args.budget,
            [default],
            batch_size=args.batch_size,
            vocab_size=d.backend.info.vocab_size,
        ).reference_mat
        fitted = source_discount(cal, d.calibration_key)
        if fitted is not None:
            d = drafter(longest)
            mats["hybrid fitted"] = fit_source_discount(
                examples,
                ds,
                cfg,
                d,
                args.budget,
                [fitted],
                batch_size=args.batch_size,
                vocab_size=d.backend.info.vocab_size,
            ).reference_mat
        single = max(mats["retrieval"], mats["model"])
        row = {
            "set": name,
            "examples": len(examples),
            "tokens": int(sum(len(e.output) for e in examples)),
            "budget": args.budget,
            **{k: round(v, 3) for k, v in mats.items()},
            "fitted_discount": None if fitted is None else {"scale": fitted.scale, "depth_decay": fitted.depth_decay},
            "best_hybrid_over_better_single": round(
                max(v for k, v in mats.items() if k.startswith("hybrid")) / single, 3
            ),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        rec.add(**row)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    cols = ["retrieval", "model", "hybrid default", "hybrid fitted"]
    print(f"\n| set | examples | {' | '.join(cols)} | best hybrid / better single |")
    print("|---|---:|" + "---:|" * (len(cols) + 1))
    for r in rows:
        cells = " | ".join(f"{r[c]:.3f}" if c in r else "-" for c in cols)
        print(f"| {r['set']} | {r['examples']} | {cells} | {r['best_hybrid_over_better_single']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
