"""Tiny random-weight causal LMs with a real (word-level) tokenizer, for engine tests."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(90)]


def tokenizer_files(folder: Path, vocab_size: int | None = None) -> None:
    """A word-level tokenizer: <pad> 0, <eos> 1, <bos> 2, then words w0, w1, ... (WORDS, or as
    many as fill `vocab_size`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = WORDS if vocab_size is None else [f"w{i}" for i in range(vocab_size - 3)]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)


def tiny_model(folder: Path, arch: str = "llama", seed: int = 0, layers: int = 2) -> Path:
    """Saves a tiny random model of architecture `arch` (llama, qwen2, gemma3) to `folder`."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(WORDS) + 3,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "gemma3":
        config = Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"][:layers] + ["full_attention"] * (layers - 2),
            query_pre_attn_scalar=16,
        )
    else:
        raise ValueError(arch)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; sharpen them so greedy decoding is
    # decisive (ties would make exact-equality tests depend on rounding).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer_files(folder)
    return folder


def perturbed_model(base: Path, folder: Path, scale: float = 0.3, seed: int = 1) -> Path:
    """`base`'s weights plus Gaussian noise (`scale` x each tensor's std), with its architecture and
    tokenizer, saved to `folder`: a drafter close to the target but not equal (q != p)."""
    from transformers import AutoModelForCausalLM

    tiny_model(folder)  # the tokenizer files
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    return folder
