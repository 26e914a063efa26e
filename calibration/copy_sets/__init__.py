"""Copy-heavy prompt sets: answers that copy text the prompt already holds.

Built here, deterministically and without the network, from sources installed
in this environment (issue 28, item 5). Each function returns PromptRecords
(messages ending with a user turn; ``reference`` is the expected answer):

* ``code_edits()``: edits of real functions of the ``tqdm`` package (module code_edits).
* ``agent_traces()``: agent-like traces over the same tqdm sources (module agent_traces).
* ``quoting()``: RAG-style quoting of standard-library docstrings (module quoting).

Each module's docstring describes its set and its ids.

Every record of one source function (code-edits), trace instance
(agent-traces) or target passage (quoting) shares the id part before "#", so
``datasets.split_of`` puts them on one side of the dev/eval split.

Prompts stay under about 10,000 characters (~3k tokens), except every 8th
quoting record, which holds more passages (up to 20,000 characters).

Modules:
    constants      the seed of every random draw and the prompt-size limits
    tqdm_code      the installed tqdm sources and their functions, read with ``ast``
    transforms     exact program transformations (renames, comment removal, operator flips, ...)
    code_edits     the ``code-edits`` set
    agent_traces   the ``agent-traces`` set
    quoting        the ``quoting`` set
"""

from __future__ import annotations

from sssd.calibration.copy_sets.agent_traces import AGENT_SYSTEMS, agent_traces
from sssd.calibration.copy_sets.code_edits import EDIT_KINDS, FILE_KINDS, RENAMES, Edit, code_edits, make_edit
from sssd.calibration.copy_sets.constants import MAX_LONG_PROMPT_CHARS, MAX_PROMPT_CHARS, SEED
from sssd.calibration.copy_sets.quoting import PASSAGE_MAX, PASSAGE_MIN, QUOTE_MODULES, QUOTE_SYSTEMS, passages, quoting
from sssd.calibration.copy_sets.tqdm_code import (
    MAX_LINES,
    MIN_LINES,
    SOURCE_PACKAGE,
    SourceFunction,
    dedent_exact,
    reindent,
    source_functions,
    tqdm_source,
)
from sssd.calibration.copy_sets.transforms import (
    FLIPS,
    EditError,
    change_constant,
    expected_rename,
    flip_operator,
    insert_statement,
    new_number,
    numeric_sites,
    operator_sites,
    remove_comments,
    rename_identifier,
    wrap_try,
)
from sssd.calibration.datasets import PromptRecord

__all__ = [
    "AGENT_SYSTEMS",
    "COPY_SETS",
    "EDIT_KINDS",
    "FILE_KINDS",
    "FLIPS",
    "MAX_LINES",
    "MAX_LONG_PROMPT_CHARS",
    "MAX_PROMPT_CHARS",
    "MIN_LINES",
    "PASSAGE_MAX",
    "PASSAGE_MIN",
    "QUOTE_MODULES",
    "QUOTE_SYSTEMS",
    "RENAMES",
    "SEED",
    "SOURCE_PACKAGE",
    "Edit",
    "EditError",
    "PromptRecord",
    "SourceFunction",
    "agent_traces",
    "change_constant",
    "code_edits",
    "dedent_exact",
    "expected_rename",
    "flip_operator",
    "insert_statement",
    "load",
    "make_edit",
    "new_number",
    "numeric_sites",
    "operator_sites",
    "passages",
    "quoting",
    "reindent",
    "remove_comments",
    "rename_identifier",
    "source_functions",
    "tqdm_source",
    "wrap_try",
]

#: The prompt sets of this package by name (datasets.DATASETS lists them too).
COPY_SETS = ("code-edits", "agent-traces", "quoting")


def load(name: str) -> list[PromptRecord]:
    """A copy set by name (COPY_SETS)."""
    if name == "code-edits":
        return code_edits()
    if name == "agent-traces":
        return agent_traces()
    if name == "quoting":
        return quoting()
    raise ValueError(f"unknown copy set {name!r}; choose one of {', '.join(COPY_SETS)}")
