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

Modules:
    records       formats, sources, records and their stats, the field choice (Fields), CorpusError
    sources       expanding inputs into sources, detecting their format, reading one (read_source)
    streams       byte streams: byte-order marks, UTF-16/UTF-32 recoding, lines with a size limit, stdin
    extractor     a record object's text (its messages or text fields), the field detected once
    json_stream   ``json``: arrays of records or concatenated values, truncation-tolerant
    jsonl         ``jsonl``: one JSON object per line
    columnar      ``parquet`` and ``arrow``: record batches read with pyarrow
    plain_text    ``text``: a document per file, paragraph or line

BATCH_ROWS and JSON_CHUNK are re-exported here for reading; the readers use the ones in columnar
and json_stream (set those to change them).
"""

from __future__ import annotations

from sssd.datastore_builder.readers.columnar import BATCH_ROWS
from sssd.datastore_builder.readers.json_stream import JSON_CHUNK
from sssd.datastore_builder.readers.records import (
    EXTENSIONS,
    FORMATS,
    MAX_RECORD_BYTES,
    MESSAGE_FIELDS,
    STDIN,
    TEXT_FIELDS,
    TEXT_SPLITS,
    CorpusError,
    Fields,
    Record,
    Source,
    SourceStats,
)
from sssd.datastore_builder.readers.sources import detect_format, read_source, resolve_inputs

__all__ = [
    "BATCH_ROWS",
    "EXTENSIONS",
    "FORMATS",
    "JSON_CHUNK",
    "MAX_RECORD_BYTES",
    "MESSAGE_FIELDS",
    "STDIN",
    "TEXT_FIELDS",
    "TEXT_SPLITS",
    "CorpusError",
    "Fields",
    "Record",
    "Source",
    "SourceStats",
    "detect_format",
    "read_source",
    "resolve_inputs",
]
