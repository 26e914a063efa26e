"""Exact program transformations of one function's source: renaming an identifier, removing
comments, inserting a statement, wrapping the body in try/except, flipping an operator, changing
a constant. Each checks its result against the expected syntax tree and raises EditError where the
edit does not apply or would not be exact."""

from __future__ import annotations

import ast
import io
import re
import tokenize


class EditError(ValueError):
    """An edit that does not apply to a function (no candidate, or the result would not be exact)."""


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
            if src[a : a + len(old)] != old:
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
    if ast.dump(new_code[0]) != ast.dump(ast.parse(statement).body[0]) or [ast.dump(s) for s in new_code[1:]] != [
        ast.dump(s) for s in code
    ]:
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
    out = "\n".join(
        lines[:at]
        + [indent + "try:"]
        + body
        + [
            indent + "except Exception as err:",
            indent + f'    logger.error("{name} failed: %s", err)',
            indent + "    raise",
        ]
    )
    new_code = _code_body(_function_node(out))
    if (
        len(new_code) != 1
        or not isinstance(new_code[0], ast.Try)
        or [ast.dump(s) for s in new_code[0].body] != [ast.dump(s) for s in code]
    ):
        raise EditError("wrapping is not exact")
    return out


#: Operator flips that make a bug (and back).
FLIPS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "+": "-", "-": "+", "+=": "-=", "-=": "+="}


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
    out = src[:a] + FLIPS[site.string] + src[a + len(site.string) :]
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
        if (
            isinstance(n, ast.Constant)
            and type(n.value) in (int, float)
            and id(n) not in inside_f
            and id(n) not in negated
            and n.lineno == n.end_lineno
            and n.lineno >= fn.body[0].lineno
        ):
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
