"""The prepared device run (benchmarks/gpu_check.py) on the CPU at tiny shapes, so it cannot rot
between the sessions that have a GPU, and its offline section over the recorded H200 run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
RECORDED = REPO / "benchmarks" / "gpu" / "gpu_check-h200-4c2440e.json"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, SSSD_LINEAR_PLAN="off")  # the CPU's linear-layer plan is no part of this check
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env
    )


def test_the_device_run_runs_on_the_cpu_at_tiny_shapes(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = run("--device", "cpu", "--small", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["environment"]["device"] == "cpu"
    for arch, res in data["lossless"].items():
        checks = {k: v for k, v in res["checks"].items() if not k.startswith("plain")}
        assert len(checks) == 7 and all(v["identical"] for v in checks.values()), (arch, checks)
        sssd_runs = [v for k, v in res["runs"].items() if k.startswith("sssd batch")]
        assert all(v["steps"] < v["tokens"] for v in sssd_runs)  # it speculated: fewer steps than tokens
    prof = data["profile"]["profile"]
    assert prof["rows"] == [1, 2, 4] and prof["tokens"] == [1, 5, 17]
    assert all(s > 0 for row in prof["seconds"] for s in row)
    rows = data["projection"]["eager"]["speedup"]
    assert [r["batch"] for r in rows] == [1, 2, 4]
    assert all(r["speedup"] == pytest.approx(r["mat"] / r["cost_ratio"], rel=1e-2) for r in rows)
    assert "== 3." in r.stdout and "wrote" in r.stdout


def test_a_cuda_run_on_a_machine_without_cuda_is_one_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = run("--device", "cuda", "--out", str(tmp_path / "x.json"), cwd=tmp_path)
    assert r.returncode != 0 and "DeviceError" in r.stderr and "CUDA" in r.stderr.strip().splitlines()[-1]


def test_the_recorded_h200_run_reprojects_offline_and_the_fitted_roofline_matches_it(tmp_path):
    out = tmp_path / "proj.json"
    r = run("--from-json", str(RECORDED), "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    proj = json.loads(out.read_text())["projection"]
    assert set(proj) == {"eager", "cuda_graph"}
    graph = proj["cuda_graph"]
    # the roofline corrected to the GPU's own costs is within 25% at every measured point
    assert all(0.75 <= p["fitted_over_measured"] <= 1.25 for p in graph["points"]), graph["points"]
    assert [r["batch"] for r in graph["speedup"]] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert all(r["dominant"] for r in graph["speedup"])


def load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_divergence_is_called_a_rounding_tie_only_at_the_runner_up_within_1e_4_of_the_scale(tmp_path):
    import torch

    gc = load_script()
    # the H200 run of f3c7e90: SSSD took plain's runner-up 7.7e-4 below the top of logits up to 31.4
    ties = json.loads((REPO / "benchmarks" / "gpu" / "gpu_check-h200-f3c7e90-ties.json").read_text())
    diffs = [
        f
        for r in ties["lossless"].values()
        for c in r["checks"].values()
        for f in c.get("differences", [c["first"]] if "first" in c else [])
    ]
    assert diffs and all(gc.is_rounding_tie(f) for f in diffs)
    assert not gc.is_rounding_tie({"chosen_rank": 1, "relative_gap": 0.01})
    assert not gc.is_rounding_tie({"chosen_rank": 2, "relative_gap": 1e-6})
    assert not gc.is_rounding_tie({"plain_margin": 0.0})  # no chosen token: a length difference

    # margin_at against the logits themselves, on a tiny model of the same script
    folder = gc.model_folder(gc.TINY_LLAMA, tmp_path / "m")
    prefix = [5, 9, 11, 5, 9]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prefix])).logits[0, -1]
    order = logits.argsort(descending=True).tolist()
    got = gc.margin_at(folder, torch.device("cpu"), prefix, chosen=order[2])
    assert got["top2"] == order[:2] and got["chosen_rank"] == 2
    assert got["chosen_gap"] == pytest.approx(float(logits[order[0]] - logits[order[2]]), rel=1e-5)
    assert got["plain_margin"] <= got["chosen_gap"] and got["logit_scale"] == pytest.approx(float(logits.abs().max()))


def test_a_sampled_divergence_is_explained_by_redrawing_plains_seeded_token(tmp_path):
    """sampled_margin_at recomputes plain decoding's seeded inverse-CDF draw: it must give plain's own
    token at every position; a token next to the draw's edge is a rounding tie, one far off is not."""
    import numpy as np
    import torch

    from sssd.serving.engine import EngineConfig, LLMEngine
    from sssd.serving.engine.params import SamplingParams

    gc = load_script()
    folder = gc.model_folder(gc.TINY_LLAMA, tmp_path / "m")
    ps = gc.prompts(gc.TINY_LLAMA["vocab_size"], 2, np.random.default_rng(1))
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)
    config = EngineConfig(max_running=2, max_model_len=128, dtype="float32", device="cpu", speculate=False)
    outs = [o.token_ids for o in LLMEngine(folder, draft=[], config=config).generate(ps, params)]
    cpu = torch.device("cpu")
    for i, k in ((0, 0), (0, 7), (1, 11)):
        got = gc.sampled_margin_at(folder, cpu, ps[i] + outs[i][:k], k, params, outs[i][k])
        assert got["redrawn"] == outs[i][k] and got["mass_to_chosen"] == 0.0 and got["shape_delta"] < 1e-3
        # another token: the CDF mass between the draw and it, and a tie only when that is tiny
        other = (outs[i][k] + 1) % gc.TINY_LLAMA["vocab_size"]
        far = gc.sampled_margin_at(folder, cpu, ps[i] + outs[i][:k], k, params, other)
        assert far["redrawn"] == outs[i][k] and far["chosen"] == other
        assert gc.is_rounding_tie(far) == (far["mass_to_chosen"] < far["tie_reach"])
    assert gc.is_rounding_tie({"sampled": True, "mass_to_chosen": 2e-4, "tie_reach": 1.9e-3})
    assert not gc.is_rounding_tie({"sampled": True, "mass_to_chosen": 0.05, "tie_reach": 1.9e-3})


def test_the_recorded_h200_costs_price_the_batch_allocation_from_ground_truth(tmp_path):
    """Section 3 offline with --groundtruth: the allocation projected on the run's measured eager
    and CUDA-graph costs, beside one budget for every row on the same replayed steps."""
    from test_plan_allocation import synthetic_groundtruth

    synthetic_groundtruth(tmp_path / "gt.jsonl")
    out = tmp_path / "proj.json"
    recorded = REPO / "benchmarks" / "gpu" / "gpu_check-h200-7c50f1a.json"
    r = run("--from-json", str(recorded), "--groundtruth", str(tmp_path / "gt.jsonl"), "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    proj = json.loads(out.read_text())["projection"]
    for kind in ("eager", "cuda_graph"):
        rows = proj[kind]["allocation"]
        assert [x["batch"] for x in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
        assert all(x["speedup"] >= 0.99 and x["per_size_speedup"] >= 1.0 for x in rows)
        assert rows[0]["speedup"] > 1.5  # the answers copy their prompts: deep trees pay at batch 1
    assert "the batch allocation on these costs" in r.stdout


def test_a_warning_is_traced_to_the_sssd_code_that_caused_it():
    """Sync debug mode warns from torch's own file; callers_of_warnings names our lines above it."""
    import warnings

    from sssd.serving.planning.profile import run_steps

    gc = load_script()

    def steps():  # warns from here, called by run_steps (serving/planning/profile.py)
        warnings.warn("a synchronising call", UserWarning, stacklevel=1)
        yield
        return 1

    shown = warnings.showwarning
    with warnings.catch_warnings(), gc.callers_of_warnings() as found:
        warnings.simplefilter("always")
        assert run_steps(steps()) == 1
    assert len(found) == 1 and found[0]["message"] == "a synchronising call"
    assert found[0]["warned_at"].startswith("test_gpu_check.py:")
    assert any(c.startswith("profile.py:") and "run_steps" in c for c in found[0]["callers"])
    assert warnings.showwarning is shown  # the hook is gone again


def test_the_sync_debug_modes_own_notice_is_told_apart_from_a_synchronising_call():
    """The H200 run of 9565f6d traced the one warning sync debug mode raised inside launch: it was
    torch's notice, as the mode is switched on, that the mode is a prototype (no sync of ours)."""
    gc = load_script()
    run = json.loads((REPO / "benchmarks" / "gpu" / "gpu_check-h200-9565f6d.json").read_text())
    warned = [c for d in run["profile"]["device_side"] for c in d.get("syncs_in_launch_callers", [])]
    assert warned and all(gc.SYNC_MODE_NOTICE in c["message"] for c in warned)
    assert all(not c["callers"] for c in warned)  # raised where no SSSD line was on the stack
