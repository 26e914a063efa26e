"""Builds the long-context evaluation set: real text at about 2k, 4k and 8k tokens.

Two kinds of prompt, in the target model's chat template and tokens:

* sharegpt: long multi-turn ShareGPT conversations from the default datastore's held-out
  split (never in the datastore, so retrieval cannot have seen them): a conversation's turns
  up to a user turn, its longest prefix that fits; when no held-out conversation is that long,
  consecutive ones continue it as further turns of the same chat (marked `joined`). The
  reference answer is the assistant turn that follows.
* stdlib: Python source files of the standard library of this interpreter (stable, real code),
  cut at a line boundary to fit, followed by either a question about the file ("Explain what
  the function X does ...", X a function defined in the kept part) or "continue" (the raw code
  prefix, for the model to continue).

Each record is one JSON line: {"kind", "size", "tokens", "prompt_ids", "source", ...}; `size`
is the nominal context (2048, 4096, 8192), the prompt leaves `reserve` tokens of it for the
answer and a draft tree.

    .venv/bin/python benchmarks/long_context.py --model smollm2-135m-instruct --per-kind 4
"""

from __future__ import annotations

import argparse
import json
import re
import sysconfig
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "long_context.jsonl"
#: Stdlib modules long enough for an 8k-token prompt, in a fixed order (the set is reproducible).
STDLIB_FILES = (
    "argparse.py",
    "typing.py",
    "inspect.py",
    "tarfile.py",
    "subprocess.py",
    "pathlib.py",
    "dataclasses.py",
    "zipfile.py",
    "logging/__init__.py",
    "json/decoder.py",
    "ast.py",
    "enum.py",
)


def _heldout(datastore: str) -> list[list[dict]]:
    from sssd.drafter import resolve_datastore

    ds = resolve_datastore(datastore)
    path = Path(ds.path) / "heldout.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build the default datastore with `sssd build --default`")
    convs = []
    for line in path.read_text().splitlines():
        c = json.loads(line)
        turns = [
            {
                "role": "assistant" if t.get("assistant") or t.get("role") in ("gpt", "assistant") else "user",
                "content": t.get("text") or t.get("value") or "",
            }
            for t in (c.get("turns") or [])
        ]
        turns = [t for t in turns if t["content"].strip()]
        if len(turns) >= 2:
            convs.append(turns)
    return convs


def _chat(tok, messages: list[dict]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def sharegpt_prompts(tok, convs: list[list[dict]], length: int, count: int) -> list[dict]:
    """Up to `count` chats of at most `length` tokens ending at a user turn, longest conversations first."""
    order = sorted(range(len(convs)), key=lambda i: -sum(len(t["content"]) for t in convs[i]))
    out = []
    for start in order:
        if len(out) >= count:
            break
        messages: list[dict] = []
        best, joined = None, 0
        for k in range(64):
            conv = convs[(start + k) % len(convs)]
            for i, turn in enumerate(conv[:-1]):
                if turn["role"] != "user":
                    continue
                ids = _chat(tok, messages + conv[: i + 1])
                if len(ids) > length:
                    break
                best = (messages + conv[: i + 1], ids, conv[i + 1]["content"], k)
            if best is not None and len(best[1]) >= 0.85 * length:
                break
            if len(_chat(tok, messages + conv)) > length:
                break
            messages = messages + conv
        if best is None or len(best[1]) < 0.85 * length:
            continue
        trial, ids, answer, joined = best
        out.append(
            {
                "kind": "sharegpt",
                "tokens": len(ids),
                "prompt_ids": ids,
                "turns": len(trial),
                "joined": joined,
                "source": f"heldout#{start}",
                "answer": answer,
            }
        )
    return out


def stdlib_prompts(tok, length: int, count: int) -> list[dict]:
    """Stdlib files cut to fit `length` tokens: a question about a kept function, or "continue"."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for n, name in enumerate(STDLIB_FILES):
        if len(out) >= count:
            break
        path = lib / name
        if not path.is_file():
            continue
        lines = path.read_text().splitlines(keepends=True)
        mode = "continue" if n % 2 else "question"
        # the longest line prefix that fits, by bisection on the line count
        lo, hi = 1, len(lines)
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            code = "".join(lines[:mid])
            if mode == "continue":
                ids = list(tok(code)["input_ids"])
                ask = None
            else:
                funcs = re.findall(r"^\s*def (\w+)\(", code, flags=re.M)
                ask = funcs[len(funcs) // 2] if funcs else None
                q = (
                    f"Here is the Python module {name} (part of it):\n\n```python\n{code}```\n\n"
                    f"Explain what the function `{ask}` does and how it is used in this module."
                )
                ids = _chat(tok, [{"role": "user", "content": q}])
            if len(ids) <= length:
                best, lo = (ids, ask, mid), mid + 1
            else:
                hi = mid - 1
        if best is None or len(best[0]) < 0.85 * length:
            continue
        ids, ask, kept = best
        out.append(
            {
                "kind": "stdlib",
                "mode": mode,
                "tokens": len(ids),
                "prompt_ids": ids,
                "source": name,
                "lines": kept,
                **({"function": ask} if ask else {}),
            }
        )
    return out


def build(model: str, sizes: list[int], per_kind: int, reserve: int, datastore: str = "default") -> list[dict]:
    from transformers import AutoTokenizer

    from sssd.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(model), local_files_only=True)
    convs = _heldout(datastore)
    records = []
    for size in sizes:
        length = size - reserve
        got = sharegpt_prompts(tok, convs, length, per_kind) + stdlib_prompts(tok, length, per_kind)
        for r in got:
            r["size"] = size
        records += got
    return records


def load(path: Path | str = DEFAULT_OUT, size: int | None = None, kind: str | None = None) -> list[dict]:
    """The set's records (of one size / kind)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} not found: build it with `python benchmarks/long_context.py`")
    recs = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [r for r in recs if (size is None or r["size"] == size) and (kind is None or r["kind"] == kind)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer and chat template")
    p.add_argument("--sizes", default="2048,4096,8192", help="nominal contexts, comma-separated")
    p.add_argument("--per-kind", type=int, default=4, help="prompts per kind and size")
    p.add_argument("--reserve", type=int, default=256, help="tokens of each context left for the answer and a tree")
    p.add_argument("--datastore", default="default", help="whose held-out ShareGPT split")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    if any(s <= a.reserve for s in sizes):
        raise SystemExit(f"every size must exceed --reserve ({a.reserve})")
    recs = build(a.model, sizes, a.per_kind, a.reserve, a.datastore)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    for size in sizes:
        for kind in ("sharegpt", "stdlib"):
            rs = [r for r in recs if r["size"] == size and r["kind"] == kind]
            if rs:
                mean = int(np.mean([r["tokens"] for r in rs]))
                print(f"{size:>6} {kind:<9} {len(rs)} prompts, {mean} tokens on average")
    print(f"wrote {len(recs)} prompts to {a.out}")


if __name__ == "__main__":
    main()
