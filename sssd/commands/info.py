"""``sssd info DATASTORE``: a datastore's manifest and statistics."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sssd.cli import command


@command("info", help="Print a datastore's manifest and statistics.")
def setup(p: argparse.ArgumentParser):
    from sssd.commands import _args

    p.add_argument(
        "datastore",
        nargs="?",
        default="default",
        type=_args.datastore("default"),
        help="datastore directory, .sssd.zst archive, or 'default' (the default datastore)",
    )
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")

    def run(args: argparse.Namespace) -> int:
        from sssd import archive
        from sssd.drafter import resolve_datastore

        target = Path(args.datastore).expanduser()
        if args.datastore != "default" and target.is_file():
            m = archive.read_manifest(target)
            where, ds = target, None
        else:
            ds = resolve_datastore(_args.default_datastore() if args.datastore == "default" else args.datastore)
            m, where = ds.manifest, ds.path
        if args.json:
            print(json.dumps(m, indent=2))
            return 0
        _print(m, where, ds)
        return 0

    return run


def _print(m: dict, where, ds) -> None:
    from sssd.datastore import DATA_FILES

    files = m.get("files", {})
    num_tokens = ds.size if ds is not None else m.get("num_tokens", 0)
    index_bits = (ds.native.index_bytes if ds is not None else m.get("index_bytes", 4)) * 8
    print(f"datastore      {where}")
    if ds is None:
        print(
            f"archive        {Path(where).stat().st_size / 2**20:,.1f} MiB compressed "
            f"({Path(where).stat().st_size / max(num_tokens, 1):.2f} bytes/token); unpacked into the cache on first open"
        )
    print(f"format         v{m.get('format_version')}, {index_bits}-bit suffix indices, mmap")
    print(f"tokens         {num_tokens:,}")
    print(f"documents      {(ds.num_docs if ds is not None else m.get('num_docs', 0)):,}")
    tok = m.get("tokenizer") or {}
    vocab = tok.get("vocab_size") or m.get("vocab_size")
    print(f"vocab size     {vocab:,}" if isinstance(vocab, int) else f"vocab size     {vocab}")
    index_bytes = sum(files[n].get("bytes", 0) for n in DATA_FILES if n in files)
    total_bytes = sum(f.get("bytes", 0) for f in files.values())
    if total_bytes:
        print(
            f"size on disk   {total_bytes / 2**20:,.1f} MiB; index files {index_bytes / 2**20:,.1f} MiB "
            f"({index_bytes / max(num_tokens, 1):.2f} bytes/token)"
        )
    if tok:
        print(
            f"tokenizer      {tok.get('name')} (sha256 {str(tok.get('sha256'))[:16]}..., vocab {tok.get('vocab_size'):,})"
        )
        if tok.get("path"):
            print(f"               {tok['path']}")
    else:
        print("tokenizer      not recorded")
    sources = m.get("source")
    if isinstance(sources, dict):
        sources = [sources]
    for i, src in enumerate(sources or []):
        label = "sources" if i == 0 else ""
        if not isinstance(src, dict) or "records" not in src:
            print(f"{label:14s} {json.dumps(src)}")
            continue
        line = f"{src.get('kind')} {src.get('path')}: {src['records']:,} records, {src.get('documents', 0):,} documents"
        if src.get("heldout"):
            line += f", {src['heldout']:,} held out"
        if src.get("skipped"):
            reasons = "; ".join(f"{n:,} {r}" for r, n in (src.get("skipped_reasons") or {}).items())
            line += f"; skipped {src['skipped']:,} ({reasons})"
        if src.get("duplicates"):
            line += f"; {src['duplicates']:,} duplicates dropped"
        print(f"{label:14s} {line}")
    hold = m.get("holdout")
    if hold:
        print(f"held out       {hold.get('count', 0):,} records in {hold.get('file')}: {hold.get('rule')}")
    build = m.get("build")
    if isinstance(build, dict):
        params = {
            k: build[k]
            for k in (
                "roles",
                "format",
                "messages_field",
                "text_fields",
                "text_split",
                "dedup",
                "strict",
                "holdout_every",
            )
            if k in build and build[k] not in (None, [], "")
        }
        print(f"build          {', '.join(f'{k}={v}' for k, v in params.items())}")
        stages = build.get("stage_seconds") or {}
        if stages:
            print(
                f"stage seconds  {', '.join(f'{k} {v:.2f}' for k, v in stages.items())}; "
                f"total {m.get('build_seconds', sum(stages.values())):.2f}"
            )
        versions = build.get("versions")
        if versions:
            print(f"versions       {', '.join(f'{k} {v}' for k, v in versions.items())}")
    elif build is not None:
        print(f"build          {json.dumps(build)}")
    if files:
        print("files          " + ", ".join(f"{n} ({f.get('bytes', 0) / 2**20:,.1f} MiB)" for n, f in files.items()))
