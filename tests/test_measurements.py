"""Start-up that never waits on measurement: the prior cost model, measurements taken between
requests (dropped beside a busy process, retried with back-off, never from garbage), the
consistency check, the competing-process accounting and the thread count that follows it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
from tiny_models import tiny_model

from sssd.cpus import Contention, competing_seconds, competing_ticks
from sssd.serving.backends import linear_plan
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.serving.planning import measurements, profile
from sssd.serving.planning.planner import BudgetPlanner
from sssd.serving.planning.profile import Conditions, ForwardProfile, profile_problem


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("llama") / "llama", "llama")


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    """An empty profile folder of this test's own: nothing is cached yet."""
    monkeypatch.setenv("SSSD_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.setenv("SSSD_MEASURE", "background")
    # whatever else this machine runs meanwhile (the share check itself is tested with a patched
    # threshold below; the consistency check still applies)
    monkeypatch.setenv("SSSD_PROFILE_NOISY_SHARE", "1")
    # threads fixed: a plan's file name hashes the thread count, which the engine otherwise drops to
    # one beside a busy process (sssd.cpus.Contention); a plan measured then was cached under the
    # one-thread name and these tests, looking it up at two, failed under CI load
    monkeypatch.setenv("SSSD_FOLLOW_LOAD", "0")
    return tmp_path / "profiles"


def engine(model, draft=("retrieval",), **kw) -> LLMEngine:
    return LLMEngine(
        model, datastore=None, draft=list(draft), config=EngineConfig(max_running=4, max_model_len=256, **kw)
    )


def settle(eng: LLMEngine, limit: float = 300.0) -> None:
    """Runs the engine's idle work until nothing is pending (what a server does between requests)."""
    t0 = time.monotonic()
    while eng.idle(0.5):
        assert time.monotonic() - t0 < limit, eng.measurements.status()


# -- the prior and the consistency check ----------------------------------------------------------


def quiet_profile(changes: dict | None = None) -> ForwardProfile:
    rows, tokens = [1, 2, 4], [1, 2, 4, 8]
    seconds = [[0.03 * (1 + 0.15 * (r * t - 1)) for t in tokens] for r in rows]
    for (i, j), v in (changes or {}).items():
        seconds[i][j] = v
    return ForwardProfile(rows, tokens, seconds, 256, {"conditions": {"other_processes_cpu_share": 0.0}})


def test_a_sound_profile_is_trusted_and_a_pass_that_waited_for_the_cpu_is_not():
    assert profile_problem(quiet_profile()) is None
    # the busy-neighbour figures of the issue: a pass at 14x one of half the rows
    slow = {(2, j): v * 14 for j, v in enumerate(quiet_profile().seconds[2])}  # every 4-row pass
    assert "4-row pass took" in profile_problem(quiet_profile(slow))
    assert profile_problem(quiet_profile({(1, 0): 0.03 * 14})) is not None
    # 8 tokens at 13x 4 tokens in one row
    assert "8 tokens took" in profile_problem(quiet_profile({(0, 3): quiet_profile().seconds[0][2] * 13}))
    assert profile_problem(ForwardProfile([1], [1], [[0.1]], 256, {"prior": True})) is not None


def test_a_pass_that_stalls_once_is_timed_again_and_the_profile_is_trusted(llama, profiles, monkeypatch):
    """A hiccup that outlasts a point's repeats (both passes of its first timing stall, as beside
    a burst of other work) is timed again as soon as it is out of line: the profile is kept with
    the point's retimed figure. The row's stopping rule is off here (a real hiccup at a shorter
    point of this tiny model's row once stopped it before the stalled point: CI, 2026-11-30)."""
    monkeypatch.setattr(profile, "STOP_RATIO", float("inf"))
    eng = engine(llama, speculate=False)
    backend, launch = eng.backend, eng.backend.launch
    stalled = {"passes": 0}

    def stalls_at_one_point(rows, batch, active):
        if rows.stop == 1 and batch.tokens.size == 9 and stalled["passes"] < 2:  # 1 row, 9 tokens
            stalled["passes"] += 1
            time.sleep(0.05)
        return launch(rows, batch, active)

    monkeypatch.setattr(backend, "launch", stalls_at_one_point)
    prof = profile.measure(backend)
    assert stalled["passes"] == 2  # the point's first timing stalled
    prof.meta = {"conditions": {"other_processes_cpu_share": 0.0}}
    assert profile_problem(prof) is None, prof.seconds[0]
    j = prof.tokens.index(9)
    assert prof.seconds[0][j] < prof.seconds[0][j - 1] * 2 * 9 / 7 + 0.002


def test_the_rows_stopping_rule_reads_the_retimed_figure_not_the_stall(llama, profiles, monkeypatch):
    """The stopping rule at its real ratio (a row ends once a pass costs STOP_RATIO times its
    one-token pass): a point whose first timing stalled at 8x the row's first pass is timed again
    before the rule reads it, so the row goes on to its last point. Every pass is padded by a
    sleep that grows slowly with its tokens (the row's last point at ~1.7x its first), so that
    nothing but the staged stall could reach the ratio: the test that times the tiny model itself
    (above) has the rule off, since a real hiccup of its sub-millisecond passes can."""
    assert profile.STOP_RATIO < 8
    eng = engine(llama, speculate=False)
    backend, launch = eng.backend, eng.backend.launch
    stalled, seen = {"passes": 0}, set()

    def padded_with_one_stall(rows, batch, active):
        n_rows, per_row = rows.stop, batch.tokens.size // max(rows.stop, 1)
        seen.add((n_rows, per_row))
        time.sleep(0.02 + 0.0002 * per_row * n_rows)
        if (n_rows, per_row) == (1, 9) and stalled["passes"] < 2:
            stalled["passes"] += 1
            time.sleep(0.16)
        return launch(rows, batch, active)

    monkeypatch.setattr(backend, "launch", padded_with_one_stall)
    prof = profile.measure(backend)
    assert stalled["passes"] == 2  # the point's first timing stalled: both of its passes
    assert {(1, t) for t in profile.PROFILE_TOKENS if t <= 9} <= seen
    # the row went on past the stall, to the profile's last point
    assert (1, 13) in seen and (1, prof.tokens[-1]) in seen, sorted(seen)
    j = prof.tokens.index(9)
    assert prof.seconds[0][j] < 2 * prof.seconds[0][0], prof.seconds[0]


def test_the_prior_speculates_at_batch_one_and_not_at_large_batches(llama, profiles):
    eng = engine(llama, speculate=False)
    prior = profile.prior(eng.backend)
    assert prior.meta["prior"] and profile_problem(prior) is not None
    grid = np.array(prior.seconds)
    assert (np.diff(grid, axis=0) > 0).all() and (np.diff(grid, axis=1) > 0).all()
    planner = BudgetPlanner(fixed=None, mat={0: 1.0, 2: 1.6, 4: 1.9, 8: 2.1}, profile=prior, adaptive=False)
    assert planner.model_budget(1) > 0
    assert planner.model_budget(64) == 0


# -- competing processes and threads --------------------------------------------------------------


def test_a_neighbour_counts_as_competing_and_the_engines_own_child_does_not():
    spin = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])  # our own child: a pipeline stage, say
    # a neighbour: a process that is not ours (its parent shell exits, it is re-parented)
    out = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{spin}" >/dev/null 2>&1 & echo $!'], capture_output=True, text=True
    )
    pid = int(out.stdout.strip())
    try:
        before = competing_ticks()
        time.sleep(1.0)
        after = competing_ticks()
        assert child.pid not in after and pid in after
        assert after[pid] - before.get(pid, 0) >= 0.2 * os.sysconf("SC_CLK_TCK")  # it spun meanwhile
        # the neighbour's second alone is at least most of what competed meanwhile
        assert competing_seconds(before, after) >= competing_seconds({pid: before.get(pid, 0)}, {pid: after[pid]})
    finally:
        child.kill()
        child.wait()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_threads_drop_at_once_under_contention_and_come_back_after_quiet_samples():
    clock = [0.0]
    ticks = {"n": 0}
    hz = os.sysconf("SC_CLK_TCK")

    def sample():
        return {999: ticks["n"]}

    c = Contention(2, interval=1.0, recover=2, clock=lambda: clock[0], sample=sample)
    c.cores = 2

    def second(others: float):
        clock[0] += 1.0
        ticks["n"] += int(others * hz)
        return c.update()

    assert second(0.0) is None and c.current == 2 and not c.contended
    assert second(1.0) == 1 and c.current == 1 and c.contended  # a spinning neighbour: one thread
    assert second(1.0) is None
    assert second(0.0) is None and c.current == 1  # one quiet sample is not enough
    assert second(0.0) == 2 and c.current == 2
    clock[0] += 0.5
    assert c.update() is None  # within the interval: no sample


# -- measurements between requests ----------------------------------------------------------------


def test_an_engine_serves_at_once_and_adopts_its_measurements_between_requests(llama, profiles):
    t0 = time.monotonic()
    eng = engine(llama)
    assert eng.measurements is not None
    assert eng.backend.linear_plan is None and eng.backend.linear_plan_pending
    assert eng.planner.profile.meta.get("prior")
    assert not list(profiles.glob("*.json")) if profiles.exists() else True  # nothing measured yet
    params = SamplingParams(max_tokens=12, temperature=0.0)
    before = eng.generate(["w1 w2 w3 w1 w2"], params)[0].token_ids
    started = time.monotonic() - t0
    settle(eng)
    assert eng.measurements is None
    assert eng.backend.linear_plan is not None and not eng.backend.linear_plan_pending
    assert not eng.planner.profile.meta.get("prior")
    assert profile_problem(eng.planner.profile) is None
    # this engine's own files (another test's engine still measuring may write beside them)
    assert profile.profile_path(eng.backend)[0].is_file()
    assert linear_plan.plan_path(eng.backend.model, eng.backend._weights_identity())[0].is_file()
    # outputs stay plain decoding's (the layers changed kernels; greedy is still greedy)
    plain = engine(llama, speculate=False)
    assert (
        eng.generate(["w1 w2 w3 w1 w2"], params)[0].token_ids == plain.generate(["w1 w2 w3 w1 w2"], params)[0].token_ids
    )
    # the next engine finds both cached: nothing to measure
    again = engine(llama)
    assert again.measurements is None and again.backend.linear_plan is not None
    assert not again.planner.profile.meta.get("prior")
    assert len(before) == 12 and started < 60


def test_no_piece_is_taken_while_a_request_is_in_flight(llama, profiles):
    eng = engine(llama)
    eng.add_request("w1 w2 w3", SamplingParams(max_tokens=4, temperature=0.0))
    assert eng.idle(0.5) is False
    assert eng.measurements.seconds == 0.0


def test_a_measurement_beside_a_busy_process_is_dropped_retried_later_then_given_up(llama, profiles, monkeypatch):
    monkeypatch.setattr(profile, "_noisy_share", lambda: -1.0)  # every measurement looks busy
    monkeypatch.setattr(measurements, "GIVE_UP_AFTER", 0.0)
    lines: list[str] = []
    eng = engine(llama)
    clock = [0.0]
    jobs = measurements.BackgroundMeasurements(
        eng.backend, True, lambda p: pytest.fail("adopted"), log=lines.append, clock=lambda: clock[0]
    )
    plan = jobs.jobs[0]
    assert plan.name == "linear plan"
    for attempt in range(len(measurements.RETRY_AFTER)):
        assert jobs.run(0.1)
        assert plan.attempts == attempt + 1 and plan in jobs.jobs
        # nothing is due before the retry (the profile waits for the plan)
        assert jobs.due_in() == pytest.approx(measurements.RETRY_AFTER[attempt])
        assert jobs.run(0.1) and plan.attempts == attempt + 1  # not due yet: no new attempt
        assert all(j.attempts == 0 for j in jobs.jobs[1:])  # the profile waits for the layers it measures
        clock[0] += measurements.RETRY_AFTER[attempt] + 0.1
    assert jobs.run(0.1)
    assert plan not in jobs.jobs and "linear plan" in jobs.abandoned
    assert sum("gave up measuring the linear plan" in line for line in lines) == 1
    assert sum("dropped the linear plan" in line for line in lines) == len(measurements.RETRY_AFTER)
    assert not list(profiles.glob("linear-*.json")) if profiles.exists() else True
    assert eng.backend.linear_plan is None  # torch's layers, never a garbage plan


def test_a_busy_machine_takes_no_piece(llama, profiles):
    eng = engine(llama)
    jobs = measurements.BackgroundMeasurements(eng.backend, True, lambda p: None, quiet=lambda: False)
    assert jobs.run(0.2) and jobs.seconds == 0.0 and all(j.attempts == 0 for j in jobs.jobs)


@pytest.mark.parametrize("damage", ["truncated", "other torch", "garbage numbers"])
def test_a_bad_cached_profile_is_ignored_with_one_line_and_measured_again(llama, profiles, damage, capsys):
    eng = engine(llama)
    settle(eng)
    path = profile.profile_path(eng.backend)[0]  # its own (another engine may write beside it)
    text = path.read_text()
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "other torch":  # another torch is another identity: another file, never this one
        d = json.loads(text)
        d["meta"]["identity"]["torch"] = "0.0.1"
        path.rename(path.with_name("forward-0000000000000000.json"))
        path.with_name("forward-0000000000000000.json").write_text(json.dumps(d))
    else:
        d = json.loads(text)
        d["seconds"][1][0] = d["seconds"][0][0] * 50
        path.write_text(json.dumps(d))
    capsys.readouterr()
    again = engine(llama)
    err = capsys.readouterr().err
    assert again.planner.profile.meta.get("prior")
    if damage != "other torch":
        assert err.count("ignoring the cached forward profile") == 1, err
    settle(again)
    assert profile_problem(again.planner.profile) is None


def test_sssd_llm_measures_on_its_own_thread_between_generate_calls(llama, profiles):
    from sssd.serving.frontends.llm import LLM

    llm = LLM(llama, datastore=None, max_running=4, max_model_len=256)
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0)
        first = llm.generate("w1 w2 w3", params)[0].token_ids
        t0 = time.monotonic()
        while llm.engine.measurements is not None and time.monotonic() - t0 < 120:
            time.sleep(0.2)
        assert llm.engine.measurements is None
        assert llm.engine.backend.linear_plan is not None
        assert len(llm.generate("w1 w2 w3", params)[0].token_ids) == len(first) == 8
    finally:
        llm.close()


def test_a_dropped_sssd_llm_stops_measuring_and_is_freed(llama, profiles):
    import gc

    from sssd.serving.frontends.llm import LLM

    llm = LLM(llama, datastore=None, max_running=4, max_model_len=256)
    thread, gone = llm._measurer, weakref.ref(llm)
    assert thread is not None and thread.is_alive()
    del llm
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive() and gone() is None


def test_conditions_count_only_the_time_inside_the_pieces():
    cond = Conditions()
    with cond.piece():
        time.sleep(0.05)
    time.sleep(0.2)  # between pieces: not measured
    with cond.piece():
        time.sleep(0.05)
    assert 0.09 < cond.elapsed < 0.2
    assert cond.record["seconds"] == round(cond.elapsed, 2)


def test_a_busy_remeasurement_keeps_the_last_trusted_profile(llama, profiles, monkeypatch):
    eng = engine(llama)
    settle(eng)
    trusted = eng.planner.profile
    # every new profile measurement is taken beside a busy process (the cached one stays trusted)
    monkeypatch.setattr(profile, "finish", lambda *a: "other processes used 90% of the CPU while it was measured")
    now = engine(llama, measure="now", reprofile=True)
    assert now.planner.profile.seconds == trusted.seconds  # not the busy one, not the prior
    later = engine(llama, reprofile=True)  # background: the trusted one until the new one is in
    assert later.planner.profile.seconds == trusted.seconds
    assert later.measurements is not None and later.measurements.status()["pending"] == ["forward profile"]
