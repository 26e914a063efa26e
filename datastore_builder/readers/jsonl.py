"""The ``jsonl`` reader: one JSON object per line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO

from sssd.datastore_builder.readers.extractor import _Extractor, _records
from sssd.datastore_builder.readers.records import Fields, Record, SourceStats, _too_large
from sssd.datastore_builder.readers.streams import _UTF8_BOM, _lines


def _jsonl(f: BinaryIO, path: str, fields: Fields, stats: SourceStats, on_bytes) -> Iterator[Record]:
    ext = _Extractor(path, fields, stats)

    def values():
        for lineno, line in _lines(f, fields.max_record_bytes, on_bytes):
            if line is None:
                stats.skip(_too_large(fields.max_record_bytes), f"line {lineno}")
                continue
            if line.startswith(_UTF8_BOM):  # files concatenated with their byte-order marks
                line = line[len(_UTF8_BOM) :]
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                stats.skip("line is not valid UTF-8", f"line {lineno}")
                continue
            except json.JSONDecodeError as e:
                truncated = not line.endswith(b"\n")  # only the last line can lack one
                stats.skip(
                    "incomplete last line (file truncated)" if truncated else "malformed JSON line",
                    f"line {lineno}: {e.msg}",
                )
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
