"""PipelineBackend: the target's decoder layers split into stages, one process per stage.

Stage k (a process of its own, torch.distributed rank k over gloo; NCCL would
serve GPUs the same way) holds layers [a_k, b_k) of the model and their K/V
only; stage 0 also holds the token embedding, the last stage the final norm
and the output head. Activations (hidden states [nodes, hidden]) pass from
stage k to stage k + 1 with torch.distributed send/recv; the driver (the
engine's process, which loads no weights) tells every stage what to compute
through a pipe of its own and receives the last stage's outputs (argmax,
logits, top-k) the same way, so it can poll with a timeout and watch that
every stage is alive while it waits: a stage that dies, or raises, fails the
pass with a PipelineError naming it, and the other stages are shut down.

A unit of work (`Work`) is one forward pass of one stage over nodes laid out
as [R, T] (R slots, T queries per slot): each query's model position, the
KV position its K/V is written to, and the KV positions its slot's queries
read (gathered per row, so a slot's tree nodes may live anywhere in it) with
a visibility mask over them. Two schedules use it:

* sequential (the VerifierBackend protocol: `prefill`, `launch`/`collect`):
  one pass goes through stage 0, then 1, ... (each stage receives its input
  before computing); the engine's ordinary loop then runs plain decoding or
  non-pipelined speculation over the stages unchanged;
* pipelined (specpipe.py): every stage computes at once on different work
  and then hands its output on ("inter-node transmission"): stage k + 1
  receives it after its own computation, for the next pipeline step, and
  keeps only the rows the driver names then (pruning propagation).

Each slot has `capacity` positions for committed tokens, then an arena of
`arena` positions for in-flight tree nodes (specpipe.py places them), then
one scratch position that padding queries write to and read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sssd.serving.backends.base import ModelInfo, NodeOutputs, VerifierBackend
from sssd.serving.verify.tree_batch import TreeBatch

log = logging.getLogger("sssd.serving")

#: Seconds a pass may take before the driver gives up on the stages (they are then shut down).
DEFAULT_TIMEOUT = 300.0
#: Seconds between the driver's liveness checks while it waits.
POLL_SECONDS = 0.05


class PipelineError(RuntimeError):
    """A pipeline stage died, raised or did not answer: the pipeline is shut down."""


def split_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """[a, b) layer ranges of `stages` stages as even as can be (earlier stages take the extra)."""
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot split {layers} decoder layers into {stages} pipeline stages (1 to {layers} stages)")
    base, extra = divmod(layers, stages)
    out, a = [], 0
    for k in range(stages):
        b = a + base + (k < extra)
        out.append((a, b))
        a = b
    return out


@dataclass
class Work:
    """One stage's forward pass over R rows (slots) of T queries.

    Attributes:
        slots: [R] the rows' KV slots.
        tokens: [R, T] token ids (stage 0 only; else None).
        take: [R, T] the row of the stage's input holding each query's hidden state (-1: padding;
            stages > 0 only).
        positions: [R, T] model positions.
        writes: [R, T] KV positions the queries' K/V go to.
        gather: [R, L] KV positions each row's queries read.
        mask: [R, T, L] bool: query (r, t) sees gathered position l.
        valid: [R, T] bool: real queries (their outputs are kept, in row-major order).
        recv_before: rows to receive from the previous stage before computing (the input; sequential).
        recv_after: rows to receive from the previous stage after computing (the next step's input).
        send: hand the valid outputs to the next stage.
        result: for the last stage: (greedy [R] bool, topk) to send the driver the outputs, or
            None to send only an acknowledgement (sequential) / nothing (pipelined, no nodes).
        ack: the last stage answers even without a result (sequential passes).
    """

    slots: np.ndarray
    tokens: np.ndarray | None
    take: np.ndarray | None
    positions: np.ndarray
    writes: np.ndarray
    gather: np.ndarray
    mask: np.ndarray
    valid: np.ndarray
    recv_before: int = 0
    recv_after: int = 0
    send: bool = False
    result: tuple[np.ndarray, int] | None = None
    ack: bool = False


def work_from_batch(rows: slice, batch: TreeBatch, stage: int, stages: int, result=None) -> Work:
    """The sequential pass of stage `stage` over a packed TreeBatch (the engine's layout: node i of
    row b written at cached + i; the row reads positions [0, kv_length))."""
    B, T = batch.shape
    n = int(batch.valid.sum())
    S = batch.kv_length
    take = None
    if stage > 0:
        take = np.full((B, T), -1, dtype=np.int64)
        take[batch.valid] = np.arange(n)
    return Work(
        slots=np.arange(rows.start, rows.stop, dtype=np.int64),
        tokens=batch.tokens if stage == 0 else None,
        take=take,
        positions=batch.positions,
        writes=batch.writes,
        gather=np.broadcast_to(np.arange(S, dtype=np.int64), (B, S)).copy(),
        mask=batch.visible(),
        valid=batch.valid.copy(),
        recv_before=n if stage > 0 else 0,
        send=stage < stages - 1,
        result=result if stage == stages - 1 else None,
        ack=stage == stages - 1,
    )


# -- the stage process ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the driver ---------------------------------------------------------------------------------


class PipelineBackend(VerifierBackend):
    """A causal LM split into `stages` processes (pipeline parallelism), verifying draft trees.

    Args:
        model: a local Hugging Face model folder.
        stages: pipeline stages (processes); the decoder layers are split evenly.
        slots / capacity: the KV pool (requests at once, committed tokens per request).
        dtype: torch dtype name ("float32" for exact equality tests).
        threads: torch threads per stage process (1: one core each).
        arena: KV positions per slot for in-flight tree nodes (the pipelined schedule's).
        timeout: seconds a pass may take before the stages are declared hung and shut down.

    Raises:
        ValueError: not a causal LM folder, an architecture with sliding-window layers, or a
            stage count outside [1, layers].
        PipelineError: a stage failed to start or load.
    """

    def __init__(
        self,
        model: str | Path,
        stages: int,
        slots: int,
        capacity: int,
        dtype: str = "float32",
        threads: int = 1,
        arena: int = 64,
        timeout: float = DEFAULT_TIMEOUT,
        device: str | None = None,
    ):
        from transformers import AutoConfig

        if device not in (None, "cpu"):
            raise ValueError(f"the pipeline backend runs its stages on the CPU (gloo); got device {device!r}")
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model folder (no config.json)")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        text = getattr(config, "text_config", None) or config
        layer_types = getattr(text, "layer_types", None)
        if layer_types and "sliding_attention" in layer_types:
            raise ValueError(f"{path}: pipeline stages do not support sliding-window attention layers yet")
        if isinstance(stages, bool) or not isinstance(stages, int):
            raise ValueError(f"pipeline stages must be an int, got {stages!r}")
        self.ranges = split_layers(text.num_hidden_layers, stages)
        self.stages = stages
        self.slots, self.capacity, self.arena = slots, capacity, arena
        self.positions = capacity + arena + 1
        self.trash = capacity + arena  # where padding queries write and read
        self.dtype = getattr(torch, dtype)
        self.device = torch.device("cpu")  # where the stages run (the driver holds no tensors of the model)
        self.threads = threads
        self.timeout = timeout
        self.dead: str | None = None
        eos = getattr(text, "eos_token_id", None)
        try:
            from transformers import GenerationConfig

            g = GenerationConfig.from_pretrained(path, local_files_only=True)
            eos = g.eos_token_id if g.eos_token_id is not None else eos
        except Exception:  # noqa: BLE001 - no generation_config.json
            pass
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
        self.info = ModelInfo(
            path=str(path),
            model_type=text.model_type,
            vocab_size=text.vocab_size,
            max_positions=int(getattr(text, "max_position_embeddings", 2048)),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ()),
            layer_types=tuple(layer_types) if layer_types else None,
            shape={
                "layers": text.num_hidden_layers,
                "hidden": text.hidden_size,
                "heads": text.num_attention_heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                "vocab": text.vocab_size,
                "intermediate": getattr(text, "intermediate_size", 4 * text.hidden_size),
                "dtype_bytes": torch.finfo(self.dtype).bits // 8,
                "stages": stages,
            },
        )
        self._start(path, dtype)

    # -- processes ---------------------------------------------------------------------------
    def _start(self, path: Path, dtype: str) -> None:
        """Starts one process per stage (`python -m sssd.serving.backends.pipeline_stage`: a fresh
        interpreter, whatever the caller's main module does) and loads them one at a time."""
        import secrets
        import subprocess
        import sys
        from multiprocessing.connection import Listener

        port = _free_port()
        key = secrets.token_bytes(16)
        self.procs, self.conns = [], []
        with Listener(("127.0.0.1", 0), authkey=key) as listener:
            with contextlib.suppress(AttributeError):  # a stage that dies before it calls back must not hang us
                listener._listener._socket.settimeout(self.timeout)
            env = dict(os.environ, SSSD_STAGE_KEY=key.hex(), OMP_NUM_THREADS=str(max(1, self.threads)))
            for k in range(self.stages):
                a, b = self.ranges[k]
                cmd = [
                    sys.executable,
                    "-m",
                    "sssd.serving.backends.pipeline_stage",
                    str(k),
                    str(self.stages),
                    str(port),
                    str(path),
                    str(a),
                    str(b),
                    str(self.slots),
                    str(self.positions),
                    dtype,
                    str(self.threads),
                    str(self.timeout),
                    f"{listener.address[0]}:{listener.address[1]}",
                    str(os.getpid()),
                ]
                self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
            self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns)
            try:
                hello = {}
                for _ in range(self.stages):
                    c = listener.accept()
                    hello[int(c.recv())] = c
                self.conns.extend(hello[k] for k in range(self.stages))
            except (OSError, EOFError, KeyError, ValueError) as e:
                dead = [self._death(k) for k in range(self.stages)]
                self._fail(next((d for d in dead if d), f"pipeline stages did not start ({e})"))
        params = 0
        for k in range(self.stages):  # one at a time: each loads the whole checkpoint before dropping layers
            self._send(k, ("load",))
            msg = self._wait(k, f"loading layers {self.ranges[k][0]}-{self.ranges[k][1] - 1}")
            params += int(msg[1])
        self.info.shape["params"] = params

    def _send(self, k: int, msg) -> None:
        self._check()
        try:
            self.conns[k].send(msg)
        except (BrokenPipeError, ConnectionError, OSError):
            self._fail(self._gone(k))

    def _gone(self, k: int) -> str:
        """Why stage k closed its pipe: its exit, once the process is reaped (a second at most)."""
        import subprocess

        try:
            self.procs[k].wait(1.0)
        except subprocess.TimeoutExpired:
            pass
        return self._death(k) or f"pipeline stage {k} closed its pipe"

    def _dead_peer(self, k: int) -> str | None:
        """The first stage other than k found dead within a second, if any."""
        deadline = time.monotonic() + 1.0
        while True:
            dead = next((d for d in (self._death(j) for j in range(self.stages) if j != k) if d), None)
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def _death(self, k: int) -> str | None:
        p = self.procs[k]
        if p.poll() is None:
            return None
        return (
            f"pipeline stage {k} (pid {p.pid}, layers {self.ranges[k][0]}-{self.ranges[k][1] - 1}) died "
            f"(exit code {p.returncode})"
        )

    def _wait(self, k: int, what: str):
        """The next message from stage k; fails the pipeline if any stage reports an error, dies, or
        `timeout` seconds pass first."""
        deadline = time.monotonic() + self.timeout
        while True:
            self._check()
            for j, c in enumerate(self.conns):
                try:
                    ready = c.poll(POLL_SECONDS if j == k else 0)
                except (EOFError, OSError):
                    ready = False
                if not ready:
                    continue
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    self._fail(self._gone(j))
                if msg[0] == "error":
                    log.error("pipeline stage %d failed:\n%s", j, msg[2])
                    cause = self._dead_peer(j)  # a stage that lost its neighbour: name the one that died
                    self._fail(
                        f"{cause} (stage {j} then failed: {msg[1].splitlines()[0][:160]})"
                        if cause
                        else f"pipeline stage {j} failed: {msg[1]}"
                    )
                if j == k:
                    return msg
                self._fail(f"pipeline stage {j} sent {msg[0]!r} unasked")
            for j in range(self.stages):
                dead = self._death(j)
                if dead:
                    self._fail(dead)
            if time.monotonic() > deadline:
                self._fail(f"pipeline stage {k} did not finish {what} within {self.timeout:g} s")

    def _check(self) -> None:
        if self.dead is not None:
            raise PipelineError(f"the pipeline is down: {self.dead}")

    def _fail(self, why: str):
        self.dead = why
        _shutdown(self.procs, self.conns)
        raise PipelineError(f"{why}; the other pipeline stages were shut down")

    def close(self) -> None:
        """Stops the stage processes."""
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()
        if self.dead is None:
            self.dead = "closed"

    # -- passes --------------------------------------------------------------------------------
    def submit(self, works: list[Work]) -> None:
        """Hands one pass's (or pipeline step's) work to every stage."""
        for k, w in enumerate(works):
            self._send(k, ("work", w))

    def result(self, what: str = "a forward pass"):
        """The last stage's answer to the last submitted work that asked for one."""
        return self._wait(self.stages - 1, what)

    def move(self, per_stage: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """KV moves (slots, src, dst) per stage, applied before that stage's next work."""
        if self.dead is not None:
            return  # nothing left to keep consistent (retiring requests of a failed pipeline must work)
        for k, (slots, src, dst) in enumerate(per_stage):
            if len(slots):
                self._send(k, ("move", np.asarray(slots), np.asarray(src), np.asarray(dst)))

    def prefill(self, rows: slice, batch: TreeBatch) -> None:
        self.submit([work_from_batch(rows, batch, k, self.stages) for k in range(self.stages)])
        self.result("a prefill pass")

    def launch(self, rows: slice, batch: TreeBatch, greedy: np.ndarray, topk: int = 0) -> Any:
        spec = (np.asarray(greedy, dtype=bool).copy(), int(topk))
        self.submit([work_from_batch(rows, batch, k, self.stages, result=spec) for k in range(self.stages)])
        return batch, greedy, int(topk)

    def collect(self, handle: Any) -> NodeOutputs:
        batch, greedy, topk = handle
        _, am, logits, top = self.result()
        B, T = batch.shape
        b, i = np.nonzero(batch.valid)
        argmax = np.full((B, T), -1, dtype=np.int64)
        argmax[b, i] = am
        tk = None
        if topk:
            tk = np.full((B, T, topk), -1, dtype=np.int64)
            tk[b, i] = top
        if logits is None:
            return NodeOutputs(argmax, topk=tk)
        s = am < 0
        index = np.full((B, T), -1, dtype=np.int64)
        index[b[s], i[s]] = np.arange(int(s.sum()))
        return NodeOutputs(argmax, torch.from_numpy(logits), index, tk)

    # -- the KV pool -----------------------------------------------------------------------------
    def compact(self, slots: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        self.move([(slots, src, dst)] * self.stages)

    def swap(self, a: int, b: int, length: int) -> None:
        if a == b or self.dead is not None:
            return
        for k in range(self.stages):  # the arena moves with the slot: in-flight nodes live there
            self._send(k, ("swap", a, b, length, (self.capacity, self.capacity + self.arena)))

    def crash_stage(self, k: int) -> None:
        """Kills stage k abruptly (for tests of what a dead stage does)."""
        self._send(k, ("crash",))

    # -- cost ----------------------------------------------------------------------------------
    def identity(self) -> dict:
        path = Path(self.info.path)
        return {
            "backend": "pipeline",
            "stages": self.stages,
            "model": str(path),
            "mtime": (path / "config.json").stat().st_mtime,
            "dtype": str(self.dtype),
            "device": "cpu",
            "threads": self.threads,
            "slots": self.slots,
            "torch": torch.__version__,
        }

    def profile(self, log=None, force: bool = False):
        from sssd.serving.planning.profile import load_or_measure

        return load_or_measure(self, log=log, force=force)

    def describe(self) -> dict:
        return {
            "backend": "pipeline",
            "path": self.info.path,
            "model_type": self.info.model_type,
            "stages": self.stages,
            "layers": [list(r) for r in self.ranges],
            "threads_per_stage": self.threads,
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": "cpu",
        }


def _shutdown(procs, conns) -> None:
    """Stops every stage: asks, then terminates, then kills; never waits long."""
    import subprocess

    for c in conns:
        try:
            c.send(("stop",))
        except Exception:  # noqa: BLE001
            pass
    deadline = time.monotonic() + 2.0
    for p in procs:
        try:
            p.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(1.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(1.0)
    for c in conns:
        try:
            c.close()
        except Exception:  # noqa: BLE001
            pass
