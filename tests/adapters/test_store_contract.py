"""One contract, two backends: the filesystem store and the S3 store (against moto's S3
server, a real S3-protocol endpoint on 127.0.0.1) pass the same tests. Two store objects on
one backend stand for two gateway replicas (or a gateway and a worker)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from adapters import AdapterNotFoundError, BaseModelSpec, LoraAdapter, load_adapter_dir
from adapters.stores import open_store
from adapters.stores.cache import BlobCache
from adapters.stores.filesystem import FilesystemAdapterStore, write_staged
from adapters.stores.s3 import S3AdapterStore
from gateway_support import TINY_CONFIG, write_adapter

SPEC = BaseModelSpec.from_config_dict(TINY_CONFIG)


def read(path: Path) -> LoraAdapter:
    return load_adapter_dir(path, base=SPEC, max_lora_rank=64, max_bytes=8 << 20)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[LoraAdapter]:
    root = tmp_path_factory.mktemp("adapters")
    return [read(write_adapter(root / f"a{seed}", seed=seed)) for seed in range(2)]


@pytest.fixture(params=["filesystem", "s3"])
def replicas(request, tmp_path):
    """Two store objects sharing one backend, as two gateways would."""
    if request.param == "filesystem":
        root = tmp_path / "store"
        yield FilesystemAdapterStore(root), FilesystemAdapterStore(root)
        return
    s3 = request.getfixturevalue("s3_server")
    prefix = f"t-{uuid.uuid4().hex[:8]}"  # each test its own part of the bucket
    yield tuple(
        S3AdapterStore(client=s3.client(), bucket=s3.bucket, prefix=prefix, root=tmp_path / side)
        for side in ("one", "two")
    )


def staged(adapter: LoraAdapter, store, tag: str) -> Path:
    path = store.root / f".upload-{tag}"
    path.mkdir()
    write_staged(adapter, path)
    return path


def test_put_get_list_delete_round_trip(replicas, adapters):
    one, two = replicas
    a, b = adapters
    assert one.list() == [] and not one.exists(a.id)
    assert one.put(a) == a.id and one.put(a) == a.id  # idempotent: ids are content
    one.put(b)
    assert two.list() == sorted([a.id, b.id]) and two.exists(a.id)
    assert read(two.get(a.id)).id == a.id  # the other replica reads the same content
    assert two.delete(a.id) is True and two.delete(a.id) is False
    assert not one.exists(a.id) and one.list() == [b.id]
    with pytest.raises(AdapterNotFoundError):
        one.get(a.id)


def test_adopt_stores_a_staged_blob_once_and_renews_its_age(replicas, adapters):
    one, two = replicas
    a = adapters[0]
    assert one.adopt(a.id, staged(a, one, "x")) is True
    assert two.adopt(a.id, staged(a, two, "y")) is False  # the other replica finds it there
    assert read(two.get(a.id)).id == a.id
    _, blobs = one.stale_entries(grace_s=60, now=time.time() + 120)
    assert blobs == [a.id]
    _, blobs = one.stale_entries(grace_s=60, now=time.time() + 30)
    assert blobs == []


def test_set_aside_restore_and_discard(replicas, adapters):
    one, two = replicas
    a = adapters[0]
    one.put(a)
    aside = one.set_aside(a.id)
    assert aside is not None and not two.exists(a.id) and two.list() == []
    assert one.set_aside(a.id) is None
    one.restore(a.id, aside)
    assert two.exists(a.id)
    aside = one.set_aside(a.id)
    one.discard(aside)
    assert not two.exists(a.id) and two.list() == []


def test_an_upload_racing_a_deletion_keeps_its_blob(replicas, adapters):
    """A replica re-adopts the content while another holds it aside: discarding the aside
    copy leaves the new blob whole, and restoring keeps it."""
    one, two = replicas
    a = adapters[0]
    one.put(a)
    aside = one.set_aside(a.id)
    assert two.adopt(a.id, staged(a, two, "race")) is True
    one.discard(aside)
    assert one.exists(a.id) and read(two.get(a.id)).id == a.id
    aside = one.set_aside(a.id)
    two.adopt(a.id, staged(a, two, "again"))
    one.restore(a.id, aside)
    assert one.exists(a.id) and one.list() == [a.id]


def test_stale_leftovers_are_reported_once_old_and_removed(replicas, adapters):
    one, _ = replicas
    a = adapters[0]
    one.put(a)
    (one.root / ".upload-crashed").mkdir()
    aside = one.set_aside(a.id)  # a gateway that died between set_aside and discard
    assert aside is not None
    leftovers, blobs = one.stale_entries(grace_s=60, now=time.time() + 30)
    assert leftovers == [] and blobs == []
    leftovers, _ = one.stale_entries(grace_s=60, now=time.time() + 120)
    assert len(leftovers) == 2
    for entry in leftovers:
        one.discard_leftover(entry)
    assert one.stale_entries(grace_s=0, now=time.time() + 120) == ([], [])


def test_malformed_ids_never_reach_the_backend(replicas):
    one, _ = replicas
    for bad in ("../etc", "A" * 64, "a" * 63):
        with pytest.raises(ValueError):
            one.get(bad)


def test_the_backend_is_chosen_by_configuration(tmp_path, s3_server, monkeypatch):
    assert isinstance(open_store("", local=tmp_path / "fs"), FilesystemAdapterStore)
    for name, value in s3_server.env:
        monkeypatch.setenv(name, value)
    store = open_store(
        f"s3://{s3_server.bucket}/p", local=tmp_path / "s3", endpoint_url=s3_server.endpoint
    )
    assert isinstance(store, S3AdapterStore) and store.list() == []
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        open_store("http://elsewhere/x", local=tmp_path / "bad")


def test_the_worker_cache_evicts_least_recent_but_never_a_loaded_adapter(tmp_path, adapters):
    source = tmp_path / "source"
    source.mkdir()
    dirs = {}
    for a in adapters:
        dirs[a.id] = source / a.id
        dirs[a.id].mkdir()
        write_staged(a, dirs[a.id])
    size = sum(f.stat().st_size for f in dirs[adapters[0].id].iterdir())
    loaded: set[str] = set()
    cache = BlobCache(tmp_path / "cache", max_bytes=size + size // 2, pinned=lambda: loaded)

    def fill(adapter_id):
        return lambda into: [
            (into / f.name).write_bytes(f.read_bytes()) for f in dirs[adapter_id].iterdir()
        ]

    a, b = adapters
    cache.admit(a.id, fill(a.id))
    loaded.add(a.id)
    cache.admit(b.id, fill(b.id))  # over budget, but a is loaded: it stays
    assert cache.lookup(a.id) is not None and cache.lookup(b.id) is not None
    loaded.clear()
    cache.evict()
    assert [i for _, _, i in cache.entries()] == [b.id]  # a was used least recently
    assert read(cache.lookup(b.id)).id == b.id
