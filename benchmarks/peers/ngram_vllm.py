"""vLLM's n-gram proposer (``method="ngram"``).

Source: ``vllm/v1/spec_decode/ngram_proposer.py``,
``_find_longest_matched_ngram_and_propose_tokens`` (numba, read at vLLM
commit 016e8ed). It reverses the context and runs a KMP
longest-prefix-suffix scan capped at ``prompt_lookup_max``, which finds the
longest n-gram (n in [prompt_lookup_min, prompt_lookup_max]) that ends the
context and occurs earlier, at its earliest occurrence; it proposes the
``num_speculative_tokens`` tokens that follow (fewer if the context ends
first). A context shorter than ``prompt_lookup_min``, or no such n-gram: no
draft. The draft is a chain.

Here ``num_speculative_tokens`` is the budget, and the search is done with
numpy (identical results: tests/test_peers.py checks it against a line-by-line
Python port of the numba function and against vLLM's own test cases). Not
reproduced: the ``max_model_len`` cap (replays stay far below it).

With ``prompt_lookup_min = 1`` this is the same search as HF's prompt lookup
(longest n first, then the leftmost occurrence); the two peers differ only in
their settings.
"""

from __future__ import annotations

import numpy as np

from ._base import EMPTY_TREE, PerRequestDrafter, chain, chain_batch, suffix_match_lengths


def propose(context: np.ndarray, min_ngram: int, max_ngram: int, k: int) -> np.ndarray:
    """The tokens vLLM's NgramProposer.propose returns for ``context`` (may be empty)."""
    context = np.asarray(context, dtype=np.int64)
    if context.shape[0] < min_ngram or k <= 0:
        return context[:0]
    ends, lengths = suffix_match_lengths(context, max_ngram)
    if ends.size == 0:
        return context[:0]
    n = int(lengths.max())
    if n < min_ngram:
        return context[:0]
    j = int(ends[np.argmax(lengths >= n)])
    return context[j + 1 : j + 1 + k]


def propose_reference(origin_tokens: np.ndarray, min_ngram: int, max_ngram: int, k: int) -> np.ndarray:
    """A line-by-line Python port of vLLM's numba KMP (slow; the oracle for tests)."""
    total_token = origin_tokens.shape[0]
    if total_token < min_ngram or k <= 0:
        return origin_tokens[:0]
    tokens = origin_tokens[::-1]
    lps = np.zeros(max_ngram, dtype=np.int32)
    longest_ngram = 0
    position = 0
    prev_lps = 0
    i = 1
    while i < total_token:
        if tokens[prev_lps] == tokens[i]:
            prev_lps += 1
            if prev_lps >= longest_ngram:
                longest_ngram = prev_lps
                position = i
            if i < max_ngram:
                lps[i] = prev_lps
            if prev_lps == max_ngram:
                prev_lps = lps[max_ngram - 1]
            i += 1
        elif prev_lps != 0:
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest_ngram < min_ngram:
        return origin_tokens[:0]
    start_position = total_token - 1 - position + longest_ngram
    k = min(k, total_token - start_position)
    return origin_tokens[start_position : start_position + k]


class NgramVLLMDrafter(PerRequestDrafter):
    """vLLM's n-gram proposer: a chain of up to ``budget`` tokens.

    Args:
        prompt_lookup_min / prompt_lookup_max: the n-gram sizes matched.
    """

    name = "n-gram (vLLM)"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        super().__init__()
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def settings(self) -> dict:
        return {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}

    def _draft_one(self, context: np.ndarray, budget: int):
        toks = propose(context, self.prompt_lookup_min, self.prompt_lookup_max, budget)
        return chain(toks) if toks.size else EMPTY_TREE

    def draft(self, request_ids, budget: int):
        """Chains for a batch, built straight into one DraftBatch (no per-request trees)."""
        ctx, lo, hi = self._ctx, self.prompt_lookup_min, self.prompt_lookup_max
        return chain_batch([propose(ctx[rid].tokens, lo, hi, int(budget)) for rid in np.asarray(request_ids).tolist()])
