"""The offline datastore: a token stream plus its suffix array, memory-mapped.

On disk a datastore is a directory::

    manifest.json       format version, counts, tokenizer identity, checksums
    tokens.bin          64-byte header + uint32 token ids (separator 2^32 - 1)
    suffix_array.bin    64-byte header + uint32/uint64 suffix positions
    token_index.bin     64-byte header + uint64 first-token index

``Datastore.build`` writes it atomically: into a temporary sibling directory
that is renamed into place only once complete (sssd.files.atomic_directory),
so an interrupted or failed build never leaves anything that loads.
"""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sssd import _core
from sssd._tokens import as_tokens
from sssd.files import (NotRegularFileError, atomic_directory, check_regular, describe_mode, file_inside, file_sha256,
                        is_plain_name, read_bytes, write_atomic)

SEPARATOR: int = int(_core.SEPARATOR)
FORMAT_VERSION: int = int(_core.FORMAT_VERSION)
MANIFEST = "manifest.json"
DATA_FILES = (str(_core.TOKENS_FILE), str(_core.SUFFIX_ARRAY_FILE), str(_core.TOKEN_INDEX_FILE))
#: The name that Datastore.open (and sssd.Drafter, ``sssd serve``) takes for the default datastore.
DEFAULT = "default"


#: How a datastore's pages are kept in memory (Datastore.make_resident).
RESIDENCY = {
    "lazy": "read on first use: the first queries pay page faults (from disk when cold)",
    "warm": "all read in at open; the kernel may reclaim them under memory pressure",
    "lock": "read in and pinned (mlock): never reclaimed; needs RLIMIT_MEMLOCK or CAP_IPC_LOCK",
}


class DatastoreError(_core.SSSDError, ValueError):
    """A datastore is missing, corrupt, or incompatible.

    Both an ``sssd.SSSDError`` (as every error of the native core) and a ValueError
    (a bad datastore is a bad argument), so ``except ValueError`` catches it too;
    so is the core's own error for corrupt data files (``_core.CorruptDatastoreError``).
    """


#: A manifest is a few kilobytes; a larger "manifest" is refused unread.
MAX_MANIFEST_BYTES = 64 << 20


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Reads and checks a datastore's manifest.json (see :func:`check_manifest`).

    Raises:
        DatastoreError: missing, unreadable, not a regular file, not a manifest,
            from a newer format, or with malformed entries.
    """
    path = Path(path)
    mf = path / MANIFEST
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DatastoreError(f"datastore not found: {path}") from None
    except OSError as e:
        raise DatastoreError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISDIR(mode):
        kind = "a file" if stat.S_ISREG(mode) else describe_mode(mode)
        raise DatastoreError(f"{path} is {kind}, not a datastore directory or archive")
    try:
        data = read_bytes(mf, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise DatastoreError(f"{path} is not a datastore: {MANIFEST} is missing") from None
    except NotRegularFileError as e:
        raise DatastoreError(str(e)) from None
    except (OSError, ValueError) as e:
        raise DatastoreError(f"{mf}: unreadable manifest ({getattr(e, 'strerror', None) or e})") from None
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise DatastoreError(f"{mf}: unreadable manifest ({e})") from None
    return check_manifest(manifest, mf)


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> Path:
    """Writes ``manifest`` as ``directory``/manifest.json, atomically (a temporary file beside
    it, then os.replace): keys in their given order, indented by 2, with a trailing newline.

    Returns the manifest file's path.
    """
    path = Path(directory) / MANIFEST
    write_atomic(path, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    return path


def built_default_path() -> Path:
    """The default datastore's directory (sssd.default_datastore_path(): $SSSD_DATASTORE, else
    ``<SSSD cache>/datastores/sharegpt-smollm2``), if it is built. Never builds it.

    Raises:
        FileNotFoundError: it is not built yet; the one-line message names the command that builds it.
    """
    from sssd.paths import default_datastore_path

    path = default_datastore_path()
    if not (path / MANIFEST).exists():
        raise FileNotFoundError(f"the default datastore is not built yet (looked in {path}); build it with "
                                "`sssd build --default`, or point SSSD_DATASTORE at a datastore directory")
    return path


def check_manifest(manifest: Any, where: str | Path) -> dict[str, Any]:
    """Checks a parsed manifest's shape: its format and version, that every "files"
    entry is a plain file name with a byte count and sha256, the counts are
    non-negative integers, and the "tokenizer" entry (if any) is well formed.

    Returns ``manifest``.

    Raises:
        DatastoreError: the first problem, naming ``where`` and the entry.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != "sssd-datastore":
        raise DatastoreError(f"{where}: not an SSSD datastore manifest")
    version = manifest.get("format_version")
    if not _is_int(version) or version < 1:
        raise DatastoreError(f"{where}: invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise DatastoreError(
            f"{where}: format version {version} is newer than this sssd supports ({FORMAT_VERSION}); upgrade sssd"
        )
    for key in ("num_tokens", "num_docs", "vocab_size", "index_bytes"):
        if manifest.get(key) is not None and not (_is_int(manifest[key]) and manifest[key] >= 0):
            raise DatastoreError(f"{where}: {key} is {manifest[key]!r}, not a non-negative integer")
    if manifest.get("fingerprint") is not None and not isinstance(manifest["fingerprint"], str):
        raise DatastoreError(f"{where}: fingerprint is {manifest['fingerprint']!r}, not a string")
    files = manifest.get("files")
    if files is not None:
        if not isinstance(files, dict):
            raise DatastoreError(f"{where}: \"files\" is a {type(files).__name__}, not an object")
        for name, info in files.items():
            if not is_plain_name(name) or name == MANIFEST:
                raise DatastoreError(f"{where}: file entry {name!r} is not a plain file name inside the datastore "
                                     "folder; refusing to use it")
            if not isinstance(info, dict):
                raise DatastoreError(f"{where}: file entry {name!r} is a {type(info).__name__}, not an object")
            if "bytes" in info and not (_is_int(info["bytes"]) and info["bytes"] >= 0):
                raise DatastoreError(f"{where}: file entry {name!r} has bytes {info['bytes']!r}, not a non-negative integer")
            if "sha256" in info and not _is_sha256(info["sha256"]):
                raise DatastoreError(f"{where}: file entry {name!r} has sha256 {info['sha256']!r}, not 64 hex digits")
    hold = manifest.get("holdout")
    if hold is not None and not (isinstance(hold, dict) and (hold.get("file") is None or is_plain_name(hold["file"]))):
        raise DatastoreError(f"{where}: holdout file {hold.get('file') if isinstance(hold, dict) else hold!r} is not a "
                             "plain file name inside the datastore folder; refusing to use it")
    tok = manifest.get("tokenizer")
    if tok is not None:
        if not isinstance(tok, dict):
            raise DatastoreError(f"{where}: \"tokenizer\" is a {type(tok).__name__}, not an object")
        if tok.get("file") is not None and not is_plain_name(tok["file"]):
            raise DatastoreError(f"{where}: tokenizer file {tok['file']!r} is not a plain file name inside the "
                                 "datastore folder; refusing to use it")
        for key in ("path", "name"):
            if tok.get(key) is not None and not isinstance(tok[key], str):
                raise DatastoreError(f"{where}: tokenizer {key} is {tok[key]!r}, not a string")
        if tok.get("sha256") is not None and not _is_sha256(tok["sha256"]):
            raise DatastoreError(f"{where}: tokenizer sha256 is {tok['sha256']!r}, not 64 hex digits")
        vocab = tok.get("vocab_size")
        if vocab is not None and not (_is_int(vocab) and 0 < vocab <= SEPARATOR):
            raise DatastoreError(f"{where}: tokenizer vocab_size is {vocab!r}, not an integer in [1, 2^32 - 1]")
        eos = tok.get("eos_token_id")
        if eos is not None and not (_is_int(eos) and 0 <= eos < (vocab or SEPARATOR)):
            raise DatastoreError(f"{where}: tokenizer eos_token_id is {eos!r}, not a token id of the vocabulary")
    return manifest


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_sha256(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


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
            from sssd.datastore_builder.archive import unpack_cached

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
                "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)} for name in DATA_FILES},
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
        from sssd.tokenizer import load_tokenizer

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


def tokenizer_file(folder: Path, manifest: dict[str, Any]) -> Path | None:
    """The tokenizer file a datastore directory's manifest records by name ("file"), or None.

    Raises:
        DatastoreError: the file is missing, not a regular file, not a plain name, or
            a symbolic link leading out of ``folder``.
    """
    name = (manifest.get("tokenizer") or {}).get("file")
    if not name:
        return None
    try:
        path = file_inside(folder, name, "tokenizer file")
        check_regular(path)
    except FileNotFoundError:
        raise DatastoreError(f"{folder}: the tokenizer file {name!r} its manifest records is missing "
                             "(run `sssd verify`; rebuild or re-copy the datastore)") from None
    except (ValueError, OSError) as e:
        raise DatastoreError(str(e)) from None
    return path


def tokenizer_mismatch(recorded: dict[str, Any], tok: Any) -> str | None:
    """Why a loaded tokenizer is not the one a manifest's "tokenizer" entry records, or None."""
    if recorded.get("sha256") and recorded["sha256"] != tok.sha256:
        return (f"the tokenizer file {tok.path} (sha256 {tok.sha256[:12]}, vocab {tok.vocab_size}) is not the tokenizer "
                f"the manifest records (sha256 {recorded['sha256'][:12]}, vocab {recorded.get('vocab_size')})")
    if recorded.get("vocab_size") is not None and recorded["vocab_size"] != tok.vocab_size:
        return (f"the tokenizer file {tok.path} has {tok.vocab_size} ids, the manifest records vocab_size "
                f"{recorded['vocab_size']}")
    return None


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

