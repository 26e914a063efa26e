"""Where measured forward profiles and linear plans go, and that the suite keeps its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_models import tiny_model

from sssd.cache import PROFILE_DIR_ENV, cache_dir, profiles_dir


def named_model(folder: Path) -> set[str]:
    """The cached measurements in ``folder`` whose meta names a model path."""
    out = set()
    for f in folder.glob("*.json") if folder.is_dir() else ():
        try:
            meta = json.loads(f.read_text()).get("meta") or {}
        except (OSError, ValueError, AttributeError):
            continue
        model = meta.get("model") or (meta.get("identity") or {}).get("model")
        if isinstance(model, str):
            out.add(f"{f.name}:{model}")
    return out


def test_the_profile_folder_is_the_caches_unless_set(tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
    assert profiles_dir() == tmp_path / "cache" / "profiles"
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert profiles_dir() == tmp_path / "elsewhere"


def test_an_engine_on_a_temporary_model_leaves_nothing_in_the_users_profiles(tmp_path, own_profile_dir):
    """The suite's profiles and plans go to its own folder (conftest.py), not the user's cache,
    where a fresh-clone run used to leave ~40 files of models that no longer exist."""
    from sssd.serving.engine import EngineConfig, LLMEngine

    users = cache_dir() / "profiles"  # where they went before $SSSD_PROFILE_DIR
    assert os.environ[PROFILE_DIR_ENV] == str(own_profile_dir) and profiles_dir() == own_profile_dir
    assert users.resolve() != own_profile_dir.resolve()
    model = tiny_model(tmp_path / "m", "llama")
    engine = LLMEngine(model, datastore=None, config=EngineConfig(max_running=2, max_model_len=160, budget=None))
    assert engine.planner.profile is not None  # measured (and cached) on first use
    ours = {entry.split(":", 1)[0] for entry in named_model(own_profile_dir) if entry.endswith(":" + str(model))}
    assert any(n.startswith("forward-") for n in ours), ours
    if engine.backend.linear_plan is not None:  # a CPU backend plans its linear layers (unless turned off)
        assert any(n.startswith("linear-") for n in ours), ours
    assert not [e for e in named_model(users) if e.endswith(":" + str(model))]
