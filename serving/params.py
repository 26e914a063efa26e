"""Per-request generation parameters, in the shape of vLLM's SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to generate one completion.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 for greedy decoding; > 0 samples from softmax(logits / t).
        top_p: nucleus sampling mass in (0, 1] (1: off).
        top_k: keep only the k most likely tokens (0: off).
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

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an int, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
