"""The ``parquet`` and ``arrow`` readers: record batches read with pyarrow (constant memory), Arrow
in the IPC file or stream format."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from sssd.datastore_builder.readers.extractor import _Extractor
from sssd.datastore_builder.readers.records import CorpusError, Fields, Record, SourceStats

#: Rows per pyarrow batch.
BATCH_ROWS = 1024


def _read_all(stream: BinaryIO, on_bytes: Callable[[int], None]) -> Any:
    import pyarrow as pa

    data = stream.read()
    on_bytes(len(data))
    return pa.BufferReader(data)


def _arrow_like(
    source: Any,
    kind: str,
    path: str,
    fields: Fields,
    stats: SourceStats,
    on_bytes: Callable[[int], None] = lambda n: None,
    size: int | None = None,
) -> Iterator[Record]:
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
