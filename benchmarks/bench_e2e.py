"""End-to-end decoding speed: SSSD vs the same engine without speculation.

For each model and prompt set, at each batch size, the same prompts are
generated twice in one run (greedy, float32): by the engine with SSSD
speculation (budget chosen per step by the planner, or fixed with
--budget) and by the same engine with speculation off (plain first; the
engine forgets its history before each speculative run, so that the recent
outputs never hold an answer to the same prompt). Reported per run:
output tokens per second (all requests), mean per-token latency (a
request's time from admission to last token / its tokens, averaged), the
same after each request's first token (its decoding, without the prompt's
prefill: the part speculation speeds up) and the time to the first, MAT,
the budgets the planner chose, whether the outputs were identical (they
must be), and the predicted speedup: the run's MAT over the profiled
forward cost of its steps relative to a one-token step (measured /
predicted is what the engine's own overhead leaves of the drafts' gain). At batch 1 it also times Hugging Face transformers' own
generate() with prompt_lookup_num_tokens (its prompt lookup decoding).

Plots (benchmarks/out/): latency vs throughput per model (the paper's
Figure 6 shape) and the forward-cost curve (time per step vs tokens per
step) that the planner profiles.

Draft-source ablation (--draft-sets): instead of the default sources, each
listed set of draft sources (spec strings, comma-separated, as
`sssd serve --draft` takes them) drafts the same prompts, each against the
same plain run; `recycle` alone is Token Recycling's own row (the peer).
Each set has one engine over the one loaded model for the whole run, so
its sources stay warm from run to run as a server's would (Token
Recycling's matrix, the recent outputs); no prompt is generated twice by
an engine: each batch size of a set takes the next prompts of the split.
Reported per set: tokens/s over plain, MAT, accepted draft tokens per
step, and accepted tokens per source; the plots are skipped.

Usage:
  python benchmarks/bench_e2e.py --models smollm2-135m-instruct --sets mtbench gsm8k humaneval
  python benchmarks/bench_e2e.py --batch-sizes 1 4 16 --prompts 8 --max-tokens 128
  python benchmarks/bench_e2e.py --batch-sizes 1 4 --max-tokens 64 --no-hf \\
      --draft-sets retrieval recycle retrieval,recycle retrieval,recycle,recent
  python benchmarks/bench_e2e.py --sets agent-traces code-edits mtbench --batch-sizes 1 4 --no-hf \
      --max-model-len 3072 --draft-sets retrieval,recent retrieval,recent/no-evidence
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, Recorder, machine  # noqa: E402

from sssd.serving.engine import EngineConfig, LLMEngine  # noqa: E402
from sssd.serving.engine.params import SamplingParams  # noqa: E402


def load_prompts(dataset: str, n: int):
    """Chat prompts from a packaged evaluation set (see sssd.calibration.datasets)."""
    from sssd.calibration import datasets

    records = datasets.load(dataset)  # also the copy-heavy sets (code-edits, agent-traces, quoting)
    eval_part = datasets.split(records, "eval")  # the calibration tool never saw these
    return [r.messages for r in eval_part[:n]]


def run(engine: LLMEngine, prompts, max_tokens: int, speculate: bool):
    """Generates every prompt (at most engine.config.max_running at once); returns outputs and seconds."""
    params = SamplingParams(max_tokens=max_tokens, speculate=speculate)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0


def summarize(outs, seconds: float) -> dict:
    tokens = sum(len(o.token_ids) for o in outs)
    lat = [(o.metrics["finish"] - o.metrics["arrival"]) / max(len(o.token_ids), 1) for o in outs]
    # after the first token: what speculation speeds up (a long prompt's prefill is not)
    decode = [
        (o.metrics["finish"] - o.metrics["first_token"]) / (len(o.token_ids) - 1)
        for o in outs
        if len(o.token_ids) > 1 and o.metrics.get("first_token") is not None
    ]
    first = [o.metrics["first_token"] - o.metrics["arrival"] for o in outs if o.metrics.get("first_token") is not None]
    steps = sum(o.stats["steps"] for o in outs)
    accepted = sum(o.stats.get("accepted", 0) for o in outs)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3),
        "latency_ms_per_token": round(1e3 * float(np.mean(lat)), 2),
        "decode_ms_per_token": round(1e3 * float(np.mean(decode)), 2) if decode else None,
        "first_token_s": round(float(np.mean(first)), 3) if first else None,
        "mat": round(tokens / steps, 4) if steps else None,
        "accepted_per_step": round(accepted / steps, 4) if steps else None,
    }


def decode_speedup(s: dict, p: dict) -> float | None:
    """Plain's mean time per token after a request's first over SSSD's: the speedup of the decoding
    that speculation does (tokens/s also counts each prompt's prefill, the same work in both)."""
    if not s["decode_ms_per_token"] or not p["decode_ms_per_token"]:
        return None
    return round(p["decode_ms_per_token"] / s["decode_ms_per_token"], 3)


def ablation_table(rows) -> str:
    """The draft-source ablation as a markdown table (one line per set, batch size and draft set)."""
    lines = [
        "| set | batch | draft sources | tok/s | vs plain | after the first token | MAT | accepted/step "
        "| accepted by source | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        by = ", ".join(f"{k} {v}" for k, v in sorted(r["accepted_by_source"].items(), key=lambda kv: -kv[1])) or "-"
        lines.append(
            f"| {r['set']} | {r['batch']} | {r['draft']} | {r['sssd']['tokens_per_s']:.1f} "
            f"(plain {r['plain']['tokens_per_s']:.1f}) | {r['speedup']:.2f}x | {r['sssd']['mat']} | "
            f"{r['sssd']['accepted_per_step']} | {by} | {r['identical']} |"
        )
    return "\n".join(lines)


def predicted_speedup(engine: LLMEngine, batch: int, mat: float | None, budgets: dict[int, int]) -> float | None:
    """What the accepted length and the forward-cost profile promise: the run's mean accepted length
    over the mean forward cost of its steps (at the budgets the planner ran, weighted by their step
    counts) relative to a one-token step. Everything else a step costs is the engine's overhead, so
    measured / predicted is the engine's efficiency."""
    prof = engine.planner.profile
    steps = sum(budgets.values())
    if prof is None or not mat or not steps:
        return None
    one = prof.time(batch, 1)
    cost = sum(n * prof.time(batch, b + 1) / one for b, n in budgets.items()) / steps
    return round(mat / cost, 3)


def hf_prompt_lookup(model, eos: list[int], prompt_ids, max_tokens: int, reference, ngram: int = 10):
    """transformers' generate() with prompt lookup decoding, batch 1, greedy; `reference` are the
    plain engine's outputs (token ids), to check that its output is the same."""
    import torch

    tokens, same, t0 = 0, 0, time.perf_counter()
    for p, ref in zip(prompt_ids, reference):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                prompt_lookup_num_tokens=ngram,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
        new = out[0, ids.shape[1] :].tolist()
        tokens += len(new)
        same += new == list(ref)
    seconds = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3),
        "identical_to_plain": f"{same}/{len(prompt_ids)}",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"], help="model names or folders")
    ap.add_argument(
        "--datastores",
        nargs="+",
        default=["default"],
        help="one per model: a datastore built with that model's tokenizer ('default' for SmolLM2)",
    )
    ap.add_argument(
        "--drafter", default=None, help="drafter config / `sssd calibrate` parameter file (per model: same)"
    )
    ap.add_argument("--sets", nargs="+", default=["mtbench", "gsm8k", "humaneval"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per set at batch 1 (fewest)")
    ap.add_argument(
        "--prompts-per-row",
        type=int,
        default=2,
        help="at batch B, max(--prompts, B x this) prompts, so every batch size runs full for a while",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024, help="KV slot length (prompt + output + tree)")
    ap.add_argument("--budget", type=int, default=None, help="fixed draft budget (default: the planner chooses)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers prompt-lookup baseline")
    ap.add_argument(
        "--draft-sets",
        nargs="+",
        default=None,
        help="draft-source ablation: sets of sources to compare, each comma-separated "
        "(e.g. retrieval recycle retrieval,recycle retrieval,recycle,recent); a set ending in /no-evidence "
        "drafts without each request's acceptance by source (EngineConfig.source_evidence=False)",
    )
    args = ap.parse_args()
    if len(args.datastores) == 1:
        args.datastores = args.datastores * len(args.models)
    rec = Recorder("e2e", vars(args))
    curves = {}
    for model, ds in zip(args.models, args.datastores):
        max_b = max(args.batch_sizes)
        # One copy of the model (Qwen2.5-Coder-1.5B is 6 GB in float32): the plain runs are the same
        # engine with speculation off per request (SamplingParams(speculate=False)).
        spec = LLMEngine(
            model,
            datastore=ds,
            drafter=args.drafter,
            config=EngineConfig(
                max_running=max_b, max_model_len=args.max_model_len, budget=args.budget, threads=args.threads
            ),
        )
        name = Path(spec.backend.info.path).name
        hf_jobs = []  # batch-1 rows for transformers' prompt lookup, run once the engine is gone
        if spec.planner.profile is not None:
            print(
                f"{name}: planner choices " + ", ".join(f"B={r['batch']}: {r['budget']}" for r in spec.planner.table())
            )
        curves[name] = []
        ablation = {}
        if args.draft_sets:
            print(f"{name}: draft-source ablation over {args.draft_sets}")
            ablation = {
                d: LLMEngine(
                    model,
                    datastore=ds,
                    drafter=args.drafter,
                    draft=d.removesuffix("/no-evidence"),
                    backend=spec.backend,
                    config=replace(spec.config, source_evidence=not d.endswith("/no-evidence")),
                )
                for d in args.draft_sets
            }
        for dataset in args.sets:
            sizes = [max(args.prompts, args.prompts_per_row * B) for B in args.batch_sizes]
            all_prompts = load_prompts(dataset, sum(sizes) if ablation else max(sizes))
            for B, n in zip(args.batch_sizes, sizes):
                prompts = all_prompts[:n]
                if ablation:  # fresh prompts for warm sources
                    prompts, all_prompts = all_prompts[:n], all_prompts[n:]
                spec.limit_running(B)  # at most B at once (the slots stay allocated for the largest batch)
                spec.metrics.budgets.clear()
                po, pt = run(spec, prompts, args.max_tokens, speculate=False)
                spec.metrics.budgets.clear()
                if ablation:
                    rows = ablation_rows(ablation, args, dataset, B, prompts, po, pt)
                    curves[name].extend(rows)
                    if B == 1 and not args.no_hf:
                        hf_jobs.append((rows[0], [spec.encode(p) for p in prompts], [o.token_ids for o in po]))
                    continue
                # the plain run's answers to these prompts (and earlier batch sizes') are in the recent
                # outputs: forgotten, or this run would draft its own answers from them
                spec.forget_history()
                so, st = run(spec, prompts, args.max_tokens, speculate=True)
                s, p = summarize(so, st), summarize(po, pt)
                same = all(a.token_ids == b.token_ids for a, b in zip(so, po))
                budgets = dict(sorted(spec.metrics.budgets.items()))
                spec.metrics.budgets.clear()
                row = {
                    "model": name,
                    "set": dataset,
                    "batch": B,
                    "prompts": len(prompts),
                    "sssd": s,
                    "plain": p,
                    "speedup": round(s["tokens_per_s"] / p["tokens_per_s"], 3),
                    "decode_speedup": decode_speedup(s, p),
                    "identical": same,
                    "budgets": budgets,
                }
                predicted = predicted_speedup(spec, B, s["mat"], budgets)
                if predicted:
                    row["predicted"] = predicted
                    row["of_predicted"] = round(row["speedup"] / predicted, 3)
                if B == 1 and not args.no_hf:
                    hf_jobs.append((row, [spec.encode(p) for p in prompts], [o.token_ids for o in po]))
                curves[name].append(row)
                print(
                    f"{name:24s} {dataset:9s} B={B:<3d} sssd {s['tokens_per_s']:7.2f} tok/s {s['latency_ms_per_token']:8.1f} ms/tok "
                    f"MAT {s['mat']}  | plain {p['tokens_per_s']:7.2f} tok/s {p['latency_ms_per_token']:8.1f} ms/tok "
                    f"| speedup {row['speedup']:.2f}x, after the first token {row['decode_speedup']}x "
                    f"(first token {s['first_token_s']} s vs {p['first_token_s']} s; predicted {row.get('predicted')}) "
                    f"identical={same} budgets={budgets}",
                    flush=True,
                )
        if args.draft_sets:
            print(ablation_table(curves[name]))
        else:
            plot(curves[name], name, spec)
        path, eos = Path(spec.backend.info.path), sorted(spec.eos_ids)
        del spec, ablation
        gc.collect()
        if hf_jobs:
            import torch
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for row, prompt_ids, reference in hf_jobs:
                row["hf_prompt_lookup"] = hf_prompt_lookup(hf, eos, prompt_ids, args.max_tokens, reference)
        for row in curves[name]:
            rec.add(**row)
            if "hf_prompt_lookup" in row:
                h = row["hf_prompt_lookup"]
                print(
                    f"{name:24s} {row['set']:9s} B=1   HF prompt lookup {h['tokens_per_s']:7.2f} tok/s "
                    f"(SSSD {row['sssd']['tokens_per_s']:.2f}, plain {row['plain']['tokens_per_s']:.2f}; "
                    f"identical to plain {h['identical_to_plain']})",
                    flush=True,
                )
    print(f"machine: {machine()}; records: {rec.path}")
    return 0


def ablation_rows(
    engines: dict[str, LLMEngine], args, dataset: str, B: int, prompts, plain_outs, plain_seconds: float
) -> list[dict]:
    """One row per draft set: its engine generates the prompts (at most B at once), compared with
    the plain run."""
    p = summarize(plain_outs, plain_seconds)
    rows = []
    for draft, eng in engines.items():
        eng.limit_running(B)
        eng.metrics.budgets.clear()
        before = dict(eng.metrics.accepted_by_source)
        outs, seconds = run(eng, prompts, args.max_tokens, speculate=True)
        s = summarize(outs, seconds)
        budgets = dict(sorted(eng.metrics.budgets.items()))
        by = {k: v - before.get(k, 0) for k, v in eng.metrics.accepted_by_source.items() if v > before.get(k, 0)}
        name = Path(eng.backend.info.path).name
        row = {
            "model": name,
            "set": dataset,
            "batch": B,
            "prompts": len(prompts),
            "draft": draft,
            "sssd": s,
            "plain": p,
            "speedup": round(s["tokens_per_s"] / p["tokens_per_s"], 3),
            "decode_speedup": decode_speedup(s, p),
            "identical": all(a.token_ids == b.token_ids for a, b in zip(outs, plain_outs)),
            "budgets": budgets,
            "accepted_by_source": by,
        }
        predicted = predicted_speedup(eng, B, s["mat"], budgets)
        if predicted:
            row["predicted"] = predicted
        rows.append(row)
        print(
            f"{name:24s} {dataset:9s} B={B:<3d} {draft:28s} {s['tokens_per_s']:7.2f} tok/s "
            f"(plain {p['tokens_per_s']:7.2f}) {row['speedup']:.2f}x (after the first token {row['decode_speedup']}x) "
            f"MAT {s['mat']} "
            f"accepted/step {s['accepted_per_step']} by source {by} identical={row['identical']} "
            f"budgets={budgets}",
            flush=True,
        )
    return rows


def plot(rows, name: str, engine: LLMEngine) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4.5))
    for key, label in (("sssd", "SSSD"), ("plain", "no speculation")):
        for dataset in sorted({r["set"] for r in rows}):
            pts = sorted(
                (r["batch"], r[key]["tokens_per_s"], r[key]["latency_ms_per_token"])
                for r in rows
                if r["set"] == dataset
            )
            ax[0].plot(
                [p[1] for p in pts],
                [p[2] for p in pts],
                marker="o",
                label=f"{label}, {dataset}",
                linestyle="-" if key == "sssd" else "--",
            )
            for b, x, y in pts:
                ax[0].annotate(str(b), (x, y), fontsize=7)
    ax[0].set_xlabel("throughput (output tokens/s)")
    ax[0].set_ylabel("mean latency per token (ms)")
    ax[0].set_title(f"{name}: latency vs throughput (labels: batch size)")
    ax[0].grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    prof = engine.planner.profile
    if prof is not None:
        for r, secs in zip(prof.rows, prof.seconds):
            ax[1].plot([r * t for t in prof.tokens], [1e3 * s for s in secs], marker=".", label=f"{r} rows")
        ax[1].set_xscale("log", base=2)
        ax[1].set_xlabel("query tokens per forward pass (rows x tokens per row)")
        ax[1].set_ylabel("forward pass (ms)")
        ax[1].set_title("forward cost (the planner's profile)")
        ax[1].grid(alpha=0.3)
        ax[1].legend(fontsize=7)
    fig.tight_layout()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT_DIR / f"e2e_{name}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
