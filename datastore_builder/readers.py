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
SourceStats with a reason (and fail only in strict mode). A bad record is
one that is malformed, nested too deeply, holds a number too long to read,
holds text that is not valid Unicode (a lone surrogate escape such as
"\\ud800"), or is larger than ``Fields.max_record_bytes`` (16 MiB by
default): a line, JSON value, paragraph or file that large is skipped while
read, without holding it in memory (tokenizing it would take gigabytes).

Text inputs may start with a byte-order mark: a UTF-8 one is dropped, and a
UTF-16 or UTF-32 file (with its BOM, as Windows tools write them) is
decoded to UTF-8 while read.
"""

from __future__ import annotations

import codecs
import glob
import io
import json
import os
import re
import stat
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from sssd.datastore_builder.sharegpt import Turn, message_turns
from sssd.files import describe_mode, open_regular

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
#: The largest record (a JSON value, a line, a paragraph or file of text), in bytes
#: (characters for JSON values); larger ones are skipped (``sssd build --max-record-mib``).
MAX_RECORD_BYTES = 16 << 20
_UTF8_BOM = codecs.BOM_UTF8


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
    max_record_bytes: int = MAX_RECORD_BYTES

    def __post_init__(self):
        if self.text_fields and self.messages_field:
            raise ValueError("give either text fields or a messages field, not both")
        if self.text_split not in TEXT_SPLITS:
            raise ValueError(f"text split must be one of {TEXT_SPLITS}, got {self.text_split!r}")
        if isinstance(self.max_record_bytes, bool) or not isinstance(self.max_record_bytes, int) or self.max_record_bytes < 1:
            raise ValueError(f"max_record_bytes must be a positive integer, got {self.max_record_bytes!r}")


def _too_large(limit: int) -> str:
    size = f"{limit / 2**20:g} MiB" if limit >= 1 << 20 else f"{limit:,} bytes"
    return f"record larger than {size} (the --max-record-mib limit)"


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
            mode = path.stat().st_mode
            if not stat.S_ISREG(mode):  # reading a FIFO blocks until a writer comes; a device never ends
                raise CorpusError(f"input {spec} is {describe_mode(mode)}, not a regular file; to read from a "
                                  "pipe, give - and send it to stdin (... | sssd build - ...)")
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


#: Byte-order marks of the encodings decoded to UTF-8 while read (UTF-32 before UTF-16: FF FE 00 00 starts with FF FE).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _bom_encoding(head: bytes) -> str | None:
    return next((enc for bom, enc in _BOMS if head.startswith(bom)), None)


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
            yield from _READERS[kind](_text_stream(stream, src.path), src.path, fields, stats, on_bytes)
        return
    if src.kind in ("parquet", "arrow"):
        yield from _arrow_like(src.path, src.kind, src.path, fields, stats, on_bytes, src.size)
        return
    with open_regular(src.path) as f:
        yield from _READERS[src.kind](_text_stream(f, src.path), src.path, fields, stats, on_bytes)


def _text_stream(f: io.BufferedReader, path: str) -> io.BufferedReader:
    """``f`` past a UTF-8 byte-order mark, or, after a UTF-16/UTF-32 one, a stream of its text as UTF-8."""
    head = f.peek(4)[:4]
    if head.startswith(_UTF8_BOM):
        f.read(len(_UTF8_BOM))
        return f
    enc = _bom_encoding(head)
    return io.BufferedReader(_Recoded(f, enc, path), buffer_size=1 << 16) if enc else f


class _Recoded(io.RawIOBase):
    """A binary stream of UTF-16/UTF-32 text (the decoder reads its BOM), read as UTF-8."""

    def __init__(self, raw: BinaryIO, encoding: str, path: str):
        self._raw = raw
        self._encoding = encoding
        self._path = path
        self._decoder = codecs.getincrementaldecoder(encoding)()
        self._pending = b""
        self._eof = False
        self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._pending and not self._eof:
            data = self._raw.read(1 << 16)
            try:
                text = self._decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise CorpusError(f"{self._path}: not valid {self._encoding.upper()} text (it starts with a "
                                  f"{self._encoding.upper()} byte-order mark) near byte {self._offset + e.start:,}") from None
            self._offset += len(data)
            self._eof = not data
            self._pending = text.encode("utf-8")
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _lines(f: BinaryIO, limit: int, on_bytes: Callable[[int], None]) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) for each line of ``f``; the line is None if longer than ``limit``
    bytes (its newline not counted), and is then read past without being held in memory."""
    lineno = 0
    while True:
        line = f.readline(limit + 2)  # the longest acceptable line, with "\r\n"
        if not line:
            return
        on_bytes(len(line))
        lineno += 1
        if line.endswith(b"\n"):
            yield lineno, (None if len(line.rstrip(b"\r\n")) > limit else line)
            continue
        if len(line) < limit + 2:  # the last line, without a newline
            yield lineno, (None if len(line.rstrip(b"\r")) > limit else line)
            return
        while line and not line.endswith(b"\n"):  # too long: read past the rest of it
            line = f.readline(1 << 20)
            on_bytes(len(line))
        yield lineno, None


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
            return self._checked(Record(turns, rid, turn_problems=problems), "message text")
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
        return self._checked(Record(turns, rid, turn_problems=problems), "text field")

    def _checked(self, rec: Record, what: str) -> Record:
        """Drops turns that are not valid Unicode; refuses a record larger than the limit."""
        limit = self.fields.max_record_bytes
        if sum(len(t.text) for t in rec.turns) > limit:  # characters: each at least a byte
            return Record([], rec.id, problem=_too_large(limit))
        if all(t.text.isascii() for t in rec.turns):
            return rec
        kept = []
        for t in rec.turns:
            try:
                t.text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON): no tokenizer can take it
                rec.turn_problems.append(f"{what} is not valid Unicode (a lone surrogate)")
                continue
            kept.append(t)
        rec.turns = kept
        return rec

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
    a record. A value that cannot be decoded although well formed (nested too
    deeply, a number too long) or longer than ``limit`` characters is skipped
    by scanning for its end, without holding more than ``limit`` of it.
    """

    def __init__(self, f: BinaryIO, path: str, stats: SourceStats, looks_like_record: Callable[[Any], bool],
                 on_bytes: Callable[[int], None], limit: int = MAX_RECORD_BYTES):
        self.f = f
        self.path = path
        self.stats = stats
        self.looks_like_record = looks_like_record
        self.on_bytes = on_bytes
        self.limit = limit
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

    def _too_long(self, start: int) -> bool:
        return len(self.buf) - start > self.limit

    def _needs_more(self, e: json.JSONDecodeError) -> bool:
        """Whether a decode error may just be the buffer ending mid-value."""
        if self.eof:
            return False
        return e.msg.startswith("Unterminated string") or e.pos >= len(self.buf) - 16

    _STRUCTURE = re.compile(r'["{}\[\]]')
    _IN_STRING = re.compile(r'["\\]')
    _SCALAR_END = re.compile(r'[\s,\]}]')

    def _skip_value(self) -> bool:
        """Moves pos past the JSON value starting at pos by scanning (strings, brackets and
        braces), reading on as needed but holding only the current chunk; False if the
        input ends first."""
        depth = 0
        in_string = False
        if self.buf[self.pos] not in '{["':  # a number or literal: up to the next delimiter
            while True:
                m = self._SCALAR_END.search(self.buf, self.pos)
                if m:
                    self.pos = m.start()
                    return True
                self.pos = len(self.buf)
                if self.eof:
                    return True
                self._fill()
        while True:
            if self.pos >= len(self.buf):
                if self.eof:
                    return False
                self._fill()
                continue
            if in_string:
                m = self._IN_STRING.search(self.buf, self.pos)
                if m is None:
                    self.pos = len(self.buf)
                elif m.group() == "\\":
                    if m.end() < len(self.buf):
                        self.pos = m.end() + 1  # the escaped character
                    elif self.eof:
                        return False
                    else:  # the escaped character is in the next chunk
                        self.pos = m.start()
                        self._fill()
                else:
                    in_string = False
                    self.pos = m.end()
                    if depth == 0:
                        return True
                continue
            m = self._STRUCTURE.search(self.buf, self.pos)
            if m is None:
                self.pos = len(self.buf)
                continue
            self.pos = m.end()
            c = m.group()
            if c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            else:
                depth -= 1
                if depth <= 0:
                    return True

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
                if self._needs_more(e) and not self._too_long(i):
                    self.pos = i
                    self._fill()
                else:
                    self.pos = i + 1
                continue
            except (ValueError, RecursionError):  # well formed but undecodable: not where to resume
                self.pos = i + 1
                continue
            if self.looks_like_record(obj):
                self.pos = i
                return True
            self.pos = end  # a nested object of the broken record

    def _skip_undecodable(self, reason: str) -> bool:
        """Skips the value at pos (counted under ``reason``); False at the end of the input."""
        where = f"character {self.base + self.pos:,}"
        if self._skip_value():
            self.stats.skip(reason, where)
            return True
        self.stats.skip("incomplete record at the end of the file (file truncated)", where)
        return False

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
                    if not self._too_long(self.pos):
                        self._fill()
                        continue
                    if self._skip_undecodable(_too_large(self.limit)):
                        continue
                    closed = True  # already reported
                    break
                where = f"{e.msg} at character {self.base + e.pos:,}"
                if self._resync(self.pos + 1):
                    self.stats.skip("malformed JSON record", where)
                    continue
                self.stats.skip("incomplete record at the end of the file (file truncated)", where)
                closed = True  # already reported
                break
            except RecursionError:
                if self._skip_undecodable("JSON record nested too deeply"):
                    continue
                closed = True
                break
            except ValueError as e:  # e.g. an integer of more than 4,300 digits
                if self._skip_undecodable(f"unreadable JSON record ({str(e).split(':')[0]})"):
                    continue
                closed = True
                break
            if end - self.pos > self.limit:
                self.pos = end
                self.stats.skip(_too_large(self.limit), f"character {self.base + end:,}")
                continue
            self.pos = end
            self.stats.records += 1
            yield obj
        if not closed:
            self.stats.notes.append("file ends before the closing ']' (truncated between records)")


def _json(f: BinaryIO, path: str, fields: Fields, stats: SourceStats, on_bytes) -> Iterator[Record]:
    ext = _Extractor(path, fields, stats)
    stream = _JsonStream(f, path, stats, ext.looks_like_record, on_bytes, fields.max_record_bytes)
    yield from _records(stream.values(), ext, stats)


def _jsonl(f: BinaryIO, path: str, fields: Fields, stats: SourceStats, on_bytes) -> Iterator[Record]:
    ext = _Extractor(path, fields, stats)

    def values():
        for lineno, line in _lines(f, fields.max_record_bytes, on_bytes):
            if line is None:
                stats.skip(_too_large(fields.max_record_bytes), f"line {lineno}")
                continue
            if line.startswith(_UTF8_BOM):  # files concatenated with their byte-order marks
                line = line[len(_UTF8_BOM):]
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
            except RecursionError:
                stats.skip("JSON line nested too deeply", f"line {lineno}")
                continue
            except ValueError as e:  # e.g. an integer of more than 4,300 digits
                stats.skip(f"unreadable JSON line ({str(e).split(':')[0]})", f"line {lineno}")
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
    limit = fields.max_record_bytes

    def record(data: bytes | None, where: str) -> Record:
        stats.records += 1
        if data is None:
            return Record([], problem=_too_large(limit), where=where)
        if data.startswith(_UTF8_BOM):  # files concatenated with their byte-order marks
            data = data[len(_UTF8_BOM):]
        try:
            return Record([Turn(None, data.decode("utf-8"))])
        except UnicodeDecodeError as e:
            return Record([], problem="not valid UTF-8 text", where=f"{where}, byte {e.start}")

    if fields.text_split == "file":
        data = f.read(limit + 1)
        on_bytes(len(data))
        yield record(data if len(data) <= limit else None, "file")
        return
    para: list[bytes] = []
    size = 0
    too_long = False
    start = 0
    for lineno, line in _lines(f, limit, on_bytes):
        if fields.text_split == "line":
            if line is None:
                yield record(None, f"line {lineno}")
            elif line.strip():
                yield record(line.rstrip(b"\r\n"), f"line {lineno}")
            continue
        if line is None or line.strip():
            if not para and not too_long:
                start = lineno
            if line is None or too_long or size + len(line) > limit:
                too_long, para, size = True, [], 0  # the paragraph is read past, not kept
            else:
                para.append(line)
                size += len(line)
        elif para or too_long:
            yield record(None if too_long else b"".join(para).rstrip(b"\r\n"), f"line {start}")
            para, size, too_long = [], 0, False
    if para or too_long:
        yield record(None if too_long else b"".join(para).rstrip(b"\r\n"), f"line {start}")


_READERS = {"json": _json, "jsonl": _jsonl, "text": _text}


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
