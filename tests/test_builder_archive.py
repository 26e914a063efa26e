"""Compressed distribution archives: round trip, cache, corruption, versions."""

from __future__ import annotations

import json
import struct
import threading

import numpy as np
import pytest

import sssd
from sssd.cli import main
from sssd.datastore import DATA_FILES
from sssd.datastore_builder import archive

from test_builder_support import conversations, make_tokenizer

pytest.importorskip("zstandard")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def built(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "c.json").write_text(json.dumps(conversations(200)))
    rc = main(["build", str(tmp_path / "c.json"), "-o", str(tmp_path / "ds"), "-t", str(tok), "--holdout-every", "50",
               "--compress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "archive" in out and str(tmp_path / "ds.sssd.zst") in out
    return tmp_path / "ds", tmp_path / "ds.sssd.zst"


def test_archive_round_trip_through_the_cache(built, cache, monkeypatch):
    directory, packed = built
    plain = sssd.Datastore.open(directory)
    ds = sssd.Datastore.open(packed)
    assert ds.path.parent == cache / "datastores" / "unpacked" and ds.path.name == archive._sha256(packed)
    assert ds.native.mapped
    np.testing.assert_array_equal(ds.tokens, plain.tokens)
    assert ds.query(plain.tokens[5:8])["tokens"].tolist() == plain.query(plain.tokens[5:8])["tokens"].tolist()
    assert ds.manifest["files"] == plain.manifest["files"]
    # The unpacked manifest points at the unpacked tokenizer; the rest is the original.
    assert ds.manifest["tokenizer"]["path"] == str(ds.path / "tokenizer.json")
    assert (ds.path / "heldout.jsonl").read_bytes() == (directory / "heldout.jsonl").read_bytes()
    # Decompressed once: the second open maps the cached copy.
    monkeypatch.setattr(archive, "unpack", lambda *a: pytest.fail("unpacked twice"))
    assert sssd.Datastore.open(packed).path == ds.path
    assert [p.name for p in ds.path.parent.iterdir()] == [ds.path.name]  # no temporaries


def test_concurrent_first_opens_agree(built, cache):
    _, packed = built
    paths, errors = [], []

    def open_it():
        try:
            paths.append(sssd.Datastore.open(packed).path)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert [p.name for p in (cache / "datastores" / "unpacked").iterdir()] == [paths[0].name]


def test_cli_info_verify_and_draft_on_an_archive(built, capsys):
    _, packed = built
    assert main(["info", str(packed)]) == 0
    out = capsys.readouterr().out
    assert "MiB compressed" in out and "held out       4 records" in out
    assert main(["verify", str(packed)]) == 0
    out = capsys.readouterr().out
    assert f"all {len(DATA_FILES) + 2} checks passed" in out  # each file against the manifest, while decompressing
    assert main(["draft", "--datastore", str(packed), "question 7: how do I"]) == 0
    out = capsys.readouterr().out
    assert "best chain" in out and "reverse" in out  # continued from the archive's datastore


def test_corrupt_archive_is_refused(built, cache, capsys):
    _, packed = built
    data = bytearray(packed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    packed.write_bytes(bytes(data))
    with pytest.raises(sssd.DatastoreError, match="corrupt archive|checksum"):
        sssd.Datastore.open(packed)
    assert list((cache / "datastores" / "unpacked").iterdir()) == []  # nothing half-unpacked
    assert main(["verify", str(packed)]) == 1
    assert "sssd verify: error:" in capsys.readouterr().err


def test_truncated_newer_and_foreign_files(built, tmp_path):
    _, packed = built
    data = packed.read_bytes()
    (tmp_path / "short.sssd.zst").write_bytes(data[: len(data) // 3])
    with pytest.raises(sssd.DatastoreError, match="truncated|corrupt"):
        sssd.Datastore.open(tmp_path / "short.sssd.zst")
    (tmp_path / "new.sssd.zst").write_bytes(data[:8] + struct.pack("<I", 99) + data[12:])
    with pytest.raises(sssd.DatastoreError, match="archive format version 99 is newer"):
        sssd.Datastore.open(tmp_path / "new.sssd.zst")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(sssd.DatastoreError, match="neither a datastore directory nor"):
        sssd.Datastore.open(tmp_path / "notes.txt")


def test_read_manifest_reads_only_the_manifest(built):
    directory, packed = built
    assert archive.read_manifest(packed) == json.loads((directory / "manifest.json").read_text())
    assert archive.is_archive(packed) and not archive.is_archive(directory / "manifest.json")
    # Compressed: the token stream compresses, the suffix array hardly does.
    assert packed.stat().st_size < sum(f["bytes"] for f in archive.read_manifest(packed)["files"].values())
