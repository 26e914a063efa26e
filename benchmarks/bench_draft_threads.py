"""Drafting on 1 or 2 OpenMP threads beside the verifier's forward pass, under each wait policy.

The engine drafts between two forward passes (serial step); torch's own
OpenMP workers may still be spinning from the last pass, and on 2 cores
every spinning thread holds a core the drafter wants. This measures a batch
draft (256 open requests, budget 32, the default datastore) three ways:

* alone: no model work in the process;
* after a forward: the engine's serial step, a SmolLM2 forward pass over
  the batch's tokens, then the draft (only the draft is timed);
* beside a forward: a thread runs forward passes back to back while the
  draft runs (an asynchronous drafter's situation);

for each OpenMP wait policy (passive; libgomp's default, spin for a while
and then sleep; active) and 1 vs 2 drafting threads. The core and torch
share one OpenMP runtime (the system libgomp and torch's bundled copy have
one soname: whichever loads first serves both), so one policy governs both;
each policy runs in a fresh process, since the runtime reads it once. The
forward pass's own time is reported too: the policy is also torch's.

Usage:
  python benchmarks/bench_draft_threads.py [--calls 30] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import Recorder, machine

CHILD = r"""
import json, os, sys, threading, time
policy, situation, batch, budget, calls = sys.argv[1:6]
batch, budget, calls = int(batch), int(budget), int(calls)
# the one OpenMP runtime (core's and torch's) reads OMP_WAIT_POLICY as it loads
if policy != "default":
    os.environ["OMP_WAIT_POLICY"] = policy
import numpy as np
import sssd
import torch
ds = sssd.Datastore.open("default")
ds.warm()
rng = np.random.default_rng(0)
ctx = []
while len(ctx) < batch:
    i = int(rng.integers(0, ds.size - 1200))
    t = np.asarray(ds.tokens[i:i + 1200]); t = t[t != sssd.SEPARATOR]
    if len(t) >= 600:
        ctx.append(t[-int(rng.integers(300, 600)):].astype(np.int64))
model = None
if situation != "alone":
    from sssd.models.loading import load_model
    model, _, _ = load_model("smollm2-135m-instruct", log=lambda *a, **k: None)
    x = torch.randint(0, 40000, (8, 33))  # a step's worth of verification: 8 requests x (1 + 32 draft tokens)
def forward():
    with torch.inference_mode():
        model(x)
if model is not None:
    forward()
out = {}
for threads in (1, 2):
    d = sssd.Drafter(ds, num_threads=threads)
    for k, c in enumerate(ctx):
        d.open(k, c)
    ids = np.arange(batch, dtype=np.uint64)
    budgets = np.full(batch, budget, np.int32)
    for _ in range(3):
        d._native.draft(ids, budgets, None, None)
    stop = threading.Event()
    runner = None
    if situation == "beside":
        def loop():
            while not stop.is_set():
                forward()
        runner = threading.Thread(target=loop, daemon=True)
        runner.start()
        time.sleep(0.5)
    times, fwd = [], []
    for _ in range(calls):
        if situation == "after":
            t = time.perf_counter(); forward(); fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        d._native.draft(ids, budgets, None, None)
        times.append(time.perf_counter() - t)
    stop.set()
    if runner is not None:
        runner.join()
    out[threads] = {"draft_ms": float(np.median(times)) * 1e3, "forward_ms": float(np.median(fwd)) * 1e3 if fwd else None}
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--calls", type=int, default=30, help="timed drafts per setting (median)")
    args = ap.parse_args()
    rec = Recorder("draft_threads", vars(args))
    print(machine())
    print(f"batch draft of {args.batch} requests at budget {args.budget}, median of {args.calls} (ms)")
    print(
        f"{'situation':8s} {'wait policy':12s} {'1 thread':>9s} {'2 threads':>10s} {'2 vs 1':>7s} {'forward ms':>11s}"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for situation in ("alone", "after", "beside"):
        for policy in ("passive", "default", "active"):
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, policy, situation, str(args.batch), str(args.budget), str(args.calls)],
                capture_output=True,
                text=True,
                env=env,
            )
            if proc.returncode != 0:
                print(f"{situation} {policy}: failed: {proc.stderr.strip().splitlines()[-1]}")
                continue
            r = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
            one, two = r[1]["draft_ms"], r[2]["draft_ms"]
            fwd = r[1]["forward_ms"]
            print(
                f"{situation:8s} {policy:12s} {one:9.2f} {two:10.2f} {two / one:7.2f} "
                f"{'' if fwd is None else f'{fwd:11.1f}'}"
            )
            rec.add(situation=situation, wait_policy=policy, one_thread_ms=one, two_threads_ms=two, forward_ms=fwd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
