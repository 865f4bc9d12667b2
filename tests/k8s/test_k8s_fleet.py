"""The fleet on Kubernetes (k8s/overlays/two-bases = the cpu overlay + k8s/components/pool-qwen3):
one worker Deployment per base, told apart by the switchboard.io/base label, each with a
PodDisruptionBudget and an HPA on its own queue depth; the second base's Deployment is the
default pool's but for its name, label, checkpoint and volume (so the copy cannot drift); the
gateway reads that base's tokenizer from its volume; the store's credentials come from a Secret.
Rendered with real kustomize and validated strictly, as tests/k8s/test_k8s.py does."""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest
from test_k8s import (
    K8S,
    K8S_VERSIONS,
    Manifest,
    container,
    env_value,
    flag,
    named_port,
    pod_labels,
    pod_spec,
    ports_source,
    render,
    selects,
)

POOLS = {"default": "switchboard-worker", "qwen3": "switchboard-worker-qwen3"}


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    return Manifest("two-bases", render(K8S / "overlays" / "two-bases"))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_strict_schema_validation(manifest, version):
    for doc in manifest.docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_one_deployment_hpa_and_budget_per_base(manifest):
    deployments = manifest.all("Deployment")
    for base, name in POOLS.items():
        deployment = manifest.one("Deployment", name)
        assert pod_labels(deployment)["switchboard.io/base"] == base
        assert "replicas" not in deployment["spec"]  # its HPA owns them
        # No other Deployment's selector takes this pool's pods.
        owners = [d for d in deployments if selects(d["spec"]["selector"], pod_labels(deployment))]
        assert [d["metadata"]["name"] for d in owners] == [name]
        (budget,) = [
            b
            for b in manifest.all("PodDisruptionBudget")
            if selects(b["spec"]["selector"], pod_labels(deployment))
        ]
        assert budget["spec"]["maxUnavailable"] == 1
        hpa = manifest.one("HorizontalPodAutoscaler", name)
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "Deployment", "name": name
        }  # fmt: skip
        (metric,) = hpa["spec"]["metrics"]
        # Its own pods' queue depth, a custom per-pod metric the workers export.
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] == "switchboard_worker_waiting_sequences"


def test_the_second_pool_is_the_default_pool_but_for_its_base(manifest):
    default = copy.deepcopy(manifest.one("Deployment", POOLS["default"]))
    other = copy.deepcopy(manifest.one("Deployment", POOLS["qwen3"]))
    worker = container(other, "worker")
    assert flag(worker, "model") == "/models/qwen3"
    assert flag(worker, "served-model-name") == "qwen3"
    (models,) = [v for v in pod_spec(other)["volumes"] if v["name"] == "models"]
    assert models["persistentVolumeClaim"]["claimName"] == "switchboard-models-qwen3"
    # What is left once the base's own fields are taken out is the default pool's, exactly
    # (the cpu overlay's resource sizes apply to the default pool only).
    for d in (default, other):
        d["metadata"]["name"] = "pool"
        for labels in (
            d["spec"]["selector"]["matchLabels"],
            d["spec"]["template"]["metadata"]["labels"],
        ):
            labels.pop("switchboard.io/base")
        c = container(d, "worker")
        c["args"] = [a for a in c["args"] if not a.startswith(("--model=", "--served-model-name="))]
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "models"]
        c.pop("resources")
        pod_spec(d)["volumes"] = [v for v in pod_spec(d)["volumes"] if v["name"] != "models"]
    assert other == default


def test_the_second_pool_takes_its_ports_from_ports_yaml(manifest):
    ports = ports_source()
    worker = container(manifest.one("Deployment", POOLS["qwen3"]), "worker")
    assert named_port(worker, "grpc") == int(flag(worker, "port")) == ports["worker-grpc"]
    assert (
        named_port(worker, "health") == int(flag(worker, "health-port")) == ports["worker-health"]
    )
    assert int(flag(worker, "metrics-port")) == ports["worker-metrics"]
    assert env_value(worker, "SWITCHBOARD_REDIS_URL").endswith(f":{ports['redis']}")


def test_the_gateway_reads_each_base_from_its_volume(manifest):
    gateway = manifest.one("Deployment", "switchboard-gateway")
    gw = container(gateway, "gateway")
    roots = json.loads(env_value(gw, "SWITCHBOARD_MODEL_ROOTS"))
    (mount,) = [m for m in gw["volumeMounts"] if m["name"] == "models-qwen3"]
    assert mount["readOnly"] and any(mount["mountPath"].startswith(r) for r in roots)
    worker = container(manifest.one("Deployment", POOLS["qwen3"]), "worker")
    assert flag(worker, "model") == mount["mountPath"]  # the path its workers publish


def test_the_store_credentials_come_from_a_secret(manifest):
    for name in ("switchboard-gateway", *POOLS.values()):
        workload = manifest.one("Deployment", name)
        for c in pod_spec(workload)["containers"]:
            for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                (entry,) = [e for e in c["env"] if e["name"] == var]
                ref = entry["valueFrom"]["secretKeyRef"]
                assert ref["name"] == "switchboard-adapter-store" and ref["optional"] is True
    assert "SWITCHBOARD_ADAPTER_STORE_URL" in manifest.config_map("switchboard")
