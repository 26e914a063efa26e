"""The `sssd` command line as a careless user meets it: bad arguments fail at once, in one
line naming the argument, with a non-zero exit and no traceback; --help states each
default once and explains every option."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from test_builder_support import conversations, make_tokenizer

from sssd.cli import main


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """An empty cache and no default datastore: nothing may be built or pulled by accident."""
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SSSD_DATASTORE", raising=False)
    monkeypatch.delenv("SSSD_MODELS_DIR", raising=False)
    return tmp_path / "cache"


def run(capsys, *argv):
    """(exit code, stdout, stderr) of `sssd ARGV`, run in this process."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's exits (--help, usage errors)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# -- --help ---------------------------------------------------------------------------------


def _help_entries(text: str) -> dict[str, str]:
    """{option invocation: its help text} from an argparse help screen."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if m:
            current = m.group(1).strip()
            entries[current] = m.group(2) or ""
        elif current and re.match(r"^ {10,}\S", line):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


COMMANDS = [
    "build",
    "calibrate",
    "draft",
    "groundtruth",
    "info",
    "models",
    "models list",
    "models pull",
    "models path",
    "plan",
    "serve",
    "verify",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_states_each_default_once_and_explains_every_option(capsys, command):
    code, out, _ = run(capsys, *command.split(), "--help")
    assert code == 0
    entries = _help_entries(out)
    assert "-h, --help" in entries
    for option, text in entries.items():
        assert text.strip(), f"sssd {command}: {option} has no help text"
        assert text.count("(default") <= 1, f"sssd {command}: {option}: {text}"
        assert "(default: None)" not in text, f"sssd {command}: {option}: {text}"


def test_help_shows_a_default_the_help_text_does_not_state(capsys):
    _, out, _ = run(capsys, "draft", "--help")
    entries = _help_entries(out)
    assert entries["--budget BUDGET"].endswith("(default: 32)")
    assert entries["--tokenizer TOKENIZER"].count("default") == 1  # stated by the help text itself
    assert "(default" not in entries["--json"]  # a flag
    _, out, _ = run(capsys, "calibrate", "--help")
    assert _help_entries(out)["--budgets BUDGETS [BUDGETS ...]"].endswith("(default: 4 8 16 32 64)")


# -- bad arguments ----------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    """A few real things to point arguments at."""
    (tmp_path / "gt.jsonl").write_text('{"not": "read before the arguments are checked"}\n')
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


CASES = [
    # draft
    (["draft", "--ids", "1,2,x"], "argument --ids: 'x' (item 3) is not a token id"),
    (["draft", "--ids", ""], "argument --ids: no token ids"),
    (["draft", "--ids", "1,,2"], "argument --ids: an empty item (item 2) is not a token id"),
    (["draft", "--ids", "-5"], "argument --ids: -5 (item 1) is not a token id: ids are in [0, 4294967294]"),
    (["draft", "--ids", "4294967295"], "is not a token id"),
    (["draft", "--budget", "-1", "text"], "argument --budget: must be >= 1, got -1"),
    (["draft", "--budget", "many", "text"], "argument --budget: 'many' is not an integer"),
    (["draft", "--budget", "100000", "text"], "argument --budget: must be <= 4096"),
    (["draft", "--paths", "0", "text"], "argument --paths: must be >= 1"),
    (["draft", "--config", "{d}/nope.json", "text"], "argument --config: {d}/nope.json: no such file or directory"),
    (["draft", "--config", "{d}/a_dir", "text"], "argument --config: {d}/a_dir: it is a directory, not a regular file"),
    (["draft", "--config", "{d}/fifo", "text"], "argument --config: {d}/fifo: it is a FIFO, not a regular file"),
    (["draft", "--tokenizer", "{d}/nope.json", "text"], "argument --tokenizer: {d}/nope.json: no such file"),
    (["draft", "--datastore", "{d}/nope", "text"], "argument --datastore: {d}/nope: no such file or directory"),
    (["draft", "--datastore", "{d}/fifo", "text"], "it is a FIFO, not a datastore directory or archive"),
    (["draft"], "give TEXT or --ids"),
    (["draft", "--ids", "1", "text"], "give either TEXT or --ids (not both)"),
    (["draft", ""], "argument text: empty text"),
    (["draft", "--datastore", "none", "some text"], "--datastore none has no tokenizer to read TEXT with"),
    # calibrate
    (["calibrate", "/nope.jsonl"], "argument groundtruth: /nope.jsonl: no such file or directory"),
    (["calibrate", "{d}/a_dir"], "argument groundtruth: {d}/a_dir: it is a directory, not a regular file"),
    (["calibrate", "{d}/fifo"], "it is a FIFO, not a regular file"),
    (["calibrate", "{d}/gt.jsonl", "--budgets", "8", "0"], "argument --budgets: must be >= 1, got 0"),
    (["calibrate", "{d}/gt.jsonl", "--workers", "-2"], "argument --workers: must be >= 0, got -2"),
    (["calibrate", "{d}/gt.jsonl", "--limit", "-1"], "argument --limit: must be >= 0"),
    (["calibrate", "{d}/gt.jsonl", "--default-budget", "-8"], "argument --default-budget: must be >= 0"),
    (["calibrate", "{d}/gt.jsonl", "--input-scale", "nan"], "argument --input-scale: must be a finite number"),
    (["calibrate", "{d}/gt.jsonl", "--input-scale", "-0.5"], "argument --input-scale: must be >= 0"),
    (["calibrate", "{d}/gt.jsonl", "--max-samples", "0"], "argument --max-samples: must be >= 1"),
    (
        ["calibrate", "{d}/gt.jsonl", "--datastore-branch-len", "300"],
        "argument --datastore-branch-len: 300 is refused: branch_len must be in [1, 255]",
    ),
    (["calibrate", "{d}/gt.jsonl", "-o", "{d}/a_dir"], "argument -o/--output: {d}/a_dir: it is a directory"),
    (["calibrate", "{d}/gt.jsonl", "-o", "{d}/notes.txt/out.json"], "{d}/notes.txt is not a directory"),
    (["calibrate", "{d}/gt.jsonl", "--datastore", "{d}/nope"], "argument --datastore: {d}/nope: no such file"),
    (["calibrate", "{d}/gt.jsonl", "--draft", "retrieval"], "argument --draft: 'retrieval': only draft models"),
    (["calibrate", "{d}/gt.jsonl", "--draft", "model:"], "malformed draft source 'model:'"),
    (["calibrate", "{d}/gt.jsonl", "--draft-scales", "0"], "argument --draft-scales: must be > 0"),
    # build
    (["build", "{d}/notes.txt", "-o", "{d}/ds", "-t", "{d}/nope.json"], "argument -t/--tokenizer: {d}/nope.json"),
    (
        ["build", "{d}/notes.txt", "-o", "{d}/notes.txt", "-t", "{d}/tok.json"],
        "argument -o/--output: {d}/notes.txt: it exists and is not a directory",
    ),
    (
        ["build", "{d}/notes.txt", "-o", "{d}/ds", "-t", "{d}/tok.json", "--threads", "-1"],
        "argument --threads: must be >= 0",
    ),
    (
        ["build", "{d}/notes.txt", "-o", "{d}/ds", "-t", "{d}/tok.json", "--batch-docs", "0"],
        "argument --batch-docs: must be >= 1",
    ),
    (
        ["build", "{d}/notes.txt", "-o", "{d}/ds", "-t", "{d}/tok.json", "--holdout-every", "-3"],
        "argument --holdout-every: must be >= 0",
    ),
    (
        ["build", "{d}/notes.txt", "-o", "{d}/ds", "-t", "{d}/tok.json", "--max-record-mib", "0"],
        "argument --max-record-mib: must be > 0",
    ),
    (
        ["build", "{d}/notes.txt", "-o", "{d}/ds", "-t", "{d}/tok.json", "--text-field", ","],
        "argument --text-field: no field name given",
    ),
    (
        ["build", "{d}/notes.txt", "-o", "{d}/ds", "-t", "{d}/tok.json", "--text-field", "a", "--messages-field", "m"],
        "arguments --text-field and --messages-field: give one or the other",
    ),
    (
        ["build", "{d}/fifo", "-o", "{d}/ds", "-t", "{d}/tok.json"],
        "input {d}/fifo is a FIFO, not a regular file; to read from a pipe, give -",
    ),
    (["build", "{d}/a_dir", "-o", "{d}/ds", "-t", "{d}/tok.json"], "no input files in directory {d}/a_dir"),
    (["build", "", "-o", "{d}/ds", "-t", "{d}/tok.json"], "argument INPUT: empty input"),
    (
        ["build", "{d}/notes.txt", "-o", "/proc/sssd-nope/ds", "-t", "{d}/tok.json"],
        "cannot create the datastore in /proc/sssd-nope",
    ),
    # the default datastore, not built (the one-line message says how to build it)
    (["info"], "the default datastore is not built yet"),
    (["verify"], "the default datastore is not built yet"),
    (["calibrate", "{d}/gt.jsonl"], "the default datastore is not built yet (looked in"),
    # info and verify
    (["info", "{d}/nope"], "argument datastore: {d}/nope: no such file or directory"),
    (["info", "{d}/notes.txt"], "{d}/notes.txt is neither a datastore directory nor an SSSD datastore archive"),
    (["info", "{d}/a_dir"], "{d}/a_dir is not a datastore: manifest.json is missing"),
    (["verify", "{d}/fifo"], "it is a FIFO, not a datastore directory or archive"),
    (["verify", "{d}/notes.txt"], "{d}/notes.txt is neither a datastore directory nor an SSSD datastore archive"),
    # groundtruth (checked before any model or dataset loads)
    (["groundtruth", "--prompts", "/nope.jsonl"], "argument --prompts: /nope.jsonl: no such file or directory"),
    (["groundtruth", "--prompts", "{d}/a_dir"], "argument --prompts: {d}/a_dir: it is a directory"),
    (["groundtruth", "--dataset", "mtbench", "--limit", "0"], "argument --limit: must be >= 1, got 0"),
    (["groundtruth", "--dataset", "mtbench", "--max-new-tokens", "-1"], "argument --max-new-tokens: must be >= 1"),
    (["groundtruth", "--dataset", "mtbench", "--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["groundtruth", "--dataset", "mtbench", "--threads", "0"], "argument --threads: must be >= 1"),
    (
        ["groundtruth", "--dataset", "mtbench", "-m", "no-such-model"],
        "argument -m/--model: unknown model 'no-such-model'",
    ),
    (
        ["groundtruth", "--dataset", "mtbench", "-m", "{d}/nope"],
        "argument -m/--model: unknown model '{d}/nope': no such model folder",
    ),
    (["groundtruth", "--dataset", "mtbench", "-m", "{d}/notes.txt"], "not a file"),
    (["groundtruth", "--dataset", "mtbench", "-o", "{d}/a_dir"], "argument -o/--output: {d}/a_dir: it is a directory"),
    (["groundtruth", "--dataset", "mtbench", "--datastore", "{d}/nope"], "argument --datastore: {d}/nope: no such"),
    (["groundtruth"], "one of the arguments --dataset --prompts is required"),
    # models
    (["models", "pull", "no-such-model"], "argument name: unknown model 'no-such-model'; registered models:"),
    (["models", "path", "no-such-model"], "argument name: unknown model 'no-such-model'"),
    (["models", "--dir", "{d}/notes.txt", "list"], "argument --dir: {d}/notes.txt: it is not a directory"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_arguments_fail_in_one_line(files, cache, capsys, argv, message):
    make_tokenizer(files / "tok.json")
    d = str(files)
    argv = [a.replace("{d}", d) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code not in (0, None), (argv, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line
    command = " ".join(a for a in argv[:2] if a in ("models", "pull", "path", "list") or a == argv[0])
    assert err.startswith(f"sssd {command}: error: "), err
    assert message.replace("{d}", d) in err, err
    assert "[Errno" not in err
    # Nothing was built or pulled on the way (the default datastore, a model).
    assert not (cache / "datastores").exists() and not (cache / "models").exists()


def test_draft_checks_its_arguments_before_building_the_default_datastore(cache, capsys, tmp_path):
    # With no default datastore, `sssd draft` builds it first (a minute): a typo must not cost that.
    for argv in (
        ["draft", "--ids", "1,2,x"],
        ["draft", "--config", str(tmp_path / "nope.json"), "text"],
        ["draft", "--budget", "0", "text"],
    ):
        code, _, err = run(capsys, *argv)
        assert code == 1 and err.count("\n") == 1 and "The default datastore is not built yet" not in err
        assert not (cache / "datastores").exists()


@pytest.fixture
def datastore(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "c.json").write_text(json.dumps(conversations(20)))
    assert main(["build", str(tmp_path / "c.json"), "-o", str(tmp_path / "ds"), "-t", str(tok), "-q"]) == 0
    capsys.readouterr()
    return tmp_path / "ds"


def test_draft_with_good_arguments_still_works(datastore, capsys):
    code, out, err = run(capsys, "draft", "--datastore", datastore, "--ids", " 1, 2,3,", "--json")
    assert code == 0, err
    assert set(json.loads(out)) == {"tokens", "parents", "depths", "scores", "sources"}
    code, out, err = run(capsys, "draft", "--datastore", datastore, "question 7: how do I")
    assert code == 0 and "best chain" in out, err


def test_calibrate_refuses_ground_truth_that_is_not_ground_truth(datastore, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "junk.jsonl").write_text("not json at all\n")
    for name in ("empty.jsonl", "junk.jsonl"):
        code, _, err = run(capsys, "calibrate", tmp_path / name, "--datastore", datastore, "-o", tmp_path / "cal.json")
        assert code == 1 and err.count("\n") == 1 and err.startswith("sssd calibrate: error: "), err
        assert str(tmp_path / name) in err and "[Errno" not in err
    assert not (tmp_path / "cal.json").exists()


def test_a_closed_pipe_is_not_an_error_message(datastore):
    # `sssd info DS | head -1`: the reader goes away; no "Broken pipe" error, no traceback.
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "sssd.cli", "info", "--json", str(datastore)],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(w)
    assert proc.stderr == "" and proc.returncode != 0
