"""Offline generation in the shape of vLLM's API::

    from sssd import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", datastore="default")
    outputs = llm.generate(["Tell me about the sea."], SamplingParams(max_tokens=64))
    outputs[0].text, outputs[0].token_ids, outputs[0].stats

The same engine serves `sssd serve`. `sssd.LLM` is this class, imported on
first use (``import sssd`` never loads torch).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Sequence

from sssd.serving.engine import DEFAULT_DRAFT, EngineConfig, LLMEngine, RequestOutput
from sssd.serving.engine.params import SamplingParams
from sssd.sources import parse_specs

#: The project's default target model (see `sssd models list`).
DEFAULT_MODEL = "smollm2-135m-instruct"


def _drafts_with_retrieval(draft: Sequence[Any] | str | None) -> bool:
    """Whether the draft list names retrieval (which drafts from the `datastore` argument)."""
    return ("retrieval", "") in parse_specs(draft)


class LLM:
    """A target model with SSSD speculation, for batch generation.

    Args:
        model: a model name from `sssd models list` or a local Hugging Face model folder.
        datastore: a Datastore, a directory, "default" (built on first use where retrieval drafts,
            as `sssd serve` does), or None (draft from the prompt only);
            or a list of them: the first drafts with the input source, each other one as a
            draft source of its own (sssd.datastore_source.DatastoreSource).
        drafter: a DrafterConfig, a CalibrationFile, or a config / `sssd calibrate` parameter
            file (ValueError if malformed; one calibrated for another datastore, tokenizer or
            model is replaced by the built-in defaults, with a warning). Default: the packaged
            calibration when its fingerprint matches the model and datastore, else the defaults.
        draft: the draft sources (sssd.sources): spec strings ("retrieval", ...) and
            sssd.DraftSource objects; [] decodes plainly with the same engine.
        speculate: False is draft=[].
        budget: fixed draft budget; None lets the engine choose per batch size.
        **engine: other EngineConfig fields (max_running, max_model_len, dtype, device, ...).
            ``threads`` (torch's, per stage with pipeline_stages) defaults to torch's own count,
            capped at the cores this process may use (its CPU affinity and cgroup CPU quota:
            sssd.cpus); more than those is cut to them with a warning, 0 or less is a ValueError.
    """

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        datastore: Any = "default",
        drafter: Any = None,
        draft: Sequence[Any] | str | None = DEFAULT_DRAFT,
        speculate: bool = True,
        budget: int | None = None,
        **engine: Any,
    ):
        draft = draft if speculate else []
        if isinstance(datastore, str) and datastore == "default" and _drafts_with_retrieval(draft):
            # as `sssd serve` does: the default datastore is built the first time it is needed
            # (the model is pulled on first use too)
            from sssd.datastore_builder.default import ensure_built

            ensure_built()
        engine = _fit_threads(engine)
        self.engine = LLMEngine(
            model,
            datastore=datastore,
            drafter=drafter,
            draft=draft,
            config=EngineConfig(speculate=speculate, budget=budget, **engine),
        )
        # The start-up measurements the engine does not have yet (the linear plan, the forward
        # profile) are taken on a thread of their own while no generate() runs (a piece at a time:
        # generate waits for at most one piece), and used from the next generate() on.
        self._lock = threading.Lock()
        self._wanted = threading.Event()  # a generate() waits for the engine
        self._stop = threading.Event()
        self._measurer: threading.Thread | None = None
        if self.engine.measurements is not None:
            # The thread holds the LLM weakly: an LLM the caller drops stops measuring and frees
            # its model, instead of living on until its last retry is due.
            self._measurer = threading.Thread(
                target=_measure_between_calls,
                args=(weakref.ref(self), self._lock, self._wanted, self._stop),
                name="sssd-measure",
                daemon=True,
            )
            self._measurer.start()
            me = weakref.ref(self)  # the exit hook does not keep the engine alive
            atexit.register(lambda: (llm := me()) is not None and llm.close())
            weakref.finalize(self, self._stop.set)

    def close(self) -> None:
        """Stops the measuring thread (waits for its current piece); the engine stays usable."""
        self._stop.set()
        if self._measurer is not None and self._measurer is not threading.current_thread():
            self._measurer.join()
        self._measurer = None

    def generate(
        self,
        prompts: str | Sequence,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for each prompt (a text, token ids, or chat messages); outputs in order."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (dict, int))):
            prompts = [prompts]  # one prompt: a text, token ids or one conversation
        return self._run(list(prompts), sampling_params, use_tqdm)

    @contextmanager
    def _engine_turn(self):
        """Holds the engine against the measuring thread (which lets go after its current piece)."""
        self._wanted.set()
        try:
            with self._lock:
                self._wanted.clear()
                yield
        finally:
            self._wanted.clear()

    def _run(self, prompts: list, sampling_params: Any, use_tqdm: bool) -> list[RequestOutput]:
        with self._engine_turn():
            return self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat(
        self,
        conversations: Sequence[Sequence[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to each conversation (chat template applied)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run(list(conversations), sampling_params, use_tqdm)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def forget_history(self) -> None:
        """The draft sources forget what earlier requests left for later ones (the recent outputs):
        call it between two runs of the same prompts, or the second is drafted from the first's
        answers (LLMEngine.forget_history)."""
        with self._engine_turn():
            self.engine.forget_history()


def _fit_threads(engine: dict) -> dict:
    """EngineConfig's keywords with ``threads`` fitted to the cores this process may use: checked
    and capped if given; if not, torch's own count capped (pipeline stages: 1 each, as before)."""
    from sssd.cpus import threads_for

    stages = engine.get("pipeline_stages", 1)
    stages = stages if isinstance(stages, int) and not isinstance(stages, bool) and stages >= 1 else 1
    requested = engine.get("threads")
    if requested is None and stages > 1:
        return engine
    default = None
    if requested is None:
        import torch

        default = torch.get_num_threads()
    return dict(engine, threads=threads_for(requested, default=default, share=stages, what="threads"))


def _measure_between_calls(
    ref: weakref.ref, lock: threading.Lock, wanted: threading.Event, stop: threading.Event
) -> None:
    """The body of an LLM's measuring thread: pieces of the engine's pending measurements while no
    generate() runs, until none is pending, the LLM is closed, or it is gone."""
    while not stop.is_set():
        if wanted.is_set():
            time.sleep(0.01)
            continue
        llm = ref()
        if llm is None:
            return
        with lock:
            if stop.is_set():
                return
            try:
                pending = llm.engine.idle(0.2)
            except Exception:  # noqa: BLE001 - measuring never breaks generation
                import logging

                logging.getLogger("sssd.serving").exception("measuring between generate() calls failed")
                llm.engine.measurements = None
                pending = False
            jobs = llm.engine.measurements
            done = not pending and jobs is None
            wait = jobs.due_in() if jobs is not None else 0.0
        del llm, jobs  # the engine is held only while a piece runs
        if done:
            return
        stop.wait(min(max(wait, 0.02), 1.0))  # nothing due (a retry later): poll once a second
