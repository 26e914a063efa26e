"""``sssd info DATASTORE``: a datastore's manifest and statistics."""

from __future__ import annotations

import argparse
import json

from sssd.cli import command


@command("info", help="Print a datastore's manifest and statistics.")
def setup(p: argparse.ArgumentParser):
    p.add_argument("datastore", nargs="?", default="default", help="datastore directory ('default': the default datastore)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")

    def run(args: argparse.Namespace) -> int:
        from sssd.drafter import resolve_datastore

        ds = resolve_datastore(args.datastore)
        if args.json:
            print(json.dumps(ds.manifest, indent=2))
            return 0
        m = ds.manifest
        data_bytes = sum(f.get("bytes", 0) for f in m.get("files", {}).values())
        print(f"datastore      {ds.path}")
        print(f"format         v{m.get('format_version')}, {ds.native.index_bytes * 8}-bit suffix indices, mmap")
        print(f"tokens         {ds.size:,}")
        print(f"documents      {ds.num_docs:,}")
        print(f"vocab size     {ds.vocab_size:,}")
        if data_bytes:
            print(f"size on disk   {data_bytes / 2**20:,.1f} MiB ({data_bytes / max(ds.size, 1):.2f} bytes/token)")
        tok = m.get("tokenizer")
        if tok:
            print(f"tokenizer      {tok.get('name')} (sha256 {str(tok.get('sha256'))[:16]}..., vocab {tok.get('vocab_size'):,})")
        for key in ("source", "build"):
            if key in m:
                print(f"{key:14s} {json.dumps(m[key])}")
        return 0

    return run
