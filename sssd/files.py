"""Small file helpers shared across the package: regular-file checks, streaming
sha256, bounded JSON reads (strict: :func:`read_json_object`; lenient:
:func:`read_json_dict`), names inside a folder, and atomic writes
(:func:`atomic_directory`, :func:`write_atomic`).

Anything that reads a file it did not create goes through :func:`open_regular`:
opening a FIFO for reading blocks until a writer appears (forever, if none
does), and a device such as /dev/zero never ends. So the path is checked with
stat first, then opened with O_NONBLOCK (which cannot block and does nothing to
a regular file) and checked again with fstat, so that a file swapped in between
is caught too.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

#: Bytes read per chunk when hashing.
CHUNK = 1 << 22


class NotRegularFileError(OSError):
    """A path that must be a regular file is a FIFO, a directory, a device or a socket.

    ``str()`` is "<path>: it is a FIFO, not a regular file"; ``strerror`` is the part after the path.
    """

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def describe_mode(mode: int) -> str:
    """What a stat mode is, as a noun phrase ("a FIFO", "a directory", ...)."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(path: str | Path, mode: int) -> NotRegularFileError:
    code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
    return NotRegularFileError(code, f"it is {describe_mode(mode)}, not a regular file", str(path))


def check_regular(path: str | Path) -> os.stat_result:
    """``os.stat(path)`` (symlinks followed) if it is a regular file.

    Raises:
        FileNotFoundError: nothing there.
        NotRegularFileError: a FIFO, directory, device or socket.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st


def open_regular(path: str | Path) -> BinaryIO:
    """Opens a regular file for binary reading; never blocks on a FIFO or reads a device.

    Raises:
        FileNotFoundError / PermissionError: as open() does.
        NotRegularFileError: the path is not a regular file (checked before and after opening).
    """
    check_regular(path)
    nonblock = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped after the stat above
            raise _not_regular(path, st.st_mode)
        if nonblock:
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~nonblock)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | Path, max_bytes: int | None = None) -> bytes:
    """A regular file's contents, refusing one larger than ``max_bytes``.

    Raises:
        NotRegularFileError, OSError: see open_regular.
        ValueError: the file is larger than max_bytes.
    """
    with open_regular(path) as f:
        if max_bytes is None:
            return f.read()
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path}: larger than {max_bytes:,} bytes, too large to be what it claims")
    return data


def file_sha256(path: str | Path, progress: Callable[[int], None] | None = None) -> str:
    """The file's sha256 hex digest, read in chunks; ``progress(n)`` is called per chunk of n bytes.

    Raises:
        NotRegularFileError: the path is a FIFO, directory, device or socket (never blocks on one).
    """
    h = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


#: read_json_dict reads side files of a few kilobytes; anything larger is not one.
MAX_JSON_SIDE_FILE = 64 << 20


def read_json_dict(path: str | Path) -> dict:
    """A JSON object from a file, or {} if the file is missing, unreadable, not a
    regular file, too large (over 64 MiB) or not an object."""
    try:
        data = json.loads(read_bytes(path, MAX_JSON_SIDE_FILE))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON object from a regular file of at most 64 MiB (ValueError saying why not, naming `what` it is)."""
    try:
        d = json.loads(read_bytes(path, MAX_JSON_SIDE_FILE))
    except OSError as e:  # NotRegularFileError: "it is a FIFO, not a regular file"
        raise ValueError(f"{path}: cannot read a {what} ({e.strerror or e})") from e
    except (ValueError, RecursionError) as e:  # too large, not UTF-8, not JSON (truncated)
        raise ValueError(f"{path}: cannot read a {what} (not valid JSON, or truncated: {e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a {what} is a JSON object, got a {type(d).__name__}")
    return d


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a plain file name: a non-empty string with no directory part
    (no "/" or "\\"), not "." or "..", no NUL or other control character."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\")
        and all(ord(c) >= 32 and c != "\x7f" for c in name)
    )


def file_inside(folder: str | Path, name: object, what: str = "file") -> Path:
    """``folder / name`` for a plain file name whose file, if a symbolic link, stays inside ``folder``.

    Raises:
        ValueError: ``name`` is not a plain name (a path, "..", absolute, empty, not a
            string), or the file is a symbolic link that leads outside ``folder``.
    """
    if not is_plain_name(name):
        raise ValueError(f"{folder}: {what} {name!r} is not a plain file name inside the folder; refusing to follow it")
    path = Path(folder) / name  # type: ignore[operator]
    if path.is_symlink():
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError):  # dangling or a loop
            raise ValueError(f"{path}: {what} is a broken symbolic link") from None
        root = Path(folder).resolve()
        if root not in target.parents:
            raise ValueError(
                f"{path}: {what} is a symbolic link to {target}, outside the folder; refusing to follow it"
            )
    return path


# -- atomic writes ---------------------------------------------------------------------


@contextmanager
def atomic_directory(target: str | Path, *, replace: bool, tag: str = "tmp") -> Iterator[Path]:
    """A new empty directory beside ``target`` to fill, renamed onto ``target`` once the block succeeds.

    The directory, ``.<target name>.<tag>-<pid>-<random>``, is made like any new
    directory (mode 0777 less the umask; the parent is created if missing). If
    the block raises anything, KeyboardInterrupt included, the directory is
    removed and ``target`` is left as it was. When the block ends normally:

    * ``replace=True``: an existing ``target`` is renamed aside
      (``.<name>.old-<pid>-<random>``), the new directory renamed in, then the
      old one removed (if the second rename fails, the old one is put back):
      ``target`` is never a partial or mixed directory (for a moment, none).
    * ``replace=False``: an existing ``target`` is kept and the new directory
      removed. This is for targets named by their content (caches): when two
      processes make the same thing at once, the loser uses the winner's copy.

    Raises:
        OSError: the directory cannot be made or renamed (nothing is left behind).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp, _ = _create_unique(target.parent, f".{target.name}.{tag}-{os.getpid()}-", lambda p: os.mkdir(p, 0o777))
    try:
        yield tmp
        if replace:
            _rename_replacing(tmp, target)
        else:
            _rename_unless_exists(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def write_atomic(path: str | Path, data: bytes) -> None:
    """Writes ``data`` to the file ``path`` through a hidden temporary file beside it and
    ``os.replace``: a reader sees the old contents or the new, never part of them. The
    file gets the usual mode (0666 less the umask); on any failure the temporary is removed.
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    tmp, fd = _create_unique(path.parent, f".{path.name}.{os.getpid()}-", lambda p: os.open(p, flags, 0o666))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _create_unique(folder: Path, prefix: str, create: Callable[[Path], Any]) -> tuple[Path, Any]:
    """``(path, create(path))`` for the first free ``folder / (prefix + random)``
    (``create`` must raise FileExistsError if the name is taken)."""
    for _ in range(100):
        path = folder / f"{prefix}{secrets.token_hex(4)}"
        try:
            return path, create(path)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(folder / prefix))


def _rename_replacing(src: Path, dst: Path) -> None:
    if not os.path.lexists(dst):
        os.rename(src, dst)
        return
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(dst, old)
    try:
        os.rename(src, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


def _rename_unless_exists(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)  # onto nothing, or onto an empty directory
    except OSError:
        if not dst.is_dir():  # not a lost race: a real failure
            raise
