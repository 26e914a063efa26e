"""What a draft costs: the one-shot library call and a large batch, side by side.

One-shot: ``sssd.draft(prefix, 32)`` on contexts of 200-2000 tokens cut from
the datastore's text, against the native call alone and against what a
one-shot draft did before (build a request trie over the whole context,
draft, drop it).

Batch: one ``Drafter.draft`` call for 256 open requests (contexts of 300-600
tokens) at budget 32, with fixed 16-token datastore branches and with the
defaults (adaptive depth), on 1 and 2 OpenMP threads.

Best of 3 passes for the one-shot figures, median of 15 calls for the batch.
Run it on a quiet machine (OMP_WAIT_POLICY=passive).

Usage:
  OMP_WAIT_POLICY=passive python benchmarks/bench_draft_cost.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import Recorder, machine

import sssd


def contexts(ds: sssd.Datastore, count: int, low: int, high: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        i = int(rng.integers(0, ds.size - 2 * high))
        t = np.asarray(ds.tokens[i : i + 2 * high], dtype=np.int64)
        t = t[t != sssd.SEPARATOR]
        if len(t) >= high:
            out.append(t[-int(rng.integers(low, high)) :])
    return out


def per_call_us(fn, items, passes: int = 3) -> float:
    for c in items[:5]:
        fn(c)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for c in items:
            fn(c)
        best = min(best, (time.perf_counter() - t) / len(items) * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datastore", default="default")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ds = sssd.Datastore.open(args.datastore)
    rec = Recorder("draft_cost", vars(args))
    print(machine())

    one = contexts(ds, 100, 200, 2000, args.seed)
    native = sssd.Drafter(ds, num_threads=1)._native
    scratch = sssd.Drafter(ds, num_threads=1)._native

    def before(c):
        scratch.open(0, c.astype(np.uint32))
        scratch.draft(np.zeros(1, np.uint64), np.array([args.budget], np.int32), None, None)
        scratch.close(0)

    figures = {
        "sssd.draft(prefix)": per_call_us(lambda c: sssd.draft(c, args.budget), one),
        "native one-shot (one scan of the context)": per_call_us(
            lambda c: native.draft_context(c.astype(np.uint32), args.budget), one
        ),
        "one-shot as before (request trie over the context)": per_call_us(before, one),
    }
    print(f"one-shot, budget {args.budget}, contexts of 200-2000 tokens:")
    for name, us in figures.items():
        print(f"  {name:52s} {us:8.0f} us")
        rec.add(kind="one-shot", what=name, us=us)

    many = contexts(ds, args.batch, 300, 600, args.seed + 1)
    ids = np.arange(args.batch, dtype=np.uint64)
    budgets = np.full(args.batch, args.budget, np.int32)
    print(f"batch of {args.batch} open requests, budget {args.budget} (median of 15 calls):")
    for name, cfg in (
        ("fixed 16-token branches", sssd.DrafterConfig(datastore_branch_per_match=0, datastore_max_branch_len=16)),
        ("defaults (adaptive depth)", sssd.DrafterConfig()),
    ):
        for threads in (1, 2):
            d = sssd.Drafter(ds, cfg, num_threads=threads)
            for k, c in enumerate(many):
                d.open(k, c)
            for _ in range(3):
                d._native.draft(ids, budgets, None, None)
            times = []
            for _ in range(15):
                t = time.perf_counter()
                d._native.draft(ids, budgets, None, None)
                times.append(time.perf_counter() - t)
            ms = float(np.median(times)) * 1e3
            print(f"  {name:30s} {threads} thread(s): {ms:6.2f} ms")
            rec.add(kind="batch", config=name, threads=threads, ms=ms)


if __name__ == "__main__":
    main()
