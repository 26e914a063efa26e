"""What page faults cost a draft, and what each residency mode buys (sssd.datastore.RESIDENCY).

For each mode (lazy, warm, lock) and each situation, a fresh process opens a
private copy of the datastore, applies the mode (timed), and drafts one-shot
(``draft_context``, budget 32) from the same contexts cut at random from the
stream, recording per-draft latency and the process's page faults:

* cold: the files are evicted from the page cache first (MADV_PAGEOUT on
  the fresh map: a restart after other work, or a datastore larger than
  what stays cached); lazy pays the disk reads inside drafts, warm and lock
  pay them at start;
* reclaimed: after the mode was applied, the kernel reclaims the mapping
  (MADV_PAGEOUT, standing in for memory pressure from the model or other
  processes); warm pages are gone again, locked ones stay.

The copy lives in a temporary directory so that no other process maps the
files (a page another process maps is not evicted). Needs Linux >= 5.4
(MADV_PAGEOUT).

Usage:
  python benchmarks/bench_residency.py [--datastore DIR] [--contexts 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import Recorder, machine, stream_contexts

import sssd

CHILD = r"""
import json, os, resource, sys, time
import numpy as np
import sssd
directory, mode, situation, ctx_file, budget = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
contexts = np.load(ctx_file)
t = time.perf_counter()
ds = sssd.Datastore.open(directory)
t_open = time.perf_counter() - t
evicted = ds.page_out() if situation == "cold" else None  # out of the page cache: the next reads go to disk
t = time.perf_counter()
ds.make_resident(mode)
t_mode = time.perf_counter() - t
reclaimed = ds.page_out() if situation == "reclaimed" else None
resident = ds.resident_bytes()
native = sssd.Drafter(ds, num_threads=1)._native
r0 = resource.getrusage(resource.RUSAGE_SELF)
lat = []
for c in contexts:
    t = time.perf_counter()
    native.draft_context(c, budget)
    lat.append(time.perf_counter() - t)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"open_s": t_open, "mode_s": t_mode, "resident_mb": resident / 1e6, "page_out": reclaimed or evicted,
                  "lat_us": [x * 1e6 for x in lat], "major": r1.ru_majflt - r0.ru_majflt,
                  "minor": r1.ru_minflt - r0.ru_minflt}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datastore", default="default")
    ap.add_argument("--contexts", type=int, default=300, help="one-shot drafts per run")
    ap.add_argument("--length", type=int, default=64, help="tokens per context")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ds = sssd.Datastore.open(args.datastore)
    rec = Recorder("residency", vars(args))
    print(machine())
    with tempfile.TemporaryDirectory(prefix="sssd-residency-") as tmp:
        copy = Path(tmp) / "ds"
        shutil.copytree(ds.path, copy)
        os.sync()  # written back: clean pages can be evicted
        ctx = stream_contexts(ds.tokens, args.contexts, args.length, args.seed)
        del ds
        ctx_file = Path(tmp) / "contexts.npy"
        np.save(ctx_file, np.stack(ctx))
        print(
            f"datastore {args.datastore}: {sum(f.stat().st_size for f in copy.glob('*.bin')) / 1e6:.0f} MB of "
            f"index files; {args.contexts} one-shot drafts of {args.length}-token contexts at budget {args.budget}"
        )
        print(
            f"{'situation':10s} {'mode':5s} {'mode s':>7s} {'first 10 us':>12s} {'mean us':>9s} {'p50 us':>8s} "
            f"{'p99 us':>8s} {'major':>6s} {'minor':>7s} {'resident MB':>12s}"
        )
        for situation in ("cold", "reclaimed"):
            for mode in ("lazy", "warm", "lock"):
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, str(copy), mode, situation, str(ctx_file), str(args.budget)],
                    capture_output=True,
                    text=True,
                )
                if proc.returncode != 0:
                    print(f"{situation:10s} {mode:5s} failed: {proc.stderr.strip().splitlines()[-1]}")
                    continue
                r = json.loads(proc.stdout)
                lat = np.array(r.pop("lat_us"))
                row = {
                    "situation": situation,
                    "mode": mode,
                    "mode_s": r["mode_s"],
                    "first10_us": lat[:10].mean(),
                    "mean_us": lat.mean(),
                    "p50_us": float(np.median(lat)),
                    "p99_us": float(np.percentile(lat, 99)),
                    "major_faults": r["major"],
                    "minor_faults": r["minor"],
                    "resident_mb": r["resident_mb"],
                    "page_out": r["page_out"],
                    "open_s": r["open_s"],
                }
                rec.add(**row)
                print(
                    f"{situation:10s} {mode:5s} {row['mode_s']:7.2f} {row['first10_us']:12.0f} {row['mean_us']:9.0f} "
                    f"{row['p50_us']:8.0f} {row['p99_us']:8.0f} {row['major_faults']:6d} {row['minor_faults']:7d} "
                    f"{row['resident_mb']:12.0f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
