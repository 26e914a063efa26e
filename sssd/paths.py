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


def packaged_calibration_file() -> Path:
    """The `sssd calibrate` file shipped in the package (sssd/data/calibration-smollm2.json),
    whether or not it fits a given datastore and model."""
    return Path(__file__).resolve().parent / "data" / "calibration-smollm2.json"


def packaged_calibration(model: str | os.PathLike, datastore: object = "default") -> Path | None:
    """The packaged calibration file if it fits this model and datastore, else None.

    It fits when its fingerprint matches: the datastore's content fingerprint and
    tokenizer, and the model's weights identity (sssd.calibration_file), whatever
    their names or paths: a copy of the default datastore fits, a datastore of the
    same name built from other data does not. Why it does not fit is logged (INFO).

    Args:
        model: a model folder or registered model name (need not be pulled yet).
        datastore: a Datastore, a datastore directory or archive, "default", or None (none fits);
            of a list, the first (retrieval's).
    """
    import logging

    from sssd.calibration_file import CalibrationFile

    path = packaged_calibration_file()
    if isinstance(datastore, (list, tuple)):  # several: the first is retrieval's
        datastore = datastore[0] if datastore else None
    if datastore is None or not path.is_file():
        return None
    try:
        problems = CalibrationFile.load(path).check(datastore, model)
    except ValueError as e:  # a damaged installation
        logging.getLogger("sssd.calibration").warning("the packaged calibration is unreadable (%s)", e)
        return None
    if problems:
        logging.getLogger("sssd.calibration").info("the packaged calibration does not fit (%s): drafting with the "
                                                   "uncalibrated defaults", "; ".join(problems))
        return None
    return path
