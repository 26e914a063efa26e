"""Corpus readers: every input format, truncated and malformed input, field choice."""

from __future__ import annotations

import io
import json
import os

import pytest
from test_builder_support import conversations, truncated_json

from sssd.datastore_builder import readers
from sssd.datastore_builder.readers import (
    CorpusError,
    Fields,
    Source,
    SourceStats,
    json_stream,
    read_source,
    resolve_inputs,
)
from sssd.datastore_builder.sharegpt import HoldoutRule, message_turns, select_turns


def read(path, fields=None, kind=None, stdin=None, strict=False):
    fields = fields or Fields()
    src = resolve_inputs([str(path)])[0] if kind is None else Source(str(path), kind)
    st = SourceStats(src.kind, src.path, strict=strict)
    recs = list(read_source(src, fields, st, stdin=stdin))
    return recs, st


def texts(recs):
    return [t.text for r in recs if not r.problem for t in r.turns]


# -- JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [readers.JSON_CHUNK, 7, 64, 1000])
def test_truncated_json_recovers_every_complete_record(tmp_path, monkeypatch, chunk):
    # Small read chunks put buffer boundaries inside strings, escapes and numbers.
    monkeypatch.setattr(json_stream, "JSON_CHUNK", chunk)
    recs_in = conversations(40)
    recs_in[3]["conversations"][0]["value"] = 'quotes " and \\ backslash, unicode \u00e9\u4e2d \U0001f600 {braces}'
    (tmp_path / "c.json").write_text(truncated_json(recs_in, cut=25), encoding="utf-8")
    recs, st = read(tmp_path / "c.json")
    assert [r.id for r in recs] == [f"conv{i}" for i in range(39)]  # the last one was cut
    assert texts(recs)[6] == recs_in[3]["conversations"][0]["value"]
    assert st.records == 39
    assert st.skipped == {"incomplete record at the end of the file (file truncated)": 1}


def test_json_cut_between_records_is_a_note_not_a_drop(tmp_path):
    text = json.dumps(conversations(3), indent=2)
    (tmp_path / "c.json").write_text(text[: text.rindex("}") + 1])  # no closing ]
    recs, st = read(tmp_path / "c.json")
    assert len(recs) == 3 and not st.skipped
    assert any("closing ']'" in n for n in st.notes)


def test_malformed_record_in_the_middle_is_skipped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(json_stream, "JSON_CHUNK", 50)
    good = [json.dumps(r) for r in conversations(5)]
    broken = '{"id": "bad", "conversations": [{"from": "human", "value": "oops" "missing comma"}, {"from": "gpt", "value": "x"}]}'
    (tmp_path / "c.json").write_text("[" + ",\n".join(good[:2] + [broken] + good[2:]) + "]")
    recs, st = read(tmp_path / "c.json")
    assert [r.id for r in recs] == ["conv0", "conv1", "conv2", "conv3", "conv4"]
    assert st.skipped == {"malformed JSON record": 1}
    with pytest.raises(CorpusError, match="malformed JSON record.*--strict"):
        read(tmp_path / "c.json", strict=True)


def test_json_record_problems(tmp_path):
    recs_in = [
        {"id": 1, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]},
        {"id": 2, "conversations": "not a list"},
        {"id": 3},
        [1, 2],
        {
            "id": 4,
            "conversations": [
                {"role": "user", "content": [{"type": "text", "text": "part a"}, {"type": "text", "text": "part b"}]}
            ],
        },
    ]
    (tmp_path / "c.json").write_text(json.dumps(recs_in))
    recs, _ = read(tmp_path / "c.json")
    assert [r.problem for r in recs] == [
        None,
        "messages are a str, not a list",
        "no 'conversations' field",
        "record is a JSON list, not an object",
        None,
    ]
    assert recs[0].turn_problems == ["message has no text"]
    assert texts(recs) == ["hi", "part a\npart b"]


def test_json_unknown_fields_fail_with_the_fields_seen(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps([{"question": "a", "answer": "b"}]))
    with pytest.raises(CorpusError, match="cannot tell which field.*question, answer.*--text-field"):
        read(tmp_path / "c.json")
    (tmp_path / "d.json").write_text(json.dumps([{"question": "a"}] * 3))
    with pytest.raises(CorpusError, match="no record has the field 'body'.*question"):
        read(tmp_path / "d.json", Fields(text_fields=("body",)))


def test_json_not_utf8(tmp_path):
    (tmp_path / "c.json").write_bytes(b'[{"text": "caf\xe9"}]')
    with pytest.raises(CorpusError, match="not UTF-8"):
        read(tmp_path / "c.json")


# -- JSONL -----------------------------------------------------------------------------


def test_jsonl_text_fields_and_bad_lines(tmp_path):
    lines = [
        json.dumps({"prompt": "p1", "response": "r1"}).encode(),
        b"{broken",
        b"",
        json.dumps({"prompt": "p2"}).encode(),
        json.dumps({"other": 1}).encode(),
        b'{"prompt": "caf\xe9"}',
        json.dumps({"prompt": "p3", "response": "r3"})[:-3].encode(),
    ]
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines))
    recs, st = read(tmp_path / "d.jsonl", Fields(text_fields=("prompt", "response")))
    assert texts(recs) == ["p1", "r1", "p2"]
    assert st.records == 3
    assert st.skipped == {
        "malformed JSON line": 1,
        "line is not valid UTF-8": 1,
        "incomplete last line (file truncated)": 1,
    }
    # Records without the fields are yielded with their problem (the builder counts them).
    assert [r.problem for r in recs] == [None, None, "no 'prompt' or 'response' field"]


def test_jsonl_messages_and_roles(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "be nice"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
            ]
        }
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    recs, _ = read(tmp_path / "m.jsonl")
    assert [t.text for t in select_turns(recs[0].turns, "assistant")] == ["a"]
    assert [t.text for t in select_turns(recs[0].turns, "all")] == ["be nice", "u", "a"]


def test_roles_assistant_needs_messages(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(CorpusError, match="--roles assistant needs chat messages"):
        read(tmp_path / "t.jsonl", Fields(roles="assistant"))


# -- Parquet and Arrow -------------------------------------------------------------------


@pytest.fixture
def table():
    pa = pytest.importorskip("pyarrow")
    n = 2500  # several batches of BATCH_ROWS
    return pa.table(
        {
            "id": [f"r{i}" for i in range(n)],
            "text": [f"row {i} text" if i % 100 else None for i in range(n)],
            "messages": [
                [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(n)
            ],
        }
    )


def test_parquet_streams_batches(tmp_path, table):
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "t.parquet", row_group_size=700)
    recs, st = read(tmp_path / "t.parquet", Fields(text_fields=("text",)))
    assert st.records == 2500 and len(recs) == 2500
    assert texts(recs) == [f"row {i} text" for i in range(2500) if i % 100]
    assert recs[1].id == "r1"
    recs, _ = read(tmp_path / "t.parquet")  # auto: the messages column
    assert texts(recs)[:4] == ["q0", "a0", "q1", "a1"]
    with pytest.raises(CorpusError, match="no column 'body'.*columns: id, text, messages"):
        read(tmp_path / "t.parquet", Fields(text_fields=("body",)))


@pytest.mark.parametrize("ipc", ["file", "stream"])
def test_arrow_file_and_stream(tmp_path, table, ipc):
    import pyarrow as pa

    path = tmp_path / "t.arrow"
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_file(sink, table.schema) if ipc == "file" else pa.ipc.new_stream(sink, table.schema)
        for batch in table.to_batches(max_chunksize=1000):
            writer.write_batch(batch)
        writer.close()
    recs, st = read(path, Fields(text_fields=("text",)))
    assert st.records == 2500
    assert texts(recs)[:2] == ["row 1 text", "row 2 text"]


def test_not_really_parquet(tmp_path):
    (tmp_path / "x.parquet").write_text("hello")
    with pytest.raises(CorpusError, match="not a readable parquet file"):
        read(tmp_path / "x.parquet")


# -- text, stdin, inputs ---------------------------------------------------------------------


def test_text_splits(tmp_path):
    (tmp_path / "a.txt").write_text("para one\nstill one\n\n\npara two\n")
    assert texts(read(tmp_path / "a.txt")[0]) == ["para one\nstill one\n\n\npara two\n"]
    assert texts(read(tmp_path / "a.txt", Fields(text_split="paragraph"))[0]) == ["para one\nstill one", "para two"]
    assert texts(read(tmp_path / "a.txt", Fields(text_split="line"))[0]) == ["para one", "still one", "para two"]
    (tmp_path / "b.txt").write_bytes(b"ok line\n\xff bad\n")
    recs, _ = read(tmp_path / "b.txt", Fields(text_split="line"))
    assert texts(recs) == ["ok line"] and recs[1].problem == "not valid UTF-8 text"


@pytest.mark.parametrize(
    "data,kind,want",
    [
        (b"plain words\n", "text", ["plain words\n"]),
        (b'{"text": "a"}\n{"text": "b"}\n', "jsonl", ["a", "b"]),
        (b'[{"conversations": [{"from": "human", "value": "hi"}]}]', "json", ["hi"]),
    ],
)
def test_stdin_detects_format(data, kind, want):
    st = SourceStats("auto", "-")
    recs = list(read_source(Source("-", "auto"), Fields(), st, stdin=io.BytesIO(data)))
    assert st.kind == kind and texts(recs) == want


def test_resolve_inputs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.jsonl").write_text("{}")
    (tmp_path / "d" / "sub" / "a.txt").write_text("x")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\0")
    (tmp_path / "d" / ".hidden.txt").write_text("x")
    (tmp_path / "noext").write_text('[{"text": "x"}]')
    got = resolve_inputs([str(tmp_path / "d"), str(tmp_path / "d" / "*.jsonl"), str(tmp_path / "noext"), "-"])
    assert [(s.path.replace(str(tmp_path), ""), s.kind) for s in got] == [
        ("/d/b.jsonl", "jsonl"),
        ("/d/sub/a.txt", "text"),
        ("/d/b.jsonl", "jsonl"),
        ("/noext", "json"),
        ("-", "auto"),
    ]
    with pytest.raises(FileNotFoundError, match="input not found"):
        resolve_inputs([str(tmp_path / "missing.json")])
    with pytest.raises(FileNotFoundError, match="no files match"):
        resolve_inputs([str(tmp_path / "*.parquet")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no input files in directory"):
        resolve_inputs([str(tmp_path / "empty")])
    with pytest.raises(CorpusError, match="unknown format"):
        resolve_inputs([str(tmp_path / "noext")], "xml")


def test_message_turns_and_holdout_rule():
    turns, problems = message_turns([{"from": "gpt", "value": "a"}, "junk", {"role": "user"}])
    assert [(t.role, t.text, t.is_assistant) for t in turns] == [("gpt", "a", True)]
    assert problems == ["message is not an object", "message has no text"]
    rule = HoldoutRule(50)
    assert [i for i in range(200) if rule(f"c{i}")] == [0, 50, 100, 150]
    assert not any(HoldoutRule(0)(f"c{i}") for i in range(10))
    # The parts of a split conversation ("<id>_<part>") go out together.
    rule = HoldoutRule(2)
    ids = ["a_0", "a_1", "b_0", "c", "a_2", "b_1", None, "d_x"]
    assert [rule(r) for r in ids] == [True, True, False, True, True, False, False, True]
    with pytest.raises(ValueError):
        HoldoutRule(-1)


# -- byte-order marks -------------------------------------------------------------------------

BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize(
    "name,data,fields,want",
    [
        ("c.jsonl", BOM + b'{"text": "first"}\n{"text": "second"}\n', None, ["first", "second"]),
        ("c.jsonl", b'{"text": "a"}\n' + BOM + b'{"text": "b"}\n', None, ["a", "b"]),  # files concatenated
        ("c.json", BOM + b'[{"text": "first"}, {"text": "second"}]', None, ["first", "second"]),
        ("c.txt", BOM + b"first words\n", None, ["first words\n"]),
        ("c.txt", BOM + b"first\nsecond\n", Fields(text_split="line"), ["first", "second"]),
        ("c.txt", BOM + b"first\n\nsecond\n", Fields(text_split="paragraph"), ["first", "second"]),
        ("noext", BOM + b'{"text": "first"}\n{"text": "second"}\n', None, ["first", "second"]),  # sniffed as jsonl
    ],
)
def test_a_utf8_bom_is_dropped_in_every_text_reader(tmp_path, name, data, fields, want):
    (tmp_path / name).write_bytes(data)
    recs, st = read(tmp_path / name, fields)
    assert texts(recs) == want and not st.skipped
    st = SourceStats("auto", "-")
    recs = list(read_source(Source("-", "auto"), fields or Fields(), st, stdin=io.BytesIO(data)))
    assert texts(recs) == want and not st.skipped


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_with_a_bom_are_decoded(tmp_path, encoding):
    text = '{"text": "héllo wörld ✓"}\n{"text": "second"}\n'
    bom = {"utf-16-be": "\ufeff"}.get(encoding, "")  # "utf-16" and "utf-32" write their own
    (tmp_path / "c.jsonl").write_bytes((bom + text).encode(encoding))
    recs, st = read(tmp_path / "c.jsonl")
    assert texts(recs) == ["héllo wörld ✓", "second"] and not st.skipped
    (tmp_path / "c.txt").write_bytes((bom + "one\ntwo ✓\n").encode(encoding))
    assert texts(read(tmp_path / "c.txt", Fields(text_split="line"))[0]) == ["one", "two ✓"]


# -- records a build must skip, not die of ---------------------------------------------------

LIMIT = 1 << 16


def _big(n=3 * LIMIT):
    return 'big "quoted" \\ {braces} [brackets] ' * (n // 36)


@pytest.mark.parametrize(
    "name,content,fields",
    [
        ("c.jsonl", lambda: "\n".join(json.dumps({"text": t}) for t in ["first", _big(), "last"]) + "\n", None),
        (
            "c.json",
            lambda: json.dumps([{"text": "first"}, {"text": _big(), "nested": [{"text": "x"}]}, {"text": "last"}]),
            None,
        ),
        ("c.txt", lambda: f"first\n{'x' * 3 * LIMIT}\nlast\n", Fields(text_split="line")),
        ("c.txt", lambda: "first\n\n" + ("y" * 1000 + "\n") * 200 + "\nlast\n", Fields(text_split="paragraph")),
    ],
)
@pytest.mark.parametrize("chunk", [readers.JSON_CHUNK, 1000])
def test_records_larger_than_the_limit_are_skipped_and_counted(tmp_path, monkeypatch, name, content, fields, chunk):
    monkeypatch.setattr(json_stream, "JSON_CHUNK", chunk)
    (tmp_path / name).write_text(content())
    fields = Fields(**{**(fields or Fields()).__dict__, "max_record_bytes": LIMIT})
    recs, st = read(tmp_path / name, fields)
    assert texts(recs) == ["first", "last"]
    # Skipped while read (JSON), or yielded with the problem for the builder to count (text).
    problems = list(st.skipped.elements()) + [r.problem for r in recs if r.problem]
    assert problems == ["record larger than 65,536 bytes (the --max-record-mib limit)"]
    if name.endswith("json") or name.endswith("jsonl"):
        with pytest.raises(CorpusError, match="record larger than 65,536 bytes.*--strict"):
            read(tmp_path / name, fields, strict=True)


def test_a_text_file_or_parquet_cell_larger_than_the_limit_is_a_bad_record(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("z" * (LIMIT + 1))
    recs, _ = read(tmp_path / "a.txt", Fields(max_record_bytes=LIMIT))
    assert recs[0].problem == "record larger than 65,536 bytes (the --max-record-mib limit)"
    pq.write_table(pa.table({"text": ["small", "w" * (LIMIT + 1), "end"]}), tmp_path / "t.parquet")
    recs, _ = read(tmp_path / "t.parquet", Fields(max_record_bytes=LIMIT))
    assert texts(recs) == ["small", "end"] and "record larger than" in recs[1].problem
    with pytest.raises(ValueError, match="max_record_bytes must be a positive integer"):
        Fields(max_record_bytes=0)


@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_undecodable_records_are_skipped_and_counted(tmp_path, kind):
    bad = [
        '{"text": "deep", "x": ' + "[" * 50_000 + "]" * 50_000 + "}",  # beyond the decoder's recursion limit
        '{"text": "big number", "n": ' + "7" * 5000 + "}",  # beyond Python's int digits limit
        '{"text": "lone \\ud800 surrogate"}',  # no tokenizer can encode it
    ]
    good = ['{"text": "first"}', '{"text": "last", "ok": "\\ud83d\\ude00 pair"}']
    lines = [good[0], *bad, good[1]]
    (tmp_path / f"c.{kind}").write_text("[" + ",\n".join(lines) + "]" if kind == "json" else "\n".join(lines) + "\n")
    recs, st = read(tmp_path / f"c.{kind}")
    assert texts(recs) == ["first", "last"]
    what = "record" if kind == "json" else "line"
    assert st.skipped == {
        f"JSON {what} nested too deeply": 1,
        f"unreadable JSON {what} (Exceeds the limit (4300 digits) for integer string conversion)": 1,
    }
    # The surrogate's text is dropped as a problem of its record (the builder counts it).
    assert [r.turn_problems for r in recs] == [[], ["text field is not valid Unicode (a lone surrogate)"], []]
    with pytest.raises(CorpusError, match="nested too deeply.*--strict"):
        read(tmp_path / f"c.{kind}", strict=True)


def test_a_fifo_input_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(CorpusError, match="is a FIFO, not a regular file; to read from a pipe, give -"):
        resolve_inputs([str(tmp_path / "pipe.jsonl")])
