"""MagicDec on this machine: plain, retrieval, sparse self-speculation and both merged, side by side.

For every context size of the long-context set (benchmarks/long_context.py: ShareGPT
conversations and stdlib files at 2k/4k/8k tokens) and every batch size, the same prompts are
decoded greedily by every variant in one run, sharing one model and KV pool; decode tokens/s
and the variants' ratios to plain decoding are reported, and every variant's output is checked
token-identical to plain decoding's. Each distinct prompt is prefilled once and its K/V copied
into the slots of every run (prefill is the same work for every variant, and at 8k it would
dominate the run): the figures are decode throughput, as MagicDec reports.

--fit first measures forward passes t(B, T, S) (B rows of T tokens over S cached positions) and
fits planner.SelfSpecCostModel to them, saving it where the engine's self sources find it;
--sweep measures acceptance against the KV budget for both methods.

    .venv/bin/python benchmarks/long_context.py
    .venv/bin/python benchmarks/bench_magicdec.py --fit --sweep
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Recorder, machine  # noqa: E402
from long_context import load  # noqa: E402


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Pass:
    """A synthetic forward pass: B rows of T tokens after S cached positions (for the cost fit)."""

    def __init__(self, B: int, T: int, S: int):
        self.tokens = np.full((B, T), 100, np.int64)
        self.positions = np.broadcast_to(S + np.arange(T), (B, T)).copy()
        self.writes = self.positions.copy()
        self.kv_length = S + T
        self._visible = np.ones((B, T, S + T), bool)
        self._visible[:, :, S:] = np.tril(np.ones((T, T), bool))

    def visible(self):
        return self._visible

    def kv_positions(self):
        return np.broadcast_to(np.arange(self.kv_length), (self.tokens.shape[0], self.kv_length))


def fit_cost(backend, batches, contexts, kv_budget: int, repeats: int = 2):
    from sssd.serving.drafting.self_drafter import cost_file
    from sssd.serving.planning.planner import SelfSpecCostModel

    points = []
    for B in batches:
        for S in sorted({min(kv_budget, 512), *contexts}):
            for T in (1, 5, 9):
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    backend.hidden_states(slice(0, B), _Pass(B, T, S))
                    best = min(best, time.perf_counter() - t0)
                points.append((B, T, S, best))
                _log(f"  pass B={B:>2} T={T} S={S:>5}: {best * 1e3:7.1f} ms")
    model = SelfSpecCostModel.fit(points, kv_budget)
    model.meta.update({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "points": points})
    path = cost_file(backend)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model.to_dict(), indent=1))
    _log(f"cost model {model.coef.tolist()} -> {path}")
    return model, points


def prefill_kv(backend, prompt: list[int], chunk: int = 1024) -> torch.Tensor:
    """The K/V of prompt[:-1] (the engine's prefill; the last token is the first root), via slot 0."""
    from sssd.serving.verify.tree_batch import pack_chain

    n = len(prompt) - 1
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        backend.prefill(slice(0, 1), pack_chain(np.array([a]), [np.asarray(prompt[a:b], np.int64)]))
    return backend.pool.kv[:, :, 0, :, :n].clone()


def run(model_path, backend, datastore, draft, prompts, kvs, max_tokens, budget, max_running, gamma=None):
    """Decodes `prompts` (their K/V copied in) with one engine; (outputs, seconds, engine)."""
    from sssd.serving.engine import EngineConfig, LLMEngine
    from sssd.serving.engine.params import SamplingParams

    eng = LLMEngine(
        model_path,
        datastore=datastore,
        draft=draft,
        backend=backend,
        config=EngineConfig(
            max_model_len=backend.capacity,
            max_running=max_running,
            budget=budget if draft else None,
            prefill_chunk=1024,
        ),
    )
    if gamma is not None:
        for s in eng.drafting.external:
            s.gamma = gamma
    ids = [eng.add_request(list(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    eng.scheduler.admit(eng.open_draft)
    for req, kv in zip(list(eng.scheduler.slots), kvs):
        n = kv.shape[3]
        backend.pool.kv[:, :, req.slot, :, :n] = kv
        req.cached = n
        eng.scheduler.promote(req)
    done = {}
    t0 = time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids], time.perf_counter() - t0, eng


def store_acceptance(path: Path, sweeps: list[dict]) -> None:
    """Writes the swept per-depth acceptance rates (method -> KV budget -> rates) into the cost
    file at `path`: the engine's self sources then pick their KV budget by the cost model."""
    d = json.loads(path.read_text())
    table = d.setdefault("acceptance", {})
    for r in sweeps:
        rates = [x if x == x else 0.0 for x in r["depth_rates"]]  # NaN (never reached): 0
        table.setdefault(r["method"], {})[str(r["kv_budget"])] = rates
    path.write_text(json.dumps(d, indent=1))
    _log(f"acceptance vs KV budget -> {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--set", type=Path, default=None, help="the long-context set (default: benchmarks/out/long_context.jsonl)"
    )
    p.add_argument("--sizes", default="2048,4096,8192")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--variants", default="plain,retrieval,self,both")
    p.add_argument("--method", default="snapkv", choices=("snapkv", "streamingllm"))
    p.add_argument("--kv-budget", type=int, default=512)
    p.add_argument("--budget", type=int, default=8, help="draft tree budget of the speculating variants")
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--distinct", type=int, default=4, help="distinct prompts per size (tiled over the batch)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared 2-core machine, 2 threads oversubscribe and time 5-10x worse)",
    )
    p.add_argument("--fit", action="store_true", help="measure passes and fit the cost model first")
    p.add_argument("--sweep", action="store_true", help="acceptance vs KV budget at the largest size")
    p.add_argument("--sweep-budgets", default="64,128,256,512,1024,2048")
    p.add_argument("--no-main", action="store_true", help="skip the throughput grid")
    a = p.parse_args(argv)
    from sssd.models import resolve_model
    from sssd.serving.backends.torch_backend import TorchBackend

    sizes = [int(x) for x in a.sizes.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    variants = a.variants.split(",")
    path = Path(resolve_model(a.model))
    torch.manual_seed(0)
    backend = TorchBackend(
        path, slots=max(batches), capacity=min(max(sizes), backend_positions(path)), threads=a.threads
    )
    rec = Recorder("bench_magicdec", vars(a) | {"set": str(a.set)})
    _log(f"{a.model}: {max(batches)} slots of {backend.capacity} tokens; {machine()['cpu']}")
    if a.fit:
        model, points = fit_cost(backend, batches, [s - 256 for s in sizes], a.kv_budget)
        rec.add(kind="cost_fit", coef=model.coef.tolist(), points=points)
    from sssd.serving.drafting.self_drafter import load_cost

    cost = load_cost(backend, a.kv_budget)
    spec = f"self:{a.method}:{a.kv_budget}"
    drafts = {"plain": [], "retrieval": ["retrieval"], "self": [spec], "both": ["retrieval", spec]}
    table, sweeps = [], []
    for size in sizes:
        recs = load(a.set or Path(__file__).resolve().parent / "out" / "long_context.jsonl", size=size)
        # alternate the kinds: ShareGPT chats and stdlib files
        by = {k: [r for r in recs if r["kind"] == k] for k in ("sharegpt", "stdlib")}
        distinct = [x for pair in zip(by["sharegpt"], by["stdlib"]) for x in pair][: a.distinct]
        t0 = time.perf_counter()
        kvs = [prefill_kv(backend, r["prompt_ids"]) for r in distinct]
        _log(
            f"size {size}: prefilled {len(distinct)} prompts ({[r['tokens'] for r in distinct]}) in "
            f"{time.perf_counter() - t0:.0f} s"
        )
        if not a.no_main:
            for B in batches:
                prompts = [distinct[i % len(distinct)]["prompt_ids"] for i in range(B)]
                kv_b = [kvs[i % len(distinct)] for i in range(B)]
                row = {"size": size, "batch": B, "context": int(np.mean([len(x) for x in prompts]))}
                base = None
                for v in variants:
                    outs, secs, eng = run(
                        path,
                        backend,
                        "default" if "retrieval" in drafts[v] else None,
                        drafts[v],
                        prompts,
                        kv_b,
                        a.max_tokens,
                        a.budget,
                        max(batches),
                    )
                    toks = sum(len(o.token_ids) for o in outs)
                    steps = sum(o.stats["steps"] for o in outs)
                    acc = sum(o.stats["accepted"] for o in outs)
                    by_src = dict(eng.metrics.accepted_by_source)
                    if v == "plain":
                        base = [o.token_ids for o in outs]
                    same = base is None or [o.token_ids for o in outs] == base
                    row[v] = {
                        "tok_s": toks / secs,
                        "seconds": secs,
                        "mat": toks / max(steps, 1) * 1.0,
                        "accepted": acc,
                        "by_source": by_src,
                        "identical": same,
                    }
                    rec.add(
                        kind="throughput",
                        size=size,
                        batch=B,
                        variant=v,
                        tokens=toks,
                        seconds=secs,
                        steps=steps,
                        accepted=acc,
                        by_source=by_src,
                        identical=same,
                    )
                    _log(
                        f"  {size:>5} B={B:>2} {v:<9} {toks / secs:7.1f} tok/s  MAT {toks / max(steps, 1):.2f}  "
                        f"{by_src}{'' if same else '  OUTPUT DIFFERS'}"
                    )
                table.append(row)
        if a.sweep and size == max(sizes):
            prompts = [r["prompt_ids"] for r in distinct]
            for method in ("streamingllm", "snapkv"):
                for kb in [int(x) for x in a.sweep_budgets.split(",")]:
                    outs, secs, eng = run(
                        path,
                        backend,
                        None,
                        [f"self:{method}:{kb}"],
                        prompts,
                        kvs,
                        a.max_tokens,
                        4,
                        max(batches),
                        gamma=4,
                    )
                    src = eng.drafting.external[0]
                    drafted = sum(o.stats["drafted"] for o in outs)
                    acc = sum(o.stats["accepted"] for o in outs)
                    rates = src.acceptance_rates()[:4]
                    rec.add(
                        kind="sweep",
                        size=size,
                        method=method,
                        kv_budget=kb,
                        drafted=drafted,
                        accepted=acc,
                        rate=acc / max(drafted, 1),
                        depth_rates=rates.tolist(),
                        seconds=secs,
                    )
                    _log(
                        f"  sweep {size} {method:<12} kv {kb:>5}: {acc}/{drafted} accepted "
                        f"({acc / max(drafted, 1):.2f}), per depth {np.round(rates, 2).tolist()}"
                    )
                    sweeps.append({"method": method, "kv_budget": kb, "depth_rates": rates.tolist()})
            from sssd.serving.drafting.self_drafter import cost_file

            if cost_file(backend).is_file():
                store_acceptance(cost_file(backend), sweeps)
        del kvs
    if table:
        _log("\nsize  batch  " + "  ".join(f"{v:>16}" for v in variants))
        for row in table:
            base = row["plain"]["tok_s"] if "plain" in row else None
            cells = [
                f"{row[v]['tok_s']:7.1f} ({row[v]['tok_s'] / base:4.2f}x)" if base else f"{row[v]['tok_s']:7.1f}"
                for v in variants
            ]
            _log(f"{row['size']:>5} {row['batch']:>5}  " + "  ".join(f"{c:>16}" for c in cells))
    if cost is not None:
        rates = np.full(16, 0.75)
        for B in batches:
            _log(
                f"cost model: B={B}: draft/target pass ratio at 8k {cost.ratio(B, 8000):.2f}, critical context "
                f"{cost.critical_context(B, rates, 8)} (acceptance 0.75)"
            )


def backend_positions(path: Path) -> int:
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(path, local_files_only=True), "max_position_embeddings", 2048))


if __name__ == "__main__":
    main()
