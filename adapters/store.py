"""The filesystem adapter store and the store interface, where they were first imported from
(the backends live in `adapters.stores`)."""

from adapters.stores.base import AdapterStore
from adapters.stores.filesystem import (
    DIR_MODE,
    FILE_MODE,
    STAGING_PREFIXES,
    FilesystemAdapterStore,
    write_staged,
)

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "STAGING_PREFIXES",
    "AdapterStore",
    "FilesystemAdapterStore",
    "write_staged",
]
