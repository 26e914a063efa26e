"""Calibration parameter files (``sssd calibrate``): every budget's entry, and the
fingerprint of the datastore, tokenizer and model they were calibrated for.

A file (format "sssd-calibration", version 1) is a JSON object::

    {"format": "sssd-calibration", "version": 1,
     "default_budget": 32,                       # the entry `DrafterConfig.load` picks by default
     "budgets": {"4": {"config": {...DrafterConfig...}, "calibrated": true, "mat": 2.04, ...}, ...},
     "calibration": {...Calibration...},         # curves, used by the entries marked calibrated
     "fingerprint": {"datastore": "6a225f4f78655b21", "tokenizer": "<sha256>",
                     "model": "gguf:<sha256>", "model_name": "smollm2-135m-instruct"},
     "sources": {"model:qwen2.5-coder-0.5b-instruct": {"discount": {...SourceDiscount...}, "mat": 2.9, ...}},
     ...provenance...}

"sources" (optional) holds the merge discounts fitted for other draft sources beside
retrieval (``sssd calibrate --draft``, calibration/hybrid.py), keyed by the source's
calibration key; a DraftPipeline drafting with the file gives a source whose key it
finds that discount instead of the source's own.

The fingerprint is optional (files written before it have none; they load with a
warning that they cannot be checked), and so is each of its fields (a field that is
null is not checked).

A step drafted with budget b uses the entry of the largest calibrated budget <= b
(the smallest entry when b is below them all), with budget b; the planner's MAT
estimates come from the same entries (serving/planning/planner.py).

This module is the format, reading it and choosing an entry; it never drafts
(sssd.drafter.draft_with_entries drafts a batch with the entries, and
sssd.sources.DraftPipeline with a whole file). ``DrafterConfig.load`` reads these
files too: this module registers its reader with sssd.config as it is imported
(``import sssd`` imports it), so that sssd.config, below it, never imports it.

Errors: reading a file (``CalibrationFile.load``) raises ValueError for anything
malformed: unreadable, not JSON or truncated, another format or version, entries
that are not drafter configs. A fingerprint that differs is not an error here:
``CalibrationFile.check`` lists what differs, and the engine then drafts with the
uncalibrated defaults (with a warning naming the differences).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sssd import _core
from sssd.config import (
    CALIBRATION_FORMAT,
    CALIBRATION_VERSION,
    Calibration,
    DrafterConfig,
    SourceDiscount,
    register_config_format,
)
from sssd.datastore import DEFAULT, Datastore, built_default_path
from sssd.errors import DatastoreError
from sssd.files import read_json_object
from sssd.manifest import read_manifest
from sssd.model_registry import get_spec, is_pulled, model_fingerprint, model_path
from sssd.tokenizer import load_tokenizer

log = logging.getLogger("sssd.calibration")


@dataclass(frozen=True)
class Fingerprint:
    """What a calibration was fitted for. None: not recorded (not checked).

    Attributes:
        datastore: the datastore's content fingerprint (its manifest's "fingerprint", 16 hex digits).
        tokenizer: sha256 of the tokenizer (sssd.tokenizer identity; the datastore records it).
        model: the model's weights identity (``model_fingerprint``).
        model_name: the model's name (reported, not compared).
    """

    datastore: str | None = None
    tokenizer: str | None = None
    model: str | None = None
    model_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "calibration") -> Fingerprint:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: malformed calibration file (the fingerprint is a {type(d).__name__})")
        known = {f.name for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if k in known and v is not None and not isinstance(v, str):
                raise ValueError(f"{where}: malformed calibration file (fingerprint {k} is {v!r}, not a string)")
        return cls(**{k: d.get(k) for k in known})

    @classmethod
    def of(cls, datastore: Any = None, model: Any = None) -> Fingerprint:
        """The fingerprint of an opened Datastore (or a datastore path) and a model (folder or registered name)."""
        ds_fp, tok = datastore_identity(datastore)
        name, model_fp = model_fingerprint(model) if model is not None else (None, None)
        if tok is None and model is not None:
            tok = _model_tokenizer(model)
        return cls(ds_fp, tok, model_fp, name)


@dataclass(frozen=True)
class CalibrationFile:
    """A loaded calibration file: every budget's drafter config, and what they were fitted for.

    Attributes:
        entries: budget -> DrafterConfig (curves attached where the entry is calibrated), budgets increasing.
        mat: budget -> the replayed mean accepted tokens per step (budgets whose entry records one).
        default_budget: the budget used when none is asked.
        fingerprint: what the file was calibrated for; None for files that record none.
        where: the file's path (for messages).
        sources: calibration key -> the merge discount fitted for that draft source.
    """

    entries: dict[int, DrafterConfig]
    mat: dict[int, float]
    default_budget: int
    fingerprint: Fingerprint | None = None
    where: str = "calibration"
    sources: dict[str, SourceDiscount] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> CalibrationFile:
        """Reads a calibration file.

        Raises:
            ValueError: missing, unreadable, not a regular file, larger than 64 MiB, not JSON
                (e.g. truncated), not a calibration file, another format version, or malformed.
        """
        d = read_json_object(path, "calibration file")
        if d.get("format") != CALIBRATION_FORMAT:
            raise ValueError(
                f"{path}: not an `sssd calibrate` file (format {d.get('format')!r}, expected {CALIBRATION_FORMAT!r})"
            )
        return cls.from_dict(d, where=str(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "calibration") -> CalibrationFile:
        """The entries of a parsed calibration file (ValueError: see ``load``)."""
        version = d.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version != CALIBRATION_VERSION:
            raise ValueError(
                f"{where}: calibration format version {version!r} is not supported "
                f"(this sssd reads version {CALIBRATION_VERSION}; rerun `sssd calibrate`)"
            )
        raw = d.get("budgets")
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: malformed calibration file (budgets is not an object)")
        if not raw:
            raise ValueError(f"{where}: calibration file holds no budgets")
        curves = None
        if d.get("calibration") is not None:
            try:
                curves = Calibration.from_dict(d["calibration"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: malformed calibration file (calibration curves: {e})") from None
        entries, mat = {}, {}
        for key, entry in raw.items():
            b = _budget_key(key, where)
            entries[b], m = _entry(entry, b, curves, where)
            if m is not None:
                mat[b] = m
        entries = dict(sorted(entries.items()))
        default = d.get("default_budget")
        if default in (None, 0):
            default = max(entries)
        elif isinstance(default, bool) or not isinstance(default, int) or default < 0:
            raise ValueError(f"{where}: malformed calibration file (default_budget {default!r})")
        fp = Fingerprint.from_dict(d["fingerprint"], where) if d.get("fingerprint") is not None else None
        return cls(entries, mat, default, fp, where, _source_discounts(d.get("sources"), where))

    # -- choosing an entry ------------------------------------------------------------
    def entry_budget(self, budget: int) -> int:
        """The calibrated budget whose entry drafts at `budget`: the largest <= it, else the smallest."""
        return select_entry(list(self.entries), budget)

    def config(self, budget: int | None = None) -> DrafterConfig:
        """The drafter config for `budget` (default: the file's default budget), with that budget."""
        budget = self.default_budget if budget is None else budget
        return self.entries[self.entry_budget(budget)].replace(budget=budget)

    def map(self, fn: Callable[[DrafterConfig], DrafterConfig]) -> CalibrationFile:
        """The same file with `fn` applied to every entry's config (e.g. an end token)."""
        return dataclasses.replace(self, entries={b: fn(c) for b, c in self.entries.items()})

    # -- the fingerprint --------------------------------------------------------------
    def check(self, datastore: Any, model: Any) -> list[str]:
        """What differs between the fingerprint and this datastore and model: one phrase per
        field (empty when everything recorded matches, or when the file records no fingerprint).

        Args:
            datastore: the Datastore drafting (or a datastore path, "default", or None: none).
            model: the target model's folder, or a registered model name.
        """
        fp = self.fingerprint
        if fp is None:
            return []
        out = []
        ds_fp, tok = datastore_identity(datastore) if fp.datastore or fp.tokenizer else (None, None)
        if fp.datastore and ds_fp != fp.datastore:
            out.append(f"datastore fingerprint {ds_fp or 'none (no datastore)'} (calibrated for {fp.datastore})")
        if fp.tokenizer:
            tok = tok or _model_tokenizer(model)
            if tok != fp.tokenizer:
                out.append(f"tokenizer sha256 {tok[:12] if tok else 'unknown'} (calibrated for {fp.tokenizer[:12]})")
        if fp.model:
            name, model_fp = model_fingerprint(model)
            if model_fp != fp.model:
                out.append(
                    f"model {name or model} {_short(model_fp) if model_fp else '(unknown identity)'} "
                    f"(calibrated for {fp.model_name or 'a model'} {_short(fp.model)})"
                )
        return out

    def checked_or_defaults(self, datastore: Any, model: Any) -> CalibrationFile | DrafterConfig:
        """Itself when its fingerprint matches (or it records none: then with a warning that it
        cannot be checked); the uncalibrated DrafterConfig() with a warning naming what differs otherwise."""
        if self.fingerprint is None:
            log.warning(
                "%s records no fingerprint (an older `sssd calibrate` file): it cannot be checked "
                "against this datastore and model; using it as is",
                self.where,
            )
            return self
        problems = self.check(datastore, model)
        if not problems:
            return self
        log.warning(
            "%s was calibrated for another setup: %s; drafting with the uncalibrated defaults "
            "(run `sssd calibrate` for this datastore and model)",
            self.where,
            "; ".join(problems),
        )
        return DrafterConfig()


def select_entry(budgets: list[int], budget: int) -> int:
    """Of increasing calibrated `budgets`, the one whose entry drafts at `budget`."""
    i = int(np.searchsorted(budgets, budget, side="right")) - 1
    return budgets[max(i, 0)]


def entries_of(config: DrafterConfig | CalibrationFile) -> dict[int, DrafterConfig]:
    """Budget -> config of a CalibrationFile, or {0: config} for a single DrafterConfig (every budget)."""
    if isinstance(config, CalibrationFile):
        return dict(config.entries)
    if isinstance(config, DrafterConfig):
        return {0: config}
    raise TypeError(f"a drafter config is a DrafterConfig or a CalibrationFile, got {type(config).__name__}")


def drafter_config_for(entries: dict[int, DrafterConfig]) -> DrafterConfig:
    """The config of a Drafter that drafts with every entry (``Drafter.draft(config=...)``): the
    largest budget's entry, with request tries as deep as the deepest entry's input source."""
    cfgs = list(entries.values())
    return cfgs[-1].replace(
        use_datastore=any(c.use_datastore for c in cfgs),
        use_input=any(c.use_input for c in cfgs),
        input_max_match=max(c.input_max_match for c in cfgs),
        input_branch_len=max(c.input_branch_len for c in cfgs),
        input_max_nodes=max(c.input_max_nodes for c in cfgs),
        copy_max_branch_len=max(c.copy_max_branch_len for c in cfgs),
        copy_max_tokens=max(c.copy_max_tokens for c in cfgs),
    )


def load_drafter(drafter: Any) -> DrafterConfig | CalibrationFile:
    """What an engine's `drafter` argument names: None -> DrafterConfig(); a DrafterConfig or
    CalibrationFile as is; a path -> its calibration file (every entry) or saved DrafterConfig.

    Raises:
        ValueError: the file is unreadable or malformed (see ``CalibrationFile.load``).
    """
    if drafter is None:
        return DrafterConfig()
    if isinstance(drafter, (DrafterConfig, CalibrationFile)):
        return drafter
    if not isinstance(drafter, (str, Path)):
        raise TypeError(f"drafter must be a DrafterConfig, a CalibrationFile or a path, got {type(drafter).__name__}")
    d = read_json_object(drafter, "drafter config")
    if d.get("format") == CALIBRATION_FORMAT:
        return CalibrationFile.from_dict(d, where=str(drafter))
    return DrafterConfig.load(drafter)


# -- identities ----------------------------------------------------------------------


def datastore_identity(datastore: Any) -> tuple[str | None, str | None]:
    """(content fingerprint, tokenizer sha256) of a Datastore, a datastore directory or archive,
    or "default"; (None, None) for None or a datastore that cannot be opened."""
    if datastore is None:
        return None, None
    manifest: dict[str, Any] = {}
    fp = None
    try:
        if isinstance(datastore, Datastore):
            manifest = datastore.manifest
            fp = manifest.get("fingerprint") or f"{datastore.native.fingerprint:016x}"
        else:
            path = Path(datastore).expanduser()
            if isinstance(datastore, str) and datastore == DEFAULT:
                path = built_default_path()
            if path.is_dir():  # the manifest tells; no need to map the data
                manifest = read_manifest(path)
                fp = manifest.get("fingerprint")
            if fp is None:  # an archive, or a manifest without a fingerprint
                ds = Datastore.open(path)
                manifest, fp = ds.manifest, f"{ds.native.fingerprint:016x}"
    except (OSError, TypeError, DatastoreError):  # TypeError: not a datastore nor a path
        return None, None
    tok = (manifest.get("tokenizer") or {}).get("sha256")
    return fp, tok


def _model_tokenizer(model: Any) -> str | None:
    """sha256 of the model's tokenizer, or None if it cannot be loaded."""
    if model is None:
        return None
    folder = Path(str(model)).expanduser()
    if not (folder / "config.json").is_file():
        try:
            spec = get_spec(str(model))
            if not is_pulled(spec.name):
                return None
            folder = model_path(spec.name)
        except (ValueError, KeyError):
            return None
    try:
        return load_tokenizer(folder).sha256
    except (ValueError, OSError):
        return None


def _short(identity: str) -> str:
    kind, _, digest = identity.partition(":")
    return f"{kind}:{digest[:12]}" if digest else identity[:12]


def _budget_key(key: Any, where: str) -> int:
    try:
        b = int(key)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: malformed calibration file (budget {key!r} is not an integer)") from None
    if not 1 <= b <= int(_core.MAX_BUDGET):
        raise ValueError(f"{where}: malformed calibration file (budget {b} is outside [1, {int(_core.MAX_BUDGET)}])")
    return b


def source_discount(config: Any, key: str | None) -> SourceDiscount | None:
    """The discount a calibration file fitted for the draft source of calibration key `key`
    (None: not a CalibrationFile, no key, or nothing fitted for it)."""
    if key is None or not isinstance(config, CalibrationFile):
        return None
    return config.sources.get(key)


def _source_discounts(raw: Any, where: str) -> dict[str, SourceDiscount]:
    """The "sources" object of a file: key -> SourceDiscount, or ValueError."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: malformed calibration file (sources is not an object)")
    out = {}
    for key, entry in raw.items():
        d = entry.get("discount") if isinstance(entry, dict) else None
        if not isinstance(d, dict):
            raise ValueError(f'{where}: malformed calibration file (source {key!r}: no "discount" object)')
        try:
            disc = SourceDiscount(**d)
        except TypeError as e:
            raise ValueError(f"{where}: malformed calibration file (source {key!r}: {e})") from None
        numbers = (disc.scale, disc.depth_decay, disc.match_damping)
        if (
            any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
                for v in numbers
            )
            or isinstance(disc.full_match, bool)
            or not isinstance(disc.full_match, int)
            or disc.full_match < 0
        ):
            raise ValueError(
                f"{where}: malformed calibration file (source {key!r}: discount {d!r} is not "
                f"positive finite factors and a match length >= 0)"
            )
        out[str(key)] = disc
    return out


def _entry(entry: Any, budget: int, curves: Calibration | None, where: str) -> tuple[DrafterConfig, float | None]:
    """One budget's DrafterConfig (curves attached if calibrated) and its MAT, or ValueError."""
    bad = f"{where}: malformed calibration file (budget {budget}"
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        raise ValueError(f'{bad}: an entry is an object with a "config" object)')
    try:
        cfg = DrafterConfig.from_dict(entry["config"]).replace(budget=budget)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"{bad}: {e})") from None
    calibrated = entry.get("calibrated", False)
    if not isinstance(calibrated, bool):
        raise ValueError(f"{bad}: calibrated is {calibrated!r}, not true or false)")
    if calibrated:
        if curves is None:
            raise ValueError(f"{where}: budget {budget} is marked calibrated but the file holds no curves")
        cfg = cfg.replace(discounts=dataclasses.replace(cfg.discounts, calibration=curves))
    mat = entry.get("mat")
    if mat is not None and (
        isinstance(mat, bool) or not isinstance(mat, (int, float)) or not math.isfinite(mat) or mat < 1
    ):
        raise ValueError(f"{bad}: mat is {mat!r}, not a number >= 1)")
    return cfg, None if mat is None else float(mat)


def _config_for_budget(d: dict[str, Any], where: str, budget: int | None) -> DrafterConfig:
    """DrafterConfig.load's reader of these files: the config for `budget` (None: the file's default budget)."""
    return CalibrationFile.from_dict(d, where=where).config(budget)


# DrafterConfig.load (sssd.config, below this module: it never imports it) reads these files with it.
register_config_format(CALIBRATION_FORMAT, _config_for_budget)


__all__ = [
    "CalibrationFile",
    "Fingerprint",
    "datastore_identity",
    "drafter_config_for",
    "entries_of",
    "load_drafter",
    "model_fingerprint",
    "select_entry",
    "source_discount",
]
