"""Continuous batching on one step thread: steps that arrive while the device is busy are merged into the next batch.

One thread owns the proposer. It takes work from two places:
  - the gRPC handlers (event-loop thread): submit() queues a request's steps and awaits a future;
  - the shared-memory step channels (step_channels.py): the thread itself polls their doorbells, so a step that
    comes through a channel goes from the client's write to the proposer without waking any other thread.
Each round it takes *everything* queued (no timer: at low load a lone request runs at once), up to the token and
sequence budgets. Requests are taken in arrival order; a request touching a sequence already in the forming batch
waits for the next batch, so two steps of one sequence never run out of order. Release and GetInfo's KV numbers
run on the same thread between batches (run_exclusive), so they never race a step; so do the sequence leases
(Proposer.expire_idle, checked at every turn of the loop) and the freeing of a closed stream's or channel's
sequences (call_soon; ChannelSet.release_owner).

Merging the steps of engines that step together (merge_window.py): before a batch starts, the thread waits for the
engines that arrived within merge_window_s of the queued ones at their previous step (_wait_for_partners: a window
from when the thread is ready to wait or has read the last of them to come, never longer than the last batch took),
so that engines stepping in lockstep share one batch instead of running one after another. One engine alone never
waits.

Pre-drafting (predraft.py): when nothing is queued and sequences wait for their next step's drafts to be prepared,
the thread runs a preparation pass, which stops between two forwards as soon as a request or job is queued (it polls
the channels itself).

Idle policy: with no channel open the thread sleeps until submit() wakes it, or until the next sequence lease
can run out (Proposer.expiry_wait) when sequences are live. With channels open it polls them,
yielding the GIL between polls (drafter_client.protocol.gil_yield: time.sleep(0), and now and then a real sleep, in which the event loop's
thread, serving gRPC, can take the GIL), for channel_spin_s after the last channel request (the gap
between two engine steps), then every channel_idle_poll_s. The thread's timer slack is 1 ns (Linux): with the
default 50 us slack each time.sleep(0) lasts 50-75 us, about how late a request would be noticed.
"""
import asyncio
import faulthandler
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from drafter_service.engine.batch_io import BatchInput, BatchOutput
from drafter_service.engine.merge_window import MAX_MERGE_WAIT_S, MERGE_POLL_S, MergeWindow
from drafter_service.engine.proposer import Proposer
from drafter_service.engine.step_io import StepInput, StepOutput
from drafter_client.protocol.gil_yield import GilYield
from drafter_client.protocol.timer_slack import set_timer_slack

log = logging.getLogger(__name__)


def set_owner(steps: "list[StepInput] | BatchInput", owner: str | None) -> None:
    """The stream / step channel a sequence these steps create will belong to."""
    if isinstance(steps, BatchInput):
        steps.set_owner(owner)
    else:
        for s in steps:
            s.owner = owner


def dry_outputs(steps: "list[StepInput] | BatchInput") -> "list[StepOutput] | BatchOutput":
    """Empty answers (ingest-only benchmarks: nothing ran), in the form a real step would have."""
    outputs = [StepOutput() for _ in range(len(steps))]
    return BatchOutput.from_outputs(outputs) if isinstance(steps, BatchInput) else outputs


@dataclass
class PendingRequest:
    steps: list[StepInput] | BatchInput  # one StepInput per sequence, or a columnar request's columns
    # called on the step thread with the answers (a BatchOutput for a BatchInput) or the exception; it may return the
    # bookkeeping of its reply (metrics, traces) as a callable, which the thread runs once every request of the batch
    # has its reply (a merged batch's later engines do not wait for the earlier ones' bookkeeping)
    deliver: Callable[[list[StepOutput] | BatchOutput | None, BaseException | None], Callable[[], None] | None]
    trace: dict | None = None  # when given: the batch's worker_start / worker_end (time.perf_counter) go here
    dry: bool = False  # answer without running the head (benchmarks' ingest-only mode)
    cancelled: Callable[[], bool] = lambda: False  # True: nobody waits for it (the RPC was cancelled): skip it
    enqueued_at: float = field(default_factory=time.perf_counter)  # made just before it is queued (queue wait)
    # a columnar request's work on its answer before the drafts are known: called on the step thread, while the GPU
    # drafts, with its share of the step's answer (drafts None; Proposer.step_batch's early); then, before deliver,
    # with None when the answer deliver gets is not that one with its drafts (the step failed: drop what was made)
    early: Callable[[BatchOutput | None], None] | None = None

    @property
    def num_tokens(self) -> int:
        if isinstance(self.steps, BatchInput):
            return self.steps.total_tokens
        return sum(s.num_tokens for s in self.steps)

    def keys(self) -> set[tuple[str, str]]:
        """(namespace, sequence id) of every sequence the request steps."""
        if isinstance(self.steps, BatchInput):
            return set(zip(self.steps.namespaces, self.steps.sequence_ids))
        return {(s.namespace, s.sequence_id) for s in self.steps}

    def owner(self) -> str | None:
        """The stream / step channel that sent it (None: unary)."""
        if isinstance(self.steps, BatchInput):
            return self.steps.owners[0] if len(self.steps) else None
        return self.steps[0].owner if self.steps else None

    def asks_predraft(self) -> bool:
        if isinstance(self.steps, BatchInput):
            return bool(self.steps.predraft_branches.any())
        return any(s.predraft_branches for s in self.steps)


def _early_hook(run: list[PendingRequest]):
    """(the early callback for Proposer.step_batch of these requests merged, the list the whole answer it saw lands in):
    each request that has work of its own (PendingRequest.early) gets its share; (None, []) when none has."""
    if not any(p.early is not None for p in run):
        return None, []
    seen: list[BatchOutput] = []

    def hook(out: BatchOutput) -> None:
        seen.append(out)
        r = 0
        for p in run:
            n = len(p.steps)
            if p.early is not None:
                p.early(out.slice(r, r + n))
            r += n
    return hook, seen


@dataclass
class _Job:
    fn: Callable
    args: tuple
    deliver: Callable  # same signature as PendingRequest.deliver, with fn's result


def _resolve_in(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
    """A deliver() for the step thread that completes fut on its event loop."""

    def set_result(result, exc):
        if not fut.done():
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def deliver(result, exc=None):
        try:
            loop.call_soon_threadsafe(set_result, result, exc)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    return deliver


def _log_failure(result, exc=None) -> None:
    """deliver() of a call_soon job: nobody waits for the result."""
    if exc is not None:
        log.error("step-thread job failed: %s: %s", type(exc).__name__, exc)


# Debugging stalls: when set (seconds), a batch or a pre-drafting pass that runs longer dumps every thread's stack to
# stderr (faulthandler), so that a step that stalls (a kernel compile, a lock) shows where it waits.
STALL_TRACE_S = float(os.environ.get("DRAFTER_STALL_TRACE_S") or 0)


class _StallTrace:
    def __enter__(self):
        if STALL_TRACE_S > 0:
            faulthandler.dump_traceback_later(STALL_TRACE_S)

    def __exit__(self, *exc):
        if STALL_TRACE_S > 0:
            faulthandler.cancel_dump_traceback_later()


class StepScheduler:
    def __init__(self, proposer: Proposer, max_batch_tokens: int, max_batch_seqs: int,
                 channel_spin_s: float = 0.05, channel_idle_poll_s: float = 0.0002, merge_window_s: float = 0.0,
                 rehearse_after_s: float = 0.0):
        self.proposer = proposer
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.channel_spin_s = channel_spin_s
        self.channel_idle_poll_s = channel_idle_poll_s
        # while it spins for channel requests, this long after its last batch the thread starts re-reading the last
        # request frame now and then (ChannelSet.rehearse); 0: never
        self.rehearse_after_s = rehearse_after_s
        self._queue: deque[PendingRequest] = deque()  # appended by the event loop and by channel polls; taken here
        self._jobs: deque[_Job] = deque()
        self._wake = threading.Event()
        self._channels = None  # step_channels.ChannelSet, when channels are on (attach_channels)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.batches_run = 0
        self._last_batch_end: float | None = None  # time.perf_counter() when the last batch was answered
        self._last_batch_s = 0.0  # how long the last batch took, start to answers (caps a merge-window wait)
        self._cycle_owner: str | None = None  # the owner of the last batch's requests when they had one, and when
        self._cycle_arrived = 0.0  # its first request arrived (pre-drafting's cycle check)
        self.requests_merged = 0  # requests that shared a batch with another
        self.merge_window = MergeWindow(merge_window_s)

    def attach_channels(self, channels) -> None:
        self._channels = channels
        channels.rehearse_frames = self.rehearse_after_s > 0
        channels.wake = self._wake.set  # a new channel wakes a sleeping thread so that it starts polling
        # a channel whose client went frees its sequences, as a job between batches: a poll from inside a pre-drafting
        # pass must not change the table under it (the job also stops the pass)
        channels.release_owner = lambda owner: self.call_soon(self.proposer.release_owner, owner)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="drafter-step", daemon=True)
        self._thread.start()

    async def submit(self, steps: "list[StepInput] | BatchInput", trace: dict | None = None,
                     early: "Callable[[BatchOutput | None], None] | None" = None,
                     finish: "Callable[[list[StepOutput] | BatchOutput], object] | None" = None):
        """The answers to one request (its steps' outputs), or what finish made of them. early: PendingRequest.early
        (a columnar request's work while the GPU drafts); finish: run on the step thread on the answers as soon as
        they are known, before the hop back to the event loop (a reply encoded there); its exception is the
        request's."""
        if self._stopping:
            raise RuntimeError("the scheduler is stopped")
        fut = self._loop.create_future()
        resolve = _resolve_in(self._loop, fut)
        if finish is None:
            deliver = resolve
        else:
            def deliver(result, exc=None):
                if exc is None:
                    try:
                        result = finish(result)
                    except Exception as e:
                        result, exc = None, e
                resolve(result, exc)
        self.enqueue(PendingRequest(steps, deliver, trace, cancelled=fut.cancelled, early=early))
        return await fut

    def queue_depth(self) -> int:
        """Requests queued, not yet taken into a batch (drafter_queue_depth)."""
        return len(self._queue)

    def enqueue(self, pending: PendingRequest) -> None:
        self._queue.append(pending)
        self._wake.set()

    async def run_exclusive(self, fn: Callable, *args):
        """Run fn on the step thread, between batches (Release, GetInfo's KV numbers)."""
        fut = self._loop.create_future()
        self._jobs.append(_Job(fn, args, _resolve_in(self._loop, fut)))
        self._wake.set()
        return await fut

    def call_soon(self, fn: Callable, *args) -> None:
        """Run fn on the step thread between batches without waiting for it (a stream's end frees its
        sequences: the stream's task may be cancelled already)."""
        self._jobs.append(_Job(fn, args, _log_failure))
        self._wake.set()

    async def stop(self) -> None:
        """Finish what is queued, close the channels, then stop the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- the step thread ----

    def _take_batch(self) -> list[PendingRequest]:
        batch: list[PendingRequest] = []
        keys: set[tuple[str, str]] = set()
        tokens = seqs = 0
        postponed: deque[PendingRequest] = deque()
        while self._queue:
            p = self._queue.popleft()
            if p.cancelled():
                continue
            p_keys = p.keys()
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

    def _run(self) -> None:
        set_timer_slack(1)  # (timer_slack.py: time.sleep(0) between channel polls lasts ~4 us, not 50+)
        device = getattr(self.proposer, "device", None)
        if device is not None and device.type == "cuda":
            # the current CUDA device is per thread, and a new thread's is cuda:0: Triton launches its kernels on the
            # current device's stream, so a drafter on cuda:1 would launch them on cuda:0 with cuda:1's pointers
            torch.cuda.set_device(device)
        last_channel_request = 0.0
        yield_gil = GilYield()
        while True:
            channels = self._channels
            self.proposer.expire_idle()  # (a clock read and a compare unless a lease may have run out)
            # (the step thread queues its own finds: no need to wake itself)
            # (no reading ahead when a batch is about to run: a frame not yet sent cannot join it)
            if channels is not None and channels.poll(self._queue.append, read_ahead=not self._queue):
                last_channel_request = time.monotonic()
            while self._jobs:
                job = self._jobs.popleft()
                try:
                    job.deliver(job.fn(*job.args), None)
                except Exception as e:
                    job.deliver(None, e)
            if self._queue:
                if self.merge_window.enabled:
                    self._wait_for_partners(channels)
                with _StallTrace():
                    self._run_batch(self._take_batch())
                continue
            if self._stopping:
                break
            if self.proposer.predraft.has_work():  # idle: prepare the next steps' drafts, until a request comes
                try:
                    with _StallTrace():
                        self.proposer.predraft.prepare(lambda: self._request_waiting(channels))
                except Exception:  # (never the step thread's end: the sequences go on with plain steps)
                    log.exception("pre-drafting pass failed; prepared branches dropped")
                    self.proposer.predraft.reset()
                if channels is not None and self._queue:
                    last_channel_request = time.monotonic()
                continue
            if channels is not None and channels.open_count():
                if time.monotonic() - last_channel_request < self.channel_spin_s:
                    if self._rehearsal_due():
                        channels.rehearse()  # (the last request frame's parse, now and then: keeps it warm)
                    yield_gil()  # (to the event loop's thread too: gil_yield.py), then poll again
                    continue
                self._wake.wait(self.channel_idle_poll_s)
            else:
                self._wake.wait(self.proposer.expiry_wait())  # None (no lease, no sequence): until woken
            self._wake.clear()
        if self._channels is not None:
            self._channels.close_all("the drafter is shutting down")

    def _rehearsal_due(self) -> bool:
        """Whether the thread, spinning for channel requests, has waited rehearse_after_s since its last batch (an
        engine's step comes back to back with the last one from a short GPU step, where the code is still warm, or a
        target forward later, where it is not: docs/performance.md, twenty-fifth session)."""
        end = self._last_batch_end
        return self.rehearse_after_s > 0 and end is not None and time.perf_counter() - end >= self.rehearse_after_s

    def _wait_for_partners(self, channels) -> None:
        """Before a batch: poll for the engines that arrived together with the queued ones last time (merge_window.py)
        until each has a request queued, or until merge_window_s has passed since the step thread was ready to wait
        or since the last of the group's requests came in, whichever is later (a partner that comes brings its own
        partners: the group follows its arrivals); the whole wait never runs past the last batch's duration from the
        first request, and a first request older than that starts at once (late: the thread was busy)."""
        window = self.merge_window
        queued = list(self._queue)  # (a snapshot: the event loop appends to the deque)
        owners = {p.owner() for p in queued}
        missing = window.partners(owners)
        if not missing:
            return
        first = min(p.enqueued_at for p in queued)
        # (a wait longer than a batch costs more than running the late engines' steps on their own)
        cap = first + max(window.window_s, min(self._last_batch_s, MAX_MERGE_WAIT_S))
        start = time.perf_counter()
        if start >= cap:  # the queue's first request has waited a batch's time already (load): go now
            window.counters.late += 1
            return
        # The window counts from now, not from the first request's arrival: reading the requests that are here
        # (a step channel's parse, done by this thread: 0.1-0.35 ms per EAGLE-3 request of 8-128 sequences on an
        # H200's host) comes before, and four engines' requests took the whole of a 300 us window that way
        deadline = start + window.window_s
        seen = len(queued)
        while True:
            if channels is not None:
                channels.poll(self._queue.append)
            if len(self._queue) > seen:
                queued = list(self._queue)
                came = [p for p in queued[seen:] if p.owner() in missing]
                seen = len(queued)
                if came:
                    owners.update(p.owner() for p in came)
                    missing = window.partners(owners)
                    deadline = max(deadline, time.perf_counter() + window.window_s)
            now = time.perf_counter()
            if not missing or now >= min(deadline, cap) or self._jobs or self._stopping:
                break
            # a real sleep, not time.sleep(0): a partner's gRPC request is queued by the event loop's thread, which
            # must get the GIL; after a sleep(0) this thread takes it back before that one has woken (up to the 5 ms
            # switch interval of waiting), which would let the window run out for a request that had come
            time.sleep(MERGE_POLL_S)
        window.record_wait(now - start, complete=not missing)

    def _request_waiting(self, channels) -> bool:
        """Whether a request or a job waits for the step thread (polls the step channels: what they hold is queued)."""
        if channels is not None:
            channels.poll(self._queue.append, read_ahead=not self._queue)
        return bool(self._queue) or bool(self._jobs) or self._stopping

    def _observe_cycle(self, batch: list[PendingRequest]) -> None:
        """Pre-drafting's cycle check: the time since the previous request of the same engine (one owner: a stream or
        a step channel), when the batch holds that engine's requests alone and one of them asks for pre-drafting.
        Nothing without --predraft-cycle-check."""
        if not self.proposer.predraft.cycle_check:
            return
        owners = {p.owner() for p in batch if len(p.steps) and not p.dry}
        owner = next(iter(owners)) if len(owners) == 1 else None
        arrived = min(p.enqueued_at for p in batch)
        if (owner is not None and owner == self._cycle_owner
                and any(p.asks_predraft() for p in batch if len(p.steps) and not p.dry)):
            self.proposer.predraft.observe_cycle(arrived - self._cycle_arrived, sum(len(p.steps) for p in batch))
        self._cycle_owner, self._cycle_arrived = owner, arrived

    def _run_batch(self, batch: list[PendingRequest]) -> None:
        if batch and self._last_batch_end is not None:  # idle time before its first request (pre-drafting's window)
            arrived = min(p.enqueued_at for p in batch)
            self.proposer.predraft.observe_window(max(0.0, arrived - self._last_batch_end))
        if batch:
            self._observe_cycle(batch)
            if self.merge_window.enabled:
                arrivals: dict[str, float] = {}
                for p in batch:
                    owner = p.owner()
                    if owner is not None and owner not in arrivals:
                        arrivals[owner] = p.enqueued_at
                self.merge_window.observe(arrivals)
        run = [p for p in batch if not p.dry and len(p.steps)]
        columnar = bool(run) and all(isinstance(p.steps, BatchInput) for p in run)
        traced = columnar and any(p.trace is not None for p in run)
        if traced:  # (diagnostics: the columns step's phases into the traces below)
            self.proposer.phase_marks = {}
        t0 = time.perf_counter()
        try:
            if columnar:  # every request came as columns: one BatchInput for the whole batch
                hook, seen = _early_hook(run)
                outputs = self.proposer.step_batch(BatchInput.cat([p.steps for p in run]), early=hook)
                if seen and seen[0] is not outputs:  # (the step failed after the early work: another answer)
                    for p in run:
                        if p.early is not None:
                            p.early(None)
            else:
                steps = [s for p in run for s in (p.steps.to_inputs() if isinstance(p.steps, BatchInput) else p.steps)]
                outputs = self.proposer.step(steps) if steps else []
        except Exception as e:  # the proposer catches its own errors; this is a last resort
            log.exception("batch failed")
            if traced:
                self.proposer.phase_marks = None
            for p in batch:
                p.deliver(None, e)
            return
        span = (t0, time.perf_counter())
        marks = {}
        if traced:
            marks, self.proposer.phase_marks = self.proposer.phase_marks or {}, None
        self.batches_run += 1
        if len(batch) > 1:
            self.requests_merged += len(batch)
        r = 0
        bookkeeping: list[Callable[[], None]] = []
        for p in batch:
            if p.dry:
                answer = dry_outputs(p.steps)
            else:
                if p.trace is not None:
                    p.trace["worker_start"], p.trace["worker_end"] = span
                    p.trace.update(marks)
                n = len(p.steps)
                if columnar:  # (a request alone in its batch gets the whole answer: no slicing)
                    answer = outputs if n == len(outputs) else outputs.slice(r, r + n)
                elif isinstance(p.steps, BatchInput):
                    answer = BatchOutput.from_outputs(outputs[r : r + n])
                else:
                    answer = outputs[r : r + n]
                r += n
            after = p.deliver(answer, None)
            if after is not None:
                bookkeeping.append(after)
        for after in bookkeeping:  # (after every reply is on its way)
            try:
                after()
            except Exception:  # (metrics or a trace: never the batch's failure)
                log.exception("reply bookkeeping failed")
        for p in batch:
            self.proposer.metrics.observe_queue_wait(t0 - p.enqueued_at)
        self._last_batch_end = time.perf_counter()
        self._last_batch_s = self._last_batch_end - t0
