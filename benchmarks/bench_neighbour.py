"""Serving beside a busy neighbour: start-up, throughput and inter-token latency, plain and SSSD.

Issue 31 item 3. For each neighbour mode, the same requests run against `sssd serve --no-speculate`
(plain) and `sssd serve` (SSSD), each a fresh server process with an EMPTY profile cache (a new
temporary SSSD_PROFILE_DIR per start, so every start is a first start; the model and datastore must
already be built in the SSSD cache) and `--measure background`:

    quiet    nothing else running
    spin     a neighbour busy-looping on one core: python -c "while True: pass"
    memory   a neighbour doing memory-bound work on one core: numpy copying a 512 MB array
             back and forth

The neighbour is this benchmark's child (never the server's), pinned to the last core this
process may use, started before the server (so start-up is measured beside it) and killed at
the end of the mode (always: on errors, Ctrl-C and SIGTERM too).

Measured per (mode, engine): start-up (process start -> /health answers 200), the first chat
request after that (max_tokens 32, not streamed), then a load phase per concurrency C: N MT-Bench
evaluation prompts, streamed, greedy (temperature 0, float32), C at a time; tokens/s = output
tokens (the server's usage) / the phase's wall time; inter-token latency (ITL) = the gaps
between a stream's content chunks (one chunk per engine step: under speculation a chunk carries
several tokens, so SSSD's gaps are per step, not per token), pooled over the phase's requests,
p50 and p99. /health's JSON is kept at start and at the end ("measuring", "threads",
"other_load_cores"), with the spec_decode counters of /metrics, and plain and SSSD texts are
compared prompt by prompt (same mode, same concurrency). /health's "threads" and
"other_load_cores" at start can precede the server's first load sample (it samples once a
second): read the later ones. --settle waits for the background measurements before loading.

The in-process variant: a subprocess constructs `sssd.LLM()` (the default model; plain is
speculate=False), timed, then generates the same prompts one at a time (tokens/s), quiet and
beside the spinner (--llm-modes).

Order: for each round, for each mode: start the neighbour, plain server, SSSD server, then the
LLM runs, stop the neighbour; so drift hits every cell alike. Output: a JSON file (default
benchmarks/out/bench_neighbour.json), a markdown table on stdout (startup, first request, tok/s
at each concurrency with its ratio to the same engine's quiet figure and SSSD/plain, ITL p50/p99),
the CPU model, cores and date, and a figure benchmarks/figures/bench_neighbour.png (tok/s per mode,
plain vs SSSD) when matplotlib is importable. Medians over rounds.

Usage:
  python benchmarks/bench_neighbour.py                      # quiet/spin/memory, c=1 and 4, 16 prompts
  python benchmarks/bench_neighbour.py --quick              # smoke run: quiet+spin, 3 prompts, 16 tokens, c=1
  python benchmarks/bench_neighbour.py --modes quiet spin --concurrency 1 --rounds 2 --no-llm
  python benchmarks/bench_neighbour.py --settle 120         # load only once the measurements are in
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, disjoint_prompts, git_sha, machine  # noqa: E402

FIG_DIR = Path(__file__).resolve().parent / "figures"
MODES = ("quiet", "spin", "memory")
ENGINES = ("plain", "sssd")

#: The neighbours: one Python process each, pinned to one core by the code itself.
SPIN_CODE = "while True: pass"
MEMORY_CODE = (
    "import numpy as np, sys\n"
    "a = np.ones(2**26)  # 512 MB of float64\n"
    "b = np.empty_like(a)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    np.copyto(b, a)\n"
    "    np.copyto(a, b)\n"
)

#: The in-process run: sssd.LLM constructed (timed) and the prompts generated one at a time.
LLM_CODE = r"""
import json, sys, time
cfg = json.loads(sys.stdin.read())
t0 = time.perf_counter()
import sssd
from sssd import SamplingParams
imported = time.perf_counter()
kw = {"threads": cfg["threads"]} if cfg["threads"] else {}
llm = sssd.LLM(speculate=cfg["speculate"], **kw)
built = time.perf_counter()
first = llm.generate([cfg["first"]], SamplingParams(max_tokens=32, temperature=0))
first_s = time.perf_counter() - built
texts, tokens = [], 0
t1 = time.perf_counter()
for p in cfg["prompts"]:
    out = llm.generate([p], SamplingParams(max_tokens=cfg["max_tokens"], temperature=0))[0]
    texts.append(out.text)
    tokens += len(out.token_ids)
wall = time.perf_counter() - t1
m = llm.engine.measurements
pending = list(m.status()["pending"]) if m is not None else []
llm.close()
print("RESULT " + json.dumps({
    "import_s": round(imported - t0, 3), "construct_s": round(built - imported, 3),
    "first_generate_s": round(first_s, 3), "tokens": tokens, "wall_s": round(wall, 3),
    "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
    "measuring_at_end": pending, "texts": texts,
}), flush=True)
"""


# ----------------------------------------------------------------------------- pure helpers


def percentile_ms(gaps: list[float], q: float) -> float | None:
    """The q-th percentile of gaps (seconds) in milliseconds, None when there are none."""
    return round(1e3 * float(np.percentile(gaps, q)), 2) if gaps else None


def stream_gaps(stamps_per_request: list[list[float]]) -> list[float]:
    """The gaps between consecutive chunk arrivals of each stream, pooled over the streams."""
    return [b - a for s in stamps_per_request for a, b in zip(s, s[1:])]


def ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def parse_counters(text: str, prefix: str = "vllm:spec_decode_") -> dict:
    """Unlabelled counters of a Prometheus text page whose names start with prefix."""
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix) and "{" not in line:
            parts = line.split()
            if len(parts) >= 2:
                try:
                    out[parts[0][len(prefix) :]] = float(parts[1])
                except ValueError:
                    pass
    return out


def median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return round(float(np.median(xs)), 3) if xs else None


def summarize(rows: list[dict], llm_rows: list[dict], concurrency: list[int]) -> dict:
    """Medians over rounds per (mode, engine), with ratios to the same engine's quiet figure and
    SSSD over plain in the same mode."""
    cells: dict = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for engine in ENGINES:
            rs = [r for r in rows if r["mode"] == mode and r["engine"] == engine and not r.get("error")]
            if not rs:
                continue
            cell = {
                "startup_s": median_or_none([r["startup_s"] for r in rs]),
                "first_request_s": median_or_none([r["first_request_s"] for r in rs]),
                "levels": {},
            }
            for c in concurrency:
                lv = [r["levels"][str(c)] for r in rs if str(c) in r["levels"]]
                cell["levels"][str(c)] = {
                    "tokens_per_s": median_or_none([x["tokens_per_s"] for x in lv]),
                    "itl_p50_ms": median_or_none([x["itl_p50_ms"] for x in lv]),
                    "itl_p99_ms": median_or_none([x["itl_p99_ms"] for x in lv]),
                    "identical": all(x.get("identical") is not False for x in lv),
                }
            cells[f"{mode}/{engine}"] = cell
    for key, cell in cells.items():
        mode, engine = key.split("/")
        quiet = cells.get(f"quiet/{engine}")
        other = cells.get(f"{mode}/plain")
        for c, lv in cell["levels"].items():
            lv["vs_quiet"] = ratio(lv["tokens_per_s"], quiet["levels"][c]["tokens_per_s"]) if quiet else None
            lv["sssd_over_plain"] = (
                ratio(lv["tokens_per_s"], other["levels"][c]["tokens_per_s"]) if other and engine == "sssd" else None
            )
    llm: dict = {}
    for mode in dict.fromkeys(r["mode"] for r in llm_rows):
        for engine in ENGINES:
            rs = [r for r in llm_rows if r["mode"] == mode and r["engine"] == engine and not r.get("error")]
            if rs:
                llm[f"{mode}/{engine}"] = {
                    "construct_s": median_or_none([r["construct_s"] for r in rs]),
                    "first_generate_s": median_or_none([r["first_generate_s"] for r in rs]),
                    "tokens_per_s": median_or_none([r["tokens_per_s"] for r in rs]),
                    "identical": all(r.get("identical") is not False for r in rs),
                }
    for key, cell in llm.items():
        mode, engine = key.split("/")
        quiet, other = llm.get(f"quiet/{engine}"), llm.get(f"{mode}/plain")
        cell["vs_quiet"] = ratio(cell["tokens_per_s"], quiet["tokens_per_s"]) if quiet else None
        cell["sssd_over_plain"] = (
            ratio(cell["tokens_per_s"], other["tokens_per_s"]) if other and engine == "sssd" else None
        )
    return {"server": cells, "llm": llm}


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(summary: dict, concurrency: list[int], header: dict) -> str:
    m = header["machine"]
    lines = [
        f"CPU: {m.get('cpu')}, {m.get('cores')} cores; {header['date']}; git {header['git']}",
        "",
        "| mode | engine | startup s | first request s | "
        + " | ".join(f"c={c} tok/s | vs quiet | SSSD/plain | ITL p50/p99 ms | same text" for c in concurrency)
        + " |",
        "|---|---|---:|---:|" + "---:|---:|---:|---:|---|" * len(concurrency),
    ]
    for key, cell in summary["server"].items():
        mode, engine = key.split("/")
        row = f"| {mode} | {engine} | {fmt(cell['startup_s'], '.1f')} | {fmt(cell['first_request_s'])} |"
        for c in concurrency:
            lv = cell["levels"][str(c)]
            row += (
                f" {fmt(lv['tokens_per_s'], '.1f')} | {fmt(lv['vs_quiet'])} | {fmt(lv['sssd_over_plain'])} |"
                f" {fmt(lv['itl_p50_ms'], '.0f')}/{fmt(lv['itl_p99_ms'], '.0f')} | {lv['identical']} |"
            )
        lines.append(row)
    if summary["llm"]:
        lines += [
            "",
            "sssd.LLM in process (prompts one at a time):",
            "",
            "| mode | engine | construct s | first generate s | tok/s | vs quiet | SSSD/plain | same text |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for key, cell in summary["llm"].items():
            mode, engine = key.split("/")
            lines.append(
                f"| {mode} | {engine} | {fmt(cell['construct_s'], '.1f')} | {fmt(cell['first_generate_s'])} | "
                f"{fmt(cell['tokens_per_s'], '.1f')} | {fmt(cell['vs_quiet'])} | {fmt(cell['sssd_over_plain'])} | "
                f"{cell['identical']} |"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_core() -> int:
    try:
        return max(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) - 1


_LIVE: list[subprocess.Popen] = []  # every process started here, stopped in stop_all()


def stop(proc: subprocess.Popen | None, grace: float = 30.0) -> None:
    """SIGTERM to the process's group (it leads its own session), SIGKILL after `grace` s."""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if proc in _LIVE:
        _LIVE.remove(proc)


def stop_all() -> None:
    for proc in list(_LIVE):
        stop(proc, grace=10.0)


def spawn(cmd: list[str], **kw) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    _LIVE.append(proc)
    return proc


def start_neighbour(mode: str, pin: bool) -> subprocess.Popen | None:
    if mode == "quiet":
        return None
    code = SPIN_CODE if mode == "spin" else MEMORY_CODE
    if pin:
        code = f"import os; os.sched_setaffinity(0, {{{last_core()}}})\n" + code
    proc = spawn([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    if mode == "memory":
        line = proc.stdout.readline()  # allocated and touched: the copying starts now
        if "ready" not in line:
            raise RuntimeError(f"the memory neighbour did not start (exit {proc.poll()})")
    time.sleep(1.0)  # let it reach full speed
    if proc.poll() is not None:
        raise RuntimeError(f"the {mode} neighbour exited with {proc.returncode}")
    return proc


def server_cmd(args, engine: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sssd.cli", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--measure", "background", "--log-level", "warning"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if engine == "plain":
        cmd.append("--no-speculate")
    return cmd


def get_json(url: str):
    import httpx

    try:
        r = httpx.get(url, timeout=10)
        return r.json() if r.status_code == 200 else {"status_code": r.status_code}
    except (httpx.HTTPError, ValueError) as e:
        return {"error": repr(e)}


def spec_counters(url: str) -> dict:
    import httpx

    try:
        return parse_counters(httpx.get(url + "/metrics", timeout=10).text)
    except httpx.HTTPError:
        return {}


# ----------------------------------------------------------------------------- requests


async def one_request(client, url: str, model: str, messages, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps, text, usage = [], [], None
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                stamps.append(time.perf_counter())
                text.append(chunk["choices"][0]["delta"]["content"])
    tokens = usage["completion_tokens"] if usage else len(stamps)
    return {"ok": True, "text": "".join(text), "start": t0, "stamps": stamps, "tokens": tokens}


async def load_phase(url: str, model: str, prompts, concurrency: int, max_tokens: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def bounded(client, messages):
        async with sem:
            return await one_request(client, url, model, messages, max_tokens)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(client, m) for m in prompts), return_exceptions=True)
        wall = time.perf_counter() - t0
    ok = [r for r in results if isinstance(r, dict) and r.get("ok")]
    tokens = sum(r["tokens"] for r in ok)
    gaps = stream_gaps([r["stamps"] for r in ok])
    ttft = [r["stamps"][0] - r["start"] for r in ok if r["stamps"]]
    chunks = sum(len(r["stamps"]) for r in ok)
    return {
        "wall_s": round(wall, 3),
        "failed": len(results) - len(ok),
        "errors": [repr(r) for r in results if isinstance(r, BaseException)][:3],
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
        "itl_p50_ms": percentile_ms(gaps, 50),
        "itl_p99_ms": percentile_ms(gaps, 99),
        "ttft_p50_s": round(float(np.median(ttft)), 3) if ttft else None,
        "texts": [r.get("text") if isinstance(r, dict) else None for r in results],
    }


def first_request(url: str, model: str, messages) -> tuple[float, str]:
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": 32, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return seconds, r.json()["choices"][0]["message"]["content"]


def run_server(args, mode: str, engine: str, prompts, log_dir: Path) -> dict:
    """One fresh server with an empty profile cache: start-up, first request, the load phases.

    prompts: {"first": [the first request's prompt], "1": level 1's prompts, ...}, disjoint
    (common.disjoint_prompts)."""
    import httpx

    profiles = profile_dir(args, engine)
    env = dict(os.environ, SSSD_PROFILE_DIR=str(profiles))
    env.pop("SSSD_MEASURE", None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{mode}-{engine}.log"
    row: dict = {"mode": mode, "engine": engine, "log": str(log_path), "levels": {}}
    proc = None
    try:
        with open(log_path, "w") as log:
            t0 = time.perf_counter()
            proc = spawn(server_cmd(args, engine, port), env=env, stdout=log, stderr=subprocess.STDOUT)
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}: {tail(log_path)}")
                if time.perf_counter() - t0 > args.start_timeout:
                    raise RuntimeError(f"no /health in {args.start_timeout} s: {tail(log_path)}")
                try:
                    r = httpx.get(url + "/health", timeout=2)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            row["startup_s"] = round(time.perf_counter() - t0, 3)
            row["health_at_start"] = r.json()
            served = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            row["first_request_s"], _ = first_request(url, served, prompts["first"][0])
            row["first_request_s"] = round(row["first_request_s"], 3)
            row["health_after_first"] = get_json(url + "/health")
            print(
                f"  {mode:6} {engine:5} startup {row['startup_s']:.1f} s, first request "
                f"{row['first_request_s']:.2f} s, /health {json.dumps(row['health_at_start'])}",
                flush=True,
            )
            if args.settle > 0:  # wait for the background measurements before the load phase
                t1 = time.perf_counter()
                health = row["health_after_first"]
                while health.get("measuring") and time.perf_counter() - t1 < args.settle:
                    time.sleep(1.0)
                    health = get_json(url + "/health")
                row["settle_s"] = None if health.get("measuring") else round(time.perf_counter() - t1, 1)
                row["health_after_settle"] = health
                print(f"  {mode:6} {engine:5} settled: {row['settle_s']} s, /health {json.dumps(health)}", flush=True)
            for c in args.concurrency:
                lv = asyncio.run(load_phase(url, served, prompts[str(c)], c, args.max_tokens))
                row["levels"][str(c)] = lv
                print(
                    f"  {mode:6} {engine:5} c={c}: {lv['tokens_per_s']} tok/s, ITL p50 {lv['itl_p50_ms']} "
                    f"p99 {lv['itl_p99_ms']} ms, {lv['tokens_per_chunk']} tok/chunk, failed {lv['failed']}",
                    flush=True,
                )
            row["health_at_end"] = get_json(url + "/health")
            row["spec_decode"] = spec_counters(url)
            row["profiles_written"] = sorted(p.name for p in profiles.rglob("*") if p.is_file())
    except Exception as e:  # noqa: BLE001 - one failed cell is reported, the others still run
        row["error"] = repr(e)
        print(f"  {mode:6} {engine:5} FAILED: {e}", flush=True)
    finally:
        stop(proc)
        release_profile_dir(args, profiles)
    return row


#: --profiles shared: one profile folder per engine for the whole run (removed at its end)
SHARED: dict[str, Path] = {}


def profile_dir(args, engine: str) -> Path:
    """The SSSD_PROFILE_DIR of one start: a new empty one (--profiles empty: every start is a first
    start), or the engine's folder for the whole run (--profiles shared: what the first, quiet mode
    measured between requests is cached for the later modes, as on a server restarted beside a
    neighbour after it measured on a quiet moment)."""
    if args.profiles == "empty":
        return Path(tempfile.mkdtemp(prefix="sssd-profiles-"))
    if engine not in SHARED:
        SHARED[engine] = Path(tempfile.mkdtemp(prefix=f"sssd-profiles-{engine}-"))
    return SHARED[engine]


def release_profile_dir(args, folder: Path) -> None:
    """Removes a start's profile folder (--profiles empty); a shared one stays for the run."""
    if args.profiles == "empty":
        shutil.rmtree(folder, ignore_errors=True)


def run_llm(args, mode: str, engine: str, prompts) -> dict:
    """sssd.LLM in a subprocess with an empty profile cache (or the shared one)."""
    profiles = profile_dir(args, engine)
    env = dict(os.environ, SSSD_PROFILE_DIR=str(profiles))
    env.pop("SSSD_MEASURE", None)
    cfg = {
        "speculate": engine == "sssd",
        "first": prompts["first"][0],  # not among the timed prompts (the recent outputs would draft it)
        "prompts": prompts[str(args.concurrency[0])],
        "max_tokens": args.max_tokens,
        "threads": args.threads,
    }
    row: dict = {"mode": mode, "engine": engine}
    proc = None
    try:
        t0 = time.perf_counter()
        proc = spawn(
            [sys.executable, "-c", LLM_CODE],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = proc.communicate(json.dumps(cfg), timeout=args.start_timeout + 3600)
        row["process_s"] = round(time.perf_counter() - t0, 3)
        result = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not result:
            raise RuntimeError(f"exit {proc.returncode}: {err[-1500:]}")
        row.update(json.loads(result[-1][len("RESULT ") :]))
        print(
            f"  {mode:6} LLM {engine:5}: construct {row['construct_s']:.1f} s (import {row['import_s']:.1f} s), "
            f"first generate {row['first_generate_s']:.2f} s, {row['tokens_per_s']} tok/s, "
            f"measuring at end {row['measuring_at_end']}",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)
        print(f"  {mode:6} LLM {engine:5} FAILED: {e}", flush=True)
    finally:
        stop(proc)
        release_profile_dir(args, profiles)
    return row


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text()[-n:]
    except OSError:
        return ""


def plot(summary: dict, args, header: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure")
        return
    cells = summary["server"]
    modes = list(dict.fromkeys(k.split("/")[0] for k in cells))
    fig, axes = plt.subplots(1, len(args.concurrency), figsize=(4.5 * len(args.concurrency), 3.6), squeeze=False)
    x = np.arange(len(modes))
    for ax, c in zip(axes[0], args.concurrency):
        for i, engine in enumerate(ENGINES):
            ys = [
                (cells.get(f"{m}/{engine}") or {}).get("levels", {}).get(str(c), {}).get("tokens_per_s") or 0
                for m in modes
            ]
            ax.bar(x + (i - 0.5) * 0.38, ys, 0.38, label="plain" if engine == "plain" else "SSSD")
        ax.set_xticks(x, modes)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"concurrency {c}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"sssd serve beside a neighbour, {args.model} ({header['machine'].get('cpu')})", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the server's model (sssd.LLM uses its default)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="neighbour modes, in this order")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="load-phase concurrency levels")
    ap.add_argument("--prompts", type=int, default=16, help="MT-Bench prompts per load phase")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each load-phase request")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the whole interleaved sequence")
    ap.add_argument("--threads", type=int, default=0, help="--threads for the servers and sssd.LLM (0: their default)")
    ap.add_argument(
        "--llm-modes", nargs="*", default=["quiet", "spin"], help="modes that also run sssd.LLM in process (none: skip)"
    )
    ap.add_argument("--no-llm", action="store_true", help="skip the sssd.LLM runs")
    ap.add_argument("--no-pin", action="store_true", help="let the neighbour run on any core (default: the last one)")
    ap.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="after the first request, wait up to this many seconds for /health's 'measuring' to empty "
        "(the background linear plan and forward profile) before the load phase; records settle_s "
        "(None: not settled). Default 0: load at once, as a user right after start-up would",
    )
    ap.add_argument(
        "--profiles",
        choices=("empty", "shared"),
        default="empty",
        help="empty: every start has an empty profile cache (a first start); shared: one cache per "
        "engine for the run, filled by the first mode's background measurements (use --settle), so "
        "the later modes start as a server that measured on a quiet moment",
    )
    ap.add_argument("--start-timeout", type=float, default=1200.0, help="seconds a server may take to answer /health")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: benchmarks/out/bench_neighbour.json)")
    ap.add_argument(
        "--figure", type=Path, default=None, help="figure (default: benchmarks/figures/bench_neighbour.png)"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: quiet and spin, 3 prompts, max_tokens 16, concurrency 1; writes "
        "bench_neighbour-quick.json/.png under benchmarks/out/",
    )
    args = ap.parse_args()
    if args.quick:
        args.modes = [m for m in args.modes if m in ("quiet", "spin")] or ["quiet", "spin"]
        args.prompts, args.max_tokens, args.concurrency = 3, 16, [1]
        args.llm_modes = [m for m in args.llm_modes if m in args.modes]
    name = "bench_neighbour" + ("-quick" if args.quick else "")
    out_path = args.out or OUT_DIR / f"{name}.json"
    fig_path = args.figure or (OUT_DIR / f"{name}.png" if args.quick else FIG_DIR / "bench_neighbour.png")
    llm_modes = [] if args.no_llm else [m for m in args.llm_modes if m in args.modes]

    from sssd.calibration import datasets

    questions = [r.messages for r in datasets.split(datasets.mtbench(), "eval")]
    # the first request's prompt and each load phase's are disjoint: a server keeps its recent outputs
    phases = ["first", *map(str, args.concurrency)]
    prompts = dict(zip(phases, disjoint_prompts(questions, [1] + [args.prompts] * len(args.concurrency))))
    header = {
        "benchmark": "bench_neighbour",
        "git": git_sha(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    log_dir = OUT_DIR / f"{name}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {json.dumps(header['machine'])}", flush=True)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    rows, llm_rows = [], []
    t_all = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            for mode in args.modes:
                print(f"round {rnd}, mode {mode}", flush=True)
                neighbour = start_neighbour(mode, pin=not args.no_pin)
                try:
                    mode_rows = {}
                    for engine in ENGINES:
                        mode_rows[engine] = run_server(args, mode, engine, prompts, log_dir)
                        mode_rows[engine]["round"] = rnd
                    p, s = mode_rows["plain"], mode_rows["sssd"]
                    for c, lv in s["levels"].items():
                        if c in p["levels"]:
                            same = lv["texts"] == p["levels"][c]["texts"]
                            lv["identical"] = p["levels"][c]["identical"] = same
                    rows += [p, s]
                    if mode in llm_modes:
                        pair = {engine: run_llm(args, mode, engine, prompts) for engine in ENGINES}
                        texts = [pair[e].get("texts") for e in ENGINES]
                        same = texts[0] is not None and texts[0] == texts[1]
                        for r in pair.values():
                            r["round"], r["identical"] = rnd, same
                            llm_rows.append(r)
                    if neighbour is not None and neighbour.poll() is not None:
                        print(f"  WARNING: the {mode} neighbour died early ({neighbour.returncode})", flush=True)
                finally:
                    stop(neighbour, grace=5.0)
    finally:
        stop_all()
        for folder in SHARED.values():
            shutil.rmtree(folder, ignore_errors=True)
    total_s = round(time.perf_counter() - t_all, 1)
    for r in rows:
        for lv in r["levels"].values():
            lv.pop("texts", None)
    for r in llm_rows:
        r.pop("texts", None)
    summary = summarize(rows, llm_rows, args.concurrency)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(
        json.dumps({"header": header, "total_s": total_s, "summary": summary, "rows": rows, "llm": llm_rows}, indent=1)
    )
    print()
    print(markdown(summary, args.concurrency, header))
    print(f"\ntotal {total_s} s; JSON: {out_path}; server logs: {log_dir}")
    plot(summary, args, header, fig_path)
    busy = [
        r["health_at_end"]["other_load_cores"]
        for r in rows
        if r["mode"] == "quiet" and isinstance(r.get("health_at_end", {}).get("other_load_cores"), (int, float))
    ]
    if busy and max(busy) > 0.5:
        print(
            f"WARNING: 'quiet' was not quiet: /health saw other processes' load of {max(busy)} cores at its end "
            "(another job on this machine?); the ratios to quiet understate the neighbour's cost"
        )
    return 1 if any(r.get("error") for r in rows + llm_rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
