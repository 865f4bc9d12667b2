"""The Kubernetes manifests (k8s/) and images (docker/): every overlay renders, passes strict
offline schema validation, and keeps the promises the processes depend on (ports, probes,
drain deadline, secrets, non-root read-only pods, who may reach whom).

Rendering uses real kustomize: `kustomize build`, or `kubectl kustomize` (kustomize v5 built
in). No Python 3.11 distribution on PyPI ships it (pykustomize bundles kustomize but needs
Python >= 3.14; the PyPI package named `kustomize` is an unrelated generator), and
re-implementing kustomize's merge rules in a test would check our reading of kustomize, not
kustomize. So the binary comes with the machine (kubectl is installed on these machines and
in CI); without it these tests skip on a laptop and fail in CI (CI=true), never silently pass.
Validation uses `kubernetes-validate` (a dev dependency) in strict mode, offline.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("cpu", "gpu", "multi-gpu")
# Native gRPC probes are GA since 1.27; validate against it and the newest bundled schemas.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
# worker/serving/server.py `_drain_and_stop`: after --drain-timeout it aborts what is left and waits
# up to 5 s for those calls, then stops the gRPC server with 1 s of grace.
WORKER_POST_DRAIN_S = 5 + 1
SHUTDOWN_MARGIN_S = 3
SECRET_NAME = re.compile(r"(TOKEN|PASSWORD|SECRET|API_KEY|CREDENTIALS?)$")
VAR_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render(path: Path) -> list[dict[str, Any]]:
    command = kustomize_command()
    if command is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs kustomize or kubectl (kustomize v5) to render k8s/")
        pytest.skip("neither kustomize nor kubectl is installed")
    result = subprocess.run(
        [*command, str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass
class Manifest:
    """One rendered overlay, with lookups by kind and name."""

    overlay: str
    docs: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [doc for doc in self.all(kind) if doc["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict[str, Any]]:
        return self.all("Deployment") + self.all("StatefulSet")

    def config_map(self, name: str) -> dict[str, str]:
        """Data of a generated ConfigMap, found by its name before the hash suffix."""
        found = [
            doc
            for doc in self.all("ConfigMap")
            if re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", doc["metadata"]["name"])
        ]
        assert len(found) == 1, f"{self.overlay}: ConfigMap {name}"
        return found[0].get("data", {})

    def config_map_by_full_name(self, name: str) -> dict[str, str]:
        return self.one("ConfigMap", name).get("data", {})


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return found


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """matchLabels semantics (the only form these manifests use)."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def named_port(c: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in c.get("ports", []) if p["name"] == name]
    return port


def env_value(c: dict[str, Any], name: str) -> str:
    (entry,) = [e for e in c.get("env", []) if e["name"] == name]
    return entry["value"]


def flag(c: dict[str, Any], name: str) -> str:
    """The value of `--name=value` in a container's args."""
    (value,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith(f"--{name}=")]
    return value


def prestop_sleep_seconds(c: dict[str, Any]) -> int:
    """How long a preStop hook delays SIGTERM: `sleep N` (exec) or the native sleep action."""
    hook = c.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep", f"unexpected preStop hook {command}"
    return int(command[1])


def drain_hook_script(c: dict[str, Any]) -> str:
    """The shell script of a `/bin/sh -c` preStop hook."""
    shell, option, script = c["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, option) == ("/bin/sh", "-c")
    return script


def ports_source() -> dict[str, int]:
    doc = yaml.safe_load((K8S / "base" / "ports.yaml").read_text())
    return {key: int(value) for key, value in doc["data"].items()}


@pytest.fixture(scope="module", params=OVERLAYS)
def manifest(request) -> Manifest:
    return Manifest(request.param, render(K8S / "overlays" / request.param))


# --- rendering and schemas -----------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_strict_schema_validation(manifest, version):
    for doc in manifest.docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_an_unknown_field(manifest):
    """Guards the test above: a misspelt field must fail, not pass silently."""
    broken = yaml.safe_load(yaml.safe_dump(manifest.one("Deployment", "switchboard-worker")))
    pod_spec(broken)["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_the_overlay_holds_the_whole_system(manifest):
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in manifest.docs}
    for expected in [
        ("Deployment", "switchboard-gateway"),
        ("Service", "switchboard-gateway"),
        ("HorizontalPodAutoscaler", "switchboard-gateway"),
        ("Deployment", "switchboard-worker"),
        ("Service", "switchboard-worker"),
        ("StatefulSet", "switchboard-redis"),
        ("Service", "switchboard-redis"),
        ("PersistentVolumeClaim", "switchboard-adapters"),
    ]:
        assert expected in names, f"{manifest.overlay}: {expected} missing"
    # ports.yaml is a kustomize-only source, never applied.
    assert ("ConfigMap", "switchboard-ports") not in names
    namespaces = {doc["metadata"].get("namespace") for doc in manifest.docs} - {None}
    assert len(namespaces) == 1, namespaces


# --- ports: one source, consistent everywhere, equal to the app's defaults -----------------


def test_ports_source_matches_the_apps_own_defaults():
    from gateway.settings import GatewaySettings
    from switchboard.cli import build_parser

    ports = ports_source()
    fields = GatewaySettings.model_fields
    assert ports["gateway-http"] == fields["port"].default
    # The gateway serves no separate metrics port unless told (SWITCHBOARD_METRICS_PORT,
    # which the manifest sets: check_ports); the port must not be its HTTP port.
    assert fields["metrics_port"].default is None
    assert ports["gateway-metrics"] != ports["gateway-http"]
    worker_defaults = build_parser().parse_args(["worker"])
    assert ports["worker-grpc"] == worker_defaults.port
    assert ports["worker-metrics"] == worker_defaults.metrics_port
    assert ports["redis"] == int(fields["redis_url"].default.rsplit(":", 1)[1].split("/")[0])


def check_ports(m: Manifest, ports: dict[str, int]) -> None:
    """Every place a port number appears agrees with `ports` (ports.yaml's values)."""
    gateway = m.one("Deployment", "switchboard-gateway")
    worker = m.one("Deployment", "switchboard-worker")
    redis = m.one("StatefulSet", "switchboard-redis")
    gw, wk, rd = (
        container(gateway, "gateway"),
        container(worker, "worker"),
        container(redis, "redis"),
    )

    http = ports["gateway-http"]
    assert named_port(gw, "http") == http
    assert int(env_value(gw, "SWITCHBOARD_PORT")) == http
    # Prometheus scrapes the separate metrics port (no auth), not /metrics on the HTTP port.
    gateway_metrics = ports["gateway-metrics"]
    assert named_port(gw, "metrics") == gateway_metrics
    assert int(env_value(gw, "SWITCHBOARD_METRICS_PORT")) == gateway_metrics
    assert scraped_port(gateway) == gateway_metrics
    # /admin on its own port of the pod's loopback: declared by no container port, so no
    # Service or NetworkPolicy can carry it (both are checked below).
    admin = ports["gateway-admin"]
    assert int(env_value(gw, "SWITCHBOARD_ADMIN_PORT")) == admin
    assert env_value(gw, "SWITCHBOARD_ADMIN_HOST") == "127.0.0.1"
    assert env_value(gw, "SWITCHBOARD_GATEWAY_URL") == f"http://127.0.0.1:{admin}"  # the CLI
    assert admin not in {p["containerPort"] for p in gw["ports"]}

    grpc = ports["worker-grpc"]
    assert named_port(wk, "grpc") == grpc
    assert int(flag(wk, "port")) == grpc
    metrics = ports["worker-metrics"]
    assert named_port(wk, "metrics") == metrics
    assert int(flag(wk, "metrics-port")) == metrics
    assert scraped_port(worker) == metrics
    # Probes go to the plaintext health port: kubelet cannot present a client certificate.
    health = ports["worker-health"]
    assert named_port(wk, "health") == health
    assert int(flag(wk, "health-port")) == health
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert wk[probe]["grpc"]["port"] == health, probe

    assert named_port(rd, "redis") == ports["redis"]
    assert int(env_value(rd, "REDIS_PORT")) == ports["redis"]
    assert rd["args"][rd["args"].index("--port") + 1] == str(ports["redis"])
    for c in (gw, wk):
        url = env_value(c, "SWITCHBOARD_REDIS_URL")
        assert url == f"redis://:$(REDIS_PASSWORD)@switchboard-redis:{ports['redis']}", url

    expected_service_port = {
        "switchboard-gateway": http,
        "switchboard-worker": grpc,
        "switchboard-redis": ports["redis"],
    }
    # The gateway's metrics port is for Prometheus, never for the Service's clients.
    gateway_service = m.one("Service", "switchboard-gateway")["spec"]["ports"]
    assert [(p["port"], p["targetPort"]) for p in gateway_service] == [(http, "http")]
    for service in m.all("Service"):
        name = service["metadata"]["name"]
        (target,) = [
            w
            for w in m.workloads()
            if selects({"matchLabels": service["spec"]["selector"]}, pod_labels(w))
        ]
        for port in service["spec"]["ports"]:
            assert port["port"] == expected_service_port[name]
            # A named targetPort that a container of the selected pods declares.
            resolved = [named_port(c, port["targetPort"]) for c in pod_spec(target)["containers"]]
            assert resolved == [port["port"]], (name, port)

    policy_ports = {
        "switchboard-gateway": [http, gateway_metrics],
        "switchboard-worker": [grpc, metrics],
        "switchboard-redis": [ports["redis"]],
    }
    for policy in m.all("NetworkPolicy"):
        rules = policy["spec"].get("ingress", [])
        found = [port["port"] for rule in rules for port in rule["ports"]]
        assert found == policy_ports.get(policy["metadata"]["name"], []), policy["metadata"]


def scraped_port(deployment: dict) -> int:
    """The port Prometheus scrapes on the deployment's pods (its annotations)."""
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    return int(annotations["prometheus.io/port"])


def test_ports_agree_everywhere(manifest):
    check_ports(manifest, ports_source())


def test_changing_ports_yaml_moves_every_port(tmp_path):
    """ports.yaml is the single place: new numbers reach every field, none of the old stay."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    old = ports_source()
    new = {
        "gateway-http": 8081,
        "gateway-metrics": 9412,
        "gateway-admin": 8011,
        "worker-grpc": 50061,
        "worker-health": 50062,
        "worker-metrics": 9411,
        "redis": 6390,
    }
    text = (copy / "base" / "ports.yaml").read_text()
    for key, value in new.items():
        text = text.replace(f'{key}: "{old[key]}"', f'{key}: "{value}"')
    (copy / "base" / "ports.yaml").write_text(text)
    for overlay in OVERLAYS:
        docs = render(copy / "overlays" / overlay)
        check_ports(Manifest(overlay, docs), new)
        rendered = yaml.safe_dump_all(docs)
        for value in old.values():
            assert not re.search(rf"\b{value}\b", rendered), f"{value} left in {overlay}"


# --- probes, drain and shutdown ------------------------------------------------------------


def test_worker_probes_use_grpc_health(manifest):
    from rpc import worker_pb2

    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
    wk = container(manifest.one("Deployment", "switchboard-worker"), "worker")
    # Readiness and startup ask for the Worker service, which the server marks NOT_SERVING
    # while loading and draining; liveness asks for the server as a whole.
    assert wk["startupProbe"]["grpc"]["service"] == service
    assert wk["readinessProbe"]["grpc"]["service"] == service
    assert wk["livenessProbe"]["grpc"].get("service", "") == ""
    # Liveness waits for the model to load: the startup probe must allow minutes.
    startup = wk["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_gateway_probes_hit_its_health_routes(manifest):
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(dev_mode=True))
    routes = {path for route in app.routes if isinstance(path := getattr(route, "path", None), str)}
    gw = container(manifest.one("Deployment", "switchboard-gateway"), "gateway")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert gw[probe]["httpGet"]["port"] == "http", probe
        assert gw[probe]["httpGet"]["path"] in routes, probe
    # Redis down must give clients the gateway's 503, not an empty Service.
    assert gw["readinessProbe"]["httpGet"]["path"] != "/ready"


def test_worker_grace_period_covers_its_drain(manifest):
    """The preStop hook is the drain itself (no sleep before it), and the hook's time counts
    against the grace period: it must cover the drain, the abort and the server stop."""
    worker = manifest.one("Deployment", "switchboard-worker")
    wk = container(worker, "worker")
    drain = float(flag(wk, "drain-timeout"))
    needed = drain + WORKER_POST_DRAIN_S + SHUTDOWN_MARGIN_S
    grace = pod_spec(worker)["terminationGracePeriodSeconds"]
    # Long enough that SIGKILL never cuts a drain short; not so long that it means nothing.
    assert needed <= grace <= needed + 30, (drain, grace)


def test_worker_prestop_hook_starts_the_drain_and_waits_for_it(manifest):
    worker = manifest.one("Deployment", "switchboard-worker")
    wk = container(worker, "worker")
    script = drain_hook_script(wk)
    # SIGTERM to PID 1 (the worker: see below) starts its drain; the hook then waits while
    # the process lives, so kubelet's own SIGTERM comes only after the drain (to no one).
    assert re.search(r"\bkill -TERM 1\b", script), script
    assert re.search(r"\bwhile kill -0 1\b", script), script
    # PID 1 is the worker only if the image's exec-form ENTRYPOINT runs unwrapped and the
    # pod does not share one PID namespace (where PID 1 is the pause process).
    assert "command" not in wk
    assert not pod_spec(worker).get("shareProcessNamespace", False)
    dockerfile = (ROOT / "docker" / "worker.Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["switchboard"\]$', dockerfile, flags=re.MULTILINE)


# A stand-in for the worker: on SIGTERM it drains for a while, then exits.
DRAINING_PROCESS = """
import pathlib, signal, sys, time

def drain(*_):
    time.sleep(1.0)
    pathlib.Path(sys.argv[1]).write_text("drained")
    sys.exit(0)

signal.signal(signal.SIGTERM, drain)
pathlib.Path(sys.argv[2]).touch()
while True:
    time.sleep(60)
"""


def test_worker_drain_hook_returns_only_after_the_process_has_drained(tmp_path):
    """The hook's script, run for real against a process standing in for PID 1."""
    docs = yaml.safe_load_all((K8S / "base" / "worker.yaml").read_text())
    worker = next(d for d in docs if d["kind"] == "Deployment")
    drained, ready = tmp_path / "drained", tmp_path / "ready"
    process = subprocess.Popen([sys.executable, "-c", DRAINING_PROCESS, drained, ready])
    # Reap it the moment it exits: `kill -0` succeeds on a zombie (in a pod, PID 1 exiting
    # ends the container instead).
    reaper = threading.Thread(target=process.wait, daemon=True)
    reaper.start()
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.01)
        script, replaced = re.subn(
            r"\b(kill -(?:TERM|0)) 1\b",
            rf"\1 {process.pid}",
            drain_hook_script(container(worker, "worker")),
        )
        assert replaced == 2, script
        started = time.monotonic()
        subprocess.run(["/bin/sh", "-c", script], timeout=20, check=True)
        assert drained.read_text() == "drained"
        assert time.monotonic() - started >= 1.0
    finally:
        if process.poll() is None:
            process.kill()
        reaper.join(timeout=5)
    assert process.returncode == 0


def test_gateway_grace_period_covers_prestop_and_graceful_shutdown(manifest):
    gateway = manifest.one("Deployment", "switchboard-gateway")
    gw = container(gateway, "gateway")
    assert prestop_sleep_seconds(gw) > 0  # endpoints are removed asynchronously: keep serving
    needed = prestop_sleep_seconds(gw) + float(flag(gw, "graceful-s")) + SHUTDOWN_MARGIN_S
    assert needed <= pod_spec(gateway)["terminationGracePeriodSeconds"]


def test_worker_advertises_its_pod_ip(manifest):
    wk = container(manifest.one("Deployment", "switchboard-worker"), "worker")
    assert flag(wk, "host") == "0.0.0.0"
    assert flag(wk, "advertise-host") == "$(POD_IP)"
    (pod_ip,) = [e for e in wk["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


# --- configuration and secrets --------------------------------------------------------------


def env_names(m: Manifest, c: dict[str, Any]) -> set[str]:
    names = {e["name"] for e in c.get("env", [])}
    for source in c.get("envFrom", []):
        names |= set(m.config_map_by_full_name(source["configMapRef"]["name"]))
    return names


def test_variable_references_are_all_defined(manifest):
    """Kubernetes leaves an undefined $(VAR) as literal text: `--port=$(TYPO)` would crash."""
    for workload in manifest.workloads():
        for c in pod_spec(workload)["containers"]:
            defined = env_names(manifest, c)
            texts = [*c.get("args", []), *c.get("command", [])]
            texts += [e["value"] for e in c.get("env", []) if "value" in e]
            for text in texts:
                for name in VAR_REFERENCE.findall(text):
                    assert name in defined, f"{c['name']}: $({name}) is not defined"


def test_gateway_and_workers_agree_on_shared_settings(manifest):
    gw = container(manifest.one("Deployment", "switchboard-gateway"), "gateway")
    wk = container(manifest.one("Deployment", "switchboard-worker"), "worker")
    shared = manifest.config_map("switchboard")
    for c in (gw, wk):
        sources = [
            manifest.config_map_by_full_name(s["configMapRef"]["name"]) for s in c["envFrom"]
        ]
        assert shared in sources, c["name"]
    assert env_value(wk, "SWITCHBOARD_REDIS_URL") == env_value(gw, "SWITCHBOARD_REDIS_URL")
    # The gateway refuses adapters above its SWITCHBOARD_MAX_LORA_RANK; workers pad to theirs.
    assert flag(wk, "max-lora-rank") == "$(SWITCHBOARD_MAX_LORA_RANK)"
    assert "SWITCHBOARD_MAX_LORA_RANK" in shared
    assert "SWITCHBOARD_KEY_PREFIX" in shared  # gateway and registry share one key prefix


def test_no_secret_is_written_in_the_manifests(manifest):
    assert manifest.all("Secret") == []  # created by the operator (k8s/README.md)
    for cm in manifest.all("ConfigMap"):
        for key in cm.get("data", {}):
            assert not SECRET_NAME.search(key), f"{key} in ConfigMap {cm['metadata']['name']}"
    for workload in manifest.workloads():
        for c in pod_spec(workload)["containers"]:
            for entry in c.get("env", []):
                if SECRET_NAME.search(entry["name"]):
                    assert "value" not in entry, f"{entry['name']} is a literal"
    gw = container(manifest.one("Deployment", "switchboard-gateway"), "gateway")
    (token,) = [e for e in gw["env"] if e["name"] == "SWITCHBOARD_ADMIN_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "switchboard-admin", "key": "token"}


# --- who may call a worker, Redis' password --------------------------------------------------


def secret_mount(m: Manifest, workload: dict[str, Any], name: str, secret: str) -> str:
    """Where `secret` is mounted read-only in container `name` (0440: the pod's group)."""
    (volume,) = [
        v for v in pod_spec(workload)["volumes"] if v.get("secret", {}).get("secretName") == secret
    ]
    assert volume["secret"]["defaultMode"] == 0o440
    (mount,) = [m for m in container(workload, name)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    return mount["mountPath"]


def test_workers_require_the_gateways_client_certificate(manifest):
    """Workers listen on 0.0.0.0 with mutual TLS from Secret switchboard-worker-tls; gateways
    present the client certificate from switchboard-gateway-tls (`switchboard certs` writes
    both in the Secrets' layout: ca.crt, tls.crt, tls.key)."""
    from gateway.settings import GatewaySettings
    from worker.serving.auth import WorkerAuth

    worker = manifest.one("Deployment", "switchboard-worker")
    wk = container(worker, "worker")
    at = secret_mount(manifest, worker, "worker", "switchboard-worker-tls")
    files = {name: flag(wk, name) for name in ("tls-cert", "tls-key", "tls-client-ca")}
    assert files == {
        "tls-cert": f"{at}/tls.crt", "tls-key": f"{at}/tls.key", "tls-client-ca": f"{at}/ca.crt"
    }  # fmt: skip
    # What the worker itself checks at start: these flags may listen on the pod's IP.
    auth = WorkerAuth(**{k.replace("-", "_"): Path(v) for k, v in files.items()})
    auth.check(flag(wk, "host"))
    with pytest.raises(ValueError):
        WorkerAuth().check(flag(wk, "host"))

    gateway = manifest.one("Deployment", "switchboard-gateway")
    gw = container(gateway, "gateway")
    at = secret_mount(manifest, gateway, "gateway", "switchboard-gateway-tls")
    tls = {
        e["name"]: e["value"] for e in gw["env"] if e["name"].startswith("SWITCHBOARD_WORKER_TLS")
    }
    assert tls == {
        "SWITCHBOARD_WORKER_TLS_CA": f"{at}/ca.crt",
        "SWITCHBOARD_WORKER_TLS_CERT": f"{at}/tls.crt",
        "SWITCHBOARD_WORKER_TLS_KEY": f"{at}/tls.key",
    }
    fields = GatewaySettings.model_fields
    assert {name.removeprefix("SWITCHBOARD_").lower() for name in tls} <= set(fields)
    # The optional shared token comes from one Secret for both sides, never a literal.
    for c in (gw, wk):
        (token,) = [e for e in c["env"] if e["name"] == "SWITCHBOARD_WORKER_TOKEN"]
        ref = token["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "switchboard-worker-token", "key": "token", "optional": True}


def test_redis_requires_a_password_from_a_secret(manifest):
    redis = manifest.one("StatefulSet", "switchboard-redis")
    rd = container(redis, "redis")
    assert rd["args"][rd["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "--protected-mode" not in rd["args"]
    assert 'REDISCLI_AUTH="$REDIS_PASSWORD"' in rd["readinessProbe"]["exec"]["command"][-1]
    gw = container(manifest.one("Deployment", "switchboard-gateway"), "gateway")
    wk = container(manifest.one("Deployment", "switchboard-worker"), "worker")
    for c in (rd, gw, wk):
        names = [e["name"] for e in c["env"]]
        (password,) = [e for e in c["env"] if e["name"] == "REDIS_PASSWORD"]
        ref = {"name": "switchboard-redis", "key": "password"}
        assert password["valueFrom"]["secretKeyRef"] == ref, c["name"]
        if c is not rd:
            # $(VAR) expands only from entries listed before it.
            assert names.index("REDIS_PASSWORD") < names.index("SWITCHBOARD_REDIS_URL")
            assert "$(REDIS_PASSWORD)@" in env_value(c, "SWITCHBOARD_REDIS_URL")


# --- security, resources, storage ----------------------------------------------------------


def test_every_pod_is_non_root_with_a_read_only_root(manifest):
    for workload in manifest.workloads():
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False
        empty_dirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in spec["containers"]:
            security = c["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            # Writable scratch (HOME, caches) lives on an emptyDir mounted at /tmp.
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert mounts.get("/tmp") in empty_dirs, c["name"]
            for e in c.get("env", []):
                if e["name"] in ("HOME", "TRITON_CACHE_DIR"):
                    assert e["value"].startswith("/tmp"), e


def test_every_container_has_requests_and_limits(manifest):
    for workload in manifest.workloads():
        for c in pod_spec(workload)["containers"]:
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][bound]), (c["name"], bound)


def test_gpu_overlays_request_a_gpu_per_rank_of_each_worker(manifest):
    """gpu: one GPU per worker; multi-gpu: N per worker pod, its model split over N ranks
    (--tensor-parallel-size) that talk through a /dev/shm sized for NCCL; cpu: none."""
    worker = manifest.one("Deployment", "switchboard-worker")
    c = container(worker, "worker")
    gpus = {bound: c["resources"][bound].get("nvidia.com/gpu") for bound in ("requests", "limits")}
    assert flag(c, "tensor-parallel-size") == "$(SWITCHBOARD_WORKER_TENSOR_PARALLEL_SIZE)"
    options = manifest.config_map("switchboard-worker")
    ranks = int(options["SWITCHBOARD_WORKER_TENSOR_PARALLEL_SIZE"])
    if manifest.overlay == "cpu":
        assert gpus == {"requests": None, "limits": None}
        assert ranks == 1
        return
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare GPU
    assert gpus == {"requests": ranks, "limits": ranks}
    assert ranks == (2 if manifest.overlay == "multi-gpu" else 1)
    shm = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}.get("/dev/shm")
    if ranks == 1:
        assert shm is None
        return
    (volume,) = [v for v in pod_spec(worker)["volumes"] if v["name"] == shm]
    assert volume["emptyDir"]["medium"] == "Memory"
    size = volume["emptyDir"]["sizeLimit"]
    assert size.endswith("Gi") and int(size[:-2]) >= 1  # NCCL's buffers, past Docker's 64 MiB


def test_workers_run_the_engine_on_the_gpu_they_request(manifest):
    worker = container(manifest.one("Deployment", "switchboard-worker"), "worker")
    assert flag(worker, "device") == "$(SWITCHBOARD_WORKER_DEVICE)"
    device = manifest.config_map("switchboard-worker")["SWITCHBOARD_WORKER_DEVICE"]
    assert device == ("cpu" if manifest.overlay == "cpu" else "cuda")


def test_adapter_store_is_shared_at_one_path(manifest):
    """Gateway and workers mount the store at one place (SWITCHBOARD_ADAPTER_STORE)."""
    gateway = manifest.one("Deployment", "switchboard-gateway")
    worker = manifest.one("Deployment", "switchboard-worker")

    def store_mount(workload, name):
        (volume,) = [
            v
            for v in pod_spec(workload)["volumes"]
            if v.get("persistentVolumeClaim", {}).get("claimName") == "switchboard-adapters"
        ]
        (mount,) = [
            m for m in container(workload, name)["volumeMounts"] if m["name"] == volume["name"]
        ]
        return volume, mount

    _, gateway_mount = store_mount(gateway, "gateway")
    worker_volume, worker_mount = store_mount(worker, "worker")
    assert gateway_mount["mountPath"] == worker_mount["mountPath"]
    assert not gateway_mount.get("readOnly", False)
    assert worker_mount["readOnly"] and worker_volume["persistentVolumeClaim"]["readOnly"]
    store = Path(manifest.config_map("switchboard")["SWITCHBOARD_ADAPTER_STORE"])
    assert store.is_relative_to(gateway_mount["mountPath"])
    # Adapters are written group-readable: gateway and workers must share the group.
    groups = {pod_spec(w)["securityContext"]["fsGroup"] for w in (gateway, worker)}
    assert len(groups) == 1
    pvc = manifest.one("PersistentVolumeClaim", "switchboard-adapters")
    # The cpu overlay targets single-node dev clusters, where ReadWriteOnce is enough.
    expected = "ReadWriteOnce" if manifest.overlay == "cpu" else "ReadWriteMany"
    assert pvc["spec"]["accessModes"] == [expected]


# --- who may reach whom, disruption budgets, autoscaling -----------------------------------


def test_network_policies_let_only_the_gateway_reach_workers(manifest):
    workloads = {w["metadata"]["name"]: pod_labels(w) for w in manifest.workloads()}
    metrics_port = ports_source()["worker-metrics"]
    gateway_metrics_port = ports_source()["gateway-metrics"]

    def allowed_sources(policy_name: str, *, skip_port: int | None = None) -> set[str]:
        policy = manifest.one("NetworkPolicy", policy_name)
        sources = set()
        for rule in policy["spec"]["ingress"]:
            if [p["port"] for p in rule["ports"]] == [skip_port]:
                continue
            if "from" not in rule:
                return {"*"}
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, peer  # same namespace, named pods only
                sources |= {
                    n for n, labels in workloads.items() if selects(peer["podSelector"], labels)
                }
        return sources

    (deny,) = [p for p in manifest.all("NetworkPolicy") if p["spec"]["podSelector"] == {}]
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]

    def scrape_rule(policy_name: str, port: int) -> dict[str, Any]:
        rules = manifest.one("NetworkPolicy", policy_name)["spec"]["ingress"]
        (rule,) = [r for r in rules if [p["port"] for p in r["ports"]] == [port]]
        return rule

    # gRPC from gateways only; the metrics port (and only it) from Prometheus' namespace.
    assert allowed_sources("switchboard-worker", skip_port=metrics_port) == {"switchboard-gateway"}
    assert scrape_rule("switchboard-worker", metrics_port)["from"] == [{"namespaceSelector": {}}]
    assert allowed_sources("switchboard-redis") == {"switchboard-gateway", "switchboard-worker"}
    # HTTP from anywhere; the unauthenticated metrics port from in-cluster scrapers only.
    assert allowed_sources("switchboard-gateway", skip_port=gateway_metrics_port) == {"*"}
    gateway_scrape = scrape_rule("switchboard-gateway", gateway_metrics_port)
    assert gateway_scrape["from"] == [{"namespaceSelector": {}}]
    for name, labels in workloads.items():
        policy = manifest.one("NetworkPolicy", name)
        assert selects(policy["spec"]["podSelector"], labels), name


def test_replicated_workloads_have_disruption_budgets(manifest):
    budgets = manifest.all("PodDisruptionBudget")
    for deployment in manifest.all("Deployment"):
        matching = [b for b in budgets if selects(b["spec"]["selector"], pod_labels(deployment))]
        assert len(matching) == 1, deployment["metadata"]["name"]
        assert matching[0]["spec"].get("maxUnavailable") == 1
    # Redis is one pod: a budget would block every node drain (see k8s/base/redis.yaml).
    redis = manifest.one("StatefulSet", "switchboard-redis")
    assert not [b for b in budgets if selects(b["spec"]["selector"], pod_labels(redis))]


def test_gateway_autoscales_on_cpu_and_the_hpa_owns_its_replicas(manifest):
    hpa = manifest.one("HorizontalPodAutoscaler", "switchboard-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "switchboard-gateway"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "replicas" not in manifest.one("Deployment", "switchboard-gateway")["spec"]
    # CPU utilisation is measured against requests: there must be some.
    gw = container(manifest.one("Deployment", "switchboard-gateway"), "gateway")
    assert gw["resources"]["requests"]["cpu"]


# --- images ---------------------------------------------------------------------------------

GATEWAY_ENTRY_MODULES = (
    "gateway.main",
    "gateway.structured.grammar_child",  # the grammar checker's child processes
    "switchboard.admin_client",
    "worker.errors",
)
FIRST_PARTY = {
    "switchboard",
    "runtime",
    "training",
    "worker",
    "switchboard_kernels",
    "adapters",
    "gateway",
    "bench",
    "rpc",
}
HEAVY = {"torch", "triton", "transformers"}  # import names and distribution names alike


def module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def third_party_imports(entry_modules: tuple[str, ...]) -> set[str]:
    """Top-level third-party modules any import statement reachable from the entries names,
    function-level imports included (a superset of what runs: safe for an image)."""
    seen: set[str] = set()
    todo = list(entry_modules)
    found: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        file = module_file(name)
        if file is None:
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for imported in names:
                top = imported.split(".")[0]
                if top in FIRST_PARTY:
                    parts = imported.split(".")
                    todo += [".".join(parts[: i + 1]) for i in range(len(parts))]
                elif top not in sys.stdlib_module_names:
                    found.add(top)
    return found


def load_lockfile():
    """locks/lockfile.py, which reads the locks the images install."""
    path = ROOT / "locks" / "lockfile.py"
    spec = importlib.util.spec_from_file_location("lockfile", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


lockfile = load_lockfile()


def test_gateway_image_lock_covers_its_imports_without_torch():
    """locks/gateway.txt, all the gateway image installs, holds a distribution for every
    third-party module the gateway and `switchboard admin` import, and nothing heavy."""
    locked = set(lockfile.read_lock(ROOT / "locks" / "gateway.txt"))
    assert not HEAVY & locked
    providers = importlib.metadata.packages_distributions()
    imports = third_party_imports(GATEWAY_ENTRY_MODULES)
    assert "fastapi" in imports and not imports & HEAVY
    for module in imports:
        dists = {lockfile.normalize(d) for d in providers.get(module, [])}
        assert dists & locked, f"the gateway imports {module}; locks/gateway.txt has no provider"


def test_images_run_as_the_uid_the_pods_expect():
    users = set()
    for dockerfile in ("gateway.Dockerfile", "worker.Dockerfile"):
        text = (ROOT / "docker" / dockerfile).read_text()
        (user,) = re.findall(r"^USER (\d+):(\d+)$", text, flags=re.MULTILINE)
        users.add(user)
    for manifest_file in ("gateway.yaml", "worker.yaml"):
        docs = yaml.safe_load_all((K8S / "base" / manifest_file).read_text())
        security = pod_spec(next(d for d in docs if d["kind"] == "Deployment"))["securityContext"]
        assert users == {(str(security["runAsUser"]), str(security["runAsGroup"]))}


def test_gateway_image_never_installs_torch():
    text = (ROOT / "docker" / "gateway.Dockerfile").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs and not any("torch" in line for line in installs)
    assert "pip install --no-deps --no-build-isolation /src" in text  # skips its torch pin


def test_images_install_the_locks():
    """Both images install hash-checked pins of locks/ and the package with --no-deps."""
    for dockerfile in ("gateway.Dockerfile", "worker.Dockerfile"):
        text = (ROOT / "docker" / dockerfile).read_text()
        installs = re.findall(r"pip install ([^\n]*)", text)
        for install in installs:
            assert (
                "--require-hashes" in install
                or "--no-deps --no-build-isolation /src" in install
                or "torch==2.13.0" in install  # the CUDA build's torch, from its own index
            ), f"{dockerfile}: {install}"


def test_grafana_dashboard_queries_only_series_we_export():
    """Every switchboard_… series the dashboard queries is one the gateway or worker exports
    (a renamed metric would otherwise leave an empty panel), and it queries no other names
    (the gateway exports no process_/python_ series: its RSS and CPU are switchboard_…)."""
    import json

    from gateway.metrics import REGISTRY
    from worker.engine.engine_stats import EngineStats
    from worker.serving.metrics import EngineStatsCollector, WorkerMetrics
    from worker.spec_decode.stats import SpecDecodeStats

    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queried = {name for expr in expressions for name in re.findall(r"switchboard_[a-z_]+", expr)}
    for expr in expressions:
        assert not re.search(r"(?<![a-z_])(process|python)_", expr), expr
    stats = EngineStats(
        running=0, waiting=0, free_kv_blocks=1, total_kv_blocks=1, adapter_ids=(),
        spec_decode=SpecDecodeStats(),
    )  # fmt: skip
    families = [
        *REGISTRY.collect(),
        *WorkerMetrics(lambda: None).registry.collect(),
        *EngineStatsCollector(lambda: stats).collect(),
    ]
    exported = {f.name for f in families if f.name.startswith("switchboard_")}
    # A family `x` is queried as x, x_total (counters) or x_bucket/_count/_sum (histograms).
    unknown = {
        name for name in queried if re.sub(r"_(total|bucket|count|sum)$", "", name) not in exported
    }
    assert unknown == set()
