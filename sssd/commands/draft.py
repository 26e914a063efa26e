"""``sssd draft``: draft a token tree for a prompt and print its branches."""

from __future__ import annotations

import argparse
import time

from sssd.cli import command


def ensure_default_datastore() -> None:
    """Builds the default datastore the first time it is needed (about a minute)."""
    from sssd.datastore_builder.default import ensure_built

    ensure_built()


@command("draft", help="Draft continuations of a text (or token ids) from the datastore and the text itself.")
def setup(p: argparse.ArgumentParser):
    from sssd import _core
    from sssd.commands import _args

    p.add_argument(
        "text",
        nargs="?",
        type=_args.non_empty("text"),
        help="the context to continue (tokenized with the datastore's tokenizer)",
    )
    p.add_argument("--ids", type=_args.token_ids, metavar="IDS", help="comma-separated token ids instead of text")
    p.add_argument(
        "--datastore",
        default="default",
        type=_args.datastore("default", "none"),
        help="datastore directory or .sssd.zst archive, 'default' (built on first use), or 'none' (input source only)",
    )
    p.add_argument(
        "--tokenizer",
        type=_args.file_or_folder,
        help="tokenizer.json / model folder / GGUF (default: the one the datastore was built with)",
    )
    p.add_argument(
        "--budget",
        type=_args.int_range(1, int(_core.MAX_BUDGET)),
        default=32,
        help="draft tree size (candidate tokens)",
    )
    p.add_argument("--config", type=_args.regular_file, help="drafter config JSON (e.g. from sssd calibrate)")
    p.add_argument("--paths", type=_args.int_range(1), default=12, help="branches to print")
    p.add_argument("--json", action="store_true", help="print the tree's arrays as JSON")

    def run(args: argparse.Namespace) -> int:
        import numpy as np

        from sssd.cli import print_json
        from sssd.config import DrafterConfig
        from sssd.drafter import Drafter, resolve_datastore

        if (args.text is None) == (args.ids is None):
            raise ValueError("give either TEXT or --ids (not both)" if args.text is not None else "give TEXT or --ids")
        if args.datastore == "none" and args.ids is None and not args.tokenizer:
            raise ValueError("--datastore none has no tokenizer to read TEXT with: pass --tokenizer or use --ids")
        config = DrafterConfig.load(args.config) if args.config else DrafterConfig()  # light; before building anything
        if args.datastore == "default":
            ensure_default_datastore()
        datastore = None if args.datastore == "none" else resolve_datastore(args.datastore)
        decode = tok = None
        if args.ids is None:
            from sssd.tokenizer import load_tokenizer

            if args.tokenizer:
                tok = load_tokenizer(args.tokenizer)
            else:
                tok = datastore.load_tokenizer()  # checked against the identity its manifest records
                if tok is None:
                    raise ValueError("this datastore records no tokenizer; pass --tokenizer or use --ids")
        drafter = Drafter(datastore, config, tokenizer=tok, budget=args.budget)
        if args.ids is not None:
            ids = args.ids
        else:
            ids = tok.encode(args.text)
            decode = tok.decode
            if not ids:
                raise ValueError(f"TEXT {args.text!r} gives no tokens to continue")
        t0 = time.perf_counter()
        tree = drafter.draft_prefix(np.asarray(ids), args.budget)
        ms = (time.perf_counter() - t0) * 1e3
        if args.json:
            print_json({k: getattr(tree, k).tolist() for k in ("tokens", "parents", "depths", "scores", "sources")})
            return 0
        counts = tree.source_counts()
        print(
            f"context: {len(ids)} tokens; draft: {len(tree)} nodes, depth {tree.max_depth}, "
            f"{counts['datastore']} from the datastore, {counts['input']} from the input ({ms:.2f} ms)"
        )
        chain = tree.chain_tokens().tolist()
        if chain:
            print(f"best chain: {decode(chain)!r}" if decode else f"best chain: {chain}")
        print(tree.format(decode, args.paths))
        return 0

    return run
