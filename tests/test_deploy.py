"""The Kubernetes manifests in deploy/k8s: valid against a current Kubernetes
schema (kubernetes-validate, strict: unknown fields are errors), and consistent
with each other and with TokenFleet itself (names they reference exist, the
topology parses, every container command parses with the real CLI)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
#: the Kubernetes release whose schema the manifests must satisfy
KUBERNETES_VERSION = "1.34.0"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


DOCS = _docs()


def _of(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for _, d in DOCS:
        if d["kind"] in ("Deployment", "Job"):
            out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
    return out


def _argv(container: dict[str, Any]) -> list[str]:
    """The container's command line; ``sh -c "exec ..."`` unwrapped, with the
    pod-name variable filled in as Kubernetes would."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[:2] == ["sh", "-c"]:
        text = argv[2].replace('"$POD_NAME"', "tokenfleet-engines-x-1")
        argv = shlex.split(text.replace("$POD_IP", "10.0.0.7"))
        assert argv[0] == "exec", argv
        argv = argv[1:]
    return argv


def test_the_manifests_cover_what_a_deployment_needs() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in DOCS}
    for want in [
        ("Deployment", "tokenfleet-api"),
        ("Service", "tokenfleet-api"),
        ("Deployment", "tokenfleet-beat"),
        ("Job", "tokenfleet-migrate"),
        ("ConfigMap", "tokenfleet-config"),
        ("Secret", "tokenfleet-stores"),
        ("Deployment", "tokenfleet-engines-dc-a"),
        ("Deployment", "tokenfleet-engines-dc-b"),
        ("HorizontalPodAutoscaler", "tokenfleet-engines-dc-a"),
    ]:
        assert want in kinds, want


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}" for n, d in DOCS])
def test_each_manifest_validates_against_the_kubernetes_schema(
    name: str, doc: dict[str, Any]
) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name} ({doc['kind']} {doc['metadata']['name']}): {exc.message}")


def test_references_between_manifests_resolve() -> None:
    configmaps, secrets = _of("ConfigMap"), _of("Secret")
    pvcs, deployments = _of("PersistentVolumeClaim"), _of("Deployment")
    for owner, spec in _pod_specs():
        for c in spec["containers"]:
            for src in c.get("envFrom", []):
                if "configMapRef" in src:
                    assert src["configMapRef"]["name"] in configmaps, owner
                if "secretRef" in src:
                    assert src["secretRef"]["name"] in secrets, owner
            mounted = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounted <= {v["name"] for v in spec.get("volumes", [])}, owner
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, owner
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, owner
    for name, d in deployments.items():
        sel = d["spec"]["selector"]["matchLabels"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items(), name
    for name, svc in _of("Service").items():
        if svc["spec"].get("type") == "ExternalName":
            continue
        sel = svc["spec"]["selector"].items()
        assert any(
            sel <= d["spec"]["template"]["metadata"]["labels"].items() for d in deployments.values()
        ), f"Service {name} selects no pods"
    for name, hpa in _of("HorizontalPodAutoscaler").items():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments, name


def test_exactly_one_beat_and_the_api_probes_its_own_health_endpoint() -> None:
    beat = _of("Deployment")["tokenfleet-beat"]["spec"]
    # two beats would each publish tier shares and replica plans
    assert beat["replicas"] == 1 and beat["strategy"]["type"] == "Recreate"
    assert "tokenfleet-beat" not in _of("HorizontalPodAutoscaler")
    api = _of("Deployment")["tokenfleet-api"]["spec"]["template"]["spec"]["containers"][0]
    port = _of("ConfigMap")["tokenfleet-config"]["data"]["TOKENFLEET_API_PORT"]
    assert [p["containerPort"] for p in api["ports"]] == [int(port)]
    assert api["readinessProbe"]["httpGet"]["path"] == "/health"
    # liveness must not restart the API just because no engine is healthy
    assert "httpGet" not in api["livenessProbe"]


def test_the_topology_parses_and_every_worker_serves_a_dc_of_it_in_its_region() -> None:
    from tokenfleet.core.fleet.topology import parse_topology

    cm = _of("ConfigMap")["tokenfleet-topology"]["data"]["topology.yaml"]
    topo = parse_topology(yaml.safe_load(cm), "tokenfleet-topology")
    mount = _of("ConfigMap")["tokenfleet-config"]["data"]["TOKENFLEET_TOPOLOGY"]
    assert mount == "/etc/tokenfleet/topology.yaml"
    served = set()
    for name, d in _of("Deployment").items():
        if not name.startswith("tokenfleet-engines-"):
            continue
        spec = d["spec"]["template"]["spec"]
        worker = next(c for c in spec["containers"] if c["name"] == "worker")
        argv = _argv(worker)
        dc = argv[argv.index("--dc") + 1]
        assert dc in topo.datacenters, (name, dc)
        assert spec["nodeSelector"]["topology.kubernetes.io/region"] == (
            topo.datacenters[dc].region
        ), name
        hpa = _of("HorizontalPodAutoscaler")[name]["spec"]["metrics"][0]["external"]
        assert hpa["metric"] == {
            "name": "tokenfleet_replica_target",
            "selector": {"matchLabels": {"dc": dc}},
        }
        served.add(dc)
    assert served == set(topo.datacenters)


def test_every_container_command_parses_with_the_tokenfleet_cli() -> None:
    from tokenfleet.cli.main import build_parser

    parser = build_parser()
    seen = set()
    for owner, spec in _pod_specs():
        for c in spec["containers"]:
            argv = _argv(c)
            if argv[0] != "tokenfleet":
                continue
            args = parser.parse_args(argv[1:])  # SystemExit (a test error) if wrong
            seen.add(argv[1])
            if argv[1] == "worker":
                # the engine is in the same pod; the API reaches it at the pod's IP
                assert args.engine_url == "http://127.0.0.1:8000", owner
                assert args.public_engine_url == "http://10.0.0.7:8000", owner
                env = {e["name"] for e in c["env"]}
                assert {"POD_NAME", "POD_IP"} <= env, owner
    assert {"api", "worker", "beat", "db"} <= seen
