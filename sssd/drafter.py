"""The drafting API: a stateful batch Drafter for engines, and ``sssd.draft``.

An engine opens one request per sequence with its prompt, appends the tokens
it accepts after each step, drafts the whole batch in one call (parallel over
requests in C++, GIL released), and closes requests when they finish::

    drafter = sssd.Drafter(datastore)            # or Drafter() for the default
    drafter.open(7, prompt_ids)
    batch = drafter.draft([7], budgets=[32])     # DraftBatch
    drafter.extend(7, accepted_ids)
    drafter.close(7)

A calibration file holds one config per budget: ``draft_with_entries`` drafts each
request of a batch with the entry of its budget.
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from sssd import _core
from sssd._tokens import as_tokens, pack_tokens
from sssd.config import DrafterConfig
from sssd.datastore import DEFAULT, Datastore
from sssd.tokenizer import check_compatible, load_tokenizer
from sssd.tree import DraftBatch, DraftTree


def resolve_datastore(datastore: Datastore | str | Path | None) -> Datastore | None:
    """A Datastore from an instance, a path, DEFAULT, or None (no datastore)."""
    if datastore is None or isinstance(datastore, Datastore):
        return datastore
    if isinstance(datastore, (str, Path)):  # DEFAULT too: Datastore.open knows it
        return Datastore.open(datastore)
    raise TypeError(f"datastore must be a Datastore, a path, 'default' or None, got {type(datastore).__name__}")


# Request ids are the integers in [0, 2^64) everywhere: scalars and arrays,
# here and in sssd._core (which checks the ranges).


def _request_ids(ids: Any) -> np.ndarray:
    """Request ids as a 1-D integer array (ranges are checked in C++)."""
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype.kind not in "iu" and not isinstance(ids, np.ndarray) and arr.ndim == 1:
        # A list mixing ids >= 2^63 with smaller ones (or negative ones) has no
        # common integer dtype: numpy makes it float64 (losing digits) or
        # object. Check each Python int instead.
        return np.array([_request_id(i) for i in ids], dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"request ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise TypeError(f"request ids must be 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def _request_id(rid: Any) -> int:
    if isinstance(rid, bool) or not isinstance(rid, (int, np.integer)):
        raise TypeError(f"request id must be an int, got {type(rid).__name__}")
    if not 0 <= int(rid) < 2**64:
        raise ValueError(f"request ids must be >= 0 and < 2^64, got {rid}")
    return int(rid)


class Drafter:
    """Batched SSSD drafter: datastore + per-request input tries + merge.

    Thread-safe: engine threads may open, extend, close and draft
    concurrently. Drafting runs in C++ with the GIL released.

    Args:
        datastore: a Datastore, a datastore directory, DEFAULT ("default") for
            the default datastore, or None to draft from the input only.
        config: a DrafterConfig (defaults: the paper's).
        tokenizer: the tokenizer the caller's token ids come from (a
            tokenizer object or spec accepted by sssd.tokenizer); if given, a
            datastore built with a different tokenizer is refused.
        external_sources: the discounts of the caller's candidate sources, in
            order (their nodes are tagged 2, 3, ...; see ``draft``); default:
            one, ``config.discounts.external``.
        **overrides: DrafterConfig fields replacing those of ``config``.
    """

    def __init__(
        self,
        datastore: Datastore | str | Path | None = DEFAULT,
        config: DrafterConfig | None = None,
        *,
        tokenizer: Any = None,
        external_sources: Sequence[Any] = (),
        **overrides: Any,
    ):
        self.config = (config or DrafterConfig()).replace(**overrides) if overrides else (config or DrafterConfig())
        self.datastore = resolve_datastore(datastore) if self.config.use_datastore else None
        if tokenizer is not None and self.datastore is not None:
            check_compatible(self.datastore, tokenizer)
        vocab = (
            self.datastore.vocab_size
            if self.datastore is not None and self.datastore.manifest.get("tokenizer")
            else None
        )
        self._vocab, self._external = vocab, tuple(external_sources) or None
        params = self.config.native_params(vocab, self._external)
        self._native = _core.Drafter(self.datastore.native if self.datastore else None, params, self.config.num_threads)
        self._params: dict[DrafterConfig, Any] = {self.config: params}
        self._own_params = params
        self._params_lock = threading.Lock()
        self._last_params: tuple[DrafterConfig, Any] | None = None

    @property
    def num_threads(self) -> int:
        """Batch drafting's OpenMP threads; set it to change them from the next call on (0: all cores)."""
        return int(self._native.num_threads)

    @num_threads.setter
    def num_threads(self, n: int) -> None:
        self._native.num_threads = int(n)

    # -- request lifecycle ------------------------------------------------
    def open(self, request_id: int, prompt: Any) -> None:
        """Starts a request with its prompt (a non-empty sequence of token ids)."""
        self._native.open(_request_id(request_id), as_tokens(prompt, "prompt", allow_empty=False))

    def extend(self, request_id: int, tokens: Any) -> None:
        """Appends tokens the target model accepted (or generated) to a request."""
        self._native.extend(_request_id(request_id), as_tokens(tokens, "tokens"))

    def extend_batch(self, request_ids: Sequence[int] | np.ndarray, tokens: Sequence[Any]) -> None:
        """Appends tokens to many requests in one native call (one lock, no
        per-request Python validation): request_ids[b] gets tokens[b].

        Args:
            request_ids: open requests.
            tokens: one sequence of token ids per request (may be empty).
        """
        ids = _request_ids(request_ids)
        if len(tokens) != ids.shape[0]:
            raise ValueError(f"got {ids.shape[0]} request ids but {len(tokens)} token lists")
        self.extend_packed(ids, *pack_tokens(tokens))

    def extend_packed(self, request_ids: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> None:
        """`extend_batch` with the tokens already packed (sssd._tokens.pack_tokens: request_ids[b]
        gets tokens[offsets[b]:offsets[b + 1]]), for a caller that hands the same batch to other
        consumers too (sssd.sources.DraftPipeline). Every argument is checked in C++ before any
        request changes."""
        self._native.extend_batch(_request_ids(request_ids), offsets, tokens)

    def close(self, request_id: int) -> None:
        """Ends a request and frees its state."""
        self._native.close(_request_id(request_id))

    @contextmanager
    def request(self, request_id: int, prompt: Any) -> Iterator[int]:
        """Context manager that opens a request and always closes it."""
        self.open(request_id, prompt)
        try:
            yield request_id
        finally:
            self.close(request_id)

    def __contains__(self, request_id: object) -> bool:
        return (
            isinstance(request_id, (int, np.integer))
            and 0 <= int(request_id) < 2**64
            and int(request_id) in self._native
        )

    def __len__(self) -> int:
        return len(self._native)

    def request_ids(self) -> list[int]:
        return sorted(self._native.request_ids())

    def context(self, request_id: int) -> np.ndarray:
        """The request's tokens so far (prompt + appended), uint32."""
        return self._native.context(_request_id(request_id))

    def request_memory(self, request_id: int) -> int:
        """Bytes held by the request's input trie."""
        return int(self._native.request_memory(_request_id(request_id)))

    @property
    def datastore_queries(self) -> tuple[int, int]:
        """(requests drafted with the datastore on, how many of them skipped its query) since the
        drafter was made. A request skips it when its budget fills, before the datastore is asked,
        with candidates of other sources above anything the datastore could offer (a confident
        copy of its own text): the draft is the same, minus the suffix-array search."""
        drafted, skipped = self._native.datastore_queries()
        return int(drafted), int(skipped)

    # -- drafting -----------------------------------------------------------
    def params_for(self, config: DrafterConfig) -> Any:
        """The native parameters of `config` for this drafter's requests (cached), or ValueError
        if they cannot draft over its request tries (a deeper input source, another vocabulary)."""
        hit = self._last_params  # one config drafts most steps: found without hashing it
        if hit is not None and hit[0] is config:
            return hit[1]
        with self._params_lock:
            params = self._params.get(config)
        if params is not None:
            self._last_params = (config, params)
        else:
            params = config.replace(vocab_size=self.config.vocab_size).native_params(self._vocab, self._external)
            self._native.check_compatible(params)
            with self._params_lock:
                if len(self._params) >= 16:
                    self._params.pop(next(k for k in self._params if k != self.config))
                self._params[config] = params
        return params

    def draft(
        self,
        request_ids: Sequence[int] | np.ndarray,
        budgets: int | Sequence[int] | np.ndarray | None = None,
        external: DraftBatch | dict | None = None,
        config: DrafterConfig | None = None,
        source_factors: np.ndarray | None = None,
        recent: tuple | None = None,
    ) -> DraftBatch:
        """Drafts one tree per request, in one parallel call.

        Args:
            request_ids: open requests to draft for.
            budgets: nodes per tree: one int for all, one per request, or None
                for config.budget. 0 gives an empty draft.
            external: the caller's candidates, one tree per request, merged by
                priority: a DraftBatch (one model source; its ``draft_probs``
                are conditional probabilities q(token | parent path) and rank
                the candidates), or a dict of CSR arrays ``offsets``,
                ``tokens``, ``parents``, ``weights`` (conditional ranking
                probabilities), optionally ``q`` (real draft probabilities,
                NaN where none) and ``sources`` (uint8 tags 2, 3, ..., one per
                ``external_sources`` entry).
            config: retrieval parameters and discounts for this call instead of the
                drafter's own (e.g. the calibration entry of this step's budget); its
                input source may be no deeper than the drafter's (``params_for``).
            source_factors: [B, MAX_SOURCES, 2] float32, per request and source tag (scale, level):
                that request's candidates from that source rank at priority * scale * level**(depth - 1)
                (a request's measured acceptance by source: sssd.source_evidence). None: all 1.
            recent: (store, tag, budgets): the other requests' recent outputs (sssd._core.RecentStore) asked
                in this call for each request's context as this drafter holds it, at most budgets[b] deep
                (int64 [B]; 0: not asked); request b's proposals merge as external source `tag`'s
                (DraftSource.recent_store). Another external source may not use that tag.

        Raises:
            KeyError: an id is not open. ValueError: a budget is out of range, or
            `config` does not fit this drafter.
        """
        # Ranges (ids >= 0, budgets in [0, MAX_BUDGET]) are checked in C++:
        # numpy reductions would cost more than drafting a small batch.
        ids = _request_ids(request_ids)
        if budgets is None:
            budgets = self.config.budget
        if isinstance(budgets, (int, np.integer)) and not isinstance(budgets, bool):
            b = np.full(ids.shape[0], budgets, dtype=np.int32) if -(2**31) <= budgets < 2**31 else np.array([budgets])
        else:
            b = np.asarray(budgets)
            if b.dtype.kind not in "iu":
                raise TypeError(f"budgets must be integers, got dtype {b.dtype}")
        if b.shape != ids.shape:
            raise ValueError(f"got {ids.shape[0]} request ids but {b.shape[0] if b.ndim else 1} budgets")
        if b.dtype != np.int32:
            if b.size and (int(b.min()) < -(2**31) or int(b.max()) >= 2**31):
                raise ValueError(f"budgets must be in [0, {int(_core.MAX_BUDGET)}]")
            b = b.astype(np.int32)
        ext = None
        if isinstance(external, dict):
            if len(external["offsets"]) != ids.shape[0] + 1:
                raise ValueError(
                    f"external drafts cover {len(external['offsets']) - 1} requests, expected {ids.shape[0]}"
                )
            ext = {
                "offsets": np.ascontiguousarray(external["offsets"], dtype=np.int64),
                "tokens": as_tokens(external["tokens"], "external tokens"),
                "parents": np.ascontiguousarray(external["parents"], dtype=np.int32),
                "weights": np.ascontiguousarray(external["weights"], dtype=np.float32),
            }
            for key, dt in (("q", np.float32), ("sources", np.uint8)):
                if external.get(key) is not None:
                    ext[key] = np.ascontiguousarray(external[key], dtype=dt)
        elif external is not None:
            if len(external) != ids.shape[0]:
                raise ValueError(f"external drafts cover {len(external)} requests, expected {ids.shape[0]}")
            ext = {
                "offsets": np.ascontiguousarray(external.offsets, dtype=np.int64),
                "tokens": as_tokens(external.tokens, "external tokens"),
                "parents": np.ascontiguousarray(external.parents, dtype=np.int32),
                "probs": np.ascontiguousarray(external.draft_probs, dtype=np.float32),
            }
        params = None if config is None or config is self.config else self.params_for(config)
        if params is self._own_params:
            params = None  # the drafter's own: nothing to check
        return DraftBatch.from_native(
            self._native.draft(ids, np.ascontiguousarray(b), ext, params, source_factors, recent)
        )

    def draft_prefix(self, prefix: Any, budget: int | None = None) -> DraftTree:
        """Drafts once for a token prefix without opening a request."""
        budget = self.config.budget if budget is None else budget
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
            raise TypeError(f"budget must be an int, got {type(budget).__name__}")
        batch = DraftBatch.from_native(
            self._native.draft_context(as_tokens(prefix, "prefix", allow_empty=False), int(budget))
        )
        return batch[0]

    def __repr__(self) -> str:
        return f"Drafter({self.datastore!r}, {len(self)} open requests, budget={self.config.budget})"


_cache_lock = threading.Lock()
_cached: dict[tuple, Drafter] = {}


def draft(
    prefix: Any,
    budget: int | None = None,
    *,
    datastore: Datastore | str | Path | None = DEFAULT,
    config: DrafterConfig | None = None,
    tokenizer: Any = None,
    **overrides: Any,
) -> DraftTree:
    """Drafts a token tree continuing ``prefix`` (the library call ``sssd.draft``).

    Sources: the datastore (default: the default datastore) and the prefix
    itself as the input source; merged as in the paper's Algorithm 1.

    Args:
        prefix: a text, or a non-empty sequence of token ids; its last token is
            the tree's root. A text is tokenized with the tokenizer the
            datastore records (or ``tokenizer``), and the tree can render its
            tokens as text (``tree.token_texts()``, ``tree.format()``).
        budget: candidate tokens in the tree (default: config.budget = 32).
        datastore: Datastore, directory, "default", or None (input source only).
        tokenizer: for a text prefix: a tokenizer spec (sssd.tokenizer.load_tokenizer)
            instead of the datastore's.
        config / overrides: DrafterConfig and field overrides.

    Returns:
        A DraftTree (flat numpy arrays: tokens, parents, depths, scores, sources).
    """
    # Keyed by the arguments, so that a call builds no DrafterConfig (it validates itself).
    try:
        key = (str(datastore) if isinstance(datastore, Path) else datastore, config, tuple(sorted(overrides.items())))
        hash(key)
    except TypeError:  # an unhashable override value: no caching by it
        key = None
    with _cache_lock:
        drafter = _cached.get(key) if key is not None else None
        if drafter is None:
            cfg = (config or DrafterConfig()).replace(**overrides) if overrides else (config or DrafterConfig())
            drafter = Drafter(datastore, cfg)
            if key is not None:
                if len(_cached) >= 8:
                    _cached.pop(next(iter(_cached)))
                _cached[key] = drafter
    if not isinstance(prefix, str):
        tok = _tokenizer_of(drafter, tokenizer) if tokenizer is not None else None
        tree = drafter.draft_prefix(prefix, budget)
        return tree.with_tokenizer(tok) if tok is not None else tree
    tok = _tokenizer_of(drafter, tokenizer)
    ids = tok.encode(prefix)
    if not ids:
        raise ValueError("the text prefix has no tokens")
    return drafter.draft_prefix(ids, budget).with_tokenizer(tok)


_tokenizers: dict[Any, Any] = {}


def _tokenizer_of(drafter: Drafter, spec: Any = None):
    """The tokenizer for text prefixes: `spec`, else the one the drafter's datastore records (cached)."""
    if spec is not None:
        return load_tokenizer(spec)
    ds = drafter.datastore
    if ds is None or not (ds.manifest.get("tokenizer") or {}):
        raise ValueError(
            "a text prefix needs a tokenizer: this datastore records none (or there is no datastore); "
            "pass token ids, or tokenizer=... (a tokenizer.json, model folder or .gguf file)"
        )
    key = (str(ds.path), (ds.manifest.get("tokenizer") or {}).get("sha256"))
    with _cache_lock:
        tok = _tokenizers.get(key)
    if tok is None:
        tok = ds.load_tokenizer()
        with _cache_lock:
            _tokenizers[key] = tok
    return tok


# -- drafting with a calibration file's entries ----------------------------------------


def draft_with_entries(
    drafter: Drafter,
    entries: dict[int, DrafterConfig],
    ids: np.ndarray,
    budgets: np.ndarray,
    external: Any = None,
    source_factors: np.ndarray | None = None,
    recent: tuple | None = None,
) -> DraftBatch:
    """One DraftBatch for a batch, each request drafted with the entry of its budget (the largest
    entry budget <= it, the smallest below them all: sssd.calibration_file.select_entry).

    The requests of one entry draft in one call: normally the whole batch (a step runs one
    budget; budget 0, no draft, goes with any). Several entries cost one call each, the other
    entries' requests at budget 0, and the trees are put back in request order.

    Args:
        drafter: a Drafter built with ``sssd.calibration_file.drafter_config_for(entries)``.
        entries: increasing budget -> DrafterConfig (a calibration file's: sssd.calibration_file.entries_of).
        ids, budgets: [B] request ids and int32 budgets; external, source_factors, recent: as ``Drafter.draft``
            takes them (recent's budgets are its own: an entry's call asks it for that entry's requests only).
    """
    keys = list(entries)
    which = np.maximum(np.searchsorted(keys, budgets, side="right") - 1, 0)
    asked = which[budgets > 0]
    if not asked.size or asked.min() == asked.max():  # one entry: one call (the usual step)
        g = int(asked[0]) if asked.size else len(keys) - 1
        return drafter.draft(
            ids, budgets, external, config=entries[keys[g]], source_factors=source_factors, recent=recent
        )
    groups = np.unique(asked)
    parts = [
        drafter.draft(
            ids,
            np.where(which == g, budgets, 0).astype(np.int32),
            external,
            config=entries[keys[g]],
            source_factors=source_factors,
            recent=None if recent is None else (*recent[:2], np.where(which == g, recent[2], 0)),
        )
        for g in groups
    ]
    return _merge_batches(parts)


def _merge_batches(parts: list[DraftBatch]) -> DraftBatch:
    """One DraftBatch from batches over the same requests where each request's tree is in one of them."""
    n = len(parts[0])
    sizes = [p.sizes for p in parts]
    owner = np.concatenate([np.repeat(np.arange(n), s) for s in sizes])
    order = np.argsort(owner, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.sum(sizes, axis=0))]).astype(np.int64)
    fields = {}
    for f in dataclasses.fields(DraftBatch):
        if f.name != "offsets":
            values = [getattr(p, f.name) for p in parts]
            fields[f.name] = None if any(v is None for v in values) else np.concatenate(values)[order]
    return DraftBatch(offsets=offsets, **fields)
