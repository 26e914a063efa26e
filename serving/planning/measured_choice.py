"""A choice among ways of running a step, kept by measured tokens per second per batch size.

Used where a model of the costs is not trusted to decide alone: serial or asynchronous
drafting (serving.async_draft.ModeChooser), and whether a draft model drafts beside
retrieval (sssd.serving.planning.deferral). Per batch-size bucket (powers of two) blocks of `block` steps
run one arm; the first blocks measure each arm in order (the first arm is the known
default), then the fastest runs, and every `probe_every` blocks the arm measured longest
ago is measured again (machines and workloads change). Smoothed totals per arm, never a
constant. Where a step can tell exactly what another arm would have got in it (the
counterfactual: sssd.serving.planning.deferral), that arm is measured on the same steps too, a paired
comparison without the noise of comparing different steps.
"""

from __future__ import annotations

from typing import Sequence


def bucket(batch: int) -> int:
    """The power-of-two batch-size bucket of `batch`."""
    return 1 << max(0, int(batch) - 1).bit_length()


def _key(batch: int, scope: str | None):
    return bucket(batch) if scope is None else (scope, bucket(batch))


class MeasuredChoice:
    """Chooses one of `arms` per batch-size bucket by measured tokens per second (module docstring).

    Args:
        arms: the choices, the default first.
        block: steps per measured block of one arm.
        probe_every: blocks of the best arm between probes of another.
        fixed: always this arm (nothing measured); None to choose.
    """

    def __init__(self, arms: Sequence[str], block: int = 8, probe_every: int = 8, fixed: str | None = None):
        self.arms = tuple(arms)
        if len(self.arms) < 2 or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"a measured choice needs two or more distinct arms, got {self.arms!r}")
        if fixed is not None and fixed not in self.arms:
            raise ValueError(f"fixed must be None or one of {', '.join(map(repr, self.arms))}, got {fixed!r}")
        self.block, self.probe_every, self.fixed = int(block), int(probe_every), fixed
        self._stats: dict = {}  # bucket (or (scope, bucket)) -> arm -> [seconds, tokens]
        self._state: dict = {}  # bucket -> [arm, steps left, blocks run]
        self._last: dict = {}  # bucket -> arm -> the block it last ran in

    def choose(self, batch: int, scope: str | None = None) -> str:
        """The arm of a step at this batch size; `scope` keeps separate measurements for steps that
        differ otherwise (another choice made beside this one: its arms must not take turns with
        these in step, or each would measure the other's)."""
        if self.fixed is not None:
            return self.fixed
        key = _key(batch, scope)
        st = self._state.setdefault(key, [self.arms[0], self.block, 0])
        if st[1] <= 0:
            stats, last = self._stats.get(key, {}), self._last.setdefault(key, {})
            st[2] += 1
            unmeasured = [a for a in self.arms if a not in stats]
            if unmeasured:
                st[0] = unmeasured[0]
            else:
                best = max(self.arms, key=lambda a: stats[a][1] / max(stats[a][0], 1e-9))
                if st[2] % self.probe_every == 0:  # the arm measured longest ago, the best aside
                    st[0] = min((a for a in self.arms if a != best), key=lambda a: last.get(a, -1))
                else:
                    st[0] = best
            st[1] = self.block
            last[st[0]] = st[2]
        return st[0]

    def observe(self, batch: int, arm: str, seconds: float, tokens: int, scope: str | None = None) -> None:
        """A step at this batch size (in `scope`) ran `arm` for `seconds` and emitted `tokens`."""
        key = _key(batch, scope)
        st = self._state.setdefault(key, [arm, self.block, 0])
        st[1] -= 1
        self._add(key, arm, seconds, tokens)

    def observe_counterfactual(
        self, batch: int, arm: str, seconds: float, tokens: float, scope: str | None = None
    ) -> None:
        """What a step run by another arm would have taken with `arm` instead, worked out exactly
        from the step (sssd.serving.planning.deferral: retrieval's own trees against the verified tokens). Measures
        `arm` beside the arm that ran, on the same steps, without running it or ending a block."""
        if arm in self.arms and seconds > 0:
            self._add(_key(batch, scope), arm, seconds, tokens)

    def _add(self, key, arm: str, seconds: float, tokens: float) -> None:
        s = self._stats.setdefault(key, {}).setdefault(arm, [0.0, 0.0])
        s[0], s[1] = 0.9 * s[0] + seconds, 0.9 * s[1] + tokens

    def rates(self) -> dict:
        """Per bucket (a (scope, bucket) pair for scoped steps), each measured arm's smoothed
        tokens per second."""
        return {k: {a: v[1] / max(v[0], 1e-9) for a, v in d.items()} for k, d in self._stats.items()}
