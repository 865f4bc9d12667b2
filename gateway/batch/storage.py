"""Where batch files' bytes live: one small interface (`FileBlobs`), so the files and the
runner never know the backend. The filesystem backend is the embedded default, a folder of
the adapter store's volume; an object store (the adapter store's S3 backend) implements the
same five methods. Blobs are written whole and atomically, and never changed once written:
a file id names one content for its whole life.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

DIR_MODE = 0o750
FILE_MODE = 0o640
CHUNK_BYTES = 1 << 20
_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class FileBlobs(Protocol):
    """Blobs by key: written once from a binary stream, read back in chunks, deleted."""

    def put(self, key: str, source: BinaryIO) -> int: ...  # bytes written

    def chunks(self, key: str) -> Iterator[bytes]: ...

    def read(self, key: str) -> bytes: ...

    def delete(self, key: str) -> bool: ...

    def exists(self, key: str) -> bool: ...


def check_key(key: str) -> str:
    """Keys are ours (file ids), never a client's name; still, nothing that could leave the
    folder passes."""
    if not _KEY.match(key) or key.startswith("."):
        raise ValueError(f"invalid blob key {key!r}")
    return key


class FilesystemBlobs:
    """`root/<key>`, written to a temporary file, fsynced and renamed into place."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        if self.root.stat().st_mode & stat.S_IWOTH:
            raise PermissionError(f"batch file store {self.root} is world-writable")

    def put(self, key: str, source: BinaryIO) -> int:
        final = self.root / check_key(key)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
        written = 0
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := source.read(CHUNK_BYTES):
                    out.write(chunk)
                    written += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return written

    def chunks(self, key: str) -> Iterator[bytes]:
        with open(self.root / check_key(key), "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk

    def read(self, key: str) -> bytes:
        return (self.root / check_key(key)).read_bytes()

    def delete(self, key: str) -> bool:
        try:
            (self.root / check_key(key)).unlink()
        except FileNotFoundError:
            return False
        return True

    def exists(self, key: str) -> bool:
        return (self.root / check_key(key)).is_file()
