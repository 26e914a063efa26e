"""Mixed traffic: speculation at batch size, plain vs SSSD, with the batch-wide allocation.

One batch mixes chat (MT-Bench), math (GSM8K), code generation (HumanEval) and the copy-heavy sets
(code edits, agent traces, quoting), round robin, held-out prompts (the calibration never saw them).
At each batch size B the same prompts (a queue of 3 x B: continuous batching admits one as another
finishes) run, in interleaved rounds, as:

    plain      the engine with speculation off
    batch      SSSD, one budget per step shared across the batch by expected acceptance (the default)
    per-size   SSSD, one budget per batch size for every request (the planner before the allocation)
    X-fixed-threads   X (plain, batch or per-size) with the thread count fixed instead of following
               other processes' load (SSSD_FOLLOW_LOAD=0): what the load-following policy costs
    X@SOURCES  X drafting with these sources (comma-separated, as `sssd serve --draft`) instead of
               the default ones: `batch@retrieval` is the allocation without the recent outputs
    X-unfused  X with every prompt chunk written in a pass of its own (EngineConfig.fuse_prefill
               off) instead of inside the decode step's pass: `plain-unfused batch-unfused`

Each run starts from a forgotten history (LLMEngine.forget_history): the recent outputs would
otherwise draft a round's answers from the earlier rounds' answers to the same prompts. Greedy,
float32; every SSSD output is checked token-identical to plain. Reported per batch size and
configuration: tokens/s, its ratio to plain within the same round, tokens per step (per row), draft
nodes verified per step (the budget actually spent, over the batch), and for `batch` the
allocation's own predicted tokens/s beside the measured one. A plot of speedup against batch size
goes to benchmarks/out/bench_mixed.png (the paper's figure, on this CPU).

Usage:
  python benchmarks/bench_mixed.py                                   # SmolLM2, batch 1 4 16 32
  python benchmarks/bench_mixed.py --sets mtbench --batch-sizes 1 4 16 32    # pure chat
  python benchmarks/bench_mixed.py --model qwen2.5-coder-1.5b-instruct --batch-sizes 4 --max-tokens 48 \
      --datastore ~/.cache/sssd/datastores/sharegpt-qwen2.5  # sssd build <ShareGPT json> -t <qwen folder>
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, Recorder, machine  # noqa: E402

from sssd.serving.engine import EngineConfig, LLMEngine  # noqa: E402
from sssd.serving.engine.config import DEFAULT_DRAFT  # noqa: E402
from sssd.serving.engine.params import SamplingParams  # noqa: E402

MIXED = ["mtbench", "gsm8k", "humaneval", "code-edits", "agent-traces", "quoting"]
#: A configuration name ending in this runs with the thread count fixed (no load following).
FIXED = "-fixed-threads"
#: A configuration name ending in this writes prompt chunks in passes of their own (same engine).
UNFUSED = "-unfused"


def mixed_prompts(sets: list[str], n: int, skip: int = 0, fits=None) -> list[tuple[str, list]]:
    """n held-out prompts, round robin over the sets (starting `skip` prompts into each), those
    that `fits` (messages -> bool: the prompt leaves room for the answer in a KV slot)."""
    from sssd.calibration import datasets

    pools = {s: [r for r in datasets.split(datasets.load(s), "eval") if fits is None or fits(r.messages)] for s in sets}
    out, i = [], skip
    while len(out) < n:
        for s in sets:
            if len(out) < n and i < len(pools[s]):
                out.append((s, pools[s][i].messages))
        i += 1
        if all(i >= len(p) for p in pools.values()):
            break
    return out


def prompt_fits(tokenizer, max_model_len: int, max_tokens: int):
    """messages -> whether the prompt leaves room in a KV slot of `max_model_len` for an answer of
    `max_tokens` and one draft tree (mixed_prompts' `fits`)."""
    from sssd.serving.engine.prompts import encode_prompt

    room = max_model_len - max_tokens - 66

    def fits(messages) -> bool:
        try:
            return len(encode_prompt(tokenizer, messages, limit=room)) <= room
        except ValueError:  # certainly longer
            return False

    return fits


def run(engine: LLMEngine, prompts, max_tokens: int, speculate: bool) -> dict:
    params = SamplingParams(max_tokens=max_tokens, speculate=speculate)
    before = dict(engine.allocator.report()["buckets"]) if engine.allocator is not None else {}
    m = engine.metrics
    prefill0, decode0 = m.prefill_seconds, m.draft_seconds + m.forward_seconds
    passes0, fused0 = m.prefill_passes, m.prefill_fused
    t0 = time.perf_counter()
    outs = engine.generate([p for _, p in prompts], params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.stats["steps"] for o in outs)
    spent = sum(sum(o.stats["budgets"]) for o in outs)
    decode_steps = max(max(len(o.stats["budgets"]) for o in outs), 1)
    decode = m.draft_seconds + m.forward_seconds - decode0
    res = {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "prefill_seconds": round(m.prefill_seconds - prefill0, 3),
        "prefill_passes": m.prefill_passes - passes0,  # passes that only wrote prompts
        "prefill_fused": m.prefill_fused - fused0,  # prompt chunks written by decode passes
        "decode_tokens_per_s": round(tokens / decode, 3) if decode > 0 else None,
        "tokens_per_s": round(tokens / seconds, 3),
        "tokens_per_step": round(tokens / max(steps, 1), 3),
        "nodes_per_row_step": round(spent / max(steps, 1), 2),
        "decode_steps": decode_steps,
        "outputs": [o.token_ids for o in outs],
    }
    if engine.allocator is not None and speculate:
        res["allocation"] = engine.allocator.report()
        res["allocation_before"] = before
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--datastore",
        default="default",
        help="retrieval's datastore, built with the model's tokenizer ('default': SmolLM2's ShareGPT one)",
    )
    ap.add_argument("--sets", nargs="+", default=MIXED, help="prompt sets mixed round robin")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument(
        "--per-slot",
        type=int,
        default=3,
        help="prompts per KV slot: a queue, so that a request that finishes early makes room (continuous batching)",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048, help="KV slot length; longer prompts are left out")
    ap.add_argument("--configs", nargs="+", default=["plain", "batch", "per-size"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tag", default="", help="a label for this run in the output files")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    rec = Recorder("bench_mixed", vars(args))
    max_b = max(args.batch_sizes)
    engines = {}
    for c in dict.fromkeys(c.removesuffix(UNFUSED) for c in args.configs):
        base, _, draft = c.removesuffix(FIXED).partition("@")
        if base == "plain":
            continue
        engines[c] = LLMEngine(
            args.model,
            datastore=args.datastore,
            draft=draft.split(",") if draft else DEFAULT_DRAFT,
            config=EngineConfig(
                max_running=max_b, max_model_len=args.max_model_len, allocation=base, threads=args.threads
            ),
        )
        if c.endswith(FIXED):
            engines[c].contention = None
    if not engines:
        engines["batch"] = LLMEngine(
            args.model,
            datastore=args.datastore,
            config=EngineConfig(max_running=max_b, max_model_len=args.max_model_len, threads=args.threads),
        )
    plain_engine = next((e for c, e in engines.items() if not c.endswith(FIXED)), next(iter(engines.values())))
    fixed_plain = next((e for c, e in engines.items() if c.endswith(FIXED)), None)
    if fixed_plain is None and "plain" + FIXED in args.configs:
        fixed_plain = LLMEngine(
            args.model,
            datastore=args.datastore,
            config=EngineConfig(max_running=max_b, max_model_len=args.max_model_len, threads=args.threads),
        )
        fixed_plain.contention = None
    fits = prompt_fits(plain_engine.tokenizer, args.max_model_len, args.max_tokens)
    warm = mixed_prompts(args.sets, 2, skip=50, fits=fits)  # first calls (prefill shapes, the profile) stay out
    for eng in [*engines.values(), *([fixed_plain] if fixed_plain is not None else [])]:
        for speculate in (False, True):
            eng.generate([p for _, p in warm], SamplingParams(max_tokens=8, speculate=speculate))
    print(f"machine: {json.dumps(machine())}", flush=True)
    rows = []
    for B in args.batch_sizes:
        prompts = mixed_prompts(args.sets, args.per_slot * B if B > 1 else 2 * len(args.sets), fits=fits)
        for r in range(args.rounds):
            order = args.configs[r % len(args.configs) :] + args.configs[: r % len(args.configs)]
            res = {}
            for c in order:
                name = c.removesuffix(UNFUSED)
                if name.removesuffix(FIXED) == "plain":
                    eng = fixed_plain if name.endswith(FIXED) else plain_engine
                else:
                    eng = engines[name]
                eng.config = dataclasses.replace(eng.config, fuse_prefill=not c.endswith(UNFUSED))
                eng.limit_running(B)  # the slots stay allocated for the largest batch
                eng.forget_history()  # the recent outputs hold earlier rounds' answers to these prompts
                res[c] = run(eng, prompts, args.max_tokens, speculate=name.removesuffix(FIXED) != "plain")
            base = res.get("plain")
            for c in args.configs:
                x = res[c]
                row = {
                    "batch": B,
                    "round": r,
                    "config": c,
                    **{k: v for k, v in x.items() if k not in ("outputs",)},
                    "speedup": round(x["tokens_per_s"] / base["tokens_per_s"], 3) if base else None,
                    "decode_speedup": round(x["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
                    if base
                    else None,
                    "identical": (x["outputs"] == base["outputs"]) if base else None,
                }
                rows.append(row)
                rec.add(**row)
                alloc = x.get("allocation", {}).get("buckets", {})
                bucket = alloc.get(1 << max(0, B - 1).bit_length(), {})
                print(
                    f"B={B:<3} r{r} {c:<9} {x['tokens_per_s']:8.2f} tok/s  x{row['speedup'] or 1:.3f}  "
                    f"decode x{row['decode_speedup'] or 1:.3f}  prefill {x['prefill_seconds']:.1f}s "
                    f"({x['prefill_passes']} passes, {x['prefill_fused']} fused)  "
                    f"tok/step {x['tokens_per_step']:.2f}  nodes/row/step {x['nodes_per_row_step']:.2f}  "
                    f"identical {row['identical']}"
                    + (
                        f"  predicted {bucket.get('predicted_tokens_per_s')} measured {bucket.get('measured_tokens_per_s')} tok/s"
                        if bucket
                        else ""
                    ),
                    flush=True,
                )
    summary = summarize(rows, args)
    print(summary)
    plot(rows, args)
    return 0


def summarize(rows, args) -> str:
    lines = [
        "| batch | config | tok/s (median) | vs plain (per round) | mean vs plain (+-2 SE) | decode only, vs plain | "
        "tokens/step | nodes/row/step | identical |",
        "|---:|---|---:|---|---|---|---:|---:|---|",
    ]
    for B in args.batch_sizes:
        for c in args.configs:
            rs = [r for r in rows if r["batch"] == B and r["config"] == c]
            if not rs:
                continue
            sp = ", ".join(f"{r['speedup']:.2f}" for r in rs if r["speedup"] is not None)
            dsp = ", ".join(f"{r['decode_speedup']:.2f}" for r in rs if r["decode_speedup"] is not None)
            lines.append(
                f"| {B} | {c} | {np.median([r['tokens_per_s'] for r in rs]):.1f} | {sp} | "
                f"{mean_with_error([r['speedup'] for r in rs if r['speedup'] is not None])} | {dsp} | "
                f"{np.median([r['tokens_per_step'] for r in rs]):.2f} | "
                f"{np.median([r['nodes_per_row_step'] for r in rs]):.2f} | "
                f"{all(r['identical'] is not False for r in rs)} |"
            )
    return "\n".join(lines)


def mean_with_error(ratios: list[float]) -> str:
    """The rounds' mean ratio and two standard errors of it: a round's ratio moves +-5% on a noisy
    machine, so whether a goal such as "never below 0.98x" holds is read off the mean, not a round."""
    if not ratios:
        return "-"
    m = float(np.mean(ratios))
    if len(ratios) < 2:
        return f"{m:.3f}"
    se = float(np.std(ratios, ddof=1)) / np.sqrt(len(ratios))
    return f"{m:.3f} +- {2 * se:.3f}"


def plot(rows, args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in args.configs:
        if c == "plain":
            continue
        xs = args.batch_sizes
        ys = [np.median([r["speedup"] for r in rows if r["batch"] == B and r["config"] == c]) for B in xs]
        ax.plot(xs, ys, marker="o", label=f"SSSD, {c}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="plain decoding")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s over plain")
    # two lines: a six-set mix with the model and CPU names does not fit the figure's width on one
    ax.set_title(
        f"{args.model} ({machine().get('cpu', 'CPU')}, {args.max_tokens} tokens)\n{' + '.join(args.sets)}", fontsize=8
    )
    ax.legend()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"bench_mixed{('-' + args.tag) if args.tag else ''}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
