"""Row-count-planned linear layers: the same products as F.linear, the plan's choices as measured,
cached and re-measured like the forward profile, and speculation still lossless on them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

import sssd
from sssd.serving.backends import linear_plan
from sssd.serving.backends.linear_plan import ROW_GRID, WIN, LinearPlan, PlannedLinear
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("llama") / "llama", "llama")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SSSD_PROFILE_DIR", raising=False)  # the default place: <cache>/profiles
    return tmp_path / "cache"


def always(shapes, ratio: float = 10.0) -> LinearPlan:
    """A plan that chose (ratio >= WIN) or refused the transposed form at every measured row count."""
    return LinearPlan({tuple(s): [ratio] * len(ROW_GRID) for s in shapes})


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 17, 33])
def test_the_transposed_form_is_the_same_product(rows):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(37, 23, generator=g), torch.randn(rows, 23, generator=g)
    got = linear_plan.transposed(x, w)
    assert got.shape == (rows, 37) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ratio", [10.0, 1.0])
@pytest.mark.parametrize("shape", [(1, 1, 16), (1, 4, 16), (3, 5, 16), (2, 40, 16)])
def test_a_planned_layer_computes_what_torch_does(ratio, shape):
    """Either choice, with a bias, for 3-D inputs, and above the measured grid (80 rows: torch's)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 24, bias=True)
    x = torch.randn(*shape)
    want = layer(x)
    linear_plan.install(layer, always([(24, 16)], ratio))
    assert isinstance(layer, PlannedLinear)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_between_measured_row_counts_both_neighbours_must_agree():
    i16, i24 = ROW_GRID.index(16), ROW_GRID.index(24)
    both = [1.0] * len(ROW_GRID)
    both[i16] = both[i24] = 2.0
    one = [1.0] * len(ROW_GRID)
    one[i16] = 2.0
    plan = LinearPlan({(8, 8): both, (4, 4): one})
    assert all(plan.table((8, 8))[m] for m in range(16, 25))
    assert plan.table((4, 4))[16] and not any(plan.table((4, 4))[m] for m in range(17, 25))
    assert not any(plan.table((9, 9))), "an unmeasured shape keeps torch's layer"
    just = [WIN] * len(ROW_GRID)
    assert all(LinearPlan({(2, 2): just}).table((2, 2))[1:]), "a ratio of exactly WIN chooses the transposed form"


def test_modes_override_the_per_shape_choices_at_their_row_counts():
    plan = LinearPlan({(8, 8): [2.0] * len(ROW_GRID), (4, 4): [1.0] * len(ROW_GRID)}, modes={1: "F", 2: "T"})
    assert not plan.table((8, 8))[1] and plan.table((8, 8))[3], "F at 1 row only"
    assert plan.table((4, 4))[2] and not plan.table((4, 4))[3], "T at 2 rows only"
    assert not any(plan.table((9, 9))), "an unmeasured shape keeps torch's layer whatever the mode"
    again = LinearPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.modes == plan.modes and again.table((8, 8)) == plan.table((8, 8))
    assert linear_plan.plan_key(again) != linear_plan.plan_key(LinearPlan(plan.ratios))
    with pytest.raises(ValueError, match="mode"):
        LinearPlan.from_dict(dict(plan.to_dict(), modes={"7": "T"}))


@pytest.mark.parametrize("faster", ["T", "F", "shape"])
def test_refine_keeps_the_mode_whose_whole_forward_is_fastest(llama, faster):
    """The model's layers as installed decide what a pass costs here (a cost function over the real
    installed tables, so refine's search and install are what is tested)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    shapes = sorted({tuple(m.weight.shape) for m in linear_plan.linears(model)})
    # per-shape choices: the first shape transposed, the others not (distinct from all-T and all-F)
    plan = LinearPlan({s: [10.0 if i == 0 else 1.0] * len(ROW_GRID) for i, s in enumerate(shapes)})
    shape_choice = [i == 0 for i in range(len(shapes))]
    want = {"T": [True] * len(shapes), "F": [False] * len(shapes), "shape": shape_choice}[faster]
    seen = []

    def time_rows(m):
        mods = {tuple(mod.weight.shape): mod for mod in linear_plan.linears(model)}
        got = [mods[s]._rows_table[m] for s in shapes]
        seen.append(m)
        return None if m == 32 else (1.0 if got == want else 2.0)  # 32 rows "do not fit"

    linear_plan.refine(model, plan, time_rows, rounds=2)
    assert set(seen) == set(ROW_GRID)
    for m in ROW_GRID:
        got = [plan.wins(s)[ROW_GRID.index(m)] for s in shapes]
        assert got == (shape_choice if m == 32 else want), m
        assert plan.modes.get(m) == (None if faster == "shape" or m == 32 else faster)
    tables = {tuple(mod.weight.shape): mod._rows_table for mod in linear_plan.linears(model)}
    assert all(tables[s] == plan.table(s) for s in shapes), "the refined plan is left installed"


def test_install_and_uninstall_keep_parameters_and_ties(llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shapes = {tuple(m.weight.shape) for m in linear_plan.linears(model)}
    assert linear_plan.install(model, always(shapes)) == len(linear_plan.linears(model))
    assert all(isinstance(m, PlannedLinear) for m in linear_plan.linears(model))
    linear_plan.install(model, None)
    assert all(type(m) is torch.nn.Linear for m in linear_plan.linears(model))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_the_plan_is_measured_once_cached_and_remeasured_when_corrupt(llama, cache):
    from sssd.serving.backends.torch_backend import TorchBackend

    logs: list[str] = []
    be = TorchBackend(llama, slots=2, capacity=64, log=logs.append)
    plan = be.linear_plan
    shapes = {tuple(m.weight.shape) for m in linear_plan.linears(be.model)}
    assert set(plan.ratios) == shapes and all(len(r) == len(ROW_GRID) and min(r) > 0 for r in plan.ratios.values())
    assert plan.meta["conditions"]["cpu_model"]
    assert set(plan.modes) <= set(ROW_GRID) and set(plan.modes.values()) <= {"T", "F"}
    for m in linear_plan.linears(be.model):  # each layer follows its shape's measurement, refined in place
        ratios = plan.ratios[tuple(m.weight.shape)]
        want = [plan.modes.get(rows, "T" if r >= WIN else "F") == "T" for rows, r in zip(ROW_GRID, ratios)]
        assert [m._rows_table[rows] for rows in ROW_GRID] == want
    assert any("whole forward" in line for line in logs), "the plan was refined in forward passes"
    files = list((cache / "profiles").glob("linear-*.json"))
    assert len(files) == 1 and any("linear plan" in line for line in logs)

    logs.clear()
    again = TorchBackend(llama, slots=2, capacity=64, log=logs.append).linear_plan
    assert again.to_dict()["ratios"] == plan.to_dict()["ratios"] and not logs, "the cached plan is used as it is"

    files[0].write_text(files[0].read_text()[:40])
    third = TorchBackend(llama, slots=2, capacity=64, log=logs.append)
    assert set(third.linear_plan.ratios) == shapes
    assert any("cannot be read" in line for line in logs)
    json.loads(files[0].read_text())  # rewritten whole


def test_off_leaves_torchs_layers(llama, cache, monkeypatch):
    from sssd.serving.backends.torch_backend import TorchBackend

    monkeypatch.setenv(linear_plan.ENV, "off")
    be = TorchBackend(llama, slots=2, capacity=64)
    assert be.linear_plan is None and be.identity()["linear_plan"] is None
    assert all(type(m) is torch.nn.Linear for m in linear_plan.linears(be.model))
    assert not list((cache / "profiles").glob("linear-*.json"))


@pytest.mark.parametrize("ratio", [10.0, 1.0])
def test_speculation_is_lossless_on_either_kernel(llama, ratio):
    """Every layer forced onto one form at every row count: speculative greedy decoding stays
    token-identical to plain decoding on the same kernels, with drafts long enough to be verified
    at many row counts."""
    prompts = [[5, 9, 23, 7, 3, 40, 41, 42, 3], [10, 11, 12, 13, 10, 11, 12], [4] * 20, [60]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = LLMEngine(llama, config=EngineConfig(max_model_len=256, speculate=False, max_running=4))
    shapes = {tuple(m.weight.shape) for m in linear_plan.linears(plain.backend.model)}
    linear_plan.install(plain.backend.model, always(shapes, ratio))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    docs = [p + w for p, w in zip(prompts, want)]
    ds = sssd.Datastore.from_tokens(np.array([t for d in docs for t in d + [sssd.SEPARATOR]], dtype=np.uint32))
    for budget, running in [(4, 1), (16, 4)]:
        spec = LLMEngine(
            llama,
            datastore=ds,
            backend=plain.backend,
            config=EngineConfig(max_model_len=256, budget=budget, max_running=running),
        )
        outs = spec.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        assert sum(o.stats["accepted"] for o in outs) > 20
