"""The common format as a conversion endpoint (the store itself lives in `interop.store`)."""
from __future__ import annotations

from ..store import StoreReader, StoreWriter, is_store

detect = is_store


class Reader(StoreReader):
    """Conversions verify checksums in the background and confirm before finishing."""

    def __init__(self, path):
        super().__init__(path, verify="background")


class Writer(StoreWriter):
    holds_moe = True  # routed experts stored by expert-parallel rank (interop.store)
