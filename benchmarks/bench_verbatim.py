"""How far a draft follows a long verbatim match.

Samples contexts of --context tokens that occur exactly once in the datastore
(inside one document, with at least --follow tokens of the document after
them), drafts for each at --budget, and measures how many tokens of the
document's continuation the draft tree follows from its root (the accepted
length if the target copied the document). Configurations side by side:
fixed 16-token datastore branches (before adaptive depth), the built-in
defaults, and each --config file's entry for the budget.

Usage:
  python benchmarks/bench_verbatim.py                                   # default datastore
  python benchmarks/bench_verbatim.py --config sssd/data/calibration-smollm2.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import Recorder, machine

import sssd


def followed(tree: sssd.DraftTree, continuation: np.ndarray) -> int:
    """Tokens of `continuation` on one root path of `tree`."""
    node, n = -1, 0
    while n < len(continuation):
        kids = np.flatnonzero((tree.parents == node) & (tree.tokens == continuation[n]))
        if not kids.size:
            break
        node, n = int(kids[0]), n + 1
    return n


def sample_contexts(ds: sssd.Datastore, count: int, context: int, follow: int, seed: int):
    tokens = ds.tokens
    rng = np.random.default_rng(seed)
    out = []
    tries = 0
    while len(out) < count and tries < 100 * count:
        tries += 1
        i = int(rng.integers(context, ds.size - follow))
        window = np.asarray(tokens[i - context : i + follow], dtype=np.int64)
        if (window == sssd.SEPARATOR).any():
            continue
        ctx = np.ascontiguousarray(window[:context])
        if ds.count(ctx) != 1:
            continue
        out.append((ctx, window[context:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datastore", default="default")
    ap.add_argument("--config", nargs="*", default=[], help="calibration / config files to compare")
    ap.add_argument("--contexts", type=int, default=200, help="contexts sampled")
    ap.add_argument("--context", type=int, default=32, help="context length (tokens)")
    ap.add_argument("--follow", type=int, default=64, help="continuation tokens available after the context")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--goal", type=int, default=48, help="tokens a draft should follow")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    ds = sssd.Datastore.open(args.datastore)
    cases = sample_contexts(ds, args.contexts, args.context, args.follow, args.seed)
    configs = {
        "fixed 16-token branches": sssd.DrafterConfig(datastore_branch_per_match=0, datastore_max_branch_len=16),
        "built-in defaults": sssd.DrafterConfig(),
        "defaults, match boost 1.5": sssd.DrafterConfig(match_boost=1.5),
    }
    for path in args.config:
        configs[f"{path} (budget {args.budget})"] = sssd.DrafterConfig.load(path, args.budget)
    rec = Recorder("verbatim", vars(args))
    print(machine())
    print(f"{len(cases)} contexts of {args.context} tokens occurring once in {ds}; budget {args.budget}")
    print(f"{'configuration':48s} {'mean':>6s} {'median':>6s} {'>= goal':>8s} {'us/draft':>9s}")
    for name, cfg in configs.items():
        drafter = sssd.Drafter(ds, cfg.replace(num_threads=1))
        lengths = []
        t0 = time.perf_counter()
        for ctx, cont in cases:
            lengths.append(followed(drafter.draft_prefix(ctx, args.budget), cont))
        us = (time.perf_counter() - t0) / max(1, len(cases)) * 1e6
        lengths = np.asarray(lengths)
        share = float((lengths >= args.goal).mean())
        print(f"{name:48s} {lengths.mean():6.1f} {np.median(lengths):6.0f} {share:8.0%} {us:9.0f}")
        rec.add(
            config=name,
            contexts=len(cases),
            mean=float(lengths.mean()),
            median=float(np.median(lengths)),
            share_at_goal=share,
            us_per_draft=us,
        )


if __name__ == "__main__":
    main()
