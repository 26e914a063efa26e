"""Which device the verifier runs on, checked before anything is loaded onto it.

`resolve` turns a device name ("cpu", "cuda", "cuda:1", None) into a
torch.device, or fails with one line that names the device and what this
machine has instead (a CPU-only torch build, no visible GPU, too few GPUs),
so `sssd serve --device cuda` on a machine without CUDA stops before the
model loads. `out_of_memory` turns a CUDA allocation failure at start into
a message with the sizes that caused it.
"""

from __future__ import annotations

import os

import torch

#: Device types a verifier may name (torch's own names).
KNOWN = ("cpu", "cuda", "mps", "xpu")


class DeviceError(ValueError):
    """The device asked for is not on this machine (or its name is not one torch knows)."""


def resolve(requested: str | torch.device | None = None) -> torch.device:
    """The device to run on: `requested` once checked, else CUDA when available, else the CPU.

    Raises:
        DeviceError: an unknown name, or a device this machine does not have (the message says
            what it has).
    """
    if requested is None or requested == "":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(requested)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"device {requested!r} is not a device name ({', '.join(KNOWN)}, cuda:N)") from e
    if dev.type not in KNOWN:
        raise DeviceError(f"device {requested!r}: sssd runs on {', '.join(KNOWN)}, not {dev.type}")
    if dev.type == "cuda":
        if torch.version.cuda is None:
            raise DeviceError(
                f"device {requested!r}: this torch ({torch.__version__}) is a build without CUDA; "
                f"install a CUDA build of torch, or use --device cpu"
            )
        n = torch.cuda.device_count()
        if n == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise DeviceError(
                f"device {requested!r}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
                f"CUDA GPU{why}; use --device cpu"
            )
        if dev.index is not None and dev.index >= n:
            raise DeviceError(
                f"device {requested!r}: this machine has {n} CUDA GPU{'s' if n > 1 else ''} "
                f"(cuda:0{f'..cuda:{n - 1}' if n > 1 else ''})"
            )
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise DeviceError(f"device {requested!r}: no Apple GPU (MPS) is available to this torch ({torch.__version__})")
    elif dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise DeviceError(f"device {requested!r}: no Intel GPU (XPU) is available to this torch ({torch.__version__})")
    return dev


def name(dev: torch.device) -> str:
    """A readable name: the GPU's model for CUDA devices, else the device string."""
    if dev.type == "cuda" and torch.cuda.is_available():
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return str(dev)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def free_memory(dev: torch.device) -> int | None:
    """Bytes free on a CUDA device (None elsewhere)."""
    if dev.type != "cuda":
        return None
    try:
        return int(torch.cuda.mem_get_info(dev)[0])
    except RuntimeError:
        return None


def is_out_of_memory(e: BaseException) -> bool:
    """A failed allocation: CUDA's out-of-memory error, or the CPU allocator's refusal."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def out_of_memory(what: str, needed: int, sizes: str, dev: torch.device, advice: str) -> MemoryError:
    """The error for an allocation at start that does not fit: what, how much, from which sizes,
    what the device had free and what to change."""
    free = free_memory(dev)
    had = f"; {name(dev)} had {gib(free)} free" if free is not None else ""
    return MemoryError(f"out of memory on {dev} allocating {what}: {gib(needed)} ({sizes}){had}. {advice}")
