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
import importlib
import logging
import os
import socket
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sssd.serving.backend import ModelInfo, NodeOutputs, VerifierBackend
from sssd.serving.tree_batch import TreeBatch

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
        raise ValueError(f"cannot split {layers} decoder layers into {stages} pipeline stages "
                         f"(1 to {layers} stages)")
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
    return Work(slots=np.arange(rows.start, rows.stop, dtype=np.int64),
                tokens=batch.tokens if stage == 0 else None, take=take,
                positions=batch.positions, writes=batch.writes,
                gather=np.broadcast_to(np.arange(S, dtype=np.int64), (B, S)).copy(),
                mask=batch.visible(), valid=batch.valid.copy(),
                recv_before=n if stage > 0 else 0, send=stage < stages - 1,
                result=result if stage == stages - 1 else None, ack=stage == stages - 1)


# -- the stage process ---------------------------------------------------------------------------

class _GatherStep:
    """attention.PoolStep's contract over gathered KV positions: writes this pass's K/V at
    `writes`, returns each row's K/V at `gather` [R, H_kv, L, D]."""

    def __init__(self, pool, first_layer: int, slots: torch.Tensor, writes: torch.Tensor, gather: torch.Tensor):
        sh = pool.shape
        self.pool, self.first = pool, first_layer
        heads = torch.arange(sh.kv_heads)[None, :, None]
        base = (slots[:, None, None] * sh.kv_heads + heads) * sh.capacity
        self.windex = (base + writes[:, None, :]).reshape(-1)
        self.gindex = (base + gather[:, None, :]).reshape(-1)
        self.shape = (slots.shape[0], sh.kv_heads, gather.shape[1], sh.head_dim)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer - self.first
        self.pool.write(i, self.windex, key, value)
        rows = self.pool._rows
        return (rows[2 * i].index_select(0, self.gindex).view(self.shape),
                rows[2 * i + 1].index_select(0, self.gindex).view(self.shape))


class _Stage:
    """The model slice one stage process runs."""

    def __init__(self, rank: int, stages: int, path: str, layers: tuple[int, int], slots: int, positions: int,
                 dtype: str):
        from transformers import AutoModelForCausalLM

        from sssd.serving import attention
        from sssd.serving.kv_cache import KVPool, PoolShape

        self.rank, self.stages = rank, stages
        self.first, self.last_layer = layers
        self.dtype = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, attn_implementation=attention.register(),
                                                     local_files_only=True)
        model.eval()
        inner = model.model
        self.layers = torch.nn.ModuleList(list(inner.layers[self.first:self.last_layer]))
        self.embed = inner.embed_tokens if rank == 0 else None
        self.rotary = inner.rotary_emb
        last = rank == stages - 1
        self.norm = inner.norm if last else None
        self.head = model.get_output_embeddings() if last else None
        text = getattr(model.config, "text_config", None) or model.config
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.hidden = text.hidden_size
        kept = list(self.layers.parameters()) + [p for m in (self.embed, self.norm, self.head) if m is not None
                                                 for p in m.parameters()]
        self.params = sum(p.numel() for p in {id(p): p for p in kept}.values())
        del model, inner  # the other stages' layers go with it
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
        self.pool = KVPool(PoolShape(layers=self.last_layer - self.first, kv_heads=kv_heads, head_dim=head_dim,
                                     slots=slots, capacity=positions), self.dtype)
        self.inbox: torch.Tensor | None = None  # the previous stage's output of the last pipelined step
        self._sending: tuple[Any, torch.Tensor] | None = None
        self._step_kwarg = attention.STEP_KWARG
        self.linear_plan = None
        from sssd.serving import linear_plan
        from sssd.serving.torch_backend import weights_identity

        if linear_plan.enabled(torch.device("cpu")):  # this stage's layers, timed in its own passes
            mods = torch.nn.ModuleList([m for m in (self.embed, *self.layers, self.norm, self.head) if m is not None])
            ident = dict(weights_identity(path, dtype, "cpu"), stage=[rank, stages, *layers])
            self.linear_plan = linear_plan.load_or_measure(mods, ident, time_rows=self._time_rows, busy_ok=True)
            linear_plan.install(mods, self.linear_plan)

    def _time_rows(self, rows: int, context: int = 256) -> float | None:
        """Seconds of this stage's pass over a chain of `rows` queries in slot 0 after `context`
        cached positions (the last stage's argmax included; no hand-over); None if it does not fit."""
        context = min(context, self.pool.shape.capacity - rows - 1)
        if context < 1:
            return None
        pos = np.arange(context, context + rows, dtype=np.int64)[None]
        length = context + rows
        mask = (np.arange(length)[None, None, :] <= pos[:, :, None])
        w = Work(slots=np.zeros(1, dtype=np.int64), tokens=np.zeros((1, rows), dtype=np.int64) if self.rank == 0 else None,
                 take=np.arange(rows, dtype=np.int64)[None] if self.rank > 0 else None, positions=pos, writes=pos,
                 gather=np.arange(length, dtype=np.int64)[None], mask=mask, valid=np.ones((1, rows), dtype=bool),
                 result=(np.ones(1, dtype=bool), 0) if self.rank == self.stages - 1 else None)
        saved, self.inbox = self.inbox, torch.zeros((rows, self.hidden), dtype=self.dtype)
        try:
            t0 = time.perf_counter()
            self.run(w)
            return time.perf_counter() - t0
        finally:
            self.inbox = saved

    def _recv(self, n: int) -> torch.Tensor:
        import torch.distributed as dist

        buf = torch.empty((n, self.hidden), dtype=self.dtype)
        dist.recv(buf, src=self.rank - 1)
        return buf

    @torch.inference_mode()
    def run(self, w: Work):
        import torch.distributed as dist

        if self._sending is not None:  # the previous hand-over must be done before this one's buffer
            self._sending[0].wait()
            self._sending = None
        given = self._recv(w.recv_before) if w.recv_before else self.inbox
        R, T = w.valid.shape
        outputs = None
        if R and T and w.valid.any():
            if self.rank == 0:
                h = self.embed(torch.from_numpy(w.tokens))
            else:
                take = torch.from_numpy(np.maximum(w.take, 0).reshape(-1))
                h = given.index_select(0, take).view(R, T, self.hidden)
            pos = torch.from_numpy(w.positions)
            mask = torch.from_numpy(w.mask)[:, None]
            step = _GatherStep(self.pool, self.first, torch.from_numpy(w.slots), torch.from_numpy(w.writes),
                               torch.from_numpy(w.gather))
            pe = self.rotary(h, position_ids=pos)
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe,
                          **{self._step_kwarg: step})
                if isinstance(h, tuple):
                    h = h[0]
            outputs = h[torch.from_numpy(w.valid)]  # [N, hidden], row-major over the valid queries
            if self.rank < self.stages - 1 and w.send:
                buf = outputs.contiguous()
                self._sending = (dist.isend(buf, dst=self.rank + 1), buf)
        if self.rank == self.stages - 1 and (w.result is not None or w.ack):
            return self._results(outputs, w) if (w.result is not None and outputs is not None) else ("ack",)
        return None

    def receive(self, w: Work) -> None:
        """The hand-over after a pipelined step: the previous stage's output, this stage's next input
        (after the results went out, so the driver verifies while earlier stages still compute)."""
        if w.recv_after:
            self.inbox = self._recv(w.recv_after)

    @torch.inference_mode()
    def _results(self, hidden: torch.Tensor, w: Work):
        greedy, topk = w.result
        h = self.norm(hidden)
        rows = np.nonzero(w.valid)[0]
        g = np.asarray(greedy, dtype=bool)[rows]
        argmax = np.full(len(rows), -1, dtype=np.int64)
        logits = top = None
        if g.any():
            gi = torch.from_numpy(np.flatnonzero(g))
            out = self.head(h[gi]).float()
            argmax[g] = out.argmax(-1).numpy()
            if topk:
                top = np.full((len(rows), topk), -1, dtype=np.int64)
                top[g] = out.topk(topk, dim=-1).indices.numpy()
        if (~g).any():
            si = torch.from_numpy(np.flatnonzero(~g))
            out = self.head(h[si]).float()
            if self.softcap:
                out = torch.tanh(out / self.softcap) * self.softcap
            logits = out.numpy()
            if topk:
                top = top if top is not None else np.full((len(rows), topk), -1, dtype=np.int64)
                top[~g] = out.topk(topk, dim=-1).indices.numpy()
        return ("result", argmax, logits, top)

    def swap(self, a: int, b: int, length: int, arena: tuple[int, int]) -> None:
        self.pool.swap(a, b, length)
        lo, hi = arena
        if a != b and hi > lo:
            kv = self.pool.kv
            tmp = kv[:, :, a, :, lo:hi].clone()
            kv[:, :, a, :, lo:hi] = kv[:, :, b, :, lo:hi]
            kv[:, :, b, :, lo:hi] = tmp


def _watch_parent(parent: int) -> None:
    """Ends this stage when the driver process is gone (a stage blocked in a gloo receive would
    otherwise wait for its timeout)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def _stage_main(rank: int, stages: int, port: int, path: str, layers: tuple[int, int], slots: int, positions: int,
                dtype: str, threads: int, timeout: float, address: str, parent: int) -> None:
    """A stage process: connects to the driver, joins the gloo group, loads its layers when told,
    then runs commands until told to stop (or the driver is gone)."""
    from multiprocessing.connection import Client

    host, p = address.rsplit(":", 1)
    conn = Client((host, int(p)), authkey=bytes.fromhex(os.environ.pop("SSSD_STAGE_KEY")))
    conn.send(str(rank))
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(max(1, threads))
    try:
        import torch.distributed as dist
        importlib.import_module("transformers.models.auto.modeling_auto")  # every stage at once, before the loads

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=stages,
                                timeout=timedelta(seconds=timeout))
        msg = conn.recv()
        if msg[0] != "load":
            return
        stage = _Stage(rank, stages, path, layers, slots, positions, dtype)
        conn.send(("ready", stage.params))
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "stop":
                break
            if kind == "work":
                out = stage.run(msg[1])
                if out is not None:
                    conn.send(out)
                stage.receive(msg[1])
            elif kind == "move":
                stage.pool.move(*msg[1:])
            elif kind == "swap":
                stage.swap(*msg[1:])
            elif kind == "crash":  # tests: a stage that dies mid-run
                os._exit(9)
    except (EOFError, KeyboardInterrupt, ConnectionError):  # the driver went away
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - report, then die: the driver shuts the others down
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)
    os._exit(0)  # no teardown handshake: the driver may already have stopped the other stages


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

    def __init__(self, model: str | Path, stages: int, slots: int, capacity: int, dtype: str = "float32",
                 threads: int = 1, arena: int = 64, timeout: float = DEFAULT_TIMEOUT, device: str | None = None):
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
            path=str(path), model_type=text.model_type, vocab_size=text.vocab_size,
            max_positions=int(getattr(text, "max_position_embeddings", 2048)),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ()),
            layer_types=tuple(layer_types) if layer_types else None,
            shape={"layers": text.num_hidden_layers, "hidden": text.hidden_size, "heads": text.num_attention_heads,
                   "kv_heads": kv_heads, "head_dim": head_dim, "vocab": text.vocab_size,
                   "intermediate": getattr(text, "intermediate_size", 4 * text.hidden_size),
                   "dtype_bytes": torch.finfo(self.dtype).bits // 8, "stages": stages})
        self._start(path, dtype)

    # -- processes ---------------------------------------------------------------------------
    def _start(self, path: Path, dtype: str) -> None:
        """Starts one process per stage (`python -m sssd.serving.pipeline_backend`: a fresh
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
                cmd = [sys.executable, "-m", "sssd.serving.pipeline_backend", str(k), str(self.stages), str(port),
                       str(path), str(a), str(b), str(self.slots), str(self.positions), dtype, str(self.threads),
                       str(self.timeout), f"{listener.address[0]}:{listener.address[1]}", str(os.getpid())]
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
        return f"pipeline stage {k} (pid {p.pid}, layers {self.ranges[k][0]}-{self.ranges[k][1] - 1}) died " \
               f"(exit code {p.returncode})"

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
                    self._fail(f"{cause} (stage {j} then failed: {msg[1].splitlines()[0][:160]})" if cause
                               else f"pipeline stage {j} failed: {msg[1]}")
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
        return {"backend": "pipeline", "stages": self.stages, "model": str(path),
                "mtime": (path / "config.json").stat().st_mtime, "dtype": str(self.dtype), "device": "cpu",
                "threads": self.threads, "slots": self.slots, "torch": torch.__version__}

    def profile(self, log=None, force: bool = False):
        from sssd.serving.profile import load_or_measure

        return load_or_measure(self, log=log, force=force)

    def describe(self) -> dict:
        return {"backend": "pipeline", "path": self.info.path, "model_type": self.info.model_type,
                "stages": self.stages, "layers": [list(r) for r in self.ranges], "threads_per_stage": self.threads,
                "dtype": str(self.dtype).replace("torch.", ""), "device": "cpu"}


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


def main(argv: list[str]) -> None:
    """Entry point of a stage process (PipelineBackend starts it)."""
    k, stages, port, path, a, b, slots, positions, dtype, threads, timeout, address, parent = argv
    _stage_main(int(k), int(stages), int(port), path, (int(a), int(b)), int(slots), int(positions), dtype,
                int(threads), float(timeout), address, int(parent))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
