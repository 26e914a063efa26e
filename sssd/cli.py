"""The ``sssd`` command line: one entry point, one subcommand per job.

    sssd draft "text"        draft continuations for a prompt (default datastore)
    sssd info DATASTORE      a datastore's manifest and statistics

Later subcommands (build, calibrate, serve, ...) register here too.
"""

from __future__ import annotations

import argparse
import json
import os
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


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help as written (descriptions and epilogs keep their line breaks), each default stated once.

    An option's help gets "(default: X)" appended only when it does not already
    say its default (contains "(default" or "default:"), and only for a value
    worth stating: not for flags, and not when the default is None.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "(default" in text or "default:" in text:
            return text
        default = action.default
        if (
            default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or action.nargs == 0
            or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        ):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line ("sssd draft: error: argument --ids: ...") and exit
    1 like every other error, and whose help (and its subparsers') states each default once (HelpFormatter)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(1, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="sssd",
        description="SSSD: CPU speculative-decoding drafts from a suffix-array datastore and the request itself.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"sssd {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, setup, _) in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        sp.set_defaults(_run=setup(sp))
        if "--debug" not in sp._option_string_actions:
            sp.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


#: Errors a command expects (bad input, missing files, corrupt data): reported in one line.
_EXPECTED = (FileNotFoundError, FileExistsError, ValueError, TypeError, KeyError, OSError, RuntimeError, MemoryError)


def _message(e: BaseException) -> str:
    """One line saying what went wrong: the exception's message, with no "[Errno N]" noise."""
    if isinstance(e, KeyError) and e.args:
        text = str(e.args[0])
    elif isinstance(e, OSError) and type(e).__str__ is OSError.__str__ and e.strerror:
        where = f"{e.filename}: " if e.filename is not None else ""
        if e.filename2 is not None:
            where = f"{e.filename} -> {e.filename2}: "
        text = f"{where}{e.strerror}"
    elif isinstance(e, MemoryError):
        text = "out of memory" + (f" ({e})" if str(e) else "")
    else:
        text = str(e).strip() or type(e).__name__
    return " ".join(text.split("\n")[:1]) if isinstance(e, RecursionError) else text


def main(argv: list[str] | None = None) -> int:
    from sssd import commands  # noqa: F401  (registers the subcommands)

    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) or a bad argument (1, after its one-line message)
        return e.code if isinstance(e.code, int) else 1
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`sssd info | head -1`): not an error worth a message.
        try:  # so that the interpreter's last flush of stdout does not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except Exception as e:  # noqa: BLE001 - every error is one line unless --debug
        if getattr(args, "debug", False):
            raise
        where = f"sssd {args.command}: error: "
        if isinstance(e, _EXPECTED):
            print(where + _message(e), file=sys.stderr)
        else:  # a bug: still one line, and how to see more
            print(
                f"{where}internal error: {type(e).__name__}: {_message(e)} (rerun with --debug for the traceback)",
                file=sys.stderr,
            )
        return 1


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


if __name__ == "__main__":
    # Run through the imported module, where the subcommands register.
    from sssd.cli import main as _main

    sys.exit(_main())
