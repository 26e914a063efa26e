"""The side-by-side's prompt sets, round order, per-cell figures and tables (sssd.serving.frontends.vllm_compare).

Pure functions, no vLLM: prompt sets come from sssd.calibration.datasets (the dev split for
tuning, the eval split for the report, the two disjoint), tokenized once with the model's chat
template exactly as the ground-truth files are (calibration.ground_truth.prompt_ids); a cell is
one prompt set x one concurrency (max_num_seqs) x one method, summarized over interleaved rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from sssd.serving.planning.step_timing import FIELDS, empty_sums, summarize

#: The prompt sets of the side-by-side: chat, code generation, and the copy-heavy sets.
SETS = ("mtbench", "humaneval", "code-edits", "agent-traces", "quoting")
#: A small built-in set (no dataset files needed): chat questions and HumanEval-style completions.
BUILTIN = "builtin"

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


# -- prompt sets ---------------------------------------------------------------


def records(name: str) -> list[tuple[str, list[dict]]]:
    """A prompt set as (id, chat messages): BUILTIN, or a sssd.calibration.datasets set."""
    if name == BUILTIN:
        return [(f"builtin/{i}", [{"role": "user", "content": p}]) for i, p in enumerate(PROMPTS)]
    from sssd.calibration import datasets

    return [(r.id, r.messages) for r in datasets.load(name) if not r.follows]


def prompt_set(
    name: str, part: str, n: int, encode: Callable[[list[dict]], list[int]], room: int
) -> tuple[list[str], list[list[int]], int]:
    """The first ``n`` prompts of one side ("dev" or "eval") of a set's dev/eval split that fit in
    ``room`` tokens: (ids, prompt token ids, how many earlier ones were left out as too long)."""
    from sssd.calibration.datasets import split

    ids, prompts, left_out = [], [], 0
    for rid, messages in split(records(name), part, key=lambda r: r[0]):
        if len(prompts) >= n:
            break
        tokens = encode(messages)
        if len(tokens) > room:
            left_out += 1
            continue
        ids.append(rid)
        prompts.append(tokens)
    return ids, prompts, left_out


def chat_encoder(model: str) -> Callable[[list[dict]], list[int]]:
    """Messages -> prompt token ids with the model's chat template, as the ground-truth files have them."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from sssd.calibration.ground_truth import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return lambda messages: prompt_ids(tokenizer, messages)


# -- round order ---------------------------------------------------------------


def schedule(methods: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, method) in the order they run: every method once per round, round after round, each
    round starting one method later than the one before (so no method always runs first)."""
    methods = list(methods)
    order = []
    for r in range(rounds):
        k = r % len(methods) if methods else 0
        order += [(r, m) for m in methods[k:] + methods[:k]]
    return order


# -- per-cell figures ----------------------------------------------------------


def spec_figures(counters: dict, tokens: int) -> dict:
    """vLLM's spec-decode counters as the figures vLLM's log derives from them."""
    drafts = counters.get("spec_decode_num_drafts", 0)
    draft_tokens = counters.get("spec_decode_num_draft_tokens", 0)
    accepted = counters.get("spec_decode_num_accepted_tokens", 0)
    steps = tokens - accepted
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "draft_acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
        "tokens_per_step": round(tokens / steps, 3) if steps > 0 else None,
    }


def add_counters(a: dict, b: dict) -> dict:
    """Two readings of vLLM's counters added (vector counters position by position)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, list):
            w = out.get(k, [])
            out[k] = [x + y for x, y in zip(w + [0] * (len(v) - len(w)), v + [0] * (len(w) - len(v)))]
        else:
            out[k] = out.get(k, 0) + v
    return out


def _median(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def cells(runs: Sequence[dict], methods: Sequence[str]) -> list[dict]:
    """One summary per (set, max_num_seqs, method) from the runs (each: set, num_seqs, round, method,
    tokens, seconds, token_ids, spec_decode counters, optional timing sums and config).

    Per cell: tokens/s each round and their median; the ratio to plain vLLM of the same round, each
    round and the median (and to ``plain-sync``, plain with asynchronous scheduling off, where it
    ran: what a speculative method's drafts earn apart from the scheduling vLLM gives up); vLLM's counters summed over rounds and their figures; whether every
    round's outputs are token-identical to plain's of the same round; the requests' mean latency
    (queued to last token) and plain's over it in the same round (> 1: answers come sooner); for SSSD the drafting share
    of the step (its proposer's timing) and the ratio to the best suffix method of the cell (the
    suffix method with the higher median tokens/s), round by round and the median.
    """
    by: dict[tuple, dict[int, dict]] = {}
    for run in runs:
        by.setdefault((run["set"], run["num_seqs"], run["method"]), {})[run["round"]] = run
    groups = list(dict.fromkeys((s, n) for s, n, _ in by))
    out = []
    for s, n in groups:
        plain = by.get((s, n, "plain"), {})
        sync = by.get((s, n, "plain-sync"), {})
        group = []
        for m in methods:
            rounds = by.get((s, n, m))
            if not rounds:
                continue
            order = sorted(rounds)
            tps = [rounds[r]["tokens"] / rounds[r]["seconds"] for r in order]
            ratios = [t / (plain[r]["tokens"] / plain[r]["seconds"]) for r, t in zip(order, tps) if r in plain]
            counters: dict = {}
            timing = empty_sums()
            for r in order:
                counters = add_counters(counters, rounds[r].get("spec_decode", {}))
                for label, sums in (rounds[r].get("timing") or {}).items():
                    timing[label] = {f: timing[label][f] + sums[f] for f in FIELDS}
            tokens = sum(rounds[r]["tokens"] for r in order)
            identical = [rounds[r]["token_ids"] == plain[r]["token_ids"] if r in plain else None for r in order]
            cell = {
                "set": s,
                "num_seqs": n,
                "method": m,
                "config": rounds[order[0]].get("config"),
                "rounds": len(order),
                "tokens_per_s": _median(tps),
                "tokens_per_s_rounds": [round(t, 2) for t in tps],
                "ratio_to_plain": _median(ratios),
                "ratio_to_plain_rounds": [round(x, 3) for x in ratios],
                **spec_figures(counters, tokens),
                "identical": all(x is True for x in identical),
                "identical_rounds": identical,
            }
            lat = [rounds[r].get("latency_s") for r in order]
            if all(lat):
                cell["latency_s"] = _median(lat)
                vs_lat = [plain[r]["latency_s"] / x for r, x in zip(order, lat) if plain.get(r, {}).get("latency_s")]
                cell["latency_vs_plain"] = _median(vs_lat)
            if sync and m not in ("plain", "plain-sync"):
                vs_sync = [t / (sync[r]["tokens"] / sync[r]["seconds"]) for r, t in zip(order, tps) if r in sync]
                cell["ratio_to_plain_sync"] = _median(vs_sync)
            if any(rounds[r].get("timing") for r in order):
                summary = summarize(timing)
                cell["draft_share"] = summary["all"]["share"]
                cell["propose_ms"] = summary["all"]["propose_ms"]
                cell["timing"] = summary
            group.append((cell, rounds, order, tps))
        suffixes = [(c, r, tps) for c, r, _, tps in group if c["method"].startswith("suffix")]
        if suffixes:
            best, best_rounds, _ = max(suffixes, key=lambda x: x[0]["tokens_per_s"])
            for cell, _rounds, order, tps in group:
                if not cell["method"].startswith("sssd"):
                    continue
                vs = [
                    t / (best_rounds[r]["tokens"] / best_rounds[r]["seconds"])
                    for r, t in zip(order, tps)
                    if r in best_rounds
                ]
                cell["best_suffix"] = best["method"]
                cell["vs_best_suffix"] = _median(vs)
                cell["vs_best_suffix_rounds"] = [round(x, 3) for x in vs]
        out += [c for c, *_ in group]
    return out


# -- tables --------------------------------------------------------------------


def _fmt(v: Any, spec: str = "") -> str:
    return "–" if v is None else format(v, spec)


def table(cells_: Sequence[dict], skipped: dict[str, str] | None = None) -> str:
    """The cells as one markdown table (rows by set, then concurrency, then method)."""
    rows = [
        "| set | seqs | method | tokens/s (median; rounds) | vs plain | SSSD vs best suffix "
        "| request latency vs plain | mean acceptance length | draft tokens | accepted | drafting share "
        "| identical to plain |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cells_:
        each = ", ".join(f"{t:.1f}" for t in c["tokens_per_s_rounds"])
        vs = f"{c['vs_best_suffix']:.2f}× ({c['best_suffix']})" if c.get("vs_best_suffix") is not None else ""
        share = c.get("draft_share")
        sync = f" ({c['ratio_to_plain_sync']:.2f}× sync)" if c.get("ratio_to_plain_sync") is not None else ""
        same = "(reference)" if c["method"] == "plain" else ("yes" if c["identical"] else "**no**")
        latency = f"{c['latency_vs_plain']:.2f}× ({c['latency_s']:.1f} s)" if c.get("latency_vs_plain") else ""
        rows.append(
            f"| {c['set']} | {c['num_seqs']} | {c['method']} | {c['tokens_per_s']:.1f} ({each}) "
            f"| {_fmt(c['ratio_to_plain'], '.2f')}×{sync} | {vs} | {latency} | {_fmt(c['mean_acceptance_length'], '.2f')} "
            f"| {c['draft_tokens']} | {c['accepted']} | {'' if share is None else f'{share:.1%}'} | {same} |"
        )
    for method, why in (skipped or {}).items():
        rows.append(f"| | | {method} | skipped: {why} | | | | | | | | |")
    return "\n".join(rows)


def sweep_table(sweep: dict) -> str:
    """The suffix sweep on development prompts: tokens/s per setting, per concurrency and set."""
    rows = ["| seqs | set | suffix setting | tokens/s (dev) | chosen |", "|---:|---|---|---:|---|"]
    for n, by_set in sweep.items():
        for s, res in by_set.items():
            for point in res["points"]:
                setting = ", ".join(f"{k.removeprefix('suffix_decoding_')}={v}" for k, v in point["params"].items())
                chosen = "**best**" if point["params"] == res["best"] else ""
                rows.append(f"| {n} | {s} | {setting} | {point['tokens_per_s']:.1f} | {chosen} |")
    return "\n".join(rows)
