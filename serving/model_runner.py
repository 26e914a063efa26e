"""ModelRunner: a Hugging Face causal LM evaluated on packed draft trees.

One call runs one forward pass for a group of requests (rows of the KV
pool): row b feeds T tokens at explicit positions with an explicit mask
(each tree node sees the request's cached context and its own ancestors;
a prefill chunk is a chain). The model's own layers do everything else
(projections, rotary embeddings, norms, MLPs); attention is ours
(attention.py): it reads and writes the KV pool directly, so no cache object
crosses the model's forward signature. Any architecture whose HF
implementation dispatches attention through transformers' AttentionInterface
works (Llama, Qwen2, Gemma3 are tested).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from sssd.serving import attention
from sssd.serving.kv_cache import KVPool, PoolShape
from sssd.serving.verify import Packed


def pick_device(requested: str | None = None) -> torch.device:
    """CUDA when available (or as asked), else the CPU."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class ModelInfo:
    path: str
    model_type: str
    vocab_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    layer_types: tuple[str, ...] | None


class ModelRunner:
    """Loads a causal LM and runs masked, positioned forward passes over a KV pool.

    Args:
        model: a local Hugging Face model folder (config.json + weights).
        dtype: torch dtype name ("float32" for exact equality tests).
        device: "cpu", "cuda", ... (default: CUDA if available).
    """

    def __init__(self, model: str | Path, dtype: str = "float32", device: str | None = None, threads: int | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(model)
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
        self.config = self.model.config
        text = getattr(self.config, "text_config", None) or self.config
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else text.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        layer_types = getattr(text, "layer_types", None)
        self.info = ModelInfo(
            path=str(path),
            model_type=text.model_type,
            vocab_size=text.vocab_size,
            max_positions=int(getattr(text, "max_position_embeddings", 2048)),
            eos_token_ids=eos_ids,
            sliding_window=getattr(text, "sliding_window", None) if layer_types and "sliding_attention" in layer_types else None,
            layer_types=tuple(layer_types) if layer_types else None,
        )
        self._text = text
        self._softcap = getattr(text, "final_logit_softcapping", None)

    # -- the KV pool ---------------------------------------------------------
    def pool_shape(self, slots: int, capacity: int) -> PoolShape:
        t = self._text
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        return PoolShape(layers=t.num_hidden_layers, kv_heads=getattr(t, "num_key_value_heads", t.num_attention_heads),
                         head_dim=head_dim, slots=slots, capacity=capacity)

    def new_pool(self, slots: int, capacity: int) -> KVPool:
        return KVPool(self.pool_shape(slots, capacity), self.dtype, self.device)

    # -- forward -----------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, pool: KVPool, rows: slice, packed: Packed) -> torch.Tensor:
        """One forward pass for pool slots `rows` (see verify.Packed).

        Queries are packed.tokens at packed.positions; their K/V are written at
        packed.writes; each sees the KV positions packed.visible allows
        (sliding-window layers additionally only the window before it).
        Returns the final hidden states [B, T, hidden].
        """
        dev = self.device
        tok = torch.from_numpy(packed.tokens).to(dev)
        pos = torch.from_numpy(packed.positions).to(dev)
        full = torch.from_numpy(packed.visible).to(dev)[:, None]
        mask: torch.Tensor | dict = full
        if self.info.layer_types is not None:
            mask = {"full_attention": full, "sliding_attention": full}
            if self.info.sliding_window:
                near = packed.positions[:, :, None] - packed.kv_positions[:, None, :] < self.info.sliding_window
                mask["sliding_attention"] = full & torch.from_numpy(near).to(dev)[:, None]
        step = attention.PoolStep(pool, rows, torch.from_numpy(packed.writes).to(dev), packed.visible.shape[2])
        out = self.model.model(input_ids=tok, position_ids=pos, attention_mask=mask, use_cache=False,
                               **{attention.STEP_KWARG: step})
        return out.last_hidden_state

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits (float32) for hidden states [..., hidden]."""
        out = self.model.get_output_embeddings()(hidden).float()
        if self._softcap:
            out = torch.tanh(out / self._softcap) * self._softcap
        return out

    def describe(self) -> dict:
        return {"path": self.info.path, "model_type": self.info.model_type, "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device), "config": json.loads(self._text.to_json_string())["model_type"]}
