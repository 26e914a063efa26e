"""A datastore's manifest.json: reading, checking and writing it, and the tokenizer it records.

On disk a datastore is a directory holding manifest.json (format version, counts,
tokenizer identity, the data files' sizes and checksums) beside its data files
(sssd.datastore). Both the directory and a compressed archive (sssd.archive) carry
the manifest; both check it here.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from sssd import _core
from sssd.errors import DatastoreError
from sssd.files import (
    NotRegularFileError,
    check_regular,
    describe_mode,
    file_inside,
    is_plain_name,
    read_bytes,
    write_atomic,
)

#: The datastore format version this sssd reads and writes (a manifest's "format_version").
FORMAT_VERSION: int = int(_core.FORMAT_VERSION)
MANIFEST = "manifest.json"
#: Token ids are below the document separator (2^32 - 1).
_MAX_VOCAB = int(_core.SEPARATOR)

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
            raise DatastoreError(f'{where}: "files" is a {type(files).__name__}, not an object')
        for name, info in files.items():
            if not is_plain_name(name) or name == MANIFEST:
                raise DatastoreError(
                    f"{where}: file entry {name!r} is not a plain file name inside the datastore "
                    "folder; refusing to use it"
                )
            if not isinstance(info, dict):
                raise DatastoreError(f"{where}: file entry {name!r} is a {type(info).__name__}, not an object")
            if "bytes" in info and not (_is_int(info["bytes"]) and info["bytes"] >= 0):
                raise DatastoreError(
                    f"{where}: file entry {name!r} has bytes {info['bytes']!r}, not a non-negative integer"
                )
            if "sha256" in info and not _is_sha256(info["sha256"]):
                raise DatastoreError(f"{where}: file entry {name!r} has sha256 {info['sha256']!r}, not 64 hex digits")
    hold = manifest.get("holdout")
    if hold is not None and not (isinstance(hold, dict) and (hold.get("file") is None or is_plain_name(hold["file"]))):
        raise DatastoreError(
            f"{where}: holdout file {hold.get('file') if isinstance(hold, dict) else hold!r} is not a "
            "plain file name inside the datastore folder; refusing to use it"
        )
    tok = manifest.get("tokenizer")
    if tok is not None:
        if not isinstance(tok, dict):
            raise DatastoreError(f'{where}: "tokenizer" is a {type(tok).__name__}, not an object')
        if tok.get("file") is not None and not is_plain_name(tok["file"]):
            raise DatastoreError(
                f"{where}: tokenizer file {tok['file']!r} is not a plain file name inside the "
                "datastore folder; refusing to use it"
            )
        for key in ("path", "name"):
            if tok.get(key) is not None and not isinstance(tok[key], str):
                raise DatastoreError(f"{where}: tokenizer {key} is {tok[key]!r}, not a string")
        if tok.get("sha256") is not None and not _is_sha256(tok["sha256"]):
            raise DatastoreError(f"{where}: tokenizer sha256 is {tok['sha256']!r}, not 64 hex digits")
        vocab = tok.get("vocab_size")
        if vocab is not None and not (_is_int(vocab) and 0 < vocab <= _MAX_VOCAB):
            raise DatastoreError(f"{where}: tokenizer vocab_size is {vocab!r}, not an integer in [1, 2^32 - 1]")
        eos = tok.get("eos_token_id")
        if eos is not None and not (_is_int(eos) and 0 <= eos < (vocab or _MAX_VOCAB)):
            raise DatastoreError(f"{where}: tokenizer eos_token_id is {eos!r}, not a token id of the vocabulary")
    return manifest


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_sha256(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


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
        raise DatastoreError(
            f"{folder}: the tokenizer file {name!r} its manifest records is missing "
            "(run `sssd verify`; rebuild or re-copy the datastore)"
        ) from None
    except (ValueError, OSError) as e:
        raise DatastoreError(str(e)) from None
    return path


def tokenizer_mismatch(recorded: dict[str, Any], tok: Any) -> str | None:
    """Why a loaded tokenizer is not the one a manifest's "tokenizer" entry records, or None."""
    if recorded.get("sha256") and recorded["sha256"] != tok.sha256:
        return (
            f"the tokenizer file {tok.path} (sha256 {tok.sha256[:12]}, vocab {tok.vocab_size}) is not the tokenizer "
            f"the manifest records (sha256 {recorded['sha256'][:12]}, vocab {recorded.get('vocab_size')})"
        )
    if recorded.get("vocab_size") is not None and recorded["vocab_size"] != tok.vocab_size:
        return (
            f"the tokenizer file {tok.path} has {tok.vocab_size} ids, the manifest records vocab_size "
            f"{recorded['vocab_size']}"
        )
    return None
