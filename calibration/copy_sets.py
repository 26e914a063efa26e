"""Copy-heavy prompt sets: answers that copy text the prompt already holds.

Built here, deterministically and without the network, from sources installed
in this environment (issue 28, item 5). Each function returns PromptRecords
(messages ending with a user turn; ``reference`` is the expected answer):

* ``code_edits()``: edits of real functions of the ``tqdm`` package, read from
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
* ``agent_traces()``: agent-like traces: a system prompt describing JSON tool
  calls, a task, assistant turns (plans, tool calls) and tool outputs as user
  turns ("Tool output (<tool>):" with directory listings, grep hits and
  numbered file contents of the same tqdm sources, and pytest output made up
  here). The reference restates the plan, quotes tool outputs, or repeats an
  earlier tool call with a small change. Seven templates, each instance drawn
  by a seeded RNG. Ids: ``agent-traces/<template>/<subject>`` (``#<n>``: a
  later cut of the same trace, or another question on the same listing).
* ``quoting()``: RAG-style: several numbered passages (docstrings of standard
  library modules, functions and classes of this Python, ``inspect.cleandoc``
  of their own ``__doc__``), a question, and a reference that quotes one or
  two passages or one sentence verbatim with a short framing sentence
  ("According to passage 3: ..."). Ids: ``quoting/<target title>#<kind>``.
  The standard library's docstrings are those of the running interpreter
  (Python 3.11 here): another Python version gives other text.

Every record of one source function (code-edits), trace instance
(agent-traces) or target passage (quoting) shares the id part before "#", so
``datasets.split_of`` puts them on one side of the dev/eval split.

Prompts stay under about 10,000 characters (~3k tokens), except every 8th
quoting record, which holds more passages (up to 20,000 characters).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import io
import json
import random
import re
import tokenize
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sssd.calibration.datasets import PromptRecord

#: The prompt sets of this module by name (datasets.DATASETS lists them too).
COPY_SETS = ("code-edits", "agent-traces", "quoting")

#: The package whose sources the code sets edit and read.
SOURCE_PACKAGE = "tqdm"

SEED = "issue28-item5"  # seeds every random.Random here (string seeds hash the same in every process)
MIN_LINES, MAX_LINES = 20, 120
MAX_PROMPT_CHARS = 10_000
MAX_LONG_PROMPT_CHARS = 20_000

EDIT_KINDS = ("rename-var", "remove-comments", "add-log", "rename-function", "wrap-try", "change-constant",
              "fix-bug")
FILE_KINDS = ("rename-var", "remove-comments", "add-log", "change-constant", "fix-bug")


class EditError(ValueError):
    """An edit that does not apply to a function (no candidate, or the result would not be exact)."""


# -- the tqdm sources -----------------------------------------------------------

def tqdm_source() -> tuple[Path, str]:
    """(the installed tqdm package folder, its version). Raises FileNotFoundError if not installed."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.origin:
        raise FileNotFoundError(f"the Python package {SOURCE_PACKAGE!r} is not installed")
    return Path(spec.origin).parent, importlib.metadata.version(SOURCE_PACKAGE)


@dataclass(frozen=True)
class SourceFunction:
    """A function or method of a source file.

    Attributes:
        qualname: module and qualified name, e.g. "tqdm.std.tqdm.update".
        path: the file, relative to site-packages ("tqdm/std.py").
        name: the function's own name; cls: its class, or None.
        source: the function (decorators included), dedented, without a final newline.
        indent: the indentation of its ``def`` in the file.
        start, end: its first and last line in the file (1-based, inclusive).
    """

    qualname: str
    path: str
    name: str
    cls: str | None
    source: str
    indent: str
    start: int
    end: int


@lru_cache(maxsize=1)
def _source_files() -> tuple[tuple[str, str], ...]:
    """((relative path, text)) of every .py file of the package, sorted by path."""
    root, _ = tqdm_source()
    out = []
    for p in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if "__pycache__" in p.parts:
            continue
        out.append((f"{SOURCE_PACKAGE}/{p.relative_to(root).as_posix()}", p.read_text(encoding="utf-8")))
    return tuple(out)


def _module_name(path: str) -> str:
    mod = path[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def dedent_exact(text: str, indent: str) -> str | None:
    """``text`` with ``indent`` cut off every non-blank line, or None if a non-blank line lacks it
    or a line is whitespace only (then reindent would not give ``text`` back)."""
    out = []
    for line in text.split("\n"):
        if not line:
            out.append(line)
        elif line.strip() and line.startswith(indent):
            out.append(line[len(indent):])
        else:
            return None
    return "\n".join(out)


def reindent(text: str, indent: str) -> str:
    """The inverse of dedent_exact: ``indent`` before every non-empty line."""
    return "\n".join(indent + line if line else line for line in text.split("\n"))


@lru_cache(maxsize=1)
def source_functions() -> tuple[SourceFunction, ...]:
    """The package's functions and methods of MIN_LINES-MAX_LINES lines (decorators included)
    that stand alone once dedented, sorted by qualname."""
    found = []
    for path, text in _source_files():
        tree = ast.parse(text)
        lines = text.split("\n")
        mod = _module_name(path)

        def walk(node: ast.AST, prefix: str, cls: str | None) -> None:
            for ch in ast.iter_child_nodes(node):
                if isinstance(ch, ast.ClassDef):
                    walk(ch, f"{prefix}{ch.name}.", ch.name)
                elif isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    start = min([ch.lineno] + [d.lineno for d in ch.decorator_list])
                    if not MIN_LINES <= ch.end_lineno - start + 1 <= MAX_LINES:
                        continue
                    segment = ast.get_source_segment(text, ch, padded=True)
                    head = "\n".join(lines[start - 1:ch.lineno - 1])  # the decorators
                    full = f"{head}\n{segment}" if head else segment
                    if full != "\n".join(lines[start - 1:ch.end_lineno]):
                        continue
                    indent = lines[ch.lineno - 1][: ch.col_offset]
                    src = dedent_exact(full, indent)
                    if src is None:
                        continue
                    try:
                        ast.parse(src)
                    except SyntaxError:
                        continue
                    found.append(SourceFunction(f"{mod}.{prefix}{ch.name}", path, ch.name, cls, src, indent,
                                                start, ch.end_lineno))

        walk(tree, "", None)
    found.sort(key=lambda f: f.qualname)
    return tuple(found)


# -- exact program transformations -----------------------------------------------

def _function_node(src: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    node = ast.parse(src).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise EditError("not a function")
    return node


def _line_starts(src: str) -> list[int]:
    starts, pos = [], 0
    for line in src.split("\n"):
        starts.append(pos)
        pos += len(line) + 1
    return starts


def _offset(src: str, starts: list[int], lineno: int, col_bytes: int) -> int:
    """Character offset of an ast position (col_offset counts UTF-8 bytes)."""
    line = src.split("\n")[lineno - 1]
    return starts[lineno - 1] + len(line.encode("utf-8")[:col_bytes].decode("utf-8"))


def _apply(src: str, edits: list[tuple[int, int, str]]) -> str:
    for a, b, new in sorted(edits, reverse=True):
        src = src[:a] + new + src[b:]
    return src


def _tokens(src: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(src + "\n").readline))


def _names(src: str) -> set[str]:
    return {t.string for t in _tokens(src) if t.type == tokenize.NAME}


def _docstring_end(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int | None:
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno
    return None


def _code_body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    return fn.body[1:] if _docstring_end(fn) is not None else list(fn.body)


class _Renamer(ast.NodeTransformer):
    """Renames Name and arg nodes (what rename_identifier does, on the tree)."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id == self.old:
            node.id = self.new
        return node

    def visit_arg(self, node: ast.arg) -> ast.arg:
        self.generic_visit(node)
        if node.arg == self.old:
            node.arg = self.new
        return node


def expected_rename(src: str, old: str, new: str) -> str:
    """ast.dump of ``src`` with ``old`` renamed to ``new`` at Name and arg nodes."""
    return ast.dump(_Renamer(old, new).visit(ast.parse(src)))


def _rename_blockers(fn: ast.AST, name: str) -> bool:
    """Whether ``name`` is bound somewhere a Name/arg rename would not reach."""
    for n in ast.walk(fn):
        if isinstance(n, (ast.Global, ast.Nonlocal)) and name in n.names:
            return True
        if isinstance(n, ast.ExceptHandler) and n.name == name:
            return True
        if isinstance(n, ast.alias) and (n.asname or n.name.split(".")[0]) == name:
            return True
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fn and n.name == name:
            return True
        if isinstance(n, ast.Name) and n.id in ("locals", "vars", "eval", "exec"):
            return True
    return False


def rename_identifier(src: str, old: str, new: str, *, include_def: bool = False) -> str:
    """``src`` with every Name and arg node called ``old`` renamed to ``new`` (and the function's
    own name if ``include_def``); attributes, keywords, strings and comments are left alone.

    Raises:
        EditError: ``old`` is bound where this would miss it, ``new`` is taken, or the result
            is not exactly the renamed tree.
    """
    if new in _names(src) or not new.isidentifier():
        raise EditError(f"{new!r} is already used")
    fn = _function_node(src)
    if _rename_blockers(fn, old):
        raise EditError(f"{old!r} is bound by global/except/import/def")
    starts = _line_starts(src)
    edits = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and n.id == old or isinstance(n, ast.arg) and n.arg == old:
            a = _offset(src, starts, n.lineno, n.col_offset)
            if src[a:a + len(old)] != old:
                raise EditError("position mismatch")
            edits.append((a, a + len(old), new))
    if include_def:
        toks = _tokens(src)
        for t0, t1 in zip(toks, toks[1:]):
            if t0.type == tokenize.NAME and t0.string == "def" and t0.start[0] == fn.lineno and t1.string == old:
                a = starts[t1.start[0] - 1] + t1.start[1]
                edits.append((a, a + len(old), new))
                break
        else:
            raise EditError("def name not found")
    if not edits:
        raise EditError(f"{old!r} does not occur")
    out = _apply(src, edits)
    tree = _Renamer(old, new).visit(ast.parse(src))
    if include_def:
        tree.body[0].name = new
    if ast.dump(ast.parse(out)) != ast.dump(tree):
        raise EditError("rename is not exact")
    return out


def remove_comments(src: str) -> str:
    """``src`` without its ``#`` comments: comment-only lines dropped, trailing comments cut with the
    whitespace before them. Raises EditError if there is no comment."""
    lines = src.split("\n")
    drop: set[int] = set()
    for t in _tokens(src):
        if t.type != tokenize.COMMENT:
            continue
        row, col = t.start
        line = lines[row - 1]
        if not line[:col].strip():
            drop.add(row - 1)
        else:
            lines[row - 1] = line[:col].rstrip()
    if not drop and lines == src.split("\n"):
        raise EditError("no comments")
    out = "\n".join(line for i, line in enumerate(lines) if i not in drop)
    if ast.dump(ast.parse(out)) != ast.dump(ast.parse(src)):
        raise EditError("removing comments changed the code")
    return out


def _first_line(stmt: ast.stmt) -> int:
    """A statement's first line, its decorators included."""
    return min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])


def _body_indent(src: str, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    line = src.split("\n")[fn.body[0].lineno - 1]
    return line[: len(line) - len(line.lstrip())]


def insert_statement(src: str, statement: str) -> str:
    """``src`` with ``statement`` (one line) as the first statement of the body, after the docstring."""
    fn = _function_node(src)
    if fn.body[0].lineno == fn.lineno:
        raise EditError("one-line body")
    indent = _body_indent(src, fn)
    doc_end = _docstring_end(fn)
    code = _code_body(fn)
    if not code:
        raise EditError("no code after the docstring")
    if doc_end is not None:
        at = doc_end  # 0-based index of the line after the docstring
        if code[0].lineno == doc_end:
            raise EditError("code on the docstring's line")
    else:
        at = _first_line(code[0]) - 1
    lines = src.split("\n")
    out = "\n".join(lines[:at] + [indent + statement] + lines[at:])
    new_fn = _function_node(out)
    new_code = _code_body(new_fn)
    if (ast.dump(new_code[0]) != ast.dump(ast.parse(statement).body[0])
            or [ast.dump(s) for s in new_code[1:]] != [ast.dump(s) for s in code]):
        raise EditError("insertion is not exact")
    return out


def _string_interior_rows(src: str) -> set[int]:
    """1-based rows that lie inside a multi-line string token (after its first row)."""
    rows: set[int] = set()
    for t in _tokens(src):
        if t.type == tokenize.STRING and t.end[0] > t.start[0]:
            rows.update(range(t.start[0] + 1, t.end[0] + 1))
    return rows


def wrap_try(src: str, name: str) -> str:
    """``src`` with its body after the docstring inside ``try:`` and an ``except Exception as err:``
    that logs ``logger.error("<name> failed: %s", err)`` and re-raises."""
    fn = _function_node(src)
    if fn.body[0].lineno == fn.lineno:
        raise EditError("one-line body")
    if "err" in _names(src):
        raise EditError("'err' is used")
    code = _code_body(fn)
    if not code:
        raise EditError("no code after the docstring")
    indent = _body_indent(src, fn)
    doc_end = _docstring_end(fn)
    if doc_end is not None and code[0].lineno == doc_end:
        raise EditError("code on the docstring's line")
    at = doc_end if doc_end is not None else _first_line(code[0]) - 1
    lines = src.split("\n")
    interior = _string_interior_rows(src)
    body = [line if not line or (i + 1) in interior else "    " + line for i, line in enumerate(lines) if i >= at]
    out = "\n".join(lines[:at] + [indent + "try:"] + body + [
        indent + "except Exception as err:",
        indent + f'    logger.error("{name} failed: %s", err)',
        indent + "    raise"])
    new_code = _code_body(_function_node(out))
    if len(new_code) != 1 or not isinstance(new_code[0], ast.Try) or \
            [ast.dump(s) for s in new_code[0].body] != [ast.dump(s) for s in code]:
        raise EditError("wrapping is not exact")
    return out


#: Operator flips that make a bug (and back).
FLIPS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "+": "-", "-": "+",
         "+=": "-=", "-=": "+="}


def operator_sites(src: str) -> list[tokenize.TokenInfo]:
    """OP tokens of the function's body (after its header) that FLIPS can change."""
    fn = _function_node(src)
    first_body = fn.body[0].lineno
    return [t for t in _tokens(src) if t.type == tokenize.OP and t.string in FLIPS and t.start[0] >= first_body]


def flip_operator(src: str, site: tokenize.TokenInfo) -> str:
    """``src`` with the operator token ``site`` flipped (FLIPS); EditError if that does not parse
    or does not change the tree."""
    starts = _line_starts(src)
    a = starts[site.start[0] - 1] + site.start[1]
    out = src[:a] + FLIPS[site.string] + src[a + len(site.string):]
    try:
        changed = ast.dump(ast.parse(out)) != ast.dump(ast.parse(src))
    except SyntaxError:
        changed = False
    if not changed:
        raise EditError("flip does not change the code")
    return out


def numeric_sites(src: str) -> list[ast.Constant]:
    """Numeric literals of the body (not bools, not inside f-strings, not negated), whose text occurs
    once on their line."""
    fn = _function_node(src)
    inside_f = {id(n) for j in ast.walk(fn) if isinstance(j, ast.JoinedStr) for n in ast.walk(j)}
    negated = {id(n.operand) for n in ast.walk(fn) if isinstance(n, ast.UnaryOp)}
    lines = src.split("\n")
    out = []
    for n in ast.walk(fn):
        if (isinstance(n, ast.Constant) and type(n.value) in (int, float) and id(n) not in inside_f
                and id(n) not in negated and n.lineno == n.end_lineno and n.lineno >= fn.body[0].lineno):
            text = ast.get_source_segment(src, n)
            if text and len(re.findall(rf"(?<![\w.]){re.escape(text)}(?![\w.])", lines[n.lineno - 1])) == 1:
                out.append(n)
    out.sort(key=lambda n: (n.lineno, n.col_offset))
    return out


def new_number(value: int | float) -> str:
    """The value a constant is changed to: double it (0 and 1: add one)."""
    if isinstance(value, float):
        return repr(value * 2)
    return str(value * 2 if abs(value) >= 2 else value + 1)


def change_constant(src: str, node: ast.Constant, new_text: str) -> str:
    starts = _line_starts(src)
    a = _offset(src, starts, node.lineno, node.col_offset)
    b = _offset(src, starts, node.end_lineno, node.end_col_offset)
    out = src[:a] + new_text + src[b:]
    tree = ast.parse(src)
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and (n.lineno, n.col_offset) == (node.lineno, node.col_offset):
            n.value = ast.literal_eval(new_text)
    if ast.dump(ast.parse(out)) != ast.dump(tree):
        raise EditError("constant change is not exact")
    return out


# -- code-edits -----------------------------------------------------------------

#: Readable new names for common identifiers (else a pattern picked by the RNG).
RENAMES = {"n": "count", "i": "idx", "x": "value", "fp": "stream", "total": "total_count", "desc": "description",
           "kwargs": "options", "args": "positional", "s": "text", "t": "elapsed", "res": "result",
           "msg": "message", "pos": "position", "bar": "progress_bar", "fn": "func", "f": "func",
           "e": "exc", "k": "key", "v": "val", "d": "data", "ncols": "num_columns", "nrows": "num_rows",
           "unit": "unit_name", "file": "out_file", "chunksize": "chunk_size", "max_workers": "num_workers",
           "dt": "delta_t", "dn": "delta_n", "cur_t": "now", "last_print_t": "last_shown_t",
           "mininterval": "min_interval", "miniters": "min_iters", "instance": "inst", "iterable": "items"}


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
            instr = rng.choice([
                f"Rename the {noun} `{old}` to `{new}` everywhere in the {what}. Do not change anything else.",
                f"In the {what}, rename `{old}` to `{new}` (it is a {noun}). Keep all other code as is.",
                f"Please rename the {noun} `{old}` of the {what} to `{new}`, at every use.",
            ])
            return Edit(kind, instr, src, out)
        raise EditError("no exact rename")
    if kind == "remove-comments":
        out = remove_comments(src)
        return Edit(kind, rng.choice([
            f"Remove all comments from the {what}. Leave the code and the docstring unchanged.",
            f"Strip every `#` comment out of the {what}; keep everything else exactly as it is.",
            f"Clean up the {what} by deleting all of its comments (docstrings stay).",
        ]), src, out)
    if kind == "add-log":
        stmt = rng.choice([f'print("entering {fn.name}")', f'logger.debug("{fn.qualname} called")',
                           f'logger.info("start %s", "{fn.name}")'])
        out = insert_statement(src, stmt)
        return Edit(kind, rng.choice([
            f"Add the line `{stmt}` as the first statement of the {what}'s body (after its docstring, if any).",
            f"Insert `{stmt}` at the top of the body of the {what}, right after the docstring if there is one.",
        ]), src, out)
    if kind == "rename-function":
        if fn.name.startswith("__") or any(isinstance(n, ast.Attribute) and n.attr == fn.name
                                           for n in ast.walk(_function_node(src))):
            raise EditError("dunder or called as an attribute")
        base = fn.name.lstrip("_")
        prefix = fn.name[: len(fn.name) - len(base)]
        options = [f"{prefix}{base}_impl", f"{prefix}{base}_v2", f"{prefix}do_{base}", f"{prefix}new_{base}"]
        new = rng.choice([o for o in options if o not in _names(src)])
        out = rename_identifier(src, fn.name, new, include_def=True)
        return Edit(kind, rng.choice([
            f"Rename the {what} to `{new}` (recursive calls too, if any). Change nothing else.",
            f"Change the name of the {what} to `{new}`.",
        ]), src, out)
    if kind == "wrap-try":
        out = wrap_try(src, fn.name)
        return Edit(kind, rng.choice([
            f"Wrap the body of the {what} (everything after the docstring) in a `try:` block, followed by "
            f"`except Exception as err:` that calls `logger.error(\"{fn.name} failed: %s\", err)` and re-raises.",
            f"Make the {what} log failures: put its body after the docstring inside `try:` and add "
            f"`except Exception as err:` with `logger.error(\"{fn.name} failed: %s\", err)` then `raise`.",
        ]), src, out)
    if kind == "change-constant":
        sites = numeric_sites(src)
        if not sites:
            raise EditError("no numeric constant")
        node = rng.choice(sites)
        old = ast.get_source_segment(src, node)
        new = new_number(node.value)
        out = change_constant(src, node, new)
        n = node.lineno
        return Edit(kind, rng.choice([
            f"On line {n} of the {what} (`{lines[n - 1].strip()}`), change the constant `{old}` to `{new}`.",
            f"Change `{old}` to `{new}` in this line of the {what}: `{lines[n - 1].strip()}`.",
        ]), src, out, n)
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
            return Edit(kind, rng.choice([
                f"There is a bug on line {n} of the {what}: `{bad}`. Fix it and reply with the whole corrected "
                f"{'method' if fn.cls else 'function'}.",
                f"The {what} misbehaves because of line {n} (`{bad}`): one operator there is wrong. Fix the bug.",
                f"Fix the bug in the {what}. Hint: it is on line {n}, `{bad}`.",
            ]), buggy, src, n)
        raise EditError("no operator to flip")
    raise ValueError(f"unknown edit kind {kind!r}")


def _code_block(code: str) -> str:
    return f"```python\n{code}\n```"


def _file_excerpt(path: str, text: str, fn: SourceFunction, body: str) -> tuple[str, int, int]:
    """(excerpt, first line, last line) of the file ``text`` around ``fn`` (whose lines are
    replaced by ``body``): the whole file if it fits MAX_PROMPT_CHARS, else lines added on both sides
    of the function until the excerpt would pass it, starting after a blank line."""
    lines = text.rstrip("\n").split("\n")
    lines = lines[:fn.start - 1] + body.split("\n") + lines[fn.end:]
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
            out.append(PromptRecord(f"{base}#{kind}", "code-edits", [{"role": "user", "content": user}],
                                    _code_block(e.answer)))
        kinds = list(FILE_KINDS)
        rng.shuffle(kinds)
        for kind in kinds:
            try:
                e = make_edit(fn, kind, rng)
            except EditError:
                continue
            excerpt, a, b = _file_excerpt(fn.path, files[fn.path], fn, reindent(e.shown, fn.indent))
            whole = a == 1 and b >= len(files[fn.path].rstrip("\n").split("\n"))
            where = (f"Below is the file `{fn.path}` from tqdm {version}." if whole
                     else f"Below are lines {a}-{b} of `{fn.path}` from tqdm {version}.")
            owner = f" of class `{fn.cls}`" if fn.cls else ""
            instr = e.instruction
            if e.line is not None:  # line numbers count from the def: say so for the file
                instr += (f" (Line {e.line} counts from the `{fn.name}` definition's first line, {fn.start} in "
                          "the file.)")
            user = (f"{where} {instr}\n\nReply with only the edited "
                    f"`{fn.name}`{owner}, keeping its indentation in the file, in a ```python block.\n\n"
                    f"{_code_block(excerpt)}")
            out.append(PromptRecord(f"{base}#file-{kind}", "code-edits", [{"role": "user", "content": user}],
                                    _code_block(reindent(e.answer, fn.indent))))
            break
    return out


# -- agent-traces ---------------------------------------------------------------

AGENT_SYSTEMS = (
    "You are a coding agent working in a checkout of the tqdm repository (version {version}). Call a tool by "
    "writing one JSON object on its own line: {{\"tool\": <name>, \"arguments\": {{...}}}}. Tools:\n"
    "- list_dir(path): the files and folders in a folder, with sizes\n"
    "- grep(pattern, path): matching lines as path:line:text (Python regular expressions)\n"
    "- read_file(path, start_line, end_line): lines of a file, numbered\n"
    "- run_tests(selector): runs pytest on a test id and prints its output\n"
    "- edit_file(path, old, new): replaces the exact text old with new\n"
    "Think step by step, say what you will do before each call, and finish with a short answer for the user.",
    "You are an autonomous software engineer. The repository is tqdm {version}. You act only through tools; "
    "to use one, reply with a JSON object {{\"tool\": ..., \"arguments\": ...}}. Available tools: list_dir "
    "{{path}}, grep {{pattern, path}}, read_file {{path, start_line, end_line}}, run_tests {{selector}}, "
    "edit_file {{path, old, new}}. Tool results come back in the next user message. Be precise and quote "
    "code exactly.",
    "System: repository assistant for tqdm {version}.\nTool protocol: emit exactly one JSON object per tool "
    "call, e.g. {{\"tool\": \"read_file\", \"arguments\": {{\"path\": \"tqdm/std.py\", \"start_line\": 1, "
    "\"end_line\": 40}}}}.\nTools: list_dir, grep, read_file, run_tests, edit_file.\nWhen you have the answer, "
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
    task = rng.choice([f"Where is `{fn.name}` implemented in tqdm, and what does it look like? Show me its code.",
                       f"I need to understand `{fn.qualname.split('.', 1)[1]}`. Find its definition and quote it.",
                       f"Find the definition of `{fn.name}`{' in class `' + fn.cls + '`' if fn.cls else ''} and "
                       "show it to me verbatim."])
    plan = (f"Plan:\n1. List `{folder}` to see the modules.\n2. Grep for the `def {fn.name}` line.\n"
            f"3. Read the lines of the definition.\n4. Quote the code and summarise where it is.")
    pattern = rf"def {fn.name}\b"
    hits = _grep(pattern)
    lo, hi = max(1, fn.start - 2), fn.end + 2
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": task},
            {"role": "assistant", "content": f"{plan}\n\n{_call('list_dir', path=folder)}"},
            _tool_output("list_dir", _listing(folder)),
            {"role": "assistant", "content": f"Now I search for the definition.\n"
                                             f"{_call('grep', pattern=pattern, path='tqdm')}"},
            _tool_output("grep", _grep_text(hits)),
            {"role": "assistant", "content": f"It is in `{fn.path}` at line {fn.start}. Reading it.\n"
                                             f"{_call('read_file', path=fn.path, start_line=lo, end_line=hi)}"},
            _tool_output("read_file", _numbered(fn.path, lo, hi))]
    hit = next(f"{p}:{n}:{line}" for p, n, line in hits if p == fn.path and fn.start <= n <= fn.end)
    file_code = reindent(fn.source, fn.indent)
    ref = (f"`{fn.name}` is defined in `{fn.path}`, lines {fn.start}-{fn.end}"
           f"{' (a method of class `' + fn.cls + '`)' if fn.cls else ''}:\n\n{_code_block(file_code)}\n")
    doc = _first_paragraph(fn)
    if doc:
        ref += f"\nIts docstring begins: \"{doc}\"\n"
    ref += (f"\nWhat I did:\n1. Listed `{folder}`.\n2. Grepped for `def {fn.name}`: {len(hits)} match"
            f"{'es' if len(hits) != 1 else ''}, among them `{hit}`.\n3. Read lines {lo}-{hi} of `{fn.path}`.")
    return msgs, ref


def _trace_continue(path: str, rng: random.Random, system: str, reads: int) -> tuple[list[dict], str]:
    """Read a file in chunks; the answer is the next read_file call (the last one with new lines)."""
    text = dict(_source_files())[path]
    n_lines = len(text.splitlines())
    step = rng.choice([40, 50, 60])
    topic = rng.choice(["how it handles its arguments", "what it imports and why", "its public API",
                        "how errors are handled"])
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"Read `{path}` and tell me {topic}."},
            {"role": "assistant", "content": f"Plan: read `{path}` in chunks of {step} lines, note {topic}, then "
                                             f"answer.\n{_call('read_file', path=path, start_line=1, end_line=step)}"},
            _tool_output("read_file", _numbered(path, 1, step))]
    for k in range(1, reads):
        a, b = k * step + 1, (k + 1) * step
        msgs += [{"role": "assistant", "content": f"Continuing with the next {step} lines.\n"
                                                  f"{_call('read_file', path=path, start_line=a, end_line=b)}"},
                 _tool_output("read_file", _numbered(path, a, b))]
    a, b = reads * step + 1, (reads + 1) * step
    tail = _numbered(path, reads * step - 4, reads * step)
    ref = (f"So far I have read lines 1-{reads * step} of `{path}`, which has {n_lines} lines. The last ones I read "
           f"were:\n\n{tail}\n\nThat is not the end of the file, so I will read the next {step} lines.\n"
           f"{_call('read_file', path=path, start_line=a, end_line=b)}")
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
    buggy_file = "\n".join(lines[:fn.start - 1] + reindent(buggy, fn.indent).split("\n") + lines[fn.end:])
    bad_line = buggy_file.split("\n")[file_row - 1]
    good_line = lines[file_row - 1]
    module = fn.path.rsplit("/", 1)[-1][:-3].lstrip("_")
    test = f"tests/tests_{module}.py::test_{fn.name.strip('_')}"
    exc = rng.choice(["AssertionError: assert 0 == 1", "AssertionError: expected 10, got 9",
                      "ValueError: unexpected value", "AssertionError: output differs from expected"])
    pytest_out = (f"============================= test session starts ==============================\n"
                  f"collected 1 item\n\n{test} F{'':>30s}[100%]\n\n"
                  f"=================================== FAILURES ===================================\n"
                  f"_{'_' * 20} test_{fn.name.strip('_')} {'_' * 20}\n\n"
                  f"    def test_{fn.name.strip('_')}():\n>       check_{fn.name.strip('_')}()\n\n"
                  f"{fn.path}:{file_row}: in {fn.name}\n    {bad_line.strip()}\nE   {exc}\n"
                  f"=========================== short test summary info ============================\n"
                  f"FAILED {test} - {exc}\n"
                  f"============================== 1 failed in 0.42s ===============================")
    lo, hi = max(1, fn.start - 2), fn.end + 2
    plan = (f"Plan:\n1. Run the failing test to see the error.\n2. Read the code it points to.\n"
            f"3. Fix the line at fault with edit_file.\n4. Rerun the test.")
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"`{test}` started failing after a recent change. Find the bug and fix it."},
            {"role": "assistant", "content": f"{plan}\n\n{_call('run_tests', selector=test)}"},
            _tool_output("run_tests", pytest_out),
            {"role": "assistant", "content": f"The traceback points at `{fn.path}` line {file_row}, in `{fn.name}`. "
                                             f"Reading the function.\n"
                                             f"{_call('read_file', path=fn.path, start_line=lo, end_line=hi)}"},
            _tool_output("read_file", _numbered(fn.path, lo, hi, buggy_file))]
    op_bad, op_good = FLIPS[site.string], site.string
    ref = (f"The failure comes from line {file_row} of `{fn.path}`:\n\n    {file_row} | {bad_line}\n\n"
           f"`{op_bad}` there should be `{op_good}`. Fixing it:\n"
           f"{_call('edit_file', path=fn.path, old=bad_line.strip(), new=good_line.strip())}\n"
           f"Then I will rerun the test:\n{_call('run_tests', selector=test)}")
    return msgs, ref


def _trace_summary(fns: list[SourceFunction], rng: random.Random, system: str) -> tuple[list[dict], str]:
    """Several calls; the user asks to restate the plan and list the calls with their key results."""
    names = ", ".join(f"`{f.name}`" for f in fns)
    plan_steps = [f"Grep for the definitions of {names}.",
                  *[f"Read `{f.name}` in `{f.path}`." for f in fns],
                  "Compare how they handle their arguments.", "Report the differences to the user."]
    plan = "Plan:\n" + "\n".join(f"{i}. {s}" for i, s in enumerate(plan_steps, start=1))
    pattern = "def (" + "|".join(re.escape(f.name) for f in fns) + r")\b"
    hits = _grep(pattern)
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"Compare {names}: how does each handle its arguments?"},
            {"role": "assistant", "content": f"{plan}\n\n{_call('grep', pattern=pattern, path='tqdm')}"},
            _tool_output("grep", _grep_text(hits))]
    calls = [(_call("grep", pattern=pattern, path="tqdm"), f"{len(hits)} matching lines")]
    for f in fns:
        lo, hi = f.start, min(f.end, f.start + rng.choice([14, 18, 24]))
        call = _call("read_file", path=f.path, start_line=lo, end_line=hi)
        msgs += [{"role": "assistant", "content": f"Reading `{f.name}`.\n{call}"},
                 _tool_output("read_file", _numbered(f.path, lo, hi))]
        calls.append((call, f"the first line is `{dict(_source_files())[f.path].split(chr(10))[lo - 1].strip()}`"))
    msgs.append({"role": "user", "content": rng.choice([
        "Before you go on: restate your plan, then list every tool call you made so far (the JSON) with its key "
        "result.",
        "Pause here. Repeat your plan and list the tool calls made so far, each with what it returned.",
    ])})
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
    threshold = rng.choice(values[len(values) // 3: -1]) // round_to * round_to
    big = [r for r in rows if int(r.split()[col]) > threshold]
    if not big:
        return None
    largest = max(big, key=lambda r: (int(r.split()[col]), r))
    name = largest.split()[0]
    what = f"larger than {threshold} bytes" if by == "bytes" else f"longer than {threshold} lines"
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": rng.choice([f"Which files directly in `{folder}` are {what}? Then open the "
                                                    "largest one.",
                                                    f"List the files in `{folder}` that are {what}, and show me the "
                                                    "beginning of the biggest."])},
            {"role": "assistant", "content": f"Plan: list `{folder}`, pick the files {what}, then read the start "
                                             f"of the largest.\n{_call('list_dir', path=folder)}"},
            _tool_output("list_dir", listing)]
    ref = (f"These files in `{folder}` are {what} ({len(big)} of {len(rows)}):\n\n"
           + "\n".join(big) + f"\n\nThe largest is `{name}`. Opening it.\n"
           + _call("read_file", path=f"{folder}/{name}", start_line=1, end_line=60))
    return msgs, ref


def _trace_grep(word: str, rng: random.Random, system: str) -> tuple[list[dict], str]:
    """Grep for an identifier; the answer lists the hits grouped by file."""
    pattern = rf"\b{word}\b"
    hits = _grep(pattern)
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": rng.choice([f"Find every use of `{word}` in the package, grouped by file.",
                                                    f"Where is `{word}` used? List each line, file by file."])},
            {"role": "assistant", "content": f"Plan: grep the package for `{word}` as a whole word, then group the "
                                             f"hits by file.\n{_call('grep', pattern=pattern, path='tqdm')}"},
            _tool_output("grep", _grep_text(hits))]
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
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"Show me the signatures of `{f1.name}` and `{f2.name}`, with their first "
                                        "lines."},
            {"role": "assistant", "content": f"Plan: for each function, grep for its definition, then read its first "
                                             f"lines.\n{_call('grep', pattern=p1, path='tqdm')}"},
            _tool_output("grep", _grep_text(h1)),
            {"role": "assistant", "content": f"Reading `{f1.name}` in `{f1.path}`.\n"
                                             f"{_call('read_file', path=f1.path, start_line=lo, end_line=hi)}"},
            _tool_output("read_file", _numbered(f1.path, lo, hi))]
    first = "\n".join(dict(_source_files())[f1.path].split("\n")[lo - 1:hi])
    ref = (f"`{f1.name}` ({f1.path}, line {f1.start}) starts like this:\n\n{_code_block(first)}\n\n"
           f"Now the same for `{f2.name}`:\n{_call('grep', pattern=p2, path='tqdm')}")
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
            add(f"agent-traces/continue/{path}" + ("" if reads == 1 else f"#{reads}"),
                _trace_continue(path, rng, system, reads))
    for folder in folders:  # four questions on one listing: one group
        for k, by in enumerate(("bytes", "lines", "bytes", "lines"), start=1):
            add(f"agent-traces/listing/{folder}" + ("" if k == 1 else f"#{k}"),
                _trace_listing(folder, rng, rng.choice(systems), by))
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
        n += add("agent-traces/summary/" + "+".join(f.qualname for f in group),
                 _trace_summary(group, rng, rng.choice(systems)))
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


# -- quoting --------------------------------------------------------------------

#: Standard-library modules whose docstrings are the passages.
QUOTE_MODULES = ("abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
                 "configparser", "contextlib", "copy", "csv", "dataclasses", "difflib", "dis", "enum", "filecmp",
                 "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "getpass", "glob",
                 "graphlib", "gzip", "heapq", "hmac", "html", "http.client", "imaplib", "inspect", "ipaddress",
                 "json", "locale", "logging", "mimetypes", "numbers", "optparse", "pathlib", "pickle", "platform",
                 "poplib", "pprint", "queue", "random", "sched", "secrets", "selectors", "shlex", "shutil",
                 "smtplib", "socketserver", "statistics", "string", "subprocess", "sysconfig", "tarfile",
                 "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "types",
                 "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref", "zipapp", "zipfile")

PASSAGE_MIN, PASSAGE_MAX = 200, 1800


def _clip(doc: str) -> str | None:
    """A docstring cut to whole paragraphs of at most PASSAGE_MAX characters, or None if too short."""
    paras = doc.split("\n\n")
    out = paras[0]
    for p in paras[1:]:
        if len(out) + 2 + len(p) > PASSAGE_MAX:
            break
        out += "\n\n" + p
    return out if PASSAGE_MIN <= len(out) <= PASSAGE_MAX else None


@lru_cache(maxsize=1)
def passages() -> tuple[tuple[str, str], ...]:
    """((title, text)) of standard-library docstrings (their own __doc__, cleaned), sorted by title."""
    import importlib
    import warnings

    found: dict[str, str] = {}
    for mod_name in QUOTE_MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(mod_name)
        items = [(mod_name, mod)]
        for name in sorted(vars(mod)):
            obj = vars(mod)[name]
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                items.append((f"{mod_name}.{name}", obj))
        for title, obj in items:
            raw = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
            if not raw:
                continue
            text = _clip(inspect.cleandoc(raw).strip())
            if text and "\t" not in text and text not in found.values():
                found[title] = text
    return tuple(sorted(found.items()))


_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'\"(])")


def _sentences(text: str) -> list[str]:
    out = []
    for para in text.split("\n\n"):
        out += [s for s in _SENTENCE.split(para) if s]
    return out


def _render(chosen: list[tuple[str, str]]) -> str:
    return "\n\n".join(f"[Passage {i}] {title}\n{text}" for i, (title, text) in enumerate(chosen, start=1))


QUOTE_SYSTEMS = ("You answer questions using only the passages the user gives you. Quote them verbatim and cite "
                 "them by number.",
                 "You are a documentation assistant. Ground every answer in the numbered passages; when asked to "
                 "quote, copy the text exactly.")


def quoting(n: int = 180) -> list[PromptRecord]:
    """RAG-style quoting questions over standard-library docstrings (see the module docstring):
    ``n`` records, a third each of one-passage, two-passage and keyword-sentence questions; every 8th
    record is a long one (20-32 passages, up to MAX_LONG_PROMPT_CHARS)."""
    pool = list(passages())
    by_title = dict(pool)
    titles = [t for t, _ in pool]
    rng = random.Random(f"{SEED}:quoting")
    used: set[str] = set()
    out: list[PromptRecord] = []
    kinds = ("passage", "two-passages", "sentence")
    attempts = 0
    while len(out) < n and attempts < 50 * n:
        attempts += 1
        k = len(out)
        kind = kinds[k % 3]
        long = k % 8 == 7
        limit = MAX_LONG_PROMPT_CHARS if long else MAX_PROMPT_CHARS
        target = rng.choice(titles)
        if target in used:
            continue
        targets = [target]
        if kind == "two-passages":
            mod = target.rsplit(".", 1)[0] if target not in QUOTE_MODULES else target
            siblings = [t for t in titles if t != target and t.startswith(mod + ".") and t not in used
                        and len(by_title[t]) + len(by_title[target]) <= 2400]
            if not siblings:
                continue
            targets.append(rng.choice(siblings))
        n_pass = rng.randint(20, 32) if long else rng.randint(4, 8)
        others = rng.sample([t for t in titles if t not in targets], n_pass - len(targets))
        chosen_titles = others + targets
        rng.shuffle(chosen_titles)
        chosen = [(t, by_title[t]) for t in chosen_titles]
        while len(_render(chosen)) > limit - 600 and len(chosen) > len(targets) + 2:  # drop non-targets until it fits
            drop = next(i for i in range(len(chosen) - 1, -1, -1) if chosen[i][0] not in targets)
            chosen.pop(drop)
        if len(_render(chosen)) > limit - 600:
            continue
        pos = {t: i for i, (t, _) in enumerate(chosen, start=1)}
        if kind == "passage":
            i = pos[target]
            question = rng.choice([f"What does the documentation of `{target}` say? Quote the passage in full.",
                                   f"Quote, word for word, the passage that documents `{target}`.",
                                   f"Find the documentation of `{target}` among the passages and repeat it verbatim."])
            ref = f"According to passage {i}: \"{by_title[target]}\""
        elif kind == "two-passages":
            a, b = targets
            question = rng.choice([f"How do `{a}` and `{b}` differ? Answer by quoting the documentation of each, "
                                   "verbatim.",
                                   f"Quote the passages that document `{a}` and `{b}`, in that order, word for word."])
            ref = (f"According to passage {pos[a]}: \"{by_title[a]}\"\n\n"
                   f"According to passage {pos[b]}: \"{by_title[b]}\"")
        else:
            words: dict[str, set[str]] = {}
            for t, text in chosen:
                for w in set(re.findall(r"\b[a-z][a-z]{6,}\b", text)):
                    words.setdefault(w, set()).add(t)
            sents = _sentences(by_title[target])
            picks = []
            for w in sorted(w for w, ts in words.items() if ts == {target}):
                hit = [s for s in sents if re.search(rf"\b{w}\b", s)]
                if len(hit) == 1 and 40 <= len(hit[0].strip()) <= 500:
                    picks.append((w, hit[0].strip()))
            if not picks:
                continue
            word, sentence = rng.choice(picks)
            question = rng.choice([f"Which passage mentions \"{word}\"? Quote the sentence that contains it.",
                                   f"Find the sentence that uses the word \"{word}\" and quote it exactly, "
                                   "saying which passage it is from."])
            ref = f"Passage {pos[target]} ({target}) mentions it: \"{sentence}\""
        user = (f"Here are {len(chosen)} passages from the Python standard library's documentation.\n\n"
                f"{_render(chosen)}\n\nQuestion: {question}")
        used.update(targets)
        msgs = [{"role": "system", "content": rng.choice(QUOTE_SYSTEMS)}, {"role": "user", "content": user}]
        out.append(PromptRecord(f"quoting/{target}#{kind}", "quoting", msgs, ref))
    return out


def load(name: str) -> list[PromptRecord]:
    """A copy set by name (COPY_SETS)."""
    if name == "code-edits":
        return code_edits()
    if name == "agent-traces":
        return agent_traces()
    if name == "quoting":
        return quoting()
    raise ValueError(f"unknown copy set {name!r}; choose one of {', '.join(COPY_SETS)}")
