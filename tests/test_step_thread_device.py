"""The step thread makes the drafter's GPU its current device: the current CUDA device is per thread, a new thread's
is cuda:0, and Triton launches its kernels on the current device's stream (a drafter on cuda:1 failed every step
before). CPU test of the call; tests/test_cuda_fast_path.py runs a drafter on a second GPU where there is one."""
import asyncio
import types

import torch

from drafter_service.engine.scheduler import StepScheduler


def run_scheduler(proposer) -> None:
    async def run():
        sched = StepScheduler(proposer, max_batch_tokens=64, max_batch_seqs=8)
        sched.start()
        await sched.stop()
    asyncio.run(run())


def test_the_step_thread_sets_the_drafters_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    proposer = types.SimpleNamespace(device=torch.device("cuda", 1), expire_idle=lambda: 0,
                                     expiry_wait=lambda: None, predraft=types.SimpleNamespace(has_work=lambda: False))
    run_scheduler(proposer)
    assert calls == [torch.device("cuda", 1)]
    calls.clear()
    proposer.device = torch.device("cpu")
    run_scheduler(proposer)
    assert calls == []
