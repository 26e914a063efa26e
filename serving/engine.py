"""LLMEngine: continuous batching with SSSD tree speculation.

Every call to step() is one iteration of an Orca-style loop:

1. admit waiting requests into free KV slots;
2. prefill: write the next chunk of prompts into their slots (a bounded
   number of prompt tokens per step, so long prompts never stall decoding);
3. decode one speculative step for every decoding request, in three phases:
   * prepare (CPU): choose the budget, draft a tree per request from every
     draft source (one batched merge), pack the trees;
   * launch: the backend's forward pass over all trees at once;
   * finish: accept (vectorised over the batch), move every accepted path's
     KV into place in one operation, emit tokens, update the drafters.
   The split lets a later step's drafting overlap a forward pass.

The engine knows the target only through its VerifierBackend (backend.py):
slots, forward passes, compaction and a cost profile. The KV pool keeps
decoding requests in slots [0, d) and prefilling ones in [d, n), so both
passes read their keys without gathers.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

import sssd
from sssd.serving.acceptance import Sampler, accept_greedy, accept_sampled, mss_trials
from sssd.serving.backend import VerifierBackend
from sssd.serving.detokenizer import Detokenizer
from sssd.serving.metrics import Histogram
from sssd.serving.params import SamplingParams
from sssd.serving.sequence import Request, Status
from sssd.serving.tree_batch import NO_SOURCE, TreeBatch, pack, pack_chain
from sssd.sources import DraftPipeline, DraftRequest, DraftSource, RetrievalSource, parse_specs

log = logging.getLogger("sssd.serving")

#: Request ids are 63-bit non-negative ints everywhere (the API, the engine, the drafter).
MAX_REQUEST_ID = 2**63 - 1
#: Prompts longer than this many characters per servable token are judged on a prefix first
#: (tokenizing megabytes only to refuse them would stall the caller for seconds).
PROBE_CHARS_PER_TOKEN = 8
#: What the engine drafts with unless told otherwise.
DEFAULT_DRAFT = ("retrieval",)
#: How drafting runs beside verification (EngineConfig.draft_mode).
DRAFT_MODES = ("serial", "async")


class ContextLengthExceeded(ValueError):
    """The prompt (or the prompt plus max_tokens) does not fit in the model's context."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizing and behaviour.

    Attributes:
        max_running: KV slots: requests decoded concurrently (the batch size cap).
        max_model_len: tokens per slot: prompt + output + one draft tree.
        max_waiting: queued requests beyond which add_request refuses (back-pressure).
        prefill_chunk: prompt tokens written per step across prefilling requests.
        speculate: draft and verify (False: plain decoding, same engine).
        budget: fixed draft budget; None lets the planner choose per step
            (planner.py), which falls back to no speculation where it would not pay.
        dtype / device / threads: how the model runs.
        reprofile: measure the planner's forward-time profile again instead of using the cached one.
        datastore_residency: how the datastores' pages are kept in memory (sssd.datastore.RESIDENCY):
            "warm" (read in at start, the default), "lock" (also pinned: never reclaimed) or "lazy".
        draft_mode: "serial" drafts each step before its forward pass; "async" grows the next
            step's trees on a drafting thread while the target verifies (serving.async_draft),
            where measured to pay (else those steps run serially).
        draft_threads: torch threads of the async drafting thread (a draft model's passes);
            None: as many as the verifier's.
    """

    max_running: int = 32
    max_model_len: int = 2048
    max_waiting: int = 1024
    prefill_chunk: int = 512
    speculate: bool = True
    budget: int | None = None
    dtype: str = "float32"
    device: str | None = None
    threads: int | None = None
    reprofile: bool = False
    datastore_residency: str = "warm"
    pipeline_stages: int = 1
    draft_mode: str = "serial"
    draft_threads: int | None = None

    def __post_init__(self):
        from sssd.datastore import RESIDENCY

        if self.datastore_residency not in RESIDENCY:
            raise ValueError(f"datastore_residency must be one of {', '.join(RESIDENCY)}, "
                             f"got {self.datastore_residency!r}")
        if isinstance(self.pipeline_stages, bool) or not isinstance(self.pipeline_stages, int) \
                or self.pipeline_stages < 1:
            raise ValueError(f"pipeline_stages must be an int >= 1, got {self.pipeline_stages!r}")
        if self.pipeline_stages > 1 and self.draft_mode != "serial":
            raise ValueError(f"draft_mode {self.draft_mode!r} does not apply with pipeline stages: their decode loop "
                             f"(SpecPipe, serving/specpipe.py) drafts serially")
        for name in ("max_running", "max_model_len", "max_waiting", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {', '.join(DRAFT_MODES)}, got {self.draft_mode!r}")
        if self.draft_threads is not None and self.draft_threads < 1:
            raise ValueError(f"draft_threads must be >= 1, got {self.draft_threads}")
        if self.device is not None:  # before any model is pulled or loaded: what this machine has instead
            from sssd.serving.devices import resolve

            resolve(self.device)
        if self.budget is not None and not 0 <= self.budget <= int(sssd._core.MAX_BUDGET):
            raise ValueError(f"budget must be in [0, {int(sssd._core.MAX_BUDGET)}], got {self.budget}")


@dataclass
class RequestOutput:
    """A request's state after a step (what is new since the last output, and all so far)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    stats: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # the reason, when finish_reason is "error"


@dataclass
class StepPlan:
    """A decode step prepared on the CPU, ready to launch."""

    requests: list[Request]
    budget: int              # the planner's budget for this batch size
    budgets: np.ndarray      # [B] per request (0: not drafting)
    batch: TreeBatch
    greedy: np.ndarray       # [B] bool
    started: float           # perf_counter at prepare's start
    draft_seconds: float
    launched: float = 0.0    # perf_counter when the forward pass started
    trials: list | None = None  # [B] per row: packed node -> randomly drawn candidates' trials (acceptance.mss_trials)
    mode: str = "serial"     # how this step drafts the next one (async: a tree grows beside its forward pass)
    grown: bool = False      # the drafting thread grows the next step's trees beside this step's forward pass
    times: dict = field(default_factory=dict)  # perf_counter marks for the timeline (EngineMetrics.timeline)


def _log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


class LLMEngine:
    """Continuous-batching engine over one target model.

    Args:
        model: a local model folder (or a name from `sssd models list`).
        datastore: retrieval's datastore: a Datastore, a directory, "default", or None
            (the request's own tokens only); or a list of them: the first is retrieval's,
            each further one drafts as a source of its own (sssd.datastore_source), and
            every one is checked against the model's tokenizer and vocabulary.
        drafter: a DrafterConfig, or a path to a config / `sssd calibrate` file; None: the
            packaged calibration where its fingerprint matches the datastore and model
            (sssd.paths.packaged_calibration), else the built-in defaults (DrafterConfig()).
        config: EngineConfig.
        draft: the draft sources (sssd.sources): spec strings ("retrieval", ...) and
            DraftSource objects; [] decodes plainly with the same engine.
        backend: a VerifierBackend to verify with (default: a TorchBackend of `model`).
    """

    def __init__(self, model: str | Path, datastore: Any = "default", drafter: Any = None,
                 config: EngineConfig | None = None, draft: Sequence[str | DraftSource] | str | None = DEFAULT_DRAFT,
                 backend: VerifierBackend | None = None):
        from transformers import AutoTokenizer

        self.config = config or EngineConfig()
        path = _resolve_model(model)
        if backend is None:
            from transformers import AutoConfig

            positions = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "max_position_embeddings", None)
            capacity = min(self.config.max_model_len, int(positions)) if positions else self.config.max_model_len
            if self.config.pipeline_stages > 1:  # the layers split over processes (pipeline_backend.py)
                from sssd.serving.pipeline_backend import PipelineBackend

                backend = PipelineBackend(path, self.config.pipeline_stages, slots=self.config.max_running,
                                          capacity=capacity, dtype=self.config.dtype, device=self.config.device,
                                          threads=self.config.threads or 1)
            else:
                from sssd.serving.torch_backend import TorchBackend

                backend = TorchBackend(path, slots=self.config.max_running, capacity=capacity,
                                       dtype=self.config.dtype, device=self.config.device,
                                       threads=self.config.threads, log=_log)
        self.backend = backend
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        info = backend.info
        self.eos_ids = set(info.eos_token_ids) or ({self.tokenizer.eos_token_id} - {None})
        self.max_model_len = min(self.config.max_model_len, info.max_positions, backend.capacity)
        self.drafter_source = str(drafter) if isinstance(drafter, (str, Path)) else None
        #: a DrafterConfig, or a CalibrationFile whose entry for each step's budget drafts that step
        self.drafter_configs = _drafter_config(drafter)
        self.drafter_config = _default_config(self.drafter_configs)
        self.drafting: DraftPipeline | None = None
        self.model_path = path
        datastores = list(datastore) if isinstance(datastore, (list, tuple)) else [datastore]
        sources = self._sources(draft if self.config.speculate else [], datastores[0] if datastores else None, path)
        if sources:
            eos = min(self.eos_ids) if self.eos_ids else None
            self.drafting = DraftPipeline(sources, _with_end_token(self.drafter_configs, eos),
                                          vocab_size=info.vocab_size)
            ds = self.drafting.datastore
            if ds is not None:
                _check_datastore(ds, path, info.vocab_size)
            if drafter is None:  # the packaged calibration where it fits this datastore and model
                checked = _packaged(ds, path) or self.drafter_configs
                if checked is not self.drafter_configs:
                    self.drafter_source = checked.where
            else:
                checked = _checked(self.drafter_configs, ds, path)
            if checked is not self.drafter_configs:  # packaged, or calibrated for another setup (warned): the defaults
                self.drafter_configs = self.drafter_config = checked
                sources = [RetrievalSource(ds, checked, **s.overrides) if isinstance(s, RetrievalSource) else s
                           for s in sources]
                self.drafting = DraftPipeline(sources, _with_end_token(checked, eos), vocab_size=info.vocab_size)
            if ds is not None:  # fault the mmap in now: cold pages cost milliseconds per draft
                ds.make_resident(self.config.datastore_residency)
            from sssd.datastore_source import add_datastore

            for extra in datastores[1:]:
                add_datastore(self.drafting, self.check_datastore(extra), default_name=extra)
        #: async drafting (serving.async_draft): the drafting thread and the measured choice of mode
        self.async_drafter = self.mode_chooser = None
        if self.config.draft_mode == "async" and self.drafting is not None:
            from sssd.serving.async_draft import AsyncDrafter, ModeChooser

            self.async_drafter = AsyncDrafter(self.drafting, threads=self.config.draft_threads)
            self.mode_chooser = ModeChooser()
        from sssd.serving.planner import BudgetPlanner

        self.planner = BudgetPlanner.create(self.config, speculate=self.drafting is not None,
                                            calibration=self.drafter_configs, profile=self._profile,
                                            draft_cost=self._draft_cost())
        self.waiting: deque[Request] = deque()
        self.slots: list[Request] = []   # slots[:num_decode] decode, the rest prefill
        self.num_decode = 0
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._generator = torch.Generator(device="cpu")
        self._generator.seed()
        self.step_count = 0
        self.metrics = EngineMetrics()
        self.pipeline = None  # with pipeline stages, decode steps run SpecPipe's schedule (specpipe.py)
        if self.config.pipeline_stages > 1:
            from sssd.serving.specpipe import SpecPipe

            self.pipeline = SpecPipe(self)

    def _profile(self):
        return self.backend.profile(log=_log, force=self.config.reprofile)

    def _draft_cost(self):
        """What the draft sources' own forward passes add to a step, for the planner (None: nothing):
        the sum of their `draft_seconds(batch, target profile, target parameters)`."""
        costly = [s for s in (self.drafting.external if self.drafting is not None else [])
                  if callable(getattr(s, "draft_seconds", None))]
        if not costly:
            return None
        params = self.backend.info.shape.get("params")
        return lambda batch, profile: sum(s.draft_seconds(batch, profile, params) for s in costly)

    def check_datastore(self, datastore: Any) -> sssd.Datastore:
        """Opens a datastore (a Datastore, directory, archive or "default"), checks that it speaks the
        model's tokens and makes its pages resident (EngineConfig.datastore_residency), for a draft
        source of its own (sssd.datastore_source).
        Reads no engine state that a step changes: it may run beside one (the admin endpoint does).

        Raises:
            FileNotFoundError, ValueError (sssd.DatastoreError): missing, corrupt, or built with another
                tokenizer or vocabulary; the message names the datastore.
        """
        from sssd.drafter import resolve_datastore

        ds = resolve_datastore(datastore)
        if ds is None:
            raise ValueError("no datastore given")
        _check_datastore(ds, self.model_path, self.backend.info.vocab_size)
        ds.make_resident(self.config.datastore_residency)
        return ds

    def _sources(self, draft, datastore: Any, model_path: Path) -> list:
        out = []
        for spec in parse_specs(draft):
            if isinstance(spec, tuple):
                kind, arg = spec
                if kind == "retrieval":
                    out.append(RetrievalSource(datastore, self.drafter_config))
                    continue
                if kind == "recycle":
                    from sssd.token_recycling import DEFAULT_K, TokenRecycling

                    out.append(TokenRecycling(int(arg) if arg else DEFAULT_K, vocab_size=self.backend.info.vocab_size))
                    continue
                if kind == "recent":
                    from sssd.recent_outputs import RecentOutputs

                    out.append(RecentOutputs())
                    continue
                if kind == "model":
                    from sssd.serving.model_drafter import ModelDrafter

                    out.append(ModelDrafter(arg, target=model_path, target_tokenizer=self.tokenizer,
                                            slots=self.config.max_running, capacity=self.max_model_len,
                                            dtype=self.config.dtype, device=self.config.device,
                                            threads=self.config.threads))
                    continue
                if kind == "self":
                    from sssd.serving.self_drafter import SelfDrafter

                    out.append(SelfDrafter.for_engine(self, arg))
                    continue
                raise ValueError(f"the draft source '{kind}:{arg}' is not available in this version of sssd "
                                 f"(available: retrieval, model:<name or folder>, recycle, recent, or your own "
                                 f"sssd.DraftSource)")
            out.append(spec)
        return out

    # -- requests ------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int] | Sequence[dict], params: SamplingParams | None = None,
                    request_id: int | None = None, *, clip_max_tokens: bool = True) -> int:
        """Queues a request: a text, token ids, or chat messages (chat template applied).

        Args:
            clip_max_tokens: lower max_tokens to what fits beside the prompt (else refuse it).

        Raises:
            ValueError: empty or oversize prompt, unknown token ids, bad parameters or request id.
            OverflowError: the waiting queue is full (retry later).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is not None and (isinstance(request_id, bool) or not isinstance(request_id, (int, np.integer))
                                       or not 0 <= int(request_id) <= MAX_REQUEST_ID):
            raise ValueError(f"request_id must be an int in [0, 2^63), got {request_id!r}")
        if len(self.waiting) >= self.config.max_waiting:
            raise OverflowError(f"the queue is full ({self.config.max_waiting} waiting requests)")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.backend.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary ({vocab})")
        room = self.max_model_len - len(ids) - self._max_tree()
        if room < 1:
            raise ContextLengthExceeded(f"the prompt has {len(ids)} tokens; this engine serves at most "
                                        f"{self.max_prompt_tokens} (max_model_len {self.max_model_len})")
        if params.max_tokens > room:
            if not clip_max_tokens:
                raise ContextLengthExceeded(
                    f"max_tokens {params.max_tokens} does not fit: the prompt has {len(ids)} tokens and this engine "
                    f"serves at most {self.max_model_len - self._max_tree()} in all (max_model_len "
                    f"{self.max_model_len}); ask for at most {room}")
            params = _replace(params, max_tokens=room)
        rid = self._new_id() if request_id is None else int(request_id)
        if rid in self.requests:
            raise ValueError(f"request id {rid} is already in use")
        req = Request(rid, list(ids), params, time.monotonic())
        if params.seed is not None:
            req.generator = torch.Generator(device="cpu").manual_seed(params.seed % 2**64)
        req.detok = Detokenizer(self.tokenizer, params.stop)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def _new_id(self) -> int:
        rid = next(self._ids)
        while rid in self.requests:  # skip ids a caller chose explicitly
            rid = next(self._ids)
        return rid

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt this engine serves (room left for one output token and a draft tree)."""
        return self.max_model_len - self._max_tree() - 1

    def encode(self, prompt: str | Sequence[int] | Sequence[dict]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.max_prompt_tokens)

    def abort(self, request_id: int, reason: str = "abort", error: str | None = None) -> bool:
        """Cancels a request and frees its slot; False if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, reason, error=error)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.slots)

    @property
    def num_running(self) -> int:
        return len(self.slots)

    # -- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: admit, prefill a chunk, decode one speculative step."""
        self._admit()
        if self.num_decode < len(self.slots):
            self._prefill()
        if self.num_decode and self.pipeline is not None:
            self.pipeline.decode()
        elif self.num_decode:
            plan = self.prepare()
            self.grow(plan)
            self.finish(plan, self.launch(plan))
        self.step_count += 1
        return self.collect_outputs()

    def collect_outputs(self) -> list[RequestOutput]:
        """Outputs of the requests with news (tokens, or finished); finished ones are then forgotten."""
        outputs = []
        for r in [r for r in self.requests.values() if r.new_token_count or r.finished]:
            try:
                outputs.append(self._output(r))
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that cannot decode this output
                log.exception("request %s: its output could not be built", r.id)
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                outputs.append(RequestOutput(r.id, list(r.prompt_ids), r.output_ids, r.sent_text, True, "error",
                                             stats=r.stats.as_dict(), error=r.error))
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs prompts to completion (offline batch); outputs in prompt order."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        pending = list(zip(prompts, params))[::-1]
        ids: list[int] = []
        done: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(pending), desc="generating", unit="req")
        mine: set[int] = set()
        while pending or len(done) < len(ids):
            # feed the queue as it drains, so any number of prompts fits max_waiting
            while pending and len(self.waiting) < self.config.max_waiting:
                ids.append(self.add_request(*pending.pop()))
                mine.add(ids[-1])
            for out in self.step():
                if out.finished and out.request_id in mine:  # other callers' requests may run beside these
                    done[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[i] for i in ids]

    # -- slots -----------------------------------------------------------------------
    def _max_tree(self) -> int:
        return 1 + (self.planner.max_budget if self.drafting is not None else 0)

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        ra, rb = self.slots[a], self.slots[b]
        self.backend.swap(a, b, max(ra.cached, rb.cached))
        self.slots[a], self.slots[b] = rb, ra
        ra.slot, rb.slot = b, a

    def _admit(self) -> None:
        while self.waiting and len(self.slots) < self.config.max_running:
            req = self.waiting.popleft()
            if req.finished:
                continue
            req.slot = len(self.slots)
            req.status = Status.PREFILL
            self.slots.append(req)
            if self.drafting is not None:
                self._open_draft(req)
            if req.prompt_len == 1:
                self._promote(req)

    def _open_draft(self, req: Request) -> None:
        """(Re)opens the request's drafter state from its tokens; on failure it decodes without drafts."""
        try:
            self._drafting_call(self._reopen, req.id, req.history())  # async: queued while the thread drafts
            req.draft = True
        except Exception as e:  # noqa: BLE001 - drafting is an optimisation: never fail the request over it
            log.warning("request %s: drafting disabled (%s)", req.id, e)
            req.draft = False

    def _reopen(self, request_id: int, history: np.ndarray) -> None:
        if request_id in self.drafting:
            self.drafting.close(request_id)
        self.drafting.open(request_id, history)

    def _drafting_call(self, fn, *args) -> None:
        """Calls a pipeline method now, or (async drafting) once the drafting thread lets go of it."""
        if self.async_drafter is not None:
            self.async_drafter.mutate(fn, *args)
        else:
            fn(*args)

    def _promote(self, req: Request) -> None:
        self._swap(req.slot, self.num_decode)
        self.num_decode += 1
        req.status = Status.DECODE

    def _close_draft(self, request_id: int) -> None:
        self.drafting.close(request_id)
        if self.async_drafter is not None:
            self.async_drafter.prepared.pop(request_id, None)

    def _retire(self, req: Request) -> None:
        s = req.slot
        if s < 0:
            return
        if s < self.num_decode:
            self._swap(s, self.num_decode - 1)
            self.num_decode -= 1
            s = self.num_decode
        self._swap(s, len(self.slots) - 1)
        self.slots.pop()
        req.slot = -1

    def _finish(self, req: Request, reason: str, retire: bool = True, error: str | None = None) -> None:
        """Marks a request finished; frees its slot now, or later if `retire` is False
        (during a decode step, slots must not move before every row is processed)."""
        if req.finished:
            return
        req.error = error
        if req in self.waiting:
            self.waiting.remove(req)
        if retire:
            self._retire(req)
        if self.drafting is not None:
            try:
                self._drafting_call(self._close_draft, req.id)
            except Exception as e:  # noqa: BLE001
                log.warning("request %s: closing its drafter state failed (%s)", req.id, e)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self.metrics.finished(req)

    # -- prefill -----------------------------------------------------------------------
    def _prefill(self) -> None:
        budget = self.config.prefill_chunk
        rows, chunks, cached = [], [], []
        for req in self.slots[self.num_decode:]:
            if budget <= 0:
                break
            todo = req.prompt_len - 1 - req.cached  # the last prompt token is the first tree root
            n = min(todo, budget)
            rows.append(req)
            chunks.append(np.asarray(req.prompt_ids[req.cached : req.cached + n], dtype=np.int64))
            cached.append(req.cached)
            budget -= n
        if not rows:
            return
        t0 = time.perf_counter()
        batch = pack_chain(np.asarray(cached), chunks)
        self.backend.prefill(slice(self.num_decode, self.num_decode + len(rows)), batch)
        self.metrics.prefill(int(batch.sizes.sum()), time.perf_counter() - t0)
        for req, chunk in zip(rows, chunks):
            req.cached += len(chunk)
            if req.cached == req.prompt_len - 1:
                self._promote(req)

    # -- decode: prepare, launch, finish ----------------------------------------------------
    def prepare(self) -> StepPlan:
        """Chooses the budget, drafts every decoding request's tree, packs them (CPU only)."""
        reqs = self.slots[: self.num_decode]
        B = len(reqs)
        t0 = time.perf_counter()
        budget = self.planner.budget(B) if self.drafting is not None else 0
        budgets = np.fromiter((budget if r.params.speculate and r.draft else 0 for r in reqs), dtype=np.int32, count=B)
        if not budgets.any():
            budget = 0  # nobody drafts: the step is plain decoding (for the planner and the metrics too)
        mode = self.mode_chooser.mode(B) if self.mode_chooser is not None and budget else "serial"
        if budget and self.drafting.defers:  # whether a draft model drafts beside retrieval: measured
            self.drafting.deferral.begin_step(B, mode)
        if not budget:
            drafts, use, proposals = None, None, None
        elif self.async_drafter is not None:
            drafts, use, proposals = self._draft_async(reqs, budgets)
        else:
            drafts, use, proposals = self._draft(reqs, budgets)
        greedy = np.fromiter((r.params.greedy for r in reqs), dtype=bool, count=B)
        trials = None
        if proposals is not None and any(c.dists is not None for cands in proposals for _, c in cands):
            trials = [None] * B
            sampled = np.flatnonzero(~greedy)
            for b, t in zip(sampled.tolist(), mss_trials(drafts, proposals, sampled, use)):
                trials[b] = t
        t_draft = time.perf_counter() - t0
        batch = pack(np.fromiter((r.tokens[-1] for r in reqs), dtype=np.int64, count=B),
                     np.fromiter((r.cached for r in reqs), dtype=np.int64, count=B), drafts, use)
        plan = StepPlan(reqs, budget, budgets, batch, greedy, t0, t_draft, trials=trials, mode=mode)
        plan.times["prepared"] = time.perf_counter()
        return plan

    def grow(self, plan: StepPlan) -> None:
        """Async drafting: hands the drafting thread this step's roots, to grow the next step's trees
        from while the target verifies (serving.async_draft); nothing in serial mode."""
        a = self.async_drafter
        if a is None or plan.mode != "async" or not plan.budget or a.dead is not None:
            return
        from sssd.serving.async_draft import GROW

        grow = min(GROW * plan.budget, int(sssd._core.MAX_BUDGET))  # drafter-side only: the step packs <= budget
        reqs = [r for r, b in zip(plan.requests, plan.budgets) if b > 0]
        asks = [DraftRequest(r.id, r.history(), grow, 0.0 if r.params.greedy else r.params.temperature,
                             r.params.top_k, r.params.top_p) for r in reqs]
        plan.grown = a.submit(self.step_count, asks, {r.id: len(r.tokens) for r in reqs})

    def _draft_async(self, reqs: list[Request], budgets: np.ndarray) -> tuple[Any, np.ndarray | None, list | None]:
        """This step's trees under async drafting: each request's tree grown during the last step,
        re-rooted on its outcome, where it holds one, joined with retrieval's fresh tree (one
        cheap C++ call: a re-rooted tree is shallower than a fresh one) and cut to the budget;
        the others drafted now (serially), unless the drafting thread still holds the pipeline
        (stalled): then they go without."""
        from sssd.serving.async_draft import best, combine, row_of, union

        a = self.async_drafter
        B = len(reqs)
        rows: list = [None] * B
        need = np.zeros(B, dtype=bool)
        for b, r in enumerate(reqs):
            if budgets[b] > 0:
                rows[b] = a.take(r.id, len(r.tokens))
                need[b] = rows[b] is None
        hits = np.flatnonzero((budgets > 0) & ~need).tolist()
        if hits and self.drafting.retrieval and a.idle():
            try:
                fresh = self.drafting.draft_retrieval(
                    [DraftRequest(reqs[b].id, reqs[b].history(), int(budgets[b])) for b in hits])
            except Exception as e:  # noqa: BLE001 - the re-rooted trees alone are still good drafts
                log.warning("retrieval failed to top up the re-rooted trees (%s); using them alone", e)
                fresh = None
            if fresh is not None:
                for k, b in enumerate(hits):
                    rows[b] = union(rows[b], row_of(fresh, k))
        for b in hits:
            rows[b] = best(rows[b], int(budgets[b]))
        proposals: list = [[] for _ in reqs]
        if need.any() and a.idle():
            drafts, use, props = self._draft(reqs, np.where(need, budgets, 0).astype(np.int32))
            if drafts is not None:
                for b in np.flatnonzero(need & use):
                    rows[b], proposals[b] = row_of(drafts, b), props[b]
        elif need.any():
            log.debug("the drafting thread is busy: %d requests decode without drafts this step", int(need.sum()))
        drafts = combine(rows)
        return drafts, (budgets > 0) & self._in_vocab(reqs, drafts), proposals

    def launch(self, plan: StepPlan) -> Any:
        """Starts the forward pass over the plan's trees."""
        plan.launched = plan.times["launched"] = time.perf_counter()
        topk = self.drafting.observe_topk if self.drafting is not None else 0
        if topk:  # a source observes the target's top-k next tokens (asked for only then)
            return self.backend.launch(slice(0, len(plan.requests)), plan.batch, plan.greedy, topk=topk)
        return self.backend.launch(slice(0, len(plan.requests)), plan.batch, plan.greedy)

    def finish(self, plan: StepPlan, handle: Any) -> None:
        """Accepts, compacts the KV cache, emits tokens and updates the drafters.

        Shared work (the forward pass) failing fails the step; a failure that belongs
        to one request (its sampling, its stop check, its output) finishes that request
        with an error and the others go on.
        """
        out = self.backend.collect(handle)
        t_forward = time.perf_counter() - plan.launched
        plan.times["forward"] = time.perf_counter()
        reqs, batch = plan.requests, plan.batch
        B = len(reqs)
        node = np.zeros(B, dtype=np.int64)
        count = np.zeros(B, dtype=np.int64)
        bonus = np.zeros(B, dtype=np.int64)
        errors: dict[int, str] = {}
        g = np.flatnonzero(plan.greedy)
        if g.size:
            acc = accept_greedy(batch, out.argmax, g)
            node[g], count[g], bonus[g] = acc.node, acc.count, acc.bonus
        s = np.flatnonzero(~plan.greedy)
        if s.size:
            samplers = [Sampler(reqs[b].params.temperature, reqs[b].params.top_k, reqs[b].params.top_p,
                                reqs[b].generator) for b in s]
            logits, index = out.logits, out.logit_index
            acc, errs = accept_sampled(batch, s, samplers,
                                       lambda rows, idx: logits[torch.from_numpy(index[rows, idx])], self._generator,
                                       None if plan.trials is None else [plan.trials[b] for b in s])
            node[s], count[s], bonus[s] = acc.node, acc.count, acc.bonus
            errors.update({int(s[j]): e for j, e in enumerate(errs) if e})
        plan.times["accepted"] = time.perf_counter()
        # async: the drafting thread must let go of the pipeline before requests stop or extend
        job = self.async_drafter.wait() if plan.grown else None
        plan.times["waited"] = time.perf_counter()
        # every accepted path's K/V down to consecutive positions, in one move
        path = batch.ancestors[np.arange(B), node]
        path[:, 0] = False
        for b in errors:
            path[b] = False
        pb, pi = np.nonzero(path)
        rank = (np.cumsum(path, axis=1) - 1)[pb, pi]
        src, dst = batch.cached[pb] + pi, batch.cached[pb] + 1 + rank
        moved = src != dst
        if moved.any():
            self.backend.compact(pb[moved], src[moved], dst[moved])
            self.metrics.kv_moves += int(np.unique(pb[moved]).size)
        path_tokens = np.split(batch.tokens[pb, pi], np.cumsum(np.bincount(pb, minlength=B))[:-1])
        path_sources = np.split(batch.sources[pb, pi], np.cumsum(np.bincount(pb, minlength=B))[:-1])
        names = self.drafting.source_names if self.drafting is not None else {}
        emitted: dict[int, list[int]] = {}
        verified: dict[int, tuple[list[int], int | None]] = {}  # greedy rows: the target's tokens (sssd.deferral)
        accepted = []
        for b, req in enumerate(reqs):
            if b in errors:
                self._finish(req, "error", retire=False, error=errors[b])
                accepted.append(0)
                continue
            try:
                a = int(count[b])
                req.cached += 1 + a
                st = req.stats
                st.steps += 1
                st.drafted += int(batch.sizes[b]) - 1
                st.accepted += a
                st.accepted_per_step.append(a)
                st.budgets.append(int(plan.budgets[b]))
                for src_tag in path_sources[b].tolist():
                    if src_tag != NO_SOURCE:
                        name = names.get(src_tag, "external")
                        st.accepted_by_source[name] = st.accepted_by_source.get(name, 0) + 1
                        self.metrics.accepted_by_source[name] = self.metrics.accepted_by_source.get(name, 0) + 1
                toks = path_tokens[b].tolist() + [int(bonus[b])]
                emitted[req.id] = self._emit(req, toks)
                if plan.greedy[b]:
                    verified[req.id] = (toks, len(emitted[req.id]) if req.finished else None)
                accepted.append(a)
            except Exception as e:  # noqa: BLE001 - this request's failure is this request's alone
                log.exception("request %s failed in its decode step", req.id)
                self._finish(req, "error", retire=False, error=f"{type(e).__name__}: {e}")
                accepted.append(0)
        for req in reqs:  # slots move only now that every row is done
            if req.finished:
                self._retire(req)
        n_emitted = sum(len(v) for v in emitted.values())
        self.metrics.decode_step(B, int(batch.sizes.sum()), plan.budget, plan.draft_seconds, t_forward, n_emitted,
                                 accepted)
        if self.drafting is not None and out.topk is not None:
            self._drafting_call(self._observe, reqs, batch, out.topk, errors)
        if self.drafting is not None:
            live = [(rid, toks) for rid, toks in emitted.items()
                    if toks and not self.requests[rid].finished and self.requests[rid].draft]
            if self.async_drafter is not None:  # the next step's trees: the grown ones, re-rooted
                if job is not None:
                    self.async_drafter.reroot_all(job, dict(live))
                else:
                    self.async_drafter.prepared.clear()
            if live:
                self._drafting_call(self._extend, live)
        seconds = time.perf_counter() - plan.started
        self.planner.observe(B, plan.budget, seconds, n_emitted)
        if self.drafting is not None and plan.budget:  # what the deferral of costly sources measures
            self.drafting.deferral.observe_step(B, t_forward, {r.id: a for r, a in zip(reqs, accepted)},
                                                seconds, n_emitted, verified)
        if self.mode_chooser is not None and plan.budget:
            self.mode_chooser.observe(B, plan.mode, seconds, n_emitted)
        if self.metrics.timeline is not None:
            self.metrics.timeline.append(_timeline_entry(plan, job, n_emitted, sum(accepted), time.perf_counter()))

    def _extend(self, live: list[tuple[int, list[int]]]) -> None:
        try:
            self.drafting.extend_batch([rid for rid, _ in live], [toks for _, toks in live])
        except Exception as e:  # noqa: BLE001 - rebuild each state from the request's own tokens
            log.warning("drafter update failed (%s); reopening the requests' drafter states", e)
            for rid, _ in live:
                self._open_draft(self.requests[rid])

    def _observe(self, reqs: list[Request], batch: TreeBatch, topk: np.ndarray, errors: dict[int, str]) -> None:
        """Shows the observing draft sources every node verified this step (rows that failed aside)."""
        seen = batch.valid & (topk[:, :, 0] >= 0)
        for b in errors:
            seen[b] = False
        b, i = np.nonzero(seen)
        if b.size:
            ids = np.fromiter((r.id for r in reqs), dtype=np.int64, count=len(reqs))
            self.drafting.observe_verified(ids[b], batch.tokens[b, i], topk[b, i])

    def _draft(self, reqs: list[Request], budgets: np.ndarray) -> tuple[Any, np.ndarray | None, list | None]:
        """The merged drafts of the batch, which rows may use theirs, and every source's
        proposals per row. A drafting failure, or a tree holding ids the model does not know,
        costs only drafts: those rows decode plainly this step."""
        try:
            drafts, proposals = self.drafting.draft_with_proposals(
                [DraftRequest(r.id, r.history(), int(b), 0.0 if r.params.greedy else r.params.temperature,
                              r.params.top_k, r.params.top_p) for r, b in zip(reqs, budgets)])
        except Exception as e:  # noqa: BLE001
            log.warning("drafting failed for this step (%s); decoding without drafts", e)
            return None, None, None
        return drafts, (budgets > 0) & self._in_vocab(reqs, drafts), proposals

    def _in_vocab(self, reqs: list[Request], drafts: Any) -> np.ndarray:
        """[B] rows whose tree holds only ids the model knows (the others are logged)."""
        use = np.ones(len(reqs), dtype=bool)
        if drafts.tokens.size:
            sizes = np.diff(drafts.offsets)
            nonempty = sizes > 0
            top = np.zeros(len(reqs), dtype=np.int64)
            top[nonempty] = np.maximum.reduceat(drafts.tokens, drafts.offsets[:-1][nonempty])
            bad = top >= self.backend.info.vocab_size
            if bad.any():
                for b in np.flatnonzero(bad):
                    log.warning("request %s: the draft holds token id %d outside the model's vocabulary (%d); "
                                "dropped", reqs[b].id, int(top[b]), self.backend.info.vocab_size)
                use &= ~bad
        return use

    def _emit(self, req: Request, new: list[int]) -> list[int]:
        """Appends tokens one by one, honouring stop conditions; returns those kept."""
        kept = []
        p = req.params
        for tok in new:
            req.append(tok)
            kept.append(tok)
            req.new_token_count += 1
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(req, "stop", retire=False)
                break
            if req.detok.add(tok):
                self._finish(req, "stop", retire=False)
                break
            if len(req.tokens) - req.prompt_len >= p.max_tokens:
                self._finish(req, "length", retire=False)
                break
        return kept

    # -- outputs ---------------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput:
        ids = req.output_ids
        new_ids = ids[len(ids) - req.new_token_count :] if req.new_token_count else []
        req.text = req.detok.finish() if req.finished else req.detok.text
        new_text = _stream_delta(req)
        req.new_token_count = 0
        metrics = {"arrival": req.arrival, "first_token": req.first_token_time, "finish": req.finish_time}
        return RequestOutput(req.id, list(req.prompt_ids), list(ids), req.text, req.finished, req.finish_reason,
                             new_ids, new_text, req.stats.as_dict(), metrics, req.error)


def _stream_delta(req: Request) -> str:
    """The text to stream since the last output. While the request runs, a trailing U+FFFD is
    held back: it is an incomplete UTF-8 sequence (a multi-byte character split across byte
    tokens) that the next token completes. Should a tokenizer still rewrite text already sent,
    only what follows the common prefix is sent (a client cannot take text back)."""
    stable = req.text if req.finished else req.text.rstrip("\ufffd")
    sent = req.sent_text
    if stable.startswith(sent):
        delta = stable[len(sent):]
    else:
        common = len(os.path.commonprefix([sent, stable]))
        delta = stable[common:]
    req.sent_text = stable
    return delta


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int] | Sequence[dict], limit: int | None = None) -> list[int]:
    """Token ids of a prompt: a text, token ids, or chat messages (the chat template applied).

    A text (or conversation) far longer than `limit` tokens could be is refused after
    tokenizing a prefix only: its prefix's token count (less a margin for the last word)
    is a lower bound on the whole text's. Megabytes are thus refused in milliseconds.

    Raises:
        ValueError: a malformed prompt, or one certainly longer than `limit` tokens.
    """
    if isinstance(prompt, str):
        if not prompt:
            return []
        if limit is not None:
            _probe(limit, [len(prompt)], lambda cut: tokenizer.encode(prompt[:cut], add_special_tokens=False))
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, (bytes, dict)):
        raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")
    prompt = list(prompt)
    if prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), str):
                raise ValueError("a chat message is {'role': str, 'content': str}")

        def chat(cut: int | None = None) -> list[int]:
            msgs = [dict(m, content=m.get("content", "")[:cut]) if cut else m for m in prompt]
            out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

        if limit is not None:
            _probe(limit, [len(m.get("content", "")) for m in prompt], chat)
        return chat()
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
        raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")
    return [int(t) for t in prompt]


def _probe(limit: int, lengths: list[int], encode_prefix) -> None:
    """Refuses a prompt whose pieces (the text, or each message) cut to their first `cut`
    characters already exceed `limit` tokens, less a margin per cut piece for its last word."""
    cut = (limit + 64) * PROBE_CHARS_PER_TOKEN
    cuts = sum(n > cut for n in lengths)
    if cuts:
        margin = 64 * cuts
        n = len(encode_prefix(cut))
        if n > limit + margin:
            raise ContextLengthExceeded(f"the prompt has more than {n - margin} tokens; "
                                        f"this engine serves at most {limit}")


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **changes)


def _resolve_model(model: str | Path) -> Path:
    p = Path(model).expanduser()
    if (p / "config.json").is_file():
        return p
    from sssd.models import resolve_model

    return Path(resolve_model(str(model)))


def _check_datastore(ds: Any, model_path: Path, vocab_size: int) -> None:
    """A datastore must speak the model's tokens: the tokenizer it records, and its largest id."""
    if ds.manifest.get("tokenizer"):
        from sssd.tokenizer import check_compatible

        check_compatible(ds, model_path)
    if int(ds.manifest.get("vocab_size", 0)) > vocab_size:
        raise ValueError(f"the datastore {ds.path} holds token ids up to {int(ds.manifest['vocab_size']) - 1}, "
                         f"beyond the model's vocabulary ({vocab_size} ids): it was built with another "
                         f"tokenizer; rebuild it with the model's (sssd build -t {model_path})")


def _drafter_config(drafter: Any) -> Any:
    """A DrafterConfig, or a CalibrationFile (every budget's entry); ValueError for a malformed file."""
    from sssd.calibration_file import load_drafter

    return load_drafter(drafter)


def _default_config(configs: Any) -> sssd.DrafterConfig:
    """The config of a file's default budget (or the one config)."""
    return configs if isinstance(configs, sssd.DrafterConfig) else configs.config()


def _with_end_token(configs: Any, eos: int | None) -> Any:
    """Every config with the model's end-of-sequence id as its end token, unless it names one."""
    def fix(c: sssd.DrafterConfig) -> sssd.DrafterConfig:
        return c if c.end_token is not None else c.replace(end_token=eos)

    return fix(configs) if isinstance(configs, sssd.DrafterConfig) else configs.map(fix)


def _packaged(datastore: Any, model_path: Path) -> Any:
    """The packaged calibration (a CalibrationFile) if its fingerprint matches the datastore
    and model, else None (why not is logged at INFO)."""
    if datastore is None:
        return None
    from sssd.calibration_file import CalibrationFile
    from sssd.paths import packaged_calibration

    found = packaged_calibration(model_path, datastore)
    return CalibrationFile.load(found) if found is not None else None


def _checked(configs: Any, datastore: Any, model_path: Path) -> Any:
    """A calibration file whose fingerprint matches the datastore, tokenizer and model (or that
    records none: warned, used as is); the uncalibrated defaults, warned, when one differs."""
    from sssd.calibration_file import CalibrationFile

    return configs.checked_or_defaults(datastore, model_path) if isinstance(configs, CalibrationFile) else configs


def _timeline_entry(plan: StepPlan, job: Any, emitted: int, accepted: int, now: float) -> dict:
    """A decode step's phases for the timeline: drafting (prepare), forward, acceptance and the
    rest of finish, the wait for the drafting thread, and that thread's own drafting."""
    t = plan.times
    out = {"batch": len(plan.requests), "budget": plan.budget, "mode": plan.mode, "emitted": emitted,
           "start": plan.started, "prepared": t.get("prepared", plan.started), "launched": t.get("launched"),
           "forward": t.get("forward"), "accepted_at": t.get("accepted"), "waited": t.get("waited"), "end": now,
           "accepted": int(accepted)}
    if job is not None:
        out.update(draft_start=job.started, draft_end=job.ended)
    return out


class EngineMetrics:
    """Counters and timings of the engine (the server exports them)."""

    def __init__(self):
        self.steps = 0
        self.decode_tokens = 0          # tokens emitted by decode steps
        self.prefill_tokens = 0
        self.num_drafts = 0             # requests x steps with a draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: dict[int, int] = {}
        self.draft_time = Histogram()
        self.step_time = Histogram()
        self.accepted_by_source: dict[str, int] = {}
        self.prefill_seconds = 0.0
        self.budgets: dict[int, int] = {}   # budget -> steps that used it
        self.finished_requests = 0
        self.finish_reasons: dict[str, int] = {}
        self.kv_moves = 0               # accepted paths that were not the first branch (moved in the cache)
        self.draft_seconds = 0.0        # totals, for the engine-overhead benchmark
        self.forward_seconds = 0.0
        #: per decode step, its phases' perf_counter marks (None: not recorded; a list records them)
        self.timeline: list[dict] | None = None

    def prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens
        self.prefill_seconds += seconds

    def decode_step(self, batch: int, tokens_in: int, budget: int, t_draft: float, t_forward: float, emitted: int,
                    accepted: Iterable[int]) -> None:
        self.steps += 1
        self.decode_tokens += emitted
        self.budgets[budget] = self.budgets.get(budget, 0) + 1
        if budget:
            self.num_drafts += batch
            self.num_draft_tokens += tokens_in - batch
        for a in accepted:
            self.num_accepted_tokens += a
            for pos in range(a):
                self.accepted_per_pos[pos] = self.accepted_per_pos.get(pos, 0) + 1
        self.draft_time.observe(t_draft)
        self.step_time.observe(t_draft + t_forward)
        self.draft_seconds += t_draft
        self.forward_seconds += t_forward

    def finished(self, req: Request) -> None:
        self.finished_requests += 1
        self.finish_reasons[req.finish_reason] = self.finish_reasons.get(req.finish_reason, 0) + 1
