"""Scheduler: which requests hold KV slots, in what order, and which prompt chunks each step writes.

The running requests occupy slots 0..n-1 of the backend's KV pool, decoding ones first (0..d-1)
and prefilling ones after them (d..n-1), so that a forward pass over either group reads its keys
as a plain slice (a view, no gather). Admitting, promoting (prefill -> decode) and retiring keep
that order by swapping slots, which copies only the positions in use. Prompts are written in
chunks, at most `prefill_chunk` tokens a step across the prefilling requests, so a long prompt
never stalls decoding.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

from sssd.serving.engine.requests import Request, Status
from sssd.serving.verify.tree_batch import pack_chain


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

    def prefill(self, metrics) -> None:
        """Writes the next chunk of the prefilling requests' prompts; promotes those now written."""
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
            return
        t0 = time.perf_counter()
        batch = pack_chain(np.asarray(cached), chunks)
        self.backend.prefill(slice(self.num_decode, self.num_decode + len(rows)), batch)
        metrics.prefill(int(batch.sizes.sum()), time.perf_counter() - t0)
        for req, chunk in zip(rows, chunks):
            req.cached += len(chunk)
            if req.cached == req.prompt_len - 1:
                self.promote(req)

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        ra, rb = self.slots[a], self.slots[b]
        self.backend.swap(a, b, max(ra.cached, rb.cached))
        self.slots[a], self.slots[b] = rb, ra
        ra.slot, rb.slot = b, a
