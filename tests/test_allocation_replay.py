"""The allocation's recorded steps (BatchAllocator.record) and their offline replay
(benchmarks/bench_allocation_replay.py): a fresh allocator fed the record prices as the live one did."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_allocation_replay import replay, summary  # noqa: E402
from test_planner import linear_profile  # noqa: E402

from sssd.serving.planning.allocation import BatchAllocator  # noqa: E402


def _live_run(alloc: BatchAllocator) -> list[float]:
    """Plain and drafted steps of 3-4 rows over growing contexts, in waves; the price of each
    drafted pass of a fitted bucket, as the live allocator gave it just before observing it."""
    rng = np.random.default_rng(5)
    prices = []
    for i in range(300):
        rows = 4 - (i % 20 > 16)
        cached = rows * (100 + 10 * (i % 20))
        if i % 3:
            s = (0.03 + 0.001 * rows + 0.004 * cached / 1000) * rng.normal(1, 0.05)
            alloc.observe_plain(rows, s + 0.001, s, cached)
            continue
        k = int(rng.integers(1, 40))
        s = (0.035 + 0.0015 * (rows + k) + 0.004 * cached / 1000) * rng.normal(1, 0.05)
        if alloc.fitted(rows):
            prices.append(float(alloc.forward_seconds(rows, np.array([float(k)]), cached)[0]))
        alloc.observe(
            rows, k, s, s + 0.002, rows + k // 3, predicted=rows / s, expected=(rows + k / 2, s), cached=cached
        )
    return prices


def test_a_replayed_record_prices_every_drafted_pass_as_the_live_allocator_did():
    profile = linear_profile(0.03, 0.001)
    live = BatchAllocator(profile.times)
    live.record = []
    prices = _live_run(live)
    assert len(prices) > 50
    steps = json.loads(json.dumps(live.record))  # as written to and read from a file
    replayed = replay(steps, profile.times)
    assert [p["price"] for p in replayed] == pytest.approx(prices, rel=1e-12)
    assert all(p["took"] > 0 and p["drafted"] > 0 for p in replayed)
    assert {p["past_edge"] for p in replayed} == {True, False}  # passes priced by the fit alone, and past it
    # a record missing its plain steps does not price the same (the record is what the fit learns from)
    partial = replay([e for e in steps if e[0] != "plain"], profile.times)
    assert [p["price"] for p in partial] != pytest.approx(prices[-len(partial) :], rel=1e-3)


def test_an_allocator_keeps_no_record_unless_asked():
    alloc = BatchAllocator(linear_profile(0.03, 0.001).times)
    alloc.observe_plain(4, 0.05, 0.04, 400)
    assert alloc.record is None


def test_the_replay_summary_splits_passes_past_the_fits_edge():
    prices = [
        {"price": 0.8, "took": 1.0, "past_edge": True},
        {"price": 1.2, "took": 1.0, "past_edge": True},
        {"price": 1.05, "took": 1.0, "past_edge": False},
    ]
    s = summary(prices)
    assert s["all"]["passes"] == 3 and s["past edge"]["passes"] == 2 and s["within"]["passes"] == 1
    assert s["past edge"]["median"] == pytest.approx(1.0)
    assert s["past edge"]["within_10pct"] == 0.0 and s["within"]["within_10pct"] == 1.0
    assert s["all"]["mean_abs_log"] == pytest.approx(np.mean(np.abs(np.log([0.8, 1.2, 1.05]))), abs=1e-3)
