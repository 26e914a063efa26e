"""The copy-heavy prompt sets (sssd.calibration.copy_sets): built offline from installed sources,
deterministic, references that copy the prompt, exact edits, grouped dev/eval split."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from collections import defaultdict

import pytest

from sssd.calibration import copy_sets, datasets
from sssd.calibration.copy_sets import tqdm_code, transforms

pytest.importorskip("tqdm")

CODE = re.compile(r"```python\n(.*?)\n```", re.S)


@pytest.fixture(scope="module")
def sets():
    return {name: datasets.load(name) for name in copy_sets.COPY_SETS}


def _prompt(r) -> str:
    return "\n".join(m["content"] for m in r.messages)


def _code(text: str) -> str:
    blocks = CODE.findall(text)
    assert blocks, text[:200]
    return blocks[-1]


def _digest(records) -> str:
    return hashlib.sha256(json.dumps([r.to_json() for r in records], sort_keys=True).encode()).hexdigest()


# -- the sets as a whole ---------------------------------------------------------------------


def test_registered():
    for name in copy_sets.COPY_SETS:
        assert name in datasets.DATASETS
    five = datasets.load("code-edits", limit=5)
    assert len(five) == 5 and all(r.dataset == "code-edits" for r in five)


@pytest.mark.parametrize("name", copy_sets.COPY_SETS)
def test_shape(sets, name):
    records = sets[name]
    assert 120 <= len(records) <= 300
    ids = [r.id for r in records]
    assert len(set(ids)) == len(ids)
    for r in records:
        assert r.dataset == name and r.id.startswith(name + "/")
        assert r.reference and r.messages[-1]["role"] == "user"
        assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str) for m in r.messages)
        limit = copy_sets.MAX_LONG_PROMPT_CHARS if name == "quoting" else copy_sets.MAX_PROMPT_CHARS
        assert len(_prompt(r)) <= limit, r.id


def test_deterministic(sets):
    """Equal on a second call, and in another process with another string hash seed."""
    for name in copy_sets.COPY_SETS:
        assert datasets.load(name) == sets[name]
    code = (
        "import hashlib, json; from sssd.calibration import datasets; "
        "print(json.dumps({n: hashlib.sha256(json.dumps([r.to_json() for r in datasets.load(n)], "
        "sort_keys=True).encode()).hexdigest() for n in ('code-edits', 'agent-traces', 'quoting')}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {n: _digest(sets[n]) for n in copy_sets.COPY_SETS}


@pytest.mark.parametrize("name", copy_sets.COPY_SETS)
def test_split_grouped(sets, name):
    """Every record of one source (the id before '#') is on one side; both sides are used."""
    sides: dict[str, set[str]] = defaultdict(set)
    for r in sets[name]:
        head = r.id.split("#", 1)[0]
        assert datasets.split_group(r.id) == datasets.split_group(head)
        sides[head].add(datasets.split_of(r.id))
    assert all(len(s) == 1 for s in sides.values())
    assert {next(iter(s)) for s in sides.values()} == {"dev", "eval"}
    if name == "code-edits":  # one group per source function
        assert len(sides) == len(copy_sets.source_functions())


# -- references copy the prompt ---------------------------------------------------------------


def test_code_edit_references_copy_the_prompt(sets):
    for r in sets["code-edits"]:
        prompt_lines = {line.strip() for line in _prompt(r).split("\n")}
        ref_lines = [line.strip() for line in r.reference.split("\n") if line.strip()]
        share = sum(line in prompt_lines for line in ref_lines) / len(ref_lines)
        assert share >= 0.5, (r.id, share)


def _copied_share(reference: str, prompt: str, k: int = 16) -> float:
    """The share of the reference's characters inside a k-character span that occurs in the prompt."""
    grams = {prompt[i : i + k] for i in range(len(prompt) - k + 1)}
    covered = bytearray(len(reference))
    for i in range(len(reference) - k + 1):
        if reference[i : i + k] in grams:
            covered[i : i + k] = b"\x01" * k
    return sum(covered) / max(1, len(reference))


def test_agent_trace_references_copy_the_prompt(sets):
    shares = []
    for r in sets["agent-traces"]:
        share = _copied_share(r.reference, _prompt(r))
        assert share >= 0.4, (r.id, share)
        shares.append(share)
    assert sum(shares) / len(shares) >= 0.6


def test_quoting_references_quote_verbatim(sets):
    long = 0
    for r in sets["quoting"]:
        quotes = re.findall(
            r'^(?:According to passage \d+|Passage \d+ \([^)]*\) mentions it): "(.*?)"$', r.reference, re.S | re.M
        )
        assert quotes, r.id
        body = r.messages[-1]["content"]
        for q in quotes:
            assert len(q) >= 30 and q in body, r.id
        for n in re.findall(r"[Pp]assage (\d+)", r.reference):
            assert f"[Passage {n}] " in body
        long += len(_prompt(r)) > copy_sets.MAX_PROMPT_CHARS
    assert long >= 5


# -- the edits are exact ---------------------------------------------------------------------


def _by_qualname():
    return {f.qualname: f for f in copy_sets.source_functions()}


def _names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)
    }


def _code_body(fn):
    return transforms._code_body(fn)


def test_edits_are_exact(sets):
    fns = _by_qualname()
    kinds = defaultdict(int)
    for r in sets["code-edits"]:
        head, kind = r.id.split("#")
        fn = fns[head[len("code-edits/") :]]
        user = r.messages[-1]["content"]
        ref = _code(r.reference)
        ref_tree = ast.parse(ref if not kind.startswith("file-") else copy_sets.dedent_exact(ref, fn.indent))
        kinds[kind] += 1
        if kind.startswith("file-"):
            orig = fn.source
            ref_src = copy_sets.dedent_exact(ref, fn.indent)
            assert ref_src is not None
            if kind == "file-fix-bug":  # the answer is the function exactly as in the installed file
                file_text = dict(tqdm_code._source_files())[fn.path].split("\n")
                assert ref == "\n".join(file_text[fn.start - 1 : fn.end])
            kind, ref = kind[len("file-") :], ref_src
        else:
            orig = _code(user)
        orig_tree = ast.parse(orig)
        if kind == "fix-bug":
            assert ref == fn.source
            if not r.id.split("#")[1].startswith("file-"):
                diff = [i for i, (a, b) in enumerate(zip(orig.split("\n"), ref.split("\n"))) if a != b]
                assert len(diff) == 1 and f"line {diff[0] + 1}" in user
                assert ast.dump(orig_tree) != ast.dump(ref_tree)
            continue
        assert orig == fn.source
        if kind == "rename-var":
            old, new = re.search(
                r"[Rr]ename (?:the (?:parameter|local variable) )?`(\w+)`"
                r"(?: of the (?:method|function) `\w+`)? to `(\w+)`",
                user,
            ).groups()
            assert ast.dump(ref_tree) == copy_sets.expected_rename(orig, old, new)
            assert old not in _names(ref_tree) and new in _names(ref_tree)
        elif kind == "rename-function":
            new = re.search(r"to `(\w+)`", user).group(1)
            node = ref_tree.body[0]
            assert node.name == new and fn.name not in _names(ref_tree)
            assert not any(isinstance(n, ast.FunctionDef) and n.name == fn.name for n in ast.walk(ref_tree))
        elif kind == "remove-comments":
            assert ast.dump(ref_tree) == ast.dump(orig_tree)
            toks = tokenize.generate_tokens(io.StringIO(ref + "\n").readline)
            assert not any(t.type == tokenize.COMMENT for t in toks)
            assert ref != orig
        elif kind == "add-log":
            stmt = re.search(r"`((?:print|logger\.\w+)\(.*?\))`", user).group(1)
            new_body, old_body = _code_body(ref_tree.body[0]), _code_body(orig_tree.body[0])
            assert ast.dump(new_body[0]) == ast.dump(ast.parse(stmt).body[0])
            assert [ast.dump(s) for s in new_body[1:]] == [ast.dump(s) for s in old_body]
        elif kind == "wrap-try":
            new_body, old_body = _code_body(ref_tree.body[0]), _code_body(orig_tree.body[0])
            assert len(new_body) == 1 and isinstance(new_body[0], ast.Try)
            assert [ast.dump(s) for s in new_body[0].body] == [ast.dump(s) for s in old_body]
            handler = new_body[0].handlers[0]
            assert isinstance(handler.body[-1], ast.Raise) and handler.body[-1].exc is None
        elif kind == "change-constant":
            old, new = re.search(r"`([\d.e+-]+)` to `([\d.e+-]+)`", user).groups()
            diff = [(a, b) for a, b in zip(orig.split("\n"), ref.split("\n")) if a != b]
            assert len(diff) == 1 and len(orig.split("\n")) == len(ref.split("\n"))
            assert diff[0][1].strip() != diff[0][0].strip() and new in diff[0][1] and old in diff[0][0]
        else:
            raise AssertionError(f"unknown kind {kind}")
    assert set(copy_sets.EDIT_KINDS) <= set(kinds)
    assert sum(v for k, v in kinds.items() if k.startswith("file-")) >= 20


# -- the transformations on tricky inputs ------------------------------------------------------


def test_rename_identifier_leaves_attributes_keywords_and_strings():
    src = (
        'def f(total, x=1):\n    """total is the total."""\n    obj.total = total  # total\n'
        '    g(total=total, y=f"{total}")\n    return [total for _ in x]'
    )
    out = copy_sets.rename_identifier(src, "total", "count")
    assert out == (
        'def f(count, x=1):\n    """total is the total."""\n    obj.total = count  # total\n'
        '    g(total=count, y=f"{count}")\n    return [count for _ in x]'
    )
    with pytest.raises(copy_sets.EditError):
        copy_sets.rename_identifier(src, "total", "x")  # taken
    with pytest.raises(copy_sets.EditError):
        copy_sets.rename_identifier("def f():\n    try:\n        pass\n    except E as e:\n        e = 1", "e", "z")


def test_remove_comments_keeps_hashes_in_strings():
    src = 'def f():\n    # gone\n    s = "# kept"  # gone too\n    return s'
    assert copy_sets.remove_comments(src) == 'def f():\n    s = "# kept"\n    return s'


def test_wrap_try_leaves_multiline_strings_alone():
    src = 'def f():\n    """Doc."""\n    s = """a\nb"""\n    return s'
    out = copy_sets.wrap_try(src, "f")
    assert out == (
        'def f():\n    """Doc."""\n    try:\n        s = """a\nb"""\n        return s\n'
        '    except Exception as err:\n        logger.error("f failed: %s", err)\n        raise'
    )
    ns: dict = {}
    exec(out.replace("logger.error", "print"), ns)  # noqa: S102 - our own snippet
    assert ns["f"]() == "a\nb"


def test_dedent_reindent_roundtrip():
    for fn in copy_sets.source_functions():
        text = dict(tqdm_code._source_files())[fn.path].split("\n")
        assert copy_sets.reindent(fn.source, fn.indent) == "\n".join(text[fn.start - 1 : fn.end])
