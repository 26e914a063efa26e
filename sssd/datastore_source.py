"""DatastoreSource: one more datastore, drafting as a source of its own beside retrieval.

The engine's first datastore is retrieval's (RetrievalSource: the datastore
and the request's own tokens, drafted and merged in one C++ call). Every
further datastore is a DatastoreSource: it keeps the requests' contexts in a
drafter of its own (datastore only, no input trie), drafts the whole batch in
one native call, and hands its trees to the same merge as external
candidates, under its own name (per-source acceptance metrics) and discount::

    sssd.LLM(model, datastore=["code-ds", "docs-ds"])      # retrieval over code-ds, docs-ds beside it
    sssd serve --datastore code-ds --datastore docs-ds

A running engine takes more (and drops them) between steps:
``DraftPipeline.add_source`` / ``remove_source``, or over HTTP with
``sssd serve --enable-admin`` (``/v1/admin/datastores``).

The merge sees a candidate's conditional weight (the chance it follows its
parent) and no match length; so a node's weight here carries its own
drafter's path probability times the match damping of the discount, and the
merge's score table applies the rest of the discount (scale and depth decay).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from sssd.config import DrafterConfig, SourceDiscount
from sssd.draft_source import Candidates, DraftRequest, DraftSource
from sssd.drafter import Drafter, resolve_datastore
from sssd.sources import MAX_EXTERNAL

#: Names that stand for retrieval's own sources in the metrics; an extra datastore never takes them.
RESERVED_NAMES = frozenset({"datastore", "input", "retrieval", "external"})
#: What a source name may hold: it is a metrics label and a URL path segment.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: Suffix of a compressed datastore archive (stripped from its name).
ARCHIVE_SUFFIX = ".sssd.zst"


class DatastoreSource(DraftSource):
    """A datastore drafting as its own source.

    Thread-safe as its drafter is: the pipeline calls it between steps.

    Args:
        datastore: a Datastore, a datastore directory or archive, or "default".
        config: the engine's DrafterConfig (retrieval parameters: suffix lengths, samples,
            branch length, end token, vocabulary); its input source is not used.
        name: reported in the metrics (default: the datastore's folder name).
        discount: the source's discount (default: the config's datastore discount). Its
            scale and depth decay go to the merge; its match damping is applied here, to
            each node's path weight by its match length (the merge knows no match lengths).

    Attributes:
        datastore: the opened Datastore.
        discount: what the merge's score table holds for this source (scale, depth decay).
        damping: (match_damping, full_match) applied to the weights.
    """

    def __init__(
        self,
        datastore: Any,
        config: DrafterConfig | None = None,
        *,
        name: str | None = None,
        discount: SourceDiscount | None = None,
    ):
        ds = resolve_datastore(datastore)
        if ds is None:
            raise ValueError("a DatastoreSource needs a datastore, got None")
        cfg = config or DrafterConfig()
        self.datastore = ds
        self.name = check_name(name) if name is not None else source_name(datastore)
        full = discount or cfg.discounts.datastore
        self.discount = SourceDiscount(scale=full.scale, depth_decay=full.depth_decay, match_damping=1.0, full_match=0)
        self.damping = (float(full.match_damping), int(full.full_match))
        self._drafter = Drafter(ds, cfg.replace(use_datastore=True, use_input=False))

    @property
    def path(self) -> Path | None:
        return self.datastore.path

    def info(self) -> dict:
        """What an admin listing shows: name, path, tokens and documents."""
        return {
            "name": self.name,
            "path": None if self.path is None else str(self.path),
            "tokens": self.datastore.size,
            "docs": self.datastore.num_docs,
        }

    # -- following requests ----------------------------------------------------------------
    def open(self, request_id: int, prompt: np.ndarray) -> None:
        if request_id in self._drafter:
            self._drafter.close(request_id)
        self._drafter.open(request_id, prompt)

    def extend(self, request_id: int, tokens: np.ndarray) -> None:
        self._drafter.extend(request_id, tokens)

    def close(self, request_id: int) -> None:
        if request_id in self._drafter:
            self._drafter.close(request_id)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._drafter

    def __len__(self) -> int:
        return len(self._drafter)

    # -- drafting ---------------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> list[Candidates | None]:
        """Every request's tree from this datastore, in one native call; weights are conditional."""
        asked = [k for k, r in enumerate(requests) if r.budget > 0 and r.request_id in self._drafter]
        out: list[Candidates | None] = [None] * len(requests)
        if not asked:
            return out
        ids = np.fromiter((requests[k].request_id for k in asked), dtype=np.int64, count=len(asked))
        budgets = np.fromiter((requests[k].budget for k in asked), dtype=np.int32, count=len(asked))
        batch = self._drafter.draft(ids, budgets)
        weights = conditional_weights(batch.offsets, batch.parents, batch.probs, batch.match_lens, *self.damping)
        offsets = batch.offsets.tolist()
        for j, k in enumerate(asked):
            a, b = offsets[j], offsets[j + 1]
            if b > a:
                out[k] = Candidates(batch.tokens[a:b], batch.parents[a:b], weights=weights[a:b])
        return out

    def __repr__(self) -> str:
        return f"DatastoreSource({self.name!r}, {self.path}, {len(self)} open requests)"


class SourceConflict(ValueError):
    """The pipeline cannot take this change as asked: a name in use, the source limit reached,
    retrieval's own datastore asked to go, or an engine that does not draft."""


def add_datastore(
    pipeline: Any,
    datastore: Any,
    *,
    name: str | None = None,
    default_name: Any = None,
    discount: SourceDiscount | None = None,
) -> DatastoreSource:
    """Adds `datastore` to a pipeline (sssd.sources.DraftPipeline) as a source of its own, opened
    for every running request. Between steps only (the engine's lock).

    The datastore should be checked against the model first (LLMEngine.check_datastore).

    Args:
        name: the source's name, which must be free; None: the name of `default_name` (a path
            or Datastore; default: `datastore`), made unique with a suffix (-2, -3, ...).
        discount: see DatastoreSource.

    Raises:
        ValueError: a malformed name. SourceConflict: the name is taken, or the pipeline holds
            MAX_EXTERNAL sources besides retrieval already.
    """
    taken = set(pipeline.names) | {"retrieval"}
    if name is not None:
        if check_name(name) in taken:
            raise SourceConflict(f"a draft source named {name!r} exists already; choose another name")
    else:
        name = unique_name(source_name(datastore if default_name is None else default_name), taken)
    if len(pipeline.external) >= MAX_EXTERNAL:
        raise SourceConflict(
            f"this engine merges {MAX_EXTERNAL} draft sources besides retrieval already "
            f"(the most it can); remove one first"
        )
    source = DatastoreSource(datastore, pipeline.config, name=name, discount=discount)
    pipeline.add_source(source)
    return source


def list_datastores(pipeline: Any) -> list[dict]:
    """The pipeline's datastores: retrieval's first ("primary": true, named "datastore" as in the
    metrics), then each DatastoreSource in the order they were added."""
    out = []
    ds = getattr(pipeline, "datastore", None)
    if ds is not None:
        out.append(
            {
                "name": "datastore",
                "path": None if ds.path is None else str(ds.path),
                "tokens": ds.size,
                "docs": ds.num_docs,
                "primary": True,
            }
        )
    out += [dict(s.info(), primary=False) for s in pipeline.external if isinstance(s, DatastoreSource)]
    return out


def conditional_weights(
    offsets: np.ndarray,
    parents: np.ndarray,
    probs: np.ndarray,
    match_lens: np.ndarray | None,
    match_damping: float = 1.0,
    full_match: int = 0,
) -> np.ndarray:
    """Each node's weight given its parent, for a CSR batch of trees (float32 in [0, 1]).

    A node's path weight is its path probability times match_damping ** (full_match -
    match length) (no damping at or above full_match); its conditional weight is its path
    weight over its parent's (a child of the root: its path weight). Along a branch of
    one match the ratio is exactly the drafter's conditional probability; a child whose
    match was longer than its parent's would exceed 1 and is clipped.

    Args:
        offsets: [B + 1] tree b owns nodes offsets[b]:offsets[b + 1].
        parents: [N] parent index local to the node's tree, -1 for the root's children.
        probs: [N] path probabilities from the root.
        match_lens: [N] context tokens matched by each node's branch (None: no damping).
    """
    n = int(parents.shape[0])
    path = np.asarray(probs, dtype=np.float64).copy()
    if match_lens is not None and match_damping != 1.0 and full_match > 0:
        path *= match_damping ** np.maximum(0, full_match - np.asarray(match_lens, dtype=np.int64))
    start = np.repeat(np.asarray(offsets[:-1], dtype=np.int64), np.diff(offsets))
    par = np.asarray(parents, dtype=np.int64)
    has = par >= 0
    above = np.ones(n, dtype=np.float64)
    above[has] = path[par[has] + start[has]]
    out = np.zeros(n, dtype=np.float64)
    np.divide(path, above, out=out, where=above > 0)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def source_name(datastore: Any) -> str:
    """The default name of a datastore given as a path (its folder or archive name) or a Datastore."""
    path = getattr(datastore, "path", datastore)
    if path is None:
        return "extra"
    text = Path(str(path)).expanduser().name or str(path)
    if text.endswith(ARCHIVE_SUFFIX):
        text = text[: -len(ARCHIVE_SUFFIX)]
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "extra"
    return text[:64]


def check_name(name: str) -> str:
    """`name` if it can name a source: letters, digits, '.', '_', '-' (1-64, a letter or digit first)."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"a datastore name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit; got {name!r}"
        )
    if name in RESERVED_NAMES:
        raise ValueError(f"the name {name!r} is reserved (it names one of retrieval's sources)")
    return name


def unique_name(base: str, taken: Iterable[str]) -> str:
    """`base`, or `base-2`, `base-3`, ... : the first not in `taken` (nor reserved)."""
    taken = set(taken) | RESERVED_NAMES
    if base not in taken:
        return base
    k = 2
    while f"{base[:60]}-{k}" in taken:
        k += 1
    return f"{base[:60]}-{k}"


__all__ = [
    "DatastoreSource",
    "SourceConflict",
    "add_datastore",
    "check_name",
    "conditional_weights",
    "list_datastores",
    "source_name",
    "unique_name",
]
