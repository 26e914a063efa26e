"""SlotTable: which request holds which slot of a draft source's own KV pool.

A draft model (model_drafter.py) and self-speculation's sparse view (self_drafter.py) keep one KV
slot per open request, and before a pass they arrange the batch's requests into slots 0..n-1 so
the pass reads its keys as a plain slice. This is that bookkeeping, once.
"""

from __future__ import annotations

from typing import Callable


class SlotTable:
    """Request ids <-> slots 0..slots-1 (`what` names the pool in the error when it is full)."""

    def __init__(self, slots: int, what: str):
        self.owner: list[int | None] = [None] * slots  # slot -> request id
        self.slot: dict[int, int] = {}  # request id -> slot
        self.what = what

    def __contains__(self, request_id: int) -> bool:
        return request_id in self.slot

    def __getitem__(self, request_id: int) -> int:
        return self.slot[request_id]

    def get(self, request_id: int) -> int | None:
        return self.slot.get(request_id)

    def acquire(self, request_id: int) -> int:
        """A free slot for the request. Raises RuntimeError when all are taken."""
        try:
            s = self.owner.index(None)
        except ValueError:
            raise RuntimeError(f"all {len(self.owner)} {self.what} slots are taken") from None
        self.owner[s] = request_id
        self.slot[request_id] = s
        return s

    def release(self, request_id: int) -> int | None:
        """Frees the request's slot (None if it held none)."""
        s = self.slot.pop(request_id, None)
        if s is not None:
            self.owner[s] = None
        return s

    def arrange(self, request_ids: list[int], swap: Callable[[int, int, int, int | None], None]) -> None:
        """Moves the requests to slots 0..n-1 in order: `swap(a, b, request in a, request in b or
        None)` exchanges two slots' contents (the caller copies what each request's state spans)."""
        for i, rid in enumerate(request_ids):
            s = self.slot[rid]
            if s == i:
                continue
            other = self.owner[i]
            swap(s, i, rid, other)
            self.owner[s], self.owner[i] = other, rid
            self.slot[rid] = i
            if other is not None:
                self.slot[other] = s
