"""The offline datastore: a token stream plus its suffix array, memory-mapped.

On disk a datastore is a directory::

    manifest.json       format version, counts, tokenizer identity, checksums (sssd.manifest)
    tokens.bin          64-byte header + uint32 token ids (separator 2^32 - 1)
    suffix_array.bin    64-byte header + uint32/uint64 suffix positions
    token_index.bin     64-byte header + uint64 first-token index

or a compressed single-file archive of one (sssd.archive), unpacked once into the cache.

``Datastore.build`` writes it atomically: into a temporary sibling directory
that is renamed into place only once complete (sssd.files.atomic_directory),
so an interrupted or failed build never leaves anything that loads.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sssd import _core
from sssd._tokens import as_tokens
from sssd.archive import unpack_cached
from sssd.cache import default_datastore_path
from sssd.errors import DatastoreError
from sssd.files import atomic_directory, check_regular, file_inside, file_sha256
from sssd.manifest import FORMAT_VERSION, MANIFEST, read_manifest, tokenizer_file, tokenizer_mismatch, write_manifest
from sssd.tokenizer import load_tokenizer

SEPARATOR: int = int(_core.SEPARATOR)
DATA_FILES = (str(_core.TOKENS_FILE), str(_core.SUFFIX_ARRAY_FILE), str(_core.TOKEN_INDEX_FILE))
#: The name that Datastore.open (and sssd.Drafter, ``sssd serve``) takes for the default datastore.
DEFAULT = "default"


#: How a datastore's pages are kept in memory (Datastore.make_resident).
RESIDENCY = {
    "lazy": "read on first use: the first queries pay page faults (from disk when cold)",
    "warm": "all read in at open; the kernel may reclaim them under memory pressure",
    "lock": "read in and pinned (mlock): never reclaimed; needs RLIMIT_MEMLOCK or CAP_IPC_LOCK",
}


def built_default_path() -> Path:
    """The default datastore's directory (sssd.default_datastore_path(): $SSSD_DATASTORE, else
    ``<SSSD cache>/datastores/sharegpt-smollm2``), if it is built. Never builds it.

    Raises:
        FileNotFoundError: it is not built yet; the one-line message names the command that builds it.
    """
    path = default_datastore_path()
    if not (path / MANIFEST).exists():
        raise FileNotFoundError(
            f"the default datastore is not built yet (looked in {path}); build it with "
            "`sssd build --default`, or point SSSD_DATASTORE at a datastore directory"
        )
    return path


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
        """Maps a datastore (memory-mapped: reads only the headers and the manifest, and
        checks the data files' structure in the native core).

        ``path`` is one of:

        * a datastore directory (``sssd build -o DIR``, :meth:`build`);
        * a ``.sssd.zst`` archive (``sssd build --compress``): unpacked once, with every
          sha256 checked, into ``<SSSD cache>/datastores/unpacked/<sha256 of the archive>``,
          whose copy is then mapped (later opens hash the archive and map the copy);
        * the string ``"default"``: the default datastore, the one ``sssd serve`` and
          ``sssd.draft`` use (:func:`built_default_path`). It is never built here.
          (A folder named "default" opens as ``Path("default")`` or ``"./default"``.)

        Raises:
            FileNotFoundError: ``"default"`` and the default datastore is not built yet
                (the message names ``sssd build --default``).
            DatastoreError (also a ValueError and an sssd.SSSDError): nothing at ``path``;
                not a datastore directory or archive; a manifest that is missing,
                unreadable, malformed or from a newer format; a data file that is missing,
                not a regular file (a FIFO is refused without blocking) or outside the
                folder; corrupt or mismatched data files (bad magic, version, size,
                fingerprint or contents); an archive that is corrupt, truncated, or
                larger than the unpack limit or the free disk space.
        """
        if isinstance(path, str) and path == DEFAULT:
            path = built_default_path()
        path = Path(path).expanduser()
        if path.is_file():  # a compressed archive: unpacked once into the cache, then mapped
            path = unpack_cached(path)
        manifest = read_manifest(path)
        for name in DATA_FILES:
            try:
                file_inside(path, name, "data file")
            except ValueError as e:
                raise DatastoreError(str(e)) from None
        try:
            native = _core.Datastore.open(str(path))
        except _core.SSSDError as e:
            raise DatastoreError(str(e)) from None
        if manifest.get("num_tokens") not in (None, native.size) or manifest.get("fingerprint") not in (
            None,
            f"{native.fingerprint:016x}",
        ):
            raise DatastoreError(f"{path}: {MANIFEST} does not describe the data files (rebuild it)")
        vocab = (manifest.get("tokenizer") or {}).get("vocab_size")
        if vocab is not None and vocab < native.vocab_size:
            raise DatastoreError(
                f"{path / MANIFEST}: the tokenizer's vocab_size is {vocab}, but the token stream holds ids up to "
                f"{native.vocab_size - 1}; the manifest does not describe this datastore (run `sssd verify {path}`)"
            )
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
        with atomic_directory(path, replace=True, tag="building") as tmp:
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
                "files": {
                    name: {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
                    for name in DATA_FILES
                },
            }
            manifest.update(metadata or {})
            write_manifest(tmp, manifest)
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
        """Reads every page of the mapped files in, so that the first queries
        take no page faults (a server does this at start-up); the kernel may
        reclaim them later under memory pressure. Returns bytes."""
        return int(self._native.warm())

    def lock(self) -> int:
        """Pins every page of the mapped files in memory (mlock) for as long as
        this datastore is open: no query ever faults on it. Returns bytes.

        Raises:
            sssd.SSSDError: the lockable-memory limit (RLIMIT_MEMLOCK) is too low;
                the message says how much was asked for and how to raise it.
        """
        return int(self._native.lock())

    def make_resident(self, residency: str) -> int:
        """Applies a residency mode (RESIDENCY): "lazy" reads pages on first
        use, "warm" reads them all now, "lock" also pins them. Returns the
        bytes read in or pinned (0 for lazy)."""
        if residency not in RESIDENCY:
            raise ValueError(f"residency must be one of {', '.join(RESIDENCY)}, got {residency!r}")
        return 0 if residency == "lazy" else self.warm() if residency == "warm" else self.lock()

    def resident_bytes(self) -> int:
        """Bytes of the mapped files now in memory (mincore)."""
        return int(self._native.resident_bytes())

    def page_out(self) -> bool:
        """Asks the kernel to reclaim the unlocked pages now, as memory pressure
        would (for benchmarks). False where the kernel cannot (Linux < 5.4)."""
        return bool(self._native.page_out())

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

        A builder-made datastore keeps its own copy, recorded by name ("file"),
        which must be a plain file inside the datastore directory (so a moved
        datastore finds it, and a manifest cannot point anywhere else); without
        one, the recorded absolute "path" is used.

        Raises:
            DatastoreError: the recorded file is missing, not a regular file, or
                (through a symbolic link) outside the datastore directory.
        """
        tok = self.manifest.get("tokenizer") or {}
        if tok.get("file") and self.path is not None:
            return tokenizer_file(self.path, self.manifest)
        return Path(tok["path"]) if tok.get("path") else None

    def load_tokenizer(self) -> Any:
        """Loads the tokenizer this datastore records (:meth:`tokenizer_path`) and checks
        that it is the one the manifest names (same sha256 identity and vocabulary).

        Returns:
            an ``sssd.tokenizer.Tokenizer``, or None if the datastore records none.

        Raises:
            DatastoreError: the file is missing or is not the tokenizer the manifest records.
            ValueError: the file is not a loadable tokenizer.
        """
        path = self.tokenizer_path()
        if path is None:
            return None
        if not path.is_dir():
            try:
                check_regular(path)  # a FIFO would block the loader
            except FileNotFoundError:
                raise DatastoreError(f"{self.path}: the tokenizer {path} its manifest records is missing") from None
            except OSError as e:
                raise DatastoreError(str(e)) from None
        tok = load_tokenizer(path)
        problem = tokenizer_mismatch(self.manifest.get("tokenizer") or {}, tok)
        if problem:
            raise DatastoreError(f"{self.path}: {problem} (run `sssd verify {self.path}`)")
        return tok

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
        max_samples, min_occurrences, branch_len, branch_per_match,
        max_branch_len, match_boost, end_token (DrafterConfig documents them).
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
