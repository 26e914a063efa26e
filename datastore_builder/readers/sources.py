"""Sources: inputs (files, folders, glob patterns, "-" for stdin) expanded into sources, the format
of each detected (its extension, else its first bytes), and one source read with its format's reader."""

from __future__ import annotations

import glob
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from sssd.datastore_builder.readers.columnar import _arrow_like, _read_all
from sssd.datastore_builder.readers.json_stream import _json
from sssd.datastore_builder.readers.jsonl import _jsonl
from sssd.datastore_builder.readers.plain_text import _text
from sssd.datastore_builder.readers.records import (
    EXTENSIONS,
    FORMATS,
    STDIN,
    CorpusError,
    Fields,
    Record,
    Source,
    SourceStats,
)
from sssd.datastore_builder.readers.streams import _bom_encoding, _stdin, _text_stream
from sssd.files import describe_mode, open_regular

# -- inputs -----------------------------------------------------------------------


def resolve_inputs(inputs: list[str], fmt: str = "auto") -> list[Source]:
    """Expands inputs (files, directories, glob patterns, "-") into sources, in order.

    Raises:
        FileNotFoundError: an input does not exist or a pattern/directory matches no file.
        CorpusError: an unknown format.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise CorpusError(f"unknown format {fmt!r} (choose from auto, {', '.join(FORMATS)})")
    if not inputs:
        raise CorpusError("no inputs given")
    sources: list[Source] = []
    for spec in inputs:
        if spec == STDIN:
            sources.append(Source(STDIN, fmt))  # "auto" is settled when reading
            continue
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and _visible(p.relative_to(path)) and (fmt != "auto" or p.suffix.lower() in EXTENSIONS)
            )
            if not files:
                raise FileNotFoundError(
                    f"no input files in directory {path} (known extensions: {', '.join(sorted(EXTENSIONS))})"
                )
        elif path.exists():
            mode = path.stat().st_mode
            if not stat.S_ISREG(mode):  # reading a FIFO blocks until a writer comes; a device never ends
                raise CorpusError(
                    f"input {spec} is {describe_mode(mode)}, not a regular file; to read from a "
                    "pipe, give - and send it to stdin (... | sssd build - ...)"
                )
            files = [path]
        elif any(c in spec for c in "*?["):
            files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
            if not files:
                raise FileNotFoundError(f"no files match {spec!r}")
        else:
            raise FileNotFoundError(f"input not found: {spec}")
        for f in files:
            if not os.access(f, os.R_OK):
                raise PermissionError(f"input not readable: {f}")
            sources.append(Source(str(f), fmt if fmt != "auto" else detect_format(f), f.stat().st_size))
    return sources


def _visible(rel: Path) -> bool:
    return not any(part.startswith(".") for part in rel.parts)


def detect_format(path: Path) -> str:
    """A file's format from its extension, else from its first bytes."""
    kind = EXTENSIONS.get(path.suffix.lower())
    if kind:
        return kind
    with open_regular(path) as f:
        return _sniff(f.read(1 << 16))


def _sniff(head: bytes) -> str:
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith((b"ARROW1", b"\xff\xff\xff\xff")):  # IPC file magic / stream continuation marker
        return "arrow"
    enc = _bom_encoding(head)
    if enc:
        head = head.decode(enc, errors="ignore").encode("utf-8")
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if stripped.startswith(b"["):
        return "json"
    if stripped.startswith(b"{"):
        first = stripped.split(b"\n", 1)[0]
        try:
            json.loads(first)
            return "jsonl"
        except ValueError:
            return "json"
    return "text"


# -- reading ----------------------------------------------------------------------


def read_source(
    src: Source,
    fields: Fields,
    stats: SourceStats,
    on_bytes: Callable[[int], None] = lambda n: None,
    stdin: BinaryIO | None = None,
) -> Iterator[Record]:
    """Streams the records of one source; counts problems in ``stats``.

    Raises:
        CorpusError: the source cannot be read at all (not the format it claims,
            no field holding text, a bad record under --strict).
        OSError: the file cannot be opened or read.
    """
    if src.path == STDIN:
        stream = _stdin(stdin)
        kind = src.kind
        if kind == "auto":
            kind = _sniff(stream.peek(1 << 16)[: 1 << 16])
        stats.kind = kind
        if kind in ("parquet", "arrow"):
            yield from _arrow_like(_read_all(stream, on_bytes), kind, src.path, fields, stats)
        else:
            yield from _READERS[kind](_text_stream(stream, src.path), src.path, fields, stats, on_bytes)
        return
    if src.kind in ("parquet", "arrow"):
        yield from _arrow_like(src.path, src.kind, src.path, fields, stats, on_bytes, src.size)
        return
    with open_regular(src.path) as f:
        yield from _READERS[src.kind](_text_stream(f, src.path), src.path, fields, stats, on_bytes)


_READERS = {"json": _json, "jsonl": _jsonl, "text": _text}
