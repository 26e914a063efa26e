"""The engine: continuous batching with SSSD tree speculation over one target model.

llm_engine.py   LLMEngine: requests in, outputs out; the step loop
scheduler.py    KV slots, admission, prefill chunks
step.py         one decode step: prepare (draft + pack), launch (forward), finish (accept + emit)
requests.py     a request's state, emission (stop conditions) and outputs
factory.py      putting an engine together: backend, draft sources, calibration
config.py, params.py, prompts.py, metrics.py, detokenizer.py
acceptance.py, tree_batch.py   verification of packed draft trees (the step's data path)
"""

from sssd.serving.engine.config import DEFAULT_DRAFT, EngineConfig
from sssd.serving.engine.llm_engine import LLMEngine
from sssd.serving.engine.metrics import EngineMetrics
from sssd.serving.engine.prompts import ContextLengthExceeded, encode_prompt
from sssd.serving.engine.requests import RequestOutput

__all__ = [
    "DEFAULT_DRAFT",
    "ContextLengthExceeded",
    "EngineConfig",
    "EngineMetrics",
    "LLMEngine",
    "RequestOutput",
    "encode_prompt",
]
