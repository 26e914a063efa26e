"""Small file helpers shared across the package: streaming sha256, lenient JSON reads."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

#: Bytes read per chunk when hashing.
CHUNK = 1 << 22


def file_sha256(path: str | Path, progress: Callable[[int], None] | None = None) -> str:
    """The file's sha256 hex digest, read in chunks; ``progress(n)`` is called per chunk of n bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def read_json_dict(path: str | Path) -> dict:
    """A JSON object from a file, or {} if the file is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
