"""What a chain rule earns inside vLLM, in seconds, without running vLLM.

Replays vLLM's greedy loop at concurrency C on the plain outputs of a
``vllm_compare`` report (its ``outputs``: plain vLLM's token ids per set and
concurrency): requests join in order as rows free up, each step asks a
proposer for every row's chain, the row accepts the chain's longest prefix
that matches its output and gains that plus one token (greedy verification,
which is what makes the outputs identical). Methods:

- ``sssd``: serving/vllm_proposer.py itself (the datastore, calibration and
  SSSD_VLLM_* settings as vllm_compare's engines get them), its step clock
  driven by the step model below, so its measured-cost rule sees the
  modelled step times;
- ``suffix``: vLLM's suffix method as vllm/v1/spec_decode/suffix_decoding.py
  calls arctic-inference (per-request tree and global response cache; vLLM's
  defaults: depth 24, factor 1, min prob 0.1), skipped when it does not import;
- ``sssd-kept``: sssd's chains cut to what is accepted of them (what a perfect
  rule for each chain's length would send, with SSSD's drafts);
- ``perfect``: the row's next K output tokens, always accepted (the ceiling);
- ``plain``: no chains.

A step's seconds come from a model, ``a + b x rows + c x draft tokens``, fitted
to the decode steps of SSSD_VLLM_STEPS trace files (``--trace``; steps that
prefilled a prompt are left out, and their seconds summed as the run's prefill
time, the same for every method) or given (``--step-model a,b,c``). Reported
per method: decode steps, draft tokens, accepted, acceptance rate, modelled
decode seconds, the requests' mean finishing time (decode steps only), with a
trace the end-to-end estimate (decode + the trace's prefill), and the ratios
to plain and suffix; for sssd, how the worth the rule gave the nodes it sent
compares with what was accepted.

    .venv-vllm/bin/python benchmarks/bench_vllm_replay.py --report out.json --set code-edits \\
        --seqs 4 --model ~/.cache/sssd/models/smollm2-135m-instruct --trace 'steps-*.jsonl'
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np

#: (rows, their requests, their contexts, each row's tokens new since its last call) -> each row's
#: chain. vLLM tells its own proposers the request ids; a custom_class proposer sees rows only.
Propose = Callable[[list[int], list[int], list[list[int]], list[list[int]]], list[list[int]]]


@dataclass
class Replay:
    """One replayed run: per decode step, the rows, draft tokens sent and tokens accepted."""

    rows: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    sent: list[tuple[int, int, int]] = field(default_factory=list)  # (step, request, chain length)
    finished: dict[int, int] = field(default_factory=dict)  # request -> the step it finished in

    def step_seconds(self, model: Sequence[float]) -> np.ndarray:
        a, b, c = model
        return a + b * np.asarray(self.rows, dtype=float) + c * np.asarray(self.drafted, dtype=float)

    def seconds(self, model: Sequence[float]) -> float:
        return float(self.step_seconds(model).sum())

    def mean_finish(self, model: Sequence[float]) -> float:
        """The requests' mean finishing time (decode steps only): what a user waits, beside the
        run's seconds (the last request's finish)."""
        ends = np.cumsum(self.step_seconds(model))
        return float(np.mean([ends[s] for s in self.finished.values()])) if self.finished else 0.0


def accepted_prefix(chain: Sequence[int], want: Sequence[int]) -> int:
    """How many leading tokens of ``chain`` greedy verification accepts when ``want`` follows."""
    m = 0
    while m < len(chain) and m < len(want) and int(chain[m]) == int(want[m]):
        m += 1
    return m


def replay(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    concurrency: int,
    propose: Propose,
    k: int,
    on_step: Callable[[int, int, int], None] | None = None,
) -> Replay:
    """vLLM's greedy loop over ``outputs``: a request joins when a row is free (its prefill step
    samples its first output token), then each step verifies every row's chain (cut to ``k``).
    ``on_step(rows, draft tokens, accepted)`` runs after each step (the sssd proposer's clock)."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    queue = [i for i, o in enumerate(outputs) if len(o)]
    slots: dict[int, int] = {}  # row -> request
    made: dict[int, int] = {}  # request -> output tokens it has
    new: dict[int, list[int]] = {}  # request -> tokens since its last call
    out = Replay()
    while queue or slots:
        for row in range(concurrency):
            while row not in slots and queue:
                r = queue.pop(0)
                made[r], new[r] = 1, [int(outputs[r][0])]
                if len(outputs[r]) > 1:  # (a one-token output is done at its prefill)
                    slots[row] = r
        rows = sorted(slots)
        if not rows:
            break
        reqs = [slots[row] for row in rows]
        contexts = [list(prompts[r]) + list(outputs[r][: made[r]]) for r in reqs]
        chains = [list(c)[:k] for c in propose(rows, reqs, contexts, [new[r] for r in reqs])]
        step = len(out.rows)
        got = 0
        for row, r, chain in zip(rows, reqs, chains):
            want = outputs[r][made[r] :]
            m = accepted_prefix(chain, want)
            out.sent.append((step, r, len(chain)))
            gain = min(m + 1, len(want))  # the accepted tokens and the one vLLM samples after them
            new[r] = [int(t) for t in want[:gain]]
            made[r] += gain
            got += m
            if made[r] >= len(outputs[r]):
                del slots[row]
                out.finished[r] = step
        out.rows.append(len(rows))
        out.drafted.append(sum(map(len, chains)))
        out.accepted.append(got)
        if on_step is not None:
            on_step(len(rows), out.drafted[-1], got)
    return out


# -- methods -------------------------------------------------------------------


class SSSDChains:
    """serving/vllm_proposer.py's SSSDProposer on the replay's rows, its clock the step model's."""

    def __init__(self, model: str, k: int, model_fn: Sequence[float]):
        from sssd.serving.vllm_proposer import SSSDProposer

        cfg = SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=k),
            model_config=SimpleNamespace(model=model, get_vocab_size=lambda: None),
            device_config=SimpleNamespace(device_type="cpu"),
        )
        self.prop = SSSDProposer(cfg)
        self.now = 0.0
        self.prop.clock = lambda: self.now
        self.model = model_fn
        self.worth: list[tuple[float, bool]] = []  # (worth the rule gave a sent node, accepted)
        self._pending: dict[int, tuple[int, list[int], np.ndarray]] = {}  # row -> (request, chain, worth)

    def __call__(self, rows, requests, contexts, new) -> list[list[int]]:
        for row, req, ctx in zip(rows, requests, contexts):  # what was accepted of the last chains
            sent = self._pending.pop(row, None)
            if sent is not None and sent[0] == req:  # (not a finished request's last chain)
                _, chain, w = sent
                start = len(self.prop.rows[row])
                took = ctx[start : start + len(chain)]
                m = accepted_prefix(chain, took)
                self.worth += [(float(x), i < m) for i, x in enumerate(w)]
        width = max(map(len, contexts))
        batch = max(rows) + 1
        ids = np.zeros((batch, width), dtype=np.int32)
        n = np.zeros(batch, dtype=np.int32)
        sampled: list[list[int]] = [[] for _ in range(batch)]
        for row, ctx, fresh in zip(rows, contexts, new):
            ids[row, : len(ctx)], n[row], sampled[row] = ctx, len(ctx), fresh
        out = self.prop.propose(sampled, n, ids)
        chains = [out[row] for row in rows]
        for row, req, chain in zip(rows, requests, chains):
            if chain:
                gamma = self.prop.acceptance.gammas([row], np.ones(1, dtype=bool))[0]
                self._pending[row] = (req, chain, self.prop.acceptance.worth(self.prop.sent[row][2], gamma))
        return chains

    def step(self, rows: int, drafted: int, accepted: int) -> None:
        a, b, c = self.model
        self.now += a + b * rows + c * drafted


class SuffixChains:
    """vLLM's suffix proposer's calls into arctic-inference (vllm/v1/spec_decode/suffix_decoding.py)."""

    def __init__(self, k: int, depth: int = 24, factor: float = 1.0, prob: float = 0.1):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10000)
        self.k, self.depth, self.factor, self.prob = k, depth, factor, prob

    def __call__(self, rows, requests, contexts, new) -> list[list[int]]:
        out = []
        for req, ctx, fresh in zip(requests, contexts, new):
            if req not in self.cache.active_requests:
                self.cache.start_request(req, np.asarray(ctx[: len(ctx) - len(fresh)], dtype=np.int32))
            self.cache.add_active_response(req, list(fresh))
            pattern = np.asarray(ctx[max(0, len(ctx) - self.depth) :], dtype=np.int32)
            draft = self.cache.speculate(
                req, pattern, max_spec_tokens=self.k, max_spec_factor=self.factor, min_token_prob=self.prob
            )
            out.append(list(draft.token_ids))
        for req in self.cache.active_requests - set(requests):  # finished: into the global response cache
            self.cache.stop_request(req)
        return out


def kept(propose: Propose, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> Propose:
    """Another method's chains cut to what is accepted of them: what a perfect rule for each chain's
    length would send (the method itself still learns from the chains it chose)."""

    def cut(rows, requests, contexts, new):
        out = []
        for chain, r, c in zip(propose(rows, requests, contexts, new), requests, contexts):
            want = outputs[r][len(c) - len(prompts[r]) :]
            out.append(list(chain[: accepted_prefix(chain, want)]))
        return out

    return cut


def no_chains(rows, requests, contexts, new) -> list[list[int]]:
    """Plain decoding: no chains."""
    return [[] for _ in rows]


def perfect(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int) -> Propose:
    """The ceiling: every row's next k output tokens."""

    def propose(rows, requests, contexts, new):
        return [
            list(outputs[r][len(c) - len(prompts[r]) : len(c) - len(prompts[r]) + k])
            for r, c in zip(requests, contexts)
        ]

    return propose


# -- the step model --------------------------------------------------------------


def fit_steps(lines: Sequence[dict]) -> tuple[tuple[float, float, float], float, int]:
    """(a, b, c) of seconds = a + b rows + c draft tokens over the decode steps of SSSD_VLLM_STEPS
    lines, the prefill steps' seconds and how many decode steps the fit saw."""
    dec = [x for x in lines if not x["prefilled"]]
    if len(dec) < 3:
        raise ValueError(f"{len(dec)} decode steps in the trace: too few to fit a step model")
    X = np.array([[1.0, x["rows"], x["tokens"] - x["rows"]] for x in dec])
    y = np.array([x["seconds"] for x in dec])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    prefill = float(sum(x["seconds"] for x in lines if x["prefilled"]))
    return (float(coef[0]), float(coef[1]), float(coef[2])), prefill, len(dec)


def read_traces(pattern: str) -> list[list[dict]]:
    """Each trace file's lines, the warm-up request's leading steps dropped (a trace starts with the
    engine's warm-up: its first steps have one row and come before the set's first prefill)."""
    runs = []
    for path in sorted(glob.glob(pattern)):
        lines = [json.loads(x) for x in open(path) if x.strip()]
        first = next((i for i, x in enumerate(lines) if x["prefilled"]), 0)
        runs.append(lines[first:])
    if not runs:
        raise SystemExit(f"bench_vllm_replay: no trace file matches {pattern!r}")
    return runs


def calibration_table(pairs: Sequence[tuple[float, bool]]) -> list[dict]:
    w = np.array([p[0] for p in pairs])
    a = np.array([p[1] for p in pairs], dtype=float)
    edges = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0 + 1e-9]
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        sel = (w >= lo) & (w < hi)
        if sel.any():
            rows.append(
                {
                    "worth": f"{lo:.1f}-{min(hi, 1.0):.1f}",
                    "nodes": int(sel.sum()),
                    "predicted": round(float(w[sel].mean()), 3),
                    "accepted": round(float(a[sel].mean()), 3),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--report", required=True, help="a vllm_compare JSON report (-o): its plain outputs are replayed")
    ap.add_argument("--set", required=True, help="the prompt set (as in the report)")
    ap.add_argument("--seqs", type=int, required=True, help="concurrency (vLLM's max_num_seqs)")
    ap.add_argument("--model", required=True, help="the model folder the report ran (its tokenizer and chat template)")
    ap.add_argument("--methods", default="plain,sssd,sssd-kept,suffix,perfect")
    ap.add_argument("--trace", help="glob of SSSD_VLLM_STEPS files from runs of this cell: the step model and prefill")
    ap.add_argument("--step-model", help="a,b,c seconds (per step, per row, per draft token) instead of --trace")
    ap.add_argument("-o", "--output", help="also write the figures here as JSON")
    args = ap.parse_args(argv)

    report = json.load(open(args.report))
    k = int(report["k"])
    key = f"{args.set}@{args.seqs}"
    if key not in report.get("outputs", {}):
        raise SystemExit(
            f"bench_vllm_replay: the report has no plain outputs for {key} (it has {sorted(report['outputs'])})"
        )
    outputs = report["outputs"][key]
    from sssd.serving.frontends import vllm_report

    ids = report["sets"][args.set]["eval"]  # the prompts the report ran, by id (its split and length limit)
    messages = dict(vllm_report.records(args.set))
    encode = vllm_report.chat_encoder(args.model)
    prompts = [encode(messages[i]) for i in ids]
    if len(prompts) != len(outputs):
        raise SystemExit(
            f"bench_vllm_replay: the report lists {len(prompts)} prompts of {args.set} but {len(outputs)} outputs"
        )
    prefill = None
    if args.step_model:
        model = tuple(float(x) for x in args.step_model.split(","))
    elif args.trace:
        fits = [fit_steps(lines) for lines in read_traces(args.trace)]
        model = tuple(float(np.mean([f[0][i] for f in fits])) for i in range(3))
        prefill = float(np.mean([f[1] for f in fits]))
    else:
        raise SystemExit("bench_vllm_replay: give --trace or --step-model")
    os.environ.setdefault("SSSD_VLLM_DATASTORE", str(report.get("datastore", "default")))
    os.environ.setdefault("SSSD_VLLM_MIN_SCORE", str(report.get("min_score", 0.01)))
    print(
        f"step model: {model[0] * 1e3:.1f} ms + {model[1] * 1e3:.1f} ms/row + {model[2] * 1e3:.2f} ms/draft token"
        + (f"; prefill steps {prefill:.1f} s a run" if prefill is not None else "")
    )
    results = {}
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        hook = None
        if method == "plain":
            propose = no_chains
        elif method == "sssd":
            chains = SSSDChains(args.model, k, model)
            propose, hook = chains, chains.step
        elif method == "sssd-kept":
            chains = SSSDChains(args.model, k, model)
            propose, hook = kept(chains, prompts, outputs), chains.step
        elif method == "suffix":
            try:
                propose = SuffixChains(k)
            except ImportError as e:
                print(f"suffix: skipped ({e})")
                continue
        elif method == "perfect":
            propose = perfect(prompts, outputs, k)
        else:
            raise SystemExit(f"bench_vllm_replay: unknown method {method!r} (plain, sssd, sssd-kept, suffix, perfect)")
        run = replay(prompts, outputs, args.seqs, propose, k, hook)
        res = {
            "steps": len(run.rows),
            "drafted": sum(run.drafted),
            "accepted": sum(run.accepted),
            "decode_s": round(run.seconds(model), 2),
            "mean_finish_s": round(run.mean_finish(model), 2),
        }
        res["acceptance_rate"] = round(res["accepted"] / max(res["drafted"], 1), 3)
        if prefill is not None:
            res["end_to_end_s"] = round(res["decode_s"] + prefill, 2)
        if method == "sssd":
            res["calibration"] = calibration_table(chains.worth)
        results[method] = res
    print(
        f"{'method':8} {'steps':>6} {'drafted':>8} {'accepted':>9} {'rate':>5} {'decode s':>9} {'mean finish s':>13}"
        + (f" {'e2e s':>7}" if prefill is not None else "")
        + "".join(f" {'vs ' + b:>10}" for b in ("plain", "suffix") if b in results)
    )
    for m, r in results.items():
        line = f"{m:8} {r['steps']:6d} {r['drafted']:8d} {r['accepted']:9d} {r['acceptance_rate']:5.2f}"
        line += f" {r['decode_s']:9.2f} {r['mean_finish_s']:13.2f}"
        total = "end_to_end_s" if prefill is not None else "decode_s"
        if prefill is not None:
            line += f" {r[total]:7.2f}"
        for b in ("plain", "suffix"):
            if b in results:
                line += f" {results[b][total] / r[total]:9.2f}x"
        print(line)
    if "sssd" in results:
        print("sssd: the worth the rule gave the nodes it sent against what was accepted")
        for row in results["sssd"]["calibration"]:
            print(
                f"  worth {row['worth']}: {row['nodes']:5d} nodes, predicted {row['predicted']:.2f}, accepted {row['accepted']:.2f}"
            )
    if args.output:
        json.dump(
            {
                "report": args.report,
                "set": args.set,
                "seqs": args.seqs,
                "step_model": model,
                "prefill_s": prefill,
                "methods": results,
            },
            open(args.output, "w"),
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
