"""deploy/llm-d: pagoda replicas in an InferencePool behind a Gateway, routed by llm-d's endpoint picker on
their vLLM-named metrics and KV-cache events. Offline: Kubernetes' own kinds validate strictly with
kubernetes-validate; the CRD kinds (InferencePool, Gateway, HTTPRoute) with jsonschema against the CRDs'
schemas kept in tests/data/crds (made strict: an unknown field is an error; CEL rules are not checked);
and the pieces name each other: pool -> pods and picker, picker config -> pagoda's block size, hash seed,
hash scheme and events' endpoint and topic."""
from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from grpc_fixtures import REPO
from test_deploy import OLDEST, kubernetes_validate

pytestmark = pytest.mark.timeout(120)

DIR = REPO / "deploy" / "llm-d"
CRDS = {(d["group"], d["version"], d["kind"]): d for d in
        (json.loads(p.read_text()) for p in sorted((REPO / "tests" / "data" / "crds").glob("*.json")))}


def resources() -> list[dict]:
    found = []
    for path in sorted(DIR.glob("*.yaml")):
        found += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") != "Kustomization"]
    return found


def one(kind: str, name: str | None = None) -> dict:
    matches = [r for r in resources() if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def strict(schema):
    """The schema with additionalProperties: false wherever an object lists its properties and says nothing
    of others (the API server prunes unknown fields silently; a manifest's typo should fail here)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: strict(s) for n, s in v.items()} if k == "properties" else strict(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and \
            not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate_crd(resource: dict) -> None:
    import jsonschema

    group, version = resource["apiVersion"].split("/")
    crd = CRDS.get((group, version, resource["kind"]))
    assert crd is not None, f"no schema in tests/data/crds for {resource['apiVersion']} {resource['kind']}"
    schema = strict(crd["schema"])
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"]}
    jsonschema.validate(resource, schema)


def is_crd(resource: dict) -> bool:
    return not resource["apiVersion"].startswith(("v1", "apps/", "rbac.authorization.k8s.io/"))


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in DIR.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", [OLDEST, "latest"])
def test_kubernetes_kinds_validate_strictly(version):
    kv = kubernetes_validate()
    version = kv.utils.latest_version() if version == "latest" else version
    for r in resources():
        if not is_crd(r):
            kv.validate(r, version, strict=True)


def test_crd_kinds_validate_against_their_schemas():
    kinds = {r["kind"] for r in resources() if is_crd(r)}
    assert kinds == {"InferencePool", "Gateway", "HTTPRoute"}
    for r in resources():
        if is_crd(r):
            validate_crd(r)


@pytest.mark.parametrize("mutation", ["misspelled field", "wrong type", "missing required", "bad enum"])
def test_the_crd_checker_rejects_a_broken_pool(mutation):
    import jsonschema

    pool = copy.deepcopy(one("InferencePool"))
    spec = pool["spec"]
    if mutation == "misspelled field":
        spec["endpointPickerRefs"] = spec.pop("endpointPickerRef")
    elif mutation == "wrong type":
        spec["targetPorts"][0]["number"] = "8000"
    elif mutation == "missing required":
        del spec["selector"]
    else:
        spec["endpointPickerRef"]["failureMode"] = "FailSoft"
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(pool)


# ---- the pieces name each other ----

def pagoda_container() -> dict:
    (c,) = one("Deployment", "pagoda-pool")["spec"]["template"]["spec"]["containers"]
    return c


def pagoda_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in pagoda_container()["env"] if "value" in e}


def epp_config() -> dict:
    deployment = one("Deployment", "pagoda-epp")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    path = args[args.index("--config-file") + 1]
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if "configMap" in v)
    data = one("ConfigMap", volume["configMap"]["name"])["data"]
    assert path.startswith("/config/") and path.removeprefix("/config/") in data
    return yaml.safe_load(data[path.removeprefix("/config/")])


def scorer() -> dict:
    return next(p for p in epp_config()["plugins"] if p["type"] == "precise-prefix-cache-scorer")["parameters"]


def expand(text: str, values: dict) -> str:
    """Kubernetes' $(VAR) expansion of env values and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], text)


def test_pool_selects_the_pagoda_pods_and_names_the_picker():
    pool = one("InferencePool")["spec"]
    labels = one("Deployment", "pagoda-pool")["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pool["selector"]["matchLabels"].items())
    http = next(p for p in pagoda_container()["ports"] if p["name"] == "http")["containerPort"]
    assert [p["number"] for p in pool["targetPorts"]] == [http] == [int(pagoda_env()["PAGODA_HTTP_PORT"])]
    svc = one("Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    epp = one("Deployment", "pagoda-epp")
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == one("InferencePool")["metadata"]["name"]
    route = one("HTTPRoute")["spec"]
    assert route["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pagoda"}]
    assert route["parentRefs"][0]["name"] == one("Gateway")["metadata"]["name"]
    rules = one("Role")["rules"]
    assert {"pods", "inferencepools"} <= {r for rule in rules for r in rule["resources"]}


def test_picker_hashes_blocks_as_pagoda_does():
    from pagoda.engine.core.block_hash import PREFIX_HASH_ALGO

    tokens = scorer()["tokenProcessorConfig"]
    env = pagoda_env()
    assert tokens["blockSizeTokens"] == int(env["PAGODA_BLOCK_SIZE"])
    assert tokens["hashSeed"] == env["PYTHONHASHSEED"]
    assert tokens["hashAlgorithm"] == PREFIX_HASH_ALGO == "sha256_cbor"
    assert scorer()["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == env["PAGODA_SERVED_MODEL_NAME"]
    assert env["PAGODA_METRICS_COMPAT"] == "vllm"


def test_pagoda_publishes_its_events_where_the_picker_listens():
    from pagoda.engine.config import KVEventsConfig

    env = pagoda_env()
    values = {"NAMESPACE": "llm", "POD_IP": "10.0.0.7"}
    events = KVEventsConfig.parse(expand(env["PAGODA_KV_EVENTS_CONFIG"], values))
    assert events.enabled and events.publisher == "zmq"
    # a pod-side address without a wildcard: pagoda connects to the picker, which binds
    host, port = re.fullmatch(r"tcp://([^:*]+):(\d+)", events.endpoint).groups()
    assert host == "pagoda-epp.llm.svc.cluster.local"
    svc_ports = {p["name"]: p for p in one("Service", "pagoda-epp")["spec"]["ports"]}
    assert int(port) == svc_ports["zmq"]["port"]
    listen = scorer()["kvEventsConfig"]
    assert listen["zmqEndpoint"] == f"tcp://*:{svc_ports['zmq']['targetPort']}"
    epp_ports = {p["name"]: p["containerPort"] for p in
                 one("Deployment", "pagoda-epp")["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert epp_ports["zmq"] == svc_ports["zmq"]["targetPort"]
    # llm-d reads the topic as kv@POD@MODEL
    assert events.topic.startswith(listen["topicFilter"])
    _, pod, model = events.topic.split("@")
    assert pod == f"10.0.0.7:{env['PAGODA_HTTP_PORT']}" and model == env["PAGODA_SERVED_MODEL_NAME"]
    # the variables it expands come before it
    names = [e["name"] for e in pagoda_container()["env"]]
    assert max(names.index(v) for v in values) < names.index("PAGODA_KV_EVENTS_CONFIG")


def test_pagoda_env_vars_are_serve_flags():
    from pagoda.client.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    known = {m for action in serve._actions for m in re.findall(r"\[env (PAGODA_\w+)\]", action.help or "")}
    unknown = sorted(n for n in pagoda_env() if n.startswith("PAGODA_") and n not in known)
    assert not unknown, f"not `pagoda serve` variables: {unknown}"
