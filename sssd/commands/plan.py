"""``sssd plan``: project the speculation budget and speedup per batch size on named hardware."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sssd.cli import command


@command(
    "plan",
    help="Project the draft budget and the speedup per batch size for a model on named hardware "
    "(a roofline projection from the hardware's peak FLOP/s and bandwidth, not a measurement).",
)
def setup(p: argparse.ArgumentParser):
    from sssd.serving.planning.roofline import HARDWARE, MODELS

    p.add_argument(
        "--model",
        default="llama-3-8b",
        help=f"a model shape ({', '.join(MODELS)}) or a Hugging Face config.json / model folder",
    )
    p.add_argument("--hardware", default="h100", choices=sorted(HARDWARE), help="the device to project for")
    p.add_argument(
        "--calibration",
        default=None,
        help="`sssd calibrate` file whose replayed MAT per budget to use (default: the packaged "
        "SmolLM2 calibration; replay your own model's ground truth for your numbers)",
    )
    p.add_argument("--context", type=int, default=512, help="tokens already in each request's KV cache")
    p.add_argument(
        "--efficiency",
        type=float,
        default=1.0,
        help="fraction of the peak FLOP/s real kernels reach (tall-skinny matmuls reach less)",
    )
    p.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256], help="batch sizes to project"
    )
    p.add_argument(
        "--groundtruth",
        nargs="+",
        default=None,
        metavar="FILE",
        help="`sssd groundtruth` files to replay: adds the batch-wide allocation's projection (each row "
        "verifies what its own tree is worth), from trees drafted along the recorded outputs",
    )
    p.add_argument(
        "--datastore",
        default="default",
        help='datastore the replay drafts with (--groundtruth; "none": the request\'s own text only)',
    )
    p.add_argument("--limit", type=int, default=40, help="examples replayed per ground-truth file")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    def run(args: argparse.Namespace) -> int:
        from sssd.serving.planning.planner import mat_from_calibration
        from sssd.serving.planning.roofline import PAPER, ModelShape, projection

        if not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency must be in (0, 1], got {args.efficiency}")
        if args.context < 0 or any(b < 1 for b in args.batch_sizes):
            raise ValueError("--context must be >= 0 and --batch-sizes >= 1")
        if args.model in MODELS:
            shape = MODELS[args.model]
        elif Path(args.model).exists():
            shape = ModelShape.from_config(args.model)
        else:
            raise ValueError(f"--model {args.model}: not a known shape ({', '.join(MODELS)}) nor a config.json")
        cal = args.calibration
        if cal is None:  # a projection for named hardware: the packaged MAT, whatever datastore is built here
            from sssd.paths import packaged_calibration_file

            cal = packaged_calibration_file()
        elif not Path(cal).is_file():
            raise FileNotFoundError(f"--calibration {cal}: no such file")
        mat = mat_from_calibration(cal)  # ValueError for a malformed file
        hw = HARDWARE[args.hardware]
        rows = projection(shape, hw, mat, tuple(args.batch_sizes), args.context, args.efficiency)
        alloc = _allocation(args, shape, hw) if args.groundtruth else None
        if alloc is not None:
            for r, a in zip(rows, alloc["projection"]):
                r["allocation"] = a
        if args.json:
            print(
                json.dumps(
                    {
                        "model": shape.name,
                        "hardware": hw.name,
                        "context": args.context,
                        "efficiency": args.efficiency,
                        "mat_from": str(cal),
                        "projection": rows,
                        "allocation_replayed_from": alloc["replayed_from"] if alloc else None,
                    },
                    indent=2,
                )
            )
            return 0
        print(
            f"PROJECTION (roofline, not measured): {shape.name} on {hw.name}, context {args.context}, "
            f"{args.efficiency:.0%} of peak FLOP/s; MAT per budget replayed from {cal}"
        )
        extra = (
            f" {'alloc nodes/row':>16} {'alloc tok/row':>14} {'alloc speedup':>14} {'same steps, 1 budget':>21}"
            if alloc
            else ""
        )
        print(
            f"{'batch':>6} {'budget':>7} {'MAT':>6} {'cost':>6} {'speedup':>8} {'plain tok/s':>12} {'tok/s':>10}"
            + extra
        )
        for r in rows:
            a = r.get("allocation")
            print(
                f"{r['batch']:>6} {r['budget']:>7} {r['mat']:>6.2f} {r['cost_ratio']:>6.2f} {r['speedup']:>7.2f}x "
                f"{r['plain_tokens_per_s']:>12,.0f} {r['tokens_per_s']:>10,.0f}"
                + (
                    f" {a['nodes_per_row']:>16.2f} {a['tokens_per_row_step']:>14.2f} {a['speedup']:>13.2f}x"
                    f" {a['per_size_speedup']:>11.2f}x (b={a['per_size_budget']})"
                    if a
                    else ""
                )
            )
        if alloc:
            corrections = ", ".join(f"{r['batch']}: {r['worth_correction']}" for r in alloc["projection"])
            print(
                f"alloc: one budget per step shared across the batch by expected acceptance, replayed from "
                f"{alloc['replayed_from']['steps']} drafted steps of {', '.join(alloc['replayed_from']['files'])} "
                f"(gamma {alloc['projection'][0]['gamma']}; the selected nodes' worth corrected as the engine does, "
                f"by batch: {corrections}); "
                "'same steps, 1 budget': the best single budget on those steps; "
                "budget/MAT/speedup: one budget per batch size from the calibration's MAT"
            )
        print(
            "cost: forward time at budget+1 tokens per row over 1 token; speedup: MAT / cost. "
            "The SSSD paper measured (Llama2-7b, Ascend 910B4, its own MAT): "
            + "; ".join(f"{k} {v}" for k, v in PAPER.items()),
            file=sys.stdout,
        )
        return 0

    return run


def _allocation(args: argparse.Namespace, shape, hw) -> dict:
    """The batch-wide allocation's projection, from trees drafted along recorded outputs."""
    import sssd
    from sssd.calibration.allocation_replay import replay_groundtruth
    from sssd.serving.planning.projection import project
    from sssd.serving.planning.roofline import roofline_profile

    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    for path in args.groundtruth:  # before the datastore opens: a mistyped path is named at once
        if not Path(path).is_file():
            raise FileNotFoundError(f"--groundtruth {path}: no such file")
    drafter = sssd.Drafter(None if args.datastore == "none" else args.datastore, budget=64)
    steps = replay_groundtruth(drafter, args.groundtruth, args.limit)
    prof = roofline_profile(shape, hw, args.context, args.efficiency)
    return {
        "projection": project(steps, prof, args.batch_sizes),
        "replayed_from": {"files": [Path(p).name for p in args.groundtruth], "steps": len(steps)},
    }
