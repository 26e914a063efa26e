"""SSSD: Simply-Scalable Speculative Decoding.

Draft token trees on the CPU from a suffix-array datastore and the request's
own tokens, merged by calibrated priority (paper: Marzollo et al., "SSSD:
Simply-Scalable Speculative Decoding").

Quick use::

    import sssd
    tree = sssd.draft(prefix_ids)          # DraftTree from the default datastore
    drafter = sssd.Drafter(datastore)      # stateful, batched, for engines
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

# The core's OpenMP runtime is the process's only one: the system libgomp and
# the copy torch bundles share a soname, so whichever loads first serves both,
# and it reads OMP_WAIT_POLICY once, as it loads. sssd leaves its default
# (spin briefly at a barrier, then sleep). It used to set "passive" here for
# the suffix sort's sake; that made torch's forward pass sleep between its
# parallel regions too, 1.8x slower for SmolLM2 (benchmarks/RESULTS.md,
# "Linear layers planned by row count"). A user's own setting is kept.
from sssd import _core  # noqa: E402
from sssd._core import SSSDError, UnknownRequestError
from sssd.calibration_file import CalibrationFile
from sssd.config import (
    SOURCE_COPY,
    SOURCE_DATASTORE,
    SOURCE_EXTERNAL,
    SOURCE_INPUT,
    SOURCE_NAMES,
    Calibration,
    DiscountParams,
    DrafterConfig,
    SourceDiscount,
)
from sssd.datastore import SEPARATOR, Datastore, DatastoreError
from sssd.drafter import DEFAULT, Drafter, draft
from sssd.paths import default_datastore_path
from sssd.recent_outputs import RecentOutputs
from sssd.sources import CandidateBatch, Candidates, DraftDistributions, DraftRequest, DraftSource, RetrievalSource
from sssd.token_recycling import TokenRecycling
from sssd.tree import DraftBatch, DraftTree, ancestor_mask

try:
    __version__ = _version("sssd")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+unknown"


def __getattr__(name: str):
    # The engine needs torch and transformers: load it only when asked for.
    if name == "LLM":
        from sssd.serving.frontends.llm import LLM

        return LLM
    if name == "SamplingParams":
        from sssd.serving.engine.params import SamplingParams

        return SamplingParams
    if name == "ModelDrafter":
        from sssd.serving.drafting.model_drafter import ModelDrafter

        return ModelDrafter
    raise AttributeError(f"module 'sssd' has no attribute {name!r}")


def build_info() -> dict:
    """How the native extension was built (OpenMP, threads, compiler)."""
    return dict(_core.build_info(), version=__version__)


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"LLM", "ModelDrafter", "SamplingParams"})


__all__ = [
    "Calibration",
    "CalibrationFile",
    "CandidateBatch",
    "Candidates",
    "DraftDistributions",
    "DraftRequest",
    "DraftSource",
    "RecentOutputs",
    "RetrievalSource",
    "TokenRecycling",
    "DEFAULT",
    "SEPARATOR",
    "SOURCE_COPY",
    "SOURCE_DATASTORE",
    "SOURCE_EXTERNAL",
    "SOURCE_INPUT",
    "SOURCE_NAMES",
    "Datastore",
    "DatastoreError",
    "DiscountParams",
    "DraftBatch",
    "DraftTree",
    "Drafter",
    "DrafterConfig",
    "LLM",
    "ModelDrafter",
    "SSSDError",
    "SamplingParams",
    "SourceDiscount",
    "UnknownRequestError",
    "ancestor_mask",
    "build_info",
    "default_datastore_path",
    "draft",
]
