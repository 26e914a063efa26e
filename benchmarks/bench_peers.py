"""Peers side by side: SSSD vs prompt lookup (HF), vLLM n-gram, REST, ADED and
SuffixDecoding on the same data, datastore corpus and tokenizer.

For every evaluation set, each peer's few settings are swept on the set's
development split at the sweep budgets (16 and 32) and the setting with the
best mean MAT is kept; then, on the evaluation split, every system replays
greedy decoding at each budget (4, 8, 16, 32, 64) and reports MAT (mean
accepted tokens per step, bonus token included), draft µs per call and update µs
per call (appending the accepted tokens to the drafter's state; both per
request and step; SSSD drafts the lockstep batch in one call, the peers loop).
SSSD runs with its default config, a calibrated config if given
(``--sssd-config``, a parameter file from ``sssd calibrate``; it is fitted on
development data only, so use the same split), and the paper's Figure 4(a)
ablation: input only, datastore only, both merged.

Evaluation sets (``--sets``):
  sharegpt-heldout  the default datastore's held-out ShareGPT conversations:
             SmolLM2 ground truth if the file exists, else the recorded
             answers (raw turns, no chat template). Reported as *clean* and
             *contaminated*: an output is contaminated when >= 50% of its
             32-token windows occur verbatim in the datastore (ShareGPT holds
             near-duplicate conversations).
  mtbench, gsm8k, humaneval
             SmolLM2 ground-truth files (``sssd groundtruth``; skipped while
             they do not exist).
  code-edits, agent-traces, quoting
             copy-heavy sets built offline (sssd.calibration.copy_sets; not
             in the default --sets): the outputs replayed are the sets'
             reference answers, no model runs. Prompt: the --gt-model's chat
             template of the messages (with the generation prompt), the
             output: the tokenized reference and the template's end-of-turn
             token, as ``sssd groundtruth`` records answers. Only that
             model's tokenizer and template are read (it must be pulled and
             be the datastore's tokenizer).
Development and evaluation splits are disjoint: sssd.calibration.datasets'
split by a hash of each record's id, the one ``sssd calibrate`` uses.

Usage (SuffixDecoding and ADED need .venv-peers: bash benchmarks/peers/setup_arctic.sh):
  OMP_WAIT_POLICY=passive .venv-peers/bin/python benchmarks/bench_peers.py --limit 100
  python benchmarks/bench_peers.py --peers pld ngram rest --sets sharegpt-heldout --limit 50
  python benchmarks/bench_peers.py --peers pld ngram --sets code-edits agent-traces quoting --limit 100
  .venv-peers/bin/python benchmarks/bench_peers.py --peers pld suffix --suffix-global none --suffix-keep-responses \
      --sets code-edits agent-traces quoting --limit 100 --sssd-config sssd/data/calibration-smollm2.json \
      --sssd-recent --no-ablation --batch-size 8   # across requests: each sees the answers before it
  python benchmarks/bench_peers.py --plot-only benchmarks/out/peers.jsonl   # redraw the figure
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, Recorder, machine  # noqa: E402

import sssd  # noqa: E402
from sssd.calibration.replay import Example, replay  # noqa: E402

SETS = ("sharegpt-heldout", "mtbench", "gsm8k", "humaneval")
COPY_SETS = ("code-edits", "agent-traces", "quoting")  # replayed on their reference answers; not in the default --sets
PEERS = ("pld", "ngram", "rest", "rest-uncut", "aded", "suffix")
SSSD_DEFAULT = "SSSD (default)"
SSSD_CALIBRATED = "SSSD (calibrated)"
SSSD_INPUT_ONLY = "SSSD input only"
SSSD_DATASTORE_ONLY = "SSSD datastore only"
SSSD_RECENT = "SSSD (calibrated) + recent"
SSSD_RECENT_FIXED = "SSSD + recent, no evidence"


# -- data ---------------------------------------------------------------------
@dataclass
class EvalSet:
    """One evaluation set: its development split (where the peers' settings
    are chosen) and its evaluation split, reported as one or more subsets
    (ShareGPT: clean and contaminated)."""

    name: str
    source: str
    dev: list[Example] = field(default_factory=list)
    evals: dict[str, list[Example]] = field(default_factory=dict)


def split_of(record_id: str, dev_fraction: float) -> str:
    """'dev' or 'eval': sssd.calibration.datasets.split_of, the split ``sssd
    calibrate`` uses, so that a calibrated config never saw the evaluation
    split (a stand-in hash if that module is missing from this tree)."""
    try:
        from sssd.calibration.datasets import split_of as colleague_split
    except ImportError:
        h = int.from_bytes(hashlib.sha256(f"sssd-split:{record_id}".encode()).digest()[:8], "big") / 2**64
        return "dev" if h < dev_fraction else "eval"
    return colleague_split(record_id, dev_fraction)


def contamination(datastore: sssd.Datastore, outputs: list[np.ndarray], end_ids=()) -> list[float]:
    """Per output, the fraction of its 32-token windows (stride 1) found verbatim in the datastore."""
    try:
        from sssd.calibration.datasets import contamination as colleague_contamination
    except ImportError:
        colleague_contamination = None
    if colleague_contamination is not None:
        return colleague_contamination(outputs, datastore, 32, end_ids=end_ids)
    out = []
    for ids in outputs:
        ids = np.asarray(ids, dtype=np.int64)
        while ids.size and int(ids[-1]) in set(end_ids):
            ids = ids[:-1]
        wins = np.lib.stride_tricks.sliding_window_view(ids, 32) if ids.size > 32 else [ids]
        out.append(
            float(np.mean([datastore.count(np.ascontiguousarray(w)) > 0 for w in wins])) if ids.size else float("nan")
        )
    return out


def groundtruth(dataset: str, model: str, explicit: dict[str, str], datastore: sssd.Datastore):
    """(path, header, [(id, prompt, output)]) of a ground-truth file, or (None, reason, None)."""
    try:
        from sssd.calibration.ground_truth import default_path, load_groundtruth
    except ImportError as e:
        return None, f"no ground-truth loader in this tree ({e})", None
    path = explicit.get(dataset)
    if path is None:
        try:
            path = default_path(model, dataset)
        except Exception as e:  # noqa: BLE001 - e.g. an unknown model name: reported, the set skipped
            return None, f"no default ground-truth path ({e})", None
    if not Path(path).exists():
        return None, f"{path} does not exist (yet)", None
    header, examples = load_groundtruth(path, tokenizer=datastore)
    items = [(ex.id, np.asarray(ex.prompt, dtype=np.int64), np.asarray(ex.output, dtype=np.int64)) for ex in examples]
    return Path(path), header, items


def raw_heldout(datastore: sssd.Datastore, max_prompt: int = 1024, max_answer: int = 512):
    """ShareGPT held-out (id, prompt, answer) with the recorded answers, tokenized
    as replay_data.heldout_pairs does (raw turns, no chat template): every
    assistant turn that follows a user turn, answers longer than 8 tokens."""
    from sssd.calibration.datasets import sharegpt_heldout
    from sssd.tokenizer import load_tokenizer

    tok = load_tokenizer(datastore.tokenizer_path())
    out = []
    for r in sharegpt_heldout(datastore, turns="all"):
        answer = np.asarray(tok.encode(r.reference), dtype=np.int64)
        if len(answer) <= 8:
            continue
        prompt = np.concatenate([np.asarray(tok.encode(m["content"]), dtype=np.int64) for m in r.messages])
        out.append((r.id, prompt[-max_prompt:], answer[:max_answer]))
    return out


def reference_items(name: str, datastore: sssd.Datastore, model: str):
    """(source, [(id, prompt, output)]) of a copy-heavy set (sssd.calibration.copy_sets) with its
    reference answers as the outputs, tokenized as ``sssd groundtruth`` records answers
    (ground_truth.record): the prompt is ``model``'s chat template of the messages with the
    generation prompt, the output the reference's tokens and the template's end-of-turn token.
    Only the model's tokenizer files are read; it must be pulled and match the datastore's tokenizer.

    Raises:
        ValueError: the model is not pulled; DatastoreError: another tokenizer than the datastore's.
    """
    import os
    import warnings

    from sssd.calibration.datasets import load
    from sssd.calibration.ground_truth import end_of_turn_id, prompt_ids
    from sssd.models import resolve_model
    from sssd.tokenizer import check_compatible

    folder = resolve_model(model, pull_missing=False)
    check_compatible(datastore, folder)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eot = end_of_turn_id(tok)
    items = []
    for r in load(name):
        prompt = np.asarray(prompt_ids(tok, r.messages), dtype=np.int64)
        output = np.asarray(list(tok(r.reference, add_special_tokens=False)["input_ids"]) + [eot], dtype=np.int64)
        items.append((r.id, prompt, output))
    return f"{name} reference answers ({model} chat template)", items


def load_sets(datastore: sssd.Datastore, args) -> tuple[list[EvalSet], list[str]]:
    notes: list[str] = []
    sets: list[EvalSet] = []
    explicit = dict(kv.split("=", 1) for kv in args.groundtruth)
    for name in args.sets:
        end_ids: list[int] = []
        if name in COPY_SETS and (found := groundtruth(name, args.gt_model, explicit, datastore))[0] is not None:
            path, header, items = found  # `sssd groundtruth --dataset NAME --recorded`: the references, tokenized
            source = f"{path} ({header.get('generation', {}).get('mode', '?')})"
        elif name in COPY_SETS:
            try:
                source, items = reference_items(name, datastore, args.gt_model)
            except Exception as e:  # noqa: BLE001 - e.g. the model is not pulled: reported, the set skipped
                notes.append(f"{name}: skipped: {e}")
                continue
        elif (found := groundtruth(name, args.gt_model, explicit, datastore))[0] is None:
            path, header, items = found
            if name != "sharegpt-heldout":
                notes.append(f"{name}: skipped: {header}")
                continue
            notes.append(f"sharegpt-heldout: SmolLM2 ground truth not used ({header}); the recorded answers instead")
            items = raw_heldout(datastore)
            source = f"{datastore.path}/heldout.jsonl (recorded answers, raw turns)"
        else:
            path, header, items = found
            source = f"{path} ({header.get('generation', {}).get('mode', '?')})"
            end_ids = list(header.get("generation", {}).get("stop_ids") or [])
        subset = {rid: "" for rid, _, _ in items}
        if name == "sharegpt-heldout":
            frac = np.asarray(contamination(datastore, [a for _, _, a in items], end_ids), dtype=float)
            subset = {
                rid: "sharegpt-contaminated" if f >= 0.5 else "sharegpt-clean" for (rid, _, _), f in zip(items, frac)
            }
            notes.append(
                f"sharegpt-heldout: {int((frac >= 0.5).sum())} of {len(items)} outputs contaminated "
                "(>= 50% of their 32-token windows verbatim in the datastore)"
            )
        es = EvalSet(name, f"{source}, {len(items)} records")
        if name == "sharegpt-heldout":
            es.evals = {"sharegpt-clean": [], "sharegpt-contaminated": []}
        else:
            es.evals = {name: []}
        chosen = [it for it in items if len(it[1]) and len(it[2])]
        chosen.sort(key=lambda it: hashlib.sha256(it[0].encode()).digest())  # --limit takes a hash-random subset
        for rid, p, a in chosen:
            part = es.dev if split_of(rid, args.dev_fraction) == "dev" else es.evals[subset[rid] or name]
            if args.limit is None or len(part) < args.limit:
                part.append(Example(p, a))
        sets.append(es)
    return sets, notes


# -- systems ------------------------------------------------------------------
@dataclass
class System:
    """A drafter to replay: a name, the settings to sweep, and a factory."""

    name: str
    grid: list[dict]
    make: Callable[[dict], Any]
    is_peer: bool = True


class PipelineDrafter:
    """SSSD's drafting stage with sources beside retrieval (sssd.DraftPipeline, as an engine drafts)
    behind the replay interface: here retrieval and the other requests' recent outputs
    (sssd.RecentOutputs), which sees every request of the replay, running or finished."""

    def __init__(self, datastore: sssd.Datastore, config: Any, threads: int, evidence: bool = True):
        from sssd.recent_outputs import RecentOutputs
        from sssd.source_evidence import DEFAULT_EVIDENCE
        from sssd.sources import DraftPipeline, RetrievalSource

        sources = [RetrievalSource(datastore, num_threads=threads), RecentOutputs()]
        self.pipeline = DraftPipeline(sources, config, evidence=DEFAULT_EVIDENCE if evidence else None)
        self._ctx: dict[int, Any] = {}

    def open(self, request_id: int, prompt: Any) -> None:
        from peers._base import Context

        self.pipeline.open(int(request_id), prompt)
        self._ctx[int(request_id)] = Context(prompt)

    def extend_batch(self, request_ids, token_lists) -> None:
        ids = [int(i) for i in np.asarray(request_ids).tolist()]
        self.pipeline.extend_batch(ids, [np.asarray(t, dtype=np.int64) for t in token_lists])
        for rid, toks in zip(ids, token_lists):
            self._ctx[rid].extend(toks)

    def close(self, request_id: int) -> None:
        self.pipeline.close(int(request_id))
        del self._ctx[int(request_id)]

    def draft(self, request_ids, budget: int) -> sssd.DraftBatch:
        from sssd.sources import DraftRequest

        ids = [int(i) for i in np.asarray(request_ids).tolist()]
        return self.pipeline.draft([DraftRequest(i, self._ctx[i].tokens, int(budget)) for i in ids])

    def __len__(self) -> int:
        return len(self._ctx)


def fmt_settings(s: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in s.items()) or "-"


def build_systems(datastore: sssd.Datastore, args, notes: list[str]) -> list[System]:
    from peers import aded, ngram_vllm, pld, rest, suffix_decoding

    systems: list[System] = []
    want = set(args.peers)
    if "pld" in want:
        systems.append(
            System(
                pld.PromptLookupDrafter.name,
                [{"max_matching_ngram_size": n} for n in (1, 2, 3, 4)],
                lambda s: pld.PromptLookupDrafter(**s),
            )
        )
    if "ngram" in want:
        systems.append(
            System(
                ngram_vllm.NgramVLLMDrafter.name,
                [{"prompt_lookup_min": a, "prompt_lookup_max": b} for a, b in ((5, 5), (3, 5), (2, 4), (1, 3), (1, 5))],
                lambda s: ngram_vllm.NgramVLLMDrafter(**s),
            )
        )
    if "rest" in want:
        systems.append(
            System(
                "REST",
                [{"long": 10}, {"long": 16}],
                lambda s: rest.RESTDrafter(datastore, cut=True, seed=args.seed, **s),
            )
        )
    if "rest-uncut" in want:
        systems.append(
            System(
                "REST, uncut (variant)",
                [{"long": 10}, {"long": 16}],
                lambda s: rest.RESTDrafter(datastore, cut=False, seed=args.seed, **s),
            )
        )
    if "aded" in want:
        if aded.available():
            t0 = time.perf_counter()
            index = aded.cached_index(datastore)
            notes.append(
                f"ADED: index {index} ({index.stat().st_size / 2**20:.0f} MiB; ready in {time.perf_counter() - t0:.0f} s)"
            )
            systems.append(System(aded.NAME, [{}], lambda s: aded.ADEDDrafter(index)))  # a fresh Reader per replay
        else:
            notes.append("ADED: skipped: draftretriever is not installed (bash benchmarks/peers/setup_arctic.sh)")
    if "suffix" in want:
        if suffix_decoding.available():
            if args.suffix_global == "corpus":
                print("warming SuffixDecoding's global tree with the datastore's documents...", flush=True)
                warm = suffix_decoding.WarmCache(datastore.tokens, max_tree_depth=64)
                notes.append(
                    f"SuffixDecoding: global tree warmed with {warm.documents:,} documents in {warm.warm_seconds:.0f} s"
                )
            else:  # its per-request trees only (what copy-heavy work uses it for)
                warm = suffix_decoding.WarmCache(np.zeros(0, dtype=np.uint32), max_tree_depth=64)
                notes.append("SuffixDecoding: per-request trees only (--suffix-global none)")
            # Tree mode, factor 1-64, min prob 0.01-0.1: its fast settings (factor 64, min prob 0.01 is its
            # best-quality fast one, 50-85 us per call). Min prob 0 pushes every child onto its heap and costs
            # 1-6 ms a call (hours for the sweep): only with --suffix-slow.
            probs = (0.0, 0.01, 0.05, 0.1) if args.suffix_slow else (0.01, 0.05, 0.1)
            grid = [{"max_spec_factor": f, "min_token_prob": p} for f in (1.0, 4.0, 16.0, 64.0) for p in probs]
            if args.suffix_keep_responses:  # a fresh cache per replay: its global tree fills with that replay's answers
                systems.append(
                    System(
                        suffix_decoding.NAME + " + responses",
                        grid,
                        lambda s: suffix_decoding.SuffixDecodingDrafter(
                            suffix_decoding.WarmCache(np.zeros(0, dtype=np.uint32), max_tree_depth=64),
                            keep_responses=True,
                            **s,
                        ),
                    )
                )
            systems.append(
                System(suffix_decoding.NAME, grid, lambda s: suffix_decoding.SuffixDecodingDrafter(warm, **s))
            )
            # the fair cost comparison: its fast setting, reported whatever the sweep picks
            systems.append(
                System(
                    suffix_decoding.NAME + " (fast setting)",
                    [{"max_spec_factor": 64.0, "min_token_prob": 0.01}],
                    lambda s: suffix_decoding.SuffixDecodingDrafter(warm, **s),
                )
            )
        else:
            notes.append(
                "SuffixDecoding: skipped: arctic-inference is not installed (bash benchmarks/peers/setup_arctic.sh)"
            )

    threads = args.threads

    def sssd_system(name: str, **overrides) -> System:
        def make(s: dict, budget: int | None = None):
            cfg = sssd.DrafterConfig() if not s.get("config") else sssd.DrafterConfig.load(s["config"], budget)
            return sssd.Drafter(datastore, cfg.replace(num_threads=threads, **overrides))

        return System(name, [{}], make, is_peer=False)

    systems.append(sssd_system(SSSD_DEFAULT))
    if args.sssd_config:
        cal = sssd_system(SSSD_CALIBRATED)
        cal.grid = [{"config": args.sssd_config}]
        systems.append(cal)
    if args.sssd_recent:
        if not args.sssd_config:
            raise SystemExit(
                "--sssd-recent needs --sssd-config (the file whose sources entry weighs the recent outputs)"
            )
        from sssd.calibration_file import load_drafter

        calibrated = load_drafter(args.sssd_config)
        systems.append(
            System(SSSD_RECENT, [{}], lambda s, budget=None: PipelineDrafter(datastore, calibrated, threads), False)
        )
        systems.append(  # the same without each request's own acceptance by source (sssd.source_evidence)
            System(
                SSSD_RECENT_FIXED,
                [{}],
                lambda s, budget=None: PipelineDrafter(datastore, calibrated, threads, evidence=False),
                False,
            )
        )
    if not args.no_ablation:
        systems.append(sssd_system(SSSD_INPUT_ONLY, use_datastore=False))
        systems.append(sssd_system(SSSD_DATASTORE_ONLY, use_input=False))
    return systems


def run_replay(system: System, settings: dict, examples: list[Example], budget: int, batch_size: int):
    if system.name == SSSD_CALIBRATED:
        drafter = system.make(settings, budget)  # the file's parameters for this budget
    else:
        drafter = system.make(settings)
    res = replay(drafter, examples, budget, batch_size=batch_size)
    if len(drafter):
        raise RuntimeError(f"{system.name}: requests left open after a replay")
    return res


def best_replay(system: System, settings: dict, examples: list[Example], budget: int, batch_size: int, repeats: int):
    """The replay run `repeats` times (each with a fresh drafter) and the fastest run kept, by draft + update
    time: the drafts are the same every time, the microseconds drift with the host (RESULTS.md: up to
    1.3x between minutes on the 2-core VMs)."""
    runs = [run_replay(system, settings, examples, budget, batch_size) for _ in range(max(1, repeats))]
    if len({round(r.mat, 9) for r in runs}) > 1:
        print(f"  warning: {system.name} budget {budget}: MAT differs between repeats ({[r.mat for r in runs]})")
    return min(runs, key=lambda r: r.draft_seconds + r.update_seconds)


def result_record(res, **extra) -> dict:
    return {
        **extra,
        "mat": round(res.mat, 4),
        "draft_us": round(res.draft_us_per_call, 2),
        "update_us": round(res.update_us_per_call, 2),
        "steps": res.steps,
        "tokens": res.tokens,
        "nodes_per_step": round(float(res.drafted_per_depth.sum()) / max(res.steps, 1), 2),
    }


# -- report -------------------------------------------------------------------
def print_table(set_name: str, rows: list[dict], budgets: list[int], info: str) -> None:
    print(f"\n== {set_name}: {info}")
    head = f"{'system':30s} {'setting (chosen on dev)':44s} " + " ".join(f"{'MAT@' + str(b):>7s}" for b in budgets)
    head += (
        " " + " ".join(f"{'us@' + str(b):>7s}" for b in budgets if b in (16, 32)) + f" {'upd@32':>7s} {'nodes@32':>8s}"
    )
    print(head)
    by_system: dict[str, dict[int, dict]] = {}
    for r in rows:
        by_system.setdefault(r["system"], {})[r["budget"]] = r
    for name, cells in by_system.items():
        first = next(iter(cells.values()))
        line = f"{name:30s} {first['settings'][:44]:44s} " + " ".join(
            f"{cells[b]['mat']:7.3f}" if b in cells else f"{'':7s}" for b in budgets
        )
        line += " " + " ".join(
            f"{cells[b]['draft_us']:7.1f}" if b in cells else f"{'':7s}" for b in budgets if b in (16, 32)
        )
        line += (
            f" {cells[32].get('update_us', float('nan')):7.1f} {cells[32]['nodes_per_step']:8.1f}"
            if 32 in cells
            else ""
        )
        print(line)


def goals(set_name: str, rows: list[dict], reference: str) -> list[str]:
    """Issue 28's goals on one set, at each budget of 16, 32 and 64 that ran: MAT >= 1.2x the best
    peer's, and drafting + update per request-step >= 5x cheaper than SuffixDecoding's."""
    out = []
    for b in (16, 32, 64):
        ref = next((r for r in rows if r["system"] == reference and r["budget"] == b), None)
        peers = [r for r in rows if r["peer"] and r["budget"] == b]
        if ref is None or not peers:
            continue
        best = max(peers, key=lambda r: r["mat"])
        ratio = ref["mat"] / best["mat"]
        out.append(
            f"{set_name} budget {b}: {reference} MAT {ref['mat']:.3f} = {ratio:.2f}x best peer "
            f"({best['system']} {best['mat']:.3f}): {'met' if ratio >= 1.2 else 'MISSED'} (goal 1.2x)"
        )
        sd = next((r for r in peers if r["system"] == suffix_decoding_name()), None)
        if sd is not None and "update_us" in ref and "update_us" in sd:
            ours, theirs = ref["draft_us"] + ref["update_us"], sd["draft_us"] + sd["update_us"]
            out.append(
                f"{set_name} budget {b}: per request-step (draft + update) {reference} {ours:.1f} us vs "
                f"SuffixDecoding ({sd['settings']}) {theirs:.1f} us = {theirs / max(ours, 1e-9):.1f}x cheaper: "
                f"{'met' if theirs >= 5 * ours else 'MISSED'} (goal 5x)"
            )
    return out


def suffix_decoding_name() -> str:
    from peers import suffix_decoding

    return suffix_decoding.NAME


def plot(records: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed here: redraw the figure with "
            f"`.venv/bin/python benchmarks/bench_peers.py --plot-only {OUT_DIR / 'peers.jsonl'}`"
        )
        return None
    evals = [r for r in records if r.get("split") == "eval"]
    sets = list(dict.fromkeys(r["set"] for r in evals))
    if not sets:
        return None
    cols = min(3, len(sets))
    rows = (len(sets) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax, set_name in zip(axes.flat, sets):
        systems = list(dict.fromkeys(r["system"] for r in evals if r["set"] == set_name))
        for name in systems:
            pts = sorted((r["budget"], r["mat"]) for r in evals if r["set"] == set_name and r["system"] == name)
            style = "-" if name.startswith("SSSD") else "--"
            width = 2.4 if name in (SSSD_DEFAULT, SSSD_CALIBRATED) else 1.3
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, lw=width, label=name)
        ax.set_xscale("log", base=2)
        budgets = sorted({r["budget"] for r in evals})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_title(set_name)
        ax.set_xlabel("budget (draft tokens per step)")
        ax.set_ylabel("MAT (accepted tokens per step)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(sets) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def last_run(jsonl: Path) -> list[dict]:
    records: list[dict] = []
    for line in jsonl.read_text().splitlines():
        d = json.loads(line)
        if "header" in d:
            records = []
        else:
            records.append(d)
    return records


# -- main -----------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datastore", default="default", help="datastore directory (default: the default datastore)")
    ap.add_argument(
        "--sets",
        nargs="+",
        default=list(SETS),
        choices=SETS + COPY_SETS,
        help=f"evaluation sets (default: {' '.join(SETS)}; also {', '.join(COPY_SETS)})",
    )
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--sweep-budgets", type=int, nargs="+", default=[16, 32], help="budgets of the peers' sweep on dev")
    ap.add_argument("--limit", type=int, help="at most N examples per set and split (a hash-random subset)")
    ap.add_argument(
        "--dev-fraction",
        type=float,
        default=0.25,
        help="share of each set in the development split "
        "(sssd.calibration.datasets.DEV_FRACTION; keep it equal to the calibration's)",
    )
    ap.add_argument("--sssd-config", help="calibrated SSSD parameter file (sssd calibrate), also reported")
    ap.add_argument("--no-ablation", action="store_true", help="skip SSSD input-only / datastore-only")
    ap.add_argument(
        "--sssd-recent",
        action="store_true",
        help="also SSSD calibrated with the other requests' recent outputs (sssd.RecentOutputs) beside "
        "retrieval, weighed by the --sssd-config file's fitted discount (sssd calibrate --draft recent)",
    )
    ap.add_argument(
        "--suffix-keep-responses",
        action="store_true",
        help="also SuffixDecoding whose global tree keeps every finished answer of the replay (its "
        "serving default; a fresh cache per replay); with a small --batch-size later requests see earlier answers",
    )
    ap.add_argument(
        "--suffix-global",
        choices=("corpus", "none"),
        default="corpus",
        help="SuffixDecoding's global tree: warmed with the datastore's documents, or none (its "
        "per-request trees only)",
    )
    ap.add_argument(
        "--suffix-slow",
        action="store_true",
        help="also sweep SuffixDecoding at min_token_prob 0 (1-6 ms per call: slow)",
    )
    ap.add_argument(
        "--gt-model",
        default="smollm2-135m-instruct",
        help="model whose ground-truth files to use (sssd.calibration.ground_truth.default_path)",
    )
    ap.add_argument("--groundtruth", nargs="*", default=[], metavar="SET=PATH", help="ground-truth files by set name")
    ap.add_argument("--threads", type=int, default=1, help="SSSD OpenMP threads (1: as single-threaded as the peers)")
    ap.add_argument("--batch-size", type=int, default=256, help="sequences replayed in lockstep")
    ap.add_argument(
        "--timing-repeats",
        type=int,
        default=1,
        help="replay each evaluation cell this many times and report the fastest run's draft and update "
        "microseconds (the drafts are the same each time; the host's speed is not)",
    )
    ap.add_argument("--seed", type=int, default=0, help="REST's stand-in for Rust's random hash order")
    ap.add_argument("--plot-only", metavar="JSONL", help="only redraw the figure from a records file (its last run)")
    args = ap.parse_args()

    if args.plot_only:
        out = plot(last_run(Path(args.plot_only)), Path(args.plot_only).with_suffix(".png"))
        print(f"figure: {out}")
        return 0 if out else 1

    from sssd.drafter import resolve_datastore

    t_start = time.perf_counter()
    datastore = resolve_datastore(args.datastore)
    datastore.warm()
    sets, notes = load_sets(datastore, args)
    systems = build_systems(datastore, args, notes)
    rec = Recorder("peers", {**vars(args), "datastore": str(datastore.path), "datastore_tokens": datastore.size})
    for n in notes:
        print(n)
    records: list[dict] = []
    goal_lines: list[str] = []
    reference = SSSD_RECENT if args.sssd_recent else SSSD_CALIBRATED if args.sssd_config else SSSD_DEFAULT
    for es in sets:
        if not any(es.evals.values()):
            print(f"\n== {es.name}: no evaluation examples; skipped")
            continue
        rows: dict[str, list[dict]] = {sub: [] for sub in es.evals}
        for system in systems:
            settings = system.grid[0]
            if len(system.grid) > 1 and es.dev:
                dev_mat = []
                for s in system.grid:
                    mats = []
                    for b in args.sweep_budgets:
                        t0 = time.perf_counter()
                        res = run_replay(system, s, es.dev, b, args.batch_size)
                        rec.add(
                            **result_record(
                                res,
                                set=es.name,
                                split="dev",
                                system=system.name,
                                settings=fmt_settings(s),
                                budget=b,
                                peer=system.is_peer,
                                examples=len(es.dev),
                            )
                        )
                        mats.append(res.mat)
                        print(
                            f"  [{es.name} dev] {system.name} {fmt_settings(s)} budget {b}: MAT {res.mat:.3f}, "
                            f"{res.draft_us_per_call:.1f} us/call ({time.perf_counter() - t0:.0f} s)",
                            flush=True,
                        )
                    dev_mat.append(float(np.mean(mats)))
                settings = system.grid[int(np.argmax(dev_mat))]
                rec.add(
                    set=es.name,
                    system=system.name,
                    chosen=fmt_settings(settings),
                    dev_mean_mat={fmt_settings(s): round(m, 4) for s, m in zip(system.grid, dev_mat)},
                )
            for sub, examples in es.evals.items():
                if not examples:
                    continue
                for b in args.budgets:
                    t0 = time.perf_counter()
                    res = best_replay(system, settings, examples, b, args.batch_size, args.timing_repeats)
                    shown = "calibrated file" if system.name == SSSD_CALIBRATED else fmt_settings(settings)
                    r = result_record(
                        res,
                        set=sub,
                        split="eval",
                        system=system.name,
                        settings=shown,
                        budget=b,
                        peer=system.is_peer,
                        examples=len(examples),
                    )
                    rec.add(**r)
                    rows[sub].append(r)
                    print(
                        f"  [{sub} eval] {system.name} budget {b}: MAT {res.mat:.3f}, {res.draft_us_per_call:.1f} us/call, "
                        f"{r['nodes_per_step']:.1f} nodes/step ({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
        for sub, examples in es.evals.items():
            if not examples:
                continue
            records.extend(rows[sub])
            tokens = sum(len(e.output) for e in examples)
            print_table(
                sub,
                rows[sub],
                args.budgets,
                f"eval {len(examples)} examples ({tokens:,} output tokens); "
                f"settings chosen on {es.name} dev ({len(es.dev)} examples); source {es.source}",
            )
            goal_lines += goals(sub, rows[sub], reference)
    print("\nGoals (issue 28):")
    for line in goal_lines:
        print("  " + line)
    figure = plot(records, OUT_DIR / "peers.png")
    print(
        f"\nmachine: {machine()}; {time.perf_counter() - t_start:.0f} s; records: {rec.path}"
        + (f"; figure: {figure}" if figure else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
