"""Shared fixtures: small seeded corpora, synthetic and real; the suite's own profile folder."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import sssd

SEP = sssd.SEPARATOR


def random_corpus(
    rng: np.random.Generator, n_docs: int, vocab: int, max_len: int = 40, repeat: float = 0.3
) -> np.ndarray:
    """Documents of Zipf-ish tokens with copied phrases (so that matches exist)."""
    docs: list[list[int]] = []
    for _ in range(n_docs):
        n = int(rng.integers(1, max_len))
        doc: list[int] = []
        while len(doc) < n:
            if docs and rng.random() < repeat:
                src = docs[int(rng.integers(len(docs)))]
                a = int(rng.integers(len(src)))
                doc.extend(src[a : a + int(rng.integers(2, 8))])
            else:
                doc.append(int(min(vocab - 1, rng.zipf(1.3) - 1)))
        docs.append(doc[:n])
    out: list[int] = []
    for d in docs:
        out.extend(d)
        out.append(SEP)
    return np.array(out, dtype=np.uint32)


def word_corpus() -> tuple[np.ndarray, dict[str, int]]:
    """A real-text corpus: docstrings and source of a few stdlib modules,
    split into words and mapped to ids (one document per function)."""
    import argparse
    import json as json_mod
    import textwrap

    vocab: dict[str, int] = {}
    out: list[int] = []
    for mod in (argparse, textwrap, json_mod.decoder):
        for _, fn in inspect.getmembers(mod, inspect.isfunction):
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            words = re.findall(r"\w+|[^\w\s]", src)
            out.extend(vocab.setdefault(w, len(vocab)) for w in words)
            out.append(SEP)
    return np.array(out, dtype=np.uint32), vocab


@pytest.fixture(scope="session", autouse=True)
def own_profile_dir(tmp_path_factory):
    """The suite caches forward profiles and linear plans in a folder of its own
    ($SSSD_PROFILE_DIR, subprocesses included): its temporary models' measurements would
    otherwise pile up in the user's cache. The user's models, datastores and ground truth are
    still used where they are. The user's measurements of real models (not temporary ones)
    are copied in first, so that a test serving a pulled model does not measure it again."""
    from sssd.cache import PROFILE_DIR_ENV, profiles_dir

    ours = tmp_path_factory.mktemp("profiles")
    _copy_real_measurements(profiles_dir(), ours)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PROFILE_DIR_ENV, str(ours))
        # Engines measure what they need before their first request, as they did: a linear plan
        # swapped in between two generate() calls would make a test's plain and speculative runs
        # round differently. tests/test_measurements.py tests the background measurements.
        mp.setenv("SSSD_MEASURE", "now")
        # Whatever else the machine runs, the suite's measurements of its temporary models are used:
        # a test asserts what was measured, not how quiet the machine was (the tests of the busy
        # check set their own threshold).
        mp.setenv("SSSD_PROFILE_NOISY_SHARE", "1")
        yield ours


def _copy_real_measurements(user: Path, ours: Path) -> None:
    temporary = Path(tempfile.gettempdir()).resolve()
    for f in sorted(user.glob("*.json")) if user.is_dir() else ():
        if f.name.startswith("selfspec-"):  # a fitted self-speculation cost model (bench_magicdec --fit)
            shutil.copy2(f, ours / f.name)
            continue
        if not f.name.startswith(("forward-", "linear-")):
            continue
        try:
            meta = json.loads(f.read_text()).get("meta") or {}
            model = meta.get("model") or (meta.get("identity") or {}).get("model")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(model, str) and os.path.isabs(model) and os.path.exists(model):
            if not Path(model).resolve().is_relative_to(temporary):
                shutil.copy2(f, ours / f.name)


@pytest.fixture(scope="session")
def words():
    return word_corpus()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def small_datastore_dir(tmp_path_factory):
    """A datastore on disk built from the word corpus."""
    tokens, _ = word_corpus()
    path = tmp_path_factory.mktemp("ds") / "words"
    sssd.Datastore.build(tokens, path, metadata={"source": {"kind": "test"}})
    return path


def dump(obj) -> str:
    return json.dumps(obj, default=str)
