"""deploy/k8s offline: every rendered manifest validates against the Kubernetes schemas of a
pinned version (kubernetes-validate bundles them; the network is cut while it runs), and the
manifests agree with the code they deploy: ports and flags with `paradraft serve`'s parser, the
readiness path with the server module, the autoscaler's metric with the gauge the Triton model
exports, the drain with the grace period.

Rendering: the overlays use only `resources` and strategic-merge `patches`, which `render`
below applies itself (so CI needs no kustomize binary); where `kubectl kustomize` or
`kustomize` is on PATH, its output must equal ours."""

from __future__ import annotations

import argparse
import copy
import inspect
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/gpu"]
# The Kubernetes version whose schemas the manifests must satisfy (strict: unknown fields fail)
K8S_VERSION = "1.32.0"


# -- a kustomize subset: resources + strategic-merge patches ------------------------------------

# The list fields Kubernetes merges by a key in a strategic-merge patch (patchMergeKey of the
# API types); every other list is replaced, as kustomize does
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "imagePullSecrets": "name"}


def merge_key(field: str, items: list) -> str | None:
    if field == "ports":  # container ports merge on containerPort, Service ports on port
        return "containerPort" if all("containerPort" in i for i in items) else "port"
    return MERGE_KEYS.get(field)


def merge(base: dict, patch: dict) -> dict:
    """Strategic merge of ``patch`` into ``base`` (no $patch directives, no deletions)."""
    out = copy.deepcopy(base)
    for field, value in patch.items():
        assert not field.startswith("$"), f"directive {field} not supported here"
        old = out.get(field)
        if isinstance(value, dict) and isinstance(old, dict):
            out[field] = merge(old, value)
        elif isinstance(value, list) and isinstance(old, list) and merge_key(field, old + value):
            key = merge_key(field, old + value)
            merged = {item[key]: item for item in old}
            for item in value:
                merged[item[key]] = merge(merged[item[key]], item) if item[key] in merged else item
            out[field] = list(merged.values())
        else:
            out[field] = copy.deepcopy(value)
    return out


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(directory: Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "patches"}
    assert not unknown, f"{directory}: render() does not implement {unknown}"
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else load_docs(path)
    for entry in k.get("patches", []):
        assert set(entry) == {"path"}, f"{directory}: only file patches here, got {entry}"
        for patch in load_docs(directory / entry["path"]):
            hits = [i for i, o in enumerate(objects) if ident(o) == ident(patch)]
            assert len(hits) == 1, f"patch {entry['path']} matches {len(hits)} objects"
            objects[hits[0]] = merge(objects[hits[0]], patch)
    return objects


def ident(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def by_kind(objects: list[dict]) -> dict[str, dict]:
    kinds = {o["kind"]: o for o in objects}
    assert len(kinds) == len(objects), "one object per kind expected"
    return kinds


RENDERED = {name: render(K8S / name) for name in KUSTOMIZATIONS}


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_render_equals_kustomize(name):
    cmd = kustomize_command()
    if cmd is None:
        pytest.skip("no kustomize or kubectl on PATH; the other tests use render() alone")
    out = subprocess.run([*cmd, str(K8S / name)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = {ident(o): o for o in yaml.safe_load_all(out.stdout) if o}
    ours = {ident(o): o for o in RENDERED[name]}
    assert theirs == ours


# -- schemas -------------------------------------------------------------------------------------

# ServiceMonitor is a CRD (monitoring.coreos.com/v1): kubernetes-validate has no schema for it
# (it raises SchemaNotFoundError). It is checked against this structural schema of the fields we
# use, written from the prometheus-operator CRD (Endpoint.interval is its Duration pattern);
# additionalProperties false catches a misspelt field, a field we add must be added here.
DURATION = (r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
            r"(([0-9]+)ms)?)$")
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}, "labels": LABELS}},
        "spec": {
            "type": "object", "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"],
                             "additionalProperties": False,
                             "properties": {"matchLabels": LABELS}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                   "interval": {"type": "string", "pattern": DURATION}}}},
            },
        },
    },
}


@pytest.fixture
def offline(monkeypatch):
    """No sockets: the validation below must work from the bundled schemas alone."""
    def refuse(*args, **kwargs):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def validate(obj: dict) -> None:
    kv.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_manifests_validate_offline_against_pinned_schemas(name, offline):
    kinds = set()
    for obj in RENDERED[name]:
        kinds.add(obj["kind"])
        if obj["kind"] == "ServiceMonitor":
            with pytest.raises(kv.utils.SchemaNotFoundError):
                validate(obj)
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
        else:
            validate(obj)
    assert kinds == {"PersistentVolumeClaim", "Deployment", "Service", "ServiceMonitor",
                     "PodDisruptionBudget", "HorizontalPodAutoscaler"}


def test_validation_catches_mistakes(offline):
    deployment = by_kind(RENDERED["base"])["Deployment"]
    bad = copy.deepcopy(deployment)
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")  # misspelt: strict refuses it
    with pytest.raises(kv.utils.ValidationError):
        validate(bad)
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    with pytest.raises(kv.utils.ValidationError):
        validate(bad)
    monitor = copy.deepcopy(by_kind(RENDERED["base"])["ServiceMonitor"])
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


# -- agreement with the code ------------------------------------------------------------------


def serve_parser() -> argparse.ArgumentParser:
    from paradraft.cli import serve

    parser = argparse.ArgumentParser(prog="paradraft")
    serve.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def container(objects: list[dict]) -> dict:
    (c,) = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def value_after(args: list[str], flag: str) -> str:
    assert flag in args, f"container args lack {flag}"
    return args[args.index(flag) + 1]


def parsed_args(c: dict) -> tuple[argparse.Namespace, list[str]]:
    """The container's `paradraft serve` args through the real parser; (values, unknown)."""
    args = c["args"]
    assert args[:2] == ["paradraft", "serve"]
    return serve_parser().parse_known_args([a.replace("$(POD_IP)", "10.0.0.7")
                                            for a in args[1:]])


def serve_ports(c: dict) -> dict[str, int]:
    """{port name: number} as the container's serve command opens them."""
    ns, _ = parsed_args(c)
    ports = {"http": ns.http_port, "grpc": ns.grpc_port, "metrics": ns.metrics_port}
    ports["openai"] = int(getattr(ns, "openai_port", None)
                          or value_after(c["args"], "--openai-port"))
    return ports


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_ports_and_flags_are_what_serve_opens(name):
    c = container(RENDERED[name])
    ns, unknown = parsed_args(c)
    unknown_flags = {a for a in unknown if a.startswith("--")}
    assert not unknown_flags, f"not `paradraft serve` flags: {unknown_flags}"
    assert ns.engines == "/engines"
    defaults = serve_parser().parse_args(["serve"])
    ports = serve_ports(c)
    # the manifests pass serve's own default ports: docs and clients can rely on them
    assert (ports["http"], ports["grpc"], ports["metrics"]) == (
        defaults.http_port, defaults.grpc_port, defaults.metrics_port)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports
    service = by_kind(RENDERED[name])["Service"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    assert all(p["targetPort"] == p["name"] for p in service["spec"]["ports"])
    # the image's EXPOSE lists the same ports
    expose = re.search(r"^EXPOSE\s+(.+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    assert {int(p) for p in expose.split()} == set(ports.values())


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_probes_use_the_http_port_and_triton_health_paths(name):
    from paradraft.runtime.serving import server

    c = container(RENDERED[name])
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert named[c["readinessProbe"]["httpGet"]["port"]] == serve_ports(c)["http"]
    ready = c["readinessProbe"]["httpGet"]["path"]
    # the path start_server itself waits on before it calls the server ready
    assert f"{{http_port}}{ready}" in inspect.getsource(server.start_server)
    for probe in ("livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert named[get["port"]] == serve_ports(c)["http"]
        # the KServe v2 liveness sibling of the readiness path (Triton: live once it runs)
        assert get["path"] == ready.replace("/ready", "/live")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_binds_the_pod_ip_from_the_downward_api(name):
    c = container(RENDERED[name])
    assert value_after(c["args"], "--host") == "$(POD_IP)"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_grace_period_covers_prestop_and_drain(name):
    c = container(RENDERED[name])
    pod = by_kind(RENDERED[name])["Deployment"]["spec"]["template"]["spec"]
    drain = int(value_after(c["args"], "--drain-seconds"))
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = int(command[1])
    margin = 10  # tritonserver's own shutdown after the drain
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + margin
    assert drain > 0 and pre_stop > 0


def test_pending_serve_flags_have_landed():
    """--openai-port and --drain-seconds (issue 26) are `paradraft serve` flags: the parser
    reads the manifest's values as given. The API is off unless asked for (no default port),
    so the manifest names its port; the drain it asks for is serve's own default."""
    c = container(RENDERED["base"])
    ns, unknown = parsed_args(c)
    assert not [a for a in unknown if a.startswith("--")]
    defaults = serve_parser().parse_args(["serve"])
    assert defaults.openai_port is None
    assert ns.openai_port == int(value_after(c["args"], "--openai-port"))
    assert ns.drain_seconds == float(value_after(c["args"], "--drain-seconds"))
    assert ns.drain_seconds == defaults.drain_seconds


def exported_gauges() -> set[str]:
    """Gauge families the Triton model creates: family("name", gauge, ...) in its source."""
    source = (ROOT / "triton_repo" / "ensemble" / "1" / "model.py").read_text()
    return set(re.findall(r'family\(\s*"(\w+)",\s*gauge\b', source))


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_autoscaler_metric_is_the_exported_queue_gauge(name):
    objects = by_kind(RENDERED[name])
    hpa = objects["HorizontalPodAutoscaler"]["spec"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    metric_name = metric["pods"]["metric"]["name"]
    assert metric_name == "paradraft_queue_depth" and metric_name in exported_gauges()
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["name"]["as"] == metric_name
    assert re.match(rule["name"]["matches"], metric_name)
    assert rule["seriesQuery"].startswith(metric_name + "{")
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", objects["Deployment"]["metadata"]
                                                ["name"])
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]


def test_gpu_only_in_the_gpu_overlay():
    def gpus(name):
        return container(RENDERED[name])["resources"].get("limits", {}).get("nvidia.com/gpu")

    assert gpus("overlays/gpu") == 1
    assert gpus("base") is None and gpus("overlays/cpu") is None
    tolerations = by_kind(RENDERED["overlays/gpu"])["Deployment"]["spec"]["template"]["spec"][
        "tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_selectors_volumes_and_monitor_line_up(name):
    objects = by_kind(RENDERED[name])
    pod = objects["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]

    def selects(selector: dict, target: dict) -> bool:
        return selector.items() <= target.items()

    assert selects(objects["Deployment"]["spec"]["selector"]["matchLabels"], labels)
    assert selects(objects["Service"]["spec"]["selector"], labels)
    assert selects(objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], labels)
    monitor = objects["ServiceMonitor"]["spec"]
    assert selects(monitor["selector"]["matchLabels"], objects["Service"]["metadata"]["labels"])
    service_ports = {p["name"] for p in objects["Service"]["spec"]["ports"]}
    assert {e["port"] for e in monitor["endpoints"]} == {"metrics"} <= service_ports
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    claim = volumes["engines"]["persistentVolumeClaim"]["claimName"]
    assert claim == objects["PersistentVolumeClaim"]["metadata"]["name"]
    mounts = {m["name"]: m for m in container(RENDERED[name])["volumeMounts"]}
    assert mounts["engines"]["mountPath"] == "/engines" and mounts["engines"]["readOnly"]
    assert "replicas" not in objects["Deployment"]["spec"]  # the HPA owns the count
