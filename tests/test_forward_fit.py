"""The allocation's forward-cost fit (serving/planning/forward_fit.py) against known costs."""

from __future__ import annotations

import numpy as np
import pytest

from sssd.serving.planning.allocation import BatchAllocator
from sssd.serving.planning.forward_fit import ForwardFit


def true_cost(tokens, cached, drafted):
    """Seconds of a pass: 40 ms, 3 ms a token, 20 ms per thousand cached positions, 25 ms with drafts."""
    return (
        0.040
        + 0.003 * np.asarray(tokens, float)
        + 0.020 * np.asarray(cached, float) / 1000
        + 0.025 * (np.asarray(drafted) > 0)
    )


def steps(rng, n, rows=16):
    """n steps of a 16-row bucket: contexts that grow and turn over, drafts or none, noise of 5%."""
    for i in range(n):
        drafted = 0 if i % 5 == 0 else int(rng.integers(1, 64))
        cached = int(rows * (300 + 40 * (i % 25)) + rng.integers(0, 2000))
        yield rows + drafted, cached, drafted, float(true_cost(rows + drafted, cached, drafted)) * rng.normal(1, 0.05)


def test_the_fit_recovers_tokens_context_and_the_cost_of_drafting():
    rng = np.random.default_rng(0)
    fit = ForwardFit(per_token=0.001, decay=0.995)  # a prior 3x off: the steps correct it
    for t, c, d, s in steps(rng, 400):
        fit.observe(t, c, d, s)
    a, b, c, j = fit.coefficients()
    assert (
        b == pytest.approx(0.003, rel=0.1)
        and c == pytest.approx(0.020, rel=0.15)
        and j == pytest.approx(0.025, rel=0.2)
    )
    for tokens, cached, drafted in [(16, 5000, 0), (17, 5000, 1), (80, 20000, 64), (40, 12000, 24)]:
        assert float(fit(tokens, cached, drafted)) == pytest.approx(float(true_cost(tokens, cached, drafted)), rel=0.05)


def test_a_line_in_tokens_alone_is_biased_where_the_fit_is_not():
    """Replayed online, as the allocation uses them: each step predicted before it is observed.
    The line in tokens alone (the old model) misses the context and the fixed cost of drafts; on
    the speculative steps its mean prediction runs off, the fit's within 2%."""
    rng = np.random.default_rng(1)
    fit = ForwardFit(per_token=0.003)
    line = ForwardFit(per_token=0.003, level_decay=1.0)  # tokens alone: context and drafts fixed
    pairs = []
    for i, (t, c, d, s) in enumerate(steps(rng, 600)):
        if i >= 50 and d:
            pairs.append((float(fit(t, c, d)), float(line(t, 0, 1)), s))
        fit.observe(t, c, d, s)
        line.observe(t, 0, 1, s)
    p, q, s = np.array(pairs).T
    assert p.mean() / s.mean() == pytest.approx(1.0, abs=0.02)
    assert np.sqrt(((p - s) ** 2).mean()) < 0.75 * np.sqrt(((q - s) ** 2).mean())


def test_the_level_follows_the_machine_slowing_down():
    rng = np.random.default_rng(2)
    fit = ForwardFit(per_token=0.003)
    slow = ForwardFit(per_token=0.003, level_decay=1.0)  # no level: the slow fit alone
    for t, c, d, s in steps(rng, 200):
        fit.observe(t, c, d, s)
        slow.observe(t, c, d, s)
    late = []
    for i, (t, c, d, s) in enumerate(steps(rng, 20)):  # every pass now takes 1.3x as long
        if i >= 12:
            late.append((float(fit(t, c, d)), float(slow(t, c, d)), 1.3 * s))
        fit.observe(t, c, d, 1.3 * s)
        slow.observe(t, c, d, 1.3 * s)
    p, q, s = np.array(late).T
    assert p.sum() / s.sum() == pytest.approx(1.0, abs=0.06)
    assert q.sum() / s.sum() < 0.93  # the fit without the level still lags


def test_an_outlier_is_left_out_and_a_run_of_them_starts_the_fit_over():
    rng = np.random.default_rng(3)
    fit = ForwardFit(per_token=0.003)
    for t, c, d, s in steps(rng, 100):
        fit.observe(t, c, d, s)
    before = fit.coefficients().copy()
    assert not fit.observe(40, 8000, 24, 10 * float(true_cost(40, 8000, 24)))  # one stalled pass
    assert np.allclose(fit.coefficients(), before) and fit.outliers == 1
    for _ in range(fit.settle - 1):  # the machine is now 10x slower for good: the run's last starts it over
        fit.observe(40, 8000, 24, 10 * float(true_cost(40, 8000, 24)))
    assert fit.steps == 1 and float(fit(40, 8000, 24)) == pytest.approx(10 * float(true_cost(40, 8000, 24)), rel=0.01)
    assert not fit.observe(40, 8000, 24, float("nan")) and not fit.observe(40, 8000, 24, 0.0)


def test_the_allocation_prices_a_step_by_its_context():
    """Two batches of 16 with the same trees, one over short prompts, one over long ones: once the
    bucket has measured both kinds, each step is priced by its own context, and the long one buys
    more nodes (a fixed cost per pass makes each verified token relatively cheaper)."""
    from test_planner import linear_profile

    alloc = BatchAllocator(linear_profile(0.05, 0.003).times)
    rng = np.random.default_rng(4)
    for _t, c, d, s in steps(rng, 200):
        if d:
            alloc.observe(16, d, s, s + 0.002, 16 + d // 3, cached=c)
        else:
            alloc.observe_plain(16, s + 0.002, s, c)
    for cached in (4000, 30000):
        for k in (0, 16, 48):
            predicted = float(alloc.forward_seconds(16, np.array([k]), cached)[0])
            assert predicted == pytest.approx(float(true_cost(16 + k, cached, k)), rel=0.05)
    scores = [np.geomspace(0.9, 0.2, 24).astype(np.float32)] * 16
    ids, greedy = list(range(16)), np.ones(16, bool)
    short = alloc.allocate(ids, greedy, scores, cached=4000)
    long = alloc.allocate(ids, greedy, scores, cached=30000)
    assert long.counts.sum() > short.counts.sum() and long.seconds > short.seconds and long.cached == 30000
    assert alloc.report()["buckets"][16]["forward_fit_ms"][2] == pytest.approx(20.0, rel=0.15)
