"""Shared helpers for the benchmarks: machine info, JSON-lines records, timing."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "out"

# Benchmarks measure engines as they run once settled: their linear plan and forward profile are
# taken before the first request (an engine driven by generate() alone is never idle, so it would
# otherwise plan with the prior throughout). bench_neighbour.py measures the start-up itself.
os.environ.setdefault("SSSD_MEASURE", "now")


def machine() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        # how OpenMP threads wait between parallel regions: "passive" makes every elementwise op over
        # 32k values wake a sleeping thread (~70 us against ~5 on a 2-core Xeon), which passes of more
        # than ~56 tokens pay (SmolLM2: 30-40 ms a pass); unset is the default, what sssd serve runs
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default",
    }


def git_sha() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Recorder:
    """Appends one JSON object per measurement to benchmarks/out/<name>.jsonl."""

    def __init__(self, name: str, params: dict):
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        self.path = OUT_DIR / f"{name}.jsonl"
        self.header = {
            "benchmark": name,
            "git": git_sha(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": machine(),
            "params": params,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps({"header": self.header}) + "\n")

    def add(self, **record) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def median(xs):
    s = sorted(xs)
    n = len(s)
    return (s[n // 2] + s[(n - 1) // 2]) / 2 if n else float("nan")


def now() -> float:
    return time.perf_counter()


def stream_contexts(tokens, count: int, length: int, seed: int) -> list:
    """`count` contexts of `length` tokens cut at random from a token stream (a datastore's
    ``tokens``), separators dropped, as contiguous uint32 arrays."""
    import numpy as np

    from sssd import SEPARATOR

    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        i = int(rng.integers(0, len(tokens) - 2 * length))
        t = np.asarray(tokens[i : i + 2 * length])
        t = t[t != SEPARATOR]
        if len(t) >= length:
            out.append(np.ascontiguousarray(t[:length], dtype=np.uint32))
    return out


def disjoint_prompts(pool: list, sizes: list[int]) -> list[list]:
    """Consecutive slices of `pool`, one per size: no prompt is sent twice to one engine or server
    while the pool lasts. The default draft sources keep the recent outputs of earlier requests, so
    a repeated prompt would be drafted from its own earlier answer. Past the pool's end the slices
    wrap around, with a warning."""
    if sum(sizes) > len(pool):
        print(
            f"WARNING: {sum(sizes)} prompts asked of a set of {len(pool)}: some repeat, and the recent outputs "
            "draft a repeated prompt from its earlier answer",
            flush=True,
        )
    out, at = [], 0
    for n in sizes:
        out.append([pool[(at + i) % len(pool)] for i in range(n)])
        at += n
    return out
