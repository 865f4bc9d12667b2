"""Batch files' blobs behave alike on both backends: a folder, and an S3 bucket on a real
S3-protocol server (moto's, tests/README.md)."""

from __future__ import annotations

import io
import uuid

import pytest

from gateway.batch.storage import FilesystemBlobs, S3Blobs, open_file_blobs


@pytest.fixture(params=["filesystem", "s3"])
def blobs(request, tmp_path):
    if request.param == "filesystem":
        return FilesystemBlobs(tmp_path / "files")
    s3 = request.getfixturevalue("s3_server")
    return S3Blobs(client=s3.client(), bucket=s3.bucket, prefix=f"t-{uuid.uuid4().hex}")


def test_a_blob_is_written_whole_read_back_and_deleted_once(blobs):
    content = b"".join(b'{"custom_id": "%d"}\n' % i for i in range(100_000))  # ~2 MB: chunks
    assert not blobs.exists("file-abc")
    assert blobs.put("file-abc", io.BytesIO(content)) == len(content)
    assert blobs.exists("file-abc")
    assert blobs.read("file-abc") == content
    chunks = list(blobs.chunks("file-abc"))
    assert len(chunks) > 1 and b"".join(chunks) == content
    assert blobs.delete("file-abc") is True
    assert blobs.delete("file-abc") is False
    assert not blobs.exists("file-abc")
    with pytest.raises(FileNotFoundError):
        blobs.read("file-abc")
    with pytest.raises(FileNotFoundError):
        list(blobs.chunks("file-abc"))


@pytest.mark.parametrize("key", ["../escape", "a/b", ".hidden", "", "x" * 201])
def test_keys_that_could_leave_their_place_are_refused(blobs, key):
    with pytest.raises(ValueError):
        blobs.put(key, io.BytesIO(b"x"))


def test_batch_files_follow_the_adapter_store_unless_a_folder_is_named(
    s3_server, tmp_path, monkeypatch
):
    for name, value in s3_server.env:
        monkeypatch.setenv(name, value)
    url = f"s3://{s3_server.bucket}/tenants-files"
    chosen = open_file_blobs(
        store_url=url, local=tmp_path / "local", override=None, endpoint_url=s3_server.endpoint
    )
    assert isinstance(chosen, S3Blobs) and chosen.prefix == "tenants-files/batch-files/"
    chosen.put("file-1", io.BytesIO(b"line\n"))
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix="tenants-files/")
    assert [o["Key"] for o in listed["Contents"]] == ["tenants-files/batch-files/file-1"]
    named = open_file_blobs(
        store_url=url, local=tmp_path / "local", override=tmp_path / "shared", endpoint_url=None
    )
    assert isinstance(named, FilesystemBlobs) and named.root == tmp_path / "shared"
    local = open_file_blobs(
        store_url="", local=tmp_path / "local", override=None, endpoint_url=None
    )
    assert isinstance(local, FilesystemBlobs) and local.root == tmp_path / "local"
