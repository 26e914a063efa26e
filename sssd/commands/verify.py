"""``sssd verify DATASTORE``: recompute every file's sha256 and check the headers."""

from __future__ import annotations

import argparse
from pathlib import Path

from sssd.cli import command


@command("verify", help="Check a datastore's files against the sha256 checksums in its manifest, and its headers.")
def setup(p: argparse.ArgumentParser):
    p.add_argument("datastore", nargs="?", default="default",
                   help="datastore directory, .sssd.zst archive, or 'default'")
    p.add_argument("--debug", action="store_true", help="show tracebacks")

    def run(args: argparse.Namespace) -> int:
        from sssd.datastore import Datastore, DatastoreError, read_manifest
        from sssd.datastore_builder import archive
        from sssd.drafter import default_datastore_path

        path = default_datastore_path() if args.datastore == "default" else Path(args.datastore).expanduser()
        if path.is_file():
            results = archive.verify(path)
        else:
            manifest = read_manifest(path)
            files = manifest.get("files") or {}
            if not files:
                raise DatastoreError(f"{path}: the manifest lists no files to check")
            results = {name: _check_file(path / name, info) for name, info in files.items()}
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


def _check_file(path: Path, info: dict) -> str:
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if "bytes" in info and size != info["bytes"]:
        return f"size {size:,} bytes, the manifest says {info['bytes']:,}"
    from sssd.files import file_sha256

    if file_sha256(path) != info.get("sha256"):
        return "checksum mismatch (the file was modified or corrupted)"
    return "OK"
