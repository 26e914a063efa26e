"""``sssd serve``: the OpenAI-compatible server (default model, datastore and calibration)."""

from __future__ import annotations

import argparse
import os
import sys

from sssd.cli import command


@command("serve", help="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions) with SSSD "
                       "speculation; with no arguments, the default model, datastore and calibration.")
def setup(p: argparse.ArgumentParser):
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="model name (`sssd models list`; pulled on first use) or a local Hugging Face model folder")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the model's name)")
    p.add_argument("--datastore", default="default",
                   help="datastore directory, 'default' (built on first use), or 'none' (draft from prompts only)")
    p.add_argument("--drafter", default="default",
                   help="drafter config or `sssd calibrate` parameter file ('default': the packaged calibration "
                        "for the default model when serving it, else the built-in defaults)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SSSD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SSSD_API_KEY; none: open)")
    p.add_argument("--max-running", type=int, default=32, help="requests decoded concurrently (KV slots)")
    p.add_argument("--max-model-len", type=int, default=2048, help="tokens per request (prompt + output)")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 429")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--budget", type=int, default=None, help="fixed draft budget (default: chosen per batch size)")
    p.add_argument("--no-speculate", action="store_true", help="serve without speculation (same engine)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cancelled (504)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: CUDA when available)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--debug", action="store_true", help="show tracebacks")

    def run(args: argparse.Namespace) -> int:
        import logging

        import uvicorn

        from sssd.serving.api_server import create_app

        GracefulServer = _graceful_server_class()
        from sssd.serving.async_engine import AsyncEngine
        from sssd.serving.engine import EngineConfig, LLMEngine

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        speculate = not args.no_speculate
        datastore = None if args.datastore == "none" else args.datastore
        if speculate and datastore == "default":
            from sssd.commands.draft import ensure_default_datastore

            ensure_default_datastore()
        drafter = args.drafter
        if drafter == "default":
            from sssd.paths import packaged_calibration

            drafter = packaged_calibration(args.model, args.datastore)
        config = EngineConfig(max_running=args.max_running, max_model_len=args.max_model_len, max_waiting=args.max_waiting,
                              speculate=speculate, budget=args.budget, dtype=args.dtype, device=args.device,
                              threads=args.threads)
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        engine = LLMEngine(args.model, datastore=datastore if speculate else None, drafter=drafter, config=config)
        name = args.served_model_name or os.path.basename(os.path.normpath(str(args.model)))
        planner = engine.planner
        if not speculate:
            mode = "off"
        elif planner.fixed is not None:
            mode = f"budget {planner.fixed}"
        else:
            rows = planner.table((1, 4, 16, args.max_running))
            mode = "budget per batch size: " + ", ".join(f"B={r['batch']}->{r['budget']}" for r in rows)
        print(f"serving {name} on http://{args.host}:{args.port}/v1 ({engine.runner.device}, {args.dtype}); "
              f"speculation: {mode}", file=sys.stderr, flush=True)
        app = create_app(AsyncEngine(engine), name, api_key=args.api_key, request_timeout=args.request_timeout,
                         max_tokens_default=args.max_tokens)
        GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                      timeout_graceful_shutdown=30)).run()
        print("server stopped", file=sys.stderr)
        return 0

    return run


def _graceful_server_class():
    import contextlib
    import signal
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, but SIGTERM/SIGINT end it with exit status 0.

        uvicorn re-raises the signal after its graceful shutdown (so the
        process dies of it); a server that drained its requests and stopped
        cleanly should report success instead.
        """

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

