"""The Kubernetes manifests in deploy/kubernetes, without a cluster: every file parses (yaml.safe_load);
every resource validates against the Kubernetes API's JSON schemas, strictly (an unknown field, e.g. a
misspelled one, is an error), with kubernetes-validate (from PyPI, in the test extras; its schemas
ship inside the package, so this runs offline); and what the server needs is there: gRPC probes on
grpc.health.v1 at the gRPC port, a termination grace period longer than the server's drain, one GPU,
a headless Service for client-side balancing, a PodDisruptionBudget over the Deployment's pods, and
the model on a read-only volume. The PAGODA_* variables are checked against `pagoda serve`'s flags."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from grpc_fixtures import REPO

pytestmark = pytest.mark.timeout(120)

K8S = REPO / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests promise to fit (gRPC probes are GA since 1.27), and the newest
# that kubernetes-validate knows.
OLDEST = "1.27"


def kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: pip install -e '.[test]'")
    return kubernetes_validate


def yaml_files() -> list[Path]:
    return sorted(p for p in (REPO / "deploy").rglob("*") if p.suffix in (".yaml", ".yml"))


def resources() -> list[tuple[str, dict]]:
    """(file name, resource) for every Kubernetes resource in deploy/kubernetes (not the Kustomization)."""
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                found.append((path.name, doc))
    return found


def one(kind: str, name: str | None = None) -> dict:
    matches = [r for _, r in resources() if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def deployment() -> dict:
    return one("Deployment")


def container() -> dict:
    (c,) = deployment()["spec"]["template"]["spec"]["containers"]
    return c


def env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container().get("env", []) if "value" in e}


def validate(resource: dict, version: str) -> None:
    kv = kubernetes_validate()
    try:
        kv.validate(resource, version, strict=True)
    except kv.utils.SchemaNotFoundError as e:  # an unknown kind or apiVersion is an error here, not a warning
        pytest.fail(e.message)


# ---- every file parses; every resource is valid Kubernetes ----

def test_every_file_parses():
    assert yaml_files(), "no manifests under deploy/"
    for path in yaml_files():
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), path


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", [OLDEST, "latest"])
def test_manifests_validate_strictly(version):
    kv = kubernetes_validate()
    version = kv.utils.latest_version() if version == "latest" else version
    kinds = set()
    for name, resource in resources():
        try:
            validate(resource, version)
        except kv.ValidationError as e:
            pytest.fail(f"{name}: {resource['kind']}/{resource['metadata']['name']}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")
        kinds.add(resource["kind"])
    assert {"Deployment", "Service", "PodDisruptionBudget", "PersistentVolumeClaim"} <= kinds


def _spec(d):
    return d["spec"]["template"]["spec"]


def _first_container(d):
    return _spec(d)["containers"][0]


MUTATIONS = {
    "misspelled probe handler": lambda d: _first_container(d).__setitem__(
        "readinessProbe", {"grcp": {"port": 50051}}),
    "misspelled field in a probe": lambda d: _first_container(d)["livenessProbe"]["grpc"].__setitem__("prot", 50051),
    "misspelled pod field": lambda d: _spec(d).__setitem__(
        "terminationGracePeriodSecond", _spec(d).pop("terminationGracePeriodSeconds")),
    "misspelled container field": lambda d: _first_container(d).__setitem__(
        "volumeMount", _first_container(d).pop("volumeMounts")),
    "a named port where gRPC probes need a number": lambda d: _first_container(d)["startupProbe"]["grpc"].__setitem__(
        "port", "grpc"),
    "wrong type": lambda d: d["spec"].__setitem__("replicas", "two"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_checker_rejects_a_broken_manifest(mutation):
    """The checker is strict: the same Deployment with one field misspelled (or mistyped) fails."""
    kv = kubernetes_validate()
    broken = copy.deepcopy(deployment())
    MUTATIONS[mutation](broken)
    validate(deployment(), kv.utils.latest_version())  # the original passes
    with pytest.raises(kv.ValidationError):
        validate(broken, kv.utils.latest_version())


# ---- what the server needs ----

def test_env_vars_are_serve_flags():
    """Every PAGODA_* variable of the container is one `pagoda serve` reads (a typo would be ignored)."""
    from pagoda.client.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    known = {m for action in serve._actions for m in re.findall(r"\[env (PAGODA_\w+)\]", action.help or "")}
    assert "PAGODA_GRACE_PERIOD" in known and "PAGODA_MODEL" in known
    known |= {"PAGODA_CACHE", "PAGODA_PORT_FILE"}  # the image's own (docker/Dockerfile), not flags
    unknown = sorted(name for name in env() if name.startswith("PAGODA_") and name not in known)
    assert not unknown, f"not `pagoda serve` variables: {unknown}"


def test_probes_are_grpc_health_on_the_grpc_port():
    from pagoda.client.client import SERVICE_NAME

    c = container()
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    assert grpc_port == 50051 == int(env().get("PAGODA_PORT", 50051))
    for probe, services in (("startupProbe", (SERVICE_NAME, "")), ("readinessProbe", (SERVICE_NAME, "")),
                            ("livenessProbe", ("",))):
        assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert c[probe]["grpc"]["port"] == grpc_port, probe
        assert c[probe]["grpc"].get("service", "") in services, probe
    # loading a model takes a while: the startup probe allows minutes before liveness takes over
    startup = c["startupProbe"]
    assert startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) >= 300


def test_termination_grace_outlasts_the_servers_drain():
    from pagoda.server.main import DEFAULT_GRACE_S

    grace = float(env().get("PAGODA_GRACE_PERIOD", DEFAULT_GRACE_S))
    args = container().get("args", [])
    if "--grace-period" in args:
        grace = float(args[args.index("--grace-period") + 1])
    assert "PAGODA_GRACE_PERIOD" in env() or "--grace-period" in args, "set the grace period explicitly"
    # more than the drain: the engine's shutdown after it takes a few seconds too
    assert _spec(deployment())["terminationGracePeriodSeconds"] >= grace + 10


def test_one_gpu_per_pod():
    resources_ = container()["resources"]
    assert str(resources_["limits"]["nvidia.com/gpu"]) == "1"
    assert str(resources_["requests"].get("nvidia.com/gpu", "1")) == "1"
    assert env().get("PAGODA_DEVICE", "auto") in ("auto", "cuda")


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_headless_service_for_client_side_balancing():
    d = deployment()
    pod_labels = d["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p for p in container()["ports"]}
    svc = one("Service", "pagoda-headless")
    assert svc["spec"]["clusterIP"] == "None"
    assert _selects(svc["spec"]["selector"], pod_labels)
    by_name = {p["name"]: p for p in svc["spec"]["ports"]}
    assert by_name["grpc"]["port"] == 50051 and by_name["grpc"]["appProtocol"] == "grpc"
    assert by_name["http"]["port"] == 8000
    for name, p in by_name.items():  # each targets a port the container has
        target = p.get("targetPort", p["port"])
        assert target in (name, ports[name]["containerPort"]) and name in ports, p
    assert int(env().get("PAGODA_HTTP_PORT", 8000)) == ports["http"]["containerPort"] == 8000


def test_pdb_selects_the_deployments_pods():
    d = deployment()
    pdb = one("PodDisruptionBudget")
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert _selects(selector, d["spec"]["template"]["metadata"]["labels"])
    assert selector == d["spec"]["selector"]["matchLabels"]
    # a budget that lets a node drain go on: at least one pod may go at a time
    spec = pdb["spec"]
    if "minAvailable" in spec:
        assert int(spec["minAvailable"]) < d["spec"]["replicas"]
    else:
        assert int(spec["maxUnavailable"]) >= 1
    assert d["spec"]["replicas"] >= 2


def test_model_on_a_read_only_volume():
    c, spec = container(), _spec(deployment())
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/models")
    assert mount["readOnly"] is True
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert env()["PAGODA_MODEL"].startswith("/models/")
    assert env().get("HF_HUB_OFFLINE") == "1"  # never a hub download at start
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"]
        assert claim.get("readOnly") is True
        pvc = one("PersistentVolumeClaim", claim["claimName"])
        assert "ReadOnlyMany" in pvc["spec"]["accessModes"]
    else:
        assert "hostPath" in volume, volume
