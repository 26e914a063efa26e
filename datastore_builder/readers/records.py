"""What every reader shares: the formats and their extensions, a source (one input), the records
read from it and their stats (SourceStats), where a record's text is (Fields), and CorpusError."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sssd.datastore_builder.sharegpt import Turn

FORMATS = ("json", "jsonl", "parquet", "arrow", "text")
TEXT_SPLITS = ("file", "paragraph", "line")
EXTENSIONS = {
    ".json": "json",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".rst": "text",
}
MESSAGE_FIELDS = ("conversations", "messages")
TEXT_FIELDS = ("text", "content")
STDIN = "-"

#: The largest record (a JSON value, a line, a paragraph or file of text), in bytes
#: (characters for JSON values); larger ones are skipped (``sssd build --max-record-mib``).
MAX_RECORD_BYTES = 16 << 20


class CorpusError(ValueError):
    """The corpus cannot be read as asked (a one-line message for the CLI)."""


@dataclass
class Source:
    """One input: a file path (or "-" for stdin) and its format."""

    path: str
    kind: str
    size: int | None = None  # bytes, if known


@dataclass
class Record:
    """A record read from a source: its turns, or why it is unusable."""

    turns: list[Turn]
    id: str | None = None
    problem: str | None = None  # record-level: the record is skipped
    where: str = ""  # where in the source (for messages)
    turn_problems: list[str] = field(default_factory=list)  # messages skipped inside a usable record


@dataclass
class SourceStats:
    """What a source yielded: counts and the reasons records were dropped."""

    kind: str
    path: str
    strict: bool = False
    records: int = 0  # complete records read (usable or not)
    documents: int = 0  # documents that went into the datastore
    heldout: int = 0  # records written to the held-out file
    empty: int = 0  # whitespace-only texts (not documents, not errors)
    duplicates: int = 0  # documents dropped by --dedup
    skipped: Counter = field(default_factory=Counter)  # reason -> records (or messages) dropped
    notes: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str = "") -> None:
        """Counts a dropped record; in strict mode, fails instead."""
        if self.strict:
            at = f" ({where})" if where else ""
            raise CorpusError(f"{self.path}: {reason}{at}; stopping because of --strict")
        self.skipped[reason] += 1

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def to_dict(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "path": self.path,
            "records": self.records,
            "documents": self.documents,
            "skipped": self.num_skipped,
            "skipped_reasons": dict(self.skipped),
        }
        for key in ("heldout", "empty", "duplicates"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def summary(self) -> str:
        text = f"{self.path}: {self.records:,} records, {self.documents:,} documents"
        if self.heldout:
            text += f", {self.heldout:,} held out"
        if self.skipped:
            reasons = "; ".join(f"{n:,} {r}" for r, n in self.skipped.most_common())
            text += f"; skipped {self.num_skipped:,} ({reasons})"
        for note in self.notes:
            text += f"; {note}"
        return text


@dataclass(frozen=True)
class Fields:
    """Where the text is in a record, and how plain text splits into documents."""

    text_fields: tuple[str, ...] = ()
    messages_field: str | None = None
    text_split: str = "file"
    roles: str = "all"
    max_record_bytes: int = MAX_RECORD_BYTES

    def __post_init__(self):
        if self.text_fields and self.messages_field:
            raise ValueError("give either text fields or a messages field, not both")
        if self.text_split not in TEXT_SPLITS:
            raise ValueError(f"text split must be one of {TEXT_SPLITS}, got {self.text_split!r}")
        if (
            isinstance(self.max_record_bytes, bool)
            or not isinstance(self.max_record_bytes, int)
            or self.max_record_bytes < 1
        ):
            raise ValueError(f"max_record_bytes must be a positive integer, got {self.max_record_bytes!r}")


def _too_large(limit: int) -> str:
    size = f"{limit / 2**20:g} MiB" if limit >= 1 << 20 else f"{limit:,} bytes"
    return f"record larger than {size} (the --max-record-mib limit)"
