"""The ``text`` reader: plain text, a document per file, paragraph or line."""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from sssd.datastore_builder.readers.records import Fields, Record, SourceStats, _too_large
from sssd.datastore_builder.readers.streams import _UTF8_BOM, _lines
from sssd.datastore_builder.sharegpt import Turn


def _text(f: BinaryIO, path: str, fields: Fields, stats: SourceStats, on_bytes) -> Iterator[Record]:
    limit = fields.max_record_bytes

    def record(data: bytes | None, where: str) -> Record:
        stats.records += 1
        if data is None:
            return Record([], problem=_too_large(limit), where=where)
        if data.startswith(_UTF8_BOM):  # files concatenated with their byte-order marks
            data = data[len(_UTF8_BOM) :]
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
