"""Drafting latency per decoding step vs batch size and budget, with SSSD and
(optionally) SuffixDecoding side by side on the same data.

Each configuration replays held-out answers: at every step the drafter drafts
for the whole batch, the accepted length is the longest draft path that
matches the true answer, and each request then advances by accepted + 1
tokens (exactly what greedy decoding would do). Timed: the batch draft call
(SSSD: one call, OpenMP over requests; SuffixDecoding: one speculate() per
request) and the per-step update (SSSD: one extend_batch call;
SuffixDecoding: add_active_response per request).

Usage:
  python benchmarks/bench_draft_latency.py                      # default datastore
  python benchmarks/bench_draft_latency.py --peers              # + SuffixDecoding (run in .venv-peers)

Run with OMP_WAIT_POLICY=passive OPENBLAS_NUM_THREADS=1: the systems take
turns in one process, and spinning idle threads (OpenMP's after a parallel
region, OpenBLAS's) would otherwise steal the 2 cores from whichever runs next.
  python benchmarks/bench_draft_latency.py --tokens-file F.u32  # raw stream, built on the fly
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder, machine, median, now  # noqa: E402
from replay_data import heldout_pairs, stream_pairs  # noqa: E402

import sssd  # noqa: E402


def accepted_lengths(batch: sssd.DraftBatch, answers: list[np.ndarray], pos: np.ndarray) -> np.ndarray:
    """Longest root-to-node path of each tree that matches the answer at pos (vectorised)."""
    B = len(batch)
    n = batch.tokens.shape[0]
    if n == 0:
        return np.zeros(B, dtype=np.int64)
    req = np.repeat(np.arange(B), np.diff(batch.offsets))
    glob_parent = np.where(batch.parents >= 0, batch.parents + batch.offsets[req], -1)
    want_idx = pos[req] + batch.depths - 1
    lens = np.array([len(a) for a in answers])
    valid = want_idx < lens[req]
    flat = np.concatenate(answers)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    want = np.where(valid, flat[np.minimum(starts[req] + want_idx, len(flat) - 1)], -1)
    ok = (batch.tokens == want) & valid
    matched = np.zeros(n, dtype=bool)
    for d in range(1, int(batch.depths.max()) + 1):
        at = batch.depths == d
        par_ok = np.where(glob_parent[at] >= 0, matched[np.maximum(glob_parent[at], 0)], True)
        matched[at] = ok[at] & par_ok
    acc = np.zeros(B, dtype=np.int64)
    np.maximum.at(acc, req[matched], batch.depths[matched])
    return acc


class Runner:
    """This script's runner protocol over any drafter with sssd.Drafter's interface
    (open / draft / extend_batch / close): request ids are handed out here."""

    def __init__(self, drafter, name: str):
        self.drafter, self.name = drafter, name
        self.next_id = 0

    def open(self, prompt):
        rid = self.next_id
        self.next_id += 1
        self.drafter.open(rid, prompt)
        return rid

    def close(self, rid):
        self.drafter.close(rid)

    def draft(self, rids, budget):
        return self.drafter.draft(rids, budget)

    def update(self, rids, token_lists):
        self.drafter.extend_batch(rids, token_lists)


class SuffixDecodingRunner(Runner):
    """The SuffixDecoding peer adapter (benchmarks/peers/suffix_decoding.py: its
    global tree warmed with the datastore's documents, a finished request's
    response evicted so that replays never draft from an earlier copy of the
    answer they replay)."""

    def __init__(self, drafter, name: str):
        super().__init__(drafter, name)
        self.warm_seconds = drafter.warm.warm_seconds

    @classmethod
    def warmed(
        cls, datastore_tokens: np.ndarray, spec_factor: float, min_prob: float, name: str
    ) -> "SuffixDecodingRunner":
        from peers.suffix_decoding import SuffixDecodingDrafter, WarmCache

        warm = WarmCache(datastore_tokens, max_tree_depth=64)
        return cls(SuffixDecodingDrafter(warm, max_spec_factor=spec_factor, min_token_prob=min_prob), name)

    def settings(self, spec_factor: float, min_prob: float, name: str) -> "SuffixDecodingRunner":
        """The same warmed cache under other speculation settings (warming takes minutes)."""
        other = SuffixDecodingRunner(
            self.drafter.with_settings(max_spec_factor=spec_factor, min_token_prob=min_prob), name
        )
        other.next_id = 1 << 40  # ids never collide with this runner's
        return other


def replay(runner, pairs, B: int, budget: int, steps: int, pair_offset: int):
    """Runs `steps` decoding steps for a batch of B requests; returns per-step timings and accepted lengths."""
    k = pair_offset
    slots = []
    for _ in range(B):
        p, a = pairs[k % len(pairs)]
        k += 1
        slots.append([runner.open(p), a, 0])
    draft_s, update_s, accepted = [], [], []
    for _ in range(steps):
        rids = [s[0] for s in slots]
        t0 = now()
        batch = runner.draft(rids, budget)
        draft_s.append(now() - t0)
        acc = accepted_lengths(batch, [s[1] for s in slots], np.array([s[2] for s in slots]))
        accepted.extend(acc.tolist())
        chunks = [s[1][s[2] : s[2] + int(a) + 1] for s, a in zip(slots, acc)]
        t0 = now()
        runner.update(rids, chunks)
        update_s.append(now() - t0)
        for s, a in zip(slots, acc):
            s[2] += int(a) + 1
        for s in slots:  # a finished answer makes room for the next pair
            if s[2] >= len(s[1]):
                runner.close(s[0])
                p, a = pairs[k % len(pairs)]
                k += 1
                s[:] = [runner.open(p), a, 0]
    for s in slots:
        runner.close(s[0])
    return draft_s, update_s, accepted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--datastore", default="default", help="datastore with heldout.jsonl (default: the default datastore)"
    )
    ap.add_argument("--tokens-file", help="raw uint32 token stream instead (every 50th document held out)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=12, help="decoding steps per configuration")
    ap.add_argument("--threads", type=int, default=0, help="SSSD OpenMP threads (0: all cores)")
    ap.add_argument(
        "--peers", action="store_true", help="also run SuffixDecoding (needs benchmarks/peers/setup_arctic.sh)"
    )
    ap.add_argument("--sd-spec-factor", type=float, default=4.0, help="SuffixDecoding max_spec_factor (swept setting)")
    ap.add_argument("--sd-min-prob", type=float, default=0.0, help="SuffixDecoding min_token_prob (swept setting)")
    args = ap.parse_args()

    if args.tokens_file:
        stream = np.fromfile(args.tokens_file, dtype=np.uint32)
        ds_tokens, pairs = stream_pairs(stream)
        tmp = Path(tempfile.mkdtemp(prefix="sssd-bench-"))
        datastore = sssd.Datastore.build(ds_tokens, tmp / "ds")
        source = f"{args.tokens_file} (every 50th document held out)"
    else:
        from sssd.drafter import resolve_datastore

        datastore = resolve_datastore(args.datastore)
        pairs = heldout_pairs(datastore)
        ds_tokens = datastore.tokens
        source = str(datastore.path)
    datastore.warm()  # no page faults inside the measurements
    print(f"datastore: {source}: {datastore.size:,} tokens; {len(pairs)} held-out (prompt, answer) pairs")
    rec = Recorder("draft_latency", {**vars(args), "datastore_tokens": datastore.size, "pairs": len(pairs)})

    runners = [
        Runner(sssd.Drafter(datastore, num_threads=args.threads), "sssd"),
        Runner(sssd.Drafter(datastore, num_threads=1), "sssd_1thread"),
    ]
    if args.peers:
        print("warming SuffixDecoding's global tree with the datastore's documents...", flush=True)
        sd = SuffixDecodingRunner.warmed(
            np.asarray(ds_tokens), args.sd_spec_factor, args.sd_min_prob, "suffix_decoding"
        )
        print(f"  done in {sd.warm_seconds:.0f} s")
        # Its defaults (max_spec_factor=1, min_token_prob=0.1) draft few tokens; the
        # swept setting (factor 4, min prob 0 by default) fills the budget like SSSD.
        runners += [sd, sd.settings(1.0, 0.1, "suffix_decoding_defaults")]

    # Runner-major order: each system runs all its configurations back to
    # back, so none pays for the cache and TLB state another one left behind
    # (SuffixDecoding's warmed tree alone is several GB).
    configs = [(B, budget) for B in args.batch_sizes for budget in args.budgets]
    cells: dict[tuple, list[str]] = {c: [] for c in configs}
    for r in runners:
        offset = 0
        for B, budget in configs:
            replay(r, pairs, B, budget, 1, offset)  # warm-up step
            d, u, acc = replay(r, pairs, B, budget, args.steps, offset)
            ms = median(d) * 1e3
            us_req = ms * 1e3 / B
            upd_us = median(u) * 1e6 / B
            mat = 1 + float(np.mean(acc))
            rec.add(
                system=r.name,
                batch=B,
                budget=budget,
                step_ms=ms,
                us_per_request=us_req,
                update_us_per_request=upd_us,
                mat=mat,
            )
            cells[(B, budget)].append(f"{ms:8.3f} {us_req:7.1f} {upd_us:4.1f} {mat:4.2f}")
            offset += B
        print(f"  {r.name}: done", flush=True)
    print(f"{'batch':>5} {'budget':>6} | " + " | ".join(f"{r.name:>26}" for r in runners))
    print(f"{'':>5} {'':>6} | " + " | ".join(f"{'ms/step  us/req  upd  MAT':>26}" for _ in runners))
    for (B, budget), row in cells.items():
        print(f"{B:>5} {budget:>6} | " + " | ".join(f"{c:>26}" for c in row))
    print(f"machine: {machine()}; records: {rec.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
