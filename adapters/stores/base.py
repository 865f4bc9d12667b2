"""The adapter store's one interface: validated adapters by content id.

Two backends implement it (`adapters.stores.filesystem`, `adapters.stores.s3`) and one contract
test suite runs against both (tests/adapters/test_store_contract.py). Blobs are
content-addressed (an id is the sha256 of the adapter's normalized content), so writing one is
idempotent and every replica that writes the same id writes the same bytes.

The deletion protocol the gateway's catalog follows (`gateway.uploads.catalog`): a blob leaves
only by `set_aside` (out of readers' sight, atomically as far as readers go), a second look at
its references, then `discard` or `restore`. Whatever a crash leaves behind (staging
directories, set-aside blobs, unnamed blobs) `stale_entries` reports once older than a grace
period.
"""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any, Protocol

from adapters.lora import LoraAdapter


class AdapterStore(Protocol):
    """Adapters by id; `get` returns a local directory `load_adapter_dir` can read."""

    # A local directory on the store's side of every rename: uploads are staged here (the
    # filesystem store's own root; the S3 store's local staging and cache directory).
    root: Path

    def put(self, adapter: LoraAdapter) -> str: ...

    def adopt(self, adapter_id: str, staged: Path) -> bool:
        """Store the `write_staged` directory `staged` as `adapter_id`; False if it was
        there already (then its age is renewed, so a sweep's grace counts from now)."""
        ...

    def get(self, adapter_id: str) -> Path: ...

    def exists(self, adapter_id: str) -> bool: ...

    def touch(self, adapter_id: str) -> bool: ...

    def set_aside(self, adapter_id: str) -> Any | None:
        """Take the blob out of readers' sight; a token for `discard` or `restore` (None:
        it was not there)."""
        ...

    def restore(self, adapter_id: str, aside: Any) -> None: ...

    def discard(self, aside: Any) -> None: ...

    def stale_entries(
        self, *, grace_s: float, now: float | None = None
    ) -> tuple[builtins.list[Any], builtins.list[str]]:
        """(leftovers for `discard_leftover`, blob ids) last written over `grace_s` ago."""
        ...

    def discard_leftover(self, entry: Any) -> None: ...

    def delete(self, adapter_id: str) -> bool: ...

    def list(self) -> builtins.list[str]: ...
