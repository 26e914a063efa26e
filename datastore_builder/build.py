"""Building a datastore from corpora: read, tokenize, index, checksum, rename.

Stages (each timed, each with a progress bar on a terminal):

1. read: stream records from every input (the readers package), pick the turns
   (all or the assistant's), hold out the evaluation split, drop empty and
   (with dedup) duplicate documents;
2. tokenize: batch-encode the documents on all cores into one uint32 stream,
   a separator after each document (tokenize.py); read and tokenize
   alternate batch by batch, so the corpus text is never all in memory;
3. index: sort the suffix array and write the binary files (tokens.bin,
   suffix_array.bin, ...: sssd.datastore.DATA_FILES) with the native core;
4. checksum: sha256 of every file, recorded in manifest.json.

Everything is written into a temporary sibling directory
(``.<name>.building-<pid>-*``, sssd.files.atomic_directory) that is renamed
onto the output only when complete; any failure or interrupt removes it, so
nothing half-written ever loads. Temporaries of killed builds (dead pid) are
removed by the next build.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from sssd import _core
from sssd.datastore import DATA_FILES, FORMAT_VERSION, MANIFEST, DatastoreError, write_manifest
from sssd.datastore_builder.readers import CorpusError, Fields, Source, SourceStats, read_source, resolve_inputs
from sssd.datastore_builder.sharegpt import HoldoutRule, select_turns
from sssd.datastore_builder.tokenize import BATCH_DOCS, StageClock, tokenize_documents
from sssd.files import atomic_directory, file_sha256
from sssd.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer

HELDOUT_FILE = "heldout.jsonl"
#: Set to "<stage>:fail" or "<stage>:pause" to fail or stop a build after a
#: stage (read, tokenize, index, checksum, manifest); for testing atomicity.
FAULT_ENV = "SSSD_BUILD_FAULT"
#: The temporary directory of a build is ``.<output name>.<TEMP_TAG>-<pid>-<random>``.
TEMP_TAG = "building"


@dataclass
class BuildConfig:
    """What to build, from what, and how.

    Attributes:
        inputs: files, directories, glob patterns, or "-" (stdin).
        output: the datastore directory to create.
        tokenizer: a tokenizer spec (tokenizer.json, model folder, .gguf) or a Tokenizer.
        format: "auto" or one of readers.FORMATS (applies to every input).
        fields: where the text is in records; which roles; how text splits.
        holdout_every: hold out every holdout_every-th conversation, all its parts (0: none; see HoldoutRule).
        dedup: drop exact-duplicate documents.
        strict: fail on the first bad record instead of skipping it.
        overwrite: replace an existing datastore at ``output``.
        compress: also write ``<output>.sssd.zst``.
        num_threads: threads for the suffix sort (0: all cores).
        batch_docs: documents per tokenizer batch.
        progress: show progress bars (only when stderr is a terminal).
        stdin: the stream "-" reads (default: sys.stdin.buffer).
        log: where notices go (default: stderr).
    """

    inputs: list[str]
    output: str | Path
    tokenizer: Any
    format: str = "auto"
    fields: Fields = field(default_factory=Fields)
    holdout_every: int = 0
    dedup: bool = False
    strict: bool = False
    overwrite: bool = False
    compress: bool = False
    num_threads: int = 0
    batch_docs: int = BATCH_DOCS
    progress: bool = True
    stdin: BinaryIO | None = None
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))
    extra: dict[str, Any] = field(default_factory=dict)  # more manifest "build" fields


@dataclass
class BuildResult:
    path: Path
    manifest: dict[str, Any]
    stages: dict[str, float]
    sources: list[SourceStats]
    archive: Path | None = None

    @property
    def index_bytes_per_token(self) -> float:
        files = self.manifest["files"]
        return sum(files[n]["bytes"] for n in DATA_FILES) / max(1, self.manifest["num_tokens"])

    def summary(self) -> str:
        """The one-line summary: tokens, documents, bytes per token, seconds per stage."""
        m = self.manifest
        total_bytes = sum(f["bytes"] for f in m["files"].values())
        stages = ", ".join(f"{k} {v:.1f}" for k, v in self.stages.items())
        line = (
            f"built {self.path}: {m['num_tokens']:,} tokens, {m['num_docs']:,} documents, "
            f"{self.index_bytes_per_token:.2f} bytes/token index ({total_bytes / 2**20:,.1f} MiB on disk); "
            f"seconds: {stages}"
        )
        if self.archive:
            line += f"; archive {self.archive} ({self.archive.stat().st_size / 2**20:,.1f} MiB)"
        return line


def build_datastore(cfg: BuildConfig) -> BuildResult:
    """Builds a datastore directory atomically. See the module docstring.

    Raises:
        FileNotFoundError / PermissionError: an input is missing or unreadable.
        FileExistsError: the output exists and overwrite is False, or is not a datastore.
        CorpusError (ValueError): unreadable corpus, unknown fields, empty corpus, bad record under strict.
        ValueError: the tokenizer cannot be loaded or produces ids beyond 2^32 - 2.
        OSError: not enough disk space or another I/O failure (nothing is left behind).
        DatastoreError: the native writer failed (e.g. disk full).
    """
    t_start = time.perf_counter()
    clock = StageClock()
    output = Path(cfg.output).expanduser().absolute()
    _check_output(output, cfg.overwrite)
    sources = resolve_inputs(cfg.inputs, cfg.format)
    if cfg.fields.roles != "all" and any(s.kind == "text" for s in sources):
        raise CorpusError(f"--roles {cfg.fields.roles} needs chat messages, but plain text inputs have no roles")
    holdout = HoldoutRule(cfg.holdout_every)
    t0 = time.perf_counter()
    tok = load_tokenizer(cfg.tokenizer)
    clock.add("load tokenizer", time.perf_counter() - t0)
    bars = _Bars(cfg.progress)

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(output)
    except OSError as e:
        raise OSError(e.errno, f"cannot create the datastore in {output.parent}: {e.strerror or e}") from None
    stats: list[SourceStats] = []
    tmp = None
    try:
        with atomic_directory(
            output, replace=True, tag=TEMP_TAG
        ) as tmp:  # renamed onto output at the end, else removed
            # 1 + 2. read and tokenize, batch by batch.
            with _heldout_writer(tmp if holdout.every else None) as heldout:
                docs = _documents(sources, cfg, holdout, heldout, stats, bars)
                with bars.bar("tokenize", unit=" docs") as tbar:
                    done = [0]

                    def on_batch(num_docs: int, num_tokens: int) -> None:
                        done[0] += num_tokens
                        tbar.set_postfix_str(f"{done[0]:,} tokens", refresh=False)
                        tbar.update(num_docs)

                    tokens = tokenize_documents(
                        docs, tok, batch_docs=cfg.batch_docs, clock=clock, memoize=not cfg.dedup, on_batch=on_batch
                    )
            bars.close_read()
            for st in stats:
                cfg.log(f"sssd build: {st.summary()}")
            num_docs = sum(st.documents for st in stats)
            if num_docs == 0:
                raise CorpusError(
                    "empty corpus: the inputs gave no documents (" + "; ".join(st.summary() for st in stats) + ")"
                )
            _fault("tokenize")

            # 3. index.
            t0 = time.perf_counter()
            _check_space(tmp, tokens.shape[0])
            # The sort reports only its start and end: a ticking bar shows that it runs.
            with bars.bar("sort", unit=" suffixes", unit_scale=True) as sbar, _ticking(sbar):

                def sort_progress(done: int, total: int) -> None:
                    sbar.total = total
                    sbar.n = done
                    sbar.refresh()

                try:
                    _write_index(tokens, tmp, cfg.num_threads, sort_progress)
                except _core.SSSDError as e:
                    raise DatastoreError(f"{e}; the partial build was removed") from None
            tok.save(tmp / TOKENIZER_FILE)
            st_native = _core.stream_stats(tokens, cfg.num_threads)
            clock.add("index", time.perf_counter() - t0)
            _fault("index")

            # 4. checksums and manifest.
            t0 = time.perf_counter()
            names = [*DATA_FILES, TOKENIZER_FILE] + ([HELDOUT_FILE] if holdout.every else [])
            files = _checksums(tmp, names, bars)
            clock.add("checksum", time.perf_counter() - t0)
            _fault("checksum")
            stages = {k: round(v, 3) for k, v in clock.seconds.items()}
            manifest = _manifest(
                cfg, output, tok, tokens, st_native, files, stats, holdout, stages, time.perf_counter() - t_start
            )
            write_manifest(tmp, manifest)
            _fault("manifest")
    except OSError as e:
        if tmp is None:
            raise OSError(e.errno, f"cannot create the datastore in {output.parent}: {e.strerror or e}") from None
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(
                e.errno,
                f"no space left on the device holding {output.parent} "
                f"({e.strerror or e}); the partial build was removed",
            ) from None
        raise
    finally:
        bars.close()

    result = BuildResult(output, manifest, dict(stages, total=round(time.perf_counter() - t_start, 3)), stats)
    if cfg.compress:
        from sssd.datastore_builder.archive import archive_path_for, pack

        t0 = time.perf_counter()
        total = sum(f["bytes"] for f in files.values())
        with bars.bar("compress", total=total, unit="B", unit_scale=True) as cbar:
            result.archive = pack(output, archive_path_for(output), progress=cbar.update)
        result.stages["compress"] = round(time.perf_counter() - t0, 3)
    return result


# -- stages -----------------------------------------------------------------------------


def _documents(
    sources: list[Source],
    cfg: BuildConfig,
    holdout: HoldoutRule,
    heldout: BinaryIO | None,
    stats: list[SourceStats],
    bars: _Bars,
) -> Iterator[str]:
    """The documents of all sources in order; fills ``stats`` and writes held-out records."""
    known = [s.size for s in sources]
    bars.open_read(sum(known) if all(k is not None for k in known) else None)
    seen: set[bytes] = set()
    index = 0
    for src in sources:
        st = SourceStats(src.kind, src.path, strict=cfg.strict)
        stats.append(st)
        for rec in read_source(src, cfg.fields, st, bars.read_bytes, stdin=cfg.stdin):
            i = index
            index += 1
            if rec.problem:
                st.skip(rec.problem, rec.where or f"record {i}")
                continue
            for problem in rec.turn_problems:
                st.skip(problem, f"record {i}")
            if holdout(rec.id):
                st.heldout += 1
                heldout.write(_heldout_line(i, rec, src.path))
                continue
            for turn in select_turns(rec.turns, cfg.fields.roles):
                text = turn.text
                if not text.strip():
                    st.empty += 1
                    continue
                if cfg.dedup:
                    key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
                    if key in seen:
                        st.duplicates += 1
                        continue
                    seen.add(key)
                st.documents += 1
                yield text
        _fault("read")


def _heldout_line(index: int, rec, source: str) -> bytes:
    turns = [{"role": t.role, "assistant": t.is_assistant, "text": t.text} for t in rec.turns]
    return (
        json.dumps({"index": index, "id": rec.id, "source": source, "turns": turns}, ensure_ascii=False) + "\n"
    ).encode("utf-8", "surrogatepass")


@contextmanager
def _heldout_writer(directory: Path | None):
    if directory is None:
        yield None
        return
    with open(directory / HELDOUT_FILE, "wb") as f:
        yield f


def _write_index(tokens: np.ndarray, directory: Path, num_threads: int, progress) -> None:
    """Sorts the suffix array and writes both binary files (the native core)."""
    _core.Datastore.write(tokens, str(directory), num_threads, progress)


def _checksums(directory: Path, names: list[str], bars: _Bars) -> dict[str, dict[str, Any]]:
    total = sum((directory / n).stat().st_size for n in names)
    out = {}
    with bars.bar("checksum", total=total, unit="B", unit_scale=True) as bar:
        for name in names:
            out[name] = {
                "bytes": (directory / name).stat().st_size,
                "sha256": file_sha256(directory / name, progress=bar.update),
            }
    return out


def _manifest(
    cfg: BuildConfig,
    output: Path,
    tok: Tokenizer,
    tokens: np.ndarray,
    st: dict,
    files: dict,
    stats: list[SourceStats],
    holdout: HoldoutRule,
    stages: dict[str, float],
    seconds: float,
) -> dict[str, Any]:
    import tokenizers

    from sssd import __version__

    n = int(st["count"])
    index_files = sum(files[name]["bytes"] for name in DATA_FILES)
    identity = dict(
        tok.identity(),
        path=str(output / TOKENIZER_FILE),
        file=TOKENIZER_FILE,
        spec=str(cfg.tokenizer) if not isinstance(cfg.tokenizer, Tokenizer) else str(tok.path or tok.name),
    )
    manifest: dict[str, Any] = {
        # The fields sssd.Datastore.build writes, in the same form.
        "format": "sssd-datastore",
        "format_version": FORMAT_VERSION,
        "num_tokens": n,
        "num_docs": int(st["num_docs"]),
        "vocab_size": int(st["vocab_size"]),
        "fingerprint": f"{int(st['fingerprint']):016x}",
        "index_bytes": 4 if n < (1 << 32) - 2 else 8,
        "created_unix": int(time.time()),
        "build_seconds": round(seconds, 3),
        "files": files,
        # What the builder adds.
        "tokenizer": identity,
        "source": [s.to_dict() for s in stats],
        "build": {
            "inputs": list(cfg.inputs),
            "format": cfg.format,
            "roles": cfg.fields.roles,
            "messages_field": cfg.fields.messages_field,
            "text_fields": list(cfg.fields.text_fields),
            "text_split": cfg.fields.text_split,
            "max_record_bytes": cfg.fields.max_record_bytes,
            "holdout_every": holdout.every,
            "dedup": cfg.dedup,
            "strict": cfg.strict,
            "tokenizer_spec": identity["spec"],
            "batch_docs": cfg.batch_docs,
            "num_threads": cfg.num_threads,
            "documents_per_separator": "one document per turn (chat) / field / file, paragraph or line (text)",
            "stage_seconds": stages,
            "index_bytes_per_token": round(index_files / max(1, n), 4),
            "versions": {
                "sssd": __version__,
                "tokenizers": tokenizers.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
            **cfg.extra,
        },
    }
    if holdout.every:
        manifest["holdout"] = {
            "rule": holdout.describe(),
            "every": holdout.every,
            "count": sum(s.heldout for s in stats),
            "file": HELDOUT_FILE,
        }
    return manifest


# -- safety -----------------------------------------------------------------------------


def _check_output(output: Path, overwrite: bool) -> None:
    if not output.exists():
        return
    if not overwrite:
        raise FileExistsError(f"{output} already exists (pass --overwrite to replace it)")
    if not output.is_dir() or (any(output.iterdir()) and not (output / MANIFEST).is_file()):
        raise FileExistsError(f"refusing to replace {output}: it is not a datastore directory")


def _remove_stale_temporaries(output: Path) -> None:
    """Removes ``.<name>.building-<pid>-*`` directories left by builds that were killed."""
    prefix = f".{output.name}.{TEMP_TAG}-"
    for p in output.parent.glob(prefix + "*"):
        pid = p.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass


def _check_space(directory: Path, num_tokens: int) -> None:
    index = 4 if num_tokens < (1 << 32) - 2 else 8
    need = num_tokens * (4 + index) + (1 << 20)
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"not enough disk space in {directory.parent}: the datastore needs about "
            f"{need / 2**20:,.0f} MiB, {free / 2**20:,.0f} MiB are free",
        )


def _fault(stage: str) -> None:
    """Test hook: fails or pauses after ``stage`` if $SSSD_BUILD_FAULT says so."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec.startswith(stage + ":"):
        return
    action = spec.split(":", 1)[1]
    if action == "fail":
        raise RuntimeError(f"injected failure after the {stage} stage ({FAULT_ENV})")
    if action == "pause":
        print(f"sssd build: paused after the {stage} stage ({FAULT_ENV})", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(0.05)


@contextmanager
def terminate_as_interrupt():
    """Turns SIGTERM into KeyboardInterrupt while building, so temporaries get removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# -- progress bars ------------------------------------------------------------------------


@contextmanager
def _ticking(bar, every: float = 0.5):
    """Redraws `bar` (its elapsed time) every `every` seconds while the body runs, for work
    that reports no progress of its own (the native call releases the GIL)."""
    if getattr(bar, "disable", True):
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="sssd-build-ticker", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()


class _Bars:
    """tqdm bars on stderr, only when it is a terminal and progress is wanted."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self._read = None

    def bar(self, desc: str, **kwargs):
        from tqdm import tqdm

        return tqdm(desc=desc, file=sys.stderr, disable=not self.enabled, leave=False, dynamic_ncols=True, **kwargs)

    def open_read(self, total: int | None) -> None:
        self._read = self.bar("read", total=total, unit="B", unit_scale=True, position=1)

    def read_bytes(self, n: int) -> None:
        if self._read is not None and n:
            self._read.update(n)

    def close_read(self) -> None:
        if self._read is not None:
            self._read.close()
            self._read = None

    def close(self) -> None:
        self.close_read()
