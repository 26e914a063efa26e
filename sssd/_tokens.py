"""Validation of token-id inputs: any integer sequence in, uint32 numpy out.

Checks run vectorised in numpy (no per-token Python work), and every failure
names the argument and the first offending position.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sssd import _core

MAX_TOKEN_ID: int = int(_core.MAX_TOKEN_ID)


def as_tokens(values: Any, name: str = "tokens", *, allow_empty: bool = True) -> np.ndarray:
    """Returns ``values`` as a C-contiguous 1-D uint32 array of token ids.

    Args:
        values: a list/tuple of ints, a numpy array of any integer dtype, or a
            1-D torch tensor (anything ``np.asarray`` accepts).
        name: the argument name used in error messages.
        allow_empty: if False, an empty input raises ValueError.

    Raises:
        TypeError: not a 1-D sequence of integers (floats, bools, strings...).
        ValueError: empty (when not allowed), negative, or above MAX_TOKEN_ID.
    """
    if isinstance(values, np.ndarray) and values.dtype == np.uint32 and values.ndim == 1:
        arr = np.ascontiguousarray(values)
    else:
        if hasattr(values, "detach") and hasattr(values, "cpu"):  # torch tensor
            values = values.detach().cpu().numpy()
        if isinstance(values, (str, bytes)):
            raise TypeError(f"{name}: expected a sequence of token ids, got {type(values).__name__}")
        arr = np.asarray(values)
        if arr.size == 0 and arr.dtype.kind not in "iu":
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name}: token ids must be integers, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise TypeError(f"{name}: expected a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size:
            if arr.dtype.kind == "i" and int(arr.min()) < 0:
                i = int(np.argmax(arr < 0))
                raise ValueError(f"{name}[{i}] = {int(arr[i])} is negative; token ids are >= 0")
            if int(arr.max()) > MAX_TOKEN_ID:
                i = int(np.argmax(arr > MAX_TOKEN_ID))
                raise ValueError(
                    f"{name}[{i}] = {int(arr[i])} exceeds the largest token id {MAX_TOKEN_ID} "
                    f"({MAX_TOKEN_ID + 1} is reserved as the document separator)"
                )
        arr = np.ascontiguousarray(arr, dtype=np.uint32)
    if not allow_empty and arr.size == 0:
        raise ValueError(f"{name} is empty: drafting needs at least one token")
    return arr
