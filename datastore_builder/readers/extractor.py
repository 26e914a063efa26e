"""A record object (a JSON value, a Parquet or Arrow row) turned into a Record: its chat messages or
text fields, the field detected once from the first record (or the schema) unless given."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sssd.datastore_builder.readers.records import (
    MESSAGE_FIELDS,
    TEXT_FIELDS,
    CorpusError,
    Fields,
    Record,
    SourceStats,
    _too_large,
)
from sssd.datastore_builder.sharegpt import Turn, message_turns


class _Extractor:
    """Turns a record object into a Record, detecting the text field once."""

    def __init__(self, path: str, fields: Fields, stats: SourceStats):
        self.path = path
        self.fields = fields
        self.stats = stats
        self.text_fields = fields.text_fields
        self.messages_field = fields.messages_field
        self.hits = 0  # records that had the field
        self.first_keys: list[str] | None = None

    @property
    def detected(self) -> bool:
        return bool(self.text_fields or self.messages_field)

    def detect(self, keys: list[str]) -> None:
        """Picks the field from a record's (or schema's) keys, unless given."""
        if self.first_keys is None:
            self.first_keys = list(keys)
        if self.detected:
            return
        for name in MESSAGE_FIELDS:
            if name in keys:
                self.messages_field = name
                return
        for name in TEXT_FIELDS:
            if name in keys:
                self.text_fields = (name,)
                self._check_roles()
                return
        raise CorpusError(
            f"{self.path}: cannot tell which field holds the text (fields: {', '.join(map(str, keys)) or 'none'}); "
            "pass --text-field NAME or --messages-field NAME"
        )

    def _check_roles(self) -> None:
        if self.fields.roles != "all":
            raise CorpusError(
                f"{self.path}: --roles {self.fields.roles} needs chat messages, but the text is in "
                f"plain field(s) {', '.join(self.text_fields)}; use --messages-field or --roles all"
            )

    def looks_like_record(self, obj: Any) -> bool:
        if not isinstance(obj, dict):
            return False
        keys = (
            ([self.messages_field] if self.messages_field else list(self.text_fields))
            if self.detected
            else [*MESSAGE_FIELDS, *TEXT_FIELDS]
        )
        return any(k in obj for k in keys)

    def __call__(self, obj: Any) -> Record:
        if not isinstance(obj, dict):
            return Record([], problem=f"record is a JSON {type(obj).__name__}, not an object")
        if not self.detected:
            self.detect(list(obj))
        elif self.first_keys is None:
            self.first_keys = list(obj)
        rid = obj.get("id")
        rid = None if rid is None else str(rid)
        if self.messages_field:
            if self.messages_field not in obj:
                return Record([], rid, problem=f"no {self.messages_field!r} field")
            self.hits += 1
            turns, problems = message_turns(obj[self.messages_field])
            if not turns and problems and not isinstance(obj[self.messages_field], list):
                return Record([], rid, problem=problems[0])
            return self._checked(Record(turns, rid, turn_problems=problems), "message text")
        turns = []
        present = [f for f in self.text_fields if f in obj]
        if not present:
            return Record([], rid, problem=f"no {' or '.join(map(repr, self.text_fields))} field")
        self.hits += 1
        problems = []
        for name in present:
            value = obj[name]
            if isinstance(value, str):
                turns.append(Turn(None, value))
            elif value is not None:
                problems.append(f"field {name!r} is not text")
        return self._checked(Record(turns, rid, turn_problems=problems), "text field")

    def _checked(self, rec: Record, what: str) -> Record:
        """Drops turns that are not valid Unicode; refuses a record larger than the limit."""
        limit = self.fields.max_record_bytes
        if sum(len(t.text) for t in rec.turns) > limit:  # characters: each at least a byte
            return Record([], rec.id, problem=_too_large(limit))
        if all(t.text.isascii() for t in rec.turns):
            return rec
        kept = []
        for t in rec.turns:
            try:
                t.text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON): no tokenizer can take it
                rec.turn_problems.append(f"{what} is not valid Unicode (a lone surrogate)")
                continue
            kept.append(t)
        rec.turns = kept
        return rec

    def check(self, final: bool) -> None:
        """Fails if the chosen field is in none of the records so far (early: after 1,000)."""
        if self.hits or not self.stats.records or (not final and self.stats.records < 1000):
            return
        name = self.messages_field or ", ".join(self.text_fields)
        raise CorpusError(
            f"{self.path}: no record has the field {name!r} (fields seen: {', '.join(map(str, self.first_keys or [])) or 'none'})"
        )


def _records(values: Iterator[Any], ext: _Extractor, stats: SourceStats) -> Iterator[Record]:
    for obj in values:
        rec = ext(obj)
        yield rec
        if stats.records == 1000:
            ext.check(final=False)
    ext.check(final=True)
