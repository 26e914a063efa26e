"""Argument types for the subcommands.

Each is an argparse ``type=``: it checks one value while the command line is
parsed, so a bad argument fails at once with one line naming it
("sssd draft: error: argument --ids: 'x' is not a token id"), before any
model, tokenizer or datastore is loaded. Files are checked with stat only:
nothing here opens a path (a FIFO would block).
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path

Error = argparse.ArgumentTypeError

#: The largest token id (2^32 - 2; 2^32 - 1 is the document separator).
MAX_TOKEN_ID = (1 << 32) - 2


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An integer in [lo, hi] (either bound may be None)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise Error(f"{text!r} is not an integer") from None
        if lo is not None and value < lo:
            raise Error(f"must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise Error(f"must be <= {hi}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """A finite number in [lo, hi] ((lo, hi] with lo_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise Error(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise Error(f"must be a finite number, got {text!r}")
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise Error(f"must be {'>' if lo_open else '>='} {lo:g}, got {value:g}")
        if hi is not None and value > hi:
            raise Error(f"must be <= {hi:g}, got {value:g}")
        return value

    parse.__name__ = "number"
    return parse


def _stat(text: str, what: str) -> os.stat_result:
    if not text.strip():
        raise Error(f"empty {what} path")
    try:
        return os.stat(Path(text).expanduser())
    except FileNotFoundError:
        raise Error(f"{text}: no such file or directory") from None
    except NotADirectoryError:
        raise Error(f"{text}: no such file or directory (a part of the path is a file)") from None
    except OSError as e:
        raise Error(f"{text}: cannot access it ({e.strerror or e})") from None


def _kind(mode: int) -> str:
    from sssd.files import describe_mode

    return describe_mode(mode)


def regular_file(text: str) -> str:
    """An existing regular file (not a directory, FIFO or device)."""
    st = _stat(text, "file")
    if not stat.S_ISREG(st.st_mode):
        raise Error(f"{text}: it is {_kind(st.st_mode)}, not a regular file")
    if not os.access(Path(text).expanduser(), os.R_OK):
        raise Error(f"{text}: not readable (permission denied)")
    return text


def file_or_folder(text: str) -> str:
    """An existing regular file or directory (a tokenizer spec, a model)."""
    st = _stat(text, "file or folder")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise Error(f"{text}: it is {_kind(st.st_mode)}, not a file or folder")
    return text


def tokenizer(text: str) -> str:
    """A tokenizer: an existing tokenizer.json, model folder or .gguf file, or a registered model
    name (`sssd models list`: its tokenizer; the model is pulled on first use, like --model)."""
    if not text.strip():
        raise Error("empty tokenizer path")
    if Path(text).expanduser().exists() or os.sep in text or text.startswith(("~", ".")):
        return file_or_folder(text)  # a path: it must be there
    from sssd.model_registry import MODELS, get_spec

    try:
        get_spec(text)
    except ValueError:
        raise Error(
            f"{text}: no such file or directory, and not a registered model "
            f"({', '.join(MODELS)}; see `sssd models list`)"
        ) from None
    return text


def datastore(*names: str) -> Callable[[str], str]:
    """'default' (or another of ``names``) or an existing datastore directory or archive file."""

    def parse(text: str) -> str:
        if text in names:
            return text
        st = _stat(text, "datastore")
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            raise Error(f"{text}: it is {_kind(st.st_mode)}, not a datastore directory or archive")
        return text

    parse.__name__ = "datastore"
    return parse


def output_file(text: str) -> str:
    """A file to write: not an existing directory, FIFO or device; its folder, if it exists, a folder."""
    if not text.strip():
        raise Error("empty output path")
    path = Path(text).expanduser()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        _check_parent(text, path)  # names the part of the path that is a file
        raise Error(f"{text}: a part of the path is not a directory") from None
    except OSError as e:
        raise Error(f"{text}: cannot access it ({e.strerror or e})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise Error(f"{text}: it is {_kind(st.st_mode)}; give a file name")
    _check_parent(text, path)
    return text


def folder(output: bool = False) -> Callable[[str], str]:
    """A directory that may not exist yet: if something is there it must be a directory, and the
    path's nearest existing parent a directory too. ``output``: one the command creates (its
    messages say so)."""

    def parse(text: str) -> str:
        if not text.strip():
            raise Error("empty output path" if output else "empty path")
        path = Path(text).expanduser()
        if path.exists() and not path.is_dir():
            raise Error(f"{text}: it {'exists and ' if output else ''}is not a directory")
        _check_parent(text, path)
        return text

    parse.__name__ = "folder"
    return parse


def _check_parent(text: str, path: Path) -> None:
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise Error(f"{text}: {parent} is not a directory")
            return


def token_ids(text: str) -> list[int]:
    """Comma-separated token ids ("1, 2,3"): at least one, each in [0, 2^32 - 2]."""
    parts = [p.strip() for p in text.split(",")]
    if parts and not parts[-1]:
        parts.pop()  # a trailing comma
    if not parts or not any(parts):
        raise Error("no token ids (give comma-separated integers, e.g. 1,2,3)")
    ids = []
    for i, part in enumerate(parts):
        try:
            value = int(part)
        except ValueError:
            what = "an empty item" if not part else repr(part)
            raise Error(f"{what} (item {i + 1}) is not a token id: give comma-separated integers, e.g. 1,2,3") from None
        if not 0 <= value <= MAX_TOKEN_ID:
            raise Error(f"{value} (item {i + 1}) is not a token id: ids are in [0, {MAX_TOKEN_ID}]")
        ids.append(value)
    return ids


def model(text: str) -> str:
    """A registered model name (`sssd models list`) or a local Hugging Face model folder."""
    from sssd.models import MODELS, get_spec

    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise Error(
                f"unknown model {text!r}: a model is a registered name or a Hugging Face model folder, not a file"
            )
        return text
    try:
        get_spec(text)
    except ValueError:
        if os.sep in text or text.startswith("."):
            raise Error(f"unknown model {text!r}: no such model folder") from None
        raise Error(
            f"unknown model {text!r}: not a local model folder and not a registered model "
            f"({', '.join(MODELS)}; see `sssd models list`)"
        ) from None
    return text


def non_empty(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.strip():
            raise Error(f"empty {what}")
        return text

    parse.__name__ = what
    return parse


def default_datastore() -> Path:
    """The default datastore's directory, if it is built.

    Raises:
        FileNotFoundError: not built yet; the one-line message says how to build it.
    """
    from sssd.datastore import built_default_path

    return built_default_path()
