"""``sssd verify DATASTORE``: recompute every file's sha256, check the tokenizer and the headers."""

from __future__ import annotations

import argparse
from pathlib import Path

from sssd.cli import command


@command(
    "verify",
    help="Check a datastore's files against the sha256 checksums in its manifest, its tokenizer "
    "against the identity the manifest records, and its headers.",
)
def setup(p: argparse.ArgumentParser):
    from sssd.commands import _args

    p.add_argument(
        "datastore",
        nargs="?",
        default="default",
        type=_args.datastore("default"),
        help="datastore directory, .sssd.zst archive, or 'default' (the default datastore)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")

    def run(args: argparse.Namespace) -> int:
        from sssd import archive
        from sssd.datastore import Datastore, DatastoreError, read_manifest

        path = _args.default_datastore() if args.datastore == "default" else Path(args.datastore).expanduser()
        if path.is_file():
            results = archive.verify(path)
        else:
            manifest = read_manifest(path)  # refuses entries that are not plain names inside the folder
            files = manifest.get("files") or {}
            if not files:
                raise DatastoreError(f"{path}: the manifest lists no files to check")
            results = {name: _check_file(path, name, info) for name, info in files.items()}
            tokenizer = _check_tokenizer(path, manifest)
            if tokenizer is not None:
                results["tokenizer identity"] = tokenizer
            try:
                Datastore.open(path)
                results["headers"] = "OK"
            except DatastoreError as e:
                results["headers"] = str(e)
        width = max(map(len, results))
        for name, outcome in results.items():
            print(f"{name:<{width}}  {'OK' if outcome == 'OK' else 'FAILED: ' + outcome}")
        bad = [name for name, outcome in results.items() if outcome != "OK"]
        if bad:
            raise DatastoreError(f"{path}: {len(bad)} of {len(results)} checks failed: {', '.join(bad)}")
        print(f"{path}: all {len(results)} checks passed")
        return 0

    return run


def _check_file(folder: Path, name: str, info: dict) -> str:
    """ "OK" or what is wrong with one file the manifest lists (never blocks, never leaves the folder)."""
    from sssd.files import NotRegularFileError, check_regular, file_inside, file_sha256

    try:
        path = file_inside(folder, name)
        size = check_regular(path).st_size
        if "bytes" in info and size != info["bytes"]:
            return f"size {size:,} bytes, the manifest says {info['bytes']:,}"
        if file_sha256(path) != info.get("sha256"):
            return "checksum mismatch (the file was modified or corrupted)"
    except FileNotFoundError:
        return "missing"
    except NotRegularFileError as e:
        return e.strerror  # "it is a FIFO, not a regular file"
    except ValueError as e:  # a symbolic link out of the folder
        return str(e)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return "OK"


def _check_tokenizer(folder: Path, manifest: dict) -> str | None:
    """ "OK" if the tokenizer file inside the datastore is the tokenizer its manifest
    records (sha256 identity and vocabulary), else why not; None if it records none."""
    from sssd.errors import DatastoreError
    from sssd.manifest import tokenizer_file, tokenizer_mismatch
    from sssd.tokenizer import load_tokenizer

    try:
        path = tokenizer_file(folder, manifest)
        if path is None:
            return None
        tok = load_tokenizer(path)
    except (DatastoreError, ValueError, OSError) as e:
        return str(e)
    return tokenizer_mismatch(manifest.get("tokenizer") or {}, tok) or "OK"
