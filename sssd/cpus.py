"""How many CPU cores this process may use, and a thread count that fits them.

A process is often given fewer cores than the machine has: an affinity mask
(``taskset``, ``docker --cpuset-cpus``, a batch scheduler) or a cgroup CPU
quota (``docker --cpus``, Kubernetes CPU limits, systemd ``CPUQuota``).
torch's default thread count follows the machine's physical cores and sees
neither. Threads beyond the cores they may run on do not add work: OpenMP's
threads meet at a barrier after every parallel region, and a thread that
waits for a core makes every other thread wait for it, dozens of times per
layer (10-100x slower passes, not a few percent).

``available_cpus`` is the smaller of the affinity mask and the quota, at
least 1; ``threads_for`` checks a requested thread count against it. No torch
here: the command line checks ``--threads`` before anything loads.

The cores a process may use are not the cores it gets: beside a busy
neighbour, two threads on two cores wait for each other at every barrier (a
SmolLM2 pass: 40 ms alone, 264 ms with 2 threads beside one spinning
process, 56 ms with 1). ``Contention`` watches the other processes' load on
this process's CPUs and gives the thread count that fits beside it, lower
while they hold cores, back up when they leave.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from collections.abc import Callable
from pathlib import Path

#: Where the cgroup file systems are mounted (v2: the unified hierarchy; v1: one folder per controller).
CGROUP_ROOT = "/sys/fs/cgroup"
#: This process's cgroup in each hierarchy ("0::/path" for v2, "N:cpu,cpuacct:/path" for v1).
PROC_CGROUP = "/proc/self/cgroup"
#: The folders v1 mounts the cpu controller at (distributions differ).
V1_CPU_FOLDERS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")

log = logging.getLogger("sssd.cpus")


def affinity_cpus() -> int:
    """The CPUs this process may be scheduled on (its affinity mask; all CPUs where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def cgroup_quota(root: str | os.PathLike = CGROUP_ROOT, proc_cgroup: str | os.PathLike = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup, in cores (1.5: one and a half cores' time per
    period), or None where there is none.

    The tightest limit over the process's cgroup and its ancestors, cgroup v2 (``cpu.max``:
    "QUOTA PERIOD" or "max PERIOD") or v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, -1 for
    none). Files that are missing or unreadable count as no limit.

    Args:
        root: where the cgroup file systems are mounted (tests give a folder of their own).
        proc_cgroup: the file that names this process's cgroups.
    """
    root = Path(root)
    v2_path, v1_path = "/", "/"
    try:
        for line in Path(proc_cgroup).read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            if parts[0] == "0" and parts[1] == "":
                v2_path = parts[2]
            elif "cpu" in parts[1].split(","):
                v1_path = parts[2]
    except OSError:
        pass
    limits = [q for d in _up(root, v2_path) if (q := _v2_quota(d / "cpu.max")) is not None]
    for folder in V1_CPU_FOLDERS:
        if (root / folder).is_dir():
            limits += [q for d in _up(root / folder, v1_path) if (q := _v1_quota(d)) is not None]
            break
    return min(limits) if limits else None


def _up(base: Path, path: str) -> list[Path]:
    """The process's cgroup folder under ``base`` and each folder above it, up to ``base``. In a
    container that sees the host's cgroup path but mounts only its own cgroup, the path is not
    there and only ``base`` (the container's own cgroup) is read."""
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return [base.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def _v2_quota(file: Path) -> float | None:
    try:
        fields = file.read_text().split()
    except OSError:
        return None
    if len(fields) < 1 or fields[0] == "max":
        return None
    try:
        quota = float(fields[0])
        period = float(fields[1]) if len(fields) > 1 else 100_000.0
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = float((folder / "cpu.cfs_quota_us").read_text().strip())
        period = float((folder / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus(
    root: str | os.PathLike = CGROUP_ROOT, proc_cgroup: str | os.PathLike = PROC_CGROUP, affinity: int | None = None
) -> int:
    """The cores this process may use: its affinity mask, capped by its cgroup CPU quota rounded
    down (half a core's quota is 1: a thread cannot run on less), at least 1.

    Args:
        root / proc_cgroup: as for cgroup_quota (tests give files of their own).
        affinity: the affinity mask's size (default: this process's).
    """
    cores = affinity_cpus() if affinity is None else max(1, int(affinity))
    quota = cgroup_quota(root, proc_cgroup)
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def describe(root: str | os.PathLike = CGROUP_ROOT, proc_cgroup: str | os.PathLike = PROC_CGROUP) -> str:
    """Where the available count comes from, in words: "2 cores (affinity: 2 CPUs; cgroup quota: none)"."""
    quota = cgroup_quota(root, proc_cgroup)
    n = available_cpus(root, proc_cgroup)
    return (
        f"{n} core{'s' if n != 1 else ''} (CPU affinity: {affinity_cpus()} of {os.cpu_count() or '?'} CPUs; "
        f"cgroup CPU quota: {'none' if quota is None else f'{quota:g} cores'})"
    )


def threads_for(
    requested: int | None,
    *,
    default: int | None = None,
    available: int | None = None,
    share: int = 1,
    what: str = "threads",
    warn: Callable[[str], None] | None = None,
) -> int:
    """A thread count that fits the cores this process may use.

    Args:
        requested: what the user asked for; None takes ``default`` (or all the available cores),
            capped at the available cores without a word.
        default: the count to use when none is requested (e.g. torch's own default), before the cap.
        available: the cores this process may use (default: available_cpus()).
        share: how many processes share them, each with this many threads (pipeline stages):
            each may use the available cores // share, at least 1.
        what: how the message names the setting ("--threads").
        warn: where the one-line clamp warning goes (default: the "sssd.cpus" logger).

    Returns:
        ``requested``, or the available cores (per share) if it asks for more, with one warning
        saying what was asked for and what is available.

    Raises:
        ValueError: ``requested`` is not a whole number >= 1 (the message says how to get the default).
    """
    cores = available_cpus() if available is None else max(1, int(available))
    each = max(1, cores // max(1, share))
    per = " per pipeline stage" if share > 1 else ""
    if requested is None:
        return each if default is None else max(1, min(int(default), each))
    try:
        if isinstance(requested, bool):
            raise TypeError
        n = operator.index(requested)
    except TypeError:
        raise ValueError(f"{what} must be a whole number of threads, got {requested!r}") from None
    if n < 1:
        raise ValueError(
            f"{what} must be >= 1, got {n} (leave it out to use the {each} core{'s' if each != 1 else ''}{per} "
            f"this process may use)"
        )
    if n > each:
        (warn or log.warning)(
            f"{what} {n}{per}: this process may use {cores} core{'s' if cores != 1 else ''} (CPU affinity and "
            f"cgroup quota){f', {each} per stage over {share} stages' if share > 1 else ''}; using {each} "
            f"thread{'s' if each != 1 else ''}{per} (threads beyond the cores wait on each other)"
        )
        return each
    return n


def _process_table() -> dict[int, tuple[int, int, int, int]]:
    """pid -> (parent pid, CPU clock ticks used (user + system), nice, last CPU) of every live
    process, from /proc (empty where there is none)."""
    table = {}
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return table
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            # after the name: state ppid ... utime(11) stime(12) ... nice(16) ... processor(36)
            table[int(entry.name)] = (
                int(fields[1]),
                int(fields[11]) + int(fields[12]),
                int(fields[16]),
                int(fields[36]),
            )
        except (OSError, IndexError, ValueError):
            continue
    return table


def _own_tree(table: dict[int, tuple[int, int, int, int]], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, row in table.items():
        children.setdefault(row[0], []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def competing_ticks(cpus: set[int] | None = None) -> dict[int, int] | None:
    """pid -> CPU clock ticks used so far, for every live process that competes with this one for
    the CPU: not this process or one it started (pipeline stages), not niced below it (those yield
    their core to it), last run on one of `cpus` (None: any). None where /proc cannot be read.
    Two samples' difference (`competing_seconds`) is the CPU time the others took meanwhile."""
    table = _process_table()
    if not table:
        return None
    me = os.getpid()
    ours = _own_tree(table, me)
    nice = table[me][2] if me in table else 0
    return {
        pid: ticks
        for pid, (_, ticks, n, cpu) in table.items()
        if pid not in ours and n <= nice and (cpus is None or cpu in cpus)
    }


def competing_seconds(before: dict[int, int] | None, after: dict[int, int] | None) -> float | None:
    """CPU seconds the competing processes used between two `competing_ticks` samples (a process
    that started meanwhile counts all its time; one that ended, what it used before the first)."""
    if before is None or after is None:
        return None
    ticks = sum(max(0, t - before.get(pid, 0)) for pid, t in after.items())
    return ticks / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


class Contention:
    """Other processes' load on the CPUs this process may use, and the thread count that fits.

    `update()` (cheap; call it at every step) samples every `interval` seconds the CPU time that
    competing processes (competing_ticks: not this process or its children, not niced below it)
    took on this process's CPUs, as cores. Threads follow the cores left free, rounded: down at
    once when other processes hold a core, back up after `recover` quiet samples in a row. Never
    below 1 or above `threads`.

    Args:
        threads: the count to run with on a quiet machine.
        interval: seconds between samples.
        recover: quiet samples before threads go back up.
        sample: () -> a competing_ticks sample (tests give their own).
    """

    #: Other processes' load (cores) above which a core counts as taken.
    TAKEN = 0.5

    def __init__(
        self,
        threads: int,
        interval: float = 1.0,
        recover: int = 2,
        clock: Callable[[], float] = time.monotonic,
        sample: Callable[[], dict[int, int] | None] | None = None,
    ):
        self.threads = self.current = max(1, int(threads))
        self.interval, self.recover, self.clock = interval, recover, clock
        try:
            cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = None
        self.cores = min(len(cpus) if cpus else (os.cpu_count() or 1), available_cpus())
        mine_only = cpus is not None and len(cpus) < (os.cpu_count() or 1)
        self._sample = sample or (lambda: competing_ticks(cpus if mine_only else None))
        self.others = 0.0  # other processes' load in the last sample, in cores
        self._quiet_samples = 0
        self._last = (self.clock(), self._sample())

    @property
    def contended(self) -> bool:
        """Whether other processes held a core in the last sample."""
        return self.others > self.TAKEN

    def update(self) -> int | None:
        """Samples if `interval` has passed; returns the new thread count when it changes, else None."""
        t0, before = self._last
        now = self.clock()
        if now - t0 < self.interval:
            return None
        after = self._sample()
        self._last = (now, after)
        used = competing_seconds(before, after)
        if used is None:
            return None
        self.others = used / (now - t0)
        fits = max(1, min(self.threads, int(self.cores - self.others + 0.5)))
        if fits < self.current:
            self._quiet_samples = 0
            self.current = fits
            return fits
        if fits > self.current:
            self._quiet_samples += 1
            if self._quiet_samples >= self.recover:
                self._quiet_samples = 0
                self.current = fits
                return fits
        else:
            self._quiet_samples = 0
        return None
