"""A pipeline stage's process: layers [a, b) of the target, their K/V, and the work it is sent.

PipelineBackend (pipeline_backend.py) starts one per stage as
`python -m sssd.serving.backends.pipeline_stage ARGS`; see that module's docstring for the
protocol (the Work units, the schedules, how a stage that dies is noticed).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from sssd.serving.backends.pipeline_backend import Work

log = logging.getLogger("sssd.serving")


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
        return (
            rows[2 * i].index_select(0, self.gindex).view(self.shape),
            rows[2 * i + 1].index_select(0, self.gindex).view(self.shape),
        )


class _Stage:
    """The model slice one stage process runs."""

    def __init__(
        self, rank: int, stages: int, path: str, layers: tuple[int, int], slots: int, positions: int, dtype: str
    ):
        from transformers import AutoModelForCausalLM

        from sssd.serving.backends import attention
        from sssd.serving.backends.kv_cache import KVPool, PoolShape

        self.rank, self.stages = rank, stages
        self.first, self.last_layer = layers
        self.dtype = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, attn_implementation=attention.register(), local_files_only=True
        )
        model.eval()
        inner = model.model
        self.layers = torch.nn.ModuleList(list(inner.layers[self.first : self.last_layer]))
        self.embed = inner.embed_tokens if rank == 0 else None
        self.rotary = inner.rotary_emb
        last = rank == stages - 1
        self.norm = inner.norm if last else None
        self.head = model.get_output_embeddings() if last else None
        text = getattr(model.config, "text_config", None) or model.config
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.hidden = text.hidden_size
        kept = list(self.layers.parameters()) + [
            p for m in (self.embed, self.norm, self.head) if m is not None for p in m.parameters()
        ]
        self.params = sum(p.numel() for p in {id(p): p for p in kept}.values())
        del model, inner  # the other stages' layers go with it
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
        self.pool = KVPool(
            PoolShape(
                layers=self.last_layer - self.first,
                kv_heads=kv_heads,
                head_dim=head_dim,
                slots=slots,
                capacity=positions,
            ),
            self.dtype,
        )
        self.inbox: torch.Tensor | None = None  # the previous stage's output of the last pipelined step
        self._sending: tuple[Any, torch.Tensor] | None = None
        self._step_kwarg = attention.STEP_KWARG
        self.linear_plan = None
        from sssd.serving.backends import linear_plan
        from sssd.serving.backends.torch_backend import weights_identity

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
        mask = np.arange(length)[None, None, :] <= pos[:, :, None]
        w = Work(
            slots=np.zeros(1, dtype=np.int64),
            tokens=np.zeros((1, rows), dtype=np.int64) if self.rank == 0 else None,
            take=np.arange(rows, dtype=np.int64)[None] if self.rank > 0 else None,
            positions=pos,
            writes=pos,
            gather=np.arange(length, dtype=np.int64)[None],
            mask=mask,
            valid=np.ones((1, rows), dtype=bool),
            result=(np.ones(1, dtype=bool), 0) if self.rank == self.stages - 1 else None,
        )
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
            step = _GatherStep(
                self.pool, self.first, torch.from_numpy(w.slots), torch.from_numpy(w.writes), torch.from_numpy(w.gather)
            )
            pe = self.rotary(h, position_ids=pos)
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe, **{self._step_kwarg: step})
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


def _stage_main(
    rank: int,
    stages: int,
    port: int,
    path: str,
    layers: tuple[int, int],
    slots: int,
    positions: int,
    dtype: str,
    threads: int,
    timeout: float,
    address: str,
    parent: int,
) -> None:
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

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=stages,
            timeout=timedelta(seconds=timeout),
        )
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


def main(argv: list[str]) -> None:
    """Entry point of a stage process (PipelineBackend starts it)."""
    k, stages, port, path, a, b, slots, positions, dtype, threads, timeout, address, parent = argv
    _stage_main(
        int(k),
        int(stages),
        int(port),
        path,
        (int(a), int(b)),
        int(slots),
        int(positions),
        dtype,
        int(threads),
        float(timeout),
        address,
        int(parent),
    )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
