"""The verifier backend protocol: what the scheduler needs from a target model.

A backend owns the model, its KV cache (a pool of per-request slots) and
accepted-path compaction. The scheduler (engine.py) decides which request
sits in which slot and what each step feeds; the backend runs it:

* ``prefill(rows, batch)`` writes prompt chunks into slots;
* ``launch(rows, batch, greedy, topk=0)`` starts one forward pass over
  packed draft trees (tree_batch.TreeBatch), ``collect(handle)`` returns
  what the acceptance needs: the argmax at every node of the greedy rows and
  the logits of the sampled rows' nodes (never float32 logits of every node
  when greedy needs only the argmax); with ``topk`` > 0, also the target's
  top-k next tokens at every node (for draft sources that observe them);
* ``compact(slots, src, dst)`` moves every accepted path's K/V into place in
  one operation; ``swap(a, b, length)`` exchanges two slots;
* ``profile()`` is the measured (or modelled) forward cost that the budget
  planner sees (planner.ForwardProfile); the planner never sees the model.

launch/collect split a step so that a CPU-side phase (drafting the next
step) can overlap an accelerator's forward pass; on the CPU backend launch
runs the pass and collect only hands over its results.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sssd.serving.verify.tree_batch import TreeBatch


@dataclass
class ModelInfo:
    path: str
    model_type: str
    vocab_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    shape: dict = field(default_factory=dict)  # layers, hidden, heads, kv_heads, head_dim, params (for cost models)


@dataclass
class NodeOutputs:
    """What a forward pass over a TreeBatch yields for acceptance.

    Attributes:
        argmax: [B, T] the target's argmax at each node of the greedy rows (-1 elsewhere).
        logits: the sampled rows' node logits [N_s, V] (float32, processed as the model
            defines: soft-capped where it soft-caps), or None when no row samples.
        logit_index: [B, T] row of `logits` holding each sampled node (-1 elsewhere).
        topk: [B, T, k] the target's k likeliest next tokens at every node, likeliest
            first (-1 at padding), when launch was asked for them; else None.
    """

    argmax: np.ndarray
    logits: Any = None
    logit_index: np.ndarray | None = None
    topk: np.ndarray | None = None

    def cropped(self, width: int) -> NodeOutputs:
        """The outputs of the first `width` query slots of every row (a decode step's trees, when a
        prompt chunk made the pass wider)."""
        return NodeOutputs(
            self.argmax[:, :width],
            self.logits,
            None if self.logit_index is None else self.logit_index[:, :width],
            None if self.topk is None else self.topk[:, :width],
        )


class VerifierBackend(abc.ABC):
    """A target model that verifies packed draft trees over its own KV slots."""

    info: ModelInfo
    slots: int  # KV slots (requests that can run at once)
    capacity: int  # tokens per slot
    #: launch(..., heads=n) takes prompt chunks in the rows after the first n (their K/V written,
    #: no outputs): a step's prefill rides in its decode pass (scheduler.py)
    fuses_prefill: bool = False

    @abc.abstractmethod
    def prefill(self, rows: slice, batch: TreeBatch) -> None:
        """Writes prompt chunks (chains, tree_batch.pack_chain) into slots `rows`."""

    @abc.abstractmethod
    def launch(self, rows: slice, batch: TreeBatch, greedy: np.ndarray, topk: int = 0, heads: int | None = None) -> Any:
        """Starts one forward pass over slots `rows` (greedy: [B] bool per row); returns a handle.
        With `topk` > 0 its NodeOutputs also hold the top-k next tokens at every node (the
        engine asks only when a draft source observes them: a backend without them may
        refuse). With `heads` (only where `fuses_prefill`), only the first `heads` rows yield
        outputs (NodeOutputs of `heads` rows); the rest are prompt chunks, written only."""

    @abc.abstractmethod
    def collect(self, handle: Any) -> NodeOutputs:
        """Waits for a launched pass and returns its NodeOutputs."""

    @abc.abstractmethod
    def compact(self, slots: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        """Moves KV positions src[i] -> dst[i] within slots[i] (every layer), reading before writing."""

    @abc.abstractmethod
    def swap(self, a: int, b: int, length: int) -> None:
        """Exchanges the first `length` positions of slots a and b."""

    @abc.abstractmethod
    def profile(self, log=None, force: bool = False):
        """The forward-time profile (planner.ForwardProfile) the budget planner plans with."""

    def describe(self) -> dict:
        return {"backend": type(self).__name__, "model": self.info.path}
