"""``sssd groundtruth``'s generation: a target model's greedy outputs for a prompt set, written as a
ground-truth file (sssd.calibration.ground_truth: the format, the prompts, recorded answers, reading
and contamination).

Generating runs the model: through SSSD's own engine (the default: batched, speculative, and in
float32 token-identical to plain greedy decoding) or transformers' ``generate`` (the reference, one
prompt at a time). Running the engine is a front end's work, so it is here, beside the command;
calibration never imports the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sssd
from sssd.cache import default_datastore_path
from sssd.calibration.datasets import PromptRecord
from sssd.calibration.ground_truth import (
    Log,
    Summary,
    Writer,
    check_records,
    default_path,
    file_header,
    filled_messages,
    greedy_generate,
    log_to_stderr,
    progress_bar,
    prompt_ids,
    stop_ids,
    summarize,
)
from sssd.drafter import resolve_datastore
from sssd.errors import DatastoreError
from sssd.models import load_model, resolve_model
from sssd.tokenizer import check_compatible, load_tokenizer


def generate(
    model: str | os.PathLike,
    records: Sequence[PromptRecord],
    output: str | Path | None = None,
    *,
    dataset: str | None = None,
    max_new_tokens: int = 256,
    dtype: str = "float32",
    chat_template: bool = True,
    threads: int | None = None,
    overwrite: bool = False,
    engine: str = "sssd",
    batch_size: int = 16,
    max_model_len: int | None = None,
    progress: bool = True,
    log: Log = log_to_stderr,
) -> Summary:
    """Generates greedy ground truth for a prompt set into a JSONL file (resumable).

    With ``engine="sssd"`` (default) the prompts run through SSSD's own continuous-batching engine
    with speculation, ``batch_size`` at a time: in float32 its greedy output is token-identical
    to plain greedy decoding (tests/test_engine.py proves it against transformers' generate) and
    several times faster on a CPU. ``engine="transformers"`` decodes one prompt at a time with
    the plain model, the reference.

    Args:
        model: a registry name (pulled on demand) or a local Hugging Face model folder.
        records: the prompts (PromptRecord); ids must be unique.
        output: the file (default: ``default_path(model, dataset)``).
        dataset: the prompt set's name (default: the records' dataset).
        max_new_tokens: output cap per prompt (finish "length" when reached).
        dtype: the model's dtype; float32 for exact equality with other float32 decoders.
        chat_template: apply the tokenizer's chat template (False: plain text; base models).
        threads: torch threads (None: torch's default).
        overwrite: start the file over instead of resuming it.
        engine: "sssd" (batched, speculative, exact) or "transformers" (batch 1, plain).
        batch_size: prompts decoded together by the sssd engine.
        max_model_len: the sssd engine's tokens per request (prompt, output and a draft tree); None:
            sized to the longest prompt plus ``max_new_tokens`` (at least the engine's default), so
            that no output is cut short by the engine's length. The model's context caps it.

    Raises:
        ValueError: empty prompt set, duplicate ids, or an existing file from another model,
            tokenizer or generation setting.
    """
    records, dataset = check_records(records, dataset)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if engine not in ("sssd", "transformers"):
        raise ValueError(f"engine must be 'sssd' or 'transformers', got {engine!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out_path = Path(output) if output is not None else default_path(model, dataset)
    if engine == "sssd":
        return _generate_engine(
            model,
            records,
            out_path,
            dataset=dataset,
            max_new_tokens=max_new_tokens,
            dtype=dtype,
            chat_template=chat_template,
            threads=threads,
            overwrite=overwrite,
            batch_size=batch_size,
            max_model_len=max_model_len,
            progress=progress,
            log=log,
        )
    hf_model, tokenizer, folder = load_model(model, dtype, threads=threads, log=log)
    stops = stop_ids(tokenizer, hf_model)
    if not stops:
        raise ValueError(f"model {folder} has no EOS or end-of-turn token to stop at")
    header = file_header(
        dataset,
        model,
        folder,
        load_tokenizer(folder),
        {
            "mode": "greedy",
            "max_new_tokens": max_new_tokens,
            "dtype": dtype,
            "stop_ids": stops,
            "chat_template": chat_template,
            "batch_size": 1,
            "engine": "transformers",
        },
    )
    writer = Writer(out_path, header, overwrite, log)
    summary = Summary(out_path, skipped=sum(1 for r in records if r.id in writer.done))
    todo = [r for r in records if r.id not in writer.done]
    bar = progress_bar(
        progress, total=len(records), initial=len(records) - len(todo), desc=f"{dataset} ground truth", unit="prompt"
    )
    try:
        for rec in todo:
            messages = filled_messages(rec, writer.done, tokenizer, stops)
            ids = prompt_ids(tokenizer, messages, chat_template)
            t0 = time.perf_counter()
            out, finish = greedy_generate(hf_model, ids, max_new_tokens, stops)
            dt = time.perf_counter() - t0
            writer.append(
                {"id": rec.id, "prompt_ids": ids, "output_ids": out, "finish": finish, "seconds": round(dt, 3)}
            )
            summary.new += 1
            summary.new_tokens += len(out)
            summary.seconds += dt
            bar.update(1)
            bar.set_postfix(tok_s=f"{summary.tokens_per_second:.1f}")
    finally:
        bar.close()
        writer.close()
    return summarize(summary, writer)


def _generate_engine(
    model: str | os.PathLike,
    records: list[PromptRecord],
    out_path: Path,
    *,
    dataset: str,
    max_new_tokens: int,
    dtype: str,
    chat_template: bool,
    threads: int | None,
    overwrite: bool,
    batch_size: int,
    max_model_len: int | None,
    progress: bool,
    log: Log,
) -> Summary:
    """``generate`` through SSSD's engine: rounds of ``batch_size`` prompts, each round one
    continuous batch (records that follow another record's output wait for a later round)."""
    folder = resolve_model(model, log=log)
    if max_model_len is None:
        max_model_len = _model_len_for(folder, records, chat_template, max_new_tokens)
    llm = sssd.LLM(
        str(folder),
        datastore=_drafting_datastore(folder, log),
        dtype=dtype,
        threads=threads,
        max_running=batch_size,
        max_model_len=max_model_len,
    )  # sssd.LLM loads the engine (and torch) on first use
    tokenizer = llm.get_tokenizer()
    stops = stop_ids(tokenizer, llm.engine.backend.model)
    if not stops:
        raise ValueError(f"model {folder} has no EOS or end-of-turn token to stop at")
    header = file_header(
        dataset,
        model,
        folder,
        load_tokenizer(folder),
        {
            "mode": "greedy",
            "max_new_tokens": max_new_tokens,
            "dtype": dtype,
            "stop_ids": stops,
            "chat_template": chat_template,
            "batch_size": batch_size,
            "engine": "sssd",
        },
    )
    writer = Writer(out_path, header, overwrite, log)
    summary = Summary(out_path, skipped=sum(1 for r in records if r.id in writer.done))
    todo = [r for r in records if r.id not in writer.done]
    params = sssd.SamplingParams(max_tokens=max_new_tokens, stop_token_ids=tuple(stops))
    bar = progress_bar(
        progress, total=len(records), initial=len(records) - len(todo), desc=f"{dataset} ground truth", unit="prompt"
    )
    try:
        while todo:
            ready = [r for r in todo if not r.follows or r.follows in writer.done]
            if not ready:
                raise ValueError(f"record {todo[0].id!r} follows {todo[0].follows!r}, which is not in the prompt set")
            batch = ready[:batch_size]
            prompts = [
                prompt_ids(tokenizer, filled_messages(r, writer.done, tokenizer, stops), chat_template) for r in batch
            ]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            for rec, ids, out in zip(batch, prompts, outs):
                finish = "eos" if out.token_ids and out.token_ids[-1] in stops else "length"
                writer.append(
                    {
                        "id": rec.id,
                        "prompt_ids": ids,
                        "output_ids": list(out.token_ids),
                        "finish": finish,
                        "seconds": round(dt / len(batch), 3),
                    }
                )
                summary.new += 1
                summary.new_tokens += len(out.token_ids)
            summary.seconds += dt
            done = {r.id for r in batch}
            todo = [r for r in todo if r.id not in done]
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{summary.tokens_per_second:.1f}")
    finally:
        bar.close()
        writer.close()
    return summarize(summary, writer)


#: What ``_model_len_for`` leaves beside a prompt and its output: one draft tree (the largest budget
#: is 64 nodes and its root) and the engine's own margin, rounded generously.
TREE_ROOM = 128


def _model_len_for(folder: Path, records: Sequence[PromptRecord], chat_template: bool, max_new_tokens: int) -> int:
    """Tokens per request for the engine to generate every record in full: the longest prompt of
    the records that follow no other (a follow-up's earlier answers are unknown until generated:
    it adds ``max_new_tokens`` per record it follows) plus ``max_new_tokens`` and a draft tree, at
    least EngineConfig's default; the engine caps it at the model's context."""
    from transformers import AutoTokenizer

    from sssd.serving.engine.config import EngineConfig

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    by_id = {r.id: r for r in records}
    longest = 0
    for r in records:
        chain, prev = 0, r.follows
        while prev and prev in by_id and chain < len(records):
            chain, prev = chain + 1, by_id[prev].follows
        messages = [dict(m, content="") if m.get("content") is None else m for m in r.messages]
        longest = max(longest, len(prompt_ids(tokenizer, messages, chat_template)) + chain * max_new_tokens)
    need = longest + max_new_tokens + TREE_ROOM
    return max(EngineConfig.max_model_len, -(-need // 256) * 256)


def _drafting_datastore(folder: Path, log: Log) -> Any:
    """The default datastore if it exists and was built with the model's tokenizer, else None
    (the engine then drafts from each prompt alone; the output is the same either way)."""
    if not (default_datastore_path() / "manifest.json").exists():
        return None
    ds = resolve_datastore("default")
    try:
        check_compatible(ds, folder)
    except DatastoreError:
        log(f"drafting from the prompts only: the default datastore has another tokenizer than {folder.name}")
        return None
    return ds
