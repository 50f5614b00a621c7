"""deploy/k8s: every overlay rendered by the real `kubectl kustomize` (once per session) and validated
against the Kubernetes schemas; the CRDs those schemas lack (the Prometheus Operator's ServiceMonitor,
cert-manager's Issuer and Certificate) against small schemas of their required fields here; and the
wiring between the pieces: the fleet file's discovery names the workers' headless Service, every
command line parses with ctxfuse's own parser, and only the gateway reaches the workers."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from ctxfuse.cli import build_parser
from gateway.backends.fleet.config import load

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = ("single-node", "fleet")
K8S_VERSIONS = ("1.30.0", "1.37.0")  # the oldest and newest this fleet is checked against

_NAME = {"type": "string", "minLength": 1}
_META = {"type": "object", "required": ["name"], "properties": {"name": _NAME}}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": {"type": "object", "required": ["matchLabels"]},
                    "namespaceSelector": {"type": "object"},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["port", "path"],
                            "additionalProperties": False,
                            "properties": {
                                "port": _NAME,
                                "path": {"type": "string", "pattern": "^/"},
                                "interval": {"type": "string", "pattern": "^[0-9]+(s|m)$"},
                            },
                        },
                    },
                },
            },
        },
    },
    ("cert-manager.io/v1", "Issuer"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["ca"],
                "additionalProperties": False,
                "properties": {
                    "ca": {"type": "object", "required": ["secretName"], "properties": {"secretName": _NAME}}
                },
            },
        },
    },
    ("cert-manager.io/v1", "Certificate"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["secretName", "issuerRef", "dnsNames"],
                "additionalProperties": False,
                "properties": {
                    "secretName": _NAME,
                    "issuerRef": {
                        "type": "object",
                        "required": ["name", "kind"],
                        "properties": {"name": _NAME, "kind": {"enum": ["Issuer", "ClusterIssuer"]}},
                    },
                    "dnsNames": {"type": "array", "minItems": 1, "items": _NAME},
                    "usages": {
                        "type": "array",
                        "items": {
                            "enum": ["server auth", "client auth", "digital signature", "key encipherment"]
                        },
                    },
                    "duration": {"type": "string", "pattern": "^[0-9]+h$"},
                    "renewBefore": {"type": "string", "pattern": "^[0-9]+h$"},
                    "privateKey": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                            "size": {"type": "integer"},
                            "encoding": {"enum": ["PKCS1", "PKCS8"]},
                            "rotationPolicy": {"enum": ["Never", "Always"]},
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed (apt-get install kubectl): the overlays cannot be rendered")
    out = {}
    for name in OVERLAYS:
        text = subprocess.run(
            [kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / name)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        out[name] = [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def _one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas_or_its_crd_schema(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    crds = 0
    for obj in rendered[overlay]:
        schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if schema is not None:
            jsonschema.validate(obj, schema)
            crds += 1
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    assert crds == (3 if overlay == "fleet" else 0)  # the fleet has Prometheus and cert-manager


def test_the_schema_checks_refuse_a_wrong_object() -> None:
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "x"},
                "spec": {"ports": [{"port": "http"}]},
            },
            K8S_VERSIONS[0],
            strict=True,
        )
    bad = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {**bad, "spec": {"selector": {"matchLabels": {}}, "endpoints": [{"port": "http"}]}},
            CRD_SCHEMAS[("monitoring.coreos.com/v1", "ServiceMonitor")],
        )


def test_the_gateway_finds_the_workers_through_their_headless_service(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    for objs in rendered.values():
        config_map = next(
            o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("ctxfuse-fleet")
        )
        (tmp_path / "fleet.toml").write_text(config_map["data"]["fleet.toml"])
        fleet = load(tmp_path / "fleet.toml")
        assert fleet.discovery is not None and not fleet.backends
        headless = _one(objs, "Service", "ctxfuse-worker")
        workers = _one(objs, "StatefulSet", "ctxfuse-worker")
        assert headless["spec"]["clusterIP"] == "None" and not headless["spec"]["publishNotReadyAddresses"]
        assert (
            fleet.discovery.dns.split(".")[0]
            == headless["metadata"]["name"]
            == workers["spec"]["serviceName"]
        )
        assert [p["port"] for p in headless["spec"]["ports"]] == [fleet.discovery.port]
        assert (
            headless["spec"]["selector"].items() <= workers["spec"]["template"]["metadata"]["labels"].items()
        )
        gateway = _one(objs, "Deployment", "ctxfuse-gateway")
        (mounted,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
        assert mounted["configMap"]["name"] == config_map["metadata"]["name"]  # the hashed name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_line_parses_with_ctxfuse_and_names_what_is_mounted(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objs = rendered[overlay]
    gateway = _container(_one(objs, "Deployment", "ctxfuse-gateway"))
    args = build_parser().parse_args(gateway["args"])
    assert (args.command, str(args.fleet), args.host, args.port) == (
        "serve",
        "/etc/ctxfuse/fleet.toml",
        "0.0.0.0",
        8000,
    )
    mounts = {m["mountPath"] for m in gateway["volumeMounts"]}
    assert str(args.fleet.parent) in mounts
    worker = _container(_one(objs, "StatefulSet", "ctxfuse-worker"))
    wargs = build_parser().parse_args(worker["args"])
    assert (wargs.command, wargs.port) == ("worker", 8001)
    assert wargs.device == ("cuda" if overlay == "fleet" else "cpu")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_are_ready_on_ready_drain_before_they_stop_and_gpus_only_in_the_fleet(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    workers = _one(rendered[overlay], "StatefulSet", "ctxfuse-worker")
    spec = workers["spec"]["template"]["spec"]
    c = _container(workers)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    shutdown = int(next(a for a in c["args"] if a.startswith("--shutdown-timeout=")).split("=")[1])
    assert pause > 10 and spec["terminationGracePeriodSeconds"] > pause + shutdown  # refresh_s is 10
    gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    if overlay == "fleet":
        assert gpus == 1 and c["image"].startswith("ctxfuse-worker-cuda:")
    else:
        assert gpus is None and c["image"].startswith("ctxfuse-worker-cpu:")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_scales_keeps_a_replica_through_disruptions_and_is_a_service(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objs = rendered[overlay]
    gateway = _one(objs, "Deployment", "ctxfuse-gateway")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    hpa = _one(objs, "HorizontalPodAutoscaler", "ctxfuse-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "ctxfuse-gateway",
    }
    assert hpa["spec"]["minReplicas"] <= gateway["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    pdb = _one(objs, "PodDisruptionBudget", "ctxfuse-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"].get("minAvailable", 0) < gateway["spec"]["replicas"] or "maxUnavailable" in pdb["spec"]
    c = _container(gateway)
    assert (
        c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["securityContext"]["readOnlyRootFilesystem"]
    )
    for svc in (o for o in objs if o["kind"] == "Service"):  # every Service selects some pods
        pods = [
            o["spec"]["template"]["metadata"]["labels"]
            for o in objs
            if o["kind"] in ("Deployment", "StatefulSet")
        ]
        assert any(svc["spec"]["selector"].items() <= p.items() for p in pods), svc["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_reaches_workers_and_redis(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    policies = [o for o in rendered[overlay] if o["kind"] == "NetworkPolicy"]
    deny = _one(policies, "NetworkPolicy", "default-deny-ingress")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    gateway_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "ctxfuse-gateway"}}}
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    for target in ("ctxfuse-worker", "redis"):
        sources = []
        for p in policies:
            sel = p["spec"]["podSelector"]
            named = sel.get("matchLabels", {}).get("app.kubernetes.io/name") == target or any(
                target in e["values"] for e in sel.get("matchExpressions", [])
            )
            if named:
                for rule in p["spec"]["ingress"]:
                    assert "from" in rule, p["metadata"]["name"]  # never "from anywhere"
                    sources += rule["from"]
        assert gateway_pods in sources
        assert all(s in (gateway_pods, prometheus) for s in sources)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_is_tagged_and_every_pod_runs_as_non_root(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    for o in rendered[overlay]:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = o["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        for c in spec["containers"]:
            name, _, tag = c["image"].rpartition(":")
            assert name and tag and tag != "latest", c["image"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_yaml_files_pass_yamllint() -> None:
    config = YamlLintConfig(
        "extends: default\nrules:\n  line-length: {max: 110}\n  document-start: disable\n"
    )
    files = sorted((DEPLOY / "k8s").rglob("*.yaml"))
    assert len(files) >= 10
    problems = [f"{f}:{p.line}: {p.message}" for f in files for p in linter.run(f.read_text(), config)]
    assert problems == []
