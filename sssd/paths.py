"""Where SSSD keeps its files: the cache (converted tokenizers and models,
unpacked archives) and the default datastore."""

from __future__ import annotations

import os
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


#: The model the packaged calibration was fitted for (with the default datastore).
CALIBRATED_MODEL = "smollm2-135m-instruct"


def packaged_calibration(model: str | os.PathLike, datastore: object = "default") -> Path | None:
    """The `sssd calibrate` file shipped in the package for the default model with the default
    datastore (sssd/data/calibration-smollm2.json), or None for any other pairing."""
    if datastore != "default" or Path(str(model)).name != CALIBRATED_MODEL:
        return None
    path = Path(__file__).resolve().parent / "data" / "calibration-smollm2.json"
    return path if path.is_file() else None
