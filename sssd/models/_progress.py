"""How the models package reports: one-line messages (a ``Log``, stderr by default) and progress bars."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _bar(progress: bool, **kwargs: Any):
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=not progress, dynamic_ncols=True, leave=False, **kwargs)
