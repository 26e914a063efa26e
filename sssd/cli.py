"""The ``sssd`` command line: one entry point, one subcommand per job.

    sssd draft "text"        draft continuations for a prompt (default datastore)
    sssd info DATASTORE      a datastore's manifest and statistics

Later subcommands (build, calibrate, serve, ...) register here too.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from sssd import __version__

# name -> (help, add_arguments(parser), run(args) -> exit code)
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str):
    """Registers a subcommand: decorate a function that adds its arguments and returns its runner."""

    def wrap(setup: Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]]):
        _COMMANDS[name] = (help, setup, None)  # type: ignore[assignment]
        return setup

    return wrap


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sssd",
        description="SSSD: CPU speculative-decoding drafts from a suffix-array datastore and the request itself.",
    )
    p.add_argument("--version", action="version", version=f"sssd {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, setup, _) in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        sp.set_defaults(_run=setup(sp))
    return p


def main(argv: list[str] | None = None) -> int:
    from sssd import commands  # noqa: F401  (registers the subcommands)

    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, FileExistsError, ValueError, TypeError, KeyError, OSError, RuntimeError) as e:
        # Clear one-line errors for expected failures; --debug shows the traceback.
        if getattr(args, "debug", False):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"sssd {args.command}: error: {msg}", file=sys.stderr)
        return 1


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


if __name__ == "__main__":
    # Run through the imported module, where the subcommands register.
    from sssd.cli import main as _main

    sys.exit(_main())
