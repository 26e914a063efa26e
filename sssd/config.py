"""Drafter configuration: retrieval parameters and the merge's discounts.

Defaults follow the paper (section 3.1) where it gives values: input prefix
length P = 4, M = 100 sampled continuations. The discounts are sensible
starting points; ``sssd calibrate`` fits better ones for a model and budget.

``DrafterConfig.load`` reads a saved DrafterConfig, and the files of the formats
registered with ``register_config_format``: sssd.calibration_file, which defines
``sssd calibrate``'s files (they hold DrafterConfigs, so it sits above this module
and this module never imports it), registers them as it is imported, and
``import sssd`` imports it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sssd import _core
from sssd.files import read_json_object

#: The parameter files written by ``sssd calibrate``.
CALIBRATION_FORMAT = "sssd-calibration"
CALIBRATION_VERSION = 1

#: Source tags of draft nodes (DraftTree.sources).
SOURCE_DATASTORE = 0
SOURCE_INPUT = 1
SOURCE_EXTERNAL = 2
#: The copy source's nodes (the request's own long repeats, followed deep; part of the input source).
SOURCE_COPY = 15
SOURCE_NAMES = {SOURCE_DATASTORE: "datastore", SOURCE_INPUT: "input", SOURCE_EXTERNAL: "external", SOURCE_COPY: "copy"}


@dataclass(frozen=True)
class SourceDiscount:
    """Discount of one source: scale * depth_decay**(depth-1) * match_damping**shortfall.

    Attributes:
        scale: overall weight of the source relative to the others.
        depth_decay: extra factor per level below the first (the probabilities
            already fall with depth; this corrects over/under-confidence).
        match_damping: factor per token that the matched context falls short
            of ``full_match`` (short matches are less reliable).
        full_match: match length at and above which no damping applies.
    """

    scale: float = 1.0
    depth_decay: float = 1.0
    match_damping: float = 1.0
    full_match: int = 1

    def factor(self, match_len: int, depth: int) -> float:
        shortfall = max(0, self.full_match - match_len)
        return self.scale * self.depth_decay ** (depth - 1) * self.match_damping**shortfall

    def factors(self, max_match: int, max_depth: int) -> np.ndarray:
        """factor(m, d) for every match length 0..max_match (rows) and depth 1..max_depth (columns)."""
        shortfall = np.maximum(0, self.full_match - np.arange(max_match + 1, dtype=np.float64))
        return self.scale * np.outer(
            self.match_damping**shortfall, self.depth_decay ** np.arange(max_depth, dtype=np.float64)
        )


@dataclass(frozen=True)
class Calibration:
    """Calibration curves fitted by ``sssd calibrate``: for each source and each
    (match-length bin, depth bin), a monotone piecewise-linear map from the
    source's probability to the observed acceptance probability. With them,
    priorities are acceptance probabilities and comparable across sources.

    Attributes:
        match_bins: lower edges of the match-length bins, increasing, from 0.
        depth_bins: lower edges of the depth bins, increasing, from 1.
        curves: (source, match_bin, depth_bin, knots, values) per fitted cell;
            cells without a curve use the raw probability.
    """

    match_bins: tuple[int, ...] = (0,)
    depth_bins: tuple[int, ...] = (1,)
    curves: tuple[tuple[int, int, int, tuple[float, ...], tuple[float, ...]], ...] = ()

    @staticmethod
    def bin_of(edges: tuple[int, ...], values: np.ndarray) -> np.ndarray:
        """The bin holding each value: the last edge <= it (the first bin below every edge)."""
        return np.maximum(np.searchsorted(edges, values, side="right") - 1, 0)

    def curve_index(self, num_sources: int, max_match: int, max_depth: int) -> np.ndarray:
        """[num_sources, max_match + 1, max_depth + 1] int32: the index in ``curves`` of each
        (source, match length, depth) cell's curve, -1 for none (depth 0 and sources past the
        third: none)."""
        out = np.full((num_sources, max_match + 1, max_depth + 1), -1, dtype=np.int32)
        fitted = np.full((3, max(1, len(self.match_bins)), max(1, len(self.depth_bins))), -1, dtype=np.int32)
        for i, (s, m, d, _, _) in enumerate(self.curves):  # a later curve of the same cell wins
            if 0 <= s < 3 and 0 <= m < fitted.shape[1] and 0 <= d < fitted.shape[2]:
                fitted[s, m, d] = i
        m = self.bin_of(self.match_bins, np.arange(max_match + 1))
        d = self.bin_of(self.depth_bins, np.arange(1, max_depth + 1))
        k = min(num_sources, 3)
        out[:k, :, 1:] = fitted[:k][:, m][:, :, d]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "match_bins": list(self.match_bins),
            "depth_bins": list(self.depth_bins),
            "curves": [[s, m, d, list(x), list(y)] for s, m, d, x, y in self.curves],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        return cls(
            tuple(d["match_bins"]),
            tuple(d["depth_bins"]),
            tuple(
                (int(s), int(m), int(dd), tuple(map(float, x)), tuple(map(float, y))) for s, m, dd, x, y in d["curves"]
            ),
        )


@dataclass(frozen=True)
class DiscountParams:
    """Per-source discounts of the merge (paper, section 3.1.3).

    The input source (prompt + generated tokens) is overconfident: when a
    prefix was seen only once or twice in the input, its few continuations get
    probabilities near 1. So it is scaled down and damped for short matches.
    """

    datastore: SourceDiscount = SourceDiscount(scale=1.0, depth_decay=1.0, match_damping=0.85, full_match=6)
    input: SourceDiscount = SourceDiscount(scale=0.6, depth_decay=0.95, match_damping=0.7, full_match=4)
    external: SourceDiscount = SourceDiscount(scale=1.0, depth_decay=1.0, match_damping=1.0, full_match=0)
    #: Calibration curves (from ``sssd calibrate``); when set they replace the discounts.
    calibration: Calibration | None = None

    def score_table(
        self, max_match: int, max_depth: int, external: tuple[SourceDiscount, ...] | None = None
    ) -> _core.ScoreTable:
        """The dense (source, match length, depth) table the C++ merge reads.

        Args:
            external: the discounts of the caller's sources, tagged 2, 3, ... in order
                (default: one, ``self.external``).
        """
        ext = tuple(external) if external else (self.external,)
        sources = (self.datastore, self.input) + ext
        n = len(sources)
        factors = np.zeros((n, max_match + 1, max_depth + 1), dtype=np.float64)
        cal = self.calibration
        for s, disc in enumerate(sources):
            if cal is not None and s < 2:
                factors[s, :, 1:] = 1.0  # curves replace the retrieval sources' discounts
                continue
            factors[s, :, 1:] = disc.factors(max_match, max_depth)
        if cal is None:
            return _core.ScoreTable(max_match, max_depth, factors.ravel(), num_sources=n)
        if external is None:
            factors[2:, :, 1:] = 1.0  # (the calibrated external source of a calibration file)
        curve_of = cal.curve_index(n, max_match, max_depth)
        curves = [(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)) for _, _, _, x, y in cal.curves]
        return _core.ScoreTable(max_match, max_depth, factors.ravel(), curve_of.ravel(), curves, num_sources=n)

    def to_dict(self) -> dict[str, Any]:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in ("datastore", "input", "external")}
        out["calibration"] = self.calibration.to_dict() if self.calibration else None
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiscountParams:
        _check_fields(cls, d, "discount")
        kw: dict[str, Any] = {}
        for name in ("datastore", "input", "external"):
            if name in d:
                kw[name] = SourceDiscount(**d[name])
        if d.get("calibration") is not None:
            kw["calibration"] = Calibration.from_dict(d["calibration"])
        return cls(**kw)


@dataclass(frozen=True)
class DrafterConfig:
    """All knobs of the drafter. Every field has a documented default.

    Attributes:
        budget: draft tree size (candidate tokens per request per step; the
            paper's dec_len minus the root).
        datastore_max_match: longest context suffix searched in the datastore.
        datastore_min_match: shortest context suffix the datastore backs off to.
        max_samples: M, continuations sampled per suffix length (paper: 100).
        min_occurrences: back off to shorter suffixes while the occurrences of
            the suffixes used so far are below this.
        datastore_branch_len: datastore continuation length for short matches (tree depth).
        datastore_branch_per_match: adaptive depth: an occurrence whose context
            matches m tokens continues for m times this many tokens, between
            datastore_branch_len and datastore_max_branch_len (0: off).
        datastore_max_branch_len: the longest adaptive continuation.
        match_boost: weight of longer matches in the datastore's backoff sum
            (each level above the base weighs this much more than the one
            below; 1: the plain sum of the levels' occurrences). 1.5 by
            default: a context that matches a document far back is followed
            further (92% of once-occurring contexts followed >= 48 tokens, 88%
            at 1; benchmarks/bench_verbatim.py) at no cost on the development
            splits.
        input_max_match: P, longest context suffix matched in the input's n-gram trie (paper: 4).
        input_branch_len: longest continuation of those short matches.
        copy_min_match: the copy source (part of the input source; its nodes are tagged
            SOURCE_COPY): the longest earlier
            occurrence of the context's suffix, of any length, found by the request's suffix
            automaton, is followed when it is at least this many tokens long.
        copy_branch_per_match / copy_max_branch_len: a repeat of m tokens is followed
            m * copy_branch_per_match tokens deep (at least input_branch_len), up to
            copy_max_branch_len (0: no copy source).
        copy_occurrences: earlier occurrences of the repeat followed (most recent first, 1-3);
            where they disagree the draft branches.
        copy_rate: prior probability that a copy continues one more token. A copy node at
            depth d is ranked by its depth-1 priority times rate^(d - 1), where the rate is the
            request's own: how often its repeats predicted its next token (decaying with
            copy_half_life tokens), blended with this prior worth copy_evidence tokens.
        copy_exclusion: where a copy is drafted, the other sources' guesses differ from it, so
            they are ranked as needing the copy to be wrong: their priorities times
            (1 - copy_exclusion * rate) (0: off).
        copy_edit_weight: a request's edits (what it wrote instead of its source, remembered
            when the copy rejoins the source) are applied again where the source has them again:
            an edited path beside the unedited one, weighed by this times how often the edit was
            made again at its sites so far (0: off).
        copy_max_tokens: cap on a request's suffix automaton (<= 180 bytes per token).
        use_datastore / use_input: enable each source (the copy source is part of the input).
        end_token: token drafted where a datastore document ends (e.g. the
            chat template's end-of-turn id); None: documents end the draft.
        vocab_size: token ids must be below this (None: the datastore's
            tokenizer vocabulary if known, else any id < 2^32 - 1).
        input_max_nodes: cap on a request's trie nodes (up to ~100 bytes each).
        num_threads: OpenMP threads for batch drafting (0: all cores).
        discounts: the merge's per-source discounts.
    """

    budget: int = 32
    datastore_max_match: int = 16
    datastore_min_match: int = 1
    max_samples: int = 100
    min_occurrences: int = 20
    datastore_branch_len: int = 16
    datastore_branch_per_match: float = 4.0
    datastore_max_branch_len: int = 64
    match_boost: float = 1.5
    input_max_match: int = 4
    input_branch_len: int = 16
    copy_min_match: int = 8
    copy_branch_per_match: float = 0.0
    copy_max_branch_len: int = 64
    copy_occurrences: int = 2
    copy_rate: float = 0.9
    copy_evidence: float = 4.0
    copy_half_life: float = 32.0
    copy_exclusion: float = 1.0
    copy_edit_weight: float = 1.0
    copy_max_tokens: int = 1 << 20
    use_datastore: bool = True
    use_input: bool = True
    end_token: int | None = None
    vocab_size: int | None = None
    input_max_nodes: int = 1 << 22
    num_threads: int = 0
    discounts: DiscountParams = field(default_factory=DiscountParams)

    def __post_init__(self) -> None:
        ints = {f.name for f in dataclasses.fields(self) if f.type in ("int", int)}
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"DrafterConfig.{name} must be an int, got {v!r}")
        if not 0 <= self.budget <= int(_core.MAX_BUDGET):
            raise ValueError(f"budget must be in [0, {int(_core.MAX_BUDGET)}], got {self.budget}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if self.end_token is not None and not 0 <= self.end_token <= int(_core.MAX_TOKEN_ID):
            raise ValueError(f"end_token must be a token id, got {self.end_token}")
        # The remaining ranges are checked by the C++ core with precise messages.
        self.native_params()

    def replace(self, **changes: Any) -> DrafterConfig:
        return dataclasses.replace(self, **changes)

    def native_params(
        self, vocab_size: int | None = None, external: tuple[SourceDiscount, ...] | None = None
    ) -> _core.DrafterParams:
        """The C++ parameter object (vocab_size fills in a missing one; `external`: the
        discounts of the caller's draft sources, tagged 2, 3, ...)."""
        q = _core.DatastoreQuery()
        q.max_match = self.datastore_max_match
        q.min_match = self.datastore_min_match
        q.max_samples = self.max_samples
        q.min_occurrences = self.min_occurrences
        q.branch_len = self.datastore_branch_len
        q.branch_per_match = float(self.datastore_branch_per_match)
        q.max_branch_len = self.datastore_max_branch_len
        q.match_boost = float(self.match_boost)
        q.end_token = -1 if self.end_token is None else self.end_token
        p = _core.DrafterParams()
        p.datastore = q
        p.use_datastore = self.use_datastore
        p.use_input = self.use_input
        p.input_max_match = self.input_max_match
        p.input_branch_len = self.input_branch_len
        p.input_max_nodes = self.input_max_nodes
        p.copy_min_match = self.copy_min_match
        p.copy_branch_per_match = float(self.copy_branch_per_match)
        p.copy_max_branch_len = self.copy_max_branch_len
        p.copy_occurrences = self.copy_occurrences
        p.copy_rate = float(self.copy_rate)
        p.copy_evidence = float(self.copy_evidence)
        p.copy_half_life = float(self.copy_half_life)
        p.copy_exclusion = float(self.copy_exclusion)
        p.copy_edit_weight = float(self.copy_edit_weight)
        p.copy_max_tokens = self.copy_max_tokens
        p.vocab_size = self.vocab_size or vocab_size or 0
        max_match = max(self.datastore_max_match, self.input_max_match)
        max_depth = max(q.deepest(), self.input_branch_len, self.copy_max_branch_len)
        p.scores = self.discounts.score_table(max_match, max_depth, external)
        _core.Drafter(None, p, 1)  # validates every field, raising ValueError
        return p

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["discounts"] = self.discounts.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        _check_fields(cls, d, "drafter config")
        d = dict(d)
        if "discounts" in d and isinstance(d["discounts"], dict):
            d["discounts"] = DiscountParams.from_dict(d["discounts"])
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, budget: int | None = None) -> DrafterConfig:
        """Reads a config file: a saved DrafterConfig, or a parameter file
        written by ``sssd calibrate`` (then ``budget`` picks the parameters
        calibrated for the largest budget not above it; default: the file's
        default budget). A calibration file's fingerprint is not checked here
        (no datastore or model is known): see ``sssd.calibration_file``, whose
        reader this calls (``register_config_format``).

        Raises:
            ValueError: missing, unreadable, not a regular file (a FIFO is refused
                without being opened for reading), larger than 64 MiB, not JSON
                (truncated), another kind of file, or malformed; or a calibration
                file of another format version.
        """
        d = read_json_object(path, "drafter config")
        fmt = d.get("format")
        reader = _CONFIG_FORMATS.get(fmt) if isinstance(fmt, str) else None
        if reader is not None:
            return reader(d, str(path), budget)
        if "format" in d:
            raise ValueError(f"{path}: a {d['format']!r} file, not a drafter config or `sssd calibrate` file")
        try:
            cfg = cls.from_dict(d)
        except TypeError as e:  # a field of the wrong type
            raise ValueError(f"{path}: malformed drafter config ({e})") from None
        return cfg if budget is None else cfg.replace(budget=budget)

    @classmethod
    def from_calibration(
        cls, d: dict[str, Any], budget: int | None = None, where: str = "calibration"
    ) -> DrafterConfig:
        """The configuration a calibration parameter file gives for ``budget`` (ValueError if malformed;
        sssd.calibration_file reads it)."""
        return _CONFIG_FORMATS[CALIBRATION_FORMAT](d, where, budget)


#: How DrafterConfig.load reads a file of another format: (parsed file, its path, budget) -> DrafterConfig.
ConfigReader = Callable[[dict[str, Any], str, int | None], DrafterConfig]
#: The readers, by the file's "format" (register_config_format).
_CONFIG_FORMATS: dict[str, ConfigReader] = {}


def register_config_format(name: str, reader: ConfigReader) -> None:
    """Lets ``DrafterConfig.load`` read files whose "format" is `name` with `reader` (which picks the
    config for the budget asked, or the file's default for None). The module defining a format calls
    it as it is imported: sssd.calibration_file for CALIBRATION_FORMAT."""
    _CONFIG_FORMATS[name] = reader


def _check_fields(cls: type, d: dict[str, Any], what: str) -> None:
    """ValueError naming the keys of `d` that are not fields of the dataclass `cls` (a misspelt knob)."""
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown {what} fields: {sorted(unknown)}")
