"""Prompt lookup decoding, as Hugging Face transformers does it.

Source: ``PromptLookupCandidateGenerator.get_candidates`` in
``transformers/generation/candidate_generator.py`` (read in transformers
5.23.0; the algorithm is unchanged since PR #27775). For n-gram sizes from
``min(max_matching_ngram_size, len - 1)`` down to 1, it slides a window over
the whole input, takes the matches of the input's last n tokens from left to
right, and returns the tokens after the first match that has any
(``input[idx + n : min(idx + n + num_output_tokens, len)]``). No match: no
candidates. The draft is a chain.

Here ``num_output_tokens`` is the budget. The same search is done with numpy
on the positions that end with the last token (identical results, checked
against transformers' own class in tests/test_peers.py). Not reproduced,
because replays have neither: the ``max_length`` cap (generation length
limit), the logits-processor filter (none is configured in plain
``generate(prompt_lookup_num_tokens=...)``) and the cut at an EOS token
(ground-truth outputs end where the model stopped).
"""

from __future__ import annotations

import numpy as np

from ._base import EMPTY_TREE, PerRequestDrafter, chain, chain_batch, suffix_match_lengths


def prompt_lookup(context: np.ndarray, max_matching_ngram_size: int, num_output_tokens: int) -> np.ndarray:
    """The candidate tokens HF's PromptLookupCandidateGenerator returns (may be empty)."""
    if max_matching_ngram_size <= 0 or num_output_tokens <= 0:
        raise ValueError("Invalid max_matching_ngram_size or num_output_tokens")
    context = np.asarray(context, dtype=np.int64)
    ends, lengths = suffix_match_lengths(context, max_matching_ngram_size)
    if ends.size == 0:
        return context[:0]
    # The largest n with a match, then its leftmost occurrence (= smallest end).
    n = int(lengths.max())
    j = int(ends[np.argmax(lengths >= n)])
    return context[j + 1 : j + 1 + num_output_tokens]


class PromptLookupDrafter(PerRequestDrafter):
    """HF prompt lookup decoding: a chain of ``budget`` tokens copied from the context.

    Args:
        max_matching_ngram_size: longest n-gram matched (HF default 2).
    """

    name = "PLD (HF)"

    def __init__(self, max_matching_ngram_size: int = 2):
        super().__init__()
        if max_matching_ngram_size <= 0:
            raise ValueError("max_matching_ngram_size must be positive")
        self.max_matching_ngram_size = max_matching_ngram_size

    def settings(self) -> dict:
        return {"max_matching_ngram_size": self.max_matching_ngram_size}

    def _draft_one(self, context: np.ndarray, budget: int):
        if budget <= 0:
            return EMPTY_TREE
        toks = prompt_lookup(context, self.max_matching_ngram_size, budget)
        return chain(toks) if toks.size else EMPTY_TREE

    def draft(self, request_ids, budget: int):
        """Chains for a batch, built straight into one DraftBatch (no per-request trees)."""
        ctx, n = self._ctx, self.max_matching_ngram_size
        rids = np.asarray(request_ids).tolist()
        if budget <= 0:
            return chain_batch([ctx[rid].tokens[:0] for rid in rids])
        return chain_batch([prompt_lookup(ctx[rid].tokens, n, int(budget)) for rid in rids])
