"""The offline datastore: a token stream plus its suffix array, memory-mapped.

On disk a datastore is a directory::

    manifest.json       format version, counts, tokenizer identity, checksums
    tokens.bin          64-byte header + uint32 token ids (separator 2^32 - 1)
    suffix_array.bin    64-byte header + uint32/uint64 suffix positions
    token_index.bin     64-byte header + uint64 first-token index

``Datastore.build`` writes it atomically: into a temporary sibling directory
that is renamed into place only once complete, so an interrupted or failed
build never leaves anything that loads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sssd import _core
from sssd._tokens import as_tokens
from sssd.files import file_sha256

SEPARATOR: int = int(_core.SEPARATOR)
FORMAT_VERSION: int = int(_core.FORMAT_VERSION)
MANIFEST = "manifest.json"
DATA_FILES = (str(_core.TOKENS_FILE), str(_core.SUFFIX_ARRAY_FILE), str(_core.TOKEN_INDEX_FILE))


class DatastoreError(_core.SSSDError):
    """A datastore is missing, corrupt, or incompatible."""


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Reads and checks a datastore's manifest.json.

    Raises:
        DatastoreError: missing, unreadable, not a manifest, or from a newer format.
    """
    path = Path(path)
    mf = path / MANIFEST
    if not path.exists():
        raise DatastoreError(f"datastore not found: {path}")
    if not mf.is_file():
        raise DatastoreError(f"{path} is not a datastore: {MANIFEST} is missing")
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatastoreError(f"{mf}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != "sssd-datastore":
        raise DatastoreError(f"{mf}: not an SSSD datastore manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise DatastoreError(f"{mf}: invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise DatastoreError(
            f"{mf}: format version {version} is newer than this sssd supports ({FORMAT_VERSION}); upgrade sssd"
        )
    return manifest


class Datastore:
    """A read-only datastore. Safe to share between threads.

    Open one from disk with :meth:`open` (mmap: constant time, shared between
    processes), build one with :meth:`build`, or make an in-memory one for
    small corpora and tests with :meth:`from_tokens`.
    """

    def __init__(self, native: _core.Datastore, path: Path | None = None, manifest: dict | None = None):
        self._native = native
        self.path = path
        self.manifest: dict[str, Any] = manifest or {}

    # -- construction -----------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> Datastore:
        """Maps the datastore at ``path``. Reads only headers and the manifest.

        ``path`` may also be a ``.sssd.zst`` archive (``sssd build --compress``):
        it is decompressed once into the cache, whose copy is then mapped.

        Raises:
            DatastoreError: missing files, bad magic/version/size, mismatched files.
        """
        path = Path(path).expanduser()
        if path.is_file():  # a compressed archive: unpacked once into the cache, then mapped
            from sssd.datastore_builder.archive import unpack_cached

            path = unpack_cached(path)
        manifest = read_manifest(path)
        try:
            native = _core.Datastore.open(str(path))
        except _core.SSSDError as e:
            raise DatastoreError(str(e)) from None
        if manifest.get("num_tokens") not in (None, native.size) or manifest.get("fingerprint") not in (
            None,
            f"{native.fingerprint:016x}",
        ):
            raise DatastoreError(f"{path}: {MANIFEST} does not describe the data files (rebuild it)")
        return cls(native, path, manifest)

    @classmethod
    def from_tokens(cls, tokens: Any, num_threads: int = 0) -> Datastore:
        """An in-memory datastore over ``tokens`` (separators = SEPARATOR)."""
        return cls(_core.Datastore.from_tokens(_stream(tokens), num_threads))

    @staticmethod
    def build(
        tokens: Any,
        path: str | Path,
        *,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
        num_threads: int = 0,
        progress: Callable[[int, int], None] | None = None,
    ) -> Datastore:
        """Builds a datastore directory from a token stream, atomically.

        Args:
            tokens: 1-D integer ids, documents separated by SEPARATOR.
            path: directory to create.
            metadata: extra manifest fields (tokenizer identity, sources...).
            overwrite: replace an existing datastore at ``path``.
            num_threads: OpenMP threads for sorting (0: all cores).
            progress: called as progress(done, total) while sorting.

        Raises:
            FileExistsError: ``path`` exists and overwrite is False.
            DatastoreError: I/O failure (e.g. disk full); nothing is left behind.
        """
        arr = _stream(tokens)
        path = Path(path).expanduser().absolute()
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} already exists (pass overwrite=True to replace it)")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a datastore is meant to be shared
        try:
            t0 = time.perf_counter()
            try:
                _core.Datastore.write(arr, str(tmp), num_threads, progress)
            except _core.SSSDError as e:
                raise DatastoreError(str(e)) from None
            stats = _core.stream_stats(arr, num_threads)
            manifest = {
                "format": "sssd-datastore",
                "format_version": FORMAT_VERSION,
                "num_tokens": int(stats["count"]),
                "num_docs": int(stats["num_docs"]),
                "vocab_size": int(stats["vocab_size"]),
                "fingerprint": f"{int(stats['fingerprint']):016x}",
                "index_bytes": 4 if arr.size < (1 << 32) - 2 else 8,
                "created_unix": int(time.time()),
                "build_seconds": round(time.perf_counter() - t0, 3),
                "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)} for name in DATA_FILES},
            }
            manifest.update(metadata or {})
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            _replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Datastore.open(path)

    # -- properties ---------------------------------------------------------
    @property
    def native(self) -> _core.Datastore:
        return self._native

    @property
    def size(self) -> int:
        """Tokens in the stream, separators included."""
        return int(self._native.size)

    def __len__(self) -> int:
        return self.size

    def warm(self) -> int:
        """Touches every page of the mapped files, so that the first queries
        take no page faults (a server does this at start-up). Returns bytes."""
        return int(self._native.warm())

    @property
    def num_docs(self) -> int:
        return int(self._native.num_docs)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size if recorded, else 1 + the largest id in the stream."""
        tok = self.manifest.get("tokenizer") or {}
        return int(tok.get("vocab_size") or self._native.vocab_size)

    def tokenizer_path(self) -> Path | None:
        """The tokenizer.json this datastore was built with (None if it records none).

        Resolved inside the datastore directory first, so a moved datastore
        still finds its own copy."""
        tok = self.manifest.get("tokenizer") or {}
        if self.path is not None and tok.get("file") and (self.path / tok["file"]).is_file():
            return self.path / tok["file"]
        return Path(tok["path"]) if tok.get("path") else None

    @property
    def tokens(self) -> np.ndarray:
        """Read-only uint32 view of the token stream (no copy)."""
        return self._native.tokens()

    @property
    def suffix_array(self) -> np.ndarray:
        """Read-only view of the suffix array (uint32 or uint64; no copy, no range checks)."""
        return self._native.suffix_array()

    def find(self, pattern: Any) -> tuple[int, int]:
        """[lo, hi) suffix-array ranks of the occurrences of ``pattern``."""
        lo, hi = self._native.find(as_tokens(pattern, "pattern"))
        return int(lo), int(hi)

    def count(self, pattern: Any) -> int:
        lo, hi = self.find(pattern)
        return hi - lo

    def positions(self, pattern: Any) -> np.ndarray:
        """Stream positions of every occurrence of ``pattern``, in suffix order."""
        lo, hi = self.find(pattern)
        return np.array([self._native.suffix(r) for r in range(lo, hi)], dtype=np.int64)

    def query(self, context: Any, **params: Any) -> dict[str, Any]:
        """The datastore source's continuation tree for ``context`` (parent-pointer arrays).

        Keyword args are DatastoreQuery fields: max_match, min_match,
        max_samples, min_occurrences, branch_len, end_token.
        """
        q = _core.DatastoreQuery()
        for k, v in params.items():
            if not hasattr(q, k):
                raise TypeError(f"unknown query parameter {k!r}")
            setattr(q, k, v)
        return self._native.query(as_tokens(context, "context"), q)

    def __repr__(self) -> str:
        where = str(self.path) if self.path else "memory"
        return f"Datastore({where}: {self.size:,} tokens, {self.num_docs:,} documents)"


def _stream(tokens: Any) -> np.ndarray:
    """A token stream: like as_tokens, but the separator id is allowed."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1:
        return np.ascontiguousarray(tokens)
    arr = np.asarray(tokens)
    if arr.dtype.kind not in "iu" and arr.size:
        raise TypeError(f"tokens: token ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise TypeError(f"tokens: expected a 1-D stream, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > SEPARATOR):
        bad = int(np.argmax((arr < 0) | (arr > SEPARATOR)))
        raise ValueError(f"tokens[{bad}] = {int(arr[bad])} is outside [0, {SEPARATOR}]")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _replace_dir(src: Path, dst: Path) -> None:
    """Moves the finished directory ``src`` to ``dst`` (replacing it) atomically."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, dst)
