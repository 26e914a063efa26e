"""The batch-wide allocation projected from replayed steps (`sssd plan --groundtruth`):
calibration/allocation_replay.py's steps and serving/planning/projection.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from test_planner import linear_profile

import sssd
from sssd.calibration.allocation_replay import ReplaySteps, replay_steps
from sssd.calibration.replay import Example
from sssd.serving.planning.projection import fitted_gamma, project


def chain_steps(n_steps: int, accept: bool, length: int = 8) -> ReplaySteps:
    steps = ReplaySteps()
    for _ in range(n_steps):
        steps.scores.append(np.linspace(0.9, 0.3, length))
        steps.parents.append(np.arange(length) - 1)
        steps.accepted.append(np.arange(length + 1) if accept else np.zeros(length + 1, np.int64))
    return steps


def test_a_projection_spends_where_drafts_are_accepted_and_nothing_where_none_are():
    cheap = linear_profile(0.05, 0.0002)
    good = project(chain_steps(50, True), cheap, [1, 16], draws=50)
    bad = project(chain_steps(50, False), cheap, [1, 16], draws=50)
    assert all(r["speedup"] > 1.5 and r["nodes_per_row"] > 1 for r in good)
    assert good[0]["gamma"] < 1 < bad[0]["gamma"]
    assert all(r["nodes_per_row"] == 0 and r["speedup"] == 1.0 for r in bad)
    # beside it, the best single budget on the same steps: never above the allocation by more than the draws' noise
    assert all(r["per_size_speedup"] <= r["speedup"] * 1.05 for r in good)
    assert all(r["per_size_budget"] == 0 and r["per_size_speedup"] == 1.0 for r in bad)
    with pytest.raises(ValueError, match="no replayed steps"):
        project(ReplaySteps(), cheap, [1])


def test_the_projection_corrects_the_selected_nodes_worth_as_the_engine_does():
    """Trees whose high scores fail and whose low ones hold: fitted over whole trees the scores are
    right on average, but a selection takes the high ones, which emit less than they promise (the
    winner's curse). The projection settles at the engine's correction for it; trees scored right
    at every level need none."""
    cheap = linear_profile(0.05, 0.001)
    mixed = chain_steps(40, False)
    low = chain_steps(40, True)
    for s in low.scores:
        s[:] = np.linspace(0.4, 0.2, s.size)
    mixed.scores += low.scores
    mixed.parents += low.parents
    mixed.accepted += low.accepted
    for cursed in project(mixed, cheap, [1, 4], draws=50):
        assert 0.5 <= cursed["worth_correction"] < 0.85 and cursed["speedup"] > 2
    (fair,) = project(chain_steps(50, True), cheap, [16], draws=50)
    assert fair["worth_correction"] == pytest.approx(1.0, abs=0.25)


def test_replayed_steps_know_what_each_prefix_of_a_tree_would_accept():
    rng = np.random.default_rng(0)
    phrase = rng.integers(100, 900, 40).tolist()
    ex = Example(np.array(phrase * 2, np.int64), np.array(phrase[:30], np.int64))  # the answer copies
    steps = replay_steps(sssd.Drafter(None, budget=64), [ex], budget=64, stride=5)
    assert len(steps) == 6
    decoded = replay_steps(sssd.Drafter(None, budget=64), [ex], budget=64)  # steps as decoding takes them
    assert 1 <= len(decoded) < 29 and sum(int(a[-1]) + 1 for a in decoded.accepted) >= 29
    for s, p, acc in zip(steps.scores, steps.parents, steps.accepted):
        assert acc.size == s.size + 1 and acc[0] == 0 and np.all(np.diff(acc) >= 0)
        assert np.all(p < np.arange(p.size))  # parents first
    assert max(int(a[-1]) for a in steps.accepted) >= 10  # the copy is followed deep
    assert fitted_gamma(steps) < 1.5


def test_sssd_plan_prints_the_allocation_beside_the_budget_per_batch_size(tmp_path):
    gt = tmp_path / "gt.jsonl"
    synthetic_groundtruth(gt, 3)
    cmd = [
        sys.executable,
        "-m",
        "sssd.cli",
        "plan",
        "--hardware",
        "h200",
        "--groundtruth",
        str(gt),
        "--datastore",
        "none",
    ]
    r = subprocess.run([*cmd, "--batch-sizes", "1", "64", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["allocation_replayed_from"]["steps"] > 0
    assert [row["allocation"]["batch"] for row in out["projection"]] == [1, 64]
    assert all(row["allocation"]["speedup"] >= 1.0 for row in out["projection"])
    r = subprocess.run([*cmd, "--batch-sizes", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "alloc speedup" in r.stdout
    r = subprocess.run([*cmd[:-4], "--groundtruth", str(tmp_path / "missing.jsonl")], capture_output=True, text=True)
    assert r.returncode != 0 and "no such file" in r.stderr


def synthetic_groundtruth(path, n: int = 4) -> list[list[int]]:
    """A ground-truth file whose answers copy their prompt: n records, outputs 30 tokens each."""
    phrase = np.random.default_rng(1).integers(100, 900, 40).tolist()
    header = {"format": "sssd-groundtruth", "version": 1, "dataset": "synthetic", "tokenizer": {}}
    outputs = [phrase[i : i + 30] for i in range(n)]
    records = [
        {"id": str(i), "prompt_ids": phrase * 2, "output_ids": out, "finish": "length"} for i, out in enumerate(outputs)
    ]
    path.write_text("\n".join(json.dumps(x) for x in [header, *records]) + "\n")
    return outputs


def test_replay_groundtruth_takes_the_first_or_last_examples_cut_where_asked(tmp_path):
    from sssd.calibration.allocation_replay import replay_groundtruth

    outputs = synthetic_groundtruth(tmp_path / "gt.jsonl")
    drafter = sssd.Drafter(None, budget=64)

    first = replay_groundtruth(drafter, [tmp_path / "gt.jsonl"], limit=1)  # one example, its copy followed deep
    assert sum(int(a[-1]) + 1 for a in first.accepted) >= len(outputs[0]) - 1
    assert max(int(a[-1]) for a in first.accepted) >= 10
    # the last example of each of two files, cut at 10 tokens: no step accepts past the cut
    cut = replay_groundtruth(drafter, [tmp_path / "gt.jsonl"] * 2, limit=1, last=True, max_tokens=10)
    assert len(cut) >= 2 and max(int(a[-1]) for a in cut.accepted) <= 9
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        replay_groundtruth(drafter, [tmp_path / "gt.jsonl", tmp_path / "missing.jsonl"], limit=1)
    with pytest.raises(ValueError, match="limit"):
        replay_groundtruth(drafter, [tmp_path / "gt.jsonl"], limit=0)
