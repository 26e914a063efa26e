"""AsyncEngine: the engine loop on its own thread, requests as async streams.

The model's forward passes block, so the step loop runs on one background
thread that owns the LLMEngine; the asyncio front end submits requests and
receives each request's outputs through an asyncio.Queue. A request whose
consumer goes away (client disconnect, timeout, cancellation) is aborted,
which frees its KV slot and drafter state.

Prompts are tokenized (and chat templates applied) on executor threads with
the front end's own copy of the tokenizer, outside the engine lock: a huge
prompt never holds up the running streams' steps.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable

from sssd.serving.engine import LLMEngine, RequestOutput, encode_prompt
from sssd.serving.engine.params import SamplingParams

log = logging.getLogger("sssd.serving")


class ShuttingDown(RuntimeError):
    """The server stopped admitting requests."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()  # guards the engine: its thread steps, handlers add/abort
        self._wakeup = threading.Event()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="sssd-engine", daemon=True)
        self._stop = threading.Event()
        self._aborts: deque[int] = deque()  # requests to cancel, drained by the engine thread
        self._tokenizer = copy.deepcopy(engine.tokenizer)  # the front end's own (fast tokenizers are not shareable)
        self._tokenizer_lock = threading.Lock()
        self._shutdown: asyncio.Task | None = None
        self.accepting = True
        self.drained: dict | None = None  # after shutdown: requests in flight, and those cut off
        self.errors = 0
        self.started = time.time()

    def start(self) -> None:
        self._thread.start()

    # -- the engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while self._aborts:
                    self.engine.abort(self._aborts.popleft())
                busy = self.engine.has_unfinished()
                # between requests: a piece of the start-up measurements (a request that arrives
                # meanwhile waits for at most that piece)
                measuring = not busy and self._idle_work()
                due = self.engine.measurements.due_in() if measuring and self.engine.measurements else 0.0
            if not busy:
                # between pieces, a short wait: the lock goes to a handler adding a request (Python's
                # lock does not hand over; re-taken at once, it would starve the handler); a retry
                # not due yet is waited for (a request wakes the loop at once)
                self._wakeup.wait(min(max(due, 0.005), 1.0) if measuring else 0.05)
                self._wakeup.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - keep serving: fail the requests in flight, not the server
                log.exception("engine step failed; failing the requests in flight")
                self.errors += 1
                outputs = self._abort_all("error", f"the engine step failed: {type(e).__name__}: {e}")
            for out in outputs:
                self._deliver(out)

    def _idle_work(self) -> bool:
        try:
            return self.engine.idle(0.2)
        except Exception:  # noqa: BLE001 - a measurement never takes the server down
            log.exception("measuring between requests failed; serving without it")
            self.engine.measurements = None
            return False

    def _abort_all(self, reason: str, error: str | None = None) -> list[RequestOutput]:
        with self._lock:
            for rid in list(self.engine.requests):
                self.engine.abort(rid, reason, error=error)
            return self.engine.collect_outputs()

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:  # the loop is closed
            pass

    # -- the asyncio side ---------------------------------------------------------------
    async def _call(self, fn: Callable, *args):
        """Runs an engine call under the lock without blocking the event loop."""

        def locked():
            with self._lock:
                return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(None, locked)

    async def add(self, prompt, params: SamplingParams, clip_max_tokens: bool = True) -> tuple[int, asyncio.Queue]:
        """Queues a request; raises ValueError (bad request; ContextLengthExceeded when it does
        not fit), OverflowError (queue full), ShuttingDown."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        limit = self.engine.max_prompt_tokens

        def tokenize() -> list[int]:
            with self._tokenizer_lock:
                return encode_prompt(self._tokenizer, prompt, limit)

        ids = await loop.run_in_executor(None, tokenize)
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")

        def add_and_register() -> int:
            # Under the engine lock, so that no step can produce this request's first
            # output before its stream exists (that output would be dropped).
            rid = self.engine.add_request(ids, params, clip_max_tokens=clip_max_tokens)
            self._streams[rid] = (loop, queue)
            return rid

        rid = await self._call(add_and_register)
        self._wakeup.set()
        return rid, queue

    async def stream(self, rid: int, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; aborts it if the consumer stops early."""
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                # No await here: under cancellation (a client that went away) it would
                # raise at once; the engine thread performs the abort.
                self.abort_nowait(rid)

    async def generate(self, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        rid, queue = await self.add(prompt, params)
        async for out in self.stream(rid, queue):
            yield out

    def abort_nowait(self, rid: int) -> None:
        """Asks the engine thread to cancel a request (frees its slot and drafter state)."""
        self._aborts.append(rid)
        self._wakeup.set()

    async def abort(self, rid: int) -> None:
        await self._call(self.engine.abort, rid)
        self._wakeup.set()

    # -- datastores (the admin endpoints) ------------------------------------------------------
    def datastores(self) -> list[dict]:
        """The datastores drafting now (sssd.datastore_source.list_datastores), with the draft
        tokens of each that were accepted so far ("accepted")."""
        from sssd.datastore_source import list_datastores

        with self._lock:
            drafting = self.engine.drafting
            listed = list_datastores(drafting) if drafting is not None else []
            accepted = dict(self.engine.metrics.accepted_by_source)
        return [dict(d, accepted=accepted.get(d["name"], 0)) for d in listed]

    async def add_datastore(self, path: str, name: str | None = None) -> dict:
        """Opens and checks a datastore on an executor thread (the running requests keep stepping),
        then adds it between two steps as a draft source of its own; returns its listing.

        Raises:
            FileNotFoundError, ValueError: it cannot be opened, is corrupt, does not fit the model,
                or the name is malformed (nothing changed). SourceConflict: the name is taken, the
                source limit is reached, or this engine does not draft.
        """
        from sssd.datastore_source import SourceConflict, add_datastore

        if self.engine.drafting is None:
            raise SourceConflict(
                "this server does not speculate (--no-speculate or --draft none): no datastore would draft"
            )
        ds = await asyncio.get_running_loop().run_in_executor(None, self.engine.check_datastore, path)

        def add() -> dict:
            source = add_datastore(self.engine.drafting, ds, name=name, default_name=path)
            return dict(source.info(), primary=False, accepted=0)

        added = await self._call(add)
        log.info("datastore %r added (%s, %d tokens)", added["name"], added["path"], added["tokens"])
        return added

    async def remove_datastore(self, name: str) -> dict:
        """Removes an added datastore between two steps (its requests' state is dropped); returns its
        listing. KeyError: no such datastore. SourceConflict: the primary (retrieval's) one."""
        from sssd.datastore_source import DatastoreSource, SourceConflict

        def remove() -> dict:
            drafting = self.engine.drafting
            found = [s for s in (drafting.external if drafting is not None else ()) if s.name == name]
            if not found or not isinstance(found[0], DatastoreSource):
                if name == "datastore" and drafting is not None and drafting.datastore is not None:
                    raise SourceConflict(
                        "'datastore' is the primary datastore (retrieval's, given first at "
                        "start); it cannot be removed while the server runs"
                    )
                raise KeyError(name)
            drafting.remove_source(name)
            return dict(found[0].info(), primary=False)

        removed = await self._call(remove)
        log.info("datastore %r removed", name)
        return removed

    @property
    def num_waiting(self) -> int:
        return len(self.engine.waiting)

    def machine_status(self) -> dict:
        """What /health says of the machine: the measurements still taken between requests, and
        the threads the engine runs while other processes' load on its cores takes some."""
        e = self.engine
        out: dict = {"measuring": e.measurements.status()["pending"] if e.measurements is not None else []}
        if e.contention is not None:
            out["threads"] = e.contention.current
            out["other_load_cores"] = round(e.contention.others, 2)
        return out

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    async def shutdown(self, grace: float = 30.0) -> None:
        """Stops admitting, lets running requests finish for up to `grace` seconds, then ends
        the rest with finish_reason "shutdown" (streams get an error event). Idempotent: a
        second call waits for the first."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._drain(grace))
        await asyncio.shield(self._shutdown)

    async def _drain(self, grace: float) -> None:
        self.accepting = False
        deadline = time.monotonic() + grace
        with self._lock:
            running = len(self.engine.requests)
        while time.monotonic() < deadline:
            with self._lock:
                if not self.engine.has_unfinished():
                    break
            await asyncio.sleep(0.05)
        cut = self._abort_all("shutdown")
        for out in cut:
            self._deliver(out)
        self._stop.set()
        self._wakeup.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5)
        self.drained = {"running": running, "cut": len(cut)}
        log.info(
            "engine stopped: %d requests were in flight, %d finished in the %.0f s drain, %d were cut off",
            running,
            running - len(cut),
            grace,
            len(cut),
        )
