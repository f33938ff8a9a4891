"""Start-up, health, reflection, GetInfo, continuous batching, the sync client, and SIGTERM."""
import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from checkpoints import write_eagle1
from drafter_client import DrafterClient, DrafterError, SequenceStep, SyncDrafterClient

H = 64


async def test_health_reflection_and_info(server):
    async with grpc.aio.insecure_channel(server.uds) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "drafter.v1.Drafter"):
            r = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = refl.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await call.read()
        names = {s.name for s in resp.list_services_response.service}
        assert {"drafter.v1.Drafter", "grpc.health.v1.Health"} <= names
        await call.done_writing()
    async with DrafterClient(server.tcp) as c:
        info = await c.get_info()
    assert info.method == "eagle" and info.hidden_states_width == H and info.vocab_size == 512
    assert info.max_draft_tokens == 8 and info.max_model_len == 1024 and info.kv_block_size == 16
    assert info.kv_capacity_tokens == 16384 and info.device == "cpu" and info.model_dtype == "float32"
    assert info.shared_memory_supported and list(info.shared_memory_kinds) == [1]  # SYSTEM (no CUDA_IPC on CPU)


async def test_concurrent_requests_are_merged_into_batches(server):
    """Many clients at once: the worker merges queued requests (continuous batching) and answers each right."""
    sched = server.server.scheduler
    merged_before = sched.requests_merged

    async def one(i):
        async with DrafterClient(server.tcp, namespace=f"merge{i}") as c:
            for step in range(5):
                r = await c.propose([SequenceStep("s", 0, list(range(1, 65)), torch.randn(64, H), 3, 4)])
                assert r.sequences[0].ok and r.sequences[0].drafts.numel() == 4
            await c.release(["s"])

    await asyncio.gather(*(one(i) for i in range(16)))
    assert sched.requests_merged > merged_before


def test_sync_client(server):
    with SyncDrafterClient(server.uds, namespace="sync") as c:
        c.wait_ready(10)
        assert c.get_info().method == "eagle"
        r = c.propose([SequenceStep("a", 0, [1, 2, 3], torch.randn(3, H), 4, 2)])
        assert r.sequences[0].ok and r.padded().shape == (1, 2)
        assert c.release(["a"]).released == 1


async def test_stop_flips_health_before_closing(tiny_model, tmp_path):
    from conftest import ServerThread, make_config

    with ServerThread(make_config(*tiny_model, tmp_path)) as s:
        async with grpc.aio.insecure_channel(s.tcp) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            stopper = asyncio.get_running_loop().run_in_executor(None, s.stop, 2.0)
            seen = await asyncio.wait_for(watch.read(), 10)
            assert seen.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await stopper


async def test_sigterm_finishes_in_flight_steps_then_exits_0(tmp_path):
    # A head big enough that a step takes a noticeable time on CPU.
    head, target = write_eagle1(tmp_path, hidden_size=256, intermediate_size=1024, vocab_size=32000,
                                num_attention_heads=4, num_key_value_heads=2)
    sock = tmp_path / "d.sock"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "drafter_service.cli", "--model", str(head), "--target-model",
                             str(target), "--listen", f"unix:{sock}", "--device", "cpu", "--kv-cache-tokens", "65536",
                             "--max-batch-tokens", "1024"],  # one request per batch: the others wait in line
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        # (no step deadline: the steps queue behind one another for seconds on purpose)
        async with DrafterClient(f"unix:{sock}", step_timeout_s=None, raise_on_error=True) as c:
            deadline = time.monotonic() + 60
            while not sock.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await c.wait_ready(60)

            async def step(i):
                return await c.propose([SequenceStep(f"s{i}", 0, [i % 31000 + j for j in range(700)],
                                                     torch.randn(700, 256), 5, 8)])

            tasks = [asyncio.ensure_future(step(i)) for i in range(6)]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            proc.send_signal(signal.SIGTERM)
            assert sum(not t.done() for t in tasks) >= 3, "the test needs steps still pending at SIGTERM"
            results = await asyncio.gather(*tasks)
            assert all(r.sequences[0].ok and r.sequences[0].drafts.numel() == 8 for r in results)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "shutting down" in out and "stopped" in out
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_drain_refuses_new_sequences_lets_live_ones_finish_then_exits_0(tiny_model, tmp_path):
    """Drain: health NOT_SERVING at once, a new sequence gets UNAVAILABLE, a live one keeps drafting; once it is
    released the process stops by itself with exit code 0."""
    head, target = tiny_model
    sock = tmp_path / "d.sock"
    proc = subprocess.Popen([sys.executable, "-m", "drafter_service.cli", "--model", str(head), "--target-model",
                             str(target), "--listen", f"unix:{sock}", "--device", "cpu", "--kv-cache-tokens", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), text=True)
    try:
        async with DrafterClient(f"unix:{sock}", namespace="e") as c:
            deadline = time.monotonic() + 60
            while not sock.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await c.wait_ready(60)
            r = await c.propose([SequenceStep("live", 0, [1, 2, 3], torch.randn(3, H), 4, 2)])
            assert r.sequences[0].ok
            d = await c.drain(grace_seconds=30)
            assert d.live_sequences == 1 and d.grace_seconds == 30
            health = health_pb2_grpc.HealthStub(c._channel)
            r = await health.Check(health_pb2.HealthCheckRequest(service="drafter.v1.Drafter"))
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            r = await c.propose([SequenceStep("new", 0, [1, 2, 3], torch.randn(3, H), 4, 2),
                                 SequenceStep("live", 3, [4], torch.randn(1, H), 5, 2)])
            assert r.sequences[0].code == grpc.StatusCode.UNAVAILABLE.value[0] and "draining" in r.sequences[0].message
            assert r.sequences[1].ok and r.sequences[1].drafts.numel() == 2
            with pytest.raises(DrafterError) as e:
                await c.drain(grace_seconds=float("nan"))
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert (await c.release(["live"])).released == 1
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "drain over" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
