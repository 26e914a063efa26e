"""The suffix sort side by side: the 16-bit path against the integer-alphabet path, 1 and 2 threads.

The stream is the default datastore's (ShareGPT, SmolLM2's tokenizer: 49,152
ids, so its alphabet fits 16 bits). The integer path runs on the same stream
with 20,000 extra distinct ids appended as one more document (0.07% more
tokens), which pushes the alphabet past 2^16. The configurations alternate
for --rounds rounds (a slow spell of this VM slows them alike); the best and
the median of each are reported in tokens per second. Peak memory beyond the
stream and the suffix array is the symbol copy: 2 bytes per token on the
16-bit path, 4 on the integer one (suffix_sort.h).

Usage:
  .venv/bin/python benchmarks/bench_sort.py [--datastore DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder, machine  # noqa: E402

import sssd  # noqa: E402
from sssd import _core  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datastore", default="default", help="datastore whose token stream is sorted")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ds = sssd.Datastore.open(args.datastore)
    stream = np.ascontiguousarray(ds.native.tokens())
    top = int(stream[stream != sssd.SEPARATOR].max())
    extra = np.arange(top + 1, top + 20_001, dtype=np.uint32)
    wide = np.concatenate([stream, np.array([sssd.SEPARATOR], dtype=np.uint32), extra])
    configs = {
        f"{path}, {t} thread{'s' * (t > 1)}": (s, t)
        for path, s in (("16-bit", stream), ("integer", wide))
        for t in (1, 2)
    }
    rec = Recorder("sort", vars(args))
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(args.rounds):
        for name, (s, t) in configs.items():
            t0 = time.perf_counter()
            _core.build_suffix_array(s, t, None)
            times[name].append(time.perf_counter() - t0)
    print(f"{len(stream):,} tokens ({ds.path}); best / median of {args.rounds} rounds")
    for name, ts in times.items():
        n = len(configs[name][0])
        best, med = min(ts), float(np.median(ts))
        rec.add(
            config=name,
            tokens=n,
            seconds=[round(x, 3) for x in ts],
            best_tokens_per_s=round(n / best),
            median_tokens_per_s=round(n / med),
        )
        print(f"  {name:22s} {best:5.2f} s = {n / best / 1e6:5.1f}M tokens/s (median {n / med / 1e6:5.1f}M/s)")
    print(f"machine: {machine()}; records: {rec.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
