"""Where SSSD keeps its files: the cache (converted tokenizers, pulled models,
unpacked archives, measured profiles) and the default datastore.

The bottom of the library: the modules that write into the cache import it from
here. ``sssd.paths`` gives the same functions to users, beside the packaged
calibration.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The SSSD cache: $SSSD_CACHE_DIR, else $XDG_CACHE_HOME/sssd, else ~/.cache/sssd."""
    env = os.environ.get("SSSD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "sssd"


#: Where measured forward profiles and linear-layer plans go instead of <cache>/profiles (the test
#: suite points it at a folder of its own: its temporary models' measurements are no user's).
PROFILE_DIR_ENV = "SSSD_PROFILE_DIR"


def profiles_dir() -> Path:
    """Where measured forward profiles and linear-layer plans are cached: $SSSD_PROFILE_DIR, else
    <cache>/profiles."""
    env = os.environ.get(PROFILE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return cache_dir() / "profiles"


def default_datastore_path() -> Path:
    """Where the default datastore lives: $SSSD_DATASTORE, else <cache>/datastores/sharegpt-smollm2."""
    env = os.environ.get("SSSD_DATASTORE")
    if env:
        return Path(env).expanduser()
    return cache_dir() / "datastores" / "sharegpt-smollm2"
