"""The worker's trust boundary: who may call it, and Redis behind a password.

Real grpc.aio servers on loopback with a tiny model, certificates from runtime/certs.py,
a real redis-server started with --requirepass, and the real gateway under uvicorn.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.asyncio import Redis

from factories import add_byte_level_tokenizer, make_checkpoint
from gateway.worker_client import WorkerChannels, WorkerCredentials, generate_all
from gateway_support import (
    MODEL_NAME,
    create_tenant_key,
    delete_prefix,
    gateway_settings,
    running_gateway,
)
from rpc import worker_pb2, worker_pb2_grpc
from runtime import registry
from runtime.certs import WORKER_NAME, CertSet, TlsFiles, write_certs
from runtime.embedded_redis import free_port
from worker import LLMEngine, engine_config
from worker.serving.auth import WorkerAuth, WorkerAuthError
from worker.serving.server import WorkerServer

ENGINE_KWARGS = dict(dtype="float32", num_kv_blocks=32, max_num_seqs=4, max_loras=0)
TOKEN = "worker-token-0123456789abcdef"
STATS = worker_pb2.StatsRequest()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("base"), vocab_size=512, seed=5)
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertSet:
    return write_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory) -> CertSet:
    """A second, unrelated CA: its certificates must open nothing."""
    return write_certs(tmp_path_factory.mktemp("other-tls"))


def mtls(certs: CertSet, **extra) -> WorkerAuth:
    worker = certs.worker
    return WorkerAuth(tls_cert=worker.cert, tls_key=worker.key, tls_client_ca=worker.ca, **extra)


@contextlib.asynccontextmanager
async def running_worker(base, **kwargs):
    server = WorkerServer(
        lambda: LLMEngine(base, engine_config(**ENGINE_KWARGS)), model_name=MODEL_NAME, **kwargs
    )
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown(drain_timeout=1.0)


def tls_channel(port: int, *, ca: Path, client: TlsFiles | None = None, token: str = ""):
    credentials = WorkerCredentials(
        ca=ca.read_bytes(),
        cert=client.cert.read_bytes() if client else None,
        key=client.key.read_bytes() if client else None,
        token=token,
        server_name=WORKER_NAME,
    )
    return WorkerChannels(credentials).stub(f"127.0.0.1:{port}")


async def stats_code(stub) -> grpc.StatusCode:
    try:
        await stub.Stats(STATS, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def generate_request(max_tokens: int = 4) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id="r1",
        prompt_token_ids=[5, 6, 7],
        params=worker_pb2.SamplingParams(max_tokens=max_tokens, skip_special_tokens=True),
        tenant="acme",
    )


# --- mutual TLS and the token --------------------------------------------------------------


async def test_mutual_tls_admits_the_gateways_certificate_only(base, certs, other_certs):
    async with running_worker(base, auth=mtls(certs), health_port=0) as worker:
        port = worker.port
        gateway = tls_channel(port, ca=certs.gateway.ca, client=certs.gateway)
        assert await stats_code(gateway) == grpc.StatusCode.OK
        # No certificate, another CA's certificate, or no TLS at all: the handshake fails.
        no_cert = tls_channel(port, ca=certs.gateway.ca)
        assert await stats_code(no_cert) == grpc.StatusCode.UNAVAILABLE
        stranger = tls_channel(port, ca=certs.gateway.ca, client=other_certs.gateway)
        assert await stats_code(stranger) == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            code = await stats_code(worker_pb2_grpc.WorkerStub(plain))
            assert code == grpc.StatusCode.UNAVAILABLE
        # A worker whose certificate another CA signed is not believed by the gateway either.
        impostor = tls_channel(port, ca=other_certs.gateway.ca, client=certs.gateway)
        assert await stats_code(impostor) == grpc.StatusCode.UNAVAILABLE
        # Probes: health alone, in plaintext, on its own port; the Worker service is not there.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.health_port}") as plain:
            health = health_pb2_grpc.HealthStub(plain)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            code = await stats_code(worker_pb2_grpc.WorkerStub(plain))
            assert code == grpc.StatusCode.UNIMPLEMENTED


async def test_a_shared_token_is_required_on_every_call_but_health(base, certs):
    worker_files = certs.worker
    auth = WorkerAuth(tls_cert=worker_files.cert, tls_key=worker_files.key, token=TOKEN)
    async with running_worker(base, auth=auth) as worker:
        ca = certs.gateway.ca
        assert await stats_code(tls_channel(worker.port, ca=ca, token=TOKEN)) == grpc.StatusCode.OK
        for token in ("", TOKEN[:-1] + "x", TOKEN + "x"):
            stub = tls_channel(worker.port, ca=ca, token=token)
            assert await stats_code(stub) == grpc.StatusCode.UNAUTHENTICATED, token
            with pytest.raises(grpc.aio.AioRpcError) as info:  # streams too
                async for _ in stub.Generate(generate_request(), timeout=5):
                    pass
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert worker.engine.num_requests == 0
        channel = grpc.aio.secure_channel(
            f"127.0.0.1:{worker.port}",
            grpc.ssl_channel_credentials(ca.read_bytes()),
            [("grpc.ssl_target_name_override", WORKER_NAME)],
        )
        async with channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_gateways_channels_generate_through_mutual_tls_and_the_token(base, certs):
    async with running_worker(base, auth=mtls(certs, token=TOKEN)) as worker:
        settings = gateway_settings(
            redis_url="redis://127.0.0.1:1/0", prefix="unused:", model_dir=base,
            store=base / "store", worker_tls_ca=certs.gateway.ca,
            worker_tls_cert=certs.gateway.cert, worker_tls_key=certs.gateway.key,
            worker_token=TOKEN,
        )  # fmt: skip
        channels = WorkerChannels(WorkerCredentials.from_settings(settings))
        try:
            reply = await generate_all(
                channels, worker_id="w", address=f"127.0.0.1:{worker.port}",
                request=generate_request(), timeout_s=10,
            )  # fmt: skip
        finally:
            await channels.close()
        assert sum(len(r.token_ids) for r in reply.responses) == 4


def non_loopback_address() -> str | None:
    """One of this machine's own non-loopback IPv4 addresses, if it has a route."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))  # no packet is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


async def test_a_gateway_without_credentials_never_dials_off_loopback_in_plaintext():
    """A plaintext worker (one built without worker.serving.auth, listening everywhere): without
    credentials the gateway talks to it over loopback, but over any other address it insists
    on TLS, so the call fails instead of crossing a network in the clear."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker_pb2_grpc.WorkerServicer(), server)
    port = server.add_insecure_port("0.0.0.0:0")
    await server.start()
    channels = WorkerChannels()
    try:
        # UNIMPLEMENTED: the call reached the (empty) servicer.
        assert await stats_code(channels.stub(f"127.0.0.1:{port}")) == grpc.StatusCode.UNIMPLEMENTED
        assert await stats_code(channels.stub(f"{address}:{port}")) == grpc.StatusCode.UNAVAILABLE
    finally:
        await channels.close()
        await server.stop(grace=None)


# --- refusing to listen unauthenticated ----------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "worker.example"])
def test_a_worker_without_credentials_refuses_a_non_loopback_host(certs, host):
    with pytest.raises(WorkerAuthError, match="refusing to listen"):
        WorkerServer(lambda: pytest.fail("no model may load"), model_name="x", host=host)
    # TLS alone authenticates no caller; a client CA or a token does.
    server_only = WorkerAuth(tls_cert=certs.worker.cert, tls_key=certs.worker.key)
    with pytest.raises(WorkerAuthError, match="refusing to listen"):
        server_only.check(host)
    mtls(certs).check(host)
    WorkerAuth(tls_cert=certs.worker.cert, tls_key=certs.worker.key, token=TOKEN).check(host)
    for loopback in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        WorkerAuth().check(loopback)


def test_incomplete_credentials_are_refused(certs):
    for auth in [
        WorkerAuth(tls_cert=certs.worker.cert),  # no key
        WorkerAuth(token=TOKEN),  # a token in plaintext
        WorkerAuth(tls_client_ca=certs.worker.ca),  # mutual TLS without the worker's own cert
        WorkerAuth(tls_cert=certs.worker.cert, tls_key=certs.worker.key, token="short"),
    ]:
        with pytest.raises(WorkerAuthError):
            auth.check("127.0.0.1")


def test_the_worker_command_stops_at_once_on_an_open_host(tmp_path):
    """Refused before the model is read: the --model directory here holds no model at all."""
    result = subprocess.run(
        [sys.executable, "-c", "from switchboard.cli import main; raise SystemExit(main())",
         "worker", "--model", str(tmp_path), "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "refusing to listen on '0.0.0.0'" in result.stderr
    assert "Traceback" not in result.stderr


# --- Redis behind a password ---------------------------------------------------------------


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory):
    """A real redis-server that refuses clients without the password."""
    password = "redis-pass-0123456789"
    port = free_port()
    binary = "/usr/bin/redis-server"
    if not Path(binary).exists():
        from runtime.embedded_redis import redis_server_binary

        binary = str(redis_server_binary())
    process = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
         "no", "--requirepass", password, "--dir", str(tmp_path_factory.mktemp("redis"))],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port, password=password, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
    yield {
        "with": f"redis://:{password}@127.0.0.1:{port}/0",
        "user": f"redis://default:{password}@127.0.0.1:{port}/0",
        "wrong": f"redis://:wrong-{password}@127.0.0.1:{port}/0",
        "without": f"redis://127.0.0.1:{port}/0",
    }
    process.terminate()
    process.wait(timeout=10)


async def test_a_worker_registers_with_the_password_in_its_url_and_fails_clearly_without(
    base, password_redis, redis_prefix
):
    for url in ("without", "wrong"):
        client = Redis.from_url(password_redis[url])
        server = WorkerServer(
            lambda: pytest.fail("no model may load"), model_name="x", redis=client,
            redis_prefix=redis_prefix,
        )  # fmt: skip
        with pytest.raises(WorkerAuthError, match="Redis refused the worker's credentials"):
            await server.start()
        await client.aclose()
    client = Redis.from_url(password_redis["user"])
    try:
        async with running_worker(base, redis=client, redis_prefix=redis_prefix, worker_id="w"):
            [info] = await registry.live_workers(client, redis_prefix)
            assert info.worker_id == "w"
    finally:
        await delete_prefix(password_redis["with"], redis_prefix)
        await client.aclose()


async def test_the_gateway_serves_through_tls_workers_and_a_password_redis(
    base, certs, password_redis, redis_prefix, tmp_path
):
    """End to end: Redis with a password in both URLs, a worker with mutual TLS in the
    registry, the gateway under uvicorn. Without the password the gateway is not ready;
    without its client certificate it gets no answer from the worker."""
    tls = dict(
        worker_tls_ca=certs.gateway.ca,
        worker_tls_cert=certs.gateway.cert,
        worker_tls_key=certs.gateway.key,
    )
    common = dict(prefix=redis_prefix, model_dir=base, store=tmp_path / "store")
    client = Redis.from_url(password_redis["with"])
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    try:
        async with running_worker(
            base, auth=mtls(certs), redis=client, redis_prefix=redis_prefix, worker_id="w"
        ):
            settings = gateway_settings(redis_url=password_redis["with"], **common, **tls)
            async with running_gateway(settings) as gw:
                headers = {"Authorization": f"Bearer {await create_tenant_key(gw, 'acme')}"}
                async with httpx.AsyncClient(base_url=gw.url, headers=headers) as http:
                    assert (await http.get("/ready")).status_code == 200
                    done = await http.post("/v1/completions", json=body, timeout=30)
                assert done.status_code == 200, done.text
                assert done.json()["usage"]["completion_tokens"] == 4
                no_cert = gateway_settings(
                    redis_url=password_redis["with"], **common, worker_tls_ca=certs.gateway.ca
                )
                async with (
                    running_gateway(no_cert) as other,
                    httpx.AsyncClient(base_url=other.url, headers=headers) as http,
                ):
                    refused = await http.post("/v1/completions", json=body, timeout=30)
                assert refused.status_code == 502, refused.text  # the worker's, not the client's
                assert refused.json()["error"]["code"] == "worker_failed"
            without = gateway_settings(redis_url=password_redis["without"], **common, **tls)
            async with running_gateway(without) as gw, httpx.AsyncClient(base_url=gw.url) as http:
                ready = await http.get("/ready")
            assert ready.status_code == 503
    finally:
        await delete_prefix(password_redis["with"], redis_prefix)
        await client.aclose()


@pytest.fixture(scope="module")
def tls_redis(certs, tmp_path_factory):
    """A real redis-server on TLS only, with a password; its certificate is the test CA's."""
    password, port = "redis-pass-0123456789", free_port()
    files = certs.worker
    process = subprocess.Popen(
        ["/usr/bin/redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(files.cert), "--tls-key-file", str(files.key),
         "--tls-ca-cert-file", str(files.ca), "--tls-auth-clients", "no",
         "--requirepass", password, "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path_factory.mktemp("tls-redis"))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={files.ca}"
    deadline = time.monotonic() + 10
    while True:
        if process.poll() is not None:
            pytest.skip("this redis-server was built without TLS")
        try:
            redis.Redis.from_url(url, socket_connect_timeout=0.2).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    yield url
    process.terminate()
    process.wait(timeout=10)


async def test_rediss_urls_carry_tls_and_the_ca_for_worker_and_gateway(
    base, tls_redis, redis_prefix, tmp_path
):
    """`rediss://…?ssl_ca_certs=` is all either side needs for a private CA's Redis; without
    the CA the certificate is refused."""
    client = Redis.from_url(tls_redis)
    try:
        async with running_worker(base, redis=client, redis_prefix=redis_prefix, worker_id="w"):
            [info] = await registry.live_workers(client, redis_prefix)
            assert info.worker_id == "w"
            settings = gateway_settings(
                redis_url=tls_redis, prefix=redis_prefix, model_dir=base, store=tmp_path / "s"
            )
            async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url) as http:
                assert (await http.get("/ready")).status_code == 200
        no_ca = Redis.from_url(tls_redis.split("?")[0], socket_connect_timeout=1)
        with pytest.raises(redis.ConnectionError):
            await no_ca.ping()
        await no_ca.aclose()
    finally:
        await delete_prefix(tls_redis, redis_prefix)
        await client.aclose()


# --- the certificates ----------------------------------------------------------------------


def test_certificates_are_made_once_and_the_cli_never_overwrites_them(tmp_path, capsys):
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings
    from runtime.certs import ensure_certs
    from switchboard.cli import main

    first = ensure_certs(tmp_path / "home")
    written = {p: p.read_bytes() for f in (first.worker, first.gateway) for p in vars(f).values()}
    assert ensure_certs(tmp_path / "home") == first  # the second `switchboard up` reuses them
    assert all(path.read_bytes() == data for path, data in written.items())
    assert first.worker.key.stat().st_mode & 0o077 == 0  # private keys: owner only
    assert main(["certs", str(tmp_path / "home")]) == 1  # refuses to replace without --force
    assert "--force" in capsys.readouterr().err
    assert main(["certs", str(tmp_path / "home"), "--force"]) == 0
    assert first.worker.ca.read_bytes() != written[first.worker.ca]
    with pytest.raises(ValidationError, match="go together"):
        GatewaySettings(dev_mode=True, worker_tls_cert=first.gateway.cert)
