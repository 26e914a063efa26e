"""Byte streams under the readers: a UTF-8 byte-order mark dropped, UTF-16/UTF-32 text (with its
BOM) recoded to UTF-8 while read, lines read with a size limit (longer ones read past, not held),
and stdin."""

from __future__ import annotations

import codecs
import io
import sys
from collections.abc import Callable, Iterator
from typing import BinaryIO

from sssd.datastore_builder.readers.records import CorpusError

_UTF8_BOM = codecs.BOM_UTF8

#: Byte-order marks of the encodings decoded to UTF-8 while read (UTF-32 before UTF-16: FF FE 00 00 starts with FF FE).
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def _bom_encoding(head: bytes) -> str | None:
    return next((enc for bom, enc in _BOMS if head.startswith(bom)), None)


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
                raise CorpusError(
                    f"{self._path}: not valid {self._encoding.upper()} text (it starts with a "
                    f"{self._encoding.upper()} byte-order mark) near byte {self._offset + e.start:,}"
                ) from None
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
