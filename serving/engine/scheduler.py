"""Scheduler: which requests hold KV slots, in what order, and which prompt chunks each step writes.

The running requests occupy slots 0..n-1 of the backend's KV pool, decoding ones first (0..d-1)
and prefilling ones after them (d..n-1), so that a forward pass over either group reads its keys
as a plain slice (a view, no gather). Admitting, promoting (prefill -> decode) and retiring keep
that order by swapping slots, which copies only the positions in use. Prompts are written in
chunks, at most `prefill_chunk` tokens a step across the prefilling requests, so a long prompt
never stalls decoding. Where the backend can (TorchBackend.fuses_prefill), a step's chunk rides in
its decode pass (the prefilling slots follow the decoding ones): one pass a step, not two, so a
request joining alone does not pay a pass of its own.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from sssd.serving.engine.requests import Request, Status
from sssd.serving.verify.tree_batch import TreeBatch, pack_chain


@dataclass
class PrefillChunk:
    """Prompt tokens to write in one pass: `batch` (chains, tree_batch.pack_chain) into `slots`,
    row i for `requests[i]`."""

    requests: list[Request]
    batch: TreeBatch
    slots: slice

    @property
    def tokens(self) -> int:
        return int(self.batch.sizes.sum())


class Scheduler:
    """The waiting queue and the slots of one backend.

    Args:
        backend: the VerifierBackend whose slots these are (swaps and prefill passes go to it).
        max_running: slots (requests decoded at once).
        prefill_chunk: prompt tokens written per step across prefilling requests.
    """

    def __init__(self, backend, max_running: int, prefill_chunk: int):
        self.backend = backend
        self.max_running, self.prefill_chunk = max_running, prefill_chunk
        self.waiting: deque[Request] = deque()
        self.slots: list[Request] = []  # slots[:num_decode] decode, the rest prefill
        self.num_decode = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.slots)

    def decoding(self) -> list[Request]:
        """The decoding requests, in slot order (row b of a decode step is slot b)."""
        return self.slots[: self.num_decode]

    def prefilling(self) -> bool:
        return self.num_decode < len(self.slots)

    def admit(self, opened: Callable[[Request], None]) -> None:
        """Moves waiting requests into free slots (`opened(req)` as each arrives: its drafter state)."""
        while self.waiting and len(self.slots) < self.max_running:
            req = self.waiting.popleft()
            if req.finished:
                continue
            req.slot = len(self.slots)
            req.status = Status.PREFILL
            self.slots.append(req)
            opened(req)
            if req.prompt_len == 1:
                self.promote(req)

    def promote(self, req: Request) -> None:
        """A request whose prompt is written starts decoding."""
        self._swap(req.slot, self.num_decode)
        self.num_decode += 1
        req.status = Status.DECODE

    def retire(self, req: Request) -> None:
        """Frees the request's slot (the last slots move into the gap)."""
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

    def next_chunk(self) -> PrefillChunk | None:
        """The next chunk of the prefilling requests' prompts, at most `prefill_chunk` tokens (None:
        nothing to write). Nothing is written yet: `prefill` runs it alone, or a decode step runs it
        in its own forward pass (LLMEngine.step) and then calls `written`."""
        budget = self.prefill_chunk
        rows, chunks, cached = [], [], []
        for req in self.slots[self.num_decode :]:
            if budget <= 0:
                break
            todo = req.prompt_len - 1 - req.cached  # the last prompt token is the first tree root
            n = min(todo, budget)
            rows.append(req)
            chunks.append(np.asarray(req.prompt_ids[req.cached : req.cached + n], dtype=np.int64))
            cached.append(req.cached)
            budget -= n
        if not rows:
            return None
        batch = pack_chain(np.asarray(cached), chunks)
        return PrefillChunk(rows, batch, slice(self.num_decode, self.num_decode + len(rows)))

    def written(self, chunk: PrefillChunk) -> None:
        """A chunk's K/V are in its slots: its requests advance, and those whose prompt is written
        start decoding (from the next step)."""
        for req, n in zip(chunk.requests, chunk.batch.sizes.tolist()):
            req.cached += n
            if req.cached == req.prompt_len - 1:
                self.promote(req)

    def prefill(self, metrics) -> None:
        """Writes the next chunk of the prefilling requests' prompts in a pass of its own; promotes
        those now written."""
        chunk = self.next_chunk()
        if chunk is None:
            return
        t0 = time.perf_counter()
        self.backend.prefill(chunk.slots, chunk.batch)
        metrics.prefill(chunk.tokens, time.perf_counter() - t0)
        self.written(chunk)

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        ra, rb = self.slots[a], self.slots[b]
        self.backend.swap(a, b, max(ra.cached, rb.cached))
        self.slots[a], self.slots[b] = rb, ra
        ra.slot, rb.slot = b, a
