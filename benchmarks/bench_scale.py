"""A billion-token datastore: build time, peak memory, disk, and drafting latency beside the default one.

The stream is synthetic but made of real text: the default (ShareGPT)
datastore's documents, repeated in a fresh random order per copy with a
fraction of tokens (--mutate, 2%) replaced by tokens drawn from elsewhere in
the corpus, so copies are near-duplicates, not verbatim. It is built with
``sssd.Datastore.build`` (the path ``sssd build`` takes after tokenizing),
then opened, warmed, and drafted from side by side with the default
datastore on the same contexts:

* one-shot ``draft_context`` (budget 32) on contexts cut from the corpus,
  which occur ~N/27M times in the large datastore (its worst case: every
  query has that many more occurrences to sample from);
* a batch of 64 open requests drafting together (stateful ``Drafter``).

Reported: seconds for generation, the whole build and the suffix sort in
it (tokens/s), the build process's peak RSS (its input stream included)
per token, bytes on disk per token, and the latency ratio large/default
(goal: at most 2x). Needs ~9 bytes of free disk per token (--out).

Usage:
  python benchmarks/bench_scale.py                       # 1e9 tokens in a temporary directory, deleted after
  python benchmarks/bench_scale.py --tokens 2e8 --keep --out /data/sssd-200m
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import Recorder, machine, stream_contexts

import sssd


def synthetic_stream(base: np.ndarray, total: int, mutate: float, seed: int) -> np.ndarray:
    """`total` tokens: copies of `base`'s documents in a random order each, a `mutate` fraction replaced."""
    rng = np.random.default_rng(seed)
    seps = np.flatnonzero(base == sssd.SEPARATOR)
    starts = np.concatenate([[0], seps + 1])[:-1] if len(seps) else np.array([0])
    ends = seps + 1 if len(seps) else np.array([len(base)])  # each document with its separator
    lengths = ends - starts
    words = base[base != sssd.SEPARATOR]
    out = np.empty(total, dtype=np.uint32)
    filled = 0
    while filled < total:
        order = rng.permutation(len(starts))
        # gather the documents in the new order: one index array per copy
        lens = lengths[order]
        offsets = np.repeat(starts[order] - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
        take = min(total - filled, int(lens.sum()))
        idx = offsets[:take] + np.arange(take)
        out[filled : filled + take] = base[idx]
        del idx, offsets
        chunk = out[filled : filled + take]
        hit = np.flatnonzero(rng.random(take) < mutate)
        hit = hit[chunk[hit] != sssd.SEPARATOR]
        chunk[hit] = words[rng.integers(0, len(words), size=len(hit))]
        filled += take
        print(f"\r  generated {filled / 1e6:,.0f}M of {total / 1e6:,.0f}M tokens", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return out


def one_shot_us(ds: sssd.Datastore, ctx: list[np.ndarray], budget: int, passes: int = 3) -> float:
    native = sssd.Drafter(ds, num_threads=1)._native
    for c in ctx[:10]:
        native.draft_context(c, budget)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for c in ctx:
            native.draft_context(c, budget)
        best = min(best, (time.perf_counter() - t) / len(ctx) * 1e6)
    return best


def batch_ms(ds: sssd.Datastore, ctx: list[np.ndarray], budget: int, threads: int, calls: int = 15) -> float:
    d = sssd.Drafter(ds, num_threads=threads)
    for k, c in enumerate(ctx):
        d.open(k, c)
    ids = np.arange(len(ctx), dtype=np.uint64)
    budgets = np.full(len(ctx), budget, np.int32)
    for _ in range(3):
        d._native.draft(ids, budgets, None, None)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        d._native.draft(ids, budgets, None, None)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=1e9, help="tokens in the large datastore (default 1e9)")
    ap.add_argument("--base", default="default", help="the datastore whose documents make up the stream")
    ap.add_argument("--mutate", type=float, default=0.02, help="fraction of tokens replaced in each copy")
    ap.add_argument("--out", default=None, help="where to build it (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the built datastore")
    ap.add_argument("--threads", type=int, default=0, help="suffix-sort threads (0: all cores)")
    ap.add_argument("--contexts", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    total = int(args.tokens)
    base_ds = sssd.Datastore.open(args.base)
    rec = Recorder("scale", vars(args))
    print(machine())
    parent = Path(args.out).expanduser().parent if args.out else Path(tempfile.gettempdir())
    free = shutil.disk_usage(parent).free
    if free < 9 * total:
        print(
            f"bench_scale: {free / 1e9:.1f} GB free in {parent}, need about {9 * total / 1e9:.1f} GB", file=sys.stderr
        )
        return 1
    tmp = None
    if args.out:
        out = Path(args.out).expanduser()
    else:
        tmp = tempfile.mkdtemp(prefix="sssd-scale-")
        out = Path(tmp) / "ds"
    try:
        t = time.perf_counter()
        base = np.asarray(base_ds.tokens)
        stream = synthetic_stream(base, total, args.mutate, args.seed)
        t_gen = time.perf_counter() - t
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        marks: dict[str, float] = {}

        def progress(done: int, n: int) -> None:
            marks.setdefault("sort_start" if done == 0 else "sort_end", time.perf_counter())

        t = time.perf_counter()
        sssd.Datastore.build(
            stream,
            out,
            overwrite=True,
            num_threads=args.threads,
            progress=progress,
            metadata={"synthetic": f"{args.base} documents, reshuffled, {args.mutate:.0%} mutated"},
        )
        t_build = time.perf_counter() - t
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t_sort = marks["sort_end"] - marks["sort_start"]
        del stream
        disk = sum(f.stat().st_size for f in out.iterdir())
        print(
            f"built {total / 1e6:,.0f}M tokens in {t_build:.0f} s (generation {t_gen:.0f} s before it): suffix sort "
            f"{t_sort:.0f} s = {total / t_sort / 1e6:.1f}M tokens/s; peak RSS {rss / 2**30:.1f} GiB = "
            f"{rss / total:.1f} B/token (before the build: {rss0 / 2**30:.1f} GiB, the stream); "
            f"disk {disk / 1e9:.1f} GB = {disk / total:.1f} B/token"
        )
        rec.add(
            kind="build",
            tokens=total,
            generate_s=t_gen,
            build_s=t_build,
            sort_s=t_sort,
            sort_tokens_per_s=total / t_sort,
            peak_rss_bytes=rss,
            rss_before_bytes=rss0,
            disk_bytes=disk,
        )

        big = sssd.Datastore.open(out)
        t = time.perf_counter()
        big.warm()
        base_ds.warm()
        print(f"warmed both in {time.perf_counter() - t:.1f} s")
        one = stream_contexts(base, args.contexts, 64, args.seed + 1)
        many = stream_contexts(base, args.batch, 400, args.seed + 2)
        print(f"{'':34s} {'default':>10s} {'large':>10s} {'ratio':>7s}")
        for name, fn in (
            (f"one-shot draft, budget {args.budget} (us)", lambda ds: one_shot_us(ds, one, args.budget)),
            *(
                (
                    f"batch of {args.batch}, {th} thread(s) (ms)",
                    (lambda th: lambda ds: batch_ms(ds, many, args.budget, th))(th),
                )
                for th in (1, 2)
            ),
        ):
            a, b = fn(base_ds), fn(big)
            print(f"{name:34s} {a:10.2f} {b:10.2f} {b / a:7.2f}")
            rec.add(
                kind="latency",
                what=name,
                default=a,
                large=b,
                ratio=b / a,
                large_tokens=total,
                default_tokens=base_ds.size,
            )
    finally:
        if tmp and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        elif args.keep:
            print(f"kept {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
