"""deploy/lws: one pagoda replica across two nodes (tensor parallelism, --nnodes 2) as a LeaderWorkerSet.
Offline: the Service and both pod templates validate strictly with kubernetes-validate; the
LeaderWorkerSet with jsonschema against its CRD's schema in tests/data/crds (made strict, as in
test_llm_d.py); and the pieces agree: the leader's and the worker's flags, once LWS's variables are
expanded, parse with `pagoda serve`'s own parser into one group of --nnodes = LWS size nodes that name
the leader's address and the same port; the probes ask the right health service on the right port; the
Service selects the leader alone."""
from __future__ import annotations

import copy
import functools
import json
import os

import pytest
import yaml

from grpc_fixtures import REPO
from test_deploy import OLDEST, kubernetes_validate
from test_llm_d import expand, strict

pytestmark = pytest.mark.timeout(120)

DIR = REPO / "deploy" / "lws"
GENERATION = "pagoda.v1.GenerationService"


@functools.cache
def _resources() -> tuple[dict, ...]:
    found = []
    for path in sorted(DIR.glob("*.yaml")):
        found += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") != "Kustomization"]
    return tuple(found)


def resources() -> list[dict]:
    return copy.deepcopy(list(_resources()))


def one(kind: str) -> dict:
    matches = [r for r in resources() if r["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


def lws() -> dict:
    return one("LeaderWorkerSet")


def template(role: str) -> dict:
    return lws()["spec"]["leaderWorkerTemplate"][f"{role}Template"]


def container(role: str) -> dict:
    (c,) = template(role)["spec"]["containers"]
    return c


def lws_env(role: str, index: int) -> dict[str, str]:
    """What LWS injects into a group's pods (pkg/utils/pod: LWS_LEADER_ADDRESS = NAME-GROUP.NAME.NAMESPACE
    with the default subdomain policy, LWS_GROUP_SIZE, LWS_WORKER_INDEX: 0 for the leader)."""
    name = lws()["metadata"]["name"]
    return {"LWS_LEADER_ADDRESS": f"{name}-0.{name}.llm", "LWS_GROUP_SIZE": str(size()),
            "LWS_WORKER_INDEX": str(index if role == "worker" else 0)}


def size() -> int:
    return lws()["spec"]["leaderWorkerTemplate"]["size"]


def parsed(role: str, index: int, monkeypatch):
    """(argparse namespace, EngineConfig) of the container's args, $(VAR)s expanded, with its PAGODA_*
    environment: as `pagoda serve` (the image's entry point) would parse them."""
    from pagoda.client.cli import build_parser
    from pagoda.server.main import check_serve_args, engine_config

    c = container(role)
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    for name in [n for n in os.environ if n.startswith("PAGODA_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("PAGODA_"):
            monkeypatch.setenv(name, value)
    values = {**env, **lws_env(role, index)}
    args = build_parser().parse_args(["serve", *(expand(a, values) for a in c["args"])])
    check_serve_args(args)
    return args, engine_config(args)


@functools.cache
def _validator():
    """jsonschema's validator of the stored LeaderWorkerSet schema made strict (test_llm_d.strict), with
    metadata.name required as the API server does; built once (checking the 360 kB schema takes a second)."""
    import jsonschema

    crd = json.loads((REPO / "tests" / "data" / "crds" / "leaderworkerset-v1.json").read_text())
    assert (crd["group"], crd["version"], crd["kind"]) == ("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet")
    schema = strict(crd["schema"])
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"]}
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate_crd(resource: dict) -> None:
    assert resource["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    _validator().validate(resource)


# ---- valid Kubernetes, valid LeaderWorkerSet ----

def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in DIR.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", [OLDEST, "latest"])
def test_kubernetes_kinds_and_pod_templates_validate_strictly(version):
    kv = kubernetes_validate()
    version = kv.utils.latest_version() if version == "latest" else version
    kinds = set()
    for r in resources():
        kinds.add(r["kind"])
        if r["kind"] != "LeaderWorkerSet":
            kv.validate(r, version, strict=True)
    assert kinds == {"LeaderWorkerSet", "Service"}
    for role in ("leader", "worker"):
        t = template(role)
        kv.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pagoda-{role}", **t["metadata"]},
                     "spec": t["spec"]}, version, strict=True)


def test_leaderworkerset_validates_against_its_schema():
    validate_crd(lws())


@pytest.mark.parametrize("mutation", ["misspelled field", "wrong type", "bad enum", "missing required"])
def test_the_crd_checker_rejects_a_broken_leaderworkerset(mutation):
    import jsonschema

    broken = copy.deepcopy(lws())
    spec = broken["spec"]["leaderWorkerTemplate"]
    if mutation == "misspelled field":
        spec["groupSize"] = spec.pop("size")
    elif mutation == "wrong type":
        spec["size"] = "2"
    elif mutation == "bad enum":
        spec["restartPolicy"] = "RecreateGroup"
    else:
        del spec["workerTemplate"]
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(broken)


# ---- the pieces agree ----

def test_recreates_the_group_on_a_restart():
    assert lws()["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_leader_and_workers_parse_into_one_group(monkeypatch):
    leader_args, leader = parsed("leader", 0, monkeypatch)
    assert leader.nnodes == size() == 2 and leader.node_rank == 0
    assert leader.master_addr == lws_env("leader", 0)["LWS_LEADER_ADDRESS"]
    for index in range(1, size()):
        _, worker = parsed("worker", index, monkeypatch)
        assert worker.node_rank == index
        assert worker.nnodes == leader.nnodes
        assert worker.tensor_parallel_size == leader.tensor_parallel_size
        assert worker.master_port == leader.master_port is not None
        assert worker.master_addr == leader.master_addr
        assert worker.model == leader.model
        assert worker.device == leader.device == "cuda"
    # the worker's address is LWS's, not a fixed name; the leader's store port is declared
    worker_args = container("worker")["args"]
    assert worker_args[worker_args.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
    assert worker_args[worker_args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    ports = {p["name"]: p["containerPort"] for p in container("leader")["ports"]}
    assert ports["rendezvous"] == leader.master_port
    assert ports["grpc"] == leader_args.port and ports["http"] == leader_args.http_port
    # a GPU per rank on each node
    for role in ("leader", "worker"):
        gpus = container(role)["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == leader.ranks_per_node == leader.tensor_parallel_size // leader.nnodes


def test_probes_ask_each_node_its_health_service(monkeypatch):
    leader_args, _ = parsed("leader", 0, monkeypatch)
    leader = container("leader")
    assert leader["readinessProbe"]["grpc"] == {"port": leader_args.port, "service": GENERATION}
    assert leader["startupProbe"]["grpc"] == {"port": leader_args.port, "service": GENERATION}
    worker_args, _ = parsed("worker", 1, monkeypatch)
    worker = container("worker")
    # node K > 0 serves grpc.health.v1's whole-server status ("") alone, on --host:--port
    assert worker["readinessProbe"]["grpc"] == {"port": worker_args.port, "service": ""}
    assert [p["containerPort"] for p in worker["ports"]] == [worker_args.port]
    assert worker_args.host == "0.0.0.0"


def test_service_selects_the_leader_alone():
    name = lws()["metadata"]["name"]
    # LWS creates the headless Service NAME (the pods' DNS, LWS_LEADER_ADDRESS) unless one exists
    assert one("Service")["metadata"]["name"] != name
    svc = one("Service")["spec"]
    # LWS labels every pod of the set with its name
    labels = {r: {**template(r)["metadata"]["labels"], "leaderworkerset.sigs.k8s.io/name": name}
              for r in ("leader", "worker")}
    assert svc["selector"].items() <= labels["leader"].items()
    assert not svc["selector"].items() <= labels["worker"].items()
    leader_ports = {p["name"] for p in container("leader")["ports"]}
    assert {p["targetPort"] for p in svc["ports"]} == {"grpc", "http"} <= leader_ports


def test_same_image_and_model_volume_on_every_node():
    assert container("leader")["image"] == container("worker")["image"]
    for role in ("leader", "worker"):
        (models,) = [v for v in template(role)["spec"]["volumes"] if v["name"] == "models"]
        assert models["persistentVolumeClaim"] == {"claimName": "pagoda-models", "readOnly": True}
