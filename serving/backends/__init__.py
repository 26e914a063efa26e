"""Verifier backends: the target model on a device, verifying packed trees over its KV slots.

base.py             the VerifierBackend protocol the engine sees
torch_backend.py    a Hugging Face causal LM on the CPU or a GPU
attention.py        attention over the KV pool (plugged into transformers' AttentionInterface)
kv_cache.py         the KV pool: every layer's K and V, per-request slots kept dense
linear_plan.py      per-shape CPU kernel choice for the linear layers
devices.py          which device, checked before anything loads
pipeline_backend.py the model's layers split over processes (pipeline stages)
"""
