"""An error the step worker cannot recover from turns health NOT_SERVING (the liveness probe's service "" and the
Drafter service), so that Kubernetes restarts the container; until then every step gets UNAVAILABLE, which the
client library turns into "no drafts". Faults are injected by replacing the proposer's _run."""
import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, SequenceStep
from drafter_service.engine.proposer import MAX_FAILED_BATCHES_IN_A_ROW, unrecoverable

H = 64


def health_of(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def step(sid: str) -> SequenceStep:
    return SequenceStep(sid, 0, [1, 2, 3], torch.randn(3, H), 4, 2)


def test_sticky_errors_are_told_apart():
    assert unrecoverable(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert unrecoverable(RuntimeError("CUDA error: device-side assert triggered"))
    assert not unrecoverable(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not unrecoverable(ValueError("shape mismatch"))


@pytest.mark.parametrize("fault", ["sticky", "repeated"])
async def test_a_broken_step_worker_turns_health_not_serving(tiny_model, tmp_path, fault):
    cfg = make_config(*tiny_model, tmp_path, metrics_port=0)
    with ServerThread(cfg) as s:
        proposer = s.server.runtime.proposer
        assert health_of(s.tcp, "") == health_pb2.HealthCheckResponse.SERVING
        error = (RuntimeError("CUDA error: an illegal memory access was encountered") if fault == "sticky" else
                 RuntimeError("something odd"))
        calls = []

        def broken(batch):
            calls.append(len(batch))
            raise error

        s.call(lambda: setattr(proposer, "_run", broken))
        async with DrafterClient(s.tcp, namespace="n", raise_on_error=True, step_timeout_s=10) as c:
            failures = 1 if fault == "sticky" else MAX_FAILED_BATCHES_IN_A_ROW
            for i in range(failures):
                assert health_of(s.tcp, "") == health_pb2.HealthCheckResponse.SERVING
                r = await c.propose([step(f"s{i}")])
                assert r.sequences[0].code == grpc.StatusCode.INTERNAL.value[0]
            # broken now: health NOT_SERVING for the liveness probe and for the service; steps do not run
            for _ in range(100):
                if health_of(s.tcp, "") == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await __import__("asyncio").sleep(0.02)
            assert health_of(s.tcp, "") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert health_of(s.tcp, "drafter.v1.Drafter") == health_pb2.HealthCheckResponse.NOT_SERVING
            r = await c.propose([step("after")])
            assert r.sequences[0].code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert "waits to be restarted" in r.sequences[0].message
            assert len(calls) == failures  # the broken worker was not run again
            assert s.call(lambda: len(proposer.table)) == 0  # no new sequence kept
            assert s.server.runtime.metrics.value("drafter_step_worker_broken") == 1
        # the default client: "no drafts", no exception
        async with DrafterClient(s.tcp, namespace="n") as c:
            r = await c.propose([step("x")])
            assert not r.sequences[0].ok and r.sequences[0].drafts.numel() == 0
