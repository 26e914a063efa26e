"""The default datastore is built the first time it is needed: by `sssd.LLM()` as by `sssd serve`
(datastore_builder.default.ensure_built), and only where retrieval drafts from it."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

import sssd
from sssd.datastore import Datastore
from sssd.datastore_builder.default import ensure_built


@pytest.fixture
def fresh_default(tmp_path, monkeypatch):
    """The default datastore's place, empty (SSSD_DATASTORE)."""
    path = tmp_path / "default-datastore"
    monkeypatch.setenv("SSSD_DATASTORE", str(path))
    return path


def test_llm_builds_the_default_datastore_on_first_use_and_only_for_retrieval(fresh_default, tmp_path):
    model = tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(FileNotFoundError, match="sssd build --default"):
        Datastore.open("default")
    sssd.LLM(model, datastore="default", draft=["recent"], max_model_len=64).close()  # no retrieval: nothing to build
    assert not (fresh_default / "manifest.json").exists()
    # retrieval drafts from it: built first (the tiny model's vocabulary then refuses it: not SmolLM2's)
    with pytest.raises(ValueError):
        sssd.LLM(model, datastore="default", max_model_len=64)
    assert (fresh_default / "manifest.json").exists()
    ds = Datastore.open("default")
    assert ds.path == fresh_default and len(ds) > 20_000_000 and (fresh_default / "heldout.jsonl").exists()
    assert ensure_built() is False  # there now: not built again
