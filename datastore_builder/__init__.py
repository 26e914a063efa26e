"""Offline datastore building (``sssd build``); installed as ``sssd.datastore_builder``.

Modules:
    readers    one reader per input format (JSON/ShareGPT, JSONL, Parquet, Arrow, text, stdin)
    sharegpt   chat turns and roles, the held-out split, the packaged ShareGPT corpus
    tokenize   batch tokenization into one uint32 token stream
    build      the build: stages, timing, atomic output, manifest
    archive    writing zstd-compressed single-file archives (reading and unpacking them: sssd.archive)
    default    the default datastore's recipe (``sssd build --default``)
    paths      the SSSD cache directory
"""
