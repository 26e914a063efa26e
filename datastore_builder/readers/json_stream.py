"""The ``json`` reader: an array of records (ShareGPT style) or concatenated objects, decoded record
by record over a sliding buffer; a truncated file yields every complete record, and a malformed one
is skipped by resynchronising on the next object that looks like a record."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from sssd.datastore_builder.readers.extractor import _Extractor, _records
from sssd.datastore_builder.readers.records import (
    MAX_RECORD_BYTES,
    CorpusError,
    Fields,
    Record,
    SourceStats,
    _too_large,
)

#: Bytes per read of a JSON file.
JSON_CHUNK = 1 << 22


class _JsonStream:
    """Decodes the top-level values of a JSON file one at a time.

    Handles a top-level array (ShareGPT style) or values back to back. A value
    cut off by the end of the file (a truncated file) or malformed is counted
    in stats and skipped; decoding resumes at the next object that looks like
    a record. A value that cannot be decoded although well formed (nested too
    deeply, a number too long) or longer than ``limit`` characters is skipped
    by scanning for its end, without holding more than ``limit`` of it.
    """

    def __init__(
        self,
        f: BinaryIO,
        path: str,
        stats: SourceStats,
        looks_like_record: Callable[[Any], bool],
        on_bytes: Callable[[int], None],
        limit: int = MAX_RECORD_BYTES,
    ):
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
        self.buf = self.buf[self.pos :] + text
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
    _SCALAR_END = re.compile(r"[\s,\]}]")

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
