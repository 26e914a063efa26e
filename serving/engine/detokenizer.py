"""Incremental detokenization and stop strings, at a cost per step proportional to the new tokens.

Each request keeps a tokenizers DecodeStream: appending a token decodes only
a small window around it (a multi-byte character split across byte tokens
is held back until complete). Stop strings are searched only in the new
text and the few characters before it that a stop string could straddle.
When the request finishes, its text is decoded once in full, which also
flushes a trailing incomplete character.
"""

from __future__ import annotations

from typing import Any, Sequence


class Detokenizer:
    """One request's output text, built token by token."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._rust = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True) if self._rust is not None else None
        self._ids: list[int] = []
        self.stop = tuple(stop)
        self._overlap = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stopped_at: int | None = None  # the text length where a stop string begins

    def add(self, token: int) -> bool:
        """Appends one output token; True when the text now holds a stop string (the text is
        then cut before it; tokens after that change nothing)."""
        if self.stopped_at is not None:
            return True
        self._ids.append(int(token))
        if self._stream is None:  # a slow tokenizer: decode the tail window
            new = self._tokenizer.decode(self._ids, skip_special_tokens=True)[len(self.text) :]
        else:
            new = self._stream.step(self._rust, int(token)) or ""
        if not new:
            return False
        start = max(0, len(self.text) - self._overlap)
        self.text += new
        if self.stop:
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped_at = min(hits)
                self.text = self.text[: self.stopped_at]
                return True
        return False

    def finish(self) -> str:
        """The final text: decoded in full once (unless a stop string cut it)."""
        if self.stopped_at is None:
            self.text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        return self.text
