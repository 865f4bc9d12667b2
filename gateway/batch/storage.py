"""Where batch files' bytes live: one small interface (`FileBlobs`), so the files and the
runner never know the backend. They follow the adapter store's backend: a folder of its
volume (the embedded default), or its S3 bucket under `batch-files/` (`open_file_blobs`
chooses).
Blobs are written whole and atomically, and never changed once written: a file id names one
content for its whole life.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from adapters.stores.s3 import missing_object, open_bucket

# Batch files' folder inside the adapter store's volume (the adapter store lists only content
# ids there, so it never sees it), or their prefix in its bucket.
FOLDER = "batch-files"
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


class S3Blobs:
    """`s3://bucket/prefix/batch-files/<key>` in the adapter store's bucket: each object written
    whole by one upload (S3 makes it visible only once complete) and read back in chunks."""

    def __init__(self, *, client: Any, bucket: str, prefix: str = "") -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/{FOLDER}/" if prefix.strip("/") else f"{FOLDER}/"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, source: BinaryIO) -> int:
        counted = _CountingReader(source)
        self.client.upload_fileobj(counted, self.bucket, self._key(key))
        return counted.count

    def chunks(self, key: str) -> Iterator[bytes]:
        body = self._body(key)
        try:
            yield from body.iter_chunks(CHUNK_BYTES)
        finally:
            body.close()

    def read(self, key: str) -> bytes:
        body = self._body(key)
        try:
            return body.read()
        finally:
            body.close()

    def delete(self, key: str) -> bool:
        if not self.exists(key):
            return False
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        return True

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except self.client.exceptions.ClientError as exc:
            if missing_object(exc):
                return False
            raise
        return True

    def _body(self, key: str) -> Any:
        """The object's streaming body; a missing one raises FileNotFoundError, as on disk."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except self.client.exceptions.ClientError as exc:
            if missing_object(exc):
                raise FileNotFoundError(key) from exc
            raise


class _CountingReader:
    """A binary stream that counts what boto3's upload reads from it."""

    def __init__(self, source: BinaryIO) -> None:
        self.source = source
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        chunk = self.source.read(size)
        self.count += len(chunk)
        return chunk


def open_file_blobs(
    *, store_url: str, local: Path, override: Path | None, endpoint_url: str | None
) -> FileBlobs:
    """The one place batch files' backend is chosen: a folder named by `override` if set,
    else the adapter store's own backend (its S3 bucket when `store_url` is
    ``s3://bucket/prefix``; else the folder `local`)."""
    if override is not None or not store_url:
        return FilesystemBlobs(override or local)
    client, bucket, prefix = open_bucket(store_url, endpoint_url=endpoint_url)
    return S3Blobs(client=client, bucket=bucket, prefix=prefix)
