"""Calibration: isotonic fitting, curves in the merge, the parameter file, the grid."""

import json

import numpy as np
import pytest
from conftest import random_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

import sssd
from sssd import _core
from sssd.calibration.fit import MATCH_BINS, apply_calibration, fit_calibration, reliability
from sssd.calibration.grid import GridAxes, Trial, evaluate
from sssd.calibration.isotonic import isotonic_fit
from sssd.calibration.replay import Example


def brute_isotonic(y, w):
    """Exact isotonic regression by the min-max formula (O(n^3)), at each point."""
    n = len(y)
    out = np.empty(n)
    for i in range(n):
        out[i] = max(
            min(np.dot(w[j : k + 1], y[j : k + 1]) / w[j : k + 1].sum() for k in range(i, n)) for j in range(i + 1)
        )
    return out


@settings(max_examples=150, deadline=None)
@given(ys=st.lists(st.floats(0, 1), min_size=1, max_size=12), ws=st.lists(st.floats(0.1, 5), min_size=12, max_size=12))
def test_isotonic_matches_brute_force(ys, ws):
    x = np.arange(len(ys), dtype=float)
    y, w = np.array(ys), np.array(ws[: len(ys)])
    knots, values = isotonic_fit(x, y, w, max_knots=1000)
    assert np.all(np.diff(knots) > 0) and np.all(np.diff(values) >= -1e-12)
    want = brute_isotonic(y, w)
    # Each fitted block is one knot at its mean x: every point of a block gets the block value.
    got = np.array([values[np.argmin(np.abs(knots - xi))] if len(knots) == len(x) else np.nan for xi in x])
    if len(knots) == len(x):
        np.testing.assert_allclose(got, want, atol=1e-9)
    # The weighted mean is preserved whatever the pooling.
    assert np.isclose(np.dot(w, want), np.dot(w, y))


def test_isotonic_knot_budget_keeps_monotonicity():
    rng = np.random.default_rng(0)
    x = rng.random(5000)
    y = (rng.random(5000) < x**2).astype(float)
    knots, values = isotonic_fit(x, y, max_knots=10)
    assert len(knots) <= 10 and np.all(np.diff(values) >= 0) and np.all(np.diff(knots) > 0)
    assert abs(np.interp(0.8, knots, values) - 0.64) < 0.1


def synthetic_nodes(rng, n=20_000):
    """Observations where the input source is overconfident: accepted with prob/2."""
    src = rng.integers(0, 2, n)
    prob = rng.random(n)
    true = np.where(src == 1, prob / 2, prob)
    return {
        "source": src.astype(np.uint8),
        "depth": rng.integers(1, 5, n).astype(np.int32),
        "match_len": rng.integers(1, 5, n).astype(np.uint8),
        "prob": prob.astype(np.float32),
        "accepted": rng.random(n) < true,
    }


def test_fit_learns_each_sources_reliability():
    rng = np.random.default_rng(1)
    nodes = synthetic_nodes(rng)
    cal = fit_calibration(nodes, min_cell=2000)
    calibrated = apply_calibration(cal, nodes)
    for s, factor in ((0, 1.0), (1, 0.5)):
        sel = (nodes["source"] == s) & (np.abs(nodes["prob"] - 0.8) < 0.05)
        assert abs(calibrated[sel].mean() - 0.8 * factor) < 0.06
    # Every curve is monotone, so calibration preserves each source's ranking.
    for _, _, _, _x, y in cal.curves:
        assert np.all(np.diff(y) >= 0)
    after = {r.source: r for r in reliability({**nodes, "prob": calibrated.astype(np.float32)})}
    before = {r.source: r for r in reliability(nodes)}
    gap = lambda r: np.average(np.abs(r.predicted - r.observed), weights=r.count)  # noqa: E731
    assert gap(after["input"]) < 0.05 < gap(before["input"])


def test_fit_refuses_no_data():
    with pytest.raises(ValueError, match="no drafted nodes"):
        fit_calibration({"prob": np.zeros(0)})


def test_curves_change_the_merge_as_the_calibration_says():
    """A curve that halves the input source's probabilities halves its scores."""
    ctx = [10, 11, 12, 13, 1, 2, 10, 11, 12]
    plain = sssd.Drafter(None, budget=4).draft_prefix(ctx)
    half = sssd.Calibration(MATCH_BINS, (1,), tuple((1, m, 0, (0.0, 1.0), (0.0, 0.5)) for m in range(len(MATCH_BINS))))
    cfg = sssd.DrafterConfig(budget=4, discounts=sssd.DiscountParams(calibration=half))
    cal = sssd.Drafter(None, cfg).draft_prefix(ctx)
    assert cal.tokens.tolist() == plain.tokens.tolist()
    np.testing.assert_allclose(cal.scores, plain.probs * 0.5, rtol=1e-6)


def test_score_table_curves_are_validated():
    with pytest.raises(ValueError, match="non-decreasing"):
        _core.ScoreTable(0, 1, np.ones(6), np.zeros(6, np.int32), [(np.array([0.0, 1.0]), np.array([0.5, 0.1]))])
    with pytest.raises(ValueError, match="out of range"):
        _core.ScoreTable(0, 1, np.ones(6), np.full(6, 3, np.int32), [(np.array([0.0]), np.array([0.5]))])


def parameter_file(tmp_path, calibrated=True):
    cal = sssd.Calibration((0,), (1,), ((1, 0, 0, (0.0, 1.0), (0.0, 0.25)),))
    d = {
        "format": "sssd-calibration",
        "version": 1,
        "default_budget": 16,
        "budgets": {
            "8": {"config": sssd.DrafterConfig(max_samples=40).to_dict(), "calibrated": False},
            "16": {"config": sssd.DrafterConfig(max_samples=60, min_occurrences=7).to_dict(), "calibrated": calibrated},
        },
        "calibration": cal.to_dict(),
    }
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(d))
    return p


def test_parameter_file_round_trip_and_budget_choice(tmp_path):
    p = parameter_file(tmp_path)
    c16 = sssd.DrafterConfig.load(p)  # default budget 16
    assert (c16.budget, c16.max_samples, c16.min_occurrences) == (16, 60, 7)
    assert c16.discounts.calibration is not None
    c8 = sssd.DrafterConfig.load(p, budget=12)  # largest calibrated budget <= 12
    assert (c8.budget, c8.max_samples) == (12, 40) and c8.discounts.calibration is None
    assert sssd.DrafterConfig.load(p, budget=4).max_samples == 40  # below all: the smallest
    assert sssd.DrafterConfig.load(p, budget=64).max_samples == 60
    # the loaded curves reach the drafter
    ctx = [10, 11, 12, 13, 1, 2, 10, 11, 12]
    tree = sssd.Drafter(None, c16).draft_prefix(ctx)
    np.testing.assert_allclose(tree.scores, tree.probs * 0.25, rtol=1e-6)
    # and a plain saved config still loads
    c16.save(tmp_path / "plain.json")
    assert sssd.DrafterConfig.load(tmp_path / "plain.json") == c16


def test_bad_parameter_files(tmp_path):
    p = parameter_file(tmp_path)
    d = json.loads(p.read_text())
    d["version"] = 99
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="version"):
        sssd.DrafterConfig.load(p)
    p.write_text("{oops")
    with pytest.raises(ValueError, match="cannot read"):
        sssd.DrafterConfig.load(p)
    d["version"], d["budgets"] = 1, {}
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="no budgets"):
        sssd.DrafterConfig.load(p)


def test_empty_grid_axis_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        GridAxes(max_samples=())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    rng = np.random.default_rng(3)
    tokens = random_corpus(rng, 150, vocab=15, repeat=0.5)
    path = tmp_path_factory.mktemp("cal") / "ds"
    sssd.Datastore.build(tokens, path)
    docs = [d for d in np.split(tokens, np.flatnonzero(tokens == sssd.SEPARATOR) + 1) if len(d) > 10]
    return path, [Example(d[:5].astype(np.int64), d[5:-1].astype(np.int64)) for d in docs[:20]]


def test_grid_evaluation_is_the_same_in_worker_processes(tiny):
    path, examples = tiny
    configs = [sssd.DrafterConfig(max_samples=m) for m in (4, 50)]
    one = evaluate([Trial(c, 8) for c in configs], examples, path, workers=1)
    two = evaluate([Trial(c, 8) for c in configs], examples, path, workers=2)
    assert [t.mat for t in one] == [t.mat for t in two]
    assert all(t.mat >= 1.0 for t in one)
    with pytest.raises(ValueError, match="no examples"):
        evaluate([Trial(configs[0], 8)], [], path, workers=1)


def test_packaged_calibration_is_a_valid_file_for_its_fingerprint_only():
    from sssd.paths import packaged_calibration, packaged_calibration_file

    path = packaged_calibration_file()
    assert path.is_file() and path.name == "calibration-smollm2.json"
    # which datastores and models it fits: tests/test_calibration_file.py
    assert packaged_calibration("qwen2.5-coder-0.5b-instruct") is None
    assert packaged_calibration("smollm2-135m-instruct", datastore="/my/own/store") is None
    data = json.loads(path.read_text())
    assert data["format"] == "sssd-calibration" and set(data["budgets"]) == {"4", "8", "16", "32", "64"}
    mats = [data["budgets"][b]["mat"] for b in ("4", "8", "16", "32", "64")]
    assert mats == sorted(mats) and mats[0] > 1  # more budget, more accepted tokens
    for b in (4, 32):
        cfg = sssd.DrafterConfig.load(path, budget=b)
        entry = data["budgets"][str(b)]
        assert cfg.budget == b and cfg.max_samples == entry["config"]["max_samples"]
        assert (cfg.discounts.calibration is not None) == entry["calibrated"]


def test_provenance_names_no_machine_directories(tmp_path, monkeypatch):
    from sssd.paths import packaged_calibration_file, portable

    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    got = portable({"a": [str(tmp_path / "cache" / "models" / "m")], "b": "/elsewhere/x", "c": 3})
    assert got == {"a": ["<sssd cache>/models/m"], "b": "/elsewhere/x", "c": 3}

    def paths(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from ([v] if k in ("path", "spec") and isinstance(v, str) else paths(v))
        elif isinstance(obj, list):
            for v in obj:
                yield from paths(v)

    data = json.loads(packaged_calibration_file().read_text())
    found = list(paths({"datastore": data["datastore"], "groundtruth": data["groundtruth"]}))
    assert found and not any(p.startswith("/") for p in found), found


# -- the files calibration reads: never blocked on, never followed out of a datastore --------


def test_ground_truth_and_prompt_files_refuse_fifos_without_blocking(tmp_path):
    import os
    import subprocess
    import sys

    os.mkfifo(tmp_path / "gt.jsonl")
    code = (
        "import sys\nfrom sssd.calibration import datasets, ground_truth\n"
        "for load in (ground_truth.load_groundtruth, datasets.from_jsonl):\n"
        "    try:\n        load(sys.argv[1])\n    except OSError as e:\n        print(e)\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "gt.jsonl")], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("reading a FIFO as ground truth blocked")
    assert proc.stdout.splitlines() == [f"{tmp_path / 'gt.jsonl'}: it is a FIFO, not a regular file"] * 2, proc.stderr


def test_ground_truth_and_prompt_files_that_are_not_text(tmp_path):
    from sssd.calibration import datasets, ground_truth

    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00 binary\n")
    with pytest.raises(ValueError, match=r"bin.jsonl is not an sssd-groundtruth file \(not UTF-8 text near byte 0\)"):
        ground_truth.load_groundtruth(tmp_path / "bin.jsonl")
    with pytest.raises(ValueError, match=r"bin.jsonl: not UTF-8 text near byte 0"):
        datasets.from_jsonl(tmp_path / "bin.jsonl")
    (tmp_path / "partial.jsonl").write_text('{"format": "sssd-groundtruth"')  # no newline: nothing complete
    with pytest.raises(ValueError, match="partial.jsonl has no complete line"):
        ground_truth.load_groundtruth(tmp_path / "partial.jsonl")
    # An editor's byte-order mark is not part of the first line.
    (tmp_path / "p.jsonl").write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "hi"}\n')
    assert [r.id for r in datasets.from_jsonl(tmp_path / "p.jsonl")] == ["a"]


def test_a_heldout_file_linked_out_of_the_datastore_is_refused(tmp_path):
    from sssd.calibration.datasets import heldout_file

    sssd.Datastore.build(
        np.array([1, 2, sssd.SEPARATOR], dtype=np.uint32),
        tmp_path / "ds",
        metadata={"holdout": {"file": "heldout.jsonl", "every": 50, "count": 1}},
    )
    (tmp_path / "elsewhere.jsonl").write_text('{"index": 0, "turns": []}\n')
    (tmp_path / "ds" / "heldout.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(FileNotFoundError, match="symbolic link to .*elsewhere.jsonl, outside the folder"):
        heldout_file(tmp_path / "ds")
    m = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    m["holdout"]["file"] = "../elsewhere.jsonl"
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FileNotFoundError, match="not a plain file name inside the datastore folder"):
        heldout_file(tmp_path / "ds")


def test_grid_ties_keep_the_defaults():
    from sssd.calibration.grid import TIE, SearchResult, changes_from

    base = sssd.DrafterConfig()
    off = base.replace(datastore_branch_per_match=0.0)  # adaptive depth off: one parameter changed
    two = off.replace(max_samples=base.max_samples + 1)
    assert changes_from(base, base) == 0 and changes_from(off, base) == 1 and changes_from(two, base) == 2
    # listed first and equal (or within TIE): the defaults still win
    result = SearchResult([Trial(two, 16, mat=3.0), Trial(off, 16, mat=3.0), Trial(base, 16, mat=3.0 * (1 - TIE / 2))])
    assert result.best(16).config == base
    # better by more than TIE: the change is taken, the fewest changes first among the tied
    result = SearchResult([Trial(two, 16, mat=3.1), Trial(off, 16, mat=3.1), Trial(base, 16, mat=3.0)])
    assert result.best(16).config == off
    with pytest.raises(KeyError):
        result.best(8)
