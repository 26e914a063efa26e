"""Validation of token-id inputs: any integer sequence in, uint32 numpy out.

Checks run vectorised in numpy (no per-token Python work), and every failure
names the argument and the first offending position.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from sssd import _core

MAX_TOKEN_ID: int = int(_core.MAX_TOKEN_ID)


def as_tokens(values: Any, name: str = "tokens", *, allow_empty: bool = True) -> np.ndarray:
    """Returns ``values`` as a 1-D integer numpy array of token ids, without copying
    numpy input. Range checks (ids in [0, MAX_TOKEN_ID]) happen in the native
    core when the array crosses the binding, so hot paths pay no numpy
    reductions here.

    Args:
        values: a list/tuple of ints, a numpy array of any integer dtype, or a
            1-D torch tensor (anything ``np.asarray`` accepts).
        name: the argument name used in error messages.
        allow_empty: if False, an empty input raises ValueError.

    Raises:
        TypeError: not a 1-D sequence of integers (floats, bools, strings...).
        ValueError: empty when not allowed.
    """
    if not (isinstance(values, np.ndarray) and values.dtype.kind in "iu" and values.ndim == 1):
        if hasattr(values, "detach") and hasattr(values, "cpu"):  # torch tensor
            values = values.detach().cpu().numpy()
        if isinstance(values, (str, bytes)):
            raise TypeError(f"{name}: expected a sequence of token ids, got {type(values).__name__}")
        values = np.asarray(values)
        if values.size == 0 and values.dtype.kind not in "iu":
            values = values.astype(np.int64)
        if values.dtype.kind not in "iu":
            raise TypeError(f"{name}: token ids must be integers, got dtype {values.dtype}")
        if values.ndim != 1:
            raise TypeError(f"{name}: expected a 1-D sequence of token ids, got shape {values.shape}")
    if not allow_empty and values.shape[0] == 0:
        raise ValueError(f"{name} is empty: drafting needs at least one token")
    return values


def pack_tokens(tokens: Sequence[Any], name: str = "tokens") -> tuple[np.ndarray, np.ndarray]:
    """One token list per request (each as ``as_tokens`` takes it) packed for one native call:
    (offsets [n + 1] int64, the tokens concatenated); request b's are flat[offsets[b]:offsets[b + 1]]."""
    parts = [as_tokens(t, f"{name}[{b}]") for b, t in enumerate(tokens)]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter((p.shape[0] for p in parts), dtype=np.int64, count=len(parts)), out=offsets[1:])
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return offsets, flat
