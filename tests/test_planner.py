"""The batch-size-aware budget planner."""

import pytest

from sssd.serving.engine import EngineConfig, LLMEngine
from sssd.serving.planner import BudgetPlanner, ForwardProfile

from tiny_models import tiny_model


def linear_profile(fixed: float, per_token: float) -> ForwardProfile:
    rows, tokens = [1, 4, 16, 64, 256], [1, 5, 9, 17, 33, 65]
    return ForwardProfile(rows, tokens, [[fixed + per_token * r * t for t in tokens] for r in rows], context=256)


def test_speculates_at_small_batches_and_stops_when_compute_bound():
    # Memory-bound regime: a step costs 50 ms plus 0.2 ms per query token.
    p = BudgetPlanner(None, {4: 1.7, 8: 1.9, 16: 2.05, 32: 2.2, 64: 2.3}, linear_profile(0.05, 0.0002))
    assert p.budget(1) >= 16           # almost free tokens: a big tree pays
    assert p.budget(256) == 0          # 256 x 17 tokens cost far more than they yield
    choices = [p.budget(b) for b in (1, 4, 16, 64, 256)]
    assert choices == sorted(choices, reverse=True)  # never more speculation at a larger batch
    table = p.table((1, 256))
    assert table[0]["budget"] == p.budget(1)
    assert table[1]["tokens_per_s"][0] >= max(table[1]["tokens_per_s"].values())


def test_fixed_budget_needs_no_profile():
    assert BudgetPlanner(8).budget(100) == 8
    with pytest.raises(ValueError, match="profile"):
        BudgetPlanner(None, {4: 1.5})


def test_engine_profiles_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model(tmp_path / "m", "llama")
    eng = LLMEngine(model, datastore=None, config=EngineConfig(max_running=4, max_model_len=400, budget=None))
    prof = eng.planner.profile
    assert prof.rows == [1, 2, 4] and all(s > 0 for row in prof.seconds for s in row)
    cached = list((tmp_path / "cache" / "profiles").glob("forward-*.json"))
    assert len(cached) == 1
    again = LLMEngine(model, datastore=None, config=EngineConfig(max_running=4, max_model_len=400, budget=None))
    assert again.planner.profile.seconds == prof.seconds  # read back, not re-measured
    assert eng.planner.budget(1) in (0, 4, 8, 16, 32, 64)
