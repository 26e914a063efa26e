"""Per-request state in the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sssd.serving.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # admitted to the queue, no slot yet
    PREFILL = "prefill"      # prompt being written into its KV slot, chunk by chunk
    DECODE = "decode"        # generating
    FINISHED = "finished"


@dataclass
class RequestStats:
    """What speculation did for one request."""

    steps: int = 0                      # decoding steps (target forward passes that emitted tokens)
    drafted: int = 0                    # draft nodes verified
    accepted: int = 0                   # draft tokens accepted (bonus tokens not counted)
    accepted_per_step: list[int] = field(default_factory=list)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    budgets: list[int] = field(default_factory=list)  # budget used at each step

    @property
    def tokens_per_step(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "tokens_per_step": round(self.tokens_per_step, 4), "accepted_per_step": self.accepted_per_step,
                "accepted_by_source": self.accepted_by_source, "budgets": self.budgets}


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)   # prompt + output so far
    cached: int = 0                                   # tokens whose K/V are in the slot
    slot: int = -1
    finish_reason: str | None = None
    text: str = ""                                    # output text so far (stop strings applied)
    sent_text: str = ""                               # the part of it streamed to the client so far
    stats: RequestStats = field(default_factory=RequestStats)
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    new_token_count: int = 0                          # tokens added since the last output report
    error: str | None = None                          # why it finished with "error"
    draft: bool = True                                # the drafters hold this request's state
    detok: Any = None                                 # its Detokenizer (incremental text, stop strings)
    buffer: np.ndarray | None = None                  # tokens as int64, capacity prompt + max_tokens + 1

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        self.buffer = np.zeros(len(self.prompt_ids) + self.params.max_tokens + 1, dtype=np.int64)
        self.buffer[: len(self.tokens)] = self.tokens

    def append(self, token: int) -> None:
        self.buffer[len(self.tokens)] = token
        self.tokens.append(token)

    def history(self) -> np.ndarray:
        """Prompt and output so far: a read-only view, no copy."""
        view = self.buffer[: len(self.tokens)]
        view.flags.writeable = False
        return view

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
