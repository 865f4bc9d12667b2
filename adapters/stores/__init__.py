"""The adapter store's backends behind one interface (`base.AdapterStore`): the local
filesystem (the default) and S3-compatible object storage. `open_store` is the one place a
backend is chosen, from configuration."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

from adapters.stores.base import AdapterStore
from adapters.stores.filesystem import FilesystemAdapterStore

__all__ = ["AdapterStore", "FilesystemAdapterStore", "open_store"]


def open_store(
    url: str | None,
    *,
    local: Path,
    endpoint_url: str | None = None,
    cache_bytes: int = 4 << 30,
    pinned: Callable[[], Collection[str]] = tuple,
) -> AdapterStore:
    """The filesystem store at `local` when `url` is empty; for ``s3://bucket/prefix`` the
    S3 store, staging uploads and caching reads in `local` (boto3 is imported only then)."""
    if not url:
        return FilesystemAdapterStore(local)
    from adapters.stores.s3 import S3AdapterStore

    return S3AdapterStore.from_url(
        url, endpoint_url=endpoint_url, root=local, cache_bytes=cache_bytes, pinned=pinned
    )
