"""`sssd serve` under bad traffic: do the well-behaved clients notice?

Starts the default server (SmolLM2 + the default datastore) on loopback,
then runs the same streaming greedy chat clients twice: alone, and beside a
stream of bad requests (10 MB prompts, malformed JSON, NaN and huge numbers,
negative and huge max_tokens, wrong types, unknown fields, vanishing
temperatures). Reported: whether the good clients' texts are identical in
both runs, their inter-token gaps (max and p99) in each run, the bad
requests' status codes (any 5xx or dropped connection is a failure), and
whether the server is still healthy.

Usage:
  python benchmarks/bench_api_abuse.py                   # 4 clients, 128 tokens, ~40 bad requests
  python benchmarks/bench_api_abuse.py --clients 8 --huge-mb 10 --huge-count 10
  python benchmarks/bench_api_abuse.py --only-huge --interval 1   # one 10 MB prompt at a time: its delay
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder, machine  # noqa: E402

PROMPTS = [
    "Write a haiku about the sea.",
    "Explain what a suffix array is.",
    "Give me three tips for learning Python.",
    "What is the capital of France, and why is it famous?",
    "Describe a sunset over the mountains.",
    "How do I boil an egg?",
    "Summarise the plot of Hamlet.",
    "Why is the sky blue?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bad_requests(huge_mb: int, huge_count: int, only_huge: bool = False) -> list[tuple[str, bytes]]:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    huge = ("All work and no play makes Jack a dull boy. " * (huge_mb * 2**20 // 44 + 1))[: huge_mb * 2**20]
    out = [
        (chat, json.dumps({"messages": [{"role": "user", "content": huge}], "max_tokens": 8}).encode()),
        (comp, json.dumps({"prompt": huge, "max_tokens": 8}).encode()),
    ] * (huge_count // 2)
    if only_huge:
        return out
    junk = [
        '{"prompt": "hi", "temperature": NaN}',
        '{"prompt": "hi", "top_p": Infinity}',
        '{"prompt": "hi",',
        "hello",
        "[]",
        '{"prompt": "hi", "max_tokens": -1}',
        '{"prompt": "hi", "max_tokens": 1000000000000}',
        '{"prompt": [1, 2, 99999999999999999999999]}',
        '{"prompt": {"x": 1}}',
        '{"prompt": "hi", "n": "two"}',
        '{"prompt": "hi", "seed": 1e400}',
        '{"prompt": "hi", "stop": [1, 2]}',
        '{"prompt": "hi", "top_k": -7}',
        '{"messages": "not a list"}',
        '{"messages": [{"role": 5}]}',
        '{"prompt": "hi", "unknown": {"deep": [1]}, "max_tokens": 4, "temperature": 0}',
        '{"prompt": "hi", "temperature": 1e-40, "max_tokens": 4}',
        '{"prompt": "hi", "max_tokens": 4, "stream_options": {"include_usage": true}}',
    ]
    for j in junk:
        out.append((comp if "prompt" in j or "messages" not in j else chat, j.encode()))
    return out


def run_clients(url: str, model: str, n: int, max_tokens: int) -> list[dict]:
    import httpx

    results: list[dict] = [{} for _ in range(n)]

    def client(i):
        times, text = [], []
        with httpx.Client(timeout=600) as c:
            with c.stream(
                "POST",
                url + "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                },
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        d = json.loads(line[6:])
                        if d.get("choices") and d["choices"][0]["delta"].get("content"):
                            times.append(time.perf_counter())
                            text.append(d["choices"][0]["delta"]["content"])
        results[i] = {"text": "".join(text), "times": times}

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def gaps(results: list[dict]) -> np.ndarray:
    return np.concatenate([np.diff(r["times"]) for r in results if len(r["times"]) > 1]) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4, help="well-behaved streaming clients")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens each good client asks for")
    ap.add_argument("--huge-mb", type=int, default=10, help="size of the huge prompts, MB")
    ap.add_argument("--huge-count", type=int, default=6, help="huge prompts sent during the abusive run")
    ap.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="seconds between bad requests (0: back to back, a flood; 1 with --only-huge: one 10 MB "
        "prompt at a time, the delay each one causes)",
    )
    ap.add_argument(
        "--only-huge",
        action="store_true",
        help="send only the huge prompts (their own effect, without the valid small requests among the junk)",
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sssd.cli",
            "serve",
            "--model",
            args.model,
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(1800):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        run_clients(url, model, 1, 8)  # warm-up
        clean = run_clients(url, model, args.clients, args.max_tokens)

        statuses: dict[str, int] = {}
        bad_seconds: list[float] = []
        stop = threading.Event()

        def abuse():
            reqs = bad_requests(args.huge_mb, args.huge_count, args.only_huge)
            with httpx.Client(base_url=url, timeout=120) as c:
                while not stop.is_set():
                    for path, body in reqs:
                        if stop.is_set():
                            break
                        t0 = time.perf_counter()
                        try:
                            code = str(
                                c.post(path, content=body, headers={"content-type": "application/json"}).status_code
                            )
                        except httpx.HTTPError as e:
                            code = type(e).__name__
                        bad_seconds.append(time.perf_counter() - t0)
                        statuses[code] = statuses.get(code, 0) + 1
                        if args.interval:
                            stop.wait(args.interval)

        t = threading.Thread(target=abuse)
        t.start()
        time.sleep(0.5)
        abused = run_clients(url, model, args.clients, args.max_tokens)
        stop.set()
        t.join()
        healthy = httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    g0, g1 = gaps(clean), gaps(abused)
    identical = [a["text"] == b["text"] for a, b in zip(clean, abused)]
    failures = {k: v for k, v in statuses.items() if not k.isdigit() or k.startswith("5")}
    summary = {
        "identical": f"{sum(identical)}/{len(identical)}",
        "bad_requests": sum(statuses.values()),
        "statuses": statuses,
        "failures": failures,
        "healthy_after": healthy,
        "gap_ms_clean": {
            "p50": round(float(np.median(g0)), 1),
            "p99": round(float(np.percentile(g0, 99)), 1),
            "max": round(float(g0.max()), 1),
        },
        "gap_ms_abused": {
            "p50": round(float(np.median(g1)), 1),
            "p99": round(float(np.percentile(g1, 99)), 1),
            "max": round(float(g1.max()), 1),
        },
        "bad_request_seconds": {
            "p50": round(float(np.median(bad_seconds)), 3),
            "max": round(float(max(bad_seconds)), 3),
        },
    }
    Recorder("api_abuse", vars(args)).add(**summary)
    print(json.dumps({"machine": machine(), **summary}, indent=2))
    return 0 if all(identical) and not failures and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
