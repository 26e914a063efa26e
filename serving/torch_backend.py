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
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from sssd.serving import attention, linear_plan
from sssd.serving.backend import ModelInfo, NodeOutputs, VerifierBackend
from sssd.serving.kv_cache import KVPool, PoolShape
from sssd.serving.tree_batch import TreeBatch

#: Bytes of float32 logits one argmax chunk may hold.
ARGMAX_CHUNK_BYTES = 32 * 2**20


def pick_device(requested: str | None = None) -> torch.device:
    """CUDA when available (or as asked), else the CPU."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def weights_identity(path: str | Path, dtype: torch.dtype | str, device: torch.device | str) -> dict:
    """What the speed of one of a model's matrix products depends on (the linear plan's and the
    forward profile's cache key)."""
    path = Path(path)
    return {"model": str(path), "mtime": (path / "config.json").stat().st_mtime, "dtype": str(dtype),
            "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


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
        log: where progress goes (the linear plan's first measurement).
    """

    def __init__(self, model: str | Path, slots: int, capacity: int, dtype: str = "float32",
                 device: str | None = None, threads: int | None = None, plan_linears: bool = True, log=None):
        from transformers import AutoConfig, AutoModelForCausalLM

        path = self._path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model folder (no config.json)")
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise ValueError(f"{path}: cannot read the model config ({e})") from e
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

        arch = list(getattr(config, "architectures", None) or [])
        causal = (any(a in set(CAUSAL.values()) or a.endswith("ForCausalLM") for a in arch) if arch
                  else config.model_type in CAUSAL)
        if getattr(config, "is_encoder_decoder", False) or not causal:
            raise ValueError(f"{path} is not a causal language model (architectures: {arch or config.model_type})")
        if threads:
            torch.set_num_threads(threads)
        self.device = pick_device(device)
        self.dtype = getattr(torch, dtype)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                path, dtype=self.dtype, attn_implementation=attention.register(), local_files_only=True
            ).to(self.device)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: cannot load it as a causal language model ({str(e).splitlines()[0]})") from e
        self.model.eval()
        self.linear_plan = None
        self.config = self.model.config
        text = getattr(self.config, "text_config", None) or self.config
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
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
            sliding_window=getattr(text, "sliding_window", None) if layer_types and "sliding_attention" in layer_types else None,
            layer_types=tuple(layer_types) if layer_types else None,
            shape={"layers": text.num_hidden_layers, "hidden": text.hidden_size, "heads": text.num_attention_heads,
                   "kv_heads": kv_heads, "head_dim": head_dim, "vocab": text.vocab_size,
                   "intermediate": getattr(text, "intermediate_size", 4 * text.hidden_size),
                   "params": sum(p.numel() for p in self.model.parameters()),
                   "dtype_bytes": torch.finfo(self.dtype).bits // 8},
        )
        self._softcap = getattr(text, "final_logit_softcapping", None)
        self._head = self.model.get_output_embeddings()
        self.slots, self.capacity = slots, capacity
        self.pool = KVPool(PoolShape(layers=text.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, slots=slots,
                                     capacity=capacity), self.dtype, self.device)
        self._threads = threads
        if plan_linears and linear_plan.enabled(self.device):
            self.linear_plan = linear_plan.load_or_measure(self.model, self._weights_identity(), log=log,
                                                           time_rows=self._time_rows)
            linear_plan.install(self.model, self.linear_plan)

    # -- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, rows: slice, batch: TreeBatch) -> torch.Tensor:
        """Final hidden states [B, T, hidden] of one pass over slots `rows`."""
        dev = self.device
        tok = torch.from_numpy(batch.tokens).to(dev)
        pos = torch.from_numpy(batch.positions).to(dev)
        full = torch.from_numpy(batch.visible()).to(dev)[:, None]
        mask: torch.Tensor | dict = full
        if self.info.layer_types is not None:
            mask = {"full_attention": full, "sliding_attention": full}
            if self.info.sliding_window:
                near = batch.positions[:, :, None] - batch.kv_positions()[:, None, :] < self.info.sliding_window
                mask["sliding_attention"] = full & torch.from_numpy(near).to(dev)[:, None]
        step = attention.PoolStep(self.pool, rows, torch.from_numpy(batch.writes).to(dev), batch.kv_length)
        out = self.model.model(input_ids=tok, position_ids=pos, attention_mask=mask, use_cache=False,
                               **{attention.STEP_KWARG: step})
        return out.last_hidden_state

    def hidden_states(self, rows: slice, batch: TreeBatch) -> torch.Tensor:
        """Final hidden states [B, T, hidden] of one pass over slots `rows`, writing its K/V.

        `batch` is a TreeBatch or anything with the same fields and methods (tokens,
        positions, writes, kv_length, visible(), kv_positions()): a draft model lays out
        its own trees over its slots (model_drafter)."""
        return self._forward(rows, batch)

    def prefill(self, rows: slice, batch: TreeBatch) -> None:
        self._forward(rows, batch)

    @torch.inference_mode()
    def launch(self, rows: slice, batch: TreeBatch, greedy: np.ndarray, topk: int = 0) -> NodeOutputs:
        hidden = self._forward(rows, batch)
        B, T = batch.shape
        k = min(int(topk), self.info.vocab_size)
        argmax = np.full((B, T), -1, dtype=np.int64)
        top = np.full((B, T, k), -1, dtype=np.int64) if k > 0 else None
        g = batch.valid & np.asarray(greedy, dtype=bool)[:, None]
        if g.any():
            b, i = np.nonzero(g)
            h = hidden[torch.from_numpy(b), torch.from_numpy(i)]
            if top is None:
                argmax[b, i] = self.argmax(h)
            else:
                argmax[b, i], top[b, i] = self.argmax_topk(h, k)
        s = batch.valid & ~np.asarray(greedy, dtype=bool)[:, None]
        if not s.any():
            return NodeOutputs(argmax, topk=top)
        b, i = np.nonzero(s)
        index = np.full((B, T), -1, dtype=np.int64)
        index[b, i] = np.arange(b.shape[0])
        logits = self.logits(hidden[torch.from_numpy(b), torch.from_numpy(i)])
        if top is not None:
            top[b, i] = logits.topk(k, dim=-1).indices.cpu().numpy()
        return NodeOutputs(argmax, logits, index, top)

    def collect(self, handle: NodeOutputs) -> NodeOutputs:
        return handle  # the CPU pass ran in launch

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor) -> np.ndarray:
        """Argmax of the next-token logits for hidden states [N, hidden], chunk by chunk (soft-capping
        is monotone: it never changes the argmax)."""
        n = hidden.shape[0]
        chunk = max(16, ARGMAX_CHUNK_BYTES // (4 * self.info.vocab_size))
        out = torch.empty(n, dtype=torch.int64, device=hidden.device)
        for start in range(0, n, chunk):
            out[start : start + chunk] = self._head(hidden[start : start + chunk]).argmax(dim=-1)
        return out.cpu().numpy()

    @torch.inference_mode()
    def argmax_topk(self, hidden: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The argmax [N] (as `argmax` takes it) and the k likeliest next tokens [N, k], likeliest
        first, for hidden states [N, hidden], chunk by chunk from the same logits."""
        n = hidden.shape[0]
        chunk = max(16, ARGMAX_CHUNK_BYTES // (4 * self.info.vocab_size))
        best = torch.empty(n, dtype=torch.int64, device=hidden.device)
        top = torch.empty((n, k), dtype=torch.int64, device=hidden.device)
        for start in range(0, n, chunk):
            logits = self._head(hidden[start : start + chunk])
            best[start : start + chunk] = logits.argmax(dim=-1)
            top[start : start + chunk] = logits.topk(k, dim=-1).indices
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
        from sssd.serving.profile import _chains
        from sssd.serving.tree_batch import pack

        context = min(context, self.capacity - rows - 1)
        if context < 1:
            return None
        batch = pack(np.zeros(1, dtype=np.int64), np.full(1, context), _chains(1, rows - 1))
        t0 = time.perf_counter()
        self.collect(self.launch(slice(0, 1), batch, np.ones(1, dtype=bool)))
        return time.perf_counter() - t0

    def _weights_identity(self) -> dict:
        return weights_identity(self._path, self.dtype, self.device)

    def identity(self) -> dict:
        """What a forward-time profile depends on."""
        return dict(self._weights_identity(), backend="torch", slots=self.slots,
                    linear_plan=linear_plan.plan_key(self.linear_plan))

    def profile(self, log=None, force: bool = False):
        from sssd.serving.profile import load_or_measure

        return load_or_measure(self, log=log, force=force)

    def describe(self) -> dict:
        return {"backend": "torch", "path": self.info.path, "model_type": self.info.model_type,
                "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
                "config": json.loads((getattr(self.config, "text_config", None) or self.config).to_json_string())["model_type"]}
