"""What a verification pass costs by the shape of its trees: B rows at a cached context, each row
verifying its root and 0..n draft nodes (the batch-wide allocation's steps are ragged: a few rows
with drafts beside many without).

For each pattern of nodes per row, the forward pass (TorchBackend.launch + collect: the layers,
attention over the KV pool, the argmax) is timed in interleaved rounds, medians reported, beside
the plain pass (every row its root alone). `--split-ab` times every pattern twice more, with the
attention split's call cost fixed at its short-context value (attention.CALL_CONTEXT set past the
context: the rule before the split looked at the context) and as it is now, so the split's choice
is compared within one run. `--sweep N` adds passes of B + 1 .. B + N tokens (one row taking the
nodes, then the next), where the step from a plain pass to one verifying a single node shows.
`--prefill N` times a prompt chunk of N tokens (a request that joins) written in a pass of its own
after the plain decode pass, against the same chunk written by the decode pass itself (fused, as
the engine does where the backend can), and a batch's worth of such chunks in one pass.

Usage:
  python benchmarks/bench_pass_shapes.py --batch 16 --context 700 --split-ab
  python benchmarks/bench_pass_shapes.py --batch 4 16 32 --context 700 --sweep 12
  python benchmarks/bench_pass_shapes.py --batch 3 15 --context 300 --prefill 50 100 300
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder, machine  # noqa: E402


def patterns(B: int, rng) -> dict[str, list[int]]:
    """Tokens per row (root + draft nodes) of each pattern."""
    return {
        "plain": [1] * B,
        "one row +1": [1] * (B - 1) + [2],
        "two rows +2": [1] * (B - 2) + [3, 3],
        "half the rows +1": [1] * (B // 2) + [2] * (B - B // 2),
        "one row +7": [1] * (B - 1) + [8],
        "every row +1": [2] * B,
        "mixed 0-4": rng.integers(1, 6, B).tolist(),
    }


def sweep(B: int, n: int) -> dict[str, list[int]]:
    out = {}
    for extra in range(1, n + 1):
        sizes, left, i = [1] * B, extra, B - 1
        while left > 0 and i >= 0:
            add = min(left, 12)
            sizes[i] += add
            left, i = left - add, i - 1
        out[f"{B + extra} tokens"] = sizes
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--context", type=int, default=700, help="cached positions per row")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds (the first warms up)")
    ap.add_argument("--split-ab", action="store_true", help="also time the split at its fixed call cost")
    ap.add_argument("--sweep", type=int, default=0, help="also time B + 1 .. B + N tokens")
    ap.add_argument(
        "--prefill",
        type=int,
        nargs="+",
        default=[],
        help="prompt chunk lengths: each timed in a pass of its own beside the plain pass, and fused into it",
    )
    args = ap.parse_args()

    from sssd.models import resolve_model
    from sssd.serving.backends import attention
    from sssd.serving.backends.torch_backend import TorchBackend
    from sssd.serving.verify.tree_batch import pack, pack_chain, stack
    from sssd.tree import DraftBatch

    rec = Recorder("bench_pass_shapes", vars(args))
    print("machine:", machine())
    longest = max([args.context, *args.prefill])
    be = TorchBackend(resolve_model(args.model), slots=max(args.batch) + 1, capacity=longest + 64)
    V = be.info.vocab_size
    rng = np.random.default_rng(0)
    context_aware = attention.CALL_CONTEXT

    def chains(sizes):
        n = np.asarray(sizes) - 1
        N = int(n.sum())
        parents = [np.arange(-1, k - 1) for k in n if k]
        depths = [np.arange(1, k + 1) for k in n if k]
        return DraftBatch(
            np.concatenate([[0], np.cumsum(n)]).astype(np.int64),
            rng.integers(0, V, N),
            (np.concatenate(parents) if parents else np.zeros(0)).astype(np.int32),
            (np.concatenate(depths) if depths else np.zeros(0)).astype(np.int32),
            np.ones(N, np.float32),
            np.zeros(N, np.uint8),
            np.full(N, np.nan, np.float32),
        )

    def timed(B, sizes, split):
        attention.CALL_CONTEXT = context_aware if split == "now" else 10**9
        batch = pack(rng.integers(0, V, B), np.full(B, args.context), chains(sizes))
        t0 = time.perf_counter()
        be.collect(be.launch(slice(0, B), batch, np.ones(B, dtype=bool)))
        return time.perf_counter() - t0

    def prefill_pair(B, n, fused):
        """The plain decode pass of B rows and one chunk of n prompt tokens (slot B, nothing cached):
        two passes, or one."""
        plain = pack(rng.integers(0, V, B), np.full(B, args.context), None)
        chunk = pack_chain(np.zeros(1, np.int64), [rng.integers(0, V, n)])
        t0 = time.perf_counter()
        if fused:
            be.collect(be.launch(slice(0, B + 1), stack(plain, chunk), np.ones(B + 1, dtype=bool), heads=B))
        else:
            be.collect(be.launch(slice(0, B), plain, np.ones(B, dtype=bool)))
            be.prefill(slice(B, B + 1), chunk)
        return time.perf_counter() - t0

    for B in args.batch:
        if args.prefill:
            times = {(n, f): [] for n in args.prefill for f in (False, True)}
            for r in range(args.rounds):
                for n in args.prefill:
                    for f in (False, True):
                        t = prefill_pair(B, n, f)
                        if r:
                            times[(n, f)].append(t)
            print(f"\nbatch {B} decoding at {args.context} cached positions, one request's prompt chunk beside it: ms")
            print("| chunk tokens | decode pass + chunk's own pass | one pass (fused) | fused / apart |")
            print("|---:|---:|---:|---:|")
            for n in args.prefill:
                apart, fused = (float(np.median(times[(n, f)])) for f in (False, True))
                print(f"| {n} | {1e3 * apart:.1f} | {1e3 * fused:.1f} | {fused / apart:.3f} |")
                rec.add(batch=B, chunk=n, apart_ms=round(1e3 * apart, 2), fused_ms=round(1e3 * fused, 2))
            continue
        pats = patterns(B, rng) | (sweep(B, args.sweep) if args.sweep else {})
        modes = ["now", "fixed"] if args.split_ab else ["now"]
        times = {(k, m): [] for k in pats for m in modes}
        for r in range(args.rounds):
            for k, sizes in pats.items():
                for m in modes:
                    t = timed(B, sizes, m)
                    if r:
                        times[(k, m)].append(t)
        plain = float(np.median(times[("plain", "now")]))
        print(f"\nbatch {B}, {args.context} cached positions a row: forward ms (median of {args.rounds - 1})")
        head = "| pattern | tokens | ms | over plain |" + (
            " split at fixed call cost | now / fixed |" if args.split_ab else ""
        )
        print(head)
        print("|---|---:|---:|---:|" + ("---:|---:|" if args.split_ab else ""))
        for k, sizes in pats.items():
            now = float(np.median(times[(k, "now")]))
            row = f"| {k} | {sum(sizes)} | {1e3 * now:.1f} | +{1e3 * (now - plain):.1f} |"
            out = {"batch": B, "pattern": k, "tokens": sum(sizes), "ms": round(1e3 * now, 2)}
            if args.split_ab:
                fixed = float(np.median(times[(k, "fixed")]))
                row += f" {1e3 * fixed:.1f} | {now / fixed:.3f} |"
                out["ms_split_fixed"] = round(1e3 * fixed, 2)
            print(row)
            rec.add(**out)
    attention.CALL_CONTEXT = context_aware
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
