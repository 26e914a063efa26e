"""Single-file, zstandard-compressed distribution archives of datastores.

Layout of ``<name>.sssd.zst``::

    16-byte header, uncompressed:  magic b"SSSDPACK", uint32 version, uint32 reserved (0)
    one zstd frame (with content checksum) holding the entries back to back:
        uint16 name length, name (UTF-8), uint64 size, size bytes
    ... and a final entry with an empty name.

The first entry is manifest.json, so ``read_manifest`` decompresses only the
beginning. The others are the files the manifest lists. Opening an archive
(``Datastore.open`` does it) unpacks it once into
``<cache>/datastores/unpacked/<sha256 of the archive>/``, checking every
file's sha256 against the manifest, atomically (temporary directory, then
rename; a process that loses the race uses the winner's copy); later opens
hash the archive and map the cached directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from sssd.datastore import MANIFEST, DatastoreError
from sssd.files import file_sha256
from sssd.paths import cache_dir

MAGIC = b"SSSDPACK"
VERSION = 1
SUFFIX = ".sssd.zst"
_HEADER = struct.Struct("<8sII")
_NAME = struct.Struct("<H")
_SIZE = struct.Struct("<Q")
_COPY = 1 << 22


def archive_path_for(directory: str | Path) -> Path:
    """Where ``sssd build --compress`` puts the archive of ``directory``."""
    d = Path(directory)
    return d.with_name(d.name + SUFFIX)


def is_archive(path: str | Path) -> bool:
    """Whether ``path`` is a file starting with the archive magic."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def pack(directory: str | Path, archive: str | Path, *, level: int = 3, threads: int = -1,
         progress: Callable[[int], None] | None = None) -> Path:
    """Writes the datastore at ``directory`` into a compressed archive, atomically.

    Args:
        level: zstd level (3: fast; the suffix array compresses little at any level).
        threads: zstd worker threads (-1: all cores).
        progress: called with the number of input bytes after each piece.
    """
    import zstandard

    directory, archive = Path(directory), Path(archive)
    manifest_bytes = (directory / MANIFEST).read_bytes()
    names = list(json.loads(manifest_bytes).get("files", {}))
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{archive.name}.", dir=archive.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            raw.write(_HEADER.pack(MAGIC, VERSION, 0))
            cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
            with cctx.stream_writer(raw, closefd=False) as z:
                _write_entry(z, MANIFEST, len(manifest_bytes), [manifest_bytes])
                for name in names:
                    path = directory / name
                    _write_entry(z, name, path.stat().st_size, _chunks(path, progress))
                z.write(_NAME.pack(0))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return archive


def read_manifest(archive: str | Path) -> dict[str, Any]:
    """The manifest stored in an archive (decompresses only the first entry)."""
    with _ArchiveReader(archive) as entries:
        name, size, read = next(entries)
        if name != MANIFEST:
            raise DatastoreError(f"{archive}: corrupt archive (first entry is {name!r}, not {MANIFEST})")
        return _parse_manifest(read(size), archive)


def unpack_cached(archive: str | Path) -> Path:
    """The unpacked copy of ``archive`` in the cache, unpacking it first if needed.

    Raises:
        DatastoreError: not an archive, a newer archive version, or corrupt contents.
    """
    archive = Path(archive)
    if not is_archive(archive):
        raise DatastoreError(f"{archive} is neither a datastore directory nor an SSSD datastore archive ({SUFFIX})")
    digest = _sha256(archive)
    root = cache_dir() / "datastores" / "unpacked"
    target = root / digest
    if (target / MANIFEST).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.", dir=root))
    try:
        unpack(archive, tmp)
        _point_tokenizer_at(tmp, target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MANIFEST).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def unpack(archive: str | Path, directory: str | Path) -> dict[str, Any]:
    """Extracts an archive into an existing empty ``directory``, checking every sha256.

    Returns the manifest.
    """
    return _walk(archive, Path(directory))


def verify(archive: str | Path) -> dict[str, str]:
    """Checks every file of an archive against its manifest without writing anything.

    Returns:
        {name: "OK" or the reason it failed}.
    """
    results: dict[str, str] = {}
    _walk(archive, None, results)
    return results


# -- internals ----------------------------------------------------------------------

def _write_entry(z: BinaryIO, name: str, size: int, chunks) -> None:
    encoded = name.encode("utf-8")
    z.write(_NAME.pack(len(encoded)) + encoded + _SIZE.pack(size))
    written = 0
    for chunk in chunks:
        z.write(chunk)
        written += len(chunk)
    if written != size:
        raise OSError(f"{name} changed size while being archived")


def _chunks(path: Path, progress: Callable[[int], None] | None) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_COPY):
            if progress:
                progress(len(chunk))
            yield chunk


class _ArchiveReader:
    """Context manager iterating an archive's entries as (name, size, read(n))."""

    def __init__(self, archive: str | Path):
        self.archive = Path(archive)

    def __enter__(self) -> Iterator[tuple[str, int, Callable[[int], bytes]]]:
        import zstandard

        try:
            self.raw = open(self.archive, "rb")
        except FileNotFoundError:
            raise DatastoreError(f"datastore not found: {self.archive}") from None
        except OSError as e:
            raise DatastoreError(f"{self.archive}: cannot read ({e.strerror})") from None
        head = self.raw.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:8] != MAGIC:
            self.raw.close()
            raise DatastoreError(f"{self.archive} is neither a datastore directory nor an SSSD datastore archive")
        _, version, _ = _HEADER.unpack(head)
        if version > VERSION:
            self.raw.close()
            raise DatastoreError(f"{self.archive}: archive format version {version} is newer than this sssd supports ({VERSION}); upgrade sssd")
        self.z = zstandard.ZstdDecompressor().stream_reader(self.raw, read_across_frames=False)
        return self._entries()

    def _read(self, n: int) -> bytes:
        out = bytearray()
        try:
            while len(out) < n:
                chunk = self.z.read(n - len(out))
                if not chunk:
                    break
                out += chunk
        except Exception as e:  # zstandard.ZstdError
            raise DatastoreError(f"{self.archive}: corrupt archive ({e})") from None
        if len(out) < n:
            raise DatastoreError(f"{self.archive}: archive is truncated")
        return bytes(out)

    def _entries(self):
        while True:
            (length,) = _NAME.unpack(self._read(_NAME.size))
            if length == 0:
                return
            name = self._read(length).decode("utf-8", "replace")
            if "/" in name or "\\" in name or name in (".", ".."):
                raise DatastoreError(f"{self.archive}: corrupt archive (bad entry name {name!r})")
            (size,) = _SIZE.unpack(self._read(_SIZE.size))
            yield name, size, self._read

    def __exit__(self, *exc) -> None:
        self.z.close()
        self.raw.close()


def _walk(archive: str | Path, directory: Path | None, results: dict[str, str] | None = None) -> dict[str, Any]:
    """Reads every entry, checking sizes and sha256s; writes them to ``directory`` if given."""
    with _ArchiveReader(archive) as entries:
        name, size, read = next(entries)
        if name != MANIFEST:
            raise DatastoreError(f"{archive}: corrupt archive (first entry is {name!r}, not {MANIFEST})")
        raw_manifest = read(size)
        manifest = _parse_manifest(raw_manifest, archive)
        if directory is not None:
            (directory / MANIFEST).write_bytes(raw_manifest)
        expected = dict(manifest.get("files", {}))
        for name, size, read in entries:
            want = expected.pop(name, None)
            h = hashlib.sha256()
            with open(directory / name, "wb") if directory is not None else contextlib.nullcontext() as out:
                left = size
                while left:
                    chunk = read(min(left, _COPY))
                    h.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    left -= len(chunk)
            problem = None
            if want is None:
                problem = "not listed in the manifest"
            elif want.get("sha256") != h.hexdigest() or want.get("bytes", size) != size:
                problem = "checksum mismatch"
            if results is not None:
                results[name] = problem or "OK"
            elif problem:
                raise DatastoreError(f"{archive}: {name}: {problem} (corrupt archive)")
        for name in expected:
            if results is not None:
                results[name] = "missing from the archive"
            else:
                raise DatastoreError(f"{archive}: {name} is missing from the archive")
    return manifest


def _parse_manifest(data: bytes, archive: str | Path) -> dict[str, Any]:
    from sssd.datastore import FORMAT_VERSION

    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise DatastoreError(f"{archive}: unreadable manifest in archive ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "sssd-datastore":
        raise DatastoreError(f"{archive}: not an SSSD datastore archive")
    version = manifest.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise DatastoreError(f"{archive}: format version {version} is newer than this sssd supports ({FORMAT_VERSION}); upgrade sssd")
    return manifest


def _point_tokenizer_at(directory: Path, final: Path) -> None:
    """Makes the unpacked manifest's tokenizer path name the unpacked tokenizer.json."""
    tok_file = ((json.loads((directory / MANIFEST).read_text()).get("tokenizer")) or {}).get("file")
    if not tok_file or not (directory / tok_file).is_file():
        return
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["tokenizer"]["path"] = str(final / tok_file)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _sha256(path: Path) -> str:
    try:
        return file_sha256(path)
    except OSError as e:
        raise DatastoreError(f"{path}: cannot read ({e.strerror})") from None
