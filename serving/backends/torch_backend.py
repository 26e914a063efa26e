"""TorchBackend: a Hugging Face causal LM verifying packed draft trees over its KV pool.

One forward pass serves a group of slots: row b feeds T tokens at explicit
positions with an explicit mask (each tree node sees the request's cached
context and its own ancestors; a prefill chunk is a chain). The model's own
layers do everything else (projections, rotary embeddings, norms, MLPs);
attention is ours (attention.py): it reads and writes the KV pool directly,
so no cache object crosses the model's forward signature. Any architecture
whose HF implementation dispatches attention through transformers'
AttentionInterface works (Llama, Qwen2, Gemma3 are tested).

After the pass, greedy rows need only the argmax at each node: it is taken
chunk by chunk through the output embedding, so the float32 logits of every
node never exist at once. Only sampled rows' nodes get full logits. When a
draft source observes the target's top-k next tokens, they come from the
same logits (the same chunks for greedy rows).

On a CUDA device a step costs two host-to-device copies (one pinned buffer
of the step's integer arrays, one of its tree masks; the attention mask is
built on the device from the trees' ancestor relation) and one copy back
(the argmax, and top-k, of the verified nodes). `launch` only enqueues the
pass and that copy; `collect` waits for it, so the CPU drafts the next step
while the GPU verifies this one (async drafting).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from sssd.serving.backends import attention, devices, linear_plan
from sssd.serving.backends.base import ModelInfo, NodeOutputs, VerifierBackend
from sssd.serving.backends.kv_cache import KVPool, PoolShape
from sssd.serving.verify.tree_batch import TreeBatch

#: Bytes of logits one argmax chunk may hold: small on a CPU (cache-sized work), large on a GPU
#: (each chunk is a kernel launch; a pass over 256 rows of 65 tokens is 16k nodes).
ARGMAX_CHUNK_BYTES = {"cpu": 32 * 2**20, "cuda": 2**30}
#: What an in-memory model (not loaded from a folder) is called in profiles and messages.
IN_MEMORY = "<in-memory>"


def weights_identity(
    path: str | Path, dtype: torch.dtype | str, device: torch.device | str, config: dict | None = None
) -> dict:
    """What the speed of one of a model's matrix products depends on (the linear plan's and the
    forward profile's cache key). A model built in memory (`config` given) is known by its config."""
    path = Path(path)
    if config is not None:
        import hashlib

        which = {"config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]}
    else:
        which = {"mtime": (path / "config.json").stat().st_mtime}
    if torch.device(device).type == "cuda":
        which["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return {
        "model": str(path),
        **which,
        "dtype": str(dtype),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


def tree_mask(cached: torch.Tensor, valid: torch.Tensor, ancestors: torch.Tensor, length: int) -> torch.Tensor:
    """TreeBatch.visible() computed where its inputs are (on the GPU: only the [B, T, T] ancestor
    relation crosses, not the [B, T, S] mask): [B, T, S] bool, each query seeing its row's cached
    context and its own ancestors; padding queries see only themselves."""
    B, T = valid.shape
    cols = torch.arange(length, device=valid.device)
    mask = (cols[None, None, :] < cached[:, None, None]) & valid[:, :, None]
    own = (cached[:, None] + torch.arange(T, device=valid.device)[None, :])[:, None, :].expand(B, T, T)
    return mask.scatter_(2, own, ancestors)


def kv_positions(writes: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
    """TreeBatch.kv_positions() where its inputs are: [B, S] the model position at each KV slot
    position after this pass's writes."""
    out = torch.arange(length, device=writes.device).expand(writes.shape[0], length).clone()
    return out.scatter_(1, writes, positions)


class _Sent:
    """Host arrays sent to the device in one copy: packed into one pinned buffer (torch's caching
    host allocator keeps the buffer until the copy that reads it has run), then sliced there."""

    _TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool, np.dtype(np.int32): torch.int32}

    @classmethod
    def send(cls, device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
        if device.type != "cuda":
            return [
                torch.from_numpy(np.ascontiguousarray(a))
                if device.type == "cpu"
                else torch.from_numpy(np.ascontiguousarray(a)).to(device)
                for a in arrays
            ]
        arrays = [np.ascontiguousarray(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // 64) * 64
        host = torch.empty(max(total, 64), dtype=torch.uint8, pin_memory=True)
        flat = host.numpy()
        for a, off in zip(arrays, offsets):
            flat[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        dev = host.to(device, non_blocking=True)
        return [dev[off : off + a.nbytes].view(cls._TORCH[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]


class _Pending:
    """A launched pass: device results on their way to pinned host buffers, and an event that
    says when they are there (None on a CPU, where they already are)."""

    def __init__(self, shape: tuple[int, int], k: int):
        self.shape, self.k = shape, k
        self.greedy: tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor | None] | None = None
        self.sampled: tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor | None] | None = None
        self.event = None

    @staticmethod
    def to_host(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None or x.device.type == "cpu":
            return x
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return out.copy_(x, non_blocking=True)


class TorchBackend(VerifierBackend):
    """Loads a causal LM and verifies trees over a pool of `slots` KV slots of `capacity` tokens.

    Args:
        model: a local Hugging Face model folder (config.json + weights).
        slots / capacity: the KV pool (requests at once, tokens per request).
        dtype: torch dtype name ("float32" for exact equality tests).
        device: "cpu", "cuda", ... (default: CUDA if available).
        threads: torch intra-op threads (None: torch's default).
        plan_linears: let each linear layer pick its CPU kernel by row count as measured on this
            machine (linear_plan.py; also off with SSSD_LINEAR_PLAN=off).
        measure_now: measure a plan that is not cached yet here, before the first pass (True), or
            leave it to `linear_plan_steps`, which an engine takes between requests (False: torch's
            layers until then).
        log: where progress goes (the linear plan's first measurement).
    """

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        slots: int,
        capacity: int,
        dtype: str = "float32",
        device: str | None = None,
        threads: int | None = None,
        plan_linears: bool = True,
        log=None,
        measure_now: bool = True,
    ):
        self.device = devices.resolve(device)  # before anything loads: a one-line error naming what is here
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype (float32, bfloat16, float16)")
        self.dtype = getattr(torch, str(dtype))
        if threads:
            torch.set_num_threads(threads)
        if isinstance(model, torch.nn.Module):  # built in memory (benchmarks: random weights of a named shape)
            self._path, self._config_dict = Path(IN_MEMORY), model.config.to_dict()
            model.set_attn_implementation(attention.register())
            self.model = self._to_device(model.to(self.dtype))
        else:
            self._path, self._config_dict = Path(model), None
            self.model = self._load(self._path)
        self.model.eval()
        self.linear_plan = None
        self.config = self.model.config
        text = getattr(self.config, "text_config", None) or self.config
        path = self._path
        generation = getattr(self.model, "generation_config", None)
        eos = generation.eos_token_id if generation else None
        eos = eos if eos is not None else text.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        layer_types = getattr(text, "layer_types", None)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
        self.info = ModelInfo(
            path=str(path),
            model_type=text.model_type,
            vocab_size=text.vocab_size,
            max_positions=int(getattr(text, "max_position_embeddings", 2048)),
            eos_token_ids=eos_ids,
            sliding_window=getattr(text, "sliding_window", None)
            if layer_types and "sliding_attention" in layer_types
            else None,
            layer_types=tuple(layer_types) if layer_types else None,
            shape={
                "layers": text.num_hidden_layers,
                "hidden": text.hidden_size,
                "heads": text.num_attention_heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                "vocab": text.vocab_size,
                "intermediate": getattr(text, "intermediate_size", 4 * text.hidden_size),
                "params": sum(p.numel() for p in self.model.parameters()),
                "dtype_bytes": torch.finfo(self.dtype).bits // 8,
            },
        )
        self._softcap = getattr(text, "final_logit_softcapping", None)
        self._attention_softcap = getattr(text, "attn_logit_softcapping", None)
        #: grouped-query heads folded along the queries (attention.folded_attention); None: on CUDA
        self.fold_attention: bool | None = None
        #: trees of unequal size run ragged: every linear layer over the real tokens only, so a pass
        #: costs what its tokens cost, not rows x the largest tree (SSSD_RAGGED=0 pads every row)
        self.ragged = os.environ.get("SSSD_RAGGED", "1").strip() not in ("0", "off", "false")
        self._head = self.model.get_output_embeddings()
        self.slots, self.capacity = slots, capacity
        shape = PoolShape(
            layers=text.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, slots=slots, capacity=capacity
        )
        try:
            self.pool = KVPool(shape, self.dtype, self.device)
        except RuntimeError as e:
            if not devices.is_out_of_memory(e):
                raise
            raise devices.out_of_memory(
                "the KV pool",
                shape.bytes(self.dtype),
                f"{slots} slots x {capacity} tokens x {shape.layers} layers x {kv_heads} KV heads x {head_dim} x "
                f"K and V x {torch.finfo(self.dtype).bits // 8} bytes",
                self.device,
                "Lower --max-running (slots) or --max-model-len (tokens per slot).",
            ) from None
        self._threads = threads
        #: a linear plan is to be measured (linear_plan_steps) before the layers follow one
        self.linear_plan_pending = False
        if plan_linears and linear_plan.enabled(self.device):
            if measure_now:
                self.linear_plan = linear_plan.load_or_measure(
                    self.model, self._weights_identity(), log=log, time_rows=self._time_rows
                )
            else:
                self.linear_plan = linear_plan.cached(self.model, self._weights_identity(), log=log)
                self.linear_plan_pending = self.linear_plan is None
            linear_plan.install(self.model, self.linear_plan)

    def _load(self, path: Path) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model folder (no config.json)")
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise ValueError(f"{path}: cannot read the model config ({e})") from e
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

        arch = list(getattr(config, "architectures", None) or [])
        causal = (
            any(a in set(CAUSAL.values()) or a.endswith("ForCausalLM") for a in arch)
            if arch
            else config.model_type in CAUSAL
        )
        if getattr(config, "is_encoder_decoder", False) or not causal:
            raise ValueError(f"{path} is not a causal language model (architectures: {arch or config.model_type})")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=self.dtype, attn_implementation=attention.register(), local_files_only=True
            )
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: cannot load it as a causal language model ({str(e).splitlines()[0]})") from e
        return self._to_device(model)

    def _to_device(self, model: torch.nn.Module) -> torch.nn.Module:
        try:
            return model.to(self.device)
        except RuntimeError as e:
            if not devices.is_out_of_memory(e):
                raise
            n = sum(p.numel() for p in model.parameters())
            raise devices.out_of_memory(
                "the model's weights",
                n * torch.finfo(self.dtype).bits // 8,
                f"{n / 1e9:.2f}B parameters in {str(self.dtype).replace('torch.', '')}",
                self.device,
                "Use a smaller dtype or a larger device.",
            ) from None

    # -- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, rows: slice, batch: TreeBatch, heads: int | None = None) -> torch.Tensor:
        """Final hidden states [B, T, hidden] of one pass over slots `rows` (rows from `heads` on:
        prompt chunks beside a decode step's trees, attended alone).

        A TreeBatch sends its integer arrays and ancestor relation (one copy on a GPU) and its
        mask is built there; anything else shaped like one (a draft model's trees) sends its
        visible() mask as it is."""
        dev, S = self.device, batch.kv_length
        sliding = self.info.layer_types is not None and self.info.sliding_window
        ragged = None
        if isinstance(batch, TreeBatch):
            B, T = batch.shape
            # rows of unequal size: the layers run over the real tokens only (see PoolStep). Padding
            # that would reach past a slot's end (a short prompt chunk beside a long one, at the end
            # of its slot) must not be written: such passes always run ragged
            spill = S > self.capacity
            ragged_pass = (self.ragged or spill) and not batch.valid.all()
            flat = np.flatnonzero(batch.valid.reshape(-1)) if ragged_pass else None
            tok, pos, writes, cached, valid, anc, *rest = _Sent.send(
                dev,
                batch.tokens,
                batch.positions,
                batch.writes,
                batch.cached,
                batch.valid,
                batch.ancestors,
                *([flat] if flat is not None else []),
            )
            full = tree_mask(cached, valid, anc, S)[:, None]
            kv_pos = kv_positions(writes, pos, S) if sliding else None
            ragged = rest[0] if rest else None
            if ragged is not None:  # padding is neither written nor read: keys up to the last real token
                # (a prompt chunk beside a decode step's trees pads them to the chunk's length)
                S = int((batch.cached + batch.sizes).max())
                full = full[..., :S]
                kv_pos = kv_pos[:, :S] if kv_pos is not None else None
        else:
            arrays = [batch.tokens, batch.positions, batch.writes, batch.visible()]
            tok, pos, writes, vis, *kv = _Sent.send(dev, *arrays, *([batch.kv_positions()] if sliding else []))
            full, kv_pos = vis[:, None], (kv[0] if kv else None)
        mask: torch.Tensor | dict = full
        if self.info.layer_types is not None:
            mask = {"full_attention": full, "sliding_attention": full}
            if sliding:
                near = pos[:, :, None] - kv_pos[:, None, :] < self.info.sliding_window
                mask["sliding_attention"] = full & near[:, None]
        step = attention.PoolStep(
            self.pool,
            rows,
            writes,
            S,
            fold=self.fold_attention,
            ragged=ragged,
            sizes=batch.sizes if ragged is not None else None,
            cached=batch.cached if ragged is not None else None,
            head_rows=heads,
        )
        ids, at = (tok, pos) if ragged is None else (tok.reshape(-1)[ragged][None], pos.reshape(-1)[ragged][None])
        out = self.model.model(
            input_ids=ids, position_ids=at, attention_mask=mask, use_cache=False, **{attention.STEP_KWARG: step}
        )
        hidden = out.last_hidden_state
        if ragged is None:
            return hidden
        full_rows = hidden.new_zeros((B * T, hidden.shape[-1]))
        full_rows[ragged] = hidden[0]
        return full_rows.view(B, T, -1)

    @property
    def fuses_prefill(self) -> bool:
        """Prompt chunks ride in decode passes where passes run ragged and attention splits them off
        (padded, as with folded heads on CUDA or soft-capped attention, every tree row would be as
        long as the chunk)."""
        folded = self.fold_attention
        if folded is None:
            folded = self.device.type == "cuda" and attention.cuda_mode() == "folded"
        return self.ragged and not folded and not self._attention_softcap

    def hidden_states(self, rows: slice, batch: TreeBatch) -> torch.Tensor:
        """Final hidden states [B, T, hidden] of one pass over slots `rows`, writing its K/V.

        `batch` is a TreeBatch or anything with the same fields and methods (tokens,
        positions, writes, kv_length, visible(), kv_positions()): a draft model lays out
        its own trees over its slots (model_drafter)."""
        return self._forward(rows, batch)

    def prefill(self, rows: slice, batch: TreeBatch) -> None:
        self._forward(rows, batch)

    @torch.inference_mode()
    def launch(
        self, rows: slice, batch: TreeBatch, greedy: np.ndarray, topk: int = 0, heads: int | None = None
    ) -> _Pending:
        hidden = self._forward(rows, batch, heads)
        B, T = batch.shape
        k = min(int(topk), self.info.vocab_size)
        H = B if heads is None else int(heads)  # rows past H are prompt chunks: written, no outputs
        pending = _Pending((H, T), k)
        flat = hidden.reshape(B * T, hidden.shape[-1])
        greedy = np.asarray(greedy, dtype=bool)[:H]
        valid = batch.valid[:H]
        for want, sampled in ((valid & greedy[:, None], False), (valid & ~greedy[:, None], True)):
            if not want.any():
                continue
            b, i = np.nonzero(want)
            (at,) = _Sent.send(self.device, b * T + i)
            h = flat.index_select(0, at)
            if sampled:
                logits = self.logits(h)
                top = logits.topk(k, dim=-1).indices if k else None
                pending.sampled = (b, i, logits, _Pending.to_host(top))
            else:
                best, top = self._argmax_topk(h, k)
                pending.greedy = (b, i, _Pending.to_host(best), _Pending.to_host(top))
        if self.device.type == "cuda":
            pending.event = torch.cuda.Event()
            pending.event.record()
        return pending

    def collect(self, handle: _Pending) -> NodeOutputs:
        """Waits for the launched pass (on a CPU it has run) and hands over its results."""
        if handle.event is not None:
            handle.event.synchronize()
        (B, T), k = handle.shape, handle.k
        argmax = np.full((B, T), -1, dtype=np.int64)
        top = np.full((B, T, k), -1, dtype=np.int64) if k > 0 else None
        if handle.greedy is not None:
            b, i, best, tk = handle.greedy
            argmax[b, i] = best.numpy()
            if top is not None:
                top[b, i] = tk.numpy()
        if handle.sampled is None:
            return NodeOutputs(argmax, topk=top)
        b, i, logits, tk = handle.sampled
        index = np.full((B, T), -1, dtype=np.int64)
        index[b, i] = np.arange(b.shape[0])
        if top is not None:
            top[b, i] = tk.numpy()
        return NodeOutputs(argmax, logits, index, top)

    def _chunk_rows(self) -> int:
        per = ARGMAX_CHUNK_BYTES["cuda" if self.device.type == "cuda" else "cpu"]
        return max(16, per // (4 * self.info.vocab_size))

    def _argmax_topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On the device: the argmax of the next-token logits [N] for hidden states [N, hidden] and,
        with k > 0, the k likeliest tokens [N, k] (likeliest first), chunk by chunk from the same
        logits (soft-capping is monotone: it changes neither)."""
        n, chunk = hidden.shape[0], self._chunk_rows()
        best = torch.empty(n, dtype=torch.int64, device=hidden.device)
        top = torch.empty((n, k), dtype=torch.int64, device=hidden.device) if k else None
        for start in range(0, n, chunk):
            logits = self._head(hidden[start : start + chunk])
            best[start : start + chunk] = logits.argmax(dim=-1)
            if top is not None:
                top[start : start + chunk] = logits.topk(k, dim=-1).indices
        return best, top

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor) -> np.ndarray:
        """Argmax of the next-token logits for hidden states [N, hidden], chunk by chunk."""
        return self._argmax_topk(hidden, 0)[0].cpu().numpy()

    @torch.inference_mode()
    def argmax_topk(self, hidden: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The argmax [N] (as `argmax` takes it) and the k likeliest next tokens [N, k], likeliest
        first, for hidden states [N, hidden], chunk by chunk from the same logits."""
        best, top = self._argmax_topk(hidden, k)
        return best.cpu().numpy(), top.cpu().numpy()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits (float32) for hidden states [..., hidden]."""
        out = self._head(hidden).float()
        if self._softcap:
            out = torch.tanh(out / self._softcap) * self._softcap
        return out

    # -- the KV pool -----------------------------------------------------------------------
    def compact(self, slots: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        self.pool.move(slots, src, dst)

    def swap(self, a: int, b: int, length: int) -> None:
        self.pool.swap(a, b, length)

    # -- cost --------------------------------------------------------------------------------
    def _time_rows(self, rows: int, context: int = 256) -> float | None:
        """Seconds of one verification pass feeding every linear layer `rows` rows (a chain of
        that many tokens in slot 0 after `context` cached positions, argmax included); None if it
        does not fit the pool."""
        from sssd.serving.planning.profile import _chains
        from sssd.serving.verify.tree_batch import pack

        context = min(context, self.capacity - rows - 1)
        if context < 1:
            return None
        batch = pack(np.zeros(1, dtype=np.int64), np.full(1, context), _chains(1, rows - 1))
        t0 = time.perf_counter()
        self.collect(self.launch(slice(0, 1), batch, np.ones(1, dtype=bool)))
        return time.perf_counter() - t0

    def linear_plan_steps(self, log=None):
        """The linear plan's measurement in pieces: a generator (yielding after each timing; the
        layers change as it refines) that returns the LinearPlan. Run it only while no request is
        in flight; then `adopt_linear_plan`."""
        plan = yield from linear_plan.measure_steps(self.model, log=log)
        return (yield from linear_plan.refine_steps(self.model, plan, self._time_rows, log=log))

    def adopt_linear_plan(self, plan, conditions) -> str | None:
        """Caches and installs a plan measured by linear_plan_steps under `conditions`; returns why it
        is not trusted (then torch's layers stay) or None."""
        problem = linear_plan.finish(self.model, self._weights_identity(), plan, conditions)
        self.linear_plan = None if problem else plan
        self.linear_plan_pending = problem is not None
        linear_plan.install(self.model, self.linear_plan)
        return problem

    def _weights_identity(self) -> dict:
        return weights_identity(self._path, self.dtype, self.device, self._config_dict)

    def identity(self) -> dict:
        """What a forward-time profile depends on."""
        return dict(
            self._weights_identity(),
            backend="torch",
            slots=self.slots,
            linear_plan=linear_plan.plan_key(self.linear_plan),
        )

    def profile(self, log=None, force: bool = False):
        from sssd.serving.planning.profile import load_or_measure

        return load_or_measure(self, log=log, force=force)

    def describe(self) -> dict:
        return {
            "backend": "torch",
            "path": self.info.path,
            "model_type": self.info.model_type,
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
            "config": json.loads((getattr(self.config, "text_config", None) or self.config).to_json_string())[
                "model_type"
            ],
        }
