"""The chart's monitoring: metric names, the Grafana dashboard, the alert rules, the PodMonitor and the NetworkPolicy.

- Every `drafter_*` name anywhere under helm/ (templates, values, the dashboard, the examples) is a series that
  drafter_service/metrics.py exports (names taken from a Metrics() registry: sample names, with their _total /
  _bucket / _sum / _count suffixes).
- helm/drafter/dashboards/drafter.json loads, has the panels it promises, every PromQL expression in it names only
  exported series, and (with promtool) every expression parses.
- With helm: the dashboard ConfigMap (label grafana_dashboard: "1", configurable), the PrometheusRule (`promtool check
  rules` on the rendered rules, and `promtool test rules`: each alert fires on series that should fire it and stays
  quiet on healthy ones), the PodMonitor (sidecar mode: selects the engine pods and their drafter-metrics port) and
  the NetworkPolicy (pool mode: gRPC from the configured pods, metrics from the monitoring namespaces).

promtool comes from Debian's `prometheus` package (.ci/run installs it); without it those tests skip and say so.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from test_helm_chart import (CHART, ENGINE, HELM, REPO, by_kind, drafter_of, helm_env, needs_helm,  # noqa: F401
                             render, render_fails, yaml)

DASHBOARD = CHART / "dashboards" / "drafter.json"
NAME = re.compile(r"\bdrafter_[a-z0-9_]+")
NOT_SERIES = ("drafter_service", "drafter_client", "drafter_kernels")  # Python packages, should a file name them
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install "
                                                              "prometheus; .ci/run does): PromQL not checked")


def exported_series() -> set[str]:
    """Every series name a drafter's /metrics can carry, from the metrics module itself."""
    from drafter_service.metrics import Metrics

    from drafter_service.engine.merge_window import MergeWindowCounters
    from drafter_service.engine.predraft import PredraftCounters

    m = Metrics(kv_blocks_free=1, kv_blocks_total=2)
    m.queue_depth = lambda: 0
    m.predraft_counters = PredraftCounters()  # (set by every proposer: the pre-drafting series are always there)
    m.merge_window_counters = MergeWindowCounters()  # (set by every server's scheduler)
    # the series that appear only with step channels / shared memory on
    m.channels = SimpleNamespace(open_count=lambda: 0)
    m.shm = SimpleNamespace(reads_total=0, read_bytes_total=0, read_seconds_total=0, expired_total=0, regions={})
    names = set()
    for family in m.registry.collect():
        names |= {s.name for s in family.samples}
        # labelled series without a child yet (errors by code) have no samples: name them by their type
        names |= {"counter": {family.name + "_total"}, "gauge": {family.name},
                  "histogram": {family.name + s for s in ("_bucket", "_sum", "_count")}}.get(family.type, set())
    return names


EXPORTED = exported_series()


def names_in(text: str) -> set[str]:
    return {n for n in NAME.findall(text) if not n.startswith(NOT_SERIES)}


def test_exported_series_sanity():
    assert {"drafter_kv_used_ratio", "drafter_rpc_errors_total", "drafter_step_seconds_bucket",
            "drafter_queue_depth", "drafter_drafts_accepted_by_position_total"} <= EXPORTED
    assert "drafter_step_seconds" not in EXPORTED  # a histogram's base name is no series


def test_every_metric_named_under_helm_exists():
    used: dict[str, set[str]] = {}
    for path in sorted((REPO / "helm").rglob("*")):
        if path.is_file() and path.suffix in {".yaml", ".yml", ".tpl", ".json", ".txt", ".md"}:
            for name in names_in(path.read_text()):
                used.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert "drafter_kv_used_ratio" in used  # the HPA example in values.yaml
    missing = {n: sorted(files) for n, files in used.items() if n not in EXPORTED}
    assert not missing, f"named under helm/ but not exported by drafter_service/metrics.py: {missing}"


# ---------------------------------------------------------------------------------------------------------------
# The dashboard


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])  # (collapsed rows hold theirs)
    return out


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def test_dashboard_loads_and_covers_the_drafter(dashboard):
    ps = panels(dashboard)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    exprs = expressions(dashboard)
    assert all(e.strip() for e in exprs)
    text = "\n".join(exprs)
    for series in ("drafter_propose_seconds_bucket", "drafter_step_seconds_bucket", "drafter_queue_wait_seconds_bucket",
                   "drafter_drafts_accepted_by_position_total", "drafter_drafts_evaluated_by_position_total",
                   "drafter_drafts_accepted_total", "drafter_draft_proposals_evaluated_total",
                   "drafter_batch_sequences_bucket", "drafter_kv_used_ratio", "drafter_rpc_errors_total",
                   "drafter_sequence_errors_total", "drafter_predraft_hits_total",
                   "drafter_predraft_refused_by_odds_total", "drafter_merge_window_waits_total"):
        assert series in text, f"no panel on {series}"
    assert "histogram_quantile(0.99" in text and "histogram_quantile(0.5" in text
    assert "by (code)" in text and "by (position)" in text
    # every query uses the dashboard's data source variable and its namespace / pod filters
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "pod"} <= variables
    for p in ps:
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
            assert 'namespace="$namespace"' in t["expr"] and 'pod=~"$pod"' in t["expr"], t["expr"]


def test_dashboard_names_only_exported_series(dashboard):
    queries = expressions(dashboard) + [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = set().union(*(names_in(q) for q in queries))
    assert used
    assert not used - EXPORTED, f"the dashboard queries series nobody exports: {sorted(used - EXPORTED)}"


def grafana_to_promql(expr: str) -> str:
    return (expr.replace("$__rate_interval", "5m").replace("$namespace", "ml").replace("$pod", ".*"))


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@needs_promtool
def test_dashboard_promql_parses(dashboard, tmp_path):
    """Each panel query (Grafana variables filled in) as a recording rule: promtool parses every expression."""
    rules = [{"record": f"dashboard_query_{i}", "expr": grafana_to_promql(e)}
             for i, e in enumerate(expressions(dashboard))]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = promtool("check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


@needs_helm
def test_dashboard_configmap(helm_env, dashboard):
    for mode_sets in ({}, {"mode": "sidecar", **ENGINE}):
        assert "ConfigMap" not in by_kind(render(helm_env, mode_sets)), "off by default"
        (cm,) = by_kind(render(helm_env, {**mode_sets, "metrics.grafanaDashboard.enabled": True}))["ConfigMap"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "ml"
        assert json.loads(cm["data"]["drafter.json"]) == dashboard
    (cm,) = by_kind(render(helm_env, {
        "metrics.grafanaDashboard.enabled": True, "metrics.grafanaDashboard.labels": {"dashboards": "inference"},
        "metrics.grafanaDashboard.annotations": {"grafana_folder": "Inference"},
        "metrics.grafanaDashboard.namespace": "monitoring"}))["ConfigMap"]
    assert cm["metadata"]["labels"]["dashboards"] == "inference"
    assert "grafana_dashboard" in cm["metadata"]["labels"]  # (Helm merges maps; null it to drop the default)
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Inference"}
    assert cm["metadata"]["namespace"] == "monitoring"


# ---------------------------------------------------------------------------------------------------------------
# Alert rules


ALERTS = {"DrafterAcceptanceCollapse", "DrafterStepLatencyHigh", "DrafterKVPoolNearFull", "DrafterRequestErrors",
          "DrafterSequenceErrors", "DrafterStepWorkerBroken"}


@pytest.fixture(scope="module")
def rule_groups(helm_env) -> list[dict]:
    if HELM is None:
        pytest.skip(needs_helm.kwargs["reason"])
    assert "PrometheusRule" not in by_kind(render(helm_env)), "off by default"
    (rule,) = by_kind(render(helm_env, {"metrics.prometheusRule.enabled": True,
                                        "metrics.prometheusRule.labels": {"release": "prom"}}))["PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prom" and rule["metadata"]["namespace"] == "ml"
    return rule["spec"]["groups"]


def test_rules_name_only_exported_series(rule_groups):
    rules = [r for g in rule_groups for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    for r in rules:
        used = names_in(r["expr"])
        assert used and not used - EXPORTED, (r["alert"], sorted(used - EXPORTED))
        assert 'namespace="ml"' in r["expr"]  # scoped to the release namespace
        assert r["labels"]["severity"] == "warning" and r["annotations"]["summary"] and r["annotations"]["description"]


@needs_promtool
def test_rules_pass_promtool_check(rule_groups, tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups}))
    proc = promtool("check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def expected_alert(rules: dict, alert: str, pod: str) -> dict:
    annotations = {k: v.replace("{{ $labels.namespace }}", "ml").replace("{{ $labels.pod }}", pod)
                   for k, v in rules[alert]["annotations"].items()}
    return {"exp_labels": {"severity": "warning", "namespace": "ml", "pod": pod}, "exp_annotations": annotations}


def counter(name: str, pod: str, per_minute: float, labels: str = "") -> dict:
    return {"series": f'{name}{{namespace="ml",pod="{pod}",job="drafter"{labels}}}', "values": f"0+{per_minute}x60"}


@needs_promtool
def test_rules_fire_when_they_should(rule_groups, tmp_path):
    """promtool test rules: per alert, a pod whose series should fire it and a healthy one that should not."""
    rules = {r["alert"]: r for g in rule_groups for r in g["rules"]}
    series = [
        # acceptance: 10% of the evaluated drafts accepted on p-bad, 60% on p-ok
        counter("drafter_drafts_accepted_total", "p-bad", 6), counter("drafter_drafts_evaluated_total", "p-bad", 60),
        counter("drafter_drafts_accepted_total", "p-ok", 36), counter("drafter_drafts_evaluated_total", "p-ok", 60),
        # step time: every step of p-bad between 50 and 100 ms, of p-ok under 10 ms
        counter("drafter_step_seconds_bucket", "p-bad", 0, ',le="0.01"'),
        counter("drafter_step_seconds_bucket", "p-bad", 600, ',le="0.1"'),
        counter("drafter_step_seconds_bucket", "p-bad", 600, ',le="+Inf"'),
        counter("drafter_step_seconds_bucket", "p-ok", 600, ',le="0.01"'),
        counter("drafter_step_seconds_bucket", "p-ok", 600, ',le="0.1"'),
        counter("drafter_step_seconds_bucket", "p-ok", 600, ',le="+Inf"'),
        # KV pool
        {"series": 'drafter_kv_used_ratio{namespace="ml",pod="p-bad",job="drafter"}', "values": "0.97x60"},
        {"series": 'drafter_kv_used_ratio{namespace="ml",pod="p-ok",job="drafter"}', "values": "0.6x60"},
        # requests refused: 1 in 6 on p-bad, 1 in 100 on p-ok
        counter("drafter_rpc_propose_total", "p-bad", 50),
        counter("drafter_rpc_errors_total", "p-bad", 10, ',code="INVALID_ARGUMENT"'),
        counter("drafter_rpc_propose_total", "p-ok", 99),
        counter("drafter_rpc_errors_total", "p-ok", 1, ',code="INTERNAL"'),
        # sequence steps: p-bad 10% RESOURCE_EXHAUSTED; p-ok 50% NOT_FOUND and UNAVAILABLE (not counted) + 1% INTERNAL
        counter("drafter_sequence_steps_total", "p-bad", 100),
        counter("drafter_sequence_errors_total", "p-bad", 10, ',code="RESOURCE_EXHAUSTED"'),
        counter("drafter_sequence_steps_total", "p-ok", 100),
        counter("drafter_sequence_errors_total", "p-ok", 30, ',code="NOT_FOUND"'),
        counter("drafter_sequence_errors_total", "p-ok", 20, ',code="UNAVAILABLE"'),
        counter("drafter_sequence_errors_total", "p-ok", 1, ',code="INTERNAL"'),
        # the step worker: broken on p-bad
        {"series": 'drafter_step_worker_broken{namespace="ml",pod="p-bad",job="drafter"}', "values": "1x60"},
        {"series": 'drafter_step_worker_broken{namespace="ml",pod="p-ok",job="drafter"}', "values": "0x60"},
        # another namespace, as bad as can be: not this release's
        {"series": 'drafter_kv_used_ratio{namespace="other",pod="p-x",job="drafter"}', "values": "1x60"},
    ]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}))
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                # too early: every alert waits for its `for`
                *({"eval_time": "5m", "alertname": a, "exp_alerts": []} for a in sorted(ALERTS)),
                *({"eval_time": "40m", "alertname": a, "exp_alerts": [expected_alert(rules, a, "p-bad")]}
                  for a in sorted(ALERTS)),
            ],
        }],
    }
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    proc = promtool("test", "rules", "rules_test.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# PodMonitor (sidecar) and NetworkPolicy (pool)


@needs_helm
def test_pod_monitor_scrapes_the_engine_pods(helm_env):
    assert "PodMonitor" not in by_kind(render(helm_env, {"mode": "sidecar", **ENGINE})), "off by default"
    assert "PodMonitor" not in by_kind(render(helm_env, {"metrics.podMonitor.enabled": True})), "pool: ServiceMonitor"
    kinds = by_kind(render(helm_env, {"mode": "sidecar", **ENGINE, "metrics.podMonitor.enabled": True,
                                      "metrics.podMonitor.labels": {"release": "prom"}}))
    (pm,), (dep,) = kinds["PodMonitor"], kinds["Deployment"]
    pod = dep["spec"]["template"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in drafter_of(pod["spec"])["ports"]}
    assert endpoint["port"] in ports and ports[endpoint["port"]] == 9400 and endpoint["path"] == "/metrics"
    # a parent chart names its own engine pods
    (pm,) = by_kind(render(helm_env, {"mode": "sidecar", **ENGINE, "metrics.podMonitor.enabled": True,
                                      "metrics.podMonitor.matchLabels": {"app": "my-engine"}}))["PodMonitor"]
    assert pm["spec"]["selector"] == {"matchLabels": {"app": "my-engine"}}
    assert "needs server.metricsPort > 0" in render_fails(helm_env, {
        "image.repository": "r/d", "mode": "sidecar", **ENGINE, "metrics.podMonitor.enabled": True,
        "server.metricsPort": 0})


@needs_helm
def test_network_policy(helm_env):
    assert "NetworkPolicy" not in by_kind(render(helm_env)), "off by default"
    sidecar = {"mode": "sidecar", **ENGINE, "networkPolicy.enabled": True}
    assert "NetworkPolicy" not in by_kind(render(helm_env, sidecar)), "pool mode only"
    kinds = by_kind(render(helm_env, {"networkPolicy.enabled": True}))
    (np,), (dep,) = kinds["NetworkPolicy"], kinds["Deployment"]
    pod = dep["spec"]["template"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert np["spec"]["policyTypes"] == ["Ingress"]
    named = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    grpc, metrics = np["spec"]["ingress"]
    assert grpc["ports"] == [{"port": "grpc", "protocol": "TCP"}] and "grpc" in named
    assert grpc["from"] == [{"podSelector": {}}]  # every pod of the release namespace
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}] and "metrics" in named
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    # no "skip CKV2_K8S_6" annotation once the pool has its policy
    assert not any("CKV2_K8S_6" in v for v in dep["metadata"].get("annotations", {}).values())

    (np,) = by_kind(render(helm_env, {
        "networkPolicy.enabled": True, "server.metricsPort": 0,
        "networkPolicy.grpcFrom.podSelector": {"matchLabels": {"role": "engine"}},
        "networkPolicy.grpcFrom.namespaceSelector": {}}))["NetworkPolicy"]
    (grpc,) = np["spec"]["ingress"]  # metrics off: no metrics rule
    assert grpc["from"] == [{"podSelector": {"matchLabels": {"role": "engine"}}, "namespaceSelector": {}}]
