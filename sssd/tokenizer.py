"""Tokenizers for building and using datastores: load any local Hugging Face
tokenizer, identify it by content, and refuse mismatched datastores.

A tokenizer spec is one of:

* a ``tokenizer.json`` file (the ``tokenizers`` library format);
* a local model folder holding a ``tokenizer.json`` (or, through
  transformers, any tokenizer files it can convert to a fast tokenizer);
* a ``.gguf`` model file. Its tokenizer is converted once with transformers
  and cached as ``<cache>/tokenizers/gguf-<sha256 of the GGUF>/tokenizer.json``,
  so later loads take milliseconds.

Nothing here touches the network. A tokenizer's identity is the sha256 of its
canonical ``tokenizer.json`` content (keys sorted, runtime padding and
truncation settings dropped), so the same tokenizer read from a GGUF file or
from its exported json has the same identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sssd.cache import cache_dir
from sssd.errors import DatastoreError
from sssd.files import NotRegularFileError, atomic_directory, check_regular, file_sha256, open_regular, read_json_dict

#: The file a datastore keeps its tokenizer in, next to manifest.json.
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """A loaded tokenizer: encode/decode without special tokens, plus identity.

    Attributes:
        name: a human-readable name (file or folder name of the spec).
        path: a tokenizer.json holding this tokenizer (what manifests record).
        sha256: hash of the canonical tokenizer.json content (the identity).
        eos_token_id: end-of-sequence id when the spec says (None otherwise).
    """

    def __init__(self, backend: Any, *, name: str, path: Path | None = None, eos_token_id: int | None = None):
        self.name = name
        self.path = Path(path) if path is not None else None
        self.eos_token_id = eos_token_id
        self._backend = backend
        self._sha256: str | None = None

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def sha256(self) -> str:
        """The identity: sha256 of the canonical tokenizer.json (computed once, ~0.3 s)."""
        if self._sha256 is None:
            self._sha256 = canonical_sha256(self._backend)
        return self._sha256

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel on all cores by the tokenizers library; no special tokens."""
        fast = getattr(self._backend, "encode_batch_fast", None) or self._backend.encode_batch
        return [e.ids for e in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Writes the tokenizer as a tokenizer.json file."""
        self._backend.save(str(path))

    def identity(self) -> dict[str, Any]:
        """What a datastore manifest records under "tokenizer"."""
        out = {
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "path": str(self.path) if self.path else None,
        }
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        return out

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab {self.vocab_size:,}, sha256 {self.sha256[:12]})"


def canonical_sha256(backend: Any) -> str:
    """sha256 of a tokenizers.Tokenizer's canonical JSON (sorted keys, no padding/truncation)."""
    data = json.loads(backend.to_str())
    data.pop("padding", None)
    data.pop("truncation", None)
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def load_tokenizer(spec: Any) -> Tokenizer:
    """Loads a tokenizer from a tokenizer.json, a model folder, or a GGUF file.

    Also accepts a Tokenizer (returned as is), a ``tokenizers.Tokenizer``, or a
    transformers fast tokenizer object.

    Files are opened only if they are regular files: a FIFO (or device) in place of
    a tokenizer file is refused at once, never read.

    Raises:
        ValueError: the spec names nothing loadable (missing, not a regular file, not a
            tokenizer); the message gives the spec and why.
    """
    if isinstance(spec, Tokenizer):
        return spec
    if hasattr(spec, "backend_tokenizer"):  # transformers PreTrainedTokenizerFast
        return Tokenizer(
            spec.backend_tokenizer,
            name=str(getattr(spec, "name_or_path", "") or "transformers"),
            eos_token_id=getattr(spec, "eos_token_id", None),
        )
    if hasattr(spec, "to_str") and hasattr(spec, "encode_batch"):  # tokenizers.Tokenizer
        return Tokenizer(spec, name="tokenizers.Tokenizer")
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"cannot load tokenizer {spec!r}: expected a path, got {type(spec).__name__}")
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(
            f"cannot load tokenizer {str(spec)!r}: no such file or folder "
            "(give a local tokenizer.json, model folder or .gguf file; sssd never downloads)"
        )
    try:
        return _load_path(path)
    except NotRegularFileError as e:  # the spec, or a file in its folder, is a FIFO, a device, ...
        why = e.strerror if e.filename == str(path) else str(e)
        raise ValueError(f"cannot load tokenizer {str(spec)!r}: {why}") from None


def _load_path(path: Path) -> Tokenizer:
    if path.is_dir():
        if (path / TOKENIZER_FILE).exists():  # _from_json refuses one that is not a regular file
            return _from_json(path / TOKENIZER_FILE, name=path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0])
        return _from_transformers_folder(path)
    if _is_gguf(path):
        return _from_gguf(path)
    return _from_json(path, name=path.parent.name if path.name == TOKENIZER_FILE else path.stem)


def check_compatible(datastore: Any, tokenizer: Any) -> None:
    """Refuses a datastore that was not built with ``tokenizer``.

    Args:
        datastore: a Datastore (its manifest's "tokenizer" entry is compared).
        tokenizer: a Tokenizer or anything load_tokenizer accepts.

    Raises:
        DatastoreError: the datastore records no tokenizer, or a different one.
        ValueError: the tokenizer cannot be loaded.
    """
    where = getattr(datastore, "path", None) or "in-memory datastore"
    recorded = (getattr(datastore, "manifest", None) or {}).get("tokenizer") or {}
    tok = load_tokenizer(tokenizer)
    if not recorded.get("sha256"):
        raise DatastoreError(
            f"datastore {where} records no tokenizer, so it cannot be checked against tokenizer {tok.name!r}; "
            "rebuild it with `sssd build --tokenizer ...` or leave the tokenizer out"
        )
    if recorded["sha256"] != tok.sha256:
        raise DatastoreError(
            f"tokenizer mismatch: datastore {where} was built with tokenizer {recorded.get('name')!r} "
            f"(sha256 {recorded['sha256'][:12]}, vocab {recorded.get('vocab_size')}) but the given tokenizer is "
            f"{tok.name!r} (sha256 {tok.sha256[:12]}, vocab {tok.vocab_size}); its token ids would not match. "
            "Use a datastore built with this tokenizer (`sssd build --tokenizer ...`)."
        )


# -- loaders -------------------------------------------------------------------


def _from_json(path: Path, name: str) -> Tokenizer:
    from tokenizers import Tokenizer as Backend  # native, loaded with the first tokenizer: `import sssd` stays light

    try:
        with open_regular(path) as f:  # NotRegularFileError for a FIFO, without blocking
            data = f.read()
    except NotRegularFileError:
        raise
    except OSError as e:
        raise ValueError(f"cannot load tokenizer {str(path)!r}: {e.strerror or e}") from None
    try:
        backend = Backend.from_str(data.decode("utf-8"))
    except Exception as e:  # the tokenizers library raises plain Exception subclasses
        raise ValueError(
            f"cannot load tokenizer {str(path)!r}: not a valid tokenizer.json ({_first_line(e)})"
        ) from None
    meta, config = {}, {}
    if path.name == TOKENIZER_FILE:
        # Side files: our cache's metadata, a datastore's manifest, a model folder's config.
        meta = (
            read_json_dict(path.parent / "sssd_tokenizer.json")
            or read_json_dict(path.parent / "manifest.json").get("tokenizer")
            or {}
        )
        config = read_json_dict(path.parent / "tokenizer_config.json")
    eos = meta.get("eos_token_id")
    if eos is None and isinstance(config.get("eos_token"), str):
        eos = backend.token_to_id(config["eos_token"])
    return Tokenizer(backend, name=meta.get("name") or name, path=path, eos_token_id=eos)


def _from_gguf(path: Path) -> Tokenizer:
    """Converts a GGUF file's tokenizer with transformers, once; then loads the cached json."""
    digest = file_sha256(path)
    target = cache_dir() / "tokenizers" / f"gguf-{digest}"
    if not (target / TOKENIZER_FILE).is_file():
        hf = _transformers_tokenizer(path.parent, gguf_file=path.name, spec=path)
        meta = {"name": path.stem, "source": str(path), "gguf_sha256": digest, "eos_token_id": hf.eos_token_id}
        _save_cached(hf.backend_tokenizer, meta, target)
    return _from_json(target / TOKENIZER_FILE, name=path.stem)


#: Files transformers can build a tokenizer from (besides tokenizer.json).
_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)


def _from_transformers_folder(path: Path) -> Tokenizer:
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ValueError(
            f"cannot load tokenizer {str(path)!r}: the folder has no tokenizer.json, .gguf or "
            f"other tokenizer files ({', '.join(_TOKENIZER_FILES)})"
        )
    for f in (*_TOKENIZER_FILES, "config.json", "special_tokens_map.json", "added_tokens.json"):
        if (path / f).exists():
            check_regular(path / f)  # transformers would block reading a FIFO
    hf = _transformers_tokenizer(path, spec=path)
    tok = Tokenizer(hf.backend_tokenizer, name=path.name, eos_token_id=hf.eos_token_id)
    target = cache_dir() / "tokenizers" / f"sha256-{tok.sha256}"
    if not (target / TOKENIZER_FILE).is_file():
        _save_cached(
            hf.backend_tokenizer, {"name": path.name, "source": str(path), "eos_token_id": hf.eos_token_id}, target
        )
    tok.path = target / TOKENIZER_FILE
    return tok


def _transformers_tokenizer(folder: Path, *, spec: Path, gguf_file: str | None = None) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers import AutoTokenizer  # optional, heavy: only to convert a GGUF or folder tokenizer
    except ImportError as e:
        raise ValueError(
            f"cannot load tokenizer {str(spec)!r}: it needs transformers (pip install transformers gguf): {e}"
        ) from None
    kwargs = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = AutoTokenizer.from_pretrained(str(folder), **kwargs)
    except Exception as e:
        raise ValueError(f"cannot load tokenizer {str(spec)!r}: {_first_line(e)}") from None
    if not hasattr(hf, "backend_tokenizer"):
        raise ValueError(
            f"cannot load tokenizer {str(spec)!r}: transformers gave a slow tokenizer with no tokenizer.json form"
        )
    return hf


def _save_cached(backend: Any, meta: dict, target: Path) -> None:
    """Writes tokenizer.json + sssd_tokenizer.json into ``target`` atomically. ``target`` is named by
    content, so a process that loses a race to write it keeps the winner's copy."""
    with atomic_directory(target, replace=False, tag="saving") as tmp:
        backend.save(str(tmp / TOKENIZER_FILE))
        (tmp / "sssd_tokenizer.json").write_text(json.dumps(meta, indent=2) + "\n")


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open_regular(path) as f:  # never blocks on a FIFO
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
