"""The neighbour benchmark's pure helpers (benchmarks/bench_neighbour.py): no servers run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bn():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_neighbour", BENCH / "bench_neighbour.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


def test_gaps_and_percentiles(bn):
    gaps = bn.stream_gaps([[0.0, 0.1, 0.3], [1.0], [], [2.0, 2.5]])
    assert gaps == pytest.approx([0.1, 0.2, 0.5])
    assert bn.percentile_ms(gaps, 50) == pytest.approx(200.0)
    assert bn.percentile_ms([], 99) is None


def test_parse_counters_skips_labelled_and_comments(bn):
    text = (
        "# HELP vllm:spec_decode_num_drafts_total Draft trees.\n"
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        "vllm:spec_decode_num_drafts_total 12\n"
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3\n'
        "vllm:spec_decode_num_accepted_tokens_total 7.0\n"
        "other_total 1\n"
    )
    assert bn.parse_counters(text) == {"num_drafts_total": 12.0, "num_accepted_tokens_total": 7.0}


def _row(mode, engine, tps, startup=2.0, identical=True, error=None):
    row = {
        "mode": mode,
        "engine": engine,
        "startup_s": startup,
        "first_request_s": 0.5,
        "levels": {"1": {"tokens_per_s": tps, "itl_p50_ms": 30.0, "itl_p99_ms": 90.0, "identical": identical}},
    }
    if error:
        row = {"mode": mode, "engine": engine, "error": error, "levels": {}}
    return row


def test_summary_ratios_and_table(bn):
    rows = [
        _row("quiet", "plain", 40.0),
        _row("quiet", "sssd", 80.0),
        _row("spin", "plain", 20.0),
        _row("spin", "sssd", 30.0, identical=False),
        _row("spin", "sssd", 50.0, identical=True),  # a second round: medians
    ]
    llm = [
        {"mode": "quiet", "engine": "plain", "construct_s": 3.0, "first_generate_s": 1.0, "tokens_per_s": 50.0},
        {"mode": "quiet", "engine": "sssd", "construct_s": 4.0, "first_generate_s": 1.0, "tokens_per_s": 100.0},
        {"mode": "spin", "engine": "plain", "error": "boom"},
    ]
    s = bn.summarize(rows, llm, [1])
    assert s["server"]["quiet/sssd"]["levels"]["1"]["sssd_over_plain"] == 2.0
    spin = s["server"]["spin/sssd"]["levels"]["1"]
    assert spin["tokens_per_s"] == 40.0 and spin["vs_quiet"] == 0.5 and spin["sssd_over_plain"] == 2.0
    assert spin["identical"] is False
    assert s["server"]["spin/plain"]["levels"]["1"]["vs_quiet"] == 0.5
    assert s["server"]["spin/plain"]["levels"]["1"]["sssd_over_plain"] is None
    assert s["llm"]["quiet/sssd"]["sssd_over_plain"] == 2.0 and "spin/plain" not in s["llm"]
    header = {"machine": {"cpu": "Test CPU", "cores": 2}, "date": "2024-01-01 00:00:00", "git": "abc"}
    table = bn.markdown(s, [1], header)
    assert "Test CPU, 2 cores" in table
    assert "| spin | sssd | 2.0 | 0.50 | 40.0 | 0.50 | 2.00 | 30/90 | False |" in table


def test_summary_survives_a_failed_cell(bn):
    s = bn.summarize([_row("quiet", "plain", 40.0), _row("quiet", "sssd", 0, error="died")], [], [1])
    assert "quiet/sssd" not in s["server"]
    assert "sssd.LLM" not in bn.markdown(s, [1], {"machine": {}, "date": "d", "git": "g"})


def test_each_phase_gets_prompts_of_its_own_while_the_set_lasts(bn, capsys):
    """The benchmarks' phases never resend a prompt to one server while the set lasts (its recent
    outputs would draft the earlier answer); past the set's end they wrap, and say so."""
    first, a, b = bn.disjoint_prompts(list(range(10)), [1, 4, 5])
    assert (first, a, b) == ([0], [1, 2, 3, 4], [5, 6, 7, 8, 9])
    assert "WARNING" not in capsys.readouterr().out
    _, c = bn.disjoint_prompts(list(range(3)), [2, 2])
    assert c == [2, 0] and "some repeat" in capsys.readouterr().out
