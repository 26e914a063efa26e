"""What the copy source costs a request: opening a long prompt, memory per token, an appended token.

For prompts of 2k, 8k and 32k tokens (real text: the copy-heavy sets' prompts and the datastore's
documents, concatenated; and one token repeated, the worst case for a repeat structure), it times
`Drafter.open` with the copy source on and off (the request's n-gram trie is built either way),
reads `request_memory`, and times `extend` by one token and a budget-64 draft afterwards. Beside
it: one forward pass of SmolLM2 at one token (the goal: opening stays under it), when the model
is pulled.

Usage:
  python benchmarks/bench_copy_open.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Recorder  # noqa: E402

import sssd  # noqa: E402


def median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def forward_ms() -> float | None:
    """One SmolLM2 forward pass at one token (median of 10), if the model is pulled."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from sssd.models import resolve_model

        folder = resolve_model("smollm2-135m-instruct", pull_missing=False)
    except Exception:  # noqa: BLE001 - the comparison is optional
        return None
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past = out.past_key_values
        step = torch.tensor([[4]])
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            model(step, past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> int:
    from sssd.drafter import resolve_datastore

    ds = resolve_datastore("default")
    text = np.asarray(ds.tokens[:200_000], dtype=np.int64)
    text = text[text != sssd.SEPARATOR]
    rec = Recorder("copy_open", {"sizes": [2048, 8192, 32768]})
    fwd = forward_ms()
    print(f"SmolLM2 forward pass at one token: {fwd:.1f} ms" if fwd else "SmolLM2 not pulled: no forward-pass figure")
    print(
        f"{'prompt':>22} {'open ms (copy)':>15} {'open ms (no copy)':>18} {'bytes/token':>12} {'extend us':>10} "
        f"{'draft64 us':>11}"
    )
    for n in (2048, 8192, 32768):
        for kind, prompt in (("text", text[:n]), ("one token repeated", np.full(n, 7, dtype=np.int64))):
            row = {"tokens": n, "kind": kind}
            for label, cfg in (("copy", sssd.DrafterConfig()), ("no copy", sssd.DrafterConfig(copy_max_branch_len=0))):
                d = sssd.Drafter(ds, cfg)

                def open_close():
                    d.open(0, prompt)
                    d.close(0)

                row[f"open_ms_{label}"] = round(median_seconds(open_close) * 1e3, 2)
                if label == "copy":
                    d.open(0, prompt)
                    row["bytes_per_token"] = round(d.request_memory(0) / n, 1)
                    extra = iter(np.asarray(text[n : n + 1000]).tolist())
                    row["extend_us"] = round(median_seconds(lambda: d.extend(0, [next(extra)]), 50) * 1e6, 1)
                    row["draft64_us"] = round(median_seconds(lambda: d.draft([0], 64), 20) * 1e6, 1)
                    d.close(0)
            rec.add(forward_ms=fwd, **row)
            print(
                f"{n:>8} {kind:>13} {row['open_ms_copy']:>15.2f} {row['open_ms_no copy']:>18.2f} "
                f"{row['bytes_per_token']:>12.1f} {row['extend_us']:>10.1f} {row['draft64_us']:>11.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
