"""Continuous batching: steps that arrive while the device is busy are merged into the next batch.

Every RPC handler submits its request's steps and awaits a future. One worker task takes *everything* queued the
moment the previous batch finishes (no timer: at low load a lone request runs at once), up to the token and
sequence budgets, and runs it on a single worker thread so the event loop keeps serving the network.
Requests are taken in arrival order; a request touching a sequence already in the forming batch waits for the
next batch, so two steps of one sequence never run out of order. Release goes through the same thread, so it
never races a step.
"""
import asyncio
import concurrent.futures
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from .proposer import Proposer
from .step_io import StepInput, StepOutput

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    steps: list[StepInput]
    future: asyncio.Future
    trace: dict | None = None  # when given: the batch's worker_start / worker_end (time.perf_counter) go here

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps)


class StepScheduler:
    def __init__(self, proposer: Proposer, max_batch_tokens: int, max_batch_seqs: int):
        self.proposer = proposer
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter-step")
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.inline = os.environ.get("DRAFTER_STEP_INLINE") == "1"
        self.batches_run = 0
        self.requests_merged = 0  # requests that shared a batch with another

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="drafter-scheduler")

    async def submit(self, steps: list[StepInput], trace: dict | None = None) -> list[StepOutput]:
        if self._stopping:
            raise RuntimeError("the scheduler is stopped")
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(steps, fut, trace))
        self._wakeup.set()
        return await fut

    async def run_exclusive(self, fn: Callable, *args):
        """Run fn on the step thread, between batches (Release, GetInfo's KV numbers)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _take_batch(self) -> list[_Pending]:
        batch: list[_Pending] = []
        keys: set[tuple[str, str]] = set()
        tokens = seqs = 0
        postponed: deque[_Pending] = deque()
        while self._queue:
            p = self._queue.popleft()
            if p.future.cancelled():
                continue
            p_keys = {(s.namespace, s.sequence_id) for s in p.steps}
            fits = tokens + p.num_tokens <= self.max_batch_tokens and seqs + len(p.steps) <= self.max_batch_seqs
            if batch and (not fits or p_keys & keys):
                postponed.append(p)
                continue
            batch.append(p)
            keys |= p_keys
            tokens += p.num_tokens
            seqs += len(p.steps)
        self._queue.extendleft(reversed(postponed))  # keep arrival order for the next round
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wakeup.clear()
                if self._stopping:
                    return
                await self._wakeup.wait()
                continue
            batch = self._take_batch()
            if not batch:
                continue
            steps = [s for p in batch for s in p.steps]
            try:
                if self.inline:  # experiment knob: run the step on the event-loop thread (no thread hand-off)
                    outputs, span = _timed_step(self.proposer, steps)
                else:
                    outputs, span = await loop.run_in_executor(self._executor, _timed_step, self.proposer, steps)
            except Exception as e:  # the proposer catches its own errors; this is a last resort
                log.exception("batch failed")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            self.batches_run += 1
            if len(batch) > 1:
                self.requests_merged += len(batch)
            r = 0
            for p in batch:
                if p.trace is not None:
                    p.trace["worker_start"], p.trace["worker_end"] = span
                if not p.future.done():
                    p.future.set_result(outputs[r : r + len(p.steps)])
                r += len(p.steps)

    async def stop(self) -> None:
        """Finish what is queued, then stop the worker."""
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)


def _timed_step(proposer: Proposer, steps: list[StepInput]) -> tuple[list[StepOutput], tuple[float, float]]:
    t0 = time.perf_counter()
    outputs = proposer.step(steps)
    return outputs, (t0, time.perf_counter())
