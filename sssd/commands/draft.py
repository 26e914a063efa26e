"""``sssd draft``: draft a token tree for a prompt and print its branches."""

from __future__ import annotations

import argparse
import time

from sssd.cli import command


@command("draft", help="Draft continuations of a text (or token ids) from the datastore and the text itself.")
def setup(p: argparse.ArgumentParser):
    p.add_argument("text", nargs="?", help="the context to continue (tokenized with the datastore's tokenizer)")
    p.add_argument("--ids", help="comma-separated token ids instead of text")
    p.add_argument("--datastore", default="default", help="datastore directory, 'default', or 'none' (input source only)")
    p.add_argument("--tokenizer", help="tokenizer.json / model folder / GGUF (default: the one the datastore was built with)")
    p.add_argument("--budget", type=int, default=32, help="draft tree size (candidate tokens)")
    p.add_argument("--config", help="drafter config JSON (e.g. from sssd calibrate)")
    p.add_argument("--paths", type=int, default=12, help="branches to print")
    p.add_argument("--json", action="store_true", help="print the tree's arrays as JSON")

    def run(args: argparse.Namespace) -> int:
        import numpy as np

        from sssd.cli import print_json
        from sssd.config import DrafterConfig
        from sssd.drafter import Drafter

        if (args.text is None) == (args.ids is None):
            raise ValueError("give either TEXT or --ids")
        config = DrafterConfig.load(args.config) if args.config else DrafterConfig()
        drafter = Drafter(None if args.datastore == "none" else args.datastore, config, budget=args.budget)
        decode = None
        if args.ids is not None:
            ids = [int(x) for x in args.ids.replace(" ", "").split(",") if x]
        else:
            from sssd.tokenizer import load_tokenizer

            spec = args.tokenizer or (drafter.datastore.manifest.get("tokenizer", {}).get("path") if drafter.datastore else None)
            if not spec:
                raise ValueError("this datastore records no tokenizer; pass --tokenizer or use --ids")
            tok = load_tokenizer(spec)
            ids = tok.encode(args.text)
            decode = tok.decode
        t0 = time.perf_counter()
        tree = drafter.draft_prefix(np.asarray(ids), args.budget)
        ms = (time.perf_counter() - t0) * 1e3
        if args.json:
            print_json({k: getattr(tree, k).tolist() for k in ("tokens", "parents", "depths", "scores", "sources")})
            return 0
        counts = tree.source_counts()
        print(f"context: {len(ids)} tokens; draft: {len(tree)} nodes, depth {tree.max_depth}, "
              f"{counts['datastore']} from the datastore, {counts['input']} from the input ({ms:.2f} ms)")
        chain = tree.chain_tokens().tolist()
        if chain:
            print(f"best chain: {decode(chain)!r}" if decode else f"best chain: {chain}")
        print(tree.format(decode, args.paths))
        return 0

    return run
