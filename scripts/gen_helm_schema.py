"""Write the `server` part of helm/drafter/values.schema.json from drafter-serve's own options.

    python scripts/gen_helm_schema.py           # rewrite values.schema.json's properties.server
    python scripts/gen_helm_schema.py --check   # exit 1 when the committed schema differs (tests do this too)

Each chart value under `server:` that becomes a drafter-serve flag is a row of OPTIONS below. For each row:

- the JSON type comes from the ServerConfig field the flag fills (drafter_service/config.py: int -> integer,
  float -> number, str -> string); null is always allowed (null = the flag is not passed);
- `server` holds the limits drafter-serve itself enforces (argparse choices and types in cli.py, ServerConfig's
  checks in config.py). They are not trusted: before writing, every one is tried against the real
  `drafter_service.cli.parse_args` (the value on the limit and the value just past it), and block_size's allowed
  values are found by trying every block size from 0 to 1024. A limit the server no longer has, or a new one it has,
  stops the script with a message naming the flag;
- `chart` holds the chart's own, stricter limits (the server would take the value, the chart does not), each with
  the reason in a comment.

Everything else in values.schema.json is written by hand; this script leaves it as it is.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "helm" / "drafter" / "values.schema.json"
sys.path.insert(0, str(REPO))


@dataclass
class Option:
    key: str  # server.<key> in values.yaml
    flag: str  # the drafter-serve flag the chart passes it as (templates/_helpers.tpl, drafter.args)
    server: dict = field(default_factory=dict)  # limits drafter-serve enforces (checked by check_limits)
    chart: dict = field(default_factory=dict)  # limits only the chart adds

    @property
    def config_field(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


BLOCK_SIZES = "probe"  # server["enum"] of --block-size: found by trying block sizes (probe_block_sizes)

OPTIONS = [
    # chart-only: the image has CUDA torch or CPU torch; "cuda:N" is pointless in a pod that sees its own GPUs
    Option("device", "--device", chart={"enum": ["cpu", "cuda"]}),
    Option("dtype", "--dtype", server={"enum": ["float32", "bfloat16", "float16"]}),
    # chart-only minimum: a KV pool of 0 tokens can hold no sequence
    Option("kvCacheTokens", "--kv-cache-tokens", chart={"minimum": 1}),
    Option("gpuMemoryFraction", "--gpu-memory-fraction", server={"exclusiveMinimum": 0, "maximum": 1}),
    Option("blockSize", "--block-size", server={"enum": BLOCK_SIZES}),
    # chart-only minimums: 0 would refuse every sequence, message or batch
    Option("maxModelLen", "--max-model-len", chart={"minimum": 1}),
    Option("maxDraftTokens", "--max-draft-tokens", server={"minimum": 1}),
    Option("maxBatchTokens", "--max-batch-tokens", chart={"minimum": 1}),
    Option("maxMessageBytes", "--max-message-bytes", chart={"minimum": 1}),
    Option("sequenceLeaseSeconds", "--sequence-lease-s", server={"minimum": 0}),
    Option("maxSequences", "--max-sequences", server={"minimum": 0}),
    Option("maxSequencesPerNamespace", "--max-sequences-per-namespace", server={"minimum": 0}),
    Option("namespacePoolShare", "--namespace-pool-share", server={"exclusiveMinimum": 0, "maximum": 1}),
    Option("mergeWindowMicroseconds", "--merge-window-us", server={"minimum": 0, "maximum": 10000}),
    # chart-only range: a TCP port (0 = metrics off, which the server takes too)
    Option("metricsPort", "--metrics-port", chart={"minimum": 0, "maximum": 65535}),
    # the server upper-cases the level, so the chart takes any case
    Option("logLevel", "--log-level", server={"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]}),
    Option("logFormat", "--log-format", server={"enum": ["text", "json"]}),
    # chart-only: an OTLP/gRPC URL
    Option("otelEndpoint", "--otel-endpoint", chart={"pattern": "^https?://[^\\s]+$"}),
    # chart-only: whole seconds (terminationGracePeriodSeconds is computed from it) and always passed
    Option("shutdownGraceSeconds", "--shutdown-grace-s", chart={"type": "integer", "minimum": 0, "nullable": False}),
]

# server.* keys that pass a flag with no value when true (store_true flags of drafter-serve)
SWITCHES = [Option("engineAppliesFc", "--engine-applies-fc")]

# server.* keys that are not one flag each: the TCP listener (--listen <bindAddress>:<port>) and extra flags
LISTEN_AND_EXTRA = {
    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
    "bindAddress": {"type": "string", "minLength": 1},
    "extraArgs": {"type": "array", "items": {"type": ["string", "number"]}},
}


# ---- trying values against drafter-serve ----

def accepts(flag: str, value) -> bool:
    """Whether drafter-serve's argument parsing (argparse, then ServerConfig's checks) takes `flag value`."""
    from drafter_service.cli import parse_args

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parse_args([flag, str(value)])
        except (SystemExit, ValueError):
            return False
    return True


def json_type(opt: Option) -> str:
    from drafter_service.config import ServerConfig

    hints = typing.get_type_hints(ServerConfig)
    if opt.config_field not in {f.name for f in fields(ServerConfig)}:
        raise SystemExit(f"{opt.flag}: ServerConfig has no field {opt.config_field!r}")
    t = hints[opt.config_field]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        (t,) = [a for a in typing.get_args(t) if a is not type(None)]
    return {int: "integer", float: "number", str: "string"}[t]


def probe_block_sizes(flag: str) -> list[int]:
    return [b for b in range(0, 1025) if accepts(flag, b)]


def check_limits(opt: Option, jtype: str) -> list[str]:
    """Each server limit of opt tried on drafter-serve: the value on the limit and just past it. Returns problems."""
    flag, lim = opt.flag, opt.server
    step = 1 if jtype == "integer" else 1e-6
    problems = []

    def expect(value, ok: bool, why: str):
        if accepts(flag, value) != ok:
            problems.append(f"{flag} {value}: drafter-serve {'refuses' if ok else 'takes'} it, but {why}")

    if "minimum" in lim:
        expect(lim["minimum"], True, f"the schema's minimum is {lim['minimum']}")
        expect(lim["minimum"] - step, False, f"the schema's minimum is {lim['minimum']}")
    if "exclusiveMinimum" in lim:
        expect(lim["exclusiveMinimum"], False, f"the schema's exclusiveMinimum is {lim['exclusiveMinimum']}")
        expect(lim["exclusiveMinimum"] + step, True, f"the schema's exclusiveMinimum is {lim['exclusiveMinimum']}")
    if "maximum" in lim:
        expect(lim["maximum"], True, f"the schema's maximum is {lim['maximum']}")
        expect(lim["maximum"] + step, False, f"the schema's maximum is {lim['maximum']}")
    if isinstance(lim.get("enum"), list):
        for v in lim["enum"]:
            expect(v, True, "the schema allows it")
        expect("no-such-choice", False, "the schema has a fixed list of choices")
    if jtype == "integer":
        expect("1.5", False, "the schema says integer")
    if not lim:  # no server limit claimed: the server must take any value of the type
        for v in ({"integer": [0, 10**9], "number": [0.0, 1e9], "string": ["anything"]}[jtype]):
            expect(v, True, "the schema claims no server limit")
    return problems


def case_insensitive_enum(words: list[str]) -> str:
    return "^(?i:" + "|".join(words) + ")$"


def option_schema(opt: Option) -> dict:
    jtype = json_type(opt)
    server = dict(opt.server)
    if server.get("enum") == BLOCK_SIZES:
        server["enum"] = probe_block_sizes(opt.flag)
        if not server["enum"]:
            raise SystemExit(f"{opt.flag}: drafter-serve takes no block size from 0 to 1024")
    problems = check_limits(Option(opt.key, opt.flag, server), jtype)
    if problems:
        raise SystemExit("values.schema.json would not match drafter-serve:\n  " + "\n  ".join(problems))
    chart = dict(opt.chart)
    nullable = chart.pop("nullable", True)
    jtype = chart.pop("type", jtype)
    s: dict = {"description": opt.flag, "type": [jtype, "null"] if nullable else jtype}
    limits = {**server, **chart}
    if opt.key == "logLevel":  # drafter-serve upper-cases it first (type=str.upper), so the chart takes any case
        if not all(accepts(opt.flag, w.lower()) for w in limits["enum"]):
            raise SystemExit(f"{opt.flag}: drafter-serve no longer takes lower-case levels")
        s["pattern"] = case_insensitive_enum(limits.pop("enum"))
    if "enum" in limits:
        s["enum"] = limits.pop("enum") + ([None] if nullable else [])
    s.update(limits)
    return s


def switch_schema(opt: Option) -> dict:
    """A boolean value that passes opt.flag alone when true; the flag must be a drafter-serve switch filling a bool
    ServerConfig field."""
    from drafter_service.cli import parse_args
    from drafter_service.config import ServerConfig

    if typing.get_type_hints(ServerConfig).get(opt.config_field) is not bool:
        raise SystemExit(f"{opt.flag}: ServerConfig has no bool field {opt.config_field!r}")
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            on = getattr(parse_args([opt.flag]), opt.config_field)
        except (SystemExit, ValueError):
            on = None
    if on is not True:
        raise SystemExit(f"{opt.flag}: drafter-serve no longer takes it as a switch")
    return {"description": opt.flag, "type": "boolean"}


def server_schema() -> dict:
    props = {"port": LISTEN_AND_EXTRA["port"], "bindAddress": LISTEN_AND_EXTRA["bindAddress"]}
    for opt in OPTIONS:
        props[opt.key] = option_schema(opt)
    for opt in SWITCHES:
        props[opt.key] = switch_schema(opt)
    props["extraArgs"] = LISTEN_AND_EXTRA["extraArgs"]
    return {
        "type": "object",
        "description": "drafter-serve flags; written by scripts/gen_helm_schema.py from drafter_service (do not edit)",
        "additionalProperties": False,
        "required": ["port", "bindAddress", "shutdownGraceSeconds"],
        "properties": props,
        "not": {
            "description": "kvCacheTokens and gpuMemoryFraction are mutually exclusive",
            "required": ["kvCacheTokens", "gpuMemoryFraction"],
            "properties": {"kvCacheTokens": {"type": "integer"}, "gpuMemoryFraction": {"type": "number"}},
        },
    }


def generated_text(committed_text: str) -> str:
    schema = json.loads(committed_text)
    schema["properties"]["server"] = server_schema()
    return json.dumps(schema, indent=2) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when values.schema.json differs")
    a = ap.parse_args()
    committed = SCHEMA.read_text()
    text = generated_text(committed)
    if a.check:
        if text != committed:
            print(f"{SCHEMA.relative_to(REPO)} is stale: run python scripts/gen_helm_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
