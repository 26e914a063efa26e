"""The serving side: a continuous-batching engine that verifies draft trees
with a Hugging Face causal LM, and the OpenAI-compatible server; installed as
``sssd.serving``."""
