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
