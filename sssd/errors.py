"""SSSD's errors: the native core's (``SSSDError``, ``UnknownRequestError``) and ``DatastoreError``.

``DatastoreError`` lives here, below every module that raises it (the manifest, the
archive, the tokenizer's compatibility check, the datastore itself), so that none
of them imports another for its error class.
"""

from __future__ import annotations

from sssd._core import SSSDError, UnknownRequestError


class DatastoreError(SSSDError, ValueError):
    """A datastore is missing, corrupt, or incompatible.

    Both an ``sssd.SSSDError`` (as every error of the native core) and a ValueError
    (a bad datastore is a bad argument), so ``except ValueError`` catches it too;
    so is the core's own error for corrupt data files (``_core.CorruptDatastoreError``).
    """


__all__ = ["DatastoreError", "SSSDError", "UnknownRequestError"]
