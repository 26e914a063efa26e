"""The serving side, installed as ``sssd.serving`` (docs/architecture.md draws it).

Layers, each importing only those below it (import-linter checks it):

    frontends/, vllm_proposer.py   the OpenAI server, sssd.LLM, metrics; SSSD inside vLLM
    engine/                        continuous batching: scheduler, the decode step, requests
    drafting/                      draft models, self-speculation, async drafting, SpecPipe
    backends/                      the target model on a device, its KV pool, attention
    planning/                      forward-cost profiles, roofline, the budget planner
    verify/                        packed draft trees and their verification
"""
