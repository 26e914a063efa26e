"""``sssd build``: build a datastore from corpora (or the default one with --default)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sssd.cli import command

EPILOG = """\
examples:
  sssd build --default
  sssd build chats.json -o ds --tokenizer model/tokenizer.json --roles assistant
  sssd build data.jsonl --text-field prompt,response -o ds -t model/
  sssd build notes.md --text-split paragraph -o ds -t smollm2-135m-instruct
  sssd build shards/*.parquet --messages-field messages -o ds -t model.gguf --compress
  cat notes.txt | sssd build - --text-split paragraph -o ds -t tokenizer.json
"""


@command(
    "build",
    help="Build a datastore (token stream + suffix array + manifest) from ShareGPT/JSON, JSONL, "
    "Parquet, Arrow or text corpora, or the default datastore with --default.",
)
def setup(p: argparse.ArgumentParser):
    from sssd.commands import _args
    from sssd.datastore_builder.default import HELP as DEFAULT_HELP
    from sssd.datastore_builder.readers import FORMATS, MAX_RECORD_BYTES, TEXT_SPLITS
    from sssd.datastore_builder.sharegpt import ROLE_CHOICES
    from sssd.datastore_builder.tokenize import BATCH_DOCS

    p.epilog = EPILOG
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        type=_args.non_empty("input"),
        help="corpus files, directories (searched recursively), glob patterns, or - for stdin",
    )
    p.add_argument(
        "-o",
        "--output",
        type=_args.folder(output=True),
        help="the datastore directory to create (default with --default: the default datastore's place)",
    )
    p.add_argument(
        "-t",
        "--tokenizer",
        type=_args.tokenizer,
        help="a tokenizer.json, a local Hugging Face model folder, a .gguf file, or a registered model "
        "name (`sssd models list`; its tokenizer, the model pulled on first use as for --model)",
    )
    p.add_argument("--default", action="store_true", help=DEFAULT_HELP)
    p.add_argument(
        "--format",
        choices=("auto", *FORMATS),
        default="auto",
        help="input format (default: from the extension, else the content)",
    )
    p.add_argument(
        "--text-field",
        action="append",
        metavar="NAME",
        help="record field(s) holding text, each a document (repeat or comma-separate; default: text)",
    )
    p.add_argument(
        "--messages-field",
        metavar="NAME",
        type=_args.non_empty("field name"),
        help="record field holding a chat message list (default: conversations or messages)",
    )
    p.add_argument(
        "--roles", choices=ROLE_CHOICES, default="all", help="which chat turns become documents (default: all)"
    )
    p.add_argument(
        "--text-split",
        choices=TEXT_SPLITS,
        default="file",
        help="plain text: one document per file, paragraph or line (default: file)",
    )
    p.add_argument(
        "--holdout-every",
        type=_args.int_range(0),
        default=0,
        metavar="N",
        help="hold out records whose index %% N == 0 into heldout.jsonl (default: 0, none)",
    )
    p.add_argument("--dedup", action="store_true", help="drop exact-duplicate documents")
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail on the first bad record (malformed, too large, invalid text) instead of skipping and counting it",
    )
    p.add_argument(
        "--max-record-mib",
        type=_args.float_range(0.0, 1024.0, lo_open=True),
        metavar="MIB",
        default=MAX_RECORD_BYTES / 2**20,
        help="skip any record (JSON value or line, text file, paragraph or line) larger than this many "
        f"MiB: tokenizing takes about 200 bytes of memory per character (default: {MAX_RECORD_BYTES >> 20:g})",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing datastore at the output")
    p.add_argument(
        "--compress",
        action="store_true",
        help="also write OUTPUT.sssd.zst, a zstd-compressed single-file archive (sssd opens it directly)",
    )
    p.add_argument(
        "--threads",
        type=_args.int_range(0, 4096),
        default=0,
        help="threads for the suffix sort (default: 0, all cores)",
    )
    p.add_argument("--batch-docs", type=_args.int_range(1), default=BATCH_DOCS, help="documents per tokenizer batch")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or notices; only the summary")
    p.add_argument("--debug", action="store_true", help="show tracebacks")

    def run(args: argparse.Namespace) -> int:
        from sssd.datastore_builder.build import BuildConfig, build_datastore, terminate_as_interrupt
        from sssd.datastore_builder.readers import Fields

        text_fields = tuple(f.strip() for spec in args.text_field or [] for f in spec.split(",") if f.strip())
        if args.text_field and not text_fields:
            raise ValueError("argument --text-field: no field name given")
        if text_fields and args.messages_field:
            raise ValueError("arguments --text-field and --messages-field: give one or the other, not both")
        fields = Fields(
            text_fields=text_fields,
            messages_field=args.messages_field,
            text_split=args.text_split,
            roles=args.roles,
            max_record_bytes=max(1, int(args.max_record_mib * 2**20)),
        )
        log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        if args.default:
            if args.inputs or args.tokenizer:
                raise ValueError(
                    "--default builds from the packaged corpus with the default tokenizer; "
                    "give no INPUT or --tokenizer with it"
                )
            from sssd.datastore_builder.default import default_config

            cfg = default_config(
                args.output,
                overwrite=args.overwrite,
                compress=args.compress,
                dedup=args.dedup,
                strict=args.strict,
                num_threads=args.threads,
                batch_docs=args.batch_docs,
                progress=not args.quiet,
                log=log,
            )
            cfg.fields = Fields(
                messages_field=cfg.fields.messages_field,
                roles=cfg.fields.roles,
                max_record_bytes=fields.max_record_bytes,
            )
        else:
            if not args.inputs:
                raise ValueError("no inputs: give corpus files, directories or - (or --default)")
            if not args.output:
                raise ValueError("give the datastore directory to create with -o/--output")
            if not args.tokenizer:
                raise ValueError(
                    "give the tokenizer with -t/--tokenizer (tokenizer.json, model folder, .gguf or a registered model)"
                )
            tokenizer = args.tokenizer
            if not Path(tokenizer).expanduser().exists():  # a registered model name (checked as parsed)
                from sssd.models import resolve_model

                tokenizer = str(resolve_model(tokenizer, log=log))  # its folder, pulled on first use
            cfg = BuildConfig(
                inputs=args.inputs,
                output=args.output,
                tokenizer=tokenizer,
                format=args.format,
                fields=fields,
                holdout_every=args.holdout_every,
                dedup=args.dedup,
                strict=args.strict,
                overwrite=args.overwrite,
                compress=args.compress,
                num_threads=args.threads,
                batch_docs=args.batch_docs,
                progress=not args.quiet,
                log=log,
            )
        with terminate_as_interrupt():
            result = build_datastore(cfg)
        print(result.summary())
        return 0

    return run
