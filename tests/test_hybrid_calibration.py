"""Fitting a draft model's merge discount beside retrieval (calibration/hybrid.py, `sssd calibrate --draft`).

The fit's estimate for the discount it follows is exact: it equals the tokens per step the
engine measures when it decodes the same prompts with that discount (the brute-force
reference). A drafter that is the target itself is worth more the more the merge trusts it;
a drafter with unrelated weights is worth less. The fitted discount reaches the merge
through the calibration file, and a malformed "sources" entry is refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import tiny_model

from sssd.calibration.hybrid import discount_grid, fit_source_discount
from sssd.calibration.replay import Example
from sssd.calibration_file import CalibrationFile
from sssd.config import DrafterConfig, SourceDiscount
from sssd.recent_outputs import RecentOutputs
from sssd.serving.drafting.model_drafter import ModelDrafter
from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.engine.params import SamplingParams
from sssd.sources import DraftPipeline, RetrievalSource

PROMPTS = [[5, 9, 23, 7, 3, 40, 41, 42, 3], [10, 11, 12, 13, 10, 11, 12], [4] * 12, [7, 8, 9, 7, 8, 9, 7, 8]]
BUDGET = 6
N_OUT = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("target") / "llama", "llama")


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A drafter with the target's tokenizer and unrelated random weights."""
    return tiny_model(tmp_path_factory.mktemp("other") / "llama", "llama", seed=7)


@pytest.fixture(scope="module")
def examples(llama):
    eng = LLMEngine(llama, datastore=None, draft=[], config=EngineConfig(max_model_len=256))
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_OUT, ignore_eos=True))
    return [Example(np.asarray(p, np.int64), np.asarray(o.token_ids, np.int64)) for p, o in zip(PROMPTS, outs)]


def drafter(model, **kw):
    return ModelDrafter(model, slots=len(PROMPTS), capacity=256, expansion="2,1,1", complement=False, **kw)


def test_the_estimate_it_follows_is_what_the_engine_measures(llama, other, examples):
    """Retrieval (the requests' own tokens) + a draft model at one discount, through the engine:
    tokens per step equal the fit's estimate for that discount (it is the grid's first)."""
    disc = SourceDiscount(scale=0.5, depth_decay=0.9)
    eng = LLMEngine(
        llama,
        datastore=None,
        draft=["retrieval", drafter(other, discount=disc)],
        config=EngineConfig(max_model_len=256, max_running=len(PROMPTS), budget=BUDGET),
    )
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_OUT, ignore_eos=True))
    assert [o.token_ids for o in outs] == [e.output.tolist() for e in examples]  # lossless, as everywhere
    steps = sum(o.stats["steps"] for o in outs)
    engine_mat = sum(len(o.token_ids) for o in outs) / steps

    grid = [disc, SourceDiscount(scale=4.0), SourceDiscount(scale=0.1)]
    fit = fit_source_discount(
        examples, None, eng.drafting.config, drafter(other), BUDGET, grid, batch_size=len(PROMPTS)
    )
    assert fit.steps == steps
    assert fit.reference_mat == pytest.approx(engine_mat, rel=1e-12)
    assert [d for d, _ in fit.grid] == grid


def test_a_perfect_drafter_is_trusted_and_an_unrelated_one_is_not(llama, other, examples):
    """The target drafting for itself: every main-chain node is right, so ranking its nodes first
    can only help (the largest scale scores at least the smallest, and beats retrieval alone).
    Unrelated weights: its nodes crowd out retrieval's, so the smallest scale scores best."""
    cfg = LLMEngine(
        llama, datastore=None, draft=["retrieval"], config=EngineConfig(max_model_len=256, budget=BUDGET)
    ).drafting.config
    grid = discount_grid(SourceDiscount(), scales=(0.01, 1.0, 100.0), decays=(1.0,))
    self_fit = fit_source_discount(examples, None, cfg, drafter(llama), BUDGET, grid, batch_size=2)
    by_scale = {d.scale: m for d, m in self_fit.grid}
    assert by_scale[100.0] >= by_scale[0.01]
    assert self_fit.best_mat > self_fit.retrieval_mat
    assert self_fit.best.scale >= 1.0
    other_fit = fit_source_discount(examples, None, cfg, drafter(other), BUDGET, grid, batch_size=2)
    by_scale = {d.scale: m for d, m in other_fit.grid}
    assert by_scale[0.01] >= by_scale[100.0]
    assert self_fit.best_mat > other_fit.best_mat


def test_recent_outputs_pay_where_requests_repeat_each_other():
    """Requests that answer with one shared passage (an agent's repeated plan): replayed two at a
    time, the later ones draft it from the earlier answers, which their own tokens cannot give
    them; every discount scores above retrieval alone, and the estimates are tokens per step."""
    rng = np.random.default_rng(3)
    shared = rng.integers(100, 1000, size=40)
    examples = [
        Example(rng.integers(1000, 2000, size=12), np.concatenate([rng.integers(2000, 3000, size=3), shared]))
        for _ in range(6)
    ]
    cfg = DrafterConfig(use_datastore=False)
    grid = discount_grid(SourceDiscount(), scales=(0.5, 2.0), decays=(1.0,))
    fit = fit_source_discount(examples, None, cfg, RecentOutputs(), 16, grid, batch_size=2, key="recent")
    assert fit.source == "recent" and fit.tokens == sum(len(e.output) for e in examples)
    assert all(m > fit.retrieval_mat * 1.5 for _, m in fit.grid)
    assert fit.retrieval_mat < 2.0  # nothing repeats within a request
    assert fit.best_mat <= 17.0  # at most the budget and the bonus token per step


def _file(tmp_path, sources) -> CalibrationFile:
    d = {
        "format": "sssd-calibration",
        "version": 1,
        "default_budget": 8,
        "budgets": {"8": {"config": {"budget": 8}, "calibrated": False}},
        "sources": sources,
    }
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    return CalibrationFile.load(path)


def test_the_fitted_discount_reaches_the_merge(llama, tmp_path):
    fitted = SourceDiscount(scale=0.25, depth_decay=0.8)
    d = drafter(llama, name="model:mine")
    cal = _file(
        tmp_path,
        {
            "model:mine": {
                "discount": {"scale": 0.25, "depth_decay": 0.8, "match_damping": 1.0, "full_match": 1},
                "mat": 2.0,
            }
        },
    )
    assert cal.sources == {"model:mine": fitted}
    pipe = DraftPipeline([RetrievalSource(None), d], cal)
    assert pipe.discount_of(d) == fitted and pipe._discounts == (fitted,)
    assert d.discount != fitted  # the source's own is kept (another file may fit another)
    other = drafter(llama, name="model:theirs")
    assert DraftPipeline([RetrievalSource(None), other], cal).discount_of(other) == other.discount


@pytest.mark.parametrize(
    "sources, message",
    [
        ([1], "sources is not an object"),
        ({"model:x": {"mat": 2}}, 'no "discount" object'),
        ({"model:x": {"discount": {"scale": -1.0}}}, "positive finite"),
        ({"model:x": {"discount": {"scale": 1.0, "bogus": 2}}}, "bogus"),
    ],
)
def test_a_malformed_sources_entry_is_refused(tmp_path, sources, message):
    with pytest.raises(ValueError, match=message):
        _file(tmp_path, sources)
