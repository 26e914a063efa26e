"""Prompts into token ids: a text, token ids, or chat messages; oversize ones refused early."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

#: Prompts longer than this many characters per servable token are judged on a prefix first
#: (tokenizing megabytes only to refuse them would stall the caller for seconds).
PROBE_CHARS_PER_TOKEN = 8


class ContextLengthExceeded(ValueError):
    """The prompt (or the prompt plus max_tokens) does not fit in the model's context."""


def check_request_args(params: Any, request_id: Any) -> None:
    """A request's SamplingParams and optional id (ValueError naming what is wrong)."""
    from sssd.serving.engine.config import MAX_REQUEST_ID
    from sssd.serving.engine.params import SamplingParams

    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    if request_id is not None and (
        isinstance(request_id, bool)
        or not isinstance(request_id, (int, np.integer))
        or not 0 <= int(request_id) <= MAX_REQUEST_ID
    ):
        raise ValueError(f"request_id must be an int in [0, 2^63), got {request_id!r}")


def check_prompt_ids(ids: list[int], vocab: int) -> None:
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary ({vocab})")


def fit_max_tokens(params: Any, prompt_len: int, max_model_len: int, max_tree: int, clip: bool) -> Any:
    """The params with max_tokens lowered to what fits beside the prompt and a draft tree (`clip`),
    else refused (ContextLengthExceeded, saying what fits)."""
    room = max_model_len - prompt_len - max_tree
    if room < 1:
        raise ContextLengthExceeded(
            f"the prompt has {prompt_len} tokens; this engine serves at most "
            f"{max_model_len - max_tree - 1} (max_model_len {max_model_len})"
        )
    if params.max_tokens <= room:
        return params
    if not clip:
        raise ContextLengthExceeded(
            f"max_tokens {params.max_tokens} does not fit: the prompt has {prompt_len} tokens and this engine "
            f"serves at most {max_model_len - max_tree} in all (max_model_len {max_model_len}); ask for at most {room}"
        )
    return dataclasses.replace(params, max_tokens=room)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int] | Sequence[dict], limit: int | None = None) -> list[int]:
    """Token ids of a prompt: a text, token ids, or chat messages (the chat template applied).

    A text (or conversation) far longer than `limit` tokens could be is refused after
    tokenizing a prefix only: its prefix's token count (less a margin for the last word)
    is a lower bound on the whole text's. Megabytes are thus refused in milliseconds.

    Raises:
        ValueError: a malformed prompt, or one certainly longer than `limit` tokens.
    """
    if isinstance(prompt, str):
        if not prompt:
            return []
        if limit is not None:
            _probe(limit, [len(prompt)], lambda cut: tokenizer.encode(prompt[:cut], add_special_tokens=False))
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, (bytes, dict)):
        raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")
    prompt = list(prompt)
    if prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), str):
                raise ValueError("a chat message is {'role': str, 'content': str}")

        def chat(cut: int | None = None) -> list[int]:
            msgs = [dict(m, content=m.get("content", "")[:cut]) if cut else m for m in prompt]
            out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

        if limit is not None:
            _probe(limit, [len(m.get("content", "")) for m in prompt], chat)
        return chat()
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
        raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")
    return [int(t) for t in prompt]


def _probe(limit: int, lengths: list[int], encode_prefix) -> None:
    """Refuses a prompt whose pieces (the text, or each message) cut to their first `cut`
    characters already exceed `limit` tokens, less a margin per cut piece for its last word."""
    cut = (limit + 64) * PROBE_CHARS_PER_TOKEN
    cuts = sum(n > cut for n in lengths)
    if cuts:
        margin = 64 * cuts
        n = len(encode_prefix(cut))
        if n > limit + margin:
            raise ContextLengthExceeded(
                f"the prompt has more than {n - margin} tokens; this engine serves at most {limit}"
            )
