"""The batch-wide allocation projected on THIS machine: replayed trees priced by the engine's own
measured forward costs, beside what the engine measured.

`sssd plan --groundtruth` prices replayed steps on a named accelerator's roofline. Here the price is
what a `bench_mixed.py` run's engine learnt about its own forward passes (per batch-size bucket:
seconds = a + b x tokens + c x thousand cached positions + j when any draft is verified, plus the
step's overhead; planning/forward_fit.py), so the projection answers: with these drafts' accepted
lengths and this machine's costs, what could the allocation reach over plain decoding, decode steps
only (prefill excluded)? Set --max-tokens to the run's: the replay then stops each recorded answer
where the run stopped it (the first 64 tokens of a code edit copy less than its whole answer does).

The replay drafts with `sssd.Drafter("default")` (retrieval and the request's own text; the engine
also drafts from other requests' recent outputs) along recorded SmolLM2 outputs, the last --limit
examples of each set.

Usage (after `python benchmarks/bench_mixed.py ... --tag T`):
  python benchmarks/project_measured.py --tag T --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mixed import MIXED  # noqa: E402
from common import OUT_DIR  # noqa: E402

GROUNDTRUTH = Path.home() / ".cache/sssd/groundtruth/smollm2-135m-instruct"


class MeasuredCosts:
    """A profile (`times(rows, tokens per row)`) from an engine's fitted forward costs per bucket."""

    def __init__(self, buckets: dict, context: float):
        self.buckets, self.context = buckets, float(context)

    def times(self, rows: int, per_row) -> np.ndarray:
        key = str(1 << max(0, rows - 1).bit_length())
        if key not in self.buckets or not self.buckets[key].get("forward_fit_ms"):
            raise SystemExit(f"the run measured no forward fit for batch bucket {key}: run bench_mixed at that size")
        a, b, c, j = (x / 1e3 for x in self.buckets[key]["forward_fit_ms"])
        overhead = self.buckets[key]["overhead_ms"] / 1e3
        n = rows * np.asarray(per_row, dtype=np.float64)
        return a + b * n + c * rows * self.context / 1000 + j * (n > rows + 1e-9) + overhead

    def time(self, rows: int, per_row: float) -> float:
        return float(self.times(rows, np.array([per_row]))[0])


def last_run(tag: str) -> tuple[dict, list[dict]]:
    """The last bench_mixed run with this tag: its header and its records."""
    path = OUT_DIR / "bench_mixed.jsonl"
    if not path.is_file():
        raise SystemExit(f"no {path}: run benchmarks/bench_mixed.py first")
    runs: list[tuple[dict, list[dict]]] = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "header" in rec:
            runs.append((rec["header"], []))
        elif runs:
            runs[-1][1].append(rec)
    runs = [r for r in runs if r[0]["params"].get("tag") == tag and any(x.get("allocation") for x in r[1])]
    if not runs:
        raise SystemExit(f"no bench_mixed run tagged {tag!r} with an allocation report in {path}")
    return runs[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True, help="the bench_mixed run (its --tag) whose measured costs to use")
    ap.add_argument("--max-tokens", type=int, default=64, help="answers are cut here, as the run cut them")
    ap.add_argument("--sets", nargs="+", default=MIXED)
    ap.add_argument("--limit", type=int, default=20, help="examples replayed per set (the last ones: eval)")
    ap.add_argument("--context", type=float, default=700.0, help="mean cached positions per row")
    args = ap.parse_args()

    import sssd
    from sssd.calibration.allocation_replay import replay_groundtruth
    from sssd.serving.planning.projection import project

    header, records = last_run(args.tag)
    spec = [r for r in records if r.get("allocation")]
    costs = MeasuredCosts(spec[-1]["allocation"]["buckets"], args.context)  # the engine's last word
    drafter = sssd.Drafter("default", budget=64)
    paths = [GROUNDTRUTH / f"{name}.jsonl" for name in args.sets]
    steps = replay_groundtruth(drafter, paths, args.limit, last=True, max_tokens=args.max_tokens)
    batches = sorted({r["batch"] for r in spec})
    measured = {r["batch"]: r for r in spec}
    print(f"costs measured by the run of {header['date']} (git {header['git']}, {header['machine']['cpu']})")
    print(
        "| batch | projected decode speedup | nodes/row/step | tokens/row/step | measured decode speedup | measured tokens/row/step |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for p in project(steps, costs, batches):
        m = measured[p["batch"]]
        print(
            f"| {p['batch']} | {p['speedup']:.2f}x | {p['nodes_per_row']:.2f} | {p['tokens_per_row_step']:.2f} | "
            f"{m['decode_speedup']:.2f}x | {m['tokens_per_step']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
