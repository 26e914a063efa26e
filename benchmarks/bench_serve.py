"""Serving throughput and time per output token: `sssd serve` with and without speculation.

Starts two servers on loopback (the same model, one with SSSD speculation,
one with --no-speculate), then for each concurrency level sends the same
streaming chat requests (MT-Bench evaluation-split questions, greedy) to
each in turn, in one run. Each level gets prompts of its own (while the
set lasts): a server keeps its recent outputs, which would draft a
repeated prompt from its earlier answer. Reported per server and level: output tokens/s
over the level's wall time, mean time per output token (a request's time
from first to last token / (tokens - 1)), mean time to first token, failed
requests, and whether the speculative server's texts equal the plain one's.
With --engine-alone, the concurrency-1 prompts also run one at a time
through the engine in this process (same model, datastore, calibration and
threads, no HTTP), first, before the servers start: served / engine-alone
tokens/s is what the front end (HTTP, SSE, the asyncio loop, the engine
thread) costs a single user.

Usage:
  python benchmarks/bench_serve.py                         # concurrency 1 4 16 64
  python benchmarks/bench_serve.py --concurrency 1 4 --requests 8 --max-tokens 64
  python benchmarks/bench_serve.py --concurrency 1 --engine-alone    # the front end's cost at c=1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder, disjoint_prompts, machine  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, speculate: bool) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sssd.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--max-running",
        str(max(args.concurrency)),
        "--max-model-len",
        str(args.max_model_len),
        "--log-level",
        "warning",
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if not speculate:
        cmd.append("--no-speculate")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(1800):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, httpx.get(url + "/v1/models").json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start in 15 minutes")


async def one_request(client, url: str, messages, max_tokens: int, model: str) -> dict:
    t0 = time.perf_counter()
    stamps, text = [], []
    async with client.stream(
        "POST",
        url + "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True},
    ) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
                text.append(chunk["choices"][0]["delta"]["content"])
    return {"ok": True, "text": "".join(text), "start": t0, "stamps": stamps}


async def run_level(url: str, prompts, concurrency: int, max_tokens: int, served: str) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def bounded(client, messages):
        async with sem:
            return await one_request(client, url, messages, max_tokens, served)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(client, m) for m in prompts), return_exceptions=True)
        wall = time.perf_counter() - t0
    ok = [r for r in results if isinstance(r, dict) and r.get("ok")]
    # Streamed chunks carry one or more tokens; count tokens with the server's usage-free proxy:
    # the number of chunks (the engine emits one chunk per step per request).
    tpot, ttft, chunks = [], [], 0
    for r in ok:
        s = r["stamps"]
        chunks += len(s)
        if s:
            ttft.append(s[0] - r["start"])
        if len(s) > 1:
            tpot.append((s[-1] - s[0]) / (len(s) - 1))
    return {
        "wall_s": round(wall, 2),
        "failed": len(results) - len(ok),
        "texts": [r.get("text") for r in ok],
        "chunks": chunks,
        "mean_ttft_s": round(float(np.mean(ttft)), 3) if ttft else None,
        "mean_step_gap_ms": round(1e3 * float(np.mean(tpot)), 1) if tpot else None,
    }


def engine_alone(args, prompts, speculate: bool, tokenizer) -> dict:
    """The prompts one after another through the engine itself, configured as `sssd serve` is; the
    first one warms it up and is not timed."""
    import gc

    from sssd.paths import packaged_calibration
    from sssd.serving.engine import EngineConfig, LLMEngine
    from sssd.serving.engine.config import DEFAULT_DRAFT
    from sssd.serving.engine.params import SamplingParams

    config = EngineConfig(
        max_running=max(args.concurrency),
        max_model_len=args.max_model_len,
        speculate=speculate,
        threads=args.threads or None,
    )
    engine = LLMEngine(
        args.model,
        datastore="default" if speculate else None,
        drafter=packaged_calibration(args.model, "default"),
        config=config,
        draft=list(DEFAULT_DRAFT) if speculate else [],
    )
    engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))  # warm-up, as the servers get
    prompts = prompts[1:]
    t0 = time.perf_counter()
    texts = [engine.generate([m], SamplingParams(max_tokens=args.max_tokens, temperature=0))[0].text for m in prompts]
    wall = time.perf_counter() - t0
    budgets = dict(sorted(engine.metrics.budgets.items()))
    del engine
    gc.collect()
    tokens = count_tokens(tokenizer, texts)
    return {
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "texts": texts,
        "budgets": budgets,
    }


def count_tokens(tokenizer, texts) -> int:
    return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=0, help="requests per level (0: max(8, 2 x concurrency))")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per server (0: all cores)")
    ap.add_argument(
        "--engine-alone",
        action="store_true",
        help="also run the concurrency-1 prompts through the engine in-process (no HTTP), for the front end's cost",
    )
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from sssd.calibration import datasets
    from sssd.models import resolve_model

    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    questions = [r.messages for r in datasets.split(datasets.mtbench(), "eval")]
    rec = Recorder("serve", vars(args))
    alone = {}
    sizes = [args.requests or max(8, 2 * c) for c in args.concurrency]
    warmup, *per_level = disjoint_prompts(questions, [1, *sizes])
    level_prompts = dict(zip(args.concurrency, per_level))
    if args.engine_alone and 1 in args.concurrency:
        for name, speculate in (("sssd", True), ("plain", False)):
            alone[name] = engine_alone(args, warmup + level_prompts[1], speculate, tokenizer)
            print(
                f"engine alone, {name}: {alone[name]['tokens_per_s']} tok/s budgets {alone[name]['budgets']}",
                flush=True,
            )
    servers = {}
    try:
        for name, speculate in (("sssd", True), ("plain", False)):
            print(f"starting the {name} server ...", flush=True)
            servers[name] = start_server(args, speculate)
        for c in args.concurrency:
            prompts = level_prompts[c]
            row = {"concurrency": c, "requests": len(prompts)}
            for name, (_, url, served) in servers.items():
                res = asyncio.run(run_level(url, prompts, c, args.max_tokens, served))
                tokens = count_tokens(tokenizer, res["texts"])
                chunks = res.pop("chunks")
                gap = res.pop("mean_step_gap_ms")
                res["tokens"] = tokens
                res["tokens_per_s"] = round(tokens / res["wall_s"], 2)
                # time per output token: the mean gap between streamed chunks, divided by the
                # tokens each chunk carried on average (speculation delivers several per step)
                res["tpot_ms"] = round(gap * chunks / max(tokens, 1), 1) if gap else None
                row[name] = res
            row["identical"] = row["sssd"]["texts"] == row["plain"]["texts"]
            if not (row["sssd"]["tokens"] and row["plain"]["tokens"]):
                raise RuntimeError(f"no tokens came back at concurrency {c}: {row}")
            row["speedup"] = round(row["sssd"]["tokens_per_s"] / row["plain"]["tokens_per_s"], 3)
            if c == 1 and alone:
                for name in servers:
                    a = {k: v for k, v in alone[name].items() if k != "texts"}
                    a["identical_to_served"] = alone[name]["texts"] == row[name]["texts"]
                    row[name]["engine_alone"] = a
                    row[name]["served_over_engine"] = round(row[name]["tokens_per_s"] / a["tokens_per_s"], 3)
                    print(
                        f"  {name}: served {row[name]['tokens_per_s']} tok/s vs engine alone {a['tokens_per_s']} "
                        f"tok/s: {row[name]['served_over_engine']:.3f}x (same texts: {a['identical_to_served']})",
                        flush=True,
                    )
            for name in servers:
                row[name].pop("texts")
            rec.add(**row)
            s, p = row["sssd"], row["plain"]
            print(
                f"concurrency {c:3d} ({len(prompts)} requests): SSSD {s['tokens_per_s']:7.2f} tok/s TPOT {s['tpot_ms']} ms "
                f"TTFT {s['mean_ttft_s']} s | plain {p['tokens_per_s']:7.2f} tok/s TPOT {p['tpot_ms']} ms "
                f"TTFT {p['mean_ttft_s']} s | {row['speedup']:.2f}x, failed {s['failed']}+{p['failed']}, "
                f"identical={row['identical']}",
                flush=True,
            )
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print(f"machine: {machine()}; records: {rec.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
