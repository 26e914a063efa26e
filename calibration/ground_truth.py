"""Ground truth for replay: what a target model outputs under plain greedy
decoding, saved as JSONL with the model's and tokenizer's identity.

This module is the file format (``Writer``, ``read_file``, ``load_groundtruth``),
the prompts (``prompt_ids``, the chat template applied with
``add_generation_prompt=True``) and stops (``stop_ids``), the reference decoder
(``greedy_generate``: transformers' ``generate``, batch 1), ``record``, and the
contamination sidecar. ``record`` writes the format from recorded answers (the
ShareGPT held-out split) without running the model. Generating with a model
(``sssd groundtruth``: sssd.commands._generate.generate, through SSSD's engine or
``greedy_generate``) is the command line's: calibration never imports the engine.
Both resume: ids already in the output file are skipped, new records are
appended and fsync'ed one by one, and a torn last line (a run killed mid-write)
is cut off first.

File format (JSON lines)::

    {"format": "sssd-groundtruth", "version": 1, "dataset": ...,
     "model": {"name", "path", "sha256", ...}, "tokenizer": {sssd Tokenizer.identity()},
     "generation": {"mode": "greedy"|"recorded", "max_new_tokens", "dtype", "stop_ids",
                    "chat_template", "batch_size", "versions"}, "created": ...}
    {"id", "prompt_ids", "output_ids", "finish": "eos"|"length", "seconds"}
    ...

``output_ids`` include the final stop token when generation stopped on it
(finish "eos"). Files live by default at
``<sssd cache>/groundtruth/<model>/<dataset>.jsonl`` (``default_path``).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sssd.cache import cache_dir
from sssd.calibration.datasets import ContaminationReport, PromptRecord, contamination
from sssd.calibration.replay import Example
from sssd.drafter import resolve_datastore
from sssd.files import open_regular
from sssd.models import _lookup, _versions, model_identity, resolve_model
from sssd.tokenizer import load_tokenizer

FORMAT = "sssd-groundtruth"
VERSION = 1
#: Special tokens that end an assistant turn in common chat templates (in order of preference).
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>")
#: Header fields a resumed file must share with the new run.
_RESUME_KEYS = (
    "dataset",
    "model.sha256",
    "tokenizer.sha256",
    "generation.mode",
    "generation.max_new_tokens",
    "generation.dtype",
    "generation.stop_ids",
    "generation.chat_template",
)

Log = Callable[[str], None]


def log_to_stderr(msg: str) -> None:
    """The default ``log`` of a run: a line on stderr."""
    print(msg, file=sys.stderr, flush=True)


@dataclass
class GroundTruthExample(Example):
    """An Example (prompt and output token ids) with its record id and how it finished."""

    id: str = ""
    finish: str = ""


@dataclass
class Summary:
    """What a ``generate``/``record`` run did (``new`` records this run, ``total`` in the file)."""

    path: Path
    mode: str = "greedy"
    total: int = 0
    new: int = 0
    skipped: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    finish: dict[str, int] = field(default_factory=dict)
    mean_output_len: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {
            "path": str(self.path),
            "mode": self.mode,
            "records": self.total,
            "new": self.new,
            "resumed_past": self.skipped,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 1),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "finish": self.finish,
            "mean_output_len": round(self.mean_output_len, 1),
        }
        if self.mode == "recorded":
            del out["tokens_per_second"]
        return out


# -- locations -----------------------------------------------------------------


def default_dir() -> Path:
    """<sssd cache>/groundtruth."""
    return cache_dir() / "groundtruth"


def model_label(model: str | os.PathLike) -> str:
    """A model's name for file paths: its registry name, else its folder's name."""
    spec = _lookup(str(model))
    if spec is not None and not (Path(model).expanduser() / "config.json").is_file():
        return spec.name
    return Path(model).expanduser().resolve().name


def default_path(model: str | os.PathLike, dataset: str) -> Path:
    """Where ``sssd groundtruth`` writes: <sssd cache>/groundtruth/<model>/<dataset>.jsonl."""
    return default_dir() / model_label(model) / f"{dataset}.jsonl"


# -- tokens --------------------------------------------------------------------


def stop_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """Token ids that end generation: the tokenizer's EOS, the model's generation-config EOS,
    and any END_OF_TURN_TOKENS the tokenizer has as special tokens."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    add(getattr(tokenizer, "eos_token_id", None))
    gen = getattr(model, "generation_config", None) if model is not None else None
    if gen is not None:
        add(getattr(gen, "eos_token_id", None))
    for tok in END_OF_TURN_TOKENS:
        add(_special_id(tokenizer, tok))
    return ids


def _special_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` if the tokenizer has it as a special token (unknown tokens map to None, not unk)."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(tid, int) or tokenizer.convert_ids_to_tokens(tid) != token:
        return None
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, t in added.items() if getattr(t, "special", False)}
    return tid if tid in special else None


def end_of_turn_id(tokenizer: Any) -> int:
    """The token that closes an assistant turn in the chat template (EOS if none of END_OF_TURN_TOKENS)."""
    for tok in END_OF_TURN_TOKENS[:4]:
        tid = _special_id(tokenizer, tok)
        if tid is not None:
            return tid
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("the tokenizer has no end-of-turn or EOS token")
    return int(tokenizer.eos_token_id)


def prompt_ids(tokenizer: Any, messages: Sequence[dict], chat_template: bool = True) -> list[int]:
    """Token ids of a prompt: the chat template with ``add_generation_prompt=True`` (its special
    tokens, BOS included, come from the template text), or without a template the messages'
    contents joined by blank lines, with the tokenizer's own special tokens."""
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template (a base model?); use chat_template=False "
                "(--no-chat-template) to prompt with the plain text"
            )
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n\n".join(str(m.get("content") or "") for m in messages)
    return list(tokenizer(text)["input_ids"])


def greedy_generate(
    model: Any, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int] = ()
) -> tuple[list[int], str]:
    """Plain greedy decoding, batch 1, by transformers' own ``generate`` (the reference engine;
    its public API, so no dependence on how a model's forward names its cache).

    Returns:
        (output ids, "eos" if it stopped on a token in ``stop``, which is included, else "length").
    """
    import torch
    from transformers import GenerationConfig

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt) == 0:
        raise ValueError("empty prompt")
    stops = sorted({int(s) for s in stop})
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        num_beams=1,
        eos_token_id=stops or None,
        pad_token_id=stops[0] if stops else 0,
    )
    with torch.no_grad():
        seq = model.generate(torch.tensor([list(prompt)], dtype=torch.long), generation_config=config)
    out = seq[0, len(prompt) :].tolist()
    return out, "eos" if out and out[-1] in stops else "length"


# -- files ---------------------------------------------------------------------


def read_file(path: str | Path, *, repair: bool = False) -> tuple[dict, list[dict]]:
    """The header and records of a ground-truth file.

    A last line without a newline (a run killed mid-write) is ignored, and with ``repair`` cut
    off the file, so that appending continues cleanly.

    Raises:
        ValueError: not a ground-truth file, or a corrupt line before the last.
    """
    path = Path(path)
    with open_regular(path) as f:  # a FIFO or device is refused, never waited on
        data = f.read()
    size = len(data)
    end = data.rfind(b"\n") + 1
    if end < len(data):
        if repair:
            with open(path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        data = data[:end]
    try:
        lines = data.decode("utf-8-sig").splitlines()  # a byte-order mark (an editor's) is not part of the header
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not an {FORMAT} file (not UTF-8 text near byte {e.start:,})") from None
    if not lines:
        what = "is empty" if not size else "has no complete line"
        raise ValueError(f"{path} {what}: not a ground-truth file (delete it to start over)")
    try:
        header = json.loads(lines[0])
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path} is not an {FORMAT} file (its first line is not the header)")
    if header.get("version") != VERSION:
        raise ValueError(f"{path} is {FORMAT} version {header.get('version')}; this sssd reads version {VERSION}")
    records = []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: corrupt record ({e})") from None
        records.append(rec)
    return header, records


def load_groundtruth(path: str | Path, tokenizer: Any = None) -> tuple[dict, list[GroundTruthExample]]:
    """Reads a ground-truth file as replay examples.

    Args:
        path: a file written by ``generate``/``record`` (``sssd groundtruth``).
        tokenizer: if given, the file must have been made with this tokenizer: a Tokenizer, anything
            ``sssd.tokenizer.load_tokenizer`` accepts, a registry model name, or a Datastore (its
            recorded tokenizer).

    Returns:
        (header, examples in file order; each has .prompt, .output, .id, .finish).

    Raises:
        ValueError: not a ground-truth file, or made with another tokenizer (the message names both).
    """
    header, records = read_file(path)
    if tokenizer is not None:
        want = _tokenizer_identity(tokenizer)
        have = header.get("tokenizer") or {}
        if have.get("sha256") != want.get("sha256"):
            raise ValueError(
                f"tokenizer mismatch: ground truth {path} was made with tokenizer {have.get('name')!r} "
                f"(sha256 {str(have.get('sha256'))[:12]}, vocab {have.get('vocab_size')}) but the given tokenizer is "
                f"{want.get('name')!r} (sha256 {str(want.get('sha256'))[:12]}, vocab {want.get('vocab_size')}); "
                "its token ids would not match"
            )
    examples = [
        GroundTruthExample(
            prompt=np.asarray(r["prompt_ids"], dtype=np.int32),
            output=np.asarray(r["output_ids"], dtype=np.int32),
            id=str(r["id"]),
            finish=str(r.get("finish", "")),
        )
        for r in records
    ]
    return header, examples


def _tokenizer_identity(tokenizer: Any) -> dict:
    manifest = getattr(tokenizer, "manifest", None)
    if isinstance(manifest, dict):  # a Datastore
        tok = manifest.get("tokenizer") or {}
        if not tok.get("sha256"):
            raise ValueError(f"datastore {getattr(tokenizer, 'path', '')} records no tokenizer to check against")
        return tok
    if isinstance(tokenizer, str) and not Path(tokenizer).expanduser().exists():
        if _lookup(tokenizer) is not None:
            tokenizer = resolve_model(tokenizer, pull_missing=False)
    return load_tokenizer(tokenizer).identity()


class Writer:
    """Opens (or resumes) a ground-truth file and appends records durably."""

    def __init__(self, path: Path, header: dict, overwrite: bool, log: Log):
        self.path = path
        self.done: dict[str, dict] = {}
        if overwrite and path.exists():
            path.unlink()
        if path.exists():
            old, records = read_file(path, repair=True)
            for key in _RESUME_KEYS:
                a, b = _get(old, key), _get(header, key)
                if a != b:
                    raise ValueError(
                        f"{path} exists but was made with another {key} ({_short(a)}, now {_short(b)}); "
                        "give another --output or --overwrite to start over"
                    )
            self.done = {str(r["id"]): r for r in records}
            if self.done:
                log(f"resuming {path}: {len(self.done)} records already there")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                f.write(json.dumps(header) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        self._f = open(path, "a")

    def append(self, rec: dict) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done[str(rec["id"])] = rec

    def close(self) -> None:
        self._f.close()


def _get(d: dict, dotted: str) -> Any:
    for k in dotted.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:37] + "..."


# -- runs ----------------------------------------------------------------------


def record(
    model: str | os.PathLike,
    records: Sequence[PromptRecord],
    output: str | Path | None = None,
    *,
    dataset: str | None = None,
    max_new_tokens: int | None = None,
    chat_template: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    log: Log = log_to_stderr,
) -> Summary:
    """Writes ground truth from recorded answers (each record's ``reference``), no generation.

    The prompt is the chat template of the conversation so far (as ``generate`` renders it); the
    output is the tokenized answer followed by the template's end-of-turn token (finish "eos"),
    or its first ``max_new_tokens`` tokens (finish "length") if capped. Only the model's tokenizer
    and chat template are used; its weights are not loaded.
    """
    records, dataset = check_records(records, dataset)
    missing = [r.id for r in records if not r.reference]
    if missing:
        raise ValueError(f"{len(missing)} records have no recorded answer (e.g. {missing[0]!r})")
    folder = resolve_model(model, log=log)
    tokenizer = _hf_tokenizer(folder)
    eot = end_of_turn_id(tokenizer)
    out_path = Path(output) if output is not None else default_path(model, dataset)
    header = file_header(
        dataset,
        model,
        folder,
        load_tokenizer(folder),
        {
            "mode": "recorded",
            "max_new_tokens": max_new_tokens,
            "dtype": None,
            "stop_ids": [eot],
            "chat_template": chat_template,
            "batch_size": 1,
            "engine": None,
        },
    )
    writer = Writer(out_path, header, overwrite, log)
    summary = Summary(out_path, mode="recorded", skipped=sum(1 for r in records if r.id in writer.done))
    todo = [r for r in records if r.id not in writer.done]
    bar = progress_bar(
        progress, total=len(records), initial=len(records) - len(todo), desc=f"{dataset} recorded", unit="prompt"
    )
    t_start = time.perf_counter()
    try:
        for rec in todo:
            ids = prompt_ids(tokenizer, rec.messages, chat_template)
            out = list(tokenizer(rec.reference, add_special_tokens=False)["input_ids"])
            if max_new_tokens is not None and len(out) >= max_new_tokens:
                out, finish = out[:max_new_tokens], "length"
            else:
                out, finish = out + [eot], "eos"
            writer.append({"id": rec.id, "prompt_ids": ids, "output_ids": out, "finish": finish, "seconds": 0.0})
            summary.new += 1
            summary.new_tokens += len(out)
            bar.update(1)
    finally:
        bar.close()
        writer.close()
    summary.seconds = time.perf_counter() - t_start
    return summarize(summary, writer)


def check_records(records: Sequence[PromptRecord], dataset: str | None) -> tuple[list[PromptRecord], str]:
    """The records as a list, and the prompt set's name (default: the records' dataset); ValueError
    for an empty set or a duplicate id."""
    records = list(records)
    if not records:
        raise ValueError(f"empty prompt set{f' {dataset!r}' if dataset else ''}: nothing to generate")
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"duplicate record id {dup!r} in the prompt set")
    return records, dataset or records[0].dataset


def file_header(dataset: str, model: Any, folder: Path, tok: Any, generation: dict) -> dict:
    """A ground-truth file's header: the prompt set, the model (`model` as named, at `folder`), its
    tokenizer `tok` (an sssd Tokenizer) and how the outputs were made (`generation`)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "dataset": dataset,
        "model": model_identity(folder, name=model_label(model)),
        "tokenizer": tok.identity(),
        "generation": {**generation, "versions": _versions()},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def filled_messages(rec: PromptRecord, done: dict[str, dict], tokenizer: Any, stops: Sequence[int]) -> list[dict]:
    """The record's messages with a None assistant turn replaced by the followed record's output."""
    if not any(m.get("content") is None for m in rec.messages):
        return rec.messages
    prev = done.get(rec.follows or "")
    if prev is None:
        raise ValueError(
            f"record {rec.id!r} follows {rec.follows!r}, which has no output yet (put it earlier in the prompt set)"
        )
    ids = [t for t in prev["output_ids"] if t not in set(stops)]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return [dict(m, content=text) if m.get("content") is None else m for m in rec.messages]


def summarize(summary: Summary, writer: Writer) -> Summary:
    """`summary` completed from the file `writer` wrote (every record, this run's and earlier ones)."""
    summary.total = len(writer.done)
    counts: dict[str, int] = {}
    lengths = []
    for r in writer.done.values():
        counts[r.get("finish", "?")] = counts.get(r.get("finish", "?"), 0) + 1
        lengths.append(len(r["output_ids"]))
    summary.finish = counts
    summary.mean_output_len = float(np.mean(lengths)) if lengths else 0.0
    return summary


def _hf_tokenizer(folder: Path) -> Any:
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def progress_bar(progress: bool, **kwargs: Any):
    """A tqdm bar on stderr (disabled unless `progress`)."""
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=not progress, dynamic_ncols=True, **kwargs)


# -- contamination -------------------------------------------------------------


def contamination_path(path: str | Path) -> Path:
    """The contamination sidecar of a ground-truth file: <name>.contamination.json beside it."""
    path = Path(path)
    return path.with_name(path.stem + ".contamination.json")


def write_contamination(
    path: str | Path, datastore: Any = "default", window: int = 32, threshold: float = 0.5
) -> tuple[Any, Path]:
    """Measures each output's overlap with a datastore and writes the sidecar file.

    The sidecar holds the summary and, per record id, the fraction of its ``window``-token windows
    found verbatim in the datastore (see ``datasets.contamination``); ids at or above
    ``threshold`` are the contaminated subset. Report results on the clean and contaminated
    subsets separately.

    Returns:
        (ContaminationReport, sidecar path).

    Raises:
        ValueError: the datastore's tokenizer differs from the file's.
    """
    ds = resolve_datastore(datastore)
    header, examples = load_groundtruth(path, tokenizer=ds)
    fractions = contamination(examples, ds, window, end_ids=header.get("generation", {}).get("stop_ids") or ())
    report = ContaminationReport(window, fractions)
    sidecar = contamination_path(path)
    data = {
        "groundtruth": str(Path(path).resolve()),
        "dataset": header.get("dataset"),
        "datastore": {"path": str(ds.path), "fingerprint": ds.manifest.get("fingerprint")},
        "window": window,
        "threshold": threshold,
        "summary": report.summary(),
        "contaminated": [e.id for e, f in zip(examples, fractions) if f >= threshold],
        "fractions": {e.id: (None if f != f else round(f, 4)) for e, f in zip(examples, fractions)},
    }
    tmp = sidecar.with_name(f".{sidecar.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, sidecar)
    return report, sidecar


def load_contamination(path: str | Path) -> dict[str, float | None]:
    """Per record id, its contamination fraction, from a ground-truth file's sidecar (or the sidecar itself)."""
    path = Path(path)
    sidecar = path if path.name.endswith(".contamination.json") else contamination_path(path)
    if not sidecar.is_file():
        raise FileNotFoundError(f"no contamination file {sidecar}; make it with `sssd groundtruth ... --contamination`")
    return json.loads(sidecar.read_text())["fractions"]
