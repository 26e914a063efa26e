"""Loading a model for inference, and the machine-learning stack behind it.

torch and transformers are imported only when a model is loaded or converted
(``_import_ml``), so that ``import sssd.models`` stays light.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

from sssd.models._progress import Log, _stderr
from sssd.models.folders import resolve_model


def load_model(
    spec: str | os.PathLike,
    dtype: str = "float32",
    *,
    threads: int | None = None,
    cache: str | Path | None = None,
    log: Log = _stderr,
) -> tuple[Any, Any, Path]:
    """Loads a causal LM and its tokenizer (transformers) for inference, in eval mode.

    Args:
        spec: a registry name (pulled on demand) or a local model folder.
        dtype: torch dtype name; float32 for exact comparisons.
        threads: torch intra-op threads (None: leave torch's setting).

    Returns:
        (model, tokenizer, folder).
    """
    path = resolve_model(spec, cache=cache, log=log)
    torch, _ = _import_ml(str(spec))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    with _quiet(False):
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), local_files_only=True)
    model.eval()
    return model, tokenizer, path


def _import_ml(what: str) -> tuple[Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RuntimeError(f"{what}: needs torch and transformers (scripts/setup.sh installs them): {e}") from None
    return torch, transformers


class _quiet:
    """Silences transformers' warnings (and its progress bars unless ``progress``) inside the block."""

    def __init__(self, progress: bool):
        self.progress = progress

    def __enter__(self):
        import warnings

        from transformers.utils import logging as hf_logging

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        self._bars = hf_logging.is_progress_bar_enabled()
        if not self.progress:
            hf_logging.disable_progress_bar()
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._verbosity)
        if self._bars:
            hf_logging.enable_progress_bar()
        self._warnings.__exit__(*exc)
        return False


def _versions() -> dict[str, str]:
    """The installed versions of sssd and the libraries a conversion or a ground truth depends on."""
    out = {}
    for pkg in ("sssd", "transformers", "torch", "gguf", "safetensors", "tokenizers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out
