"""The whole system on one machine: Redis, workers and the gateway as child processes.

``switchboard up`` (and ``make run``) use it, and so do the end-to-end tests, so what the
tests exercise is exactly what a user starts. Every child binds to 127.0.0.1, and the
gateway reaches the workers over mutual TLS with certificates made once under
``$SWITCHBOARD_HOME/tls`` (runtime/certs.py), as a deployment does.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from runtime.certs import CertSet, ensure_certs
from runtime.embedded_redis import EmbeddedRedis, free_port
from runtime.home import default_tls_dir
from runtime.kept_keys import keep_key, read_kept_key, up_key_path
from runtime.processes import reap


@dataclass
class Stack:
    """``with Stack(model=...) as stack:`` — Redis (reused or embedded), workers, gateway.

    ``extra_models``: more bases, each its own pool of ``num_workers`` workers behind the
    same gateway (``model`` is the gateway's default base)."""

    model: Path
    num_workers: int = 1
    extra_models: list[Path] = field(default_factory=list)
    # Object storage for adapters (s3://bucket/prefix) and its endpoint; the children get
    # the AWS_* credentials from the environment (``env``). None: the filesystem store.
    adapter_store_url: str | None = None
    adapter_store_endpoint: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # more environment for every child
    redis_url: str | None = None  # None: $SWITCHBOARD_REDIS_URL, 127.0.0.1:6379, or embedded
    gateway_port: int = 8000
    dtype: str = "auto"
    key_prefix: str = "sb:"
    admin_token: str = field(default_factory=lambda: "adm-" + secrets.token_urlsafe(24))
    home: Path | None = None  # SWITCHBOARD_HOME for children (adapter store)
    worker_args: list[str] = field(default_factory=list)
    # > 0: workers run at this nice value, so on a machine they share with the gateway and
    # Redis the latency-bound processes get a core as soon as they wake (an engine keeps
    # every core busy); where each has its own CPUs (Kubernetes pods) it changes nothing.
    worker_nice: int = 0
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    worker_models: dict[str, Path] = field(default_factory=dict)  # each worker's base
    worker_ports: dict[str, int] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # each worker's /metrics
    gateway: subprocess.Popen | None = None
    certs: CertSet | None = None
    _redis: EmbeddedRedis | None = None
    _ports: set[int] = field(default_factory=set)  # worker ports handed out so far

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start(self, *, timeout: float = 180.0) -> Stack:
        self.certs = ensure_certs(default_tls_dir(self.home))
        self.redis_url = self.redis_url or reachable_redis()
        if self.redis_url is None:
            self._redis = EmbeddedRedis().start()
            self.redis_url = self._redis.url
        for i in range(self.num_workers):
            self.start_worker(f"worker-{i}")
        for model in self.extra_models:
            for i in range(self.num_workers):
                self.start_worker(f"{model.name}-worker-{i}", model=model)
        self.gateway = subprocess.Popen(
            [*switchboard_command(), "gateway", "--port", str(self.gateway_port)],
            env=self._env(),
        )
        self.wait_ready(timeout=timeout)
        return self

    @property
    def models(self) -> list[Path]:
        """Every base: the default first."""
        return [self.model, *self.extra_models]

    def stop_pool(self, model: Path) -> None:
        """Stop every worker of one base (they drain and leave the registry)."""
        for worker_id in [w for w, m in self.worker_models.items() if m == model]:
            process = self.workers.pop(worker_id)
            process.send_signal(signal.SIGTERM)
            reap(process, 15)
            del self.worker_models[worker_id]

    def start_worker(self, worker_id: str, *, model: Path | None = None) -> subprocess.Popen:
        # Both ports chosen here, distinct from every port this stack handed out: a worker
        # binding port 0 for its metrics could be given the port another worker was about to
        # bind (seen in CI as "Address already in use").
        port, metrics_port = self._unused_port(), self._unused_port()
        niced = ["nice", "-n", str(self.worker_nice)] if self.worker_nice else []
        args = [
            *niced, *switchboard_command(), "worker",
            "--model", str(model or self.model), "--port", str(port), "--dtype", self.dtype,
            "--redis-url", str(self.redis_url), "--redis-prefix", self.key_prefix,
            "--worker-id", worker_id, "--metrics-port", str(metrics_port),
            *self._worker_tls_args(), *self.worker_args,
        ]  # fmt: skip
        process = subprocess.Popen(args, env=self._env())
        self.workers[worker_id] = process
        self.worker_models[worker_id] = model or self.model
        self.worker_ports[worker_id] = port
        self.metrics_ports[worker_id] = metrics_port
        return process

    def _worker_tls_args(self) -> list[str]:
        assert self.certs is not None
        tls = self.certs.worker
        return [
            "--tls-cert",
            str(tls.cert),
            "--tls-key",
            str(tls.key),
            "--tls-client-ca",
            str(tls.ca),
        ]

    def worker_channel(self, worker_id: str, *, aio: bool = False):
        """A gRPC channel to one worker as the gateway dials it (its client certificate)."""
        import grpc

        from runtime.certs import WORKER_NAME

        assert self.certs is not None
        tls = self.certs.gateway
        credentials = grpc.ssl_channel_credentials(
            tls.ca.read_bytes(), tls.key.read_bytes(), tls.cert.read_bytes()
        )
        options = [("grpc.ssl_target_name_override", WORKER_NAME)]
        address = f"127.0.0.1:{self.worker_ports[worker_id]}"
        module = grpc.aio if aio else grpc
        return module.secure_channel(address, credentials, options)

    def _unused_port(self) -> int:
        while (port := free_port()) in self._ports or port == self.gateway_port:
            pass
        self._ports.add(port)
        return port

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SWITCHBOARD_REDIS_URL=str(self.redis_url),
            SWITCHBOARD_KEY_PREFIX=self.key_prefix,
            SWITCHBOARD_ADMIN_TOKEN=self.admin_token,
            SWITCHBOARD_MODEL=str(self.model),
            # The gateway reads each base's tokenizer where its workers loaded it.
            SWITCHBOARD_MODEL_ROOTS=json.dumps([str(m.resolve()) for m in self.models]),
            PYTHONUNBUFFERED="1",
            **self.env,
        )
        if self.adapter_store_url:
            env["SWITCHBOARD_ADAPTER_STORE_URL"] = self.adapter_store_url
            env["SWITCHBOARD_ADAPTER_STORE_ENDPOINT"] = self.adapter_store_endpoint or ""
        if self.certs is not None:  # the gateway's side (GatewaySettings.worker_tls_*)
            env.update(
                SWITCHBOARD_WORKER_TLS_CA=str(self.certs.gateway.ca),
                SWITCHBOARD_WORKER_TLS_CERT=str(self.certs.gateway.cert),
                SWITCHBOARD_WORKER_TLS_KEY=str(self.certs.gateway.key),
            )
        if self.home is not None:
            env["SWITCHBOARD_HOME"] = str(self.home)
        return env

    def wait_ready(self, *, timeout: float) -> None:
        """Until the gateway answers and every worker is in the registry."""
        import redis

        from runtime.registry import DEFAULT_PREFIX  # noqa: F401 (format owner)

        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(str(self.redis_url), decode_responses=True)
        while time.monotonic() < deadline:
            self._check_children()
            live = client.smembers(f"{self.key_prefix}workers")
            alive = [w for w in self.workers if w in live and client.exists(self._worker_key(w))]
            if len(alive) == len(self.workers) and self._gateway_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"the stack was not ready within {timeout:.0f} s")

    def _worker_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}worker:{worker_id}"

    def _gateway_ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/ready", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _check_children(self) -> None:
        for name, process in [*self.workers.items(), ("gateway", self.gateway)]:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode}")

    def admin(self, method: str, path: str, **kwargs) -> dict:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        response = httpx.request(
            method, f"{self.base_url}/admin{path}", headers=headers, timeout=30.0, **kwargs
        )
        response.raise_for_status()
        return response.json()

    def create_tenant_key(self, tenant: str) -> str:
        """Create the tenant (if new) and one API key for it; returns the key (shown once).

        A tenant left in a persistent Redis by an earlier run is reused, so `make run`
        works every time.
        """
        return self._new_key(tenant)["key"]

    def _new_key(self, tenant: str) -> dict:
        try:
            self.admin("POST", "/tenants", json={"name": tenant})
        except httpx.HTTPStatusError as error:
            if error.response.status_code != 409:  # 409: it already exists
                raise
        return self.admin("POST", f"/tenants/{tenant}/keys")

    def demo_key(self, tenant: str) -> str:
        """The key `switchboard up` prints: the one an earlier start left while Redis still
        knows it, else a new one (the tenant created if new).

        Redis keeps only a key's hash, so the key itself is kept in a file of mode 0600 under
        `$SWITCHBOARD_HOME/up-keys`, one per Redis, prefix and tenant: however often `up`
        starts on a Redis that outlives it, the tenant holds one key that `up` made.
        """
        path = up_key_path(self.home, f"{self.redis_url}|{self.key_prefix}|{tenant}")
        kept = read_kept_key(path)
        if kept is not None and self._key_is_live(tenant, kept["key_id"]):
            return kept["key"]
        new = self._new_key(tenant)
        keep_key(path, key_id=new["key_id"], key=new["key"])
        return new["key"]

    def _key_is_live(self, tenant: str, key_id: str) -> bool:
        try:
            live = self.admin("GET", f"/tenants/{tenant}/keys")["data"]
        except httpx.HTTPStatusError as error:
            if error.response.status_code == 404:  # no such tenant: a fresh Redis
                return False
            raise
        return any(entry["key_id"] == key_id for entry in live)

    def stop(self) -> None:
        """SIGTERM everyone (workers drain), then kill whatever is left."""
        children = [p for p in [self.gateway, *self.workers.values()] if p is not None]
        for process in children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in children:
            reap(process, 15)
        if self._redis is not None:
            self._redis.stop()
            self._redis = None

    def __enter__(self) -> Stack:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def reachable_redis() -> str | None:
    import redis

    for url in filter(None, [os.environ.get("SWITCHBOARD_REDIS_URL"), "redis://127.0.0.1:6379/0"]):
        try:
            redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
            return url
        except redis.RedisError:
            continue
    return None


def switchboard_command() -> list[str]:
    """The ``switchboard`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("switchboard")
    if not script.is_file():
        raise RuntimeError(f"{script} is missing: install the project (make install)")
    return [str(script)]
