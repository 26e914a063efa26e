"""sssd.files: atomic directories and files, the manifest writer."""

from __future__ import annotations

import json
import os

import pytest

from sssd.datastore import MANIFEST, write_manifest
from sssd.files import atomic_directory, write_atomic


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_atomic_directory_renames_into_place_with_the_usual_mode(tmp_path):
    target = tmp_path / "sub" / "out"
    with atomic_directory(target, replace=False, tag="making") as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(f".out.making-{os.getpid()}-")
        assert not target.exists()  # nothing at the target until the block ends
        (tmp / "a.txt").write_text("a")
    assert (target / "a.txt").read_text() == "a"
    assert _names(target.parent) == ["out"]
    assert target.stat().st_mode & 0o777 == 0o777 & ~_umask()


def test_atomic_directory_replaces_an_existing_target(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_directory(target, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
        assert (target / "old.txt").exists()  # readers see the old one while the new one is made
    assert _names(target) == ["new.txt"]
    assert _names(tmp_path) == ["out"]  # neither the temporary nor the old directory is left


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
@pytest.mark.parametrize("replace", [True, False])
def test_atomic_directory_removes_the_temporary_on_any_error(tmp_path, error, replace):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(type(error)):
        with atomic_directory(target, replace=replace) as tmp:
            (tmp / "half.txt").write_text("half")
            raise error
    assert _names(tmp_path) == ["out"] and _names(target) == ["old.txt"]


def test_atomic_directory_without_replace_keeps_the_winner_of_a_race(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target, replace=False) as tmp:
        (tmp / "mine.txt").write_text("mine")
        target.mkdir()  # another process finished first
        (target / "theirs.txt").write_text("theirs")
    assert _names(target) == ["theirs.txt"] and _names(tmp_path) == ["out"]


def test_atomic_directory_without_replace_raises_when_a_file_is_in_the_way(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(NotADirectoryError):
        with atomic_directory(target, replace=False) as tmp:
            (tmp / "mine.txt").write_text("mine")
            target.write_text("a file, not a lost race")
    assert _names(tmp_path) == ["out"] and target.read_text() == "a file, not a lost race"


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and _names(tmp_path) == ["f.json"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "f.json", b"x")
    assert _names(tmp_path) == ["f.json"]


def test_write_manifest_keeps_key_order_and_ends_with_a_newline(tmp_path):
    manifest = {"format": "sssd-datastore", "format_version": 1, "b": [1, 2], "a": {"z": 1, "y": 2}}
    path = write_manifest(tmp_path, manifest)
    text = path.read_text()
    assert path == tmp_path / MANIFEST and text.endswith("}\n") and not text.endswith("\n\n")
    assert list(json.loads(text)) == ["format", "format_version", "b", "a"] and json.loads(text) == manifest
    assert _names(tmp_path) == [MANIFEST]
