"""The filesystem adapter store: a directory (a volume shared by gateways and workers, or one
machine's disk), one subdirectory per content id. The default backend.

The store persists only `LoraAdapter`s, i.e. adapters already read and validated (the
gateway calls `load_adapter_dir` / `parse_adapter` once, at upload); it knows nothing about
base models or limits. Because ids are content hashes, `put` is idempotent and concurrent
puts of one adapter are harmless: whoever renames first wins, the other finds it done.

The gateway validates uploads in a child process, which writes the canonical directory
(`write_staged`) under the store's root; `adopt` then renames it into place, so the gateway
never holds the weights. `stale_entries`, `set_aside` and `restore` let the gateway sweep
what crashes leave (staging, upload and trash directories; blobs no name references), each
only once older than a grace period, and never a blob a name just took.
"""

from __future__ import annotations

import builtins
import os
import shutil
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from adapters.canonical import canonical_files
from adapters.errors import AdapterNotFoundError
from adapters.identity import check_adapter_id, is_adapter_id
from adapters.lora import LoraAdapter

# Group-readable so a gateway and a worker sharing a volume (same fsGroup) can both read;
# nothing for others: tenants' adapters are private.
DIR_MODE = 0o750
FILE_MODE = 0o640
# Names of what is not (yet, or any more) an adapter: never listed, swept once stale.
STAGING_PREFIXES = (".tmp-", ".upload-", ".trash-")


class FilesystemAdapterStore:
    """`root/<adapter id>/{adapter_config.json, adapter_model.safetensors}`, written atomically."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            try:
                self.root.mkdir(parents=True, mode=DIR_MODE)
                os.chmod(self.root, DIR_MODE)  # mkdir's mode is filtered by the umask
            except FileExistsError:
                pass  # another gateway replica, starting at the same moment, made it
        if self.root.stat().st_mode & stat.S_IWOTH:
            # Anyone could plant or swap an adapter under a valid id.
            raise PermissionError(f"adapter store root {self.root} is world-writable")

    def put(self, adapter: LoraAdapter) -> str:
        """Store `adapter` under its id (no-op if already there); returns the id."""
        if (self.root / check_adapter_id(adapter.id)).is_dir():
            return adapter.id
        return stage_and_adopt(self, adapter)

    def adopt(self, adapter_id: str, staged: Path) -> bool:
        """Move `staged` (a `write_staged` directory on the store's filesystem) into place
        as `adapter_id`; False if the id was there already (its mtime is renewed then, so a
        sweep's grace period counts from this upload). `staged` is gone or left to the caller."""
        final = self.root / check_adapter_id(adapter_id)
        if final.is_dir():
            os.utime(final)
            return False
        try:
            os.rename(staged, final)  # atomic: readers see all of it or none of it
        except OSError:
            if not final.is_dir():  # anything but "a concurrent put won the race"
                raise
            os.utime(final)
            return False
        os.utime(final)  # the grace period counts from now, not from when it was written
        _fsync_dir(self.root)
        return True

    def touch(self, adapter_id: str) -> bool:
        """Renew a stored blob's mtime (a name is about to reference it); False if absent."""
        try:
            os.utime(self.root / check_adapter_id(adapter_id))
        except FileNotFoundError:
            return False
        return True

    def set_aside(self, adapter_id: str) -> Path | None:
        """Move a blob out of readers' sight (atomically), to delete or `restore` it; None
        if it is not there."""
        aside = self.root / f".trash-{uuid.uuid4().hex}"
        try:
            os.rename(self.root / check_adapter_id(adapter_id), aside)
        except FileNotFoundError:
            return None
        os.utime(aside)  # fresh: no other sweep takes it for a stale leftover meanwhile
        return aside

    def discard(self, aside: Path) -> None:
        """Delete a blob set aside for good."""
        shutil.rmtree(aside, ignore_errors=True)

    def discard_leftover(self, entry: Path | str) -> None:
        """Delete one of `stale_entries`' leftovers."""
        shutil.rmtree(entry, ignore_errors=True)

    def restore(self, adapter_id: str, aside: Path) -> None:
        """Put a blob set aside back; if an upload re-adopted it meanwhile, keep that one."""
        try:
            os.rename(aside, self.root / check_adapter_id(adapter_id))
        except OSError:
            shutil.rmtree(aside, ignore_errors=True)

    def stale_entries(
        self, *, grace_s: float, now: float | None = None
    ) -> tuple[builtins.list[Path], builtins.list[str]]:
        """(staging / upload / trash directories, blob ids) last modified over `grace_s`
        ago: what a sweep may remove, the blobs once no name references them."""
        now = time.time() if now is None else now
        leftovers, blobs = [], []
        for entry in self.root.iterdir():
            try:
                if now - entry.lstat().st_mtime < grace_s:
                    continue
            except FileNotFoundError:
                continue
            if entry.name.startswith(STAGING_PREFIXES):
                leftovers.append(entry)
            elif is_adapter_id(entry.name) and entry.is_dir():
                blobs.append(entry.name)
        return leftovers, sorted(blobs)

    def get(self, adapter_id: str) -> Path:
        path = self.root / check_adapter_id(adapter_id)
        if not path.is_dir():
            raise AdapterNotFoundError(
                f"adapter {adapter_id} is not in the store", field="adapter_id"
            )
        return path

    def exists(self, adapter_id: str) -> bool:
        return (self.root / check_adapter_id(adapter_id)).is_dir()

    def delete(self, adapter_id: str) -> bool:
        """Remove an adapter; False if it was not there. Readers never see a half-deleted one."""
        path = self.root / check_adapter_id(adapter_id)
        trash = self.root / f".trash-{uuid.uuid4().hex}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash)
        _fsync_dir(self.root)
        return True

    def list(self) -> builtins.list[str]:
        """Stored ids, sorted; staging and trash directories are not ids, so never listed."""
        return sorted(p.name for p in self.root.iterdir() if is_adapter_id(p.name) and p.is_dir())


def write_staged(adapter: LoraAdapter, staging: Path) -> None:
    """Write `adapter`'s canonical files durably into the empty directory `staging`."""
    for name, data in canonical_files(adapter).items():
        _write_durably(staging / name, data)
    os.chmod(staging, DIR_MODE)
    _fsync_dir(staging)


def _write_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, FILE_MODE)  # the umask may have narrowed it


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stage_and_adopt(store: Any, adapter: LoraAdapter) -> str:
    """Write `adapter`'s canonical files in a staging folder under `store.root`, then let the
    store adopt them under its id (each backend's `put`, once it knows the id is new)."""
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=store.root))
    try:
        write_staged(adapter, staging)
        store.adopt(adapter.id, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return adapter.id
