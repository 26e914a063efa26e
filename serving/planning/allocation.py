"""One verification budget per step, shared across the batch by expected acceptance.

A step verifies B rows. Every row's draft tree is drafted as deep as any row could use it (cheap,
on the CPU); then one selection over the whole batch decides which nodes are verified. A node's
calibrated score is its path's probability under the drafter's calibration, so the top nodes of a
tree (scores fall along every path) form a connected subtree with the root, and the nodes of a
row come out of the drafter in non-increasing score order: a row's selection is a prefix of its
tree. A node's worth is its probability of being accepted,

    p = score ** gamma

with gamma fitted online per decoding mode and per request (acceptance.py: AcceptanceModel), so a
request whose drafts keep failing stops taking budget and one that copies its prompt takes more.

The step's expected tokens are B (one bonus token per row) plus the sum of the selected nodes'
worth; its cost is the backend's forward time for B rows carrying N = B + k tokens in all (ragged
passes cost their tokens, not rows x the largest tree), as the engine measures it: the profile
scaled by the measured ratio at first, then a fit to the batch size's own steps (ForwardFit: the
tokens, the rows' cached context, whether any draft is verified, and the machine's recent pace),
plus the step's time beyond the forward. The selected worth is scaled by what such steps (and the
counterfactual steps of a shut gate) emitted against what they expected (the top-scored nodes'
scores run high). The selection is the k
with the most expected tokens per second over all k (the top-k nodes by worth, batch-wide):

    k* = argmax_k (B + sum of the k largest p) / cost(B, B + k)

so a request may get 0 nodes and another 60, and a step where nothing pays verifies no drafts.
For a cost that depends only on B and the total tokens this is the exact optimum over all
per-row prefix sizes (tests/test_allocation.py checks it against brute force).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from sssd.serving.planning.acceptance import AcceptanceModel
from sssd.serving.planning.forward_fit import ForwardFit


def update_mean(means: dict, weights: dict, key, value, decay: float):
    """Moves `means[key]` (a number, or a list of numbers) to an exponential mean with `value`
    (weight `decay` per update on the past), its weights normalised over the values seen so far, so
    that it starts as the plain mean: the first value does not stand for the whole past. (Started
    at its first value instead, one slow first speculative step held a batch-1 bucket's mean step
    at 236 ms against the 85 predicted after 7 steps and kept its gate shut for a whole run:
    RESULTS.md, 2026-11-30.)
    Returns the mean before (None at the first)."""
    w = weights[key] = decay * weights.get(key, 0.0) + 1.0
    old = means.get(key)
    if old is None:
        means[key] = list(value) if isinstance(value, list) else value
    elif isinstance(old, list):
        means[key] = [o + (v - o) / w for o, v in zip(old, value)]
    else:
        means[key] = old + (value - old) / w
    return old


@dataclass
class Allocation:
    """What one step verifies: nodes per row, and what the allocator expects of it."""

    counts: np.ndarray  # [B] draft nodes verified per row (a prefix of its tree)
    expected_tokens: float  # B + the selected nodes' worth
    seconds: float  # predicted step seconds
    candidates: int  # nodes drafted over the batch
    cached: int = 0  # the rows' cached positions, summed (what the forward's cost was predicted for)
    correction: float = 1.0  # the bucket's worth correction the selection was made with

    @property
    def raw_worth(self) -> float:
        """The selected nodes' worth beyond the bonus tokens as the scores had it (uncorrected)."""
        return (self.expected_tokens - self.counts.size) / self.correction

    @property
    def tokens_per_second(self) -> float:
        return self.expected_tokens / self.seconds if self.seconds > 0 else 0.0


def select(values: list[np.ndarray], cost: Callable[[np.ndarray], np.ndarray], rows: int) -> tuple[np.ndarray, int]:
    """The best batch-wide selection: per row, how many of its first nodes to verify.

    Args:
        values: per row, its nodes' worth in tree order (made non-increasing here: a node is worth
            at most its predecessor, so a row's selection is a prefix).
        cost: seconds of a step verifying k draft nodes in all, for an array of k.
        rows: B (one bonus token each).
    Returns: (counts [B], k) with k = counts.sum().
    """
    B = len(values)
    flat = [np.minimum.accumulate(np.asarray(v, dtype=np.float64)) for v in values]
    sizes = np.fromiter((v.size for v in flat), dtype=np.int64, count=B)
    if not sizes.sum():
        return np.zeros(B, dtype=np.int64), 0
    allv = np.concatenate(flat)
    owner = np.repeat(np.arange(B), sizes)
    order = np.argsort(-allv, kind="stable")  # ties keep tree order: still a prefix per row
    gained = np.concatenate([[0.0], np.cumsum(allv[order])])
    ks = np.arange(gained.size)
    rate = (rows + gained) / cost(ks)
    k = int(np.argmax(rate))
    counts = np.bincount(owner[order[:k]], minlength=B).astype(np.int64)
    return counts, k


class BatchAllocator:
    """The step's budget, shared across the batch (see the module docstring).

    Args:
        time: (rows, tokens per row, as an array) -> seconds of a forward pass (a ForwardProfile's
            time, measured or the roofline's).
        max_budget: the most draft nodes one row may be given.
        acceptance: the AcceptanceModel (a fresh one by default).

    What drafting itself cost (a draft model's passes) is spent before the allocation runs, so it
    is no part of the choice: whether a costly source drafts at all is the deferral's decision
    (planning/deferral.py), and charging its seconds here would turn cheap retrieval off with it.
    """

    DECAY = 0.9  # weight of the past in the measured corrections, per observed step
    #: Every PLAIN_EVERY-th step of a batch-size bucket is a plain step (no drafting at all), so the
    #: rate speculation must beat is measured, not modelled: a correction fitted on speculative steps
    #: (long contexts, tree masks) does not carry over to one-token steps.
    PLAIN_EVERY = 32
    #: Where speculative steps measured no faster than plain ones (tokens per second, an exponential
    #: mean, each against a plain step of its own rows and context: plain_rate; by GAIN_MARGIN at
    #: least), only every PROBE_EVERY-th step drafts (to notice when it pays again); the others are
    #: plain. The allocation's prediction shapes each step; this measurement decides whether to draft.
    PROBE_EVERY = 8
    #: Each probe that still loses doubles the interval, up to PROBE_MAX steps; one that wins brings it
    #: back to PROBE_EVERY. On pure chat where nothing pays, probes at a fixed 1 in 8 verified drafts
    #: that lost 13-20% against plain steps: ~2% of the run.
    PROBE_MAX = 64
    #: Speculative steps must measure this much faster than plain ones (tokens per second) for the
    #: bucket to count as winning. A run pays for speculation outside its speculative steps too: its
    #: rows finish apart (more prompt chunks, a ragged last wave), the sources read every emitted
    #: token, counterfactual trees are drafted. On GSM8K at 32 rows (SmolLM2, 2-core Xeon) steps that
    #: drafted measured 1.02-1.08x the plain steps while the runs they were in lost 3.5% to plain;
    #: with the gate shut the same runs matched plain, and with this margin they lost 1.1-1.4% (ten
    #: rounds each, a fresh engine's first round the most; RESULTS.md, 2026-12-01).
    GAIN_MARGIN = 0.05
    #: ... at this many rows and more; in proportion below (bar). The whole margin at every batch
    #: size cost batch 1 on GSM8K its speculation (1.05 and 0.98x plain against 1.14 and 1.27x):
    #: drafted steps there measured 1.03-1.05x plain ones, and with one row nothing else pays for them.
    MARGIN_ROWS = 32
    #: A batch bucket's forward cost comes from its measured steps (ForwardFit: tokens verified,
    #: cached context, drafts or none, recent pace) once it has FIT_STEPS of them; until then from
    #: the profile, scaled by the measured ratio. The profile is taken over chains at a short
    #: context; at long contexts one more token costs more than it says (Qwen2.5-Coder-1.5B at
    #: batch 1 with ~1,500 cached positions: 1.8x the profile), and a ratio fixes the level but not
    #: that slope. Plain steps are in the fit as passes without drafts: a step with drafts pays for
    #: its tree (mask, ragged attention) beyond its tokens, and the fit's drafts term says how much.
    FIT_STEPS = 8
    #: The nodes a step selects are the batch's highest-scored, so their scores run high (the
    #: winner's curse): their expected tokens came out 11-24% above the tokens emitted (SmolLM2,
    #: mixed traffic, batch 2-4). A bucket's selected worth is multiplied by the ratio of what its
    #: speculative steps emitted beyond the bonus tokens to what they expected (uncorrected; sums
    #: decayed by RATIO_DECAY a step), within RATIO_RANGE, once RATIO_STEPS steps are in it.
    RATIO_DECAY = 0.95
    RATIO_STEPS = 8
    RATIO_RANGE = (0.25, 2.0)
    #: While a bucket loses, the steps the gate keeps plain still draft (greedy batches), and what
    #: verifying would have given is read off the tokens the requests go on to emit
    #: (planning/counterfactual.py). Once COUNTERFACTUAL_STEPS such steps resolved since the last
    #: probe and their tokens per second (their predicted seconds corrected by what the bucket's
    #: speculative steps measured against their predictions; exponential mean) beat the plain
    #: steps', the next step probes without waiting for the interval; and once as many resolved since
    #: the last probe and say it would still lose, a probe that falls due is skipped, as if it had
    #: lost (the interval doubles): on GSM8K at 16 rows (SmolLM2, AMD EPYC) probes verified 23-64
    #: nodes for 0.73-0.89x a plain step's tokens per second, at 1.9-2.4x its seconds, against ~2 ms
    #: for a counterfactual. Without such evidence (sampled batches, rows still inside their trees)
    #: probes come by the interval.
    COUNTERFACTUAL_STEPS = 4
    #: A row's candidate tree is drafted as deep as its request was last given, times DEPTH_GROWTH,
    #: and at least DEPTH_MIN nodes (a new request: candidate_budget). The allocation takes a prefix
    #: of each row's candidates in score order, and the drafter's tree at a small budget is the
    #: prefix of its tree at a large one (190 of 192 rows, SmolLM2 on GSM8K, MT-Bench and code
    #: edits at budgets 4-32 against 64), so a shallower tree loses only nodes the allocation would
    #: not have taken; a request that takes all its candidates is drafted 4x deeper the next step
    #: (DEPTH_MIN to 64 in two steps). At 32 rows where nothing pays, drafting 64 nodes a row cost
    #: 1.55 ms against 1.12 at 8 (retrieval, the copy index and the recent outputs; before the
    #: allocation's own work, which scales with the nodes too).
    DEPTH_MIN = 8
    DEPTH_GROWTH = 4
    #: Drafting a counterfactual costs what a drafting step's preparation does (at 32 rows, 64
    #: nodes each, 4-9 ms of a 150-180 ms step on a 2-core Xeon: 2-5% of a run where the gate
    #: stays shut; with DEPTH_MIN and this cadence, 1.5-1.6 ms, RESULTS.md 2026-11-30). So the
    #: counterfactual's cadence follows the probe interval: every gated step while probes come
    #: every PROBE_EVERY steps (a bucket that only just lost), one in (interval / PROBE_EVERY) once
    #: losing probes have stretched it (1 in 8 at PROBE_MAX): COUNTERFACTUAL_STEPS of them still
    #: resolve within half an interval, so the evidence can call a probe before it is due.

    def __init__(
        self,
        time: Callable[[int, np.ndarray], np.ndarray],
        max_budget: int = 64,
        acceptance: AcceptanceModel | None = None,
    ):
        self.time = time
        self.max_budget = int(max_budget)
        self.acceptance = acceptance or AcceptanceModel()
        self._scale: dict[int, float] = {}  # batch bucket -> measured forward / profile
        self._overhead: dict[int, float] = {}  # batch bucket -> step seconds beyond the forward
        self._caps: dict[int, int] = {}
        #: batch bucket -> [predicted tokens/s, measured tokens/s] (exponential means)
        self.rates: dict[int, list[float]] = {}
        self._plain: dict[int, float] = {}  # batch bucket -> measured seconds of a plain step
        self._gain: dict[int, float] = {}  # batch bucket -> best predicted rate over plain's (mean)
        self._probe: dict[int, int] = {}  # batch bucket -> steps between probes while drafting loses
        self._prefill_rate: dict[int, float] = {}  # batch bucket -> seconds per prompt token a decode pass writes
        self._since: dict[int, int] = {}  # batch bucket -> steps since its last probe
        self._turn: dict[int, int] = {}
        self._plain_rows: dict[int, float] = {}  # the rows of the measured plain steps (mean)
        self._plain_overhead: dict[int, float] = {}  # batch bucket -> a plain step's seconds beyond its forward
        self._fits: dict[int, ForwardFit] = {}  # batch bucket -> its measured forward seconds
        #: batch bucket -> [expected tokens, emitted tokens, predicted seconds, measured seconds] per
        #: speculative step (exponential means)
        self._parts: dict[int, list[float]] = {}
        self._ratio: dict[int, float] = {}  # batch bucket -> correction of the selected nodes' worth
        self._ratio_sums: dict[int, list] = {}  # batch bucket -> [emitted, expected, steps] beyond the bonus
        #: batch bucket -> [gain over plain, steps] of the counterfactual steps since its last probe
        self._counterfactual: dict[int, list] = {}
        self._gated: dict[int, int] = {}  # batch bucket -> steps the gate kept plain while losing
        self._depth: dict[int, int] = {}  # request id -> its candidate tree's nodes (DEPTH_MIN)
        self._weights: dict[str, dict] = {}  # mean -> batch bucket -> its normalising weight (update_mean)
        self.steps = self.empty_steps = self.plain_steps = 0
        self.counterfactual_steps = self.called_probes = self.skipped_probes = 0
        #: Where a list: every step observed (observe, observe_plain), in order, as JSON-ready lists,
        #: so that a fresh allocator fed the same steps prices passes as this one did
        #: (benchmarks/bench_allocation_replay.py compares pricings offline, free of the machine's
        #: drift). None: not kept.
        self.record: list | None = None

    def _mean(self, name: str, key: int, value, decay: float):
        """update_mean of the mean `self.<name>[key]`; returns the mean before."""
        return update_mean(getattr(self, name), self._weights.setdefault(name, {}), key, value, decay)

    def use_time(self, time: Callable[[int, np.ndarray], np.ndarray]) -> None:
        """Allocates by `time` from now on (a measured profile replacing the prior): what was
        fitted to the old one (its scale, the cost caps, the gain it measured) starts afresh; the
        measured plain steps, overheads and acceptance stay."""
        self.time = time
        self._scale.clear()
        self._caps.clear()
        self._gain.clear()
        self._weights.pop("_scale", None)
        self._weights.pop("_gain", None)
        self._probe.clear()
        self._counterfactual.clear()
        self._gated.clear()

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, int(batch) - 1).bit_length()

    def fitted(self, batch: int) -> bool:
        """Whether the bucket's forward cost comes from its measured steps (else the profile)."""
        fit = self._fits.get(self.bucket(batch))
        return fit is not None and fit.steps >= self.FIT_STEPS

    def forward_seconds(self, batch: int, drafted: np.ndarray, cached: int | None = None) -> np.ndarray:
        """Predicted forward seconds of B rows verifying `drafted` draft nodes in all, over `cached`
        positions in their KV slots (None: as the bucket's recent steps): the bucket's measured fit
        once it has enough steps (FIT_STEPS), else the profile scaled."""
        drafted = np.asarray(drafted, dtype=np.float64)
        if not self.fitted(batch):
            per_row = (batch + drafted) / batch
            return self.scale(batch) * np.asarray(self.time(batch, per_row), dtype=np.float64)
        fit = self._fits[self.bucket(batch)]
        tokens = batch + drafted
        out = fit(tokens, cached, drafted)
        edge = self.fit_edge(batch)
        beyond = tokens > edge
        if beyond.any():
            out = np.where(beyond, np.maximum(out, self._past_edge(batch, fit, edge, tokens, cached, drafted)), out)
        return out

    def fit_edge(self, batch: int) -> float:
        """The most tokens a pass of this bucket may verify and be priced by its fit alone
        (ForwardFit.known_tokens, at least the rows); longer ones are priced by _past_edge. 0 before
        the bucket is fitted."""
        if not self.fitted(batch):
            return 0.0
        return float(max(self._fits[self.bucket(batch)].known_tokens(), batch))

    def _past_edge(self, batch: int, fit: ForwardFit, edge: float, tokens, cached, drafted) -> np.ndarray:
        """A pass longer than the bucket's fit can speak for (ForwardFit.known_tokens: longer than
        its recent passes' range, or than any it measured): the fit's price at that edge plus the
        profile's own increments from there. The fit's slope comes from the passes it has seen, and
        passes of one length say nothing of another: 183 plain passes of 9-16 rows (the rows fewer
        where the contexts were longest) fitted 0 ms a token, and the first speculative step after
        them, 944 tokens at 16 rows, was priced at 103 ms and took 1.94 s (SmolLM2, GSM8K, AMD EPYC;
        RESULTS.md, 2026-12-01); the profile's increments put it at 2.2 s. They are not scaled by
        the measured ratio to the profile: that ratio is mostly the longer contexts' fixed cost
        per pass (1.42 there), which the fit's price at the edge already holds. The price is the
        larger of the two, so a fit that learnt a steeper slope than the profile keeps it."""
        prof = lambda n: np.asarray(self.time(batch, np.asarray(n, dtype=np.float64) / batch), dtype=np.float64)  # noqa: E731
        at_edge = fit(np.full_like(tokens, edge), cached, drafted)
        return at_edge + np.maximum(prof(np.maximum(tokens, edge)) - prof([edge]), 0.0)

    def prefill_seconds(self, batch: int, tokens: int) -> float:
        """What `tokens` prompt tokens add to a pass of B rows, as measured per prompt token in the
        bucket's passes that wrote a chunk (observe_prefill); 0 before any was measured (nothing
        is drafted on a guess of it)."""
        rate = self._prefill_rate.get(self.bucket(batch))
        return 0.0 if rate is None or tokens <= 0 else rate * tokens

    def observe_prefill(self, batch: int, drafted: int, cached: int, tokens: int, forward_seconds: float) -> None:
        """A pass of B rows verifying `drafted` nodes over `cached` positions that also wrote `tokens`
        prompt tokens: what it took beyond the predicted decode pass, per prompt token."""
        if tokens <= 0 or forward_seconds <= 0:
            return
        key = self.bucket(batch)
        base = float(np.asarray(self.forward_seconds(batch, np.array([float(drafted)]), cached))[0])
        rate = max(forward_seconds - base, 0.0) / tokens
        old = self._prefill_rate.get(key)
        self._prefill_rate[key] = rate if old is None else self.DECAY * old + (1 - self.DECAY) * rate

    def _fit(self, batch: int) -> ForwardFit:
        """The bucket's measured forward fit, its prior slope the profile's at this batch size."""
        key = self.bucket(batch)
        if key not in self._fits:
            one, two = (float(v) for v in np.asarray(self.time(batch, np.array([1.0, 2.0])), dtype=np.float64))
            self._fits[key] = ForwardFit(per_token=max(two - one, 0.0) / batch)  # seconds per verified token
        return self._fits[key]

    def scale(self, batch: int) -> float:
        """Measured forward over the profile's: from speculative steps once there are some, before
        that from plain steps (the profile may come from another load on this machine)."""
        key = self.bucket(batch)
        if key in self._scale:
            return self._scale[key]
        if key in self._plain:
            rows = max(int(round(self._plain_rows[key])), 1)
            return self._plain[key] / float(np.asarray(self.time(rows, np.array([1.0])))[0])
        return 1.0

    def step_seconds(self, batch: int, drafted: np.ndarray, cached: int | None = None) -> np.ndarray:
        """Predicted seconds of a step verifying `drafted` draft nodes in all. 0 nodes: the fit's
        pass without drafts plus the step's overhead (its drafting is spent either way), or before
        the fit the measured plain step, once there is one."""
        drafted = np.asarray(drafted, dtype=np.float64)
        key = self.bucket(batch)
        out = self.forward_seconds(batch, drafted, cached) + self._overhead.get(key, 0.0)
        if key in self._plain and not self.fitted(batch):
            out = np.where(drafted == 0, self._plain[key] * batch / self._plain_rows.get(key, batch), out)
        return out

    def plain_rate(self, batch: int, cached: int | None = None) -> float:
        """Tokens per second of a plain step of B rows over `cached` positions (None: as the bucket's
        recent steps), what a speculative step's rate is measured against: once the bucket's forward
        is fitted, its pass without drafts at these rows and this context plus a plain step's
        measured time beyond its forward; before that, the measured plain steps' rows over their
        seconds. (Against the plain steps' mean alone, a step was compared with passes of other
        rows and contexts: at 32 rows on GSM8K, drafted steps of 18-24 rows against plain ones of
        27-31, late in a wave against early.)"""
        key = self.bucket(batch)
        if self.fitted(batch) and key in self._plain_overhead:
            seconds = float(self.forward_seconds(batch, np.zeros(1), cached)[0]) + self._plain_overhead[key]
            return batch / seconds
        return self._plain_rows[key] / self._plain[key]

    def bar(self, key: int) -> float:
        """What a bucket's speculative steps must measure over plain ones to count as winning: 1 plus
        GAIN_MARGIN at MARGIN_ROWS rows and more, in proportion below (what a run pays outside its
        speculative steps grows with the rows that share a pass; a lone row holds up nobody)."""
        return 1.0 + self.GAIN_MARGIN * min(1.0, key / self.MARGIN_ROWS)

    def _losing(self, key: int) -> bool:
        """Whether the bucket's speculative steps measure under its bar over plain ones (then only probes draft)."""
        return self._gain.get(key, 2.0) < self.bar(key)

    def drafts(self, batch: int) -> bool:
        """Whether this step drafts at all (see PLAIN_EVERY, PROBE_EVERY and COUNTERFACTUAL_STEPS)."""
        key = self.bucket(batch)
        n = self._turn[key] = self._turn.get(key, 0) + 1
        if key not in self._plain or n % self.PLAIN_EVERY == 0:
            return False
        if self._losing(key):  # a probe once every so many steps (not in step with PLAIN_EVERY)
            since = self._since[key] = self._since.get(key, 0) + 1
            cf = self._counterfactual.get(key)
            called = cf is not None and cf[1] >= self.COUNTERFACTUAL_STEPS and cf[0] > self.bar(key)
            if since < self._probe.get(key, self.PROBE_EVERY) and not called:
                return False
            self._since[key] = 0
            self._counterfactual.pop(key, None)  # the probe measures; the evidence starts afresh
            self.called_probes += called
            if cf is not None and cf[1] >= self.COUNTERFACTUAL_STEPS and not called:
                # due, but the counterfactual steps since the last probe say it would lose: it counts
                # as a probe that lost (see COUNTERFACTUAL_STEPS)
                self._probe[key] = min(2 * self._probe.get(key, self.PROBE_EVERY), self.PROBE_MAX)
                self.skipped_probes += 1
                return False
        return True

    def counterfactual(self, batch: int) -> bool:
        """Whether a step the gate keeps plain should still draft, to learn what verifying would
        have given: only while the bucket loses (the other plain steps are the plain measurement),
        and then on one gated step in counterfactual_every (see COUNTERFACTUAL_STEPS)."""
        key = self.bucket(batch)
        if not self._losing(key):
            return False
        n = self._gated[key] = self._gated.get(key, 0) + 1
        return (n - 1) % self.counterfactual_every(key) == 0

    def counterfactual_every(self, key: int) -> int:
        """One gated step in this many drafts a counterfactual: the probe interval over its start."""
        return max(1, self._probe.get(key, self.PROBE_EVERY) // max(self.PROBE_EVERY, 1))

    def observe_counterfactual(self, batch: int, tokens: int, seconds: float, worth: float = 0.0) -> None:
        """A counterfactual step resolved (planning/counterfactual.py): the tokens it would have
        emitted in the seconds it was predicted to take, from nodes whose worth beyond the bonus
        tokens was `worth` as the scores had it (Allocation.raw_worth): the worth correction learns
        from it as from a verified step. (From verified steps alone, where the gate shuts it learnt
        only from probes: after a run's 5 probes at 16 rows on GSM8K, still none, and each probe
        expected 1.2-1.5x the tokens it gave.)"""
        key = self.bucket(batch)
        self._learn_correction(key, tokens - batch, worth)
        if key not in self._plain or seconds <= 0:
            return
        parts = self._parts.get(key)  # the bucket's speculative steps: measured over predicted seconds
        seconds *= parts[3] / parts[2] if parts is not None and parts[2] > 0 else 1.0
        gain = (tokens / seconds) / self.plain_rate(batch)
        cf = self._counterfactual.setdefault(key, [gain, 0])
        cf[0] = gain if not cf[1] else 0.7 * cf[0] + 0.3 * gain
        cf[1] += 1
        self.counterfactual_steps += 1

    def candidate_depths(self, ids: Sequence[int], batch: int) -> np.ndarray:
        """[B] how many nodes each row's candidate tree is drafted with: the bucket's
        candidate_budget, or fewer for a request the last allocations gave little (see DEPTH_MIN)."""
        cap = self.candidate_budget(batch)
        return np.fromiter((min(cap, self._depth.get(int(i), cap)) for i in ids), dtype=np.int32, count=len(ids))

    def forget(self, rid: int) -> None:
        """Request `rid` ended: its acceptance and candidate depth go."""
        self.acceptance.forget(rid)
        self._depth.pop(int(rid), None)

    def candidate_budget(self, batch: int) -> int:
        """The most nodes any one row could be given at this batch size: the k at which even nodes
        certain to be accepted stop paying (so rows need not be drafted deeper)."""
        if batch not in self._caps:
            ks = np.arange(self.max_budget * batch + 1)
            fixed = self._overhead.get(self.bucket(batch), 0.0)
            rate = (batch + ks) / (self.forward_seconds(batch, ks) + fixed)
            self._caps[batch] = int(min(self.max_budget, np.argmax(rate)))
        return self._caps[batch]

    def allocate(
        self,
        ids: Sequence[int],
        greedy: np.ndarray,
        scores: list[np.ndarray],
        cached: int | None = None,
        prefill: int = 0,
        count: bool = True,
    ) -> Allocation:
        """Nodes to verify per row, from each row's candidate tree's scores (in tree order; an
        empty array for a row that does not speculate); `cached`: the rows' cached positions,
        summed (None: as the bucket's recent steps); `prefill`: prompt tokens the same pass writes;
        `count`: False for a counterfactual step's (not in the step counts).

        A step whose pass also writes a prompt chunk pays the chunk's seconds whatever it verifies,
        so they do not lower the bar a node must clear: its selection is the one the same step
        without the chunk would make, and the chunk's seconds are in its predicted time only.
        Priced into the choice, they diluted the step's rate and bought nodes below the engine's
        own (192 nodes for 25 more tokens beside a 234-token chunk at batch 3: 25 ms a token
        against 8-15 in the decode steps around it; RESULTS.md, 2026-11-30)."""
        B = len(ids)
        gammas = self.acceptance.gammas(ids, greedy)
        ratio = self.correction(B)
        values = [ratio * self.acceptance.worth(s, g) if s.size else s for s, g in zip(scores, gammas)]
        cost = lambda ks: self.step_seconds(B, ks, cached)  # noqa: E731
        counts, k = select(values, cost, B)
        for i, s, c in zip(ids, scores, counts.tolist()):
            if s.size:  # (a row that drafted nothing this step says nothing of its depth)
                self._depth[int(i)] = max(self.DEPTH_MIN, self.DEPTH_GROWTH * int(c))
        expected = B + sum(float(np.minimum.accumulate(v)[:c].sum()) for v, c in zip(values, counts) if c)
        if count:
            self.steps += 1
            self.empty_steps += k == 0
        return Allocation(
            counts,
            expected,
            float(cost(np.array([k]))[0]) + self.prefill_seconds(B, prefill),
            int(sum(s.size for s in scores)),
            int(cached or 0),
            ratio,
        )

    def observe(
        self,
        batch: int,
        drafted: int,
        forward_seconds: float,
        step_seconds: float,
        tokens: int,
        predicted: float | None = None,
        expected: tuple[float, float] | None = None,
        cached: int = 0,
    ) -> None:
        """A step's measured costs (its forward pass over `cached` positions and its wall time) and
        rate."""
        if self.record is not None:
            expect = None if expected is None else list(expected)
            self.record.append(
                ["step", batch, drafted, forward_seconds, step_seconds, tokens, predicted, expect, cached]
            )
        key = self.bucket(batch)
        # the plain step this one is measured against, as predicted before the step moves the fit's
        # level (after, a slow step would have raised its own bar's seconds with it)
        plain_rate = self.plain_rate(batch, cached) if key in self._plain and step_seconds > 0 and drafted else None
        if forward_seconds > 0:
            ratio = forward_seconds / float(np.asarray(self.time(batch, np.array([(batch + drafted) / batch])))[0])
            self._mean("_scale", key, ratio, self.DECAY)
            self._fit(batch).observe(batch + drafted, cached, drafted, forward_seconds)
            self._mean("_overhead", key, max(step_seconds - forward_seconds, 0.0), self.DECAY)
            self._caps.pop(batch, None)
        if plain_rate is not None:  # measured against measured plain steps
            gain = (tokens / step_seconds) / plain_rate
            old = self._mean("_gain", key, gain, 0.8)
            bar = self.bar(key)
            if self._gain[key] < bar and old is not None and old < bar:  # a probe that lost: probe less often
                self._probe[key] = min(2 * self._probe.get(key, self.PROBE_EVERY), self.PROBE_MAX)
            elif self._gain[key] >= bar:
                self._probe.pop(key, None)
        if expected is not None and expected[0] > batch:  # the drafts' worth against what they gave
            self._learn_correction(key, tokens - batch, (expected[0] - batch) / self.correction(batch))
        if expected is not None and step_seconds > 0:  # where a misprediction comes from: tokens or time
            self._mean("_parts", key, [expected[0], float(tokens), expected[1], step_seconds], 0.95)
        if predicted is not None and step_seconds > 0:
            self._mean("rates", key, [predicted, tokens / step_seconds], 0.95)

    def correction(self, batch: int) -> float:
        """The factor on the selected nodes' worth at this batch size: its bucket's (RATIO_STEPS),
        or until it has one the nearest bucket's (fewer rows first), or 1. The scores run high at
        every batch size: a fresh engine's first step at 16 rows expected 49.8 tokens and gave 34
        (0.68), where the bucket then learnt 0.72-0.79 (SmolLM2, GSM8K, AMD EPYC, 2026-12-01)."""
        key = self.bucket(batch)
        if key in self._ratio or not self._ratio:
            return self._ratio.get(key, 1.0)
        near = min(self._ratio, key=lambda k: (abs(np.log2(k / key)), k))
        return self._ratio[near]

    def _learn_correction(self, key: int, gained: float, worth: float) -> None:
        """A step (speculative, or counterfactual) gained `gained` tokens beyond its bonus tokens
        from nodes whose uncorrected worth was `worth`: the bucket's worth correction (RATIO_STEPS)."""
        if worth <= 0:
            return
        sums = self._ratio_sums.setdefault(key, [0.0, 0.0, 0])
        d = self.RATIO_DECAY
        sums[0] = d * sums[0] + max(gained, 0)
        sums[1] = d * sums[1] + worth
        sums[2] += 1
        if sums[2] >= self.RATIO_STEPS:
            self._ratio[key] = float(np.clip(sums[0] / sums[1], *self.RATIO_RANGE))

    def observe_plain(self, batch: int, step_seconds: float, forward_seconds: float = 0.0, cached: int = 0) -> None:
        """A plain step's wall time (no drafting, no draft verified), and its forward pass over
        `cached` positions (the forward fit's pass without drafts)."""
        if self.record is not None:
            self.record.append(["plain", batch, step_seconds, forward_seconds, cached])
        if step_seconds <= 0:
            return
        key = self.bucket(batch)
        if forward_seconds > 0:
            self._fit(batch).observe(batch, cached, 0, forward_seconds)
            self._mean("_plain_overhead", key, max(step_seconds - forward_seconds, 0.0), self.DECAY)
        self.plain_steps += 1
        self._mean("_plain", key, step_seconds, self.DECAY)
        self._mean("_plain_rows", key, float(batch), self.DECAY)
        self._caps.pop(batch, None)

    def report(self) -> dict:
        """Per batch bucket: the forward's measured ratio to the profile, the step's overhead, and
        predicted against measured tokens/s."""
        return {
            "steps": self.steps,
            "steps_without_drafts": self.empty_steps,
            "plain_steps": self.plain_steps,
            # steps kept plain that drafted to learn what verifying would have given, and the
            # probes their evidence called before the interval
            "counterfactual_steps": self.counterfactual_steps,
            "called_probes": self.called_probes,
            "skipped_probes": self.skipped_probes,  # probes due that the counterfactual steps said would lose
            "gamma": {m: round(self.acceptance.mode_gamma(m == "greedy"), 3) for m in self.acceptance.MODES},
            "buckets": {
                k: {
                    "forward_vs_profile": round(self.scale(k), 3),
                    "worth_correction": round(self._ratio[k], 3) if k in self._ratio else None,
                    # intercept, per token, per thousand cached positions, for verifying any draft
                    "forward_fit_ms": (
                        [round(1e3 * c, 3) for c in self._fits[k].coefficients()] if k in self._fits else None
                    ),
                    "forward_level": round(self._fits[k].level, 3) if k in self._fits else None,
                    "overhead_ms": round(1e3 * self._overhead.get(k, 0.0), 2),
                    "plain_step_ms": round(1e3 * self._plain[k], 2) if k in self._plain else None,
                    "gain_over_plain": round(self._gain[k], 3) if k in self._gain else None,
                    "probe_every": self._probe.get(k, self.PROBE_EVERY) if self._losing(k) else None,
                    "counterfactual_every": self.counterfactual_every(k) if self._losing(k) else None,
                    # what a prompt token written by a decode pass added to it (measured)
                    "prefill_ms_per_token": (
                        round(1e3 * self._prefill_rate[k], 3) if k in self._prefill_rate else None
                    ),
                    "predicted_tokens_per_s": round(self.rates[k][0], 2) if k in self.rates else None,
                    "measured_tokens_per_s": round(self.rates[k][1], 2) if k in self.rates else None,
                    # a speculative step's tokens and milliseconds: predicted, measured
                    "step_tokens": [round(x, 2) for x in self._parts[k][:2]] if k in self._parts else None,
                    "step_ms": [round(1e3 * x, 2) for x in self._parts[k][2:]] if k in self._parts else None,
                }
                for k in sorted(set(self._scale) | set(self.rates) | set(self._plain))
            },
        }
