"""A request in the engine: its state, how tokens are emitted into it, and what it reports.

`emit` appends verified tokens one by one and stops the request at its end-of-sequence token, a
stop token or string, or max_tokens; `output_of` turns its state into a RequestOutput with what is
new since the last one (token ids, and streamed text that never takes back what was sent).
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from sssd.serving.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # admitted to the queue, no slot yet
    PREFILL = "prefill"  # prompt being written into its KV slot, chunk by chunk
    DECODE = "decode"  # generating
    FINISHED = "finished"


@dataclass
class RequestStats:
    """What speculation did for one request."""

    steps: int = 0  # decoding steps (target forward passes that emitted tokens)
    drafted: int = 0  # draft nodes verified
    accepted: int = 0  # draft tokens accepted (bonus tokens not counted)
    accepted_per_step: list[int] = field(default_factory=list)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    budgets: list[int] = field(default_factory=list)  # budget used at each step

    @property
    def tokens_per_step(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens_per_step": round(self.tokens_per_step, 4),
            "accepted_per_step": self.accepted_per_step,
            "accepted_by_source": self.accepted_by_source,
            "budgets": self.budgets,
        }


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt + output so far
    cached: int = 0  # tokens whose K/V are in the slot
    slot: int = -1
    finish_reason: str | None = None
    text: str = ""  # output text so far (stop strings applied)
    sent_text: str = ""  # the part of it streamed to the client so far
    stats: RequestStats = field(default_factory=RequestStats)
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    new_token_count: int = 0  # tokens added since the last output report
    error: str | None = None  # why it finished with "error"
    draft: bool = True  # the drafters hold this request's state
    detok: Any = None  # its Detokenizer (incremental text, stop strings)
    buffer: np.ndarray | None = None  # tokens as int64, capacity prompt + max_tokens + 1

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
        return self.tokens[len(self.prompt_ids) :]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def tokens_left(self) -> int:
        """Tokens it may still emit before max_tokens."""
        return self.params.max_tokens - (len(self.tokens) - len(self.prompt_ids))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """A request's state after a step (what is new since the last output, and all so far)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    stats: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # the reason, when finish_reason is "error"


def new_request(rid: int, ids: list[int], params: SamplingParams, tokenizer: Any) -> Request:
    """A request as the engine queues it: its own random stream if seeded, its detokenizer."""
    from sssd.serving.engine.detokenizer import Detokenizer

    req = Request(rid, list(ids), params, time.monotonic())
    if params.seed is not None:
        req.generator = torch.Generator(device="cpu").manual_seed(params.seed % 2**64)
    req.detok = Detokenizer(tokenizer, params.stop)
    return req


def emit(req: Request, new: list[int], eos_ids: set[int], finish: Callable[[Request, str], None]) -> list[int]:
    """Appends tokens one by one, honouring stop conditions (`finish(req, reason)` ends the request
    there); returns those kept."""
    kept = []
    p = req.params
    for tok in new:
        req.append(tok)
        kept.append(tok)
        req.new_token_count += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if (tok in eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            finish(req, "stop")
            break
        if req.detok.add(tok):
            finish(req, "stop")
            break
        if len(req.tokens) - req.prompt_len >= p.max_tokens:
            finish(req, "length")
            break
    return kept


def output_of(req: Request) -> RequestOutput:
    """The request's output now: everything so far, and what is new since the last one."""
    ids = req.output_ids
    new_ids = ids[len(ids) - req.new_token_count :] if req.new_token_count else []
    req.text = req.detok.finish() if req.finished else req.detok.text
    new_text = stream_delta(req)
    req.new_token_count = 0
    metrics = {"arrival": req.arrival, "first_token": req.first_token_time, "finish": req.finish_time}
    return RequestOutput(
        req.id,
        list(req.prompt_ids),
        list(ids),
        req.text,
        req.finished,
        req.finish_reason,
        new_ids,
        new_text,
        req.stats.as_dict(),
        metrics,
        req.error,
    )


def stream_delta(req: Request) -> str:
    """The text to stream since the last output. While the request runs, a trailing U+FFFD is
    held back: it is an incomplete UTF-8 sequence (a multi-byte character split across byte
    tokens) that the next token completes. Should a tokenizer still rewrite text already sent,
    only what follows the common prefix is sent (a client cannot take text back)."""
    stable = req.text if req.finished else req.text.rstrip("\ufffd")
    sent = req.sent_text
    if stable.startswith(sent):
        delta = stable[len(sent) :]
    else:
        common = len(os.path.commonprefix([sent, stable]))
        delta = stable[common:]
    req.sent_text = stable
    return delta
