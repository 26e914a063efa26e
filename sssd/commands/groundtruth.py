"""``sssd groundtruth``: greedy target outputs for a prompt set (or recorded answers), for replay."""

from __future__ import annotations

import argparse
import json
import sys

from sssd.cli import command

EPILOG = """\
examples:
  sssd groundtruth --dataset mtbench
  sssd groundtruth --dataset gsm8k --limit 200 --threads 1
  sssd groundtruth --dataset humaneval --model qwen2.5-coder-1.5b-instruct
  sssd groundtruth --dataset sharegpt-heldout            (recorded answers; no generation)
  sssd groundtruth --dataset code-edits --recorded        (the reference edits as the outputs)
  sssd groundtruth --prompts my_prompts.jsonl --model ./my-hf-model -o out.jsonl

Output: <sssd cache>/groundtruth/<model>/<dataset>.jsonl unless -o is given. Rerunning
resumes: prompts already in the file are skipped.
"""


@command(
    "groundtruth",
    help="Generate greedy ground truth with a target model for a prompt set (chat template, "
    "batched, resumable), or record the ShareGPT held-out answers; JSONL for replay.",
)
def setup(p: argparse.ArgumentParser):
    from sssd.calibration.datasets import DATASETS
    from sssd.commands import _args
    from sssd.models import DEFAULT_MODEL, DTYPES

    p.epilog = EPILOG
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", choices=DATASETS, help="a packaged prompt set")
    src.add_argument(
        "--prompts",
        metavar="FILE",
        type=_args.regular_file,
        help='your own prompts: JSONL with "id" and "messages" (chat) or "prompt" (text)',
    )
    p.add_argument(
        "-m",
        "--model",
        default=DEFAULT_MODEL,
        type=_args.model,
        help="a registered model name (pulled on first use) or a local Hugging Face model folder",
    )
    p.add_argument(
        "-o",
        "--output",
        type=_args.output_file,
        help="the JSONL file (default: <sssd cache>/groundtruth/<model>/<dataset>.jsonl)",
    )
    p.add_argument(
        "--limit", type=_args.int_range(1), default=None, metavar="N", help="only the first N prompts of the set"
    )
    p.add_argument(
        "--split",
        choices=("dev", "eval"),
        default=None,
        help="only the prompts of one side of the deterministic dev/eval partition (before --limit): "
        "calibrate on dev, report on eval (default: every prompt)",
    )
    p.add_argument("--max-new-tokens", type=_args.int_range(1), default=256, help="output cap per prompt")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="model dtype (float32: outputs equal any exact float32 greedy decoder's)",
    )
    p.add_argument(
        "--threads", type=_args.int_range(1, 4096), default=None, help="torch threads (default: torch's choice)"
    )
    p.add_argument(
        "--engine",
        choices=("sssd", "transformers"),
        default="sssd",
        help="sssd: SSSD's batched speculative engine (float32 output is token-identical to plain greedy, "
        "and faster); transformers: plain greedy decoding, one prompt at a time",
    )
    p.add_argument(
        "--batch-size", type=_args.int_range(1, 4096), default=16, help="prompts decoded together (--engine sssd)"
    )
    p.add_argument(
        "--max-model-len",
        type=_args.int_range(64),
        default=None,
        help="tokens per request in the sssd engine (prompt, output and a draft tree; the model's context "
        "caps it) (default: the longest prompt plus --max-new-tokens, at least 2048)",
    )
    p.add_argument(
        "--both-turns", action="store_true", help="mtbench: also the second turns (after the model's own first answers)"
    )
    p.add_argument(
        "--datastore",
        default="default",
        type=_args.datastore("default"),
        help="sharegpt-heldout: the datastore whose held-out split to use (and check contamination against)",
    )
    p.add_argument(
        "--turns",
        choices=("first", "all"),
        default="first",
        help="sharegpt-heldout: the first assistant turn of each conversation, or every one",
    )
    p.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="prompt with the plain text (base models without a chat template)",
    )
    p.add_argument(
        "--recorded",
        action="store_true",
        help="write each prompt's reference answer as its output instead of generating (always so for "
        "sharegpt-heldout; the copy-heavy sets' references stand for a capable model's answers)",
    )
    p.add_argument("--overwrite", action="store_true", help="start the file over instead of resuming it")
    p.add_argument(
        "--contamination",
        action="store_true",
        help="afterwards, measure how much of each output occurs verbatim in --datastore (always on for "
        "sharegpt-heldout) and write <output>.contamination.json",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")

    def run(args: argparse.Namespace) -> int:
        from sssd.calibration import datasets, ground_truth
        from sssd.commands._generate import generate

        log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        limit = None if args.split else args.limit  # a split first, then the limit
        if args.prompts:
            records = datasets.from_jsonl(args.prompts)
            records = records[:limit] if limit is not None else records
            name = records[0].dataset if records else args.prompts
        else:
            name = args.dataset
            records = datasets.load(
                name, limit=limit, both_turns=args.both_turns, datastore=args.datastore, turns=args.turns
            )
        if args.split:
            records = datasets.split(records, args.split)
            records = records[: args.limit] if args.limit is not None else records
        if not records:
            raise ValueError(f"empty prompt set {name!r}: nothing to do")
        common = dict(
            dataset=name, chat_template=args.chat_template, overwrite=args.overwrite, progress=not args.quiet, log=log
        )
        if name == "sharegpt-heldout" or args.recorded:
            summary = ground_truth.record(args.model, records, args.output, **common)
        else:
            summary = generate(
                args.model,
                records,
                args.output,
                max_new_tokens=args.max_new_tokens,
                dtype=args.dtype,
                threads=args.threads,
                engine=args.engine,
                batch_size=args.batch_size,
                max_model_len=args.max_model_len,
                **common,
            )
        out = summary.to_dict()
        if args.contamination or name == "sharegpt-heldout":
            try:
                report, sidecar = ground_truth.write_contamination(summary.path, args.datastore)
            except ValueError as e:
                if args.contamination:
                    raise
                log(f"no contamination check: {e}")  # e.g. another model's tokenizer than the datastore's
            else:
                out["contamination"] = report.summary()
                out["contamination_file"] = str(sidecar)
        print(json.dumps(out, indent=2))
        return 0

    return run
