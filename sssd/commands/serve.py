"""``sssd serve``: the OpenAI-compatible server (default model, datastore and calibration)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

from sssd.cli import command

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: Draft sources `sssd serve --draft` accepts (sssd.sources' spec grammar names more).
SERVABLE_SOURCES = ("retrieval", "model", "self", "recycle", "recent")


@command(
    "serve",
    help="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions) with SSSD "
    "speculation; with no arguments, the default model, datastore and calibration.",
)
def setup(p: argparse.ArgumentParser):
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model name (`sssd models list`; pulled on first use) or a local Hugging Face model folder",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's name)")
    p.add_argument(
        "--datastore",
        action="append",
        default=None,
        metavar="DATASTORE",
        help="datastore directory or .sssd.zst archive, 'none' (draft from prompts only), or 'default': "
        "the default datastore, built on first use. Repeat it to draft from several: the first is "
        "retrieval's, each further one drafts as a source of its own, named by its folder in the "
        "metrics (default: default)",
    )
    p.add_argument(
        "--drafter",
        default="default",
        help="drafter config or `sssd calibrate` parameter file; a calibration made for another "
        "datastore, tokenizer or model is not used (warning) (default: the packaged calibration "
        "when its fingerprint matches the model and datastore, else the built-in defaults)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; the default serves this machine only (see SECURITY.md before exposing it)",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (1-65535)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SSSD_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $SSSD_API_KEY if set, else no key)",
    )
    p.add_argument(
        "--public-metrics",
        action="store_true",
        help="with --api-key, serve /metrics without the key too (for a Prometheus scraper)",
    )
    p.add_argument(
        "--enable-admin",
        action="store_true",
        help="serve /v1/admin/datastores: list, add and remove datastores while the server runs. Off "
        "by default: adding opens a path on the server's disk. Behind the API key like every "
        "endpoint; on an address other than loopback it needs --api-key (SECURITY.md)",
    )
    p.add_argument("--max-running", type=int, default=32, help="requests decoded concurrently (KV slots)")
    p.add_argument("--max-model-len", type=int, default=2048, help="tokens per request (prompt + output)")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 429")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument(
        "--budget", type=int, default=None, help="fixed draft budget (default: the planner chooses per batch size)"
    )
    p.add_argument(
        "--draft",
        default="retrieval,recent",
        help="draft sources, comma-separated (default: retrieval,recent): retrieval (the datastore and "
        "the request's own tokens), "
        "model:NAME or model:FOLDER (a small model with the target's tokenizer drafting token "
        "trees, e.g. model:qwen2.5-coder-0.5b-instruct for Qwen2.5-Coder-1.5B), "
        "recycle or recycle:K (Token Recycling: the model's own top-K predictions at verified "
        "tokens), recent (other requests' recent outputs, running or finished), self:snapkv or self:streamingllm "
        "(MagicDec: the model itself over a sparse KV of 512 positions, or self:snapkv:N of N; "
        "for long contexts); 'none' serves without speculation",
    )
    p.add_argument(
        "--draft-mode",
        default="serial",
        choices=("serial", "async"),
        help="serial drafts each step before its forward pass; async grows the next step's trees on a "
        "drafting thread while the model verifies (SwiftSpec), where measured to be faster, and "
        "drafts serially where it is not (default: serial)",
    )
    p.add_argument(
        "--pipeline-stages",
        type=int,
        default=1,
        help="split the model's layers into this many pipeline stages, one process each (CPU, gloo), "
        "decoding with SpecPipe's pipelined token trees (the draft sources feed a tree layer per "
        "step; with --draft none, plain pipelined decoding); --threads is then per stage "
        "(default: 1, no pipeline)",
    )
    p.add_argument("--no-speculate", action="store_true", help="serve without speculation (same engine; --draft none)")
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="measure the forward-time profile the planner uses again, replacing the cached one "
        "(do it on a quiet machine)",
    )
    p.add_argument(
        "--measure",
        default=os.environ.get("SSSD_MEASURE", "background"),
        choices=("background", "now"),
        help="when this machine's measurements that are not cached yet are taken (the linear plan: "
        "which kernel each layer takes by row count; the forward profile the budget plan uses): "
        "background serves at once, with torch's layers and a conservative cost model, and takes "
        "them between requests, piece by piece, swapping them in once trusted (one taken beside a "
        "busy process is dropped and tried again later); now takes them before serving (about half "
        "a minute for the default model on 2 quiet cores) (default: $SSSD_MEASURE, else background)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print the details of start-up (each linear plan and profile measurement) and the "
        "thread changes under load",
    )
    p.add_argument(
        "--datastore-residency",
        default="warm",
        choices=("lazy", "warm", "lock"),
        help="how the datastores' pages stay in memory: warm reads them in at start (the kernel may "
        "reclaim them under memory pressure, and drafts then fault), lock also pins them (mlock; "
        "needs `ulimit -l` above the datastore's size, or CAP_IPC_LOCK), lazy reads them on first "
        "use (default: warm)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cancelled (504)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are cut off",
    )
    p.add_argument("--max-body-bytes", type=int, default=32 * 2**20, help="largest request body accepted (413 above)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the model's weights and activations (float32: outputs identical to plain decoding)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: CUDA when available)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the model's forward pass, per stage with --pipeline-stages (default: "
        "torch's own count, which follows OMP_NUM_THREADS where set, capped at the cores this process "
        "may use: its CPU affinity and cgroup CPU quota, %s here; with --pipeline-stages, 1 per stage). "
        "More than the cores (per stage) is cut to them, with a warning. Batch drafting's OpenMP threads "
        "follow the same count (torch and the drafter share one OpenMP runtime). OMP_WAIT_POLICY=passive "
        "makes threads that wait at a barrier sleep instead of spinning: kinder to a busy neighbour, "
        "slower on a quiet machine; set it before the server starts. SSSD_LINEAR_PLAN=off leaves the "
        "linear layers to torch (no linear-plan measurement); SSSD_PROFILE_DIR moves the cached forward "
        "profiles and linear plans out of <sssd cache>/profiles. While other processes hold some of "
        "these cores, the engine runs fewer threads (it samples the load once a second; back up when "
        "they leave); SSSD_FOLLOW_LOAD=0 keeps the count fixed" % _cores_here(),
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="server log verbosity")
    p.add_argument("--debug", action="store_true", help="show tracebacks")

    def run(args: argparse.Namespace) -> int:
        validate(args)  # everything that can be checked before the model loads
        return _serve(args)

    return run


def validate(args: argparse.Namespace) -> None:
    """Refuses bad arguments with one clear message (ValueError), before anything loads."""
    import importlib.util

    from sssd import _core

    missing = [m for m in ("torch", "transformers", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(
            f"sssd serve needs the 'serve' extra (missing: {', '.join(missing)}): "
            f"pip install 'sssd[serve]' (with torch's CPU build where there is no GPU)"
        )

    def positive(name: str) -> None:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    for name in ("max_running", "max_model_len", "max_waiting", "max_tokens", "max_body_bytes"):
        positive(name)
    if getattr(args, "pipeline_stages", 1) < 1:
        raise ValueError(f"--pipeline-stages must be >= 1, got {args.pipeline_stages}")
    if args.threads is not None:  # ValueError below 1; more than the cores this process may use: cut, one warning
        from sssd.cpus import threads_for

        args.threads = threads_for(
            args.threads,
            share=getattr(args, "pipeline_stages", 1),
            what="--threads",
            warn=lambda message: print(f"WARNING: {message}", file=sys.stderr, flush=True),
        )
    if args.budget is not None and not 0 <= args.budget <= int(_core.MAX_BUDGET):
        raise ValueError(f"--budget must be in 0-{int(_core.MAX_BUDGET)}, got {args.budget}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.draft.strip().lower() != "none":
        from sssd.sources import parse_specs

        for spec in parse_specs(args.draft):  # ValueError naming the known kinds
            if spec[0] not in SERVABLE_SOURCES:
                raise ValueError(
                    f"--draft: the draft source '{spec[0]}:{spec[1]}' is not available in this "
                    f"version of sssd (available: retrieval, model:<name or folder>, self:streamingllm, "
                    f"self:snapkv, recycle, recent)"
                )
            if spec[0] == "model":
                _draft_model(spec[1])
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty (unset SSSD_API_KEY or give a key)")
    model = Path(args.model).expanduser()
    if model.exists() or os.sep in args.model:
        if not (model / "config.json").is_file():
            raise ValueError(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
    else:
        from sssd.models import get_spec

        get_spec(args.model)  # ValueError listing the registered models
    _datastores(args)
    if args.drafter != "default":
        if not Path(args.drafter).expanduser().is_file():
            raise FileNotFoundError(f"--drafter {args.drafter}: no such file")
        from sssd.calibration_file import load_drafter

        try:
            load_drafter(Path(args.drafter).expanduser())  # a bad file refuses to serve (the fingerprint: later)
        except ValueError as e:
            raise ValueError(f"--drafter {e}") from None
    if args.device:  # before anything loads: a one-line error naming the device and what this machine has
        from sssd.serving.backends.devices import resolve

        resolve(args.device)  # DeviceError: "device 'cuda': this torch ... is a build without CUDA; ..."
    if getattr(args, "enable_admin", False) and not args.api_key and not _is_loopback(args.host):
        raise ValueError(
            f"--enable-admin on {args.host} needs --api-key: the admin endpoints open paths on this "
            f"machine's disk (SECURITY.md)"
        )
    _check_bindable(args.host, args.port)


def _cores_here() -> str:
    try:
        from sssd.cpus import available_cpus

        return str(available_cpus())
    except Exception:  # the help never fails on an odd /sys
        return "?"


def _draft_model(spec: str) -> None:
    """Refuses a draft model that is neither a model folder nor a registered name (its tokenizer
    is checked against the target's when the engine starts)."""
    path = Path(spec).expanduser()
    if path.exists() or os.sep in spec:
        if not (path / "config.json").is_file():
            raise ValueError(f"--draft model:{spec}: not a Hugging Face model folder (no config.json)")
        return
    from sssd.models import get_spec

    try:
        get_spec(spec)
    except ValueError as e:
        raise ValueError(f"--draft model:{spec}: {e}") from None


def _datastores(args: argparse.Namespace) -> None:
    """Splits the repeated --datastore into args.datastore (retrieval's, a string as before) and
    args.extra_datastores (each a draft source of its own), checking that each exists."""
    given = args.datastore if isinstance(args.datastore, list) else [args.datastore or "default"]
    given = given or ["default"]
    for k, d in enumerate(given):
        if d == "none" and k:
            raise ValueError(
                "--datastore none can only be the first --datastore (retrieval drafts from the "
                "prompts only); leave out the others"
            )
        if d not in ("default", "none") and not Path(d).expanduser().exists():
            raise FileNotFoundError(f"--datastore {d}: no such datastore directory")
        if d in given[:k]:
            raise ValueError(f"--datastore {d} is given twice")
    args.datastore, args.extra_datastores = given[0], given[1:]


def _check_bindable(host: str, port: int) -> None:
    """Binds the address once, so that a taken port or an unknown host fails before loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from sssd.serving.engine import EngineConfig, LLMEngine
    from sssd.serving.frontends.api_server import create_app
    from sssd.serving.frontends.async_engine import AsyncEngine

    logging.basicConfig(
        level=("DEBUG" if args.log_level == "trace" else args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "verbose", False):
        os.environ["SSSD_VERBOSE"] = "1"  # the measurements' details (serving/engine/factory.py)
        logging.getLogger("sssd").setLevel(logging.INFO)
    draft = [] if args.no_speculate or args.draft.strip().lower() == "none" else args.draft
    speculate = bool(draft)
    datastore = None if args.datastore == "none" else args.datastore
    extra = list(getattr(args, "extra_datastores", ()))
    if speculate and (datastore == "default" and "retrieval" in args.draft or "default" in extra):
        from sssd.commands.draft import ensure_default_datastore

        ensure_default_datastore()
    drafter = None if args.drafter == "default" else args.drafter  # None: the packaged calibration where it fits
    threads = args.threads
    if threads is None and getattr(args, "pipeline_stages", 1) == 1:  # stages: 1 thread each unless told
        import torch

        from sssd.cpus import threads_for

        threads = threads_for(None, default=torch.get_num_threads())  # capped at affinity and cgroup quota
    config = EngineConfig(
        max_running=args.max_running,
        max_model_len=args.max_model_len,
        max_waiting=args.max_waiting,
        speculate=speculate,
        budget=args.budget,
        dtype=args.dtype,
        device=args.device,
        threads=threads,
        reprofile=args.reprofile,
        measure=getattr(args, "measure", "background"),
        datastore_residency=args.datastore_residency,
        draft_mode=args.draft_mode,
        pipeline_stages=getattr(args, "pipeline_stages", 1),
    )
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    datastores = [datastore, *extra] if extra else datastore  # the first is retrieval's, the others their own sources
    engine = LLMEngine(
        args.model, datastore=datastores if speculate else None, drafter=drafter, config=config, draft=draft
    )
    name = args.served_model_name or os.path.basename(os.path.normpath(str(args.model)))
    mode = plan_summary(engine.planner, speculate, (1, 4, 16, args.max_running))
    measuring = engine.measurements.status()["pending"] if engine.measurements is not None else []
    if measuring:
        mode += (
            f" (provisional: the {' and the '.join(measuring)} "
            f"{'are' if len(measuring) > 1 else 'is'} measured between requests, then used)"
        )
    print(
        f"serving {name} on http://{args.host}:{args.port}/v1 ({engine.backend.device}, {args.dtype}); "
        f"speculation: {mode}",
        file=sys.stderr,
        flush=True,
    )
    if not _is_loopback(args.host) and not args.api_key:
        print(
            f"WARNING: listening on {args.host} without an API key: anyone who reaches this port can use the "
            f"model. Set --api-key (or SSSD_API_KEY), or bind 127.0.0.1 behind a proxy (SECURITY.md).",
            file=sys.stderr,
            flush=True,
        )
    async_engine = AsyncEngine(engine)
    app = create_app(
        async_engine,
        name,
        api_key=args.api_key,
        request_timeout=args.request_timeout,
        max_tokens_default=args.max_tokens,
        public_metrics=args.public_metrics,
        max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout,
        admin=getattr(args, "enable_admin", False),
    )
    server = _graceful_server_class()(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout + 5,
        )
    )
    server.on_exit = app.state.begin_drain
    server.run()
    drained = async_engine.drained or {"running": 0, "cut": 0}
    print(
        f"server stopped: {drained['running'] - drained['cut']} of {drained['running']} requests in flight "
        f"finished, {drained['cut']} cut off",
        file=sys.stderr,
        flush=True,
    )
    return 0


def plan_summary(planner, speculate: bool, batches, log=None) -> str:
    """The start-up line's account of speculation ("budget per batch size: B=1->3, ..."). Where the
    planned budgets turn speculation off at every batch size, one WARNING line (``log``, default
    the "sssd.serve" logger) says why, in the planner's own numbers, and how to override it."""
    import logging

    if not speculate:
        return "off"
    if planner.fixed is not None:
        return f"budget {planner.fixed}"
    rows = planner.table(tuple(dict.fromkeys(batches)))
    mode = "budget per batch size: " + ", ".join(f"B={r['batch']}->{r['budget']}" for r in rows)
    if any(r["budget"] for r in rows):
        return mode
    (log or logging.getLogger("sssd.serve").warning)(_why_off(planner, rows))
    return mode + " (off)"


def _why_off(planner, rows: list[dict]) -> str:
    """Why the planner's model chose no speculation at any batch size, in one line."""
    first = rows[0]
    B, rates = first["batch"], first["tokens_per_s"]
    drafted = {b: r for b, r in rates.items() if b > 0}
    why = "no budget's expected tokens per second beats plain decoding's"
    if drafted and planner.profile is not None:
        b = max(drafted, key=drafted.get)
        plain_ms, draft_ms = planner.profile.time(B, 1) * 1e3, planner.profile.time(B, b + 1) * 1e3
        model_ms = planner.draft_cost(B, planner.profile) * 1e3 if planner.draft_cost is not None else 0.0
        by_model = f" plus {model_ms:.1f} ms of the draft model's passes" if model_ms else ""
        why = (
            f"at batch size {B}, a step verifying budget {b}'s tree ({b + 1} tokens per row) costs "
            f"{draft_ms:.1f} ms{by_model} against {plain_ms:.1f} ms for one token, more than the "
            f"{planner.mat[b]:.2f} tokens per step it is expected to accept earn back ({drafted[b]:.1f} "
            f"against {rates[0]:.1f} tokens/s plain)"
        )
    meta = getattr(planner.profile, "meta", None) or {}
    share = (meta.get("conditions") or {}).get("other_processes_cpu_share")
    busy = ""
    if isinstance(share, (int, float)) and share > 0.1:
        busy = (
            f"; the forward profile was measured while other processes used {share:.0%} of the CPU, so the "
            f"costs may be inflated: `--reprofile` on a quiet machine measures it again"
        )
    return (
        f"speculation is off at every batch size: the planner expects no draft budget to pay on this "
        f"machine: {why}{busy}. To speculate anyway, give a fixed budget: `--budget N` (e.g. --budget 4); "
        f"`--no-speculate` serves plainly without this warning"
    )


def _graceful_server_class():
    import contextlib
    import signal
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, but SIGTERM/SIGINT drain the engine and end with exit status 0.

        On the first signal the engine stops admitting requests (503) and gives the
        running ones the drain timeout to finish; the rest end with an error event
        (streams) or 503 (the others), so every client gets a complete response and
        uvicorn never has to cancel a handler. uvicorn re-raises the signal after its
        graceful shutdown (so the process dies of it); a server that drained and
        stopped cleanly reports success instead.
        """

        on_exit = None

        def handle_exit(self, sig, frame):
            if self.on_exit is not None:
                self.on_exit()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


def __getattr__(name):
    if name == "GracefulServer":
        return _graceful_server_class()
    raise AttributeError(name)
