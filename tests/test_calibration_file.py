"""Calibration files as the engine uses them: every budget's entry drafts the steps of its
budget, the fingerprint ties a file to its datastore, tokenizer and model, and bad files
never crash and never silently apply."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from conftest import random_corpus

import sssd
import sssd.models
from sssd.calibration_file import CalibrationFile, Fingerprint, load_drafter, model_fingerprint
from sssd.sources import DraftPipeline, DraftRequest, RetrievalSource

# A context whose every suffix recurs in the datastore below and in the request itself.
PHRASE = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(11)
    tokens = random_corpus(rng, 60, vocab=40, repeat=0.4).astype(np.int64)
    tokens = np.concatenate([tokens] + [np.array(PHRASE + [sssd.SEPARATOR])] * 5)
    path = tmp_path_factory.mktemp("calfile") / "ds"
    sssd.Datastore.build(tokens, path)
    return sssd.Datastore.open(path)


@pytest.fixture()
def model_dir(tmp_path):
    """A model folder as far as identities go: a config.json, no weights."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "vocab_size": 100}')
    return folder


def calibration_dict(
    entries: dict[int, sssd.DrafterConfig], fingerprint: Fingerprint | None = None, calibrated: bool = False
) -> dict:
    cal = sssd.Calibration((0,), (1,), ((1, 0, 0, (0.0, 1.0), (0.0, 0.25)),))
    return {
        "format": "sssd-calibration",
        "version": 1,
        "default_budget": max(entries),
        "budgets": {
            str(b): {"config": c.to_dict(), "calibrated": calibrated, "mat": 1.5 + 0.1 * i}
            for i, (b, c) in enumerate(entries.items())
        },
        "calibration": cal.to_dict(),
        "fingerprint": fingerprint.to_dict() if fingerprint else None,
    }


def write(tmp_path, d: dict, name: str = "cal.json"):
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


# -- per-budget entries ---------------------------------------------------------------------


def test_each_budget_takes_the_largest_calibrated_budget_not_above_it(tmp_path):
    p = write(tmp_path, calibration_dict({b: sssd.DrafterConfig(max_samples=b + 1) for b in (4, 8, 32)}))
    cal = CalibrationFile.load(p)
    assert list(cal.entries) == [4, 8, 32] and cal.default_budget == 32
    expect = {1: 4, 3: 4, 4: 4, 7: 4, 8: 8, 31: 8, 32: 32, 200: 32}  # below all: the smallest
    for budget, entry in expect.items():
        cfg = cal.config(budget)
        assert cal.entry_budget(budget) == entry and cfg.budget == budget and cfg.max_samples == entry + 1
        assert sssd.DrafterConfig.load(p, budget) == cfg  # the old one-entry API agrees
    assert sssd.DrafterConfig.load(p) == cal.config(32)


def test_the_pipeline_drafts_each_step_with_the_entry_of_its_budget(store):
    # Entry 4 drafts from the request's own n-grams only (no copy source), entry 16 from the datastore
    # only: a tree's sources show which entry drafted it. Their input depths differ (6+3 vs 2+12).
    entries = {
        4: sssd.DrafterConfig(use_datastore=False, input_max_match=6, input_branch_len=3, copy_max_branch_len=0),
        16: sssd.DrafterConfig(use_input=False, input_max_match=2, input_branch_len=12),
    }
    cal = CalibrationFile.from_dict(calibration_dict(entries))
    pipe = DraftPipeline([RetrievalSource(store, None)], cal, vocab_size=100)
    context = np.array(PHRASE * 3, dtype=np.int64)
    for rid in (1, 2):
        pipe.open(rid, context)

    def sources(budgets):
        batch = pipe.draft([DraftRequest(rid, context, b) for rid, b in zip((1, 2), budgets)])
        return [set(tree.sources.tolist()) for tree in batch], batch

    assert sources((4, 4))[0] == [{1}, {1}]  # input only
    assert sources((16, 16))[0] == [{0}, {0}]  # datastore only
    assert sources((64, 2))[0] == [{0}, {1}]  # above all: the largest; below all: the smallest
    mixed, batch = sources((5, 20))  # one batch, two entries: drafted per entry, kept in order
    assert mixed == [{1}, {0}] and batch.sizes.tolist()[0] <= 5 and batch.sizes.tolist()[1] <= 20
    alone = [pipe.draft([DraftRequest(rid, context, b)])[0] for rid, b in ((1, 5), (2, 20))]
    for got, want in zip(batch, alone):
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.parents, want.parents)
    assert sources((0, 4))[0] == [set(), {1}]  # budget 0: no draft
    base = pipe.drafter.config  # request tries deep enough for both entries
    assert (base.input_max_match, base.input_branch_len) == (6, 12)


def test_the_planner_estimates_mat_from_the_entries_the_engine_drafts_with(tmp_path):
    from sssd.serving.planning.planner import DEFAULT_MAT, mat_from_calibration

    cal = CalibrationFile.from_dict(calibration_dict({4: sssd.DrafterConfig(), 16: sssd.DrafterConfig()}))
    assert mat_from_calibration(cal) == {0: 1.0, 4: 1.5, 16: 1.6}
    assert mat_from_calibration(write(tmp_path, calibration_dict({4: sssd.DrafterConfig()}))) == {0: 1.0, 4: 1.5}
    assert mat_from_calibration(sssd.DrafterConfig()) == DEFAULT_MAT  # the uncalibrated defaults
    assert mat_from_calibration(None) == DEFAULT_MAT


# -- the fingerprint -------------------------------------------------------------------------


def test_fingerprint_match_mismatch_and_missing(tmp_path, store, model_dir, caplog):
    fp = Fingerprint.of(store, model_dir)
    assert fp.datastore == store.manifest["fingerprint"] and fp.model.startswith("sha256:")
    assert fp.model_name == "my-model"
    entries = {8: sssd.DrafterConfig(max_samples=9)}
    cal = CalibrationFile.load(write(tmp_path, calibration_dict(entries, fp)))
    assert cal.check(store, model_dir) == []
    with caplog.at_level(logging.WARNING, "sssd.calibration"):
        assert cal.checked_or_defaults(store, model_dir) is cal
    assert not caplog.records

    # another datastore, and another model (its config changed)
    other = sssd.Datastore.build(np.array([1, 2, 3, sssd.SEPARATOR]), tmp_path / "other")
    other = sssd.Datastore.open(tmp_path / "other")
    (model_dir / "config.json").write_text('{"model_type": "llama", "vocab_size": 101}')
    problems = cal.check(other, model_dir)
    assert len(problems) == 2 and problems[0].startswith("datastore fingerprint") and "model my-model" in problems[1]
    assert cal.check(None, model_dir)[0].startswith("datastore fingerprint none")
    with caplog.at_level(logging.WARNING, "sssd.calibration"):
        assert cal.checked_or_defaults(other, model_dir) == sssd.DrafterConfig()
    assert "datastore fingerprint" in caplog.text and "uncalibrated defaults" in caplog.text

    # a tokenizer the datastore does not record and the model folder lacks: unknown, so it differs
    odd = CalibrationFile.from_dict(calibration_dict(entries, Fingerprint(tokenizer="ab" * 32)))
    assert odd.check(store, model_dir) == [f"tokenizer sha256 unknown (calibrated for {'ab' * 6})"]

    # no fingerprint (older files): used, with a warning that it cannot be checked
    old = CalibrationFile.load(write(tmp_path, calibration_dict(entries), "old.json"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "sssd.calibration"):
        assert old.checked_or_defaults(other, model_dir) is old
    assert "records no fingerprint" in caplog.text


def test_a_pulled_model_is_named_by_its_gguf_before_and_after_pulling(tmp_path):
    spec = sssd.models.get_spec("smollm2-135m-instruct")
    folder = tmp_path / "copy"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # another transformers' config.json: the same weights
    (folder / "sssd-model.json").write_text(json.dumps({"name": spec.name, "gguf_sha256": spec.sha256}))
    assert model_fingerprint(folder) == (spec.name, f"gguf:{spec.sha256}")
    assert model_fingerprint("smollm2")[1] == f"gguf:{spec.sha256}"  # a registered name, pulled or not
    assert model_fingerprint(tmp_path / "nothing") == (None, None)


def test_the_packaged_calibration_applies_wherever_its_fingerprint_matches(tmp_path, store, model_dir, monkeypatch):
    import sssd.paths as paths

    fp = Fingerprint.of(store, model_dir)
    mine = write(tmp_path, calibration_dict({8: sssd.DrafterConfig()}, fp), "packaged.json")
    monkeypatch.setattr(paths, "packaged_calibration_file", lambda: mine)
    assert paths.packaged_calibration(model_dir, store.path) == mine  # any name or path: the content decides
    assert paths.packaged_calibration(model_dir, store) == mine
    assert paths.packaged_calibration(model_dir, None) is None
    assert paths.packaged_calibration(model_dir, tmp_path / "no-such-store") is None
    assert paths.packaged_calibration("qwen2.5-coder-0.5b-instruct", store.path) is None


def test_the_packaged_file_matches_the_default_datastore_and_model():
    from sssd.datastore import built_default_path
    from sssd.paths import packaged_calibration, packaged_calibration_file

    cal = CalibrationFile.load(packaged_calibration_file())
    assert cal.fingerprint is not None and cal.fingerprint.model == f"gguf:{sssd.models.get_spec('smollm2').sha256}"
    data = json.loads(packaged_calibration_file().read_text())
    assert cal.fingerprint.datastore == data["datastore"]["fingerprint"]  # what the run recorded as provenance
    assert cal.fingerprint.tokenizer == data["datastore"]["tokenizer"]["sha256"]
    try:
        built_default_path()
    except FileNotFoundError:
        pytest.skip("the default datastore is not built (sssd build --default)")
    assert cal.check("default", "smollm2-135m-instruct") == []
    assert packaged_calibration("smollm2-135m-instruct", "default") == packaged_calibration_file()
    assert packaged_calibration("qwen2.5-coder-0.5b-instruct", "default") is None


# -- bad files -----------------------------------------------------------------------------

BAD = {
    "truncated": lambda good: good[: len(good) // 2],
    "not JSON": lambda good: "\x00\x01garbage",
    "a list": lambda good: "[1, 2]",
    "another version": lambda good: good.replace('"version": 1', '"version": 2'),
    "a version string": lambda good: good.replace('"version": 1', '"version": "1"'),
    "another format": lambda good: good.replace('"sssd-calibration"', '"sssd-datastore"'),
    "no budgets": lambda good: json.dumps({**json.loads(good), "budgets": {}}),
    "budgets not an object": lambda good: json.dumps({**json.loads(good), "budgets": [4]}),
    "a budget that is no number": lambda good: good.replace('"8":', '"eight":'),
    "a budget of 0": lambda good: good.replace('"8":', '"0":'),
    "an entry without config": lambda good: json.dumps({**json.loads(good), "budgets": {"8": {"mat": 2}}}),
    "an unknown config field": lambda good: good.replace('"max_samples"', '"max_sample"'),
    "a config field of a wrong type": lambda good: good.replace('"max_samples": 100', '"max_samples": "many"'),
    "a mat that is no number": lambda good: good.replace('"mat": 1.5', '"mat": "high"'),
    "calibrated without curves": lambda good: json.dumps({**json.loads(good), "calibration": None}),
    "malformed curves": lambda good: json.dumps({**json.loads(good), "calibration": {"curves": 3}}),
    "a fingerprint that is a list": lambda good: json.dumps({**json.loads(good), "fingerprint": ["x"]}),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_files_raise_a_clear_value_error_where_they_are_named(tmp_path, kind):
    from sssd.serving.planning.planner import mat_from_calibration

    good = json.dumps(calibration_dict({8: sssd.DrafterConfig()}, Fingerprint(datastore="0" * 16), calibrated=True))
    p = tmp_path / "bad.json"
    p.write_text(BAD[kind](good))
    for load in (CalibrationFile.load, load_drafter, sssd.DrafterConfig.load, mat_from_calibration):
        if kind == "another format" and load in (load_drafter, sssd.DrafterConfig.load):
            with pytest.raises(ValueError, match="not a drafter config"):
                load(p)
            continue
        with pytest.raises(ValueError) as e:
            load(p)
        assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_sssd_serve_refuses_a_bad_drafter_file_in_one_line(tmp_path, capsys, monkeypatch):
    from sssd.cli import main

    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    p = tmp_path / "cal.json"
    p.write_text('{"format": "sssd-calibration", "version": 1, "budgets": {"8": {"con')
    code = main(["serve", "--drafter", str(p), "--port", "1"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert err.count(str(p)) == 1 and "--drafter" in err and "truncated" in err


# -- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tiny_models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("calfile-model") / "llama", "llama")


def test_the_engine_uses_a_matching_file_per_budget_and_the_defaults_for_another_setup(
    tmp_path, store, llama, caplog, monkeypatch
):
    from sssd.serving.engine import EngineConfig, LLMEngine
    from sssd.serving.planning.planner import DEFAULT_MAT
    from sssd.serving.planning.profile import ForwardProfile

    flat = ForwardProfile([1, 64], [1, 65], [[0.01, 0.02], [0.02, 0.04]], context=256)
    from sssd.serving.backends.torch_backend import TorchBackend

    monkeypatch.setattr(
        TorchBackend, "profile", lambda self, log=None, force=False: flat
    )  # the planner's, not measured
    entries = {4: sssd.DrafterConfig(use_datastore=False), 16: sssd.DrafterConfig(use_input=False)}
    good = write(tmp_path, calibration_dict(entries, Fingerprint.of(store, llama)), "good.json")
    eng = LLMEngine(
        llama, datastore=store, drafter=good, config=EngineConfig(max_model_len=128, budget=None, max_running=2)
    )
    assert isinstance(eng.drafter_configs, CalibrationFile) and list(eng.drafting.entries) == [4, 16]
    assert eng.drafting.entries[4].end_token == 1  # the model's end-of-sequence id reached every entry
    assert eng.planner.mat[4] == 1.5 and eng.planner.mat[16] == 1.6
    out = eng.generate(["w1 w2 w3 w1 w2 w3"], sssd.SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8

    # calibrated for another datastore: a warning naming it, and the defaults (the planner's too)
    other = write(tmp_path, calibration_dict(entries, Fingerprint(datastore="0" * 16)), "other.json")
    with caplog.at_level(logging.WARNING, "sssd.calibration"):
        eng = LLMEngine(llama, datastore=store, drafter=other, config=EngineConfig(max_model_len=128, max_running=2))
    assert "datastore fingerprint" in caplog.text and str(other) in caplog.text
    assert eng.drafter_configs == sssd.DrafterConfig() and list(eng.drafting.entries) == [0]
    assert eng.drafting.datastore is store and eng.planner.mat[16] == pytest.approx(DEFAULT_MAT[16])

    # a malformed file the caller named: ValueError, no engine
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="truncated"):
        LLMEngine(llama, datastore=store, drafter=tmp_path / "bad.json", config=EngineConfig(max_model_len=128))


def test_an_engine_without_a_drafter_takes_the_packaged_calibration_only_where_it_fits(
    tmp_path, store, llama, monkeypatch
):
    import sssd.paths as paths
    from sssd.serving.engine import EngineConfig, LLMEngine

    entries = {4: sssd.DrafterConfig(use_datastore=False), 16: sssd.DrafterConfig(use_input=False)}
    mine = write(tmp_path, calibration_dict(entries, Fingerprint.of(store, llama)), "packaged.json")
    monkeypatch.setattr(paths, "packaged_calibration_file", lambda: mine)
    cfg = EngineConfig(max_model_len=128, max_running=2, budget=4)
    eng = LLMEngine(llama, datastore=store, config=cfg)  # drafter=None: the packaged file fits
    assert isinstance(eng.drafter_configs, CalibrationFile) and list(eng.drafting.entries) == [4, 16]
    assert eng.drafter_source == str(mine)
    # an explicit drafter wins; and another datastore does not fit: the defaults
    eng = LLMEngine(llama, datastore=store, drafter=sssd.DrafterConfig(), config=cfg)
    assert eng.drafter_configs == sssd.DrafterConfig()
    rng = np.random.default_rng(3)
    other = sssd.Datastore.build(random_corpus(rng, 20, vocab=40).astype(np.int64), tmp_path / "other")
    eng = LLMEngine(llama, datastore=other, config=cfg)
    assert eng.drafter_configs == sssd.DrafterConfig() and list(eng.drafting.entries) == [0]


def test_sssd_calibrate_records_the_fingerprint_and_a_recent_outputs_discount(
    tmp_path, store, model_dir, capsys, monkeypatch
):
    from sssd.cli import main

    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    gt = tmp_path / "gt.jsonl"
    header = {
        "format": "sssd-groundtruth",
        "version": 1,
        "dataset": "tiny",
        "model": {"name": "my-model", "path": str(model_dir), "sha256": "0" * 64},
    }
    context = PHRASE * 2
    records = [
        {"id": f"r{i}", "prompt_ids": context[i : i + 4], "output_ids": context[i + 4 : i + 10]} for i in range(6)
    ]
    gt.write_text("\n".join(json.dumps(r) for r in [header, *records]) + "\n")
    grid = [
        arg
        for f, v in (
            ("max-samples", 8),
            ("min-occurrences", 2),
            ("datastore-branch-len", 4),
            ("input-scale", 0.6),
            ("input-match-damping", 0.8),
            ("input-depth-decay", 0.9),
            ("datastore-match-damping", 0.85),
        )
        for arg in (f"--{f}", str(v))
    ]
    out = tmp_path / "cal.json"
    code = main(
        [
            "calibrate",
            str(gt),
            "--datastore",
            str(store.path),
            "-o",
            str(out),
            "--split",
            "all",
            "--budgets",
            "4",
            "8",
            "--workers",
            "1",
            *grid,
            "--draft",
            "recent",
            "--draft-scales",
            "0.5",
            "1",
        ]
    )
    assert code == 0, capsys.readouterr().err
    cal = CalibrationFile.load(out)
    # `--draft recent` needs no model: the other requests' outputs, fitted on the same examples
    assert set(cal.sources) == {"recent"} and cal.sources["recent"].scale in (0.5, 1.0)
    fitted = json.loads(out.read_text())["sources"]["recent"]
    assert fitted["steps"] > 0 and len(fitted["grid"]) >= 4
    assert cal.fingerprint == Fingerprint.of(store, model_dir) and cal.fingerprint.model_name == "my-model"
    assert list(cal.entries) == [4, 8] and cal.check(store, model_dir) == []
