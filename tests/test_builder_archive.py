"""Compressed distribution archives: round trip, cache, corruption, versions."""

from __future__ import annotations

import json
import struct
import threading

import numpy as np
import pytest
from test_builder_support import conversations, make_tokenizer

import sssd
from sssd import archive
from sssd.cli import main
from sssd.datastore import DATA_FILES

pytest.importorskip("zstandard")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def built(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "c.json").write_text(json.dumps(conversations(200)))
    rc = main(
        [
            "build",
            str(tmp_path / "c.json"),
            "-o",
            str(tmp_path / "ds"),
            "-t",
            str(tok),
            "--holdout-every",
            "50",
            "--compress",
        ]
    )
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
    assert (
        f"all {len(DATA_FILES) + 3} checks passed" in out
    )  # each file against the manifest, while decompressing; the tokenizer identity
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


# -- archives that lie: decompression bombs, sizes, names ----------------------------------
# Crafted from the documented layout: b"SSSDPACK" + uint32 version + uint32 0, then one
# zstd frame of entries (uint16 name length, name, uint64 size, bytes), an empty name last.


def _craft(path, manifest, entries):
    import zstandard

    with open(path, "wb") as raw:
        raw.write(b"SSSDPACK" + struct.pack("<II", 1, 0))
        with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as z:
            for name, size, chunks in [("manifest.json", None, None), *entries]:
                if name == "manifest.json" and chunks is None:
                    data = json.dumps(manifest).encode()
                    size, chunks = len(data), [data]
                z.write(struct.pack("<H", len(name.encode())) + name.encode() + struct.pack("<Q", size))
                for chunk in chunks:
                    z.write(chunk)
            z.write(struct.pack("<H", 0))
    return path


def _zeros(n, chunk=1 << 22):
    while n > 0:
        yield bytes(min(n, chunk))
        n -= chunk


def _sha256_of_zeros(n):
    import hashlib

    h = hashlib.sha256()
    for chunk in _zeros(n):
        h.update(chunk)
    return h.hexdigest()


def _real_entries(directory, manifest, skip=()):
    return [
        (name, info["bytes"], [(directory / name).read_bytes()])
        for name, info in manifest["files"].items()
        if name not in skip
    ]


def _unpacked(cache):
    root = cache / "datastores" / "unpacked"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_an_entry_larger_than_its_manifest_says_is_refused_before_writing(built, cache, tmp_path, capsys):
    directory, _ = built
    manifest = json.loads((directory / "manifest.json").read_text())
    # tokens.bin claims (in its entry) 64 MiB of zeros; the manifest says a few KiB.
    entries = [("tokens.bin", 64 << 20, _zeros(64 << 20)), *_real_entries(directory, manifest, skip={"tokens.bin"})]
    bomb = _craft(tmp_path / "bomb.sssd.zst", manifest, entries)
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(sssd.DatastoreError, match=r"entry 'tokens.bin' declares 67,108,864 bytes, the manifest says"):
        sssd.Datastore.open(bomb)
    assert _unpacked(cache) == []  # the temporary directory was removed
    assert main(["verify", str(bomb)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "declares 67,108,864 bytes" in err


def test_a_decompression_bomb_is_refused_before_unpacking(built, cache, tmp_path, capsys, monkeypatch):
    directory, _ = built
    manifest = json.loads((directory / "manifest.json").read_text())
    # Honest about its size: 300 MiB of zeros (the sha256 is right), in an archive of a few KiB.
    big = 300 << 20
    manifest["files"]["tokens.bin"] = {"bytes": big, "sha256": _sha256_of_zeros(big)}
    entries = [("tokens.bin", big, _zeros(big)), *_real_entries(directory, manifest, skip={"tokens.bin"})]
    bomb = _craft(tmp_path / "bomb.sssd.zst", manifest, entries)
    with pytest.raises(
        sssd.DatastoreError,
        match=r"refusing to unpack: its manifest declares 3\d\d,\d{3},\d{3} bytes "
        r"uncompressed, more than the limit of 268,435,456",
    ):
        sssd.Datastore.open(bomb)
    assert _unpacked(cache) == []
    assert main(["verify", str(bomb)]) == 1 and "refusing to unpack" in capsys.readouterr().err
    # A manifest claiming a petabyte, with a limit raised to allow it: the disk cannot hold it.
    manifest["files"]["tokens.bin"] = {"bytes": 1 << 50, "sha256": "0" * 64}
    liar = _craft(tmp_path / "liar.sssd.zst", manifest, _real_entries(directory, manifest, skip={"tokens.bin"}))
    with pytest.raises(sssd.DatastoreError, match="refusing to unpack.*SSSD_MAX_UNPACKED_BYTES"):
        sssd.Datastore.open(liar)
    monkeypatch.setenv("SSSD_MAX_UNPACKED_BYTES", str(1 << 60))
    with pytest.raises(sssd.DatastoreError, match="not enough disk space to unpack it"):
        sssd.Datastore.open(liar)
    assert _unpacked(cache) == []


def test_entries_that_disagree_with_the_manifest_are_refused(built, cache, tmp_path):
    directory, _ = built
    manifest = json.loads((directory / "manifest.json").read_text())
    real = _real_entries(directory, manifest)
    cases = {
        "not listed": (real + [("extra.bin", 3, [b"abc"])], "entry 'extra.bin' is not listed in the manifest"),
        "twice": (real + [real[0]], "entry 'tokens.bin' appears twice"),
        "manifest again": (real + [("manifest.json", 2, [b"{}"])], "entry 'manifest.json' appears twice"),
    }
    for name, (entries, message) in cases.items():
        with pytest.raises(sssd.DatastoreError, match=message):
            sssd.Datastore.open(_craft(tmp_path / f"{name}.sssd.zst", manifest, entries))
        assert _unpacked(cache) == [], name
    huge = dict(manifest, padding="x" * (65 << 20))  # a "manifest" too large to be one
    with pytest.raises(sssd.DatastoreError, match="manifest.json entry declares .* a manifest is at most"):
        sssd.Datastore.open(_craft(tmp_path / "fat.sssd.zst", huge, real))
    evil = dict(manifest, files={"../escape.bin": {"bytes": 3, "sha256": "0" * 64}})
    with pytest.raises(sssd.DatastoreError, match="not a plain file name"):
        sssd.Datastore.open(_craft(tmp_path / "evil.sssd.zst", evil, []))
    assert _unpacked(cache) == [] and not (tmp_path / "escape.bin").exists()
