"""--log-format json: every line drafter-serve writes is one JSON object with time, level, logger and message;
lines logged while a call is handled carry its namespace and request id."""
import json
import logging
import os
import signal
import subprocess
import sys
import time

import grpc
import torch

from drafter_client import DrafterClient, DrafterError, SequenceStep
from drafter_service.logs import JsonFormatter, request_context

NATIVE_NOISE = ("nanobind: ", " - leaked ", " - ... skipped", "See https://nanobind")


def test_json_formatter_carries_the_request_context():
    record = logging.LogRecord("drafter.x", logging.WARNING, __file__, 1, "step %d failed", (3,), None)
    token = request_context.set(("engine-0", 42))
    try:
        line = JsonFormatter().format(record)
    finally:
        request_context.reset(token)
    obj = json.loads(line)
    assert obj["level"] == "WARNING" and obj["logger"] == "drafter.x" and obj["message"] == "step 3 failed"
    assert obj["namespace"] == "engine-0" and obj["request_id"] == 42 and obj["time"].endswith("+00:00")
    record.namespace = "other"  # an explicit extra= wins
    assert json.loads(JsonFormatter().format(record))["namespace"] == "other"


async def test_drafter_serve_logs_json_lines(tiny_model, tmp_path):
    head, target = tiny_model
    sock = tmp_path / "d.sock"
    proc = subprocess.Popen([sys.executable, "-m", "drafter_service.cli", "--model", str(head), "--target-model",
                             str(target), "--listen", f"unix:{sock}", "--device", "cpu", "--kv-cache-tokens", "4096",
                             "--log-format", "json"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        async with DrafterClient(f"unix:{sock}", namespace="ns-json") as c:
            await c.wait_ready(60)
            r = await c.propose([SequenceStep("a", 0, [1, 2], torch.randn(2, 64), 3, 2)])
            assert r.sequences[0].ok
            try:  # a refused request is logged with its namespace and request id
                await c.propose([SequenceStep("a", 0, [1, 2], torch.randn(2, 65), 3, 2)])
            except DrafterError as e:
                assert e.code == grpc.StatusCode.INVALID_ARGUMENT
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    # Every line the drafter logs is JSON. What native libraries print by themselves is not ours: Triton's nanobind
    # bindings report "leaked" objects at interpreter exit (the lines start "nanobind:" / " - leaked" / "See ").
    ours = [line for line in out.splitlines() if line.strip() and not line.startswith(NATIVE_NOISE)]
    lines = [json.loads(line) for line in ours]
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    refused = [x for x in lines if x["message"].startswith("refused: INVALID_ARGUMENT")]
    assert refused and refused[0]["namespace"] == "ns-json" and refused[0]["request_id"] == 2, refused
    assert any(x["message"] == "serving" for x in lines)
