"""Local copies of blobs fetched from object storage, least recently used first out.

A worker reads an adapter from a local directory (the LoRA manager re-reads it when its host
cache dropped it), so an object-storage backend fetches each blob once into this cache and
hands out its directory. Entries are whole directories renamed into place (a reader never
sees a partial one); their mtime is their last use. Past `max_bytes` the least recently used
entries go, except those `pinned` names (the adapters an engine has loaded: it may re-read
them at any time).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from adapters.identity import check_adapter_id, is_adapter_id


class BlobCache:
    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int,
        pinned: Callable[[], Collection[str]] = tuple,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o750)
        self.max_bytes = max_bytes
        self.pinned = pinned
        self._lock = threading.RLock()
        self._last_ns = 0

    def lookup(self, adapter_id: str) -> Path | None:
        """The cached directory (its use recorded), or None."""
        path = self.root / check_adapter_id(adapter_id)
        try:
            self._used(path)
        except FileNotFoundError:
            return None
        return path

    def _used(self, path: Path) -> None:
        """Stamp a use: strictly later than this process's last (a coarse filesystem clock
        would otherwise tie two uses in a row)."""
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1_000_000)
            os.utime(path, ns=(self._last_ns, self._last_ns))

    def admit(self, adapter_id: str, fill: Callable[[Path], None]) -> Path:
        """Fill a fresh directory with ``fill(dir)`` and move it into place (a concurrent
        admission of the same id wins harmlessly: ids are content); then evict to budget."""
        final = self.root / check_adapter_id(adapter_id)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            fill(staging)
            try:
                os.rename(staging, final)
            except OSError:
                if not final.is_dir():
                    raise
            self._used(final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.evict(keep=adapter_id)
        return final

    def drop(self, adapter_id: str) -> None:
        shutil.rmtree(self.root / check_adapter_id(adapter_id), ignore_errors=True)

    def entries(self) -> list[tuple[float, int, str]]:
        """(last use, bytes, id) of every entry, oldest first."""
        found = []
        for entry in self.root.iterdir():
            if not is_adapter_id(entry.name):
                continue
            try:
                size = sum(f.stat().st_size for f in entry.iterdir())
                found.append((entry.stat().st_mtime, size, entry.name))
            except FileNotFoundError:
                continue
        return sorted(found)

    def evict(self, *, keep: str = "") -> list[str]:
        """Remove least recently used entries until within `max_bytes`; returns their ids."""
        with self._lock:
            entries = self.entries()
            total = sum(size for _, size, _ in entries)
            pinned = set(self.pinned()) | {keep}
            evicted = []
            for _, size, adapter_id in entries:
                if total <= self.max_bytes:
                    break
                if adapter_id in pinned:
                    continue
                self.drop(adapter_id)
                total -= size
                evicted.append(adapter_id)
            return evicted
