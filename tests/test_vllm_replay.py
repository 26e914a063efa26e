"""The offline replay of vLLM's greedy loop (benchmarks/bench_vllm_replay.py): exact small cases."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vllm_replay as bvr  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15], [16, 17, 18, 19, 20]]
OUTPUTS = [[3, 4, 5, 6, 7, 8, 30, 31], [40, 41, 42], [50], [60, 61, 62, 63, 64, 65]]


def nothing(rows, requests, contexts, new):
    return [[] for _ in rows]


def test_without_drafts_a_row_gains_one_token_a_step():
    run = bvr.replay(PROMPTS, OUTPUTS, 1, nothing, k=8)
    assert len(run.rows) == sum(len(o) - 1 for o in OUTPUTS)  # the first token comes from the prefill
    assert sum(run.drafted) == sum(run.accepted) == 0
    # two rows: requests 0 and 1 together; when 1 ends, 2 joins (done at its prefill) and 3 at once
    run = bvr.replay(PROMPTS, OUTPUTS, 2, nothing, k=8)
    busy = [0] * 40
    for start, request in ((0, 0), (0, 1), (2, 3)):
        for s in range(start, start + len(OUTPUTS[request]) - 1):
            busy[s] += 1
    assert run.rows == [b for b in busy if b]


def test_the_perfect_chains_are_all_accepted():
    run = bvr.replay(PROMPTS, OUTPUTS, 2, bvr.perfect(PROMPTS, OUTPUTS, 2), k=2)
    assert run.accepted == run.drafted  # every token of every chain
    per = {}
    for _, r, _ in run.sent:
        per[r] = per.get(r, 0) + 1
    for r, o in enumerate(OUTPUTS):  # k accepted + 1 a step, the last step's chain cut by the output's end
        assert per.get(r, 0) == -(-(len(o) - 1) // 3)


def test_a_chain_is_accepted_up_to_its_first_wrong_token():
    def one_wrong(rows, requests, contexts, new):
        out = []
        for r, c in zip(requests, contexts):
            done = len(c) - len(PROMPTS[r])
            chain = list(OUTPUTS[r][done : done + 4])
            if len(chain) > 2:
                chain[2] = -1
            out.append(chain)
        return out

    run = bvr.replay(PROMPTS[:1], OUTPUTS[:1], 1, one_wrong, k=4)
    # 8 tokens: 1 at the prefill, then 2 accepted + 1 a step twice, then a chain of the last token
    assert run.accepted == [2, 2, 1] and run.drafted == [4, 4, 1]


def test_the_step_model_is_fitted_to_decode_steps_and_prefill_is_summed():
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(40):
        rows, drafts = int(rng.integers(1, 5)), int(rng.integers(0, 40))
        lines.append(
            {"rows": rows, "tokens": rows + drafts, "seconds": 0.08 + 0.01 * rows + 0.002 * drafts, "prefilled": 0}
        )
    lines += [{"rows": 2, "tokens": 2, "seconds": 1.5, "prefilled": 1}] * 3
    (a, b, c), prefill, n = bvr.fit_steps(lines)
    assert (a, b, c) == pytest.approx((0.08, 0.01, 0.002), abs=1e-9) and prefill == pytest.approx(4.5) and n == 40
    with pytest.raises(ValueError, match="too few"):
        bvr.fit_steps(lines[-3:])


def test_the_sssd_proposer_is_replayed_on_the_step_models_clock(monkeypatch):
    monkeypatch.setenv("SSSD_VLLM_DATASTORE", "none")
    monkeypatch.setenv("SSSD_VLLM_MIN_SCORE", "0.0")
    body = list(range(100, 160))
    prompts = [body + [7, 8], body[::-1] + [9]]
    outputs = [body[:40], body[::-1][:30]]  # both answers copy their prompt
    model = (0.1, 0.01, 0.002)
    chains = bvr.SSSDChains(None, 8, model)
    run = bvr.replay(prompts, outputs, 2, chains, 8, chains.step)
    assert chains.now == pytest.approx(run.seconds(model))  # the proposer's clock is the model's
    assert 0 < sum(run.accepted) <= sum(run.drafted)
    assert len(run.rows) < sum(len(o) - 1 for o in outputs)  # copying takes fewer steps than tokens
    assert chains.worth and all(0.0 <= w <= 1.0 for w, _ in chains.worth)
    # the proposer's measured-cost rule saw the modelled steps (two rows, ten draft tokens: 0.14 s)
    assert float(chains.prop.cost(np.array([12]))[0]) == pytest.approx(0.14, rel=0.2)


def test_a_request_finishes_at_its_last_step_and_the_mean_is_over_requests():
    run = bvr.replay(PROMPTS, OUTPUTS, 2, nothing, k=8)
    assert run.finished == {1: 1, 0: 6, 3: 6}  # (request 2 is done at its prefill)
    model = (1.0, 0.0, 0.0)  # a second a step
    assert run.mean_finish(model) == pytest.approx((2 + 7 + 7) / 3) and run.seconds(model) == 7


def test_kept_chains_are_what_was_accepted_of_the_method_s_chains():
    def two_right_then_wrong(rows, requests, contexts, new):
        out = []
        for r, c in zip(requests, contexts):
            done = len(c) - len(PROMPTS[r])
            out.append(list(OUTPUTS[r][done : done + 2]) + [-1, -1])
        return out

    full = bvr.replay(PROMPTS, OUTPUTS, 2, two_right_then_wrong, k=4)
    cut = bvr.replay(PROMPTS, OUTPUTS, 2, bvr.kept(two_right_then_wrong, PROMPTS, OUTPUTS), k=4)
    assert cut.accepted == full.accepted and cut.rows == full.rows  # the same steps and tokens ...
    assert cut.accepted == cut.drafted and sum(cut.drafted) < sum(full.drafted)  # ... with nothing wasted
