"""LLMEngine: continuous batching with SSSD tree speculation.

Every call to step() is one iteration of an Orca-style loop:

1. admit waiting requests into free KV slots;
2. prefill: write the next chunk of prompts into their slots (a bounded
   number of prompt tokens per step, so long prompts never stall decoding);
3. decode: draft a tree for every decoding request (one batched SSSD call),
   verify all trees in one forward pass, keep each request's accepted path
   in its KV slot, emit accepted tokens + the target's bonus token, and
   retire finished requests.

The KV pool keeps decoding requests in slots [0, d) and prefilling ones in
[d, n) (see kv_cache.py), so both passes read their keys without gathers.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

import sssd
from sssd.config import SOURCE_NAMES
from sssd.serving.metrics import Histogram
from sssd.serving.model_runner import ModelRunner
from sssd.serving.params import SamplingParams
from sssd.serving.sequence import Request, Status
from sssd.serving.verify import children_of, greedy_walk, pack_chunks, pack_trees, sample_walk


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

    def __post_init__(self):
        for name in ("max_running", "max_model_len", "max_waiting", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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


def _log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


class LLMEngine:
    """Continuous-batching engine over one Hugging Face causal LM.

    Args:
        model: a local model folder (or a name from `sssd models list`).
        datastore: a Datastore, a directory, "default", or None (input-only drafting).
        drafter: a DrafterConfig, or a path to a config / `sssd calibrate` file.
        config: EngineConfig.
    """

    def __init__(self, model: str | Path, datastore: Any = "default", drafter: Any = None,
                 config: EngineConfig | None = None):
        from transformers import AutoTokenizer

        self.config = config or EngineConfig()
        path = _resolve_model(model)
        self.runner = ModelRunner(path, dtype=self.config.dtype, device=self.config.device, threads=self.config.threads)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        info = self.runner.info
        self.eos_ids = set(info.eos_token_ids) or ({self.tokenizer.eos_token_id} - {None})
        self.max_model_len = min(self.config.max_model_len, info.max_positions)
        self.pool = self.runner.new_pool(self.config.max_running, self.max_model_len)
        self.drafter_source = str(drafter) if isinstance(drafter, (str, Path)) else None
        self.drafter_config = _drafter_config(drafter)
        self.drafter: sssd.Drafter | None = None
        if self.config.speculate:
            eos = min(self.eos_ids) if self.eos_ids else None
            dcfg = self.drafter_config.replace(vocab_size=info.vocab_size, end_token=self.drafter_config.end_token
                                               if self.drafter_config.end_token is not None else eos)
            ds = sssd.drafter.resolve_datastore(datastore) if dcfg.use_datastore else None
            if ds is not None and ds.manifest.get("tokenizer"):
                # A datastore built by `sssd build` records its tokenizer: it must be the model's.
                from sssd.tokenizer import check_compatible

                check_compatible(ds, path)
            self.drafter = sssd.Drafter(ds, dcfg.replace(use_datastore=ds is not None))
            if ds is not None:
                ds.warm()  # fault the mmap in now: cold pages cost milliseconds per draft
        from sssd.serving.planner import BudgetPlanner

        self.planner = BudgetPlanner.for_engine(self, log=_log)
        self.waiting: deque[Request] = deque()
        self.slots: list[Request] = []   # slots[:num_decode] decode, the rest prefill
        self.num_decode = 0
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.step_count = 0
        self.metrics = EngineMetrics()

    # -- requests ------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int] | Sequence[dict], params: SamplingParams | None = None,
                    request_id: int | None = None) -> int:
        """Queues a request: a text, token ids, or chat messages (chat template applied).

        Raises:
            ValueError: empty or oversize prompt, unknown token ids, bad parameters.
            OverflowError: the waiting queue is full (retry later).
        """
        params = params or SamplingParams()
        if len(self.waiting) >= self.config.max_waiting:
            raise OverflowError(f"the queue is full ({self.config.max_waiting} waiting requests)")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.runner.info.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary ({self.runner.info.vocab_size})")
        room = self.max_model_len - len(ids) - self._max_tree()
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; this engine serves at most "
                             f"{self.max_model_len - self._max_tree() - 1} (max_model_len {self.max_model_len})")
        if params.max_tokens > room:
            params = _replace(params, max_tokens=room)
        rid = next(self._ids) if request_id is None else int(request_id)
        if rid in self.requests:
            raise ValueError(f"request id {rid} is already in use")
        req = Request(rid, list(ids), params, time.monotonic())
        if params.seed is not None:
            req.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def encode(self, prompt: str | Sequence[int] | Sequence[dict]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        prompt = list(prompt)
        if prompt and isinstance(prompt[0], dict):
            out = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")
        return [int(t) for t in prompt]

    def abort(self, request_id: int, reason: str = "abort") -> bool:
        """Cancels a request and frees its slot; False if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, reason)
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
        if self.num_decode:
            self._decode()
        self.step_count += 1
        return self.collect_outputs()

    def collect_outputs(self) -> list[RequestOutput]:
        """Outputs of the requests with news (tokens, or finished); finished ones are then forgotten."""
        outputs = [self._output(r) for r in self.requests.values() if r.new_token_count or r.finished]
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
        while pending or len(done) < len(ids):
            # feed the queue as it drains, so any number of prompts fits max_waiting
            while pending and len(self.waiting) < self.config.max_waiting:
                ids.append(self.add_request(*pending.pop()))
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[i] for i in ids]

    # -- slots -----------------------------------------------------------------------
    def _max_tree(self) -> int:
        return 1 + (self.planner.max_budget if self.config.speculate else 0)

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        ra, rb = self.slots[a], self.slots[b]
        self.pool.swap(a, b, max(ra.cached, rb.cached))
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
            if self.drafter is not None:
                self.drafter.open(req.id, req.prompt_ids)
            if req.prompt_len == 1:
                self._promote(req)

    def _promote(self, req: Request) -> None:
        self._swap(req.slot, self.num_decode)
        self.num_decode += 1
        req.status = Status.DECODE

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

    def _finish(self, req: Request, reason: str, retire: bool = True) -> None:
        """Marks a request finished; frees its slot now, or later if `retire` is False
        (during a decode step, slots must not move before every row is processed)."""
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if retire:
            self._retire(req)
        if self.drafter is not None and req.id in self.drafter:
            self.drafter.close(req.id)
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
        packed = pack_chunks(cached, chunks)
        self.runner.forward(self.pool, slice(self.num_decode, self.num_decode + len(rows)), packed)
        self.metrics.prefill(int(packed.sizes.sum()), time.perf_counter() - t0)
        for req, chunk in zip(rows, chunks):
            req.cached += len(chunk)
            if req.cached == req.prompt_len - 1:
                self._promote(req)

    # -- decode --------------------------------------------------------------------------
    def _decode(self) -> None:
        reqs = self.slots[: self.num_decode]
        B = len(reqs)
        budget = self.planner.budget(B) if self.drafter is not None else 0
        budgets = np.array([budget if r.params.speculate else 0 for r in reqs], dtype=np.int32)
        t0 = time.perf_counter()
        trees: list[sssd.DraftTree | None] = [None] * B
        if budgets.any():
            batch = self.drafter.draft([r.id for r in reqs], budgets)
            trees = [batch[b] if budgets[b] else None for b in range(B)]
        t_draft = time.perf_counter() - t0
        packed = pack_trees([r.tokens[-1] for r in reqs], [r.cached for r in reqs], trees)
        hidden = self.runner.forward(self.pool, slice(0, B), packed)
        # next-token logits at every real node of every row
        sizes = packed.sizes
        rows = np.repeat(np.arange(B), sizes)
        cols = np.concatenate([np.arange(n) for n in sizes])
        logits = self.runner.logits(hidden[torch.from_numpy(rows), torch.from_numpy(cols)])
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        greedy_rows = [b for b, r in enumerate(reqs) if r.params.greedy]
        argmax = logits.argmax(dim=-1).cpu().numpy() if greedy_rows else None
        t_forward = time.perf_counter() - t0 - t_draft
        emitted: dict[int, list[int]] = {}
        for b, req in enumerate(reqs):
            tree, children = trees[b], children_of(trees[b])
            lo = int(offsets[b])
            if req.params.greedy:
                path, bonus = greedy_walk(argmax[lo : lo + sizes[b]], children)
            else:
                p = req.params
                path, bonus = sample_walk(lambda i, lo=lo: logits[lo + i], children, p.temperature, p.top_k, p.top_p,
                                          req.generator)
            a = len(path)
            if a and path != list(range(1, a + 1)):
                src = torch.tensor(path, dtype=torch.long) + req.cached
                dst = torch.arange(1, a + 1, dtype=torch.long) + req.cached
                self.pool.move(req.slot, src.to(self.runner.device), dst.to(self.runner.device))
                self.metrics.kv_moves += 1
            req.cached += 1 + a
            new = [int(packed.tokens[b, i]) for i in path] + [bonus]
            st = req.stats
            st.steps += 1
            st.drafted += int(sizes[b] - 1)
            st.accepted += a
            st.accepted_per_step.append(a)
            st.budgets.append(int(budgets[b]))
            for i in path:
                name = SOURCE_NAMES[int(tree.sources[i - 1])]
                st.accepted_by_source[name] = st.accepted_by_source.get(name, 0) + 1
                self.metrics.accepted_by_source[name] = self.metrics.accepted_by_source.get(name, 0) + 1
            emitted[req.id] = self._emit(req, new)
        for req in reqs:  # slots move only now that every row is done
            if req.finished:
                self._retire(req)
        n_emitted = sum(len(v) for v in emitted.values())
        self.metrics.decode_step(B, int(packed.sizes.sum()), int(budgets.max()) if B else 0, t_draft, t_forward,
                                 n_emitted, [r.stats.accepted_per_step[-1] for r in reqs])
        if self.drafter is not None:
            live = [(rid, toks) for rid, toks in emitted.items() if not self.requests[rid].finished and toks]
            if live:
                self.drafter.extend_batch([rid for rid, _ in live], [toks for _, toks in live])
        self.planner.observe(B, budget, time.perf_counter() - t0, n_emitted)  # the whole step, as the client sees it

    def _emit(self, req: Request, new: list[int]) -> list[int]:
        """Appends tokens one by one, honouring stop conditions; returns those kept."""
        kept = []
        p = req.params
        for tok in new:
            req.tokens.append(tok)
            kept.append(tok)
            req.new_token_count += 1
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(req, "stop", retire=False)
                break
            if p.stop and self._hit_stop_string(req):
                self._finish(req, "stop", retire=False)
                break
            if len(req.tokens) - req.prompt_len >= p.max_tokens:
                self._finish(req, "length", retire=False)
                break
        return kept

    def _hit_stop_string(self, req: Request) -> bool:
        """True (and the text cut before it) once the output text holds a stop string."""
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        start = max(0, req.stop_check_from - max(len(s) for s in req.params.stop))
        hits = [i for i in (text.find(s, start) for s in req.params.stop) if i >= 0]
        req.stop_check_from = len(text)
        if hits:
            req.stop_text = text[: min(hits)]
            return True
        return False

    # -- outputs ---------------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput:
        ids = req.output_ids
        new_ids = ids[len(ids) - req.new_token_count :] if req.new_token_count else []
        req.text = req.stop_text if req.stop_text is not None else self.tokenizer.decode(ids, skip_special_tokens=True)
        new_text = _stream_delta(req)
        req.new_token_count = 0
        metrics = {"arrival": req.arrival, "first_token": req.first_token_time, "finish": req.finish_time}
        return RequestOutput(req.id, list(req.prompt_ids), list(ids), req.text, req.finished, req.finish_reason,
                             new_ids, new_text, req.stats.as_dict(), metrics)


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


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **changes)


def _resolve_model(model: str | Path) -> Path:
    p = Path(model).expanduser()
    if (p / "config.json").is_file():
        return p
    try:
        from sssd.models import resolve_model
    except ImportError:  # pragma: no cover - the models module ships with sssd
        raise ValueError(f"{model} is not a model folder") from None
    return Path(resolve_model(str(model)))


def _drafter_config(drafter: Any) -> sssd.DrafterConfig:
    if drafter is None:
        return sssd.DrafterConfig()
    if isinstance(drafter, sssd.DrafterConfig):
        return drafter
    return sssd.DrafterConfig.load(drafter)


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

    def finished(self, req: Request) -> None:
        self.finished_requests += 1
        self.finish_reasons[req.finish_reason] = self.finish_reasons.get(req.finish_reason, 0) + 1
