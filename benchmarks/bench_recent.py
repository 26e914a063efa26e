"""What the recent-outputs source costs per request and step: the numpy implementation it replaced
(tests/reference.py's RecentOutputsReference) against the C++ store (sssd.RecentOutputs).

Both stores get the same writes: a real corpus (the default datastore's token stream, separators
dropped) cut into consecutive chunks, each chunk a finished request (a 32-token prompt, then its
output) written 16 requests at a time, interleaved a few tokens per request and step as a serving
engine writes them, until `--fill` tokens are held. Then R active requests (the next chunks) are
opened and run `--steps` steps: each writes its next 1-4 tokens, and every request is drafted
for at budget B. Each source replays the same writes and batches on its own (one after the other,
so that neither evicts the other's store from the caches between steps); both must propose the
same trees at every step. The table gives the median time of one `propose` call over the batch
(the DraftSource call, Python included), per request, and the ratio.

Usage:
  python benchmarks/bench_recent.py                      # R in 8, 32; B in 16, 64; 200k tokens held
  python benchmarks/bench_recent.py --requests 8 --budgets 64 --fill 500000 --steps 50
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import RecentOutputsReference  # noqa: E402

import sssd  # noqa: E402
from sssd.draft_source import DraftRequest  # noqa: E402
from sssd.drafter import resolve_datastore  # noqa: E402
from sssd.recent_outputs import RecentOutputs  # noqa: E402

PROMPT = 32  # tokens of each chunk that are its prompt (the store keeps the last max_match of them)


def paths(c) -> dict:
    """{root-to-node tokens: weight} of a proposal (None: empty)."""
    out, at = {}, []
    if c is None:
        return out
    for tok, par, w in zip(c.tokens.tolist(), c.parents.tolist(), c.weights.tolist()):
        at.append((at[par] if par >= 0 else ()) + (tok,))
        out[at[-1]] = w
    return out


def same(a, b) -> bool:
    pa, pb = paths(a), paths(b)
    return pa.keys() == pb.keys() and all(abs(pa[k] - pb[k]) <= 1e-6 for k in pa)


def fill(source, corpus: np.ndarray, tokens: int, chunk: int, rng) -> int:
    """Writes finished requests (chunks of the corpus) until `tokens` are held; returns the corpus
    offset after them."""
    at, rid, written = 0, 0, 0
    while written < tokens:
        group = []
        for _ in range(16):
            body = corpus[at : at + chunk]
            at += chunk
            source.open(rid, body[:PROMPT])
            group.append([rid, body[PROMPT:], 0])
            written += min(PROMPT, source.max_match)
            rid += 1
        while group:
            for g in group:
                k = int(rng.integers(1, 5))
                piece = g[1][g[2] : g[2] + k]
                source.extend(g[0], piece)
                g[2] += k
                written += piece.shape[0]
            for g in [g for g in group if g[2] >= g[1].shape[0]]:
                source.close(g[0])
            group = [g for g in group if g[2] < g[1].shape[0]]
    return at


def replay(source, corpus: np.ndarray, requests: int, budget: int, args) -> tuple[list[float], list[list]]:
    """Fills the store, then runs the active requests' steps: (seconds per propose call, proposals)
    of the timed steps. Seeded: every source sees the same writes and the same batches."""
    rng = np.random.default_rng(args.seed)
    at = fill(source, corpus, args.fill, args.chunk, rng)
    active = []  # [request id, its chunk, tokens of it in the context]
    for r in range(requests):
        body = corpus[at : at + args.chunk]
        at += args.chunk
        rid = 1_000_000 + r
        source.open(rid, body[:PROMPT])
        active.append([rid, body, PROMPT])
    times, proposals = [], []
    for step in range(args.warmup + args.steps):
        for a in active:
            piece = a[1][a[2] : a[2] + int(rng.integers(1, 5))]
            source.extend(a[0], piece)
            a[2] += piece.shape[0]
        batch = [DraftRequest(a[0], a[1][: a[2]], budget) for a in active]
        t0 = time.perf_counter()
        got = source.propose(batch)
        t1 = time.perf_counter()
        if step >= args.warmup:
            times.append(t1 - t0)
            proposals.append(got)
    return times, proposals


def run(corpus: np.ndarray, requests: int, budget: int, args) -> dict:
    ref, cpp = RecentOutputsReference(), RecentOutputs()
    ref_times, want = replay(ref, corpus, requests, budget, args)
    cpp_times, got = replay(cpp, corpus, requests, budget, args)
    for step, (g, w) in enumerate(zip(got, want)):
        if not all(same(a, b) for a, b in zip(g, w)):
            raise SystemExit(f"step {step}: the C++ source proposed other trees than the numpy one")
    numpy_us, cpp_us = (float(np.median(t)) / requests * 1e6 for t in (ref_times, cpp_times))
    return {
        "requests": requests,
        "budget": budget,
        "held": len(cpp),
        "drafted": sum(c is not None for step in got for c in step) / (args.steps * requests),
        "numpy_us": numpy_us,
        "cpp_us": cpp_us,
        "ratio": numpy_us / cpp_us,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datastore", default="default", help="whose token stream is the text (default: %(default)s)")
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 32], help="batch sizes R")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64], help="budgets B per request")
    ap.add_argument("--fill", type=int, default=200_000, help="tokens written before the active requests")
    ap.add_argument("--chunk", type=int, default=512, help="corpus tokens per request (prompt and output)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ds = resolve_datastore(args.datastore)
    need = args.fill * 2 + (max(args.requests) + 32) * args.chunk
    stream = np.asarray(ds.tokens[: need * 2])
    corpus = stream[stream != sssd.SEPARATOR].astype(np.int64)[:need]
    print(f"corpus: {args.datastore}, {corpus.shape[0]} tokens; steps {args.steps}; times: median per request-step")
    print(f"{'R':>4} {'B':>4} {'held':>8} {'drafted':>8} {'numpy us':>10} {'C++ us':>8} {'ratio':>7}")
    for requests in args.requests:
        for budget in args.budgets:
            r = run(corpus, requests, budget, args)
            print(
                f"{r['requests']:>4} {r['budget']:>4} {r['held']:>8} {r['drafted']:>8.0%} "
                f"{r['numpy_us']:>10.1f} {r['cpp_us']:>8.2f} {r['ratio']:>6.0f}x"
            )


if __name__ == "__main__":
    main()
