"""The installed tqdm package's sources, which the code-edits and agent-traces sets edit and read:
its .py files, and its functions and methods of MIN_LINES-MAX_LINES lines cut out with ``ast``
(``source_functions``), with the exact dedent/reindent between the file and the cut-out function."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

#: The package whose sources the code sets edit and read.
SOURCE_PACKAGE = "tqdm"

MIN_LINES, MAX_LINES = 20, 120


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
            out.append(line[len(indent) :])
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
                    head = "\n".join(lines[start - 1 : ch.lineno - 1])  # the decorators
                    full = f"{head}\n{segment}" if head else segment
                    if full != "\n".join(lines[start - 1 : ch.end_lineno]):
                        continue
                    indent = lines[ch.lineno - 1][: ch.col_offset]
                    src = dedent_exact(full, indent)
                    if src is None:
                        continue
                    try:
                        ast.parse(src)
                    except SyntaxError:
                        continue
                    found.append(
                        SourceFunction(
                            f"{mod}.{prefix}{ch.name}", path, ch.name, cls, src, indent, start, ch.end_lineno
                        )
                    )

        walk(tree, "", None)
    found.sort(key=lambda f: f.qualname)
    return tuple(found)
