"""Per-request generation parameters, in the shape of vLLM's SamplingParams."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Temperatures below this decode greedily (as vLLM does): dividing logits by a
#: vanishing temperature overflows to inf and the softmax to NaN.
GREEDY_BELOW = 1e-5
#: Seeds are taken modulo 2^64 (torch's generator state); beyond this range they are refused.
SEED_RANGE = (-(2**63), 2**64)
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to generate one completion.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 for greedy decoding; > 0 samples from softmax(logits / t)
            (below 1e-5: greedy, since the division would overflow).
        top_p: nucleus sampling mass in (0, 1] (1: off).
        top_k: keep only the k most likely tokens (0 or -1: off).
        seed: per-request random seed (None: the engine's generator).
        stop: strings that end the completion (not included in the text).
        stop_token_ids: token ids that end the completion (included in the ids).
        ignore_eos: keep generating past the end-of-sequence token.
        speculate: draft and verify for this request (the engine may still
            choose budget 0 when speculation would not pay).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    speculate: bool = True

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"invalid sampling parameters: {msg}")

        def number(x) -> bool:  # a finite real number (NaN and infinities are refused)
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        def integer(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not integer(self.max_tokens) or self.max_tokens < 1:
            bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not number(self.temperature) or not 0 <= self.temperature <= 100:
            bad(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            bad(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not integer(self.top_k) or self.top_k < -1:
            bad(f"top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed is not None and (not integer(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            bad(f"seed must be an int in [-2^63, 2^64), got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            bad(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LENGTH} characters")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not all(integer(t) and 0 <= t < 2**63 for t in self.stop_token_ids):
            bad("stop_token_ids must be token ids (ints >= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
