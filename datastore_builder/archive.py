"""Writing single-file, zstandard-compressed distribution archives of datastores
(``sssd build --compress``).

The format, and reading, checking and unpacking an archive, are the library's
(sssd.archive: ``Datastore.open`` unpacks one); this module writes one. Layout of
``<name>.sssd.zst``::

    16-byte header, uncompressed:  magic b"SSSDPACK", uint32 version, uint32 reserved (0)
    one zstd frame (with content checksum) holding the entries back to back:
        uint16 name length, name (UTF-8), uint64 size, size bytes
    ... and a final entry with an empty name.

The first entry is manifest.json; the others are the files the manifest lists.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from sssd.archive import CHUNK, ENTRY_NAME, ENTRY_SIZE, HEADER, MAGIC, SUFFIX, VERSION
from sssd.errors import DatastoreError
from sssd.files import check_regular, file_inside, open_regular
from sssd.manifest import MANIFEST
from sssd.manifest import read_manifest as read_directory_manifest


def archive_path_for(directory: str | Path) -> Path:
    """Where ``sssd build --compress`` puts the archive of ``directory``."""
    d = Path(directory)
    return d.with_name(d.name + SUFFIX)


def pack(
    directory: str | Path,
    archive: str | Path,
    *,
    level: int = 3,
    threads: int = -1,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Writes the datastore at ``directory`` into a compressed archive, atomically.

    Args:
        level: zstd level (3: fast; the suffix array compresses little at any level).
        threads: zstd worker threads (-1: all cores).
        progress: called with the number of input bytes after each piece.
    """
    import zstandard  # a native library, loaded only when an archive is written

    directory, archive = Path(directory), Path(archive)
    names = list(read_directory_manifest(directory).get("files") or {})  # checked: plain names only
    for name in names:
        try:
            file_inside(directory, name)
        except ValueError as e:
            raise DatastoreError(str(e)) from None
    manifest_bytes = (directory / MANIFEST).read_bytes()
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{archive.name}.", dir=archive.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            raw.write(HEADER.pack(MAGIC, VERSION, 0))
            cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
            with cctx.stream_writer(raw, closefd=False) as z:
                _write_entry(z, MANIFEST, len(manifest_bytes), [manifest_bytes])
                for name in names:
                    path = directory / name
                    _write_entry(z, name, check_regular(path).st_size, _chunks(path, progress))
                z.write(ENTRY_NAME.pack(0))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return archive


def _write_entry(z: BinaryIO, name: str, size: int, chunks) -> None:
    encoded = name.encode("utf-8")
    z.write(ENTRY_NAME.pack(len(encoded)) + encoded + ENTRY_SIZE.pack(size))
    written = 0
    for chunk in chunks:
        z.write(chunk)
        written += len(chunk)
    if written != size:
        raise OSError(f"{name} changed size while being archived")


def _chunks(path: Path, progress: Callable[[int], None] | None) -> Iterator[bytes]:
    with open_regular(path) as f:
        while chunk := f.read(CHUNK):
            if progress:
                progress(len(chunk))
            yield chunk
