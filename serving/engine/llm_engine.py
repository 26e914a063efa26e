"""LLMEngine: continuous batching with SSSD tree speculation.

Every call to step() is one iteration of an Orca-style loop:

1. admit waiting requests into free KV slots (scheduler.py);
2. prefill: write the next chunk of prompts into their slots (a bounded number of prompt tokens
   per step, so long prompts never stall decoding), in the decode step's forward pass where the
   backend can (one pass a step), else in a pass of its own;
3. decode one speculative step for every decoding request (step.py: prepare, launch, finish).

The engine knows the target only through its VerifierBackend (backends/base.py): slots, forward
passes, compaction and a cost profile. How it is put together is factory.py; requests, their
emission and outputs are requests.py; prompts are prompts.py; counters are metrics.py.

Decoding modes and draft sources that work on the engine's requests (SpecPipe's pipelined
schedule, self-speculation's view of the KV cache, async drafting) use its public interface only:

    requests (id -> Request), decoding(), emit(req, tokens), finish_request(req, reason, ...),
    retire(req), reopen_draft(req), drafting_call(fn, *args), generator, and the components
    backend, drafting, planner, allocator, metrics, config, max_model_len.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

import sssd
from sssd.serving.backends.base import VerifierBackend
from sssd.serving.engine import factory
from sssd.serving.engine.config import DEFAULT_DRAFT, EngineConfig
from sssd.serving.engine.metrics import EngineMetrics
from sssd.serving.engine.params import SamplingParams
from sssd.serving.engine.prompts import check_prompt_ids, check_request_args, encode_prompt, fit_max_tokens
from sssd.serving.engine.requests import Request, RequestOutput, Status, emit, new_request, output_of
from sssd.serving.engine.scheduler import Scheduler
from sssd.serving.engine.step import DecodeStep
from sssd.sources import DraftSource

log = logging.getLogger("sssd.serving")


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

    def __init__(
        self,
        model: str | Path,
        datastore: Any = "default",
        drafter: Any = None,
        config: EngineConfig | None = None,
        draft: Sequence[str | DraftSource] | str | None = DEFAULT_DRAFT,
        backend: VerifierBackend | None = None,
    ):
        from transformers import AutoTokenizer

        self.config = config or EngineConfig()
        self.model_path = path = factory.resolve_model(model)
        self.backend = backend if backend is not None else factory.build_backend(path, self.config)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        info = self.backend.info
        self.eos_ids = set(info.eos_token_ids) or ({self.tokenizer.eos_token_id} - {None})
        self.max_model_len = min(self.config.max_model_len, info.max_positions, self.backend.capacity)
        self.drafter_source = str(drafter) if isinstance(drafter, (str, Path)) else None
        #: a DrafterConfig, or a CalibrationFile whose entry for each step's budget drafts that step
        self.drafter_configs = factory.drafter_config(drafter)
        self.drafter_config = factory.default_config(self.drafter_configs)
        self.requests: dict[int, Request] = {}
        datastores = list(datastore) if isinstance(datastore, (list, tuple)) else [datastore]
        self.drafting = factory.build_drafting(self, draft, datastores, drafter)
        #: async drafting (serving.drafting.async_draft): the drafting thread and the measured choice of mode
        self.async_drafter, self.mode_chooser = factory.build_async(self.config, self.drafting)
        self.planner = factory.build_planner(self)
        #: the step's verification budget shared across the batch (None: a fixed or per-size budget)
        self.allocator = factory.build_allocator(self)
        factory.follow_fixed_budget(self)
        #: other processes' load on this engine's CPUs, which its threads follow (None: not followed)
        self.contention = factory.build_contention(self)
        #: the linear plan and forward profile, taken between requests (None: nothing to measure)
        self.measurements = factory.build_measurements(self)
        self.scheduler = Scheduler(self.backend, self.config.max_running, self.config.prefill_chunk)
        self._ids = itertools.count()
        #: the random stream of sampled requests that bring no seed of their own
        self.generator = torch.Generator(device="cpu")
        self.generator.seed()
        self.step_count = 0
        self.metrics = EngineMetrics()
        self.decode_step = DecodeStep(self)
        self.pipeline = None  # with pipeline stages, decode steps run SpecPipe's schedule (drafting/specpipe.py)
        if self.config.pipeline_stages > 1:
            from sssd.serving.drafting.specpipe import SpecPipe

            self.pipeline = SpecPipe(self)

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
        factory.check_datastore(ds, self.model_path, self.backend.info.vocab_size)
        ds.make_resident(self.config.datastore_residency)
        return ds

    # -- requests ------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        params: SamplingParams | None = None,
        request_id: int | None = None,
        *,
        clip_max_tokens: bool = True,
    ) -> int:
        """Queues a request: a text, token ids, or chat messages (chat template applied).

        Args:
            clip_max_tokens: lower max_tokens to what fits beside the prompt (else refuse it).

        Raises:
            ValueError: empty or oversize prompt, unknown token ids, bad parameters or request id.
            OverflowError: the waiting queue is full (retry later).
        """
        params = params or SamplingParams()
        check_request_args(params, request_id)
        if len(self.waiting) >= self.config.max_waiting:
            raise OverflowError(f"the queue is full ({self.config.max_waiting} waiting requests)")
        ids = self.encode(prompt)
        check_prompt_ids(ids, self.backend.info.vocab_size)
        params = fit_max_tokens(params, len(ids), self.max_model_len, self._max_tree(), clip_max_tokens)
        rid = self._new_id() if request_id is None else int(request_id)
        if rid in self.requests:
            raise ValueError(f"request id {rid} is already in use")
        req = new_request(rid, ids, params, self.tokenizer)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def _new_id(self) -> int:
        rid = next(self._ids)
        while rid in self.requests:  # skip ids a caller chose explicitly
            rid = next(self._ids)
        return rid

    def _max_tree(self) -> int:
        return 1 + (self.planner.max_budget if self.drafting is not None else 0)

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
        self.finish_request(req, reason, error=error)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def num_running(self) -> int:
        return len(self.scheduler.slots)

    def limit_running(self, n: int | None) -> None:
        """Admits at most `n` requests at once from now on (1 up to `config.max_running`, the slots
        the engine was built with; None: all of them). Requests already running keep their slots;
        benchmarks run one engine at several batch sizes this way. (`config.max_running` sizes the
        KV pool at construction: replacing the config afterwards changes nothing.)"""
        slots = self.config.max_running
        if n is None:
            n = slots
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= slots:
            raise ValueError(f"limit_running takes an int in 1..{slots} (the engine's slots) or None, got {n!r}")
        self.scheduler.max_running = n

    # -- the machine -------------------------------------------------------------------
    def contended(self) -> bool:
        """Whether other processes held one of this engine's cores in the last second."""
        return self.contention is not None and self.contention.contended

    def follow_load(self) -> None:
        """Fits the threads (torch's and batch drafting's) to the cores other processes leave free:
        fewer while a neighbour holds a core (threads that wait for a core stall every barrier),
        back up when it leaves (sssd.cpus.Contention). Cheap: it samples once a second."""
        if self.contention is None:
            return
        changed = self.contention.update()
        n = self.contention.current
        if torch.get_num_threads() != n:  # per thread: the engine may step on another thread than it measures on
            torch.set_num_threads(n)
            if self.drafting is not None:
                self.drafting.drafter.num_threads = n
        if changed is not None:
            log.info(
                "%s: other processes use %.1f of %d cores; running %d thread%s",
                "contention" if n < self.contention.threads else "quiet again",
                self.contention.others,
                self.contention.cores,
                n,
                "s" if n != 1 else "",
            )

    def idle(self, seconds: float = 0.25) -> bool:
        """Work for a moment with no request in flight: follows the load and takes a piece of the
        pending start-up measurements (planning/measurements.py) for about `seconds`. Returns
        whether measurements are still pending (call again soon) — False when there is a request
        in flight, or nothing to measure."""
        self.follow_load()
        if self.measurements is None or self.has_unfinished():
            return False
        if not self.measurements.run(seconds):
            self.measurements = None
            return False
        return True

    # -- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: admit, prefill a chunk, decode one speculative step."""
        self.follow_load()
        self.scheduler.admit(self.open_draft)
        reqs, chunk = self.decoding(), None
        if self.scheduler.prefilling():
            if reqs and self.pipeline is None and self.config.fuse_prefill and self.backend.fuses_prefill:
                chunk = self.scheduler.next_chunk()  # written by the decode step's own pass
            else:
                self.scheduler.prefill(self.metrics)
                reqs = self.decoding()
        if reqs and self.pipeline is not None:
            self.pipeline.decode()
        elif reqs:
            plan = self.decode_step.prepare(reqs, prefill=chunk)
            self.decode_step.grow(plan)
            self.decode_step.finish(plan, self.decode_step.launch(plan))
        self.step_count += 1
        return self.collect_outputs()

    def collect_outputs(self) -> list[RequestOutput]:
        """Outputs of the requests with news (tokens, or finished); finished ones are then forgotten."""
        outputs = []
        for r in [r for r in self.requests.values() if r.new_token_count or r.finished]:
            try:
                outputs.append(output_of(r))
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that cannot decode this output
                log.exception("request %s: its output could not be built", r.id)
                self.finish_request(r, "error", error=f"{type(e).__name__}: {e}")
                outputs.append(
                    RequestOutput(
                        r.id,
                        list(r.prompt_ids),
                        r.output_ids,
                        r.sent_text,
                        True,
                        "error",
                        stats=r.stats.as_dict(),
                        error=r.error,
                    )
                )
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def generate(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
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

    # -- the interface of decoding modes and draft sources (see the module docstring) ------------
    def decoding(self) -> list[Request]:
        """The decoding requests, in slot order (row b of a decode step is slot b)."""
        return self.scheduler.decoding()

    def emit(self, req: Request, tokens: list[int]) -> list[int]:
        """Appends verified tokens to a request, honouring its stop conditions; returns those kept."""
        return emit(req, tokens, self.eos_ids, lambda r, reason: self.finish_request(r, reason, retire=False))

    def finish_request(self, req: Request, reason: str, retire: bool = True, error: str | None = None) -> None:
        """Marks a request finished; frees its slot now, or later (`retire`) if False: during a decode
        step, slots must not move before every row is processed."""
        if req.finished:
            return
        req.error = error
        if req in self.waiting:
            self.waiting.remove(req)
        if retire:
            self.retire(req)
        if self.drafting is not None:
            try:
                self.drafting_call(self._close_draft, req.id)
            except Exception as e:  # noqa: BLE001
                log.warning("request %s: closing its drafter state failed (%s)", req.id, e)
        if self.allocator is not None:
            self.allocator.forget(req.id)
            self.decode_step.request_ended(req.id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self.metrics.finished(req)

    def retire(self, req: Request) -> None:
        """Frees a (finished) request's slot."""
        self.scheduler.retire(req)

    def open_draft(self, req: Request) -> None:
        """(Re)opens the request's drafter state from its tokens; on failure it decodes without drafts."""
        if self.drafting is None:
            return
        self.reopen_draft(req)

    def reopen_draft(self, req: Request) -> None:
        """Opens the request's drafter state afresh from its tokens (after a failed update, say)."""
        try:
            self.drafting_call(self._reopen, req.id, req.history())  # async: queued while the thread drafts
            req.draft = True
        except Exception as e:  # noqa: BLE001 - drafting is an optimisation: never fail the request over it
            log.warning("request %s: drafting disabled (%s)", req.id, e)
            req.draft = False

    def forget_history(self) -> None:
        """Makes the draft sources forget what earlier requests left for later ones (the recent
        outputs), as a fresh engine's: a benchmark that generates the same prompts again calls it
        between runs, or the second run drafts the first one's answers. What the engine measured
        (profiles, acceptance rates) stays.

        Raises:
            RuntimeError: requests are running or waiting.
        """
        if self.has_unfinished():
            raise RuntimeError("forget_history() needs an idle engine: requests are running or waiting")
        if self.drafting is not None:
            self.drafting_call(self.drafting.forget_history)

    def drafting_call(self, fn, *args) -> None:
        """Calls a draft pipeline method now, or (async drafting) once the drafting thread lets go of it."""
        if self.async_drafter is not None:
            self.async_drafter.mutate(fn, *args)
        else:
            fn(*args)

    def _reopen(self, request_id: int, history: np.ndarray) -> None:
        if request_id in self.drafting:
            self.drafting.close(request_id)
        self.drafting.open(request_id, history)

    def _close_draft(self, request_id: int) -> None:
        self.drafting.close(request_id)
        if self.async_drafter is not None:
            self.async_drafter.prepared.pop(request_id, None)
