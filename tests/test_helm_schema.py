"""values.schema.json against drafter-serve's own option limits, so the two cannot drift.

The schema's `server` part is written by scripts/gen_helm_schema.py from drafter_service (ServerConfig's field
types; every limit tried on drafter_service.cli.parse_args). Here:

- the committed schema is exactly what the script writes now (stale = fail: run the script);
- every server limit the script claims holds on drafter-serve (the value on the limit is taken, the one past it
  refused), so a limit changed in config.py or cli.py fails here, naming the flag;
- every flag of the script's table is one the chart's templates pass (templates/_helpers.tpl, drafter.args), and
  (with helm) a value set for it arrives as that flag;
- sample bad values are refused by the schema (jsonschema) and, where the limit is the server's, by drafter-serve
  too; good ones pass both;
- with helm: `helm lint` and `helm template` refuse the bad values through the schema (blockSize: 12, ...).
"""
from __future__ import annotations

import importlib.util
import sys

import pytest

from test_helm_chart import (CHART, IMAGE, REPO, by_kind, deep_merge, flags, helm, helm_env, jsonschema,  # noqa: F401
                             needs_helm, render, schema, set_args, values)


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_helm_schema", REPO / "scripts" / "gen_helm_schema.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_helm_schema"] = module
    spec.loader.exec_module(module)
    return module


gen = load_generator()
OPTIONS = {o.key: o for o in gen.OPTIONS}


def test_committed_schema_is_the_generated_one():
    committed = gen.SCHEMA.read_text()
    try:
        generated = gen.generated_text(committed)
    except SystemExit as e:  # a server limit does not hold any more
        pytest.fail(str(e))
    assert generated == committed, "helm/drafter/values.schema.json is stale: run python scripts/gen_helm_schema.py"


@pytest.mark.parametrize("key", sorted(OPTIONS))
def test_server_limits_hold_on_drafter_serve(key):
    opt = OPTIONS[key]
    jtype = gen.json_type(opt)
    server = dict(opt.server)
    if server.get("enum") == gen.BLOCK_SIZES:
        server["enum"] = gen.probe_block_sizes(opt.flag)
        assert server["enum"] == [8, 16, 32, 64, 128]
    problems = gen.check_limits(gen.Option(opt.key, opt.flag, server), jtype)
    assert not problems, problems


def test_every_option_is_passed_by_the_templates(values):
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for opt in gen.OPTIONS:
        assert f'"flag" "{opt.flag}" "v" $s.{opt.key}' in helpers, f"_helpers.tpl does not pass server.{opt.key}"
        assert opt.key in values["server"], f"values.yaml has no server.{opt.key}"
    for opt in gen.SWITCHES:
        assert f"if $s.{opt.key} }}}}\n- {opt.flag}\n" in helpers, f"_helpers.tpl does not pass server.{opt.key}"
        assert values["server"][opt.key] is False, f"values.yaml: server.{opt.key} is not false by default"


# (server key, bad value, the server refuses it too)
BAD_SERVER_VALUES = [
    ("blockSize", 12, True),
    ("blockSize", 256, True),
    ("gpuMemoryFraction", 0, True),
    ("gpuMemoryFraction", 1.01, True),
    ("namespacePoolShare", 0, True),
    ("namespacePoolShare", 1.5, True),
    ("sequenceLeaseSeconds", -1, True),
    ("maxSequences", -1, True),
    ("maxSequencesPerNamespace", 2.5, True),
    ("maxDraftTokens", 0, True),
    ("logFormat", "xml", True),
    ("logLevel", "verbose", True),
    ("dtype", "fp8", True),
    ("kvCacheTokens", 0, False),  # chart-only: an empty pool
    ("otelEndpoint", "otel-collector:4317", False),  # chart-only: a URL
    ("device", "cuda:1", False),  # chart-only
]
GOOD_SERVER_VALUES = [
    ("blockSize", 64), ("gpuMemoryFraction", 1), ("namespacePoolShare", 0.25), ("namespacePoolShare", 1),
    ("sequenceLeaseSeconds", 0), ("sequenceLeaseSeconds", 12.5), ("maxSequences", 0), ("maxSequencesPerNamespace", 64),
    ("logFormat", "json"), ("logLevel", "debug"), ("logLevel", "WARNING"), ("otelEndpoint", "http://otel:4317"),
]


@pytest.mark.parametrize("key, value, server_refuses", BAD_SERVER_VALUES)
def test_schema_refuses_bad_server_values(values, schema, key, value, server_refuses):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(deep_merge(values, {"server": {key: value}}))
    assert gen.accepts(OPTIONS[key].flag, value) is not server_refuses


@pytest.mark.parametrize("key, value", GOOD_SERVER_VALUES)
def test_schema_takes_good_server_values(values, schema, key, value):
    jsonschema.Draft7Validator(schema).validate(deep_merge(values, {"server": {key: value}}))
    assert gen.accepts(OPTIONS[key].flag, value)


@pytest.mark.parametrize("override, what", [
    ({"server": {"engineAppliesFc": "yes"}}, "a switch is a boolean"),
    ({"resources": {"limits": {"memory": "16GB"}}}, "not a Kubernetes quantity"),
    ({"resources": {"requests": {"cpu": "two"}}}, "not a quantity"),
    ({"resources": {"limits": "lots"}}, "limits not a map"),
    ({"resources": {"limit": {"cpu": "1"}}}, "typo: limit"),
    ({"resources": {"claims": [{}]}}, "claim without name"),
    ({"sidecar": {"example": {"engine": {"resources": {"limits": {"nvidia.com/gpu": "one"}}}}}}, "engine quantity"),
    ({"model": {"copy": {"resources": {"requests": {"memory": "1 Gi"}}}}}, "copy quantity"),
    ({"networkPolicy": {"enabled": True, "grpcFrom": {"podSelector": {"matchLabel": {}}}}}, "selector typo"),
    ({"networkPolicy": {"ingress": []}}, "unknown networkPolicy key"),
    ({"metrics": {"podMonitor": {"matchLabels": {"app": 1}}}}, "label value not a string"),
    ({"metrics": {"podMonitor": {"interval": "30"}}}, "interval without unit"),
    ({"metrics": {"prometheusRule": {"acceptanceRateBelow": 2}}}, "ratio above 1"),
    ({"metrics": {"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}}}, "label value not a string"),
])
def test_schema_refuses_bad_values(values, schema, override, what):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(deep_merge(values, override))


@pytest.mark.parametrize("override", [
    {"resources": {"requests": {"cpu": "500m", "memory": "8Gi"}, "limits": {"cpu": 4, "nvidia.com/gpu": 1}}},
    {"resources": {"claims": [{"name": "gpu"}], "limits": {"memory": "1.5e9", "nvidia.com/gpu": None}}},
    {"resources": {}},
    {"networkPolicy": {"enabled": True, "grpcFrom": {"namespaceSelector": {}},
                       "metricsFrom": {"podSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}}}},
])
def test_schema_takes_good_values(values, schema, override):
    jsonschema.Draft7Validator(schema).validate(deep_merge(values, override))


@needs_helm
@pytest.mark.parametrize("sets, field", [
    ({"server.blockSize": 12}, "blockSize"),
    ({"server.namespacePoolShare": 0}, "namespacePoolShare"),
    ({"server.sequenceLeaseSeconds": -5}, "sequenceLeaseSeconds"),
    ({"server.logFormat": "xml"}, "logFormat"),
    ({"resources.limits.memory": "16GB"}, "memory"),
])
def test_helm_refuses_bad_values_through_the_schema(helm_env, sets, field):
    for command in (["lint", "--strict", str(CHART)], ["template", "d", str(CHART)]):
        proc = helm(helm_env, *command, *set_args({"image.repository": IMAGE, **sets}), check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"helm {command[0]} took {sets}"
        assert "schema" in out and field in out, out


@needs_helm
def test_new_server_values_become_flags(helm_env):
    docs = render(helm_env, {"server.sequenceLeaseSeconds": 90, "server.maxSequences": 512,
                             "server.maxSequencesPerNamespace": 128, "server.namespacePoolShare": 0.5,
                             "server.logFormat": "json", "server.otelEndpoint": "http://otel.obs:4317",
                             "server.gpuMemoryFraction": 0.9, "server.blockSize": 32,
                             "server.engineAppliesFc": True})
    (dep,) = by_kind(docs)["Deployment"]
    f = flags(dep["spec"]["template"]["spec"]["containers"][0])
    assert f["--sequence-lease-s"] == ["90"] and f["--max-sequences"] == ["512"]
    assert f["--max-sequences-per-namespace"] == ["128"] and f["--namespace-pool-share"] == ["0.5"]
    assert f["--log-format"] == ["json"] and f["--otel-endpoint"] == ["http://otel.obs:4317"]
    assert f["--gpu-memory-fraction"] == ["0.9"] and f["--block-size"] == ["32"]
    assert f["--engine-applies-fc"] == []  # (a switch: no value)
    # and drafter-serve takes exactly these arguments
    from drafter_service.cli import parse_args

    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    cfg = parse_args([a for a in args])
    assert (cfg.sequence_lease_s, cfg.max_sequences, cfg.max_sequences_per_namespace) == (90, 512, 128)
    assert (cfg.namespace_pool_share, cfg.log_format, cfg.otel_endpoint) == (0.5, "json", "http://otel.obs:4317")
    assert cfg.engine_applies_fc is True
    # unset, none of them is passed: the server's defaults apply
    (dep,) = by_kind(render(helm_env))["Deployment"]
    f = flags(dep["spec"]["template"]["spec"]["containers"][0])
    assert not {"--sequence-lease-s", "--max-sequences", "--max-sequences-per-namespace", "--namespace-pool-share",
                "--log-format", "--otel-endpoint", "--engine-applies-fc"} & set(f)
