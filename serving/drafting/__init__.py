"""Draft sources that run models, and decoding modes: what plugs into the engine's step.

model_drafter.py  a draft model's SpecInfer token trees (model:NAME)
self_drafter.py   self-speculation over a sparse view of the target's KV cache (self:METHOD)
async_draft.py    drafting the next step's trees while the target verifies (draft_mode="async")
specpipe.py       SpecPipe's pipelined token trees over pipeline stages
slots.py          the KV slot table these sources keep
"""
