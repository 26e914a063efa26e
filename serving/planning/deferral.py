"""When a costly draft source (a draft model) drafts beside retrieval: measured, per step.

A deferring source (DraftSource.defers_to_retrieval) is asked in a step only when its drafts
beside retrieval's promise more tokens per second than retrieval's alone (sources.DraftSource).
With A_r what retrieval's tree promises for a request, A_s what the source expects for it and
c the source's drafting time over the target's forward time, it is asked when

    sum(1 + max(A_r, A_s)) > (1 + c) * sum(1 + A_r)       over the requests that draft.

Each term is measured where it can be, since the priors are off by factors on real hardware
(seen: a 0.5B drafter's prior cost of 1.28 target passes against 0.92 measured at batch 4,
with the target verifying 9 tokens a row; retrieval uncalibrated for a model promising more
than it gets):

- c: the source's measured seconds per drafting step (`measured_seconds(batch)`) over the
  target's measured forward seconds at that batch size (`observe_step`), per power-of-two
  batch bucket; its `relative_cost` prior until both are known.
- A_r: retrieval's promise (the sum of its nodes' merge priorities) times the ratio of the
  tokens retrieval-only trees got accepted to what they promised (smoothed, starting at 1
  with PROMISE_PRIOR tokens of weight), learnt from the steps the source sat out.
- A_s: the source's own `expected_accepted` (a model drafter's measured rates).

A source that sat out EXPLORE_EVERY steps in a row drafts in the next one anyway, so that its
cost and acceptance stay measured when the rule would keep it out.

The rule is still a model, and its errors are the kind a step-by-step choice pays twice for (a
draft model asked every other step catches up on the steps it sat out). So whether steps follow
it is itself measured (sssd.serving.planning.measured_choice), per batch-size bucket, in tokens per second of whole
steps: "rule" (the above), "always" (the source drafts every step: the hybrid in full) and "never"
(retrieval alone), measured apart for serial and asynchronous steps (that choice is measured
too, in blocks of the same length: keyed together, each would measure the other's arms). The
engine begins each step's choice (`begin_step`) and reports the step (`observe_step`); a
pipeline driven without them follows the rule.

Arms compared across different steps compare different text too, and on GSM8K at batch 4 that
noise (tokens per step from 1 to 9 a row) is as large as the arms' difference: the choice drifted
to retrieval alone, 0.80-0.93x the draft model alone. So every step in which the source drafted
also measures "never" exactly, on the same step: retrieval's own tree for each request is built
anyway (its promise), and under greedy verification the tokens it would have got are those of
its longest path along the verified tokens (`accepted_along`), in the step's time without the
source's drafting seconds. "never" is measured on the same steps as the arm that ran.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from sssd.serving.planning.measured_choice import MeasuredChoice, bucket

#: Steps in a row a deferring source sits out before it drafts once anyway (measuring it).
EXPLORE_EVERY = 16
#: Weight, in promised tokens, of the prior "retrieval gets what it promises".
PROMISE_PRIOR = 16.0
#: Forgetting per observed step (the workload drifts).
DECAY = 0.97
#: How a step's deferring sources are asked: by the rule, always, never (measured per batch size).
ARMS = ("rule", "always", "never")


def accepted_along(tokens: np.ndarray, parents: np.ndarray, verified: Sequence[int]) -> int:
    """How many of `verified` (the target's tokens of a step: the accepted ones, then the bonus)
    a draft tree (its nodes' tokens and parents, -1 for the top level) would have had accepted
    under greedy verification: the depth of its longest root path along them (siblings with
    one token, as a tree merged from several sources may hold, are all followed)."""
    depth, nodes = 0, np.array([-1])
    while depth < len(verified):
        nodes = np.flatnonzero(np.isin(parents, nodes) & (tokens == verified[depth]))
        if not nodes.size:
            break
        depth += 1
    return depth


class Deferral:
    """The measured terms of the deferral rule (module docstring), kept by a DraftPipeline."""

    def __init__(self):
        self.forward: dict[int, float] = {}  # batch bucket -> smoothed forward seconds
        self.got, self.promised = PROMISE_PRIOR, PROMISE_PRIOR  # retrieval-only steps: accepted / promised
        self.sat_out: dict[int, int] = {}  # source index -> steps sat out in a row
        self._pending: dict[int, float] = {}  # request id -> promise of its retrieval-only tree
        self._alone: dict[int, tuple] = {}  # request id -> retrieval's own tree, the source drafting
        self._source_seconds = 0.0  # the deferring sources' drafting time this step
        self.counterfactual_steps = 0  # steps that measured "never" beside the arm run
        self.asked = self.deferred = 0
        #: whether steps follow the rule, or ask the source always, or never (measured per batch size)
        self.policy = MeasuredChoice(ARMS)
        self.arm: str | None = None  # this step's (begin_step); None: the rule
        self._mode: str | None = None  # this step's drafting mode (the arms' scope)

    def begin_step(self, batch: int, mode: str | None = None) -> str:
        """Chooses how this step's deferring sources are asked (an arm of ARMS). `mode`: how the
        step drafts (serial or async: chosen beside this, by measurement too), measured apart."""
        self._mode = mode
        self.arm = self.policy.choose(batch, mode)
        return self.arm

    @property
    def promise_ratio(self) -> float:
        return self.got / self.promised

    def cost(self, source: Any, batch: int) -> float:
        """The source's drafting time over the target's forward time at this batch size."""
        seconds = source.measured_seconds(batch)
        forward = self.forward.get(bucket(batch))
        if seconds is not None and forward:
            return seconds / forward
        return float(source.relative_cost)

    def pays(self, index: int, source: Any, requests: Sequence[Any], promised: np.ndarray) -> bool:
        """Whether the source (the pipeline's external[index]) drafts this step."""
        drafting = [k for k, r in enumerate(requests) if r.budget > 0]
        if not drafting:
            return False
        if self.arm in ("always", "never"):
            ask = self.arm == "always"
        else:
            a_r = promised * self.promise_ratio
            alone = sum(1.0 + a_r[k] for k in drafting)
            both = sum(1.0 + max(a_r[k], source.expected_accepted(requests[k].budget)) for k in drafting)
            ask = (
                both > (1.0 + self.cost(source, len(drafting))) * alone
                or self.sat_out.get(index, 0) + 1 >= EXPLORE_EVERY
            )
            self.sat_out[index] = 0 if ask else self.sat_out.get(index, 0) + 1
        self.asked += ask
        self.deferred += not ask
        return ask

    def drafted(
        self,
        requests: Sequence[Any],
        promised: np.ndarray | None,
        retrieval_only: bool,
        alone: Any = None,
        source_seconds: float = 0.0,
    ) -> None:
        """What a step's trees promised, to compare with what they get (retrieval-only trees only);
        where a deferring source drafted beside retrieval (not `retrieval_only`), retrieval's own
        trees (`alone`, a DraftBatch) and the source's drafting seconds, for the step's
        counterfactual "never"."""
        self._pending = (
            {r.request_id: float(promised[k]) for k, r in enumerate(requests) if r.budget > 0}
            if retrieval_only and promised is not None
            else {}
        )
        self._alone, self._source_seconds = {}, float(source_seconds)
        if not retrieval_only and alone is not None:
            o = alone.offsets
            self._alone = {
                r.request_id: (alone.tokens[o[k] : o[k + 1]], alone.parents[o[k] : o[k + 1]])
                for k, r in enumerate(requests)
                if r.budget > 0
            }

    def observe_step(
        self,
        batch: int,
        forward_seconds: float,
        accepted: dict[int, int],
        seconds: float | None = None,
        tokens: int = 0,
        verified: dict[int, tuple[Sequence[int], int | None]] | None = None,
    ) -> None:
        """After a step: the target's forward time at this batch size, per request the draft tokens
        accepted (for the promise ratio, where the step's trees were retrieval's alone), and the
        whole step's seconds and emitted tokens (for the arm begun, if any). `verified`: per
        request of a greedy step, the target's tokens (accepted, then the bonus) and, where the
        request finished in it, how many it emitted (else None): the counterfactual "never"
        (module docstring) needs every request's."""
        if self.arm is not None and seconds is not None:
            self.policy.observe(batch, self.arm, seconds, tokens, self._mode)
            if self._alone and verified is not None and all(rid in verified for rid in accepted):
                got = 0
                for rid, (toks, cap) in verified.items():
                    tree = self._alone.get(rid)
                    would = 1 + (accepted_along(tree[0], tree[1], toks) if tree is not None else 0)
                    got += would if cap is None else min(would, cap)
                self.policy.observe_counterfactual(batch, "never", seconds - self._source_seconds, got, self._mode)
                self.counterfactual_steps += 1
        self.arm, self._alone = None, {}
        key = bucket(batch)
        old = self.forward.get(key)
        self.forward[key] = forward_seconds if old is None else 0.8 * old + 0.2 * forward_seconds
        pending, self._pending = self._pending, {}
        both = [(accepted[rid], p) for rid, p in pending.items() if rid in accepted]
        if both:
            got, prom = (float(sum(x)) for x in zip(*both))
            self.got = DECAY * self.got + got + (1 - DECAY) * PROMISE_PRIOR
            self.promised = DECAY * self.promised + prom + (1 - DECAY) * PROMISE_PRIOR
