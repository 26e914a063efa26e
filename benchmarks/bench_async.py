"""Asynchronous drafting (SwiftSpec) against serial drafting, side by side, and a step timeline.

For one target, a draft model with its tokenizer and a datastore, the same prompts are
generated (greedy, float32) by plain decoding and, per draft-source set (retrieval, model,
hybrid = both), by:
  serial       drafting before each forward pass (the default engine);
  async        the next step's trees grown on a drafting thread beside every forward pass
               (serving.async_draft, forced on every step), torch threads shared;
  async-split  the same with one core each: the verifier on one torch thread pinned to core 0,
               the drafting thread on one torch thread pinned to core 1;
  auto         `draft_mode="async"` as users get it: the measured choice per batch size
               (async where it was faster, serial where nothing is hidden).
All over one loaded copy of the target and one of the draft model. Per row: tokens/s (and
the ratio to serial), MAT, accepted draft tokens per step, the share of steps whose tree came
re-rooted from the thread, seconds per step on the critical path drafting (serial drafting in
prepare plus waiting for the thread), the thread's drafting per step and how much of it
overlapped a forward pass (time hidden), and whether the outputs equal plain decoding's.

One run's per-step timeline (drafting, forward, acceptance, waiting/idle, and the thread's
drafting) is plotted to benchmarks/figures/async_timeline_<target>.png.

Usage:
  python benchmarks/bench_async.py                                # SmolLM2-135M drafting for itself
  python benchmarks/bench_async.py --model qwen2.5-coder-1.5b-instruct \\
      --draft-model qwen2.5-coder-0.5b-instruct --datastore ~/.cache/sssd/datastores/sharegpt-qwen2.5 \\
      --batch-sizes 1 --sources model hybrid --max-tokens 48
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_e2e import load_prompts, summarize  # noqa: E402
from common import Recorder, machine  # noqa: E402

from sssd.serving.drafting.async_draft import ModeChooser  # noqa: E402
from sssd.serving.drafting.model_drafter import DEFAULT_EXPANSION, ModelDrafter  # noqa: E402
from sssd.serving.engine import EngineConfig, LLMEngine  # noqa: E402
from sssd.serving.engine.params import SamplingParams  # noqa: E402

MODES = ("serial", "async", "async-split", "auto")
FIGURES = Path(__file__).resolve().parent / "figures"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target: model name or folder")
    ap.add_argument("--draft-model", default=None, help="draft model: name or folder (default: the target itself)")
    ap.add_argument("--datastore", default="default", help="retrieval's datastore, built with the target's tokenizer")
    ap.add_argument("--drafter", default=None, help="drafter config / `sssd calibrate` file for retrieval")
    ap.add_argument(
        "--expansion",
        default=",".join(map(str, DEFAULT_EXPANSION)),
        help="the draft model's tree: children per level, SpecInfer's <k1,...,km>",
    )
    ap.add_argument(
        "--sources", nargs="+", default=["retrieval", "model", "hybrid"], choices=("retrieval", "model", "hybrid")
    )
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--set", default="humaneval", help="prompt set (bench_e2e.load_prompts)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts-per-row", type=int, default=1, help="B x this prompts per batch size")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=8, help="fixed draft budget of every run")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the verifier (and shared drafting)")
    ap.add_argument(
        "--always-draft",
        action="store_true",
        help="the draft model drafts in every step beside retrieval (default: only where it pays)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every mode this many times, interleaved (serial, async, ..., serial, async, ...): "
        "on a shared machine, the spread between rounds is the noise",
    )
    ap.add_argument("--timeline", default="hybrid:1", help="SOURCES:B of the async run whose timeline is plotted")
    args = ap.parse_args()
    rec = Recorder("async", vars(args))
    max_b = max(args.batch_sizes)
    config = EngineConfig(max_running=max_b, max_model_len=args.max_model_len, budget=args.budget, threads=args.threads)
    plain = LLMEngine(args.model, datastore=None, draft=[], config=config)
    backend = plain.backend  # one copy of the target for every run
    source = None
    if {"model", "hybrid"} & set(args.sources):
        source = ModelDrafter(
            args.draft_model or args.model,
            target=backend.info.path,
            target_tokenizer=plain.tokenizer,
            slots=max_b,
            capacity=plain.max_model_len,
            expansion=args.expansion,
            threads=args.threads,
            complement=not args.always_draft,
        )
    sets = {"retrieval": ["retrieval"], "model": [source], "hybrid": ["retrieval", source]}
    engines = {}
    for name in args.sources:
        for mode in args.modes:
            eng = LLMEngine(
                args.model,
                datastore=args.datastore if "retrieval" in sets[name] else None,
                drafter=args.drafter,
                draft=sets[name],
                backend=backend,
                config=EngineConfig(**{**config.__dict__, "draft_mode": "serial" if mode == "serial" else "async"}),
            )
            if mode in ("async", "async-split"):
                eng.mode_chooser = ModeChooser(fixed="async")
            if mode == "async-split":
                eng.async_drafter.place(
                    threads=1,
                    cores={os.sched_getaffinity(0).__iter__().__next__() + 1}
                    if len(os.sched_getaffinity(0)) > 1
                    else None,
                )
            engines[(name, mode)] = eng
    target = Path(backend.info.path).name
    print(
        f"target {target}, draft model {source.path.name if source else '-'}, budget {args.budget}, "
        f"datastore {args.datastore}, machine {machine()}",
        flush=True,
    )
    all_cores = os.sched_getaffinity(0)
    rows, timeline = [], None
    for B in args.batch_sizes:
        prompts = load_prompts(args.set, B * args.prompts_per_row)
        base = run(plain, prompts, args, B)
        print(f"B={B:<3d} plain {base['tokens_per_s']:7.2f} tok/s", flush=True)
        for rnd, name in [(r, n) for r in range(args.rounds) for n in args.sources]:
            results = {}
            for mode in args.modes:
                eng = engines[(name, mode)]
                split = mode == "async-split"
                if split:  # the verifier (this thread) on one torch thread, one core
                    torch.set_num_threads(1)
                    os.sched_setaffinity(0, {min(all_cores)})
                try:
                    results[mode] = s = run(eng, prompts, args, B)
                finally:
                    if split:
                        os.sched_setaffinity(0, all_cores)
                        torch.set_num_threads(args.threads)
                if mode == "async" and f"{name}:{B}" == args.timeline:
                    timeline = list(eng.metrics.timeline)
                ser = results.get("serial", s)
                row = {
                    "target": target,
                    "draft_model": source.path.name if source else None,
                    "set": args.set,
                    "batch": B,
                    "prompts": len(prompts),
                    "sources": name,
                    "mode": mode,
                    "round": rnd,
                    **{k: v for k, v in s.items() if k not in ("ids", "timeline")},
                    "vs_serial": round(s["tokens_per_s"] / ser["tokens_per_s"], 3),
                    "vs_plain": round(s["tokens_per_s"] / base["tokens_per_s"], 3),
                    "identical": s["ids"] == base["ids"],
                }
                rows.append(row)
                rec.add(**row)
                print(
                    f"B={B:<3d} {name:9s} {mode:11s} {s['tokens_per_s']:7.2f} tok/s ({row['vs_serial']:.2f}x serial, "
                    f"{row['vs_plain']:.2f}x plain)  MAT {s['mat']}  acc/step {s['accepted_per_step']}  "
                    f"rerooted {s['rerooted']:.0%}  critical draft {s['critical_ms']:.1f} ms/step  thread "
                    f"{s['thread_ms']:.1f} ms/step, hidden {s['hidden_ms']:.1f}  identical={row['identical']}"
                    + (f"  chose {s['chose']}" if mode == "auto" else ""),
                    flush=True,
                )
    print(table(rows))
    if timeline:
        path = plot(timeline, FIGURES / f"async_timeline_{target}.png", f"{target}, {args.timeline}, async")
        print(f"timeline: {path}")
    print(f"machine: {machine()}; records: {rec.path}")
    return 0


def run(eng: LLMEngine, prompts: list, args, B: int) -> dict:
    eng.limit_running(B)  # the slots stay allocated for the largest batch
    eng.metrics.timeline = []
    a = eng.async_drafter
    hits0 = a.hits if a else 0
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=args.max_tokens))
    s = summarize(outs, time.perf_counter() - t0)
    tl = eng.metrics.timeline
    steps = max(len(tl), 1)
    critical = sum((e["prepared"] - e["start"]) + (e["waited"] - e["accepted_at"]) for e in tl)
    thread = sum(e.get("draft_end", 0) - e.get("draft_start", 0) for e in tl)
    hidden = sum(
        max(0.0, min(e["draft_end"], e["forward"]) - max(e["draft_start"], e["launched"]))
        for e in tl
        if "draft_start" in e
    )
    s.update(
        ids=[o.token_ids for o in outs],
        rerooted=((a.hits - hits0) / steps / max(B, 1)) if a else 0.0,
        critical_ms=1e3 * critical / steps,
        thread_ms=1e3 * thread / steps,
        hidden_ms=1e3 * hidden / steps,
        steps=len(tl),
        chose={m: sum(e["mode"] == m for e in tl) for m in ("serial", "async")},
    )
    return s


def table(rows: list[dict]) -> str:
    lines = [
        "| batch | sources | mode | tok/s | vs serial | vs plain | MAT | accepted/step | rerooted | "
        "critical drafting ms/step | thread ms/step | hidden ms/step | identical |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['sources']} | {r['mode']} | {r['tokens_per_s']:.2f} | "
            f"{r['vs_serial']:.2f}x | {r['vs_plain']:.2f}x | {r['mat']} | {r['accepted_per_step']} | {r['rerooted']:.0%} | "
            f"{r['critical_ms']:.1f} | {r['thread_ms']:.1f} | {r['hidden_ms']:.1f} | {r['identical']} |"
        )
    return "\n".join(lines)


def plot(timeline: list[dict], path: Path, title: str, steps: int = 24) -> Path:
    """Two lanes over the first `steps` decode steps: the engine's thread (drafting in prepare,
    forward, acceptance, waiting for the drafting thread, the rest of finish) and the drafting
    thread's own drafting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = timeline[:steps]
    t0 = tl[0]["start"]
    fig, ax = plt.subplots(figsize=(12, 2.6))
    colors = {
        "drafting (serial)": "#4c72b0",
        "forward": "#dd8452",
        "acceptance": "#55a868",
        "waiting / idle": "#c44e52",
        "emit + update": "#8172b3",
        "drafting thread": "#937860",
    }
    used = set()

    def bar(lane, a, b, what):
        if b is None or a is None or b <= a:
            return
        ax.broken_barh(
            [(1e3 * (a - t0), 1e3 * (b - a))],
            (lane - 0.4, 0.8),
            color=colors[what],
            edgecolor="white",
            linewidth=0.4,
            label=None if what in used else what,
        )
        used.add(what)

    for e in tl:
        bar(1, e["start"], e["prepared"], "drafting (serial)")
        bar(1, e["launched"], e["forward"], "forward")
        bar(1, e["forward"], e["accepted_at"], "acceptance")
        bar(1, e["accepted_at"], e["waited"], "waiting / idle")
        bar(1, e["waited"], e["end"], "emit + update")
        if "draft_start" in e:
            bar(0, e["draft_start"], e["draft_end"], "drafting thread")
    ax.set_yticks([0, 1], ["drafting thread", "engine"])
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    sys.exit(main())
