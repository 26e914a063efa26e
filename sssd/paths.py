"""Where SSSD keeps its files: the cache (converted tokenizers and models,
unpacked archives) and the default datastore."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """The SSSD cache: $SSSD_CACHE_DIR, else $XDG_CACHE_HOME/sssd, else ~/.cache/sssd."""
    env = os.environ.get("SSSD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "sssd"


def default_datastore_path() -> Path:
    """Where the default datastore lives: $SSSD_DATASTORE, else <cache>/datastores/sharegpt-smollm2."""
    env = os.environ.get("SSSD_DATASTORE")
    if env:
        return Path(env).expanduser()
    return cache_dir() / "datastores" / "sharegpt-smollm2"


def portable(obj: object) -> object:
    """``obj`` (nested dicts/lists) with every string path under the SSSD cache written as
    ``<sssd cache>/...``, under the Python environment (site-packages) as ``<python env>/...``
    and under the home directory as ``~/...``: provenance recorded in
    files that travel (a packaged calibration) names no one machine's directories."""
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v) for v in obj]
    if isinstance(obj, str) and obj.startswith(os.sep):
        for root, name in ((cache_dir(), "<sssd cache>"), (Path(sys.prefix), "<python env>"), (Path.home(), "~")):
            root = str(root.expanduser().resolve())
            if obj == root or obj.startswith(root + os.sep):
                return name + obj[len(root):]
    return obj


#: The model the packaged calibration was fitted for (with the default datastore).
CALIBRATED_MODEL = "smollm2-135m-instruct"


def packaged_calibration(model: str | os.PathLike, datastore: object = "default") -> Path | None:
    """The `sssd calibrate` file shipped in the package for the default model with the default
    datastore (sssd/data/calibration-smollm2.json), or None for any other pairing."""
    if datastore != "default" or Path(str(model)).name != CALIBRATED_MODEL:
        return None
    path = Path(__file__).resolve().parent / "data" / "calibration-smollm2.json"
    return path if path.is_file() else None
