"""How an engine is put together: the target model's backend, the draft sources, the calibration.

`LLMEngine.__init__` calls these in order: resolve the model, build its backend (a TorchBackend,
or a PipelineBackend over processes), make the draft sources of the specs, merge them in a
DraftPipeline with the calibration that fits the datastore and model (the packaged one where its
fingerprint matches), and check every datastore against the model's tokenizer and vocabulary.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import sssd
from sssd.serving.engine.config import EngineConfig
from sssd.serving.planning.deferral import Deferral
from sssd.source_evidence import DEFAULT_EVIDENCE
from sssd.sources import DraftPipeline, RetrievalSource, parse_specs


def log(msg: str) -> None:
    """Start-up progress on stderr: one line per phase, and what a measurement was (not) used for."""
    print(msg, file=sys.stderr, flush=True)


def detail(msg: str) -> None:
    """The details of a measurement (each linear plan shape, each profiled row count): on stderr
    with SSSD_VERBOSE=1 (`sssd serve -v`), else dropped."""
    import os

    if os.environ.get("SSSD_VERBOSE", "").strip() not in ("", "0"):
        log(msg)


def build_backend(path: Path, config: EngineConfig):
    """The VerifierBackend of the model folder: one process, or `pipeline_stages` of them."""
    import torch
    from transformers import AutoConfig

    from sssd.cpus import threads_for

    positions = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "max_position_embeddings", None)
    capacity = min(config.max_model_len, int(positions)) if positions else config.max_model_len
    if config.pipeline_stages > 1:  # the layers split over processes (pipeline_backend.py)
        from sssd.serving.backends.pipeline_backend import PipelineBackend

        return PipelineBackend(
            path,
            config.pipeline_stages,
            slots=config.max_running,
            capacity=capacity,
            dtype=config.dtype,
            device=config.device,
            # checked and cut to the cores per stage; 1 each unless told, as before
            threads=threads_for(config.threads, share=config.pipeline_stages) if config.threads else 1,
        )
    from sssd.serving.backends.torch_backend import TorchBackend

    return TorchBackend(
        path,
        slots=config.max_running,
        capacity=capacity,
        dtype=config.dtype,
        device=config.device,
        # torch's own count (OMP_NUM_THREADS where set) capped at the affinity mask and cgroup quota
        threads=threads_for(config.threads, default=torch.get_num_threads()),
        log=detail if config.measure == "now" else log,
        measure_now=config.measure == "now",
    )


def build_async(config: EngineConfig, drafting: DraftPipeline | None):
    """Async drafting's thread and the measured choice of mode (None, None unless asked for)."""
    if config.draft_mode != "async" or drafting is None:
        return None, None
    from sssd.serving.drafting.async_draft import AsyncDrafter, ModeChooser

    return AsyncDrafter(drafting, threads=config.draft_threads), ModeChooser()


def build_planner(engine):
    """The engine's budget planner: its profile is the backend's forward-cost profile (measured
    once per model and machine), plus what costly draft sources (a draft model) add to a step."""
    from sssd.serving.planning.planner import BudgetPlanner

    costly = [
        s
        for s in (engine.drafting.external if engine.drafting is not None else [])
        if callable(getattr(s, "draft_seconds", None))
    ]
    params = engine.backend.info.shape.get("params")
    draft_cost = (
        (lambda batch, profile: sum(s.draft_seconds(batch, profile, params) for s in costly)) if costly else None
    )
    return BudgetPlanner.create(
        engine.config,
        speculate=engine.drafting is not None,
        calibration=engine.drafter_configs,
        profile=lambda: start_profile(engine.backend, engine.config),
        draft_cost=draft_cost,
    )


def start_profile(backend, config: EngineConfig):
    """The forward profile an engine starts planning with: measured now (measure "now"), or the
    cached one where it can be trusted (with reprofile too, until the new one is in), else the
    conservative prior until the measurement taken between requests is in (build_measurements)."""
    from sssd.serving.planning import profile

    if config.measure == "now":
        return backend.profile(log=detail, force=config.reprofile)
    prof = profile.cached(backend, log)  # with reprofile too: the last trusted one until the new one is in
    return prof if prof is not None else profile.prior(backend)


def build_contention(engine):
    """The monitor of other processes' load on the engine's CPUs (sssd.cpus.Contention) that the
    engine's threads follow; None on GPUs, with pipeline stages (their processes keep their own
    count) or with SSSD_FOLLOW_LOAD=0."""
    import os

    import torch

    from sssd.cpus import Contention

    if engine.config.pipeline_stages > 1 or getattr(engine.backend, "device", None) != torch.device("cpu"):
        return None
    if os.environ.get("SSSD_FOLLOW_LOAD", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    return Contention(engine.config.threads or torch.get_num_threads())


def build_measurements(engine):
    """The measurements the engine takes between requests (planning/measurements.py): the linear
    plan where none is cached, the forward profile where the planner started from the prior.
    None when there is nothing to measure."""
    from sssd.serving.planning.measurements import BackgroundMeasurements

    planner = engine.planner
    want_profile = planner.fixed is None and (bool(planner.profile.meta.get("prior")) or engine.config.reprofile)
    if not want_profile and not getattr(engine.backend, "linear_plan_pending", False):
        return None

    def on_profile(prof) -> None:
        planner.use_profile(prof)
        if engine.allocator is not None:
            engine.allocator.use_time(prof.times)

    jobs = BackgroundMeasurements(
        engine.backend, want_profile, on_profile, quiet=lambda: not engine.contended(), log=log
    )
    if engine.config.reprofile:
        for job in jobs.jobs:
            job.cached = None
    return jobs if jobs.pending else None


def build_allocator(engine):
    """The batch-wide allocation of the step's verification budget (planning/allocation.py), when
    the engine plans its budget (no fixed budget) with allocation "batch"; None otherwise."""
    planner = engine.planner
    if engine.drafting is None or planner.fixed is not None or engine.config.allocation != "batch":
        return None
    from sssd.serving.planning.allocation import BatchAllocator

    return BatchAllocator(planner.profile.times, max_budget=planner.max_budget)


def follow_fixed_budget(engine) -> None:
    """An explicit budget means that budget: every listed source drafts at it, whatever the cost
    models say (the sparse-KV source's chain length, the deferral of a draft model)."""
    if engine.drafting is None or engine.planner.fixed is None:
        return
    from sssd.serving.planning.deferral import ARMS
    from sssd.serving.planning.measured_choice import MeasuredChoice

    if hasattr(engine.drafting.deferral, "policy"):  # always drafts; what retrieval alone would do is still measured
        engine.drafting.deferral.policy = MeasuredChoice(ARMS, fixed="always")
    for source in engine.drafting.external:
        if hasattr(source, "fixed_budget"):
            source.fixed_budget = True


def build_drafting(engine, draft, datastores: list, drafter: Any) -> DraftPipeline | None:
    """The engine's DraftPipeline (None: no draft source), with the calibration that fits; sets
    engine.drafter_configs / drafter_config / drafter_source to what it drafts with."""
    path, info = engine.model_path, engine.backend.info
    sources = make_sources(
        engine, draft if engine.config.speculate else [], datastores[0] if datastores else None, path
    )
    if not sources:
        return None
    eos = min(engine.eos_ids) if engine.eos_ids else None
    evidence = DEFAULT_EVIDENCE if engine.config.source_evidence else None
    drafting = DraftPipeline(
        sources,
        with_end_token(engine.drafter_configs, eos),
        vocab_size=info.vocab_size,
        deferral=Deferral(),
        evidence=evidence,
    )
    ds = drafting.datastore
    if ds is not None:
        check_datastore(ds, path, info.vocab_size)
    if drafter is None:  # the packaged calibration where it fits this datastore and model
        checked = packaged(ds, path) or engine.drafter_configs
        if checked is not engine.drafter_configs:
            engine.drafter_source = checked.where
    else:
        checked = checked_calibration(engine.drafter_configs, ds, path)
    if checked is not engine.drafter_configs:  # packaged, or calibrated for another setup (warned): the defaults
        engine.drafter_configs = engine.drafter_config = checked
        sources = [
            RetrievalSource(ds, checked, **s.overrides) if isinstance(s, RetrievalSource) else s for s in sources
        ]
        drafting = DraftPipeline(
            sources, with_end_token(checked, eos), vocab_size=info.vocab_size, deferral=Deferral(), evidence=evidence
        )
    if ds is not None:  # fault the mmap in now: cold pages cost milliseconds per draft
        ds.make_resident(engine.config.datastore_residency)
    from sssd.datastore_source import add_datastore

    for extra in datastores[1:]:
        add_datastore(drafting, engine.check_datastore(extra), default_name=extra)
    return drafting


def make_sources(engine, draft, datastore: Any, model_path: Path) -> list:
    """The draft sources of the specs in `draft` (strings or DraftSource objects): retrieval over
    `datastore` and the others the spec grammar names (sssd.sources.parse_specs)."""
    out = []
    for spec in parse_specs(draft):
        if isinstance(spec, tuple):
            kind, arg = spec
            if kind == "retrieval":
                out.append(RetrievalSource(datastore, engine.drafter_config))
                continue
            if kind == "recycle":
                from sssd.token_recycling import DEFAULT_K, TokenRecycling

                out.append(TokenRecycling(int(arg) if arg else DEFAULT_K, vocab_size=engine.backend.info.vocab_size))
                continue
            if kind == "recent":
                from sssd.recent_outputs import RecentOutputs

                out.append(RecentOutputs())
                continue
            if kind == "model":
                from sssd.serving.drafting.model_drafter import ModelDrafter

                out.append(
                    ModelDrafter(
                        arg,
                        target=model_path,
                        target_tokenizer=engine.tokenizer,
                        slots=engine.config.max_running,
                        capacity=engine.max_model_len,
                        dtype=engine.config.dtype,
                        device=engine.config.device,
                        threads=engine.config.threads,
                    )
                )
                continue
            if kind == "self":
                from sssd.serving.drafting.self_drafter import SelfDrafter

                out.append(SelfDrafter.for_engine(engine, arg))
                continue
            raise ValueError(
                f"the draft source '{kind}:{arg}' is not available in this version of sssd "
                f"(available: retrieval, model:<name or folder>, recycle, recent, or your own "
                f"sssd.DraftSource)"
            )
        out.append(spec)
    return out


def resolve_model(model: str | Path) -> Path:
    p = Path(model).expanduser()
    if (p / "config.json").is_file():
        return p
    from sssd.models import resolve_model

    return Path(resolve_model(str(model)))


def check_datastore(ds: Any, model_path: Path, vocab_size: int) -> None:
    """A datastore must speak the model's tokens: the tokenizer it records, and its largest id."""
    if ds.manifest.get("tokenizer"):
        from sssd.tokenizer import check_compatible

        check_compatible(ds, model_path)
    if int(ds.manifest.get("vocab_size", 0)) > vocab_size:
        raise ValueError(
            f"the datastore {ds.path} holds token ids up to {int(ds.manifest['vocab_size']) - 1}, "
            f"beyond the model's vocabulary ({vocab_size} ids): it was built with another "
            f"tokenizer; rebuild it with the model's (sssd build -t {model_path})"
        )


def drafter_config(drafter: Any) -> Any:
    """A DrafterConfig, or a CalibrationFile (every budget's entry); ValueError for a malformed file."""
    from sssd.calibration_file import load_drafter

    return load_drafter(drafter)


def default_config(configs: Any) -> sssd.DrafterConfig:
    """The config of a file's default budget (or the one config)."""
    return configs if isinstance(configs, sssd.DrafterConfig) else configs.config()


def with_end_token(configs: Any, eos: int | None) -> Any:
    """Every config with the model's end-of-sequence id as its end token, unless it names one."""

    def fix(c: sssd.DrafterConfig) -> sssd.DrafterConfig:
        return c if c.end_token is not None else c.replace(end_token=eos)

    return fix(configs) if isinstance(configs, sssd.DrafterConfig) else configs.map(fix)


def packaged(datastore: Any, model_path: Path) -> Any:
    """The packaged calibration (a CalibrationFile) if its fingerprint matches the datastore
    and model, else None (why not is logged at INFO)."""
    if datastore is None:
        return None
    from sssd.calibration_file import CalibrationFile
    from sssd.paths import packaged_calibration

    found = packaged_calibration(model_path, datastore)
    return CalibrationFile.load(found) if found is not None else None


def checked_calibration(configs: Any, datastore: Any, model_path: Path) -> Any:
    """A calibration file whose fingerprint matches the datastore, tokenizer and model (or that
    records none: warned, used as is); the uncalibrated defaults, warned, when one differs."""
    from sssd.calibration_file import CalibrationFile

    return configs.checked_or_defaults(datastore, model_path) if isinstance(configs, CalibrationFile) else configs
