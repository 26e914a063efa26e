"""Front ends over the engine.

api_server.py     the OpenAI-compatible HTTP server (sssd serve)
async_engine.py   the engine on its own thread, for asyncio callers
llm.py            sssd.LLM: offline generation in vLLM's shape
prometheus.py     /metrics in Prometheus' text format
vllm_compare.py   plain vLLM against its proposers and SSSD's, side by side
"""
