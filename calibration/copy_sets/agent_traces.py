"""The ``agent-traces`` set, one of the copy-heavy prompt sets.

``agent_traces()``: agent-like traces: a system prompt describing JSON tool
calls, a task, assistant turns (plans, tool calls) and tool outputs as user
turns ("Tool output (<tool>):" with directory listings, grep hits and
numbered file contents of the same tqdm sources, and pytest output made up
here). The reference restates the plan, quotes tool outputs, or repeats an
earlier tool call with a small change. Seven templates, each instance drawn
by a seeded RNG. Ids: ``agent-traces/<template>/<subject>`` (``#<n>``: a
later cut of the same trace, or another question on the same listing).
"""

from __future__ import annotations

import ast
import json
import random
import re

from sssd.calibration.copy_sets.code_edits import _code_block
from sssd.calibration.copy_sets.constants import MAX_PROMPT_CHARS, SEED
from sssd.calibration.copy_sets.tqdm_code import (
    SOURCE_PACKAGE,
    SourceFunction,
    _source_files,
    reindent,
    source_functions,
    tqdm_source,
)
from sssd.calibration.copy_sets.transforms import FLIPS, EditError, _function_node, flip_operator, operator_sites
from sssd.calibration.datasets import PromptRecord

AGENT_SYSTEMS = (
    "You are a coding agent working in a checkout of the tqdm repository (version {version}). Call a tool by "
    'writing one JSON object on its own line: {{"tool": <name>, "arguments": {{...}}}}. Tools:\n'
    "- list_dir(path): the files and folders in a folder, with sizes\n"
    "- grep(pattern, path): matching lines as path:line:text (Python regular expressions)\n"
    "- read_file(path, start_line, end_line): lines of a file, numbered\n"
    "- run_tests(selector): runs pytest on a test id and prints its output\n"
    "- edit_file(path, old, new): replaces the exact text old with new\n"
    "Think step by step, say what you will do before each call, and finish with a short answer for the user.",
    "You are an autonomous software engineer. The repository is tqdm {version}. You act only through tools; "
    'to use one, reply with a JSON object {{"tool": ..., "arguments": ...}}. Available tools: list_dir '
    "{{path}}, grep {{pattern, path}}, read_file {{path, start_line, end_line}}, run_tests {{selector}}, "
    "edit_file {{path, old, new}}. Tool results come back in the next user message. Be precise and quote "
    "code exactly.",
    "System: repository assistant for tqdm {version}.\nTool protocol: emit exactly one JSON object per tool "
    'call, e.g. {{"tool": "read_file", "arguments": {{"path": "tqdm/std.py", "start_line": 1, '
    '"end_line": 40}}}}.\nTools: list_dir, grep, read_file, run_tests, edit_file.\nWhen you have the answer, '
    "reply without a tool call.",
)


def _call(tool: str, **arguments) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


def _tool_output(tool: str, text: str) -> dict:
    return {"role": "user", "content": f"Tool output ({tool}):\n{text}"}


def _listing(folder: str) -> str:
    """A directory listing of a package folder: name, bytes, lines; folders first."""
    files = dict(_source_files())
    root, _ = tqdm_source()
    real = root.parent / folder
    rows = []
    for p in sorted(real.iterdir(), key=lambda p: (not p.is_dir(), p.name)):
        if p.name == "__pycache__":
            continue
        rel = f"{folder}/{p.name}"
        if p.is_dir():
            rows.append(f"{p.name + '/':24s} {'-':>8s}  (folder)")
        else:
            text = files.get(rel)
            n_lines = len(text.splitlines()) if text is not None else len(p.read_bytes().splitlines())
            rows.append(f"{p.name:24s} {p.stat().st_size:8d}  {n_lines} lines")
    return f"{folder}/\n" + "\n".join(rows)


def _numbered(path: str, start: int, end: int, text: str | None = None) -> str:
    lines = (text if text is not None else dict(_source_files())[path]).split("\n")
    end = min(end, len(lines))
    return "\n".join(f"{n:5d} | {lines[n - 1]}" for n in range(start, end + 1))


def _grep(pattern: str, folder: str = SOURCE_PACKAGE) -> list[tuple[str, int, str]]:
    rx = re.compile(pattern)
    hits = []
    for path, text in _source_files():
        if not (path == folder or path.startswith(folder.rstrip("/") + "/")):
            continue
        for n, line in enumerate(text.split("\n"), start=1):
            if rx.search(line):
                hits.append((path, n, line))
    return hits


def _grep_text(hits: list[tuple[str, int, str]]) -> str:
    return "\n".join(f"{p}:{n}:{line}" for p, n, line in hits) or "(no matches)"


def _first_paragraph(fn: SourceFunction) -> str | None:
    doc = ast.get_docstring(_function_node(fn.source), clean=False)
    if not doc:
        return None
    para = doc.strip().split("\n\n")[0].strip()
    return para if len(para) >= 12 else None


def _trace_locate(fn: SourceFunction, rng: random.Random, system: str) -> tuple[list[dict], str]:
    """Find a function, read it, answer by quoting it and restating the steps."""
    folder = fn.path.rsplit("/", 1)[0]
    task = rng.choice(
        [
            f"Where is `{fn.name}` implemented in tqdm, and what does it look like? Show me its code.",
            f"I need to understand `{fn.qualname.split('.', 1)[1]}`. Find its definition and quote it.",
            f"Find the definition of `{fn.name}`{' in class `' + fn.cls + '`' if fn.cls else ''} and "
            "show it to me verbatim.",
        ]
    )
    plan = (
        f"Plan:\n1. List `{folder}` to see the modules.\n2. Grep for the `def {fn.name}` line.\n"
        f"3. Read the lines of the definition.\n4. Quote the code and summarise where it is."
    )
    pattern = rf"def {fn.name}\b"
    hits = _grep(pattern)
    lo, hi = max(1, fn.start - 2), fn.end + 2
    msgs = [
        {"role": "system", "content": system},
        {"role": "user", "content": task},
        {"role": "assistant", "content": f"{plan}\n\n{_call('list_dir', path=folder)}"},
        _tool_output("list_dir", _listing(folder)),
        {
            "role": "assistant",
            "content": f"Now I search for the definition.\n{_call('grep', pattern=pattern, path='tqdm')}",
        },
        _tool_output("grep", _grep_text(hits)),
        {
            "role": "assistant",
            "content": f"It is in `{fn.path}` at line {fn.start}. Reading it.\n"
            f"{_call('read_file', path=fn.path, start_line=lo, end_line=hi)}",
        },
        _tool_output("read_file", _numbered(fn.path, lo, hi)),
    ]
    hit = next(f"{p}:{n}:{line}" for p, n, line in hits if p == fn.path and fn.start <= n <= fn.end)
    file_code = reindent(fn.source, fn.indent)
    ref = (
        f"`{fn.name}` is defined in `{fn.path}`, lines {fn.start}-{fn.end}"
        f"{' (a method of class `' + fn.cls + '`)' if fn.cls else ''}:\n\n{_code_block(file_code)}\n"
    )
    doc = _first_paragraph(fn)
    if doc:
        ref += f'\nIts docstring begins: "{doc}"\n'
    ref += (
        f"\nWhat I did:\n1. Listed `{folder}`.\n2. Grepped for `def {fn.name}`: {len(hits)} match"
        f"{'es' if len(hits) != 1 else ''}, among them `{hit}`.\n3. Read lines {lo}-{hi} of `{fn.path}`."
    )
    return msgs, ref


def _trace_continue(path: str, rng: random.Random, system: str, reads: int) -> tuple[list[dict], str]:
    """Read a file in chunks; the answer is the next read_file call (the last one with new lines)."""
    text = dict(_source_files())[path]
    n_lines = len(text.splitlines())
    step = rng.choice([40, 50, 60])
    topic = rng.choice(
        ["how it handles its arguments", "what it imports and why", "its public API", "how errors are handled"]
    )
    msgs = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Read `{path}` and tell me {topic}."},
        {
            "role": "assistant",
            "content": f"Plan: read `{path}` in chunks of {step} lines, note {topic}, then "
            f"answer.\n{_call('read_file', path=path, start_line=1, end_line=step)}",
        },
        _tool_output("read_file", _numbered(path, 1, step)),
    ]
    for k in range(1, reads):
        a, b = k * step + 1, (k + 1) * step
        msgs += [
            {
                "role": "assistant",
                "content": f"Continuing with the next {step} lines.\n"
                f"{_call('read_file', path=path, start_line=a, end_line=b)}",
            },
            _tool_output("read_file", _numbered(path, a, b)),
        ]
    a, b = reads * step + 1, (reads + 1) * step
    tail = _numbered(path, reads * step - 4, reads * step)
    ref = (
        f"So far I have read lines 1-{reads * step} of `{path}`, which has {n_lines} lines. The last ones I read "
        f"were:\n\n{tail}\n\nThat is not the end of the file, so I will read the next {step} lines.\n"
        f"{_call('read_file', path=path, start_line=a, end_line=b)}"
    )
    return msgs, ref


def _trace_fix(fn: SourceFunction, rng: random.Random, system: str) -> tuple[list[dict], str] | None:
    """A failing test traced to a flipped operator; the answer quotes the line, edits it back and
    reruns the same test."""
    sites = operator_sites(fn.source)
    rng.shuffle(sites)
    for site in sites:
        try:
            buggy = flip_operator(fn.source, site)
        except EditError:
            continue
        break
    else:
        return None
    row = site.start[0]
    file_row = fn.start + row - 1
    text = dict(_source_files())[fn.path]
    lines = text.split("\n")
    buggy_file = "\n".join(lines[: fn.start - 1] + reindent(buggy, fn.indent).split("\n") + lines[fn.end :])
    bad_line = buggy_file.split("\n")[file_row - 1]
    good_line = lines[file_row - 1]
    module = fn.path.rsplit("/", 1)[-1][:-3].lstrip("_")
    test = f"tests/tests_{module}.py::test_{fn.name.strip('_')}"
    exc = rng.choice(
        [
            "AssertionError: assert 0 == 1",
            "AssertionError: expected 10, got 9",
            "ValueError: unexpected value",
            "AssertionError: output differs from expected",
        ]
    )
    pytest_out = (
        f"============================= test session starts ==============================\n"
        f"collected 1 item\n\n{test} F{'':>30s}[100%]\n\n"
        f"=================================== FAILURES ===================================\n"
        f"_{'_' * 20} test_{fn.name.strip('_')} {'_' * 20}\n\n"
        f"    def test_{fn.name.strip('_')}():\n>       check_{fn.name.strip('_')}()\n\n"
        f"{fn.path}:{file_row}: in {fn.name}\n    {bad_line.strip()}\nE   {exc}\n"
        f"=========================== short test summary info ============================\n"
        f"FAILED {test} - {exc}\n"
        f"============================== 1 failed in 0.42s ==============================="
    )
    lo, hi = max(1, fn.start - 2), fn.end + 2
    plan = (
        "Plan:\n1. Run the failing test to see the error.\n2. Read the code it points to.\n"
        "3. Fix the line at fault with edit_file.\n4. Rerun the test."
    )
    msgs = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"`{test}` started failing after a recent change. Find the bug and fix it."},
        {"role": "assistant", "content": f"{plan}\n\n{_call('run_tests', selector=test)}"},
        _tool_output("run_tests", pytest_out),
        {
            "role": "assistant",
            "content": f"The traceback points at `{fn.path}` line {file_row}, in `{fn.name}`. "
            f"Reading the function.\n"
            f"{_call('read_file', path=fn.path, start_line=lo, end_line=hi)}",
        },
        _tool_output("read_file", _numbered(fn.path, lo, hi, buggy_file)),
    ]
    op_bad, op_good = FLIPS[site.string], site.string
    ref = (
        f"The failure comes from line {file_row} of `{fn.path}`:\n\n    {file_row} | {bad_line}\n\n"
        f"`{op_bad}` there should be `{op_good}`. Fixing it:\n"
        f"{_call('edit_file', path=fn.path, old=bad_line.strip(), new=good_line.strip())}\n"
        f"Then I will rerun the test:\n{_call('run_tests', selector=test)}"
    )
    return msgs, ref


def _trace_summary(fns: list[SourceFunction], rng: random.Random, system: str) -> tuple[list[dict], str]:
    """Several calls; the user asks to restate the plan and list the calls with their key results."""
    names = ", ".join(f"`{f.name}`" for f in fns)
    plan_steps = [
        f"Grep for the definitions of {names}.",
        *[f"Read `{f.name}` in `{f.path}`." for f in fns],
        "Compare how they handle their arguments.",
        "Report the differences to the user.",
    ]
    plan = "Plan:\n" + "\n".join(f"{i}. {s}" for i, s in enumerate(plan_steps, start=1))
    pattern = "def (" + "|".join(re.escape(f.name) for f in fns) + r")\b"
    hits = _grep(pattern)
    msgs = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Compare {names}: how does each handle its arguments?"},
        {"role": "assistant", "content": f"{plan}\n\n{_call('grep', pattern=pattern, path='tqdm')}"},
        _tool_output("grep", _grep_text(hits)),
    ]
    calls = [(_call("grep", pattern=pattern, path="tqdm"), f"{len(hits)} matching lines")]
    for f in fns:
        lo, hi = f.start, min(f.end, f.start + rng.choice([14, 18, 24]))
        call = _call("read_file", path=f.path, start_line=lo, end_line=hi)
        msgs += [
            {"role": "assistant", "content": f"Reading `{f.name}`.\n{call}"},
            _tool_output("read_file", _numbered(f.path, lo, hi)),
        ]
        calls.append((call, f"the first line is `{dict(_source_files())[f.path].split(chr(10))[lo - 1].strip()}`"))
    msgs.append(
        {
            "role": "user",
            "content": rng.choice(
                [
                    "Before you go on: restate your plan, then list every tool call you made so far (the JSON) with its key "
                    "result.",
                    "Pause here. Repeat your plan and list the tool calls made so far, each with what it returned.",
                ]
            ),
        }
    )
    done = len(fns) + 1
    ref = plan.replace("Plan:", "My plan:") + "\n\nTool calls so far:\n"
    ref += "\n".join(f"{i}. {c}\n   -> {res}" for i, (c, res) in enumerate(calls, start=1))
    ref += f"\n\nSteps 1-{done} are done; next is step {done + 1}: {plan_steps[done]}"
    return msgs, ref


def _trace_listing(folder: str, rng: random.Random, system: str, by: str) -> tuple[list[dict], str] | None:
    """List a folder; the answer quotes the listing's lines of the files over a size (``by`` "bytes"
    or "lines"), then reads the largest."""
    listing = _listing(folder)
    rows = [r for r in listing.split("\n")[1:] if "(folder)" not in r]
    col = 1 if by == "bytes" else 2
    values = sorted({int(r.split()[col]) for r in rows})
    if len(values) < 4:
        return None
    round_to = 100 if by == "bytes" else 10
    threshold = rng.choice(values[len(values) // 3 : -1]) // round_to * round_to
    big = [r for r in rows if int(r.split()[col]) > threshold]
    if not big:
        return None
    largest = max(big, key=lambda r: (int(r.split()[col]), r))
    name = largest.split()[0]
    what = f"larger than {threshold} bytes" if by == "bytes" else f"longer than {threshold} lines"
    msgs = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": rng.choice(
                [
                    f"Which files directly in `{folder}` are {what}? Then open the largest one.",
                    f"List the files in `{folder}` that are {what}, and show me the beginning of the biggest.",
                ]
            ),
        },
        {
            "role": "assistant",
            "content": f"Plan: list `{folder}`, pick the files {what}, then read the start "
            f"of the largest.\n{_call('list_dir', path=folder)}",
        },
        _tool_output("list_dir", listing),
    ]
    ref = (
        f"These files in `{folder}` are {what} ({len(big)} of {len(rows)}):\n\n"
        + "\n".join(big)
        + f"\n\nThe largest is `{name}`. Opening it.\n"
        + _call("read_file", path=f"{folder}/{name}", start_line=1, end_line=60)
    )
    return msgs, ref


def _trace_grep(word: str, rng: random.Random, system: str) -> tuple[list[dict], str]:
    """Grep for an identifier; the answer lists the hits grouped by file."""
    pattern = rf"\b{word}\b"
    hits = _grep(pattern)
    msgs = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": rng.choice(
                [
                    f"Find every use of `{word}` in the package, grouped by file.",
                    f"Where is `{word}` used? List each line, file by file.",
                ]
            ),
        },
        {
            "role": "assistant",
            "content": f"Plan: grep the package for `{word}` as a whole word, then group the "
            f"hits by file.\n{_call('grep', pattern=pattern, path='tqdm')}",
        },
        _tool_output("grep", _grep_text(hits)),
    ]
    files = list(dict.fromkeys(p for p, _, _ in hits))
    ref = f"`{word}` occurs on {len(hits)} lines in {len(files)} file{'s' if len(files) != 1 else ''}:\n"
    for p in files:
        mine = [f"{q}:{n}:{line}" for q, n, line in hits if q == p]
        ref += f"\n**{p}** ({len(mine)} line{'s' if len(mine) != 1 else ''}):\n```\n" + "\n".join(mine) + "\n```\n"
    return msgs, ref.rstrip("\n")


def _trace_again(f1: SourceFunction, f2: SourceFunction, rng: random.Random, system: str) -> tuple[list[dict], str]:
    """Read one definition; the answer quotes its signature and repeats the calls for the second one."""
    p1, p2 = rf"def {f1.name}\b", rf"def {f2.name}\b"
    h1 = _grep(p1)
    lo, hi = f1.start, min(f1.end, f1.start + rng.choice([10, 15, 20]))
    msgs = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Show me the signatures of `{f1.name}` and `{f2.name}`, with their first lines."},
        {
            "role": "assistant",
            "content": f"Plan: for each function, grep for its definition, then read its first "
            f"lines.\n{_call('grep', pattern=p1, path='tqdm')}",
        },
        _tool_output("grep", _grep_text(h1)),
        {
            "role": "assistant",
            "content": f"Reading `{f1.name}` in `{f1.path}`.\n"
            f"{_call('read_file', path=f1.path, start_line=lo, end_line=hi)}",
        },
        _tool_output("read_file", _numbered(f1.path, lo, hi)),
    ]
    first = "\n".join(dict(_source_files())[f1.path].split("\n")[lo - 1 : hi])
    ref = (
        f"`{f1.name}` ({f1.path}, line {f1.start}) starts like this:\n\n{_code_block(first)}\n\n"
        f"Now the same for `{f2.name}`:\n{_call('grep', pattern=p2, path='tqdm')}"
    )
    return msgs, ref


def _fits(msgs: list[dict], ref: str, limit: int = MAX_PROMPT_CHARS) -> bool:
    return sum(len(m["content"]) for m in msgs) <= limit and bool(ref)


def agent_traces() -> list[PromptRecord]:
    """Agent-like traces over tqdm's sources (see the module docstring), about 200 records."""
    _, version = tqdm_source()
    systems = [s.format(version=version) for s in AGENT_SYSTEMS]
    fns = list(source_functions())
    files = [p for p, t in _source_files() if len(t.split("\n")) >= 130]
    folders = sorted({p.rsplit("/", 1)[0] for p, _ in _source_files()})
    out: list[PromptRecord] = []

    seen: set[str] = set()

    def add(rid: str, built: tuple[list[dict], str] | None) -> bool:
        if rid in seen or built is None or not _fits(*built):  # a pair or trio drawn twice is kept once
            return False
        seen.add(rid)
        msgs, ref = built
        assert msgs[-1]["role"] == "user"
        out.append(PromptRecord(rid, "agent-traces", msgs, ref))
        return True

    rng = random.Random(f"{SEED}:agent-traces")
    for fn in fns:  # locate: one per function
        add(f"agent-traces/locate/{fn.qualname}", _trace_locate(fn, rng, rng.choice(systems)))
    for fn in fns:  # fix: one per function with a flippable operator
        add(f"agent-traces/fix-test/{fn.qualname}", _trace_fix(fn, rng, rng.choice(systems)))
    for path in files:  # continue reading: two cuts of one trace share a group
        system = rng.choice(systems)
        state = rng.getstate()
        for reads in (1, 2):
            rng.setstate(state)  # the same step and topic for both cuts
            add(
                f"agent-traces/continue/{path}" + ("" if reads == 1 else f"#{reads}"),
                _trace_continue(path, rng, system, reads),
            )
    for folder in folders:  # four questions on one listing: one group
        for k, by in enumerate(("bytes", "lines", "bytes", "lines"), start=1):
            add(
                f"agent-traces/listing/{folder}" + ("" if k == 1 else f"#{k}"),
                _trace_listing(folder, rng, rng.choice(systems), by),
            )
    # identifiers used on 4-16 lines of the package, for grep
    counts: dict[str, int] = {}
    for _, text in _source_files():
        for line in text.split("\n"):
            for w in sorted(set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{5,}\b", line))):
                counts[w] = counts.get(w, 0) + 1
    words = sorted(w for w, c in counts.items() if 4 <= c <= 16)
    for word in rng.sample(words, min(30, len(words))):
        add(f"agent-traces/grep/{word}", _trace_grep(word, rng, rng.choice(systems)))
    n = 0
    for _ in range(200):
        if n >= 30:
            break
        group = sorted(rng.sample(fns, rng.choice([2, 3])), key=lambda f: f.qualname)
        n += add(
            "agent-traces/summary/" + "+".join(f.qualname for f in group),
            _trace_summary(group, rng, rng.choice(systems)),
        )
    n = 0
    for _ in range(200):
        if n >= 25:
            break
        f1, f2 = rng.sample(fns, 2)
        if f1.name == f2.name:
            continue
        n += add(f"agent-traces/again/{f1.qualname}+{f2.qualname}", _trace_again(f1, f2, rng, rng.choice(systems)))
    ids = [r.id for r in out]
    assert len(ids) == len(set(ids)), "duplicate agent-traces ids"
    return out
