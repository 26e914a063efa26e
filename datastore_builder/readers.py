"""Corpus readers: one per input format, each streaming records of turns.

Formats (``--format``, or detected from the extension, then the content):

* ``json``: an array of records (ShareGPT style) or concatenated objects.
  Decoded record by record with ``json.JSONDecoder.raw_decode`` over a
  sliding buffer, so a file truncated mid-record (like the packaged
  ShareGPT file) yields every complete record; a malformed record is
  skipped by resynchronising on the next object that looks like a record.
* ``jsonl``: one JSON object per line.
* ``parquet`` / ``arrow``: read in record batches with pyarrow (constant
  memory); Arrow IPC file or stream format.
* ``text``: plain text; a document per file, paragraph or line.

Records of json/jsonl/parquet/arrow are objects whose text is either a chat
message list (``messages_field``; "conversations" or "messages" by default)
or one or more text fields (``text_fields``; "text" by default), each field
a separate document. Readers never raise on a bad record: they count it in
SourceStats with a reason (and fail only in strict mode).
"""

from __future__ import annotations

import codecs
import glob
import io
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from sssd.datastore_builder.sharegpt import Turn, message_turns

FORMATS = ("json", "jsonl", "parquet", "arrow", "text")
TEXT_SPLITS = ("file", "paragraph", "line")
EXTENSIONS = {
    ".json": "json",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".rst": "text",
}
MESSAGE_FIELDS = ("conversations", "messages")
TEXT_FIELDS = ("text", "content")
STDIN = "-"

#: Rows per pyarrow batch / bytes per read of a JSON file.
BATCH_ROWS = 1024
JSON_CHUNK = 1 << 22
#: A JSON record longer than this is taken as malformed rather than waited for.
MAX_JSON_RECORD = 1 << 26


class CorpusError(ValueError):
    """The corpus cannot be read as asked (a one-line message for the CLI)."""


@dataclass
class Source:
    """One input: a file path (or "-" for stdin) and its format."""

    path: str
    kind: str
    size: int | None = None  # bytes, if known


@dataclass
class Record:
    """A record read from a source: its turns, or why it is unusable."""

    turns: list[Turn]
    id: str | None = None
    problem: str | None = None  # record-level: the record is skipped
    where: str = ""  # where in the source (for messages)
    turn_problems: list[str] = field(default_factory=list)  # messages skipped inside a usable record


@dataclass
class SourceStats:
    """What a source yielded: counts and the reasons records were dropped."""

    kind: str
    path: str
    strict: bool = False
    records: int = 0  # complete records read (usable or not)
    documents: int = 0  # documents that went into the datastore
    heldout: int = 0  # records written to the held-out file
    empty: int = 0  # whitespace-only texts (not documents, not errors)
    duplicates: int = 0  # documents dropped by --dedup
    skipped: Counter = field(default_factory=Counter)  # reason -> records (or messages) dropped
    notes: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str = "") -> None:
        """Counts a dropped record; in strict mode, fails instead."""
        if self.strict:
            at = f" ({where})" if where else ""
            raise CorpusError(f"{self.path}: {reason}{at}; stopping because of --strict")
        self.skipped[reason] += 1

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "path": self.path, "records": self.records, "documents": self.documents,
               "skipped": self.num_skipped, "skipped_reasons": dict(self.skipped)}
        for key in ("heldout", "empty", "duplicates"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def summary(self) -> str:
        text = f"{self.path}: {self.records:,} records, {self.documents:,} documents"
        if self.heldout:
            text += f", {self.heldout:,} held out"
        if self.skipped:
            reasons = "; ".join(f"{n:,} {r}" for r, n in self.skipped.most_common())
            text += f"; skipped {self.num_skipped:,} ({reasons})"
        for note in self.notes:
            text += f"; {note}"
        return text


@dataclass(frozen=True)
class Fields:
    """Where the text is in a record, and how plain text splits into documents."""

    text_fields: tuple[str, ...] = ()
    messages_field: str | None = None
    text_split: str = "file"
    roles: str = "all"

    def __post_init__(self):
        if self.text_fields and self.messages_field:
            raise ValueError("give either text fields or a messages field, not both")
        if self.text_split not in TEXT_SPLITS:
            raise ValueError(f"text split must be one of {TEXT_SPLITS}, got {self.text_split!r}")


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
            files = sorted(p for p in path.rglob("*") if p.is_file() and _visible(p.relative_to(path))
                           and (fmt != "auto" or p.suffix.lower() in EXTENSIONS))
            if not files:
                raise FileNotFoundError(f"no input files in directory {path} (known extensions: {', '.join(sorted(EXTENSIONS))})")
        elif path.exists():
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
    with open(path, "rb") as f:
        return _sniff(f.read(1 << 16))


def _sniff(head: bytes) -> str:
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith((b"ARROW1", b"\xff\xff\xff\xff")):  # IPC file magic / stream continuation marker
        return "arrow"
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

def read_source(src: Source, fields: Fields, stats: SourceStats, on_bytes: Callable[[int], None] = lambda n: None,
                stdin: BinaryIO | None = None) -> Iterator[Record]:
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
            yield from _READERS[kind](stream, src.path, fields, stats, on_bytes)
        return
    if src.kind in ("parquet", "arrow"):
        yield from _arrow_like(src.path, src.kind, src.path, fields, stats, on_bytes, src.size)
        return
    with open(src.path, "rb") as f:
        yield from _READERS[src.kind](f, src.path, fields, stats, on_bytes)


def _stdin(stdin: BinaryIO | None) -> io.BufferedReader:
    raw = stdin if stdin is not None else sys.stdin.buffer
    return raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)  # type: ignore[arg-type]


def _read_all(stream: BinaryIO, on_bytes: Callable[[int], None]) -> Any:
    import pyarrow as pa

    data = stream.read()
    on_bytes(len(data))
    return pa.BufferReader(data)


class _Extractor:
    """Turns a record object into a Record, detecting the text field once."""

    def __init__(self, path: str, fields: Fields, stats: SourceStats):
        self.path = path
        self.fields = fields
        self.stats = stats
        self.text_fields = fields.text_fields
        self.messages_field = fields.messages_field
        self.hits = 0  # records that had the field
        self.first_keys: list[str] | None = None

    @property
    def detected(self) -> bool:
        return bool(self.text_fields or self.messages_field)

    def detect(self, keys: list[str]) -> None:
        """Picks the field from a record's (or schema's) keys, unless given."""
        if self.first_keys is None:
            self.first_keys = list(keys)
        if self.detected:
            return
        for name in MESSAGE_FIELDS:
            if name in keys:
                self.messages_field = name
                return
        for name in TEXT_FIELDS:
            if name in keys:
                self.text_fields = (name,)
                self._check_roles()
                return
        raise CorpusError(
            f"{self.path}: cannot tell which field holds the text (fields: {', '.join(map(str, keys)) or 'none'}); "
            "pass --text-field NAME or --messages-field NAME"
        )

    def _check_roles(self) -> None:
        if self.fields.roles != "all":
            raise CorpusError(f"{self.path}: --roles {self.fields.roles} needs chat messages, but the text is in "
                              f"plain field(s) {', '.join(self.text_fields)}; use --messages-field or --roles all")

    def looks_like_record(self, obj: Any) -> bool:
        if not isinstance(obj, dict):
            return False
        keys = ([self.messages_field] if self.messages_field else list(self.text_fields)) if self.detected else [*MESSAGE_FIELDS, *TEXT_FIELDS]
        return any(k in obj for k in keys)

    def __call__(self, obj: Any) -> Record:
        if not isinstance(obj, dict):
            return Record([], problem=f"record is a JSON {type(obj).__name__}, not an object")
        if not self.detected:
            self.detect(list(obj))
        elif self.first_keys is None:
            self.first_keys = list(obj)
        rid = obj.get("id")
        rid = None if rid is None else str(rid)
        if self.messages_field:
            if self.messages_field not in obj:
                return Record([], rid, problem=f"no {self.messages_field!r} field")
            self.hits += 1
            turns, problems = message_turns(obj[self.messages_field])
            if not turns and problems and not isinstance(obj[self.messages_field], list):
                return Record([], rid, problem=problems[0])
            return Record(turns, rid, turn_problems=problems)
        turns = []
        present = [f for f in self.text_fields if f in obj]
        if not present:
            return Record([], rid, problem=f"no {' or '.join(map(repr, self.text_fields))} field")
        self.hits += 1
        problems = []
        for name in present:
            value = obj[name]
            if isinstance(value, str):
                turns.append(Turn(None, value))
            elif value is not None:
                problems.append(f"field {name!r} is not text")
        return Record(turns, rid, turn_problems=problems)

    def check(self, final: bool) -> None:
        """Fails if the chosen field is in none of the records so far (early: after 1,000)."""
        if self.hits or not self.stats.records or (not final and self.stats.records < 1000):
            return
        name = self.messages_field or ", ".join(self.text_fields)
        raise CorpusError(f"{self.path}: no record has the field {name!r} (fields seen: {', '.join(map(str, self.first_keys or [])) or 'none'})")


def _records(values: Iterator[Any], ext: _Extractor, stats: SourceStats) -> Iterator[Record]:
    for obj in values:
        rec = ext(obj)
        yield rec
        if stats.records == 1000:
            ext.check(final=False)
    ext.check(final=True)


# -- JSON: arrays of records, truncation-tolerant ---------------------------------

class _JsonStream:
    """Decodes the top-level values of a JSON file one at a time.

    Handles a top-level array (ShareGPT style) or values back to back. A value
    cut off by the end of the file (a truncated file) or malformed is counted
    in stats and skipped; decoding resumes at the next object that looks like
    a record.
    """

    def __init__(self, f: BinaryIO, path: str, stats: SourceStats, looks_like_record: Callable[[Any], bool],
                 on_bytes: Callable[[int], None]):
        self.f = f
        self.path = path
        self.stats = stats
        self.looks_like_record = looks_like_record
        self.on_bytes = on_bytes
        self.decoder = json.JSONDecoder()
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.bytes_read = 0
        self.base = 0  # characters dropped from the front of buf so far

    def _fill(self) -> None:
        """Appends the next chunk to the buffer (dropping what was consumed)."""
        data = self.f.read(JSON_CHUNK)
        self.on_bytes(len(data))
        try:
            text = self.utf8.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise CorpusError(f"{self.path}: not UTF-8 text near byte {self.bytes_read + e.start:,}") from None
        self.bytes_read += len(data)
        self.base += self.pos
        self.buf = self.buf[self.pos:] + text
        self.pos = 0
        self.eof = not data

    def _skip(self, chars: str) -> bool:
        """Skips ``chars`` from pos; False at the end of the input."""
        while True:
            n = len(self.buf)
            while self.pos < n and self.buf[self.pos] in chars:
                self.pos += 1
            if self.pos < n:
                return True
            if self.eof:
                return False
            self._fill()

    def _needs_more(self, e: json.JSONDecodeError) -> bool:
        """Whether a decode error may just be the buffer ending mid-value."""
        if self.eof:
            return False
        if len(self.buf) - self.pos >= MAX_JSON_RECORD:
            return False
        return e.msg.startswith("Unterminated string") or e.pos >= len(self.buf) - 16

    def _resync(self, start: int) -> bool:
        """Moves pos to the next object that looks like a record; False if there is none."""
        self.pos = start
        while True:
            i = self.buf.find("{", self.pos)
            if i < 0:
                self.pos = len(self.buf)
                if self.eof:
                    return False
                self._fill()
                continue
            try:
                obj, end = self.decoder.raw_decode(self.buf, i)
            except json.JSONDecodeError as e:
                if self._needs_more(e):
                    self.pos = i
                    self._fill()
                else:
                    self.pos = i + 1
                continue
            if self.looks_like_record(obj):
                self.pos = i
                return True
            self.pos = end  # a nested object of the broken record

    def values(self) -> Iterator[Any]:
        ws = " \t\r\n\ufeff"
        if not self._skip(ws):
            return
        array = self.buf[self.pos] == "["
        if array:
            self.pos += 1
        closed = not array
        while self._skip(ws + ("," if array else "")):
            if array and self.buf[self.pos] == "]":
                closed = True
                self.pos += 1
                if self._skip(ws):
                    self.stats.notes.append("ignored text after the closing ']'")
                break
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self._needs_more(e):
                    self._fill()
                    continue
                where = f"{e.msg} at character {self.base + e.pos:,}"
                if self._resync(self.pos + 1):
                    self.stats.skip("malformed JSON record", where)
                    continue
                self.stats.skip("incomplete record at the end of the file (file truncated)", where)
                closed = True  # already reported
                break
            self.pos = end
            self.stats.records += 1
            yield obj
        if not closed:
            self.stats.notes.append("file ends before the closing ']' (truncated between records)")


def _json(f: BinaryIO, path: str, fields: Fields, stats: SourceStats, on_bytes) -> Iterator[Record]:
    ext = _Extractor(path, fields, stats)
    stream = _JsonStream(f, path, stats, ext.looks_like_record, on_bytes)
    yield from _records(stream.values(), ext, stats)


def _jsonl(f: BinaryIO, path: str, fields: Fields, stats: SourceStats, on_bytes) -> Iterator[Record]:
    ext = _Extractor(path, fields, stats)

    def values():
        for lineno, line in enumerate(f, 1):
            on_bytes(len(line))
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                stats.skip("line is not valid UTF-8", f"line {lineno}")
                continue
            except json.JSONDecodeError as e:
                truncated = not line.endswith(b"\n")  # only the last line can lack one
                stats.skip("incomplete last line (file truncated)" if truncated else "malformed JSON line",
                           f"line {lineno}: {e.msg}")
                continue
            stats.records += 1
            yield obj

    yield from _records(values(), ext, stats)


# -- Parquet and Arrow ------------------------------------------------------------

def _arrow_like(source: Any, kind: str, path: str, fields: Fields, stats: SourceStats,
                on_bytes: Callable[[int], None] = lambda n: None, size: int | None = None) -> Iterator[Record]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path}: reading {kind} needs pyarrow (pip install pyarrow)") from None
    ext = _Extractor(path, fields, stats)
    try:
        if kind == "parquet":
            pf = pq.ParquetFile(source)
            names = pf.schema_arrow.names
            total_rows = pf.metadata.num_rows
            columns = _columns(ext, names)
            batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)
        else:
            mm = pa.memory_map(source) if isinstance(source, str) else source
            try:
                reader = pa.ipc.open_file(mm)
                names = reader.schema.names
                total_rows = None
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                mm.seek(0)
                reader = pa.ipc.open_stream(mm)
                names = reader.schema.names
                total_rows = None
                batches = iter(reader)
            columns = _columns(ext, names)
        rows_done = 0
        for batch in batches:
            if kind == "arrow":
                batch = batch.select(columns)
            for off in range(0, batch.num_rows, BATCH_ROWS):
                for obj in batch.slice(off, BATCH_ROWS).to_pylist():
                    stats.records += 1
                    yield ext(obj)
            rows_done += batch.num_rows
            if size:
                on_bytes(int(size * batch.num_rows / total_rows) if total_rows else 0)
        if size and not total_rows:
            on_bytes(size)
    except pa.ArrowException as e:
        raise CorpusError(f"{path}: not a readable {kind} file ({_first_line(e)})") from None
    ext.check(final=True)


def _columns(ext: _Extractor, names: list[str]) -> list[str]:
    ext.detect(names)
    wanted = [ext.messages_field] if ext.messages_field else list(ext.text_fields)
    missing = [c for c in wanted if c not in names]
    if missing:
        raise CorpusError(f"{ext.path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(names)})")
    return wanted + (["id"] if "id" in names and "id" not in wanted else [])


# -- plain text -------------------------------------------------------------------

def _text(f: BinaryIO, path: str, fields: Fields, stats: SourceStats, on_bytes) -> Iterator[Record]:
    def record(data: bytes, where: str) -> Record:
        stats.records += 1
        try:
            return Record([Turn(None, data.decode("utf-8"))])
        except UnicodeDecodeError as e:
            return Record([], problem="not valid UTF-8 text", where=f"{where}, byte {e.start}")

    if fields.text_split == "file":
        data = f.read()
        on_bytes(len(data))
        yield record(data, "file")
        return
    para: list[bytes] = []
    start = 0
    for lineno, line in enumerate(f, 1):
        on_bytes(len(line))
        if fields.text_split == "line":
            if line.strip():
                yield record(line.rstrip(b"\r\n"), f"line {lineno}")
            continue
        if line.strip():
            if not para:
                start = lineno
            para.append(line)
        elif para:
            yield record(b"".join(para).rstrip(b"\r\n"), f"line {start}")
            para = []
    if para:
        yield record(b"".join(para).rstrip(b"\r\n"), f"line {start}")


_READERS = {"json": _json, "jsonl": _jsonl, "text": _text}


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
