"""The S3-compatible adapter store (AWS S3, MinIO, GCS's and R2's S3 APIs) through boto3.

Layout under ``s3://bucket/prefix``:

    blobs/{id}/adapter_config.json, blobs/{id}/adapter_model.safetensors   the canonical files
    blobs/{id}/MANIFEST       {"files": {name: size}}: written last, so a blob exists for
                              readers once its manifest does (S3 writes are atomic per object and
                              read-after-write consistent); its LastModified is the blob's age
    trash/{token}/...         a blob set aside (a copy of its files and manifest)

Every gateway replica and worker sees the same objects, so uploads, replaces and deletes are
consistent across gateways by the catalog's protocol (`adapters.stores.base`): `set_aside`
copies the blob under trash/ and removes the original (manifest first), so a later `discard`
only ever touches the trash copy, never a blob another upload re-adopted meanwhile; `exists`
checks every file as well as the manifest, so an upload that raced a deletion re-adopts.
Reads go through a local `BlobCache` (workers read adapters from a directory).
"""

from __future__ import annotations

import builtins
import json
import shutil
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from adapters.errors import AdapterNotFoundError
from adapters.identity import check_adapter_id, is_adapter_id
from adapters.lora import LoraAdapter
from adapters.stores.cache import BlobCache
from adapters.stores.filesystem import DIR_MODE, STAGING_PREFIXES, stage_and_adopt

MANIFEST = "MANIFEST"
CACHE_DIR = "cache"
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}


@dataclass(frozen=True, slots=True)
class S3Aside:
    """A blob set aside: its trash prefix and its manifest."""

    token: str
    adapter_id: str
    files: dict[str, int]


class S3AdapterStore:
    """Blobs in a bucket; staging and the read cache in the local directory `root`."""

    def __init__(
        self,
        *,
        client: Any,
        bucket: str,
        prefix: str = "",
        root: Path,
        cache_bytes: int = 4 << 30,
        pinned: Callable[[], Collection[str]] = tuple,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        self.cache = BlobCache(self.root / CACHE_DIR, max_bytes=cache_bytes, pinned=pinned)

    @classmethod
    def from_url(cls, url: str, *, endpoint_url: str | None = None, **kwargs) -> S3AdapterStore:
        """``s3://bucket/prefix``; credentials and region from boto3's usual chain (the
        AWS_* environment, which a Kubernetes Secret fills)."""
        client, bucket, prefix = open_bucket(url, endpoint_url=endpoint_url)
        return cls(client=client, bucket=bucket, prefix=prefix, **kwargs)

    # --- keys ----------------------------------------------------------------------------

    def _blob(self, adapter_id: str, name: str = "") -> str:
        return f"{self.prefix}blobs/{check_adapter_id(adapter_id)}/{name}"

    def _trash(self, token: str, name: str = "") -> str:
        return f"{self.prefix}trash/{token}/{name}"

    # --- writing -------------------------------------------------------------------------

    def put(self, adapter: LoraAdapter) -> str:
        if self.exists(adapter.id):
            return adapter.id
        return stage_and_adopt(self, adapter)

    def adopt(self, adapter_id: str, staged: Path) -> bool:
        """Upload the staged files, then the manifest; False (age renewed) if present."""
        if self.exists(adapter_id):
            self.touch(adapter_id)
            return False
        files = {p.name: p.stat().st_size for p in sorted(Path(staged).iterdir()) if p.is_file()}
        for name in files:
            source = str(Path(staged) / name)
            self.client.upload_file(source, self.bucket, self._blob(adapter_id, name))
        self._put_manifest(self._blob(adapter_id, MANIFEST), files)
        return True

    def touch(self, adapter_id: str) -> bool:
        files = self._manifest(self._blob(adapter_id, MANIFEST))
        if files is None:
            return False
        self._put_manifest(self._blob(adapter_id, MANIFEST), files)
        return True

    def set_aside(self, adapter_id: str) -> S3Aside | None:
        files = self._manifest(self._blob(adapter_id, MANIFEST))
        if files is None:
            return None
        aside = S3Aside(token=uuid.uuid4().hex, adapter_id=adapter_id, files=files)
        self._delete([self._blob(adapter_id, MANIFEST)])  # readers stop seeing it first
        for name in files:
            self._copy(self._blob(adapter_id, name), self._trash(aside.token, name))
        self._put_manifest(self._trash(aside.token, MANIFEST), files)
        self._delete([self._blob(adapter_id, name) for name in files])
        self.cache.drop(adapter_id)
        return aside

    def restore(self, adapter_id: str, aside: S3Aside) -> None:
        """Put a set-aside blob back (kept as is if an upload re-adopted it meanwhile)."""
        if not self.exists(adapter_id):
            for name in aside.files:
                self._copy(self._trash(aside.token, name), self._blob(adapter_id, name))
            self._put_manifest(self._blob(adapter_id, MANIFEST), aside.files)
        self.discard(aside)

    def discard(self, aside: S3Aside) -> None:
        self._delete([self._trash(aside.token, n) for n in (*aside.files, MANIFEST)])

    def delete(self, adapter_id: str) -> bool:
        aside = self.set_aside(adapter_id)
        if aside is None:
            return False
        self.discard(aside)
        return True

    # --- reading -------------------------------------------------------------------------

    def exists(self, adapter_id: str) -> bool:
        """The manifest and every file it lists are there."""
        files = self._manifest(self._blob(adapter_id, MANIFEST))
        return files is not None and all(
            self._size(self._blob(adapter_id, n)) == size for n, size in files.items()
        )

    def get(self, adapter_id: str) -> Path:
        """A local directory holding the blob (fetched once into the cache)."""
        cached = self.cache.lookup(adapter_id)
        if cached is not None:
            return cached
        files = self._manifest(self._blob(adapter_id, MANIFEST))
        if files is None:
            raise AdapterNotFoundError(
                f"adapter {adapter_id} is not in the store", field="adapter_id"
            )

        def fetch(into: Path) -> None:
            for name, size in files.items():
                target = into / name
                self.client.download_file(self.bucket, self._blob(adapter_id, name), str(target))
                if target.stat().st_size != size:
                    raise AdapterNotFoundError(
                        f"adapter {adapter_id} changed while it was read", field="adapter_id"
                    )

        return self.cache.admit(adapter_id, fetch)

    def list(self) -> builtins.list[str]:
        return sorted(adapter_id for adapter_id, _ in self._manifests())

    def stale_entries(
        self, *, grace_s: float, now: float | None = None
    ) -> tuple[builtins.list[Any], builtins.list[str]]:
        """(local staging directories and trash prefixes, blob ids) older than `grace_s`."""
        now = time.time() if now is None else now
        leftovers: builtins.list[Any] = []
        for entry in self.root.iterdir():
            if entry.name.startswith(STAGING_PREFIXES):
                try:
                    if now - entry.lstat().st_mtime >= grace_s:
                        leftovers.append(entry)
                except FileNotFoundError:
                    continue
        trash_ages: dict[str, float] = {}
        for key, modified in self._objects(f"{self.prefix}trash/"):
            token = key[len(f"{self.prefix}trash/") :].split("/", 1)[0]
            trash_ages[token] = max(trash_ages.get(token, 0.0), modified)
        leftovers += [self._trash(t) for t, at in sorted(trash_ages.items()) if now - at >= grace_s]
        blobs = sorted(i for i, at in self._manifests() if now - at >= grace_s)
        return leftovers, blobs

    def discard_leftover(self, entry: Path | str) -> None:
        if isinstance(entry, Path):
            shutil.rmtree(entry, ignore_errors=True)
            return
        self._delete([key for key, _ in self._objects(entry)])

    # --- S3 calls ------------------------------------------------------------------------

    def _manifests(self) -> builtins.list[tuple[str, float]]:
        found = []
        for key, modified in self._objects(f"{self.prefix}blobs/"):
            parts = key[len(f"{self.prefix}blobs/") :].split("/")
            if len(parts) == 2 and parts[1] == MANIFEST and is_adapter_id(parts[0]):
                found.append((parts[0], modified))
        return found

    def _objects(self, prefix: str) -> builtins.list[tuple[str, float]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        objects = (o for page in pages for o in page.get("Contents", []))
        return [(o["Key"], o["LastModified"].timestamp()) for o in objects]

    def _manifest(self, key: str) -> dict[str, int] | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.ClientError as exc:
            if missing_object(exc):
                return None
            raise
        return {str(k): int(v) for k, v in json.loads(body)["files"].items()}

    def _put_manifest(self, key: str, files: dict[str, int]) -> None:
        body = json.dumps({"files": files}, sort_keys=True).encode()
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body)

    def _size(self, key: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except self.client.exceptions.ClientError as exc:
            if missing_object(exc):
                return None
            raise

    def _copy(self, source: str, target: str) -> None:
        self.client.copy_object(
            Bucket=self.bucket, Key=target, CopySource={"Bucket": self.bucket, "Key": source}
        )

    def _delete(self, keys: builtins.list[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            chunk = keys[start : start + 1000]
            if chunk:
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk]}
                )


def open_bucket(url: str, *, endpoint_url: str | None = None) -> tuple[Any, str, str]:
    """A boto3 client, the bucket and the key prefix of ``s3://bucket/prefix`` (credentials
    and region from boto3's usual chain)."""
    import boto3

    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"an adapter store URL is s3://bucket/prefix, not {url!r}")
    client = boto3.client("s3", endpoint_url=endpoint_url or None)
    return client, parsed.netloc, parsed.path


def missing_object(exc: Exception) -> bool:
    """Whether a boto3 ClientError says the object (or bucket key) does not exist."""
    error = getattr(exc, "response", {}).get("Error", {})
    return str(error.get("Code")) in _NOT_FOUND
