"""Where SSSD keeps its files: the cache (converted tokenizers and models,
unpacked archives), the default datastore, and the packaged calibration, with
whether it fits a model and datastore.

``cache_dir``, ``default_datastore_path`` and ``profiles_dir`` are sssd.cache's, given here too: the
library's lower modules take them from there, as this module reads calibration
files (sssd.calibration_file) to tell whether the packaged one fits.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from sssd.cache import cache_dir, default_datastore_path, profiles_dir
from sssd.calibration_file import CalibrationFile

log = logging.getLogger("sssd.calibration")


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
                return name + obj[len(root) :]
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
    path = packaged_calibration_file()
    if isinstance(datastore, (list, tuple)):  # several: the first is retrieval's
        datastore = datastore[0] if datastore else None
    if datastore is None or not path.is_file():
        return None
    try:
        problems = CalibrationFile.load(path).check(datastore, model)
    except ValueError as e:  # a damaged installation
        log.warning("the packaged calibration is unreadable (%s)", e)
        return None
    if problems:
        log.info(
            "the packaged calibration does not fit (%s): drafting with the uncalibrated defaults", "; ".join(problems)
        )
        return None
    return path


__all__ = [
    "cache_dir",
    "default_datastore_path",
    "packaged_calibration",
    "packaged_calibration_file",
    "portable",
    "profiles_dir",
]
