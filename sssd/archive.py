"""Single-file, zstandard-compressed distribution archives of datastores: the format,
and reading one (``sssd build --compress`` writes them: sssd.datastore_builder.archive).

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

An archive is not trusted to be what it says (a decompression bomb is a few
kilobytes that expand to terabytes): before anything is written, the
manifest entry must be small, every file it lists must state its size, and
the total must fit both a limit (:func:`unpack_limit`: MAX_RATIO times the
archive's size, at least MIN_UNPACK_LIMIT, or $SSSD_MAX_UNPACKED_BYTES) and
the free disk space; every entry must then be a file the manifest lists,
once, of exactly the size it states, and the byte count is kept while
streaming. Any violation stops the unpacking and removes what was written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sssd.cache import cache_dir
from sssd.errors import DatastoreError
from sssd.files import atomic_directory, file_sha256, open_regular
from sssd.manifest import MANIFEST, MAX_MANIFEST_BYTES, check_manifest, tokenizer_mismatch, write_manifest
from sssd.tokenizer import Tokenizer

MAGIC = b"SSSDPACK"
VERSION = 1
SUFFIX = ".sssd.zst"
#: The uncompressed header (magic, version, reserved), and an entry's name length and size.
HEADER = struct.Struct("<8sII")
ENTRY_NAME = struct.Struct("<H")
ENTRY_SIZE = struct.Struct("<Q")
#: Bytes copied at a time.
CHUNK = 1 << 22

#: An archive may unpack to at most MAX_RATIO times its own size (a datastore
#: compresses about 1.5 times: its suffix array is nearly incompressible) ...
MAX_RATIO = 64
#: ... or MIN_UNPACK_LIMIT bytes, whichever is larger ...
MIN_UNPACK_LIMIT = 256 << 20
#: ... unless this environment variable sets the limit (in bytes).
LIMIT_ENV = "SSSD_MAX_UNPACKED_BYTES"
#: Space left free on the disk after unpacking.
DISK_MARGIN = 64 << 20


def is_archive(path: str | Path) -> bool:
    """Whether ``path`` is a regular file starting with the archive magic (never blocks on a FIFO)."""
    try:
        with open_regular(path) as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def unpack_limit(archive: str | Path) -> int:
    """The most bytes ``archive`` may unpack to: $SSSD_MAX_UNPACKED_BYTES if set, else
    MAX_RATIO times the archive's size, at least MIN_UNPACK_LIMIT.

    Raises:
        DatastoreError: $SSSD_MAX_UNPACKED_BYTES is not a positive integer.
    """
    env = os.environ.get(LIMIT_ENV, "").strip()
    if env:
        try:
            limit = int(env)
        except ValueError:
            limit = 0
        if limit <= 0:
            raise DatastoreError(f"{LIMIT_ENV}={env!r} is not a positive number of bytes")
        return limit
    return max(MIN_UNPACK_LIMIT, MAX_RATIO * os.stat(archive).st_size)


def read_manifest(archive: str | Path) -> dict[str, Any]:
    """The manifest stored in an archive (decompresses only the first entry)."""
    with _ArchiveReader(archive) as entries:
        return _parse_manifest(_manifest_entry(entries, archive), archive)


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
    try:
        # Named by the archive's sha256: a process that loses the race to unpack it keeps the winner's copy.
        with atomic_directory(target, replace=False, tag="unpacking") as tmp:
            unpack(archive, tmp)
            _point_tokenizer_at(tmp, target)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DatastoreError(
                f"{archive}: no space left on the device holding {root} while unpacking (nothing was kept)"
            ) from None
        raise
    if not (target / MANIFEST).is_file():
        raise DatastoreError(
            f"{target} is in the way of unpacking {archive}: it is not a complete unpacked datastore; remove it"
        )
    return target


def unpack(archive: str | Path, directory: str | Path) -> dict[str, Any]:
    """Extracts an archive into an existing empty ``directory``, checking every sha256,
    every entry's size against the manifest, and the total against :func:`unpack_limit`
    and the free disk space (before writing anything).

    Returns the manifest.

    Raises:
        DatastoreError: corrupt, truncated, too large for the limit or the disk, or
            its entries disagree with its manifest. What was written stays in
            ``directory`` for the caller to remove (unpack_cached does).
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


class _ArchiveReader:
    """Context manager iterating an archive's entries as (name, size, read(n))."""

    def __init__(self, archive: str | Path):
        self.archive = Path(archive)

    def __enter__(self) -> Iterator[tuple[str, int, Callable[[int], bytes]]]:
        import zstandard  # a native library, loaded only when an archive is read: `import sssd` stays light

        try:
            self.raw = open_regular(self.archive)
        except FileNotFoundError:
            raise DatastoreError(f"datastore not found: {self.archive}") from None
        except OSError as e:
            raise DatastoreError(f"{self.archive}: cannot read ({e.strerror or e})") from None
        head = self.raw.read(HEADER.size)
        if len(head) < HEADER.size or head[:8] != MAGIC:
            self.raw.close()
            raise DatastoreError(f"{self.archive} is neither a datastore directory nor an SSSD datastore archive")
        _, version, _ = HEADER.unpack(head)
        if version > VERSION:
            self.raw.close()
            raise DatastoreError(
                f"{self.archive}: archive format version {version} is newer than this sssd supports ({VERSION}); upgrade sssd"
            )
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
            (length,) = ENTRY_NAME.unpack(self._read(ENTRY_NAME.size))
            if length == 0:
                return
            name = self._read(length).decode("utf-8", "replace")
            if "/" in name or "\\" in name or name in (".", "..") or any(ord(c) < 32 for c in name):
                raise DatastoreError(f"{self.archive}: corrupt archive (bad entry name {name!r})")
            (size,) = ENTRY_SIZE.unpack(self._read(ENTRY_SIZE.size))
            yield name, size, self._read

    def __exit__(self, *exc) -> None:
        self.z.close()
        self.raw.close()


def _manifest_entry(entries, archive: str | Path) -> bytes:
    """The first entry's bytes, which must be a manifest of at most MAX_MANIFEST_BYTES."""
    name, size, read = next(entries)
    if name != MANIFEST:
        raise DatastoreError(f"{archive}: corrupt archive (first entry is {name!r}, not {MANIFEST})")
    if size > MAX_MANIFEST_BYTES:
        raise DatastoreError(
            f"{archive}: corrupt archive (its {MANIFEST} entry declares {size:,} bytes; a manifest "
            f"is at most {MAX_MANIFEST_BYTES:,})"
        )
    return read(size)


#: verify() checks the tokenizer's identity if its file is at most this large.
MAX_TOKENIZER_BYTES = 256 << 20


def _walk(archive: str | Path, directory: Path | None, results: dict[str, str] | None = None) -> dict[str, Any]:
    """Reads every entry, checking sizes and sha256s; writes them to ``directory`` if given.

    Nothing is written before the manifest's declared sizes have been checked
    against the limit and the free space; an entry is written only if the
    manifest lists it, once, with the size the entry states.
    """
    with _ArchiveReader(archive) as entries:
        raw_manifest = _manifest_entry(entries, archive)
        manifest = _parse_manifest(raw_manifest, archive)
        expected = dict(manifest.get("files") or {})
        unsized = [name for name, info in expected.items() if "bytes" not in info]
        if unsized:
            raise DatastoreError(f"{archive}: corrupt archive (its manifest gives no size for {', '.join(unsized)})")
        declared = len(raw_manifest) + sum(info["bytes"] for info in expected.values())
        limit = unpack_limit(archive)
        if declared > limit:
            raise DatastoreError(
                f"{archive}: refusing to unpack: its manifest declares {declared:,} bytes uncompressed, more than the "
                f"limit of {limit:,} ({MAX_RATIO} times the archive's size, at least {MIN_UNPACK_LIMIT >> 20} MiB; "
                f"set {LIMIT_ENV} to allow more)"
            )
        if directory is not None:
            free = shutil.disk_usage(directory).free
            if declared + DISK_MARGIN > free:
                raise DatastoreError(
                    f"{archive}: not enough disk space to unpack it into {directory.parent}: it needs "
                    f"{declared / 2**20:,.0f} MiB, {free / 2**20:,.0f} MiB are free"
                )
            (directory / MANIFEST).write_bytes(raw_manifest)
        tok_name = (manifest.get("tokenizer") or {}).get("file")
        tok_bytes: bytes | None = None
        total = len(raw_manifest)
        for name, size, read in entries:
            want = expected.pop(name, None)
            if want is None:
                again = name == MANIFEST or name in (manifest.get("files") or {})
                raise DatastoreError(
                    f"{archive}: corrupt archive (entry {name!r} "
                    f"{'appears twice' if again else 'is not listed in the manifest'})"
                )
            if size != want["bytes"]:
                raise DatastoreError(
                    f"{archive}: corrupt archive (entry {name!r} declares {size:,} bytes, the "
                    f"manifest says {want['bytes']:,})"
                )
            h = hashlib.sha256()
            keep = name == tok_name and results is not None and size <= MAX_TOKENIZER_BYTES
            kept = bytearray()
            with open(directory / name, "xb") if directory is not None else contextlib.nullcontext() as out:
                left = size
                while left:
                    chunk = read(min(left, CHUNK))
                    left -= len(chunk)
                    total += len(chunk)
                    if total > declared or total > limit:  # cannot happen given the checks above; never trust it
                        raise DatastoreError(f"{archive}: corrupt archive (more data than its manifest declares)")
                    h.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    if keep:
                        kept += chunk
            problem = None
            if want.get("sha256") != h.hexdigest():
                problem = "checksum mismatch"
            elif keep:
                tok_bytes = bytes(kept)
            if results is not None:
                results[name] = problem or "OK"
            elif problem:
                raise DatastoreError(f"{archive}: {name}: {problem} (corrupt archive)")
        for name in expected:
            if results is not None:
                results[name] = "missing from the archive"
            else:
                raise DatastoreError(f"{archive}: {name} is missing from the archive")
        if results is not None and tok_bytes is not None:
            results["tokenizer identity"] = _tokenizer_identity_check(tok_bytes, manifest)
    return manifest


def _tokenizer_identity_check(data: bytes, manifest: dict[str, Any]) -> str:
    """ "OK" if ``data`` (a tokenizer.json) is the tokenizer the manifest records, else why not."""
    from tokenizers import Tokenizer as Backend  # heavy (a native library): imported only to verify an archive

    recorded = manifest.get("tokenizer") or {}
    try:
        tok = Tokenizer(
            Backend.from_str(data.decode("utf-8")), name=str(recorded.get("name")), path=Path(recorded["file"])
        )
    except Exception as e:  # the tokenizers library raises plain Exception subclasses
        return f"{recorded['file']} is not a valid tokenizer.json ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
    return tokenizer_mismatch(recorded, tok) or "OK"


def _parse_manifest(data: bytes, archive: str | Path) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise DatastoreError(f"{archive}: unreadable manifest in archive ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "sssd-datastore":
        raise DatastoreError(f"{archive}: not an SSSD datastore archive")
    return check_manifest(manifest, f"{archive}: {MANIFEST}")


def _point_tokenizer_at(directory: Path, final: Path) -> None:
    """Makes the unpacked manifest's tokenizer path name the unpacked tokenizer.json."""
    manifest = json.loads((directory / MANIFEST).read_text())
    tok_file = (manifest.get("tokenizer") or {}).get("file")
    if not tok_file or not (directory / tok_file).is_file():
        return
    manifest["tokenizer"]["path"] = str(final / tok_file)
    write_manifest(directory, manifest)


def _sha256(path: Path) -> str:
    try:
        return file_sha256(path)
    except OSError as e:
        raise DatastoreError(f"{path}: cannot read ({e.strerror})") from None
