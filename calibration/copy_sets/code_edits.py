"""The ``code-edits`` set, one of the copy-heavy prompt sets.

``code_edits()``: edits of real functions of the ``tqdm`` package, read from
its pure-Python sources as installed (``importlib.metadata.version("tqdm")``;
4.70.1 when this was written; see ``tqdm_source()``). Functions and methods
of 20-120 lines are cut out with ``ast.get_source_segment``; each gets
several edits made by exact program transformations (checked against the
expected syntax tree before a record is kept), the reference being the whole
edited function in a ```python block:

- ``rename-var``: a local variable or parameter renamed at every ``Name`` and
  ``arg`` node (positions from ``ast``, so no substring replacement);
- ``remove-comments``: every ``#`` comment removed (``tokenize``);
- ``add-log``: a given statement inserted as the first statement of the
  body, after the docstring;
- ``rename-function``: the ``def`` renamed (and recursive calls);
- ``wrap-try``: the body after the docstring wrapped in try/except that logs
  and re-raises;
- ``change-constant``: one numeric literal on a named line changed;
- ``fix-bug`` (semantic): one operator on one line was flipped (``<`` to
  ``<=``, ``+`` to ``-``, ...) in the prompt; the reference is the original.

The ``file-<kind>`` variants (one per function) put the whole file, or an
excerpt around the function (about 200-270 lines, at most 8,500
characters), in the prompt and ask for that one function, edited, keeping
its indentation in the file. Ids:
``code-edits/<module>.<qualname>#<kind>``.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass

from sssd.calibration.copy_sets.constants import MAX_PROMPT_CHARS, SEED
from sssd.calibration.copy_sets.tqdm_code import SourceFunction, _source_files, reindent, source_functions, tqdm_source
from sssd.calibration.copy_sets.transforms import (
    EditError,
    _function_node,
    _names,
    change_constant,
    flip_operator,
    insert_statement,
    new_number,
    numeric_sites,
    operator_sites,
    remove_comments,
    rename_identifier,
    wrap_try,
)
from sssd.calibration.datasets import PromptRecord

EDIT_KINDS = ("rename-var", "remove-comments", "add-log", "rename-function", "wrap-try", "change-constant", "fix-bug")
FILE_KINDS = ("rename-var", "remove-comments", "add-log", "change-constant", "fix-bug")


#: Readable new names for common identifiers (else a pattern picked by the RNG).
RENAMES = {
    "n": "count",
    "i": "idx",
    "x": "value",
    "fp": "stream",
    "total": "total_count",
    "desc": "description",
    "kwargs": "options",
    "args": "positional",
    "s": "text",
    "t": "elapsed",
    "res": "result",
    "msg": "message",
    "pos": "position",
    "bar": "progress_bar",
    "fn": "func",
    "f": "func",
    "e": "exc",
    "k": "key",
    "v": "val",
    "d": "data",
    "ncols": "num_columns",
    "nrows": "num_rows",
    "unit": "unit_name",
    "file": "out_file",
    "chunksize": "chunk_size",
    "max_workers": "num_workers",
    "dt": "delta_t",
    "dn": "delta_n",
    "cur_t": "now",
    "last_print_t": "last_shown_t",
    "mininterval": "min_interval",
    "miniters": "min_iters",
    "instance": "inst",
    "iterable": "items",
}


def _new_name(old: str, taken: set[str], rng: random.Random) -> str:
    options = [RENAMES[old]] if old in RENAMES else []
    base = old.lstrip("_")
    options += [f"{base}_value", f"new_{base}", f"{base}_obj", f"local_{base}"]
    for cand in options if old in RENAMES else rng.sample(options, len(options)):
        if cand not in taken and cand.isidentifier():
            return cand
    raise EditError("no free name")


def _rename_candidates(src: str) -> list[tuple[str, int]]:
    """(name, occurrences) of locals and parameters that can be renamed, most frequent first."""
    fn = _function_node(src)
    bound = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
    bound |= {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            bound.add(n.id)
    counts: dict[str, int] = {}
    for n in ast.walk(fn):
        name = n.id if isinstance(n, ast.Name) else n.arg if isinstance(n, ast.arg) else None
        if name in bound:
            counts[name] = counts.get(name, 0) + 1
    out = [(k, c) for k, c in counts.items() if c >= 3 and k not in ("self", "cls") and not k.startswith("__")]
    return sorted(out, key=lambda kc: (-kc[1], kc[0]))


@dataclass(frozen=True)
class Edit:
    """One edit of a function: the instruction, the function as shown, and the exact answer."""

    kind: str
    instruction: str
    shown: str  # the function as it appears in the prompt (fix-bug: with the bug)
    answer: str  # the edited function (fix-bug: the original)
    line: int | None = None  # fix-bug / change-constant: the 1-based line in the function


def make_edit(fn: SourceFunction, kind: str, rng: random.Random) -> Edit:
    """One edit of ``fn``. Raises EditError where ``kind`` does not apply."""
    src = fn.source
    what = f"method `{fn.name}`" if fn.cls else f"function `{fn.name}`"
    lines = src.split("\n")
    if kind == "rename-var":
        cands = _rename_candidates(src)
        if not cands:
            raise EditError("nothing to rename")
        taken = _names(src)
        for old, _ in rng.sample(cands[:4], min(4, len(cands))):
            try:
                new = _new_name(old, taken, rng)
                out = rename_identifier(src, old, new)
            except EditError:
                continue
            is_param = old in {a.arg for a in ast.walk(_function_node(src)) if isinstance(a, ast.arg)}
            noun = "parameter" if is_param else "local variable"
            instr = rng.choice(
                [
                    f"Rename the {noun} `{old}` to `{new}` everywhere in the {what}. Do not change anything else.",
                    f"In the {what}, rename `{old}` to `{new}` (it is a {noun}). Keep all other code as is.",
                    f"Please rename the {noun} `{old}` of the {what} to `{new}`, at every use.",
                ]
            )
            return Edit(kind, instr, src, out)
        raise EditError("no exact rename")
    if kind == "remove-comments":
        out = remove_comments(src)
        return Edit(
            kind,
            rng.choice(
                [
                    f"Remove all comments from the {what}. Leave the code and the docstring unchanged.",
                    f"Strip every `#` comment out of the {what}; keep everything else exactly as it is.",
                    f"Clean up the {what} by deleting all of its comments (docstrings stay).",
                ]
            ),
            src,
            out,
        )
    if kind == "add-log":
        stmt = rng.choice(
            [
                f'print("entering {fn.name}")',
                f'logger.debug("{fn.qualname} called")',
                f'logger.info("start %s", "{fn.name}")',
            ]
        )
        out = insert_statement(src, stmt)
        return Edit(
            kind,
            rng.choice(
                [
                    f"Add the line `{stmt}` as the first statement of the {what}'s body (after its docstring, if any).",
                    f"Insert `{stmt}` at the top of the body of the {what}, right after the docstring if there is one.",
                ]
            ),
            src,
            out,
        )
    if kind == "rename-function":
        if fn.name.startswith("__") or any(
            isinstance(n, ast.Attribute) and n.attr == fn.name for n in ast.walk(_function_node(src))
        ):
            raise EditError("dunder or called as an attribute")
        base = fn.name.lstrip("_")
        prefix = fn.name[: len(fn.name) - len(base)]
        options = [f"{prefix}{base}_impl", f"{prefix}{base}_v2", f"{prefix}do_{base}", f"{prefix}new_{base}"]
        new = rng.choice([o for o in options if o not in _names(src)])
        out = rename_identifier(src, fn.name, new, include_def=True)
        return Edit(
            kind,
            rng.choice(
                [
                    f"Rename the {what} to `{new}` (recursive calls too, if any). Change nothing else.",
                    f"Change the name of the {what} to `{new}`.",
                ]
            ),
            src,
            out,
        )
    if kind == "wrap-try":
        out = wrap_try(src, fn.name)
        return Edit(
            kind,
            rng.choice(
                [
                    f"Wrap the body of the {what} (everything after the docstring) in a `try:` block, followed by "
                    f'`except Exception as err:` that calls `logger.error("{fn.name} failed: %s", err)` and re-raises.',
                    f"Make the {what} log failures: put its body after the docstring inside `try:` and add "
                    f'`except Exception as err:` with `logger.error("{fn.name} failed: %s", err)` then `raise`.',
                ]
            ),
            src,
            out,
        )
    if kind == "change-constant":
        sites = numeric_sites(src)
        if not sites:
            raise EditError("no numeric constant")
        node = rng.choice(sites)
        old = ast.get_source_segment(src, node)
        new = new_number(node.value)
        out = change_constant(src, node, new)
        n = node.lineno
        return Edit(
            kind,
            rng.choice(
                [
                    f"On line {n} of the {what} (`{lines[n - 1].strip()}`), change the constant `{old}` to `{new}`.",
                    f"Change `{old}` to `{new}` in this line of the {what}: `{lines[n - 1].strip()}`.",
                ]
            ),
            src,
            out,
            n,
        )
    if kind == "fix-bug":
        sites = operator_sites(src)
        rng.shuffle(sites)
        for site in sites:
            try:
                buggy = flip_operator(src, site)
            except EditError:
                continue
            n = site.start[0]
            bad = buggy.split("\n")[n - 1].strip()
            return Edit(
                kind,
                rng.choice(
                    [
                        f"There is a bug on line {n} of the {what}: `{bad}`. Fix it and reply with the whole corrected "
                        f"{'method' if fn.cls else 'function'}.",
                        f"The {what} misbehaves because of line {n} (`{bad}`): one operator there is wrong. Fix the bug.",
                        f"Fix the bug in the {what}. Hint: it is on line {n}, `{bad}`.",
                    ]
                ),
                buggy,
                src,
                n,
            )
        raise EditError("no operator to flip")
    raise ValueError(f"unknown edit kind {kind!r}")


def _code_block(code: str) -> str:
    return f"```python\n{code}\n```"


def _file_excerpt(path: str, text: str, fn: SourceFunction, body: str) -> tuple[str, int, int]:
    """(excerpt, first line, last line) of the file ``text`` around ``fn`` (whose lines are
    replaced by ``body``): the whole file if it fits MAX_PROMPT_CHARS, else lines added on both sides
    of the function until the excerpt would pass it, starting after a blank line."""
    lines = text.rstrip("\n").split("\n")
    lines = lines[: fn.start - 1] + body.split("\n") + lines[fn.end :]
    end_fn = fn.start - 1 + len(body.split("\n"))
    budget = MAX_PROMPT_CHARS - 1500
    if len(text) <= budget:
        return "\n".join(lines), 1, len(lines)
    a, b = fn.start - 1, end_fn  # [a, b)
    size = sum(len(x) + 1 for x in lines[a:b])
    grew = True
    while grew:
        grew = False
        for side in ("up", "down"):
            if side == "up" and a > 0 and size + len(lines[a - 1]) + 1 <= budget:
                a -= 1
                size += len(lines[a]) + 1
                grew = True
            elif side == "down" and b < len(lines) and size + len(lines[b]) + 1 <= budget:
                size += len(lines[b]) + 1
                b += 1
                grew = True
    while a < fn.start - 1 and lines[a].strip():  # start at a statement boundary
        a += 1
    while b > end_fn and lines[b - 1].strip():
        b -= 1
    return "\n".join(lines[a:b]), a + 1, b


def code_edits() -> list[PromptRecord]:
    """Edits of tqdm's functions (see the module docstring): every kind that applies to each
    function, and one whole-file (or excerpt) variant per function."""
    _, version = tqdm_source()
    files = dict(_source_files())
    out: list[PromptRecord] = []
    for fn in source_functions():
        rng = random.Random(f"{SEED}:code-edits:{fn.qualname}")
        base = f"code-edits/{fn.qualname}"
        for kind in EDIT_KINDS:
            try:
                e = make_edit(fn, kind, rng)
            except EditError:
                continue
            user = f"{e.instruction}\n\n{_code_block(e.shown)}"
            out.append(
                PromptRecord(f"{base}#{kind}", "code-edits", [{"role": "user", "content": user}], _code_block(e.answer))
            )
        kinds = list(FILE_KINDS)
        rng.shuffle(kinds)
        for kind in kinds:
            try:
                e = make_edit(fn, kind, rng)
            except EditError:
                continue
            excerpt, a, b = _file_excerpt(fn.path, files[fn.path], fn, reindent(e.shown, fn.indent))
            whole = a == 1 and b >= len(files[fn.path].rstrip("\n").split("\n"))
            where = (
                f"Below is the file `{fn.path}` from tqdm {version}."
                if whole
                else f"Below are lines {a}-{b} of `{fn.path}` from tqdm {version}."
            )
            owner = f" of class `{fn.cls}`" if fn.cls else ""
            instr = e.instruction
            if e.line is not None:  # line numbers count from the def: say so for the file
                instr += (
                    f" (Line {e.line} counts from the `{fn.name}` definition's first line, {fn.start} in the file.)"
                )
            user = (
                f"{where} {instr}\n\nReply with only the edited "
                f"`{fn.name}`{owner}, keeping its indentation in the file, in a ```python block.\n\n"
                f"{_code_block(excerpt)}"
            )
            out.append(
                PromptRecord(
                    f"{base}#file-{kind}",
                    "code-edits",
                    [{"role": "user", "content": user}],
                    _code_block(reindent(e.answer, fn.indent)),
                )
            )
            break
    return out
