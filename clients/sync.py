"""Blocking wrapper for engines that do not run asyncio: an event loop on a private thread.

With a step channel open, propose() runs on the calling thread (DrafterClient.propose_blocking): the request goes
through the channel and the calling thread polls for the reply, without handing the step to the loop's thread and
waiting to be woken (two thread wake-ups per step). Otherwise it runs on the loop. propose() calls are serialized.
Deadline, fallback and circuit breaker are DrafterClient's (its keyword arguments: step_timeout_s, raise_on_error,
breaker) on both paths.
"""
import asyncio
import threading

import torch

from drafter_client.batch import BatchDrafts, StepBatch
from drafter_client.breaker import CircuitBreaker
from drafter_client.client import DrafterClient, ProposeResult, ReleaseResult, SequenceStep


class SyncDrafterClient:
    """DrafterClient's calls as blocking methods, for engines without asyncio (same arguments and results)."""
    def __init__(self, target: str, namespace: str = "", **kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="drafter-client", daemon=True)
        self._thread.start()
        self._client: DrafterClient = self._run(self._make(target, namespace, kwargs))
        self._propose_lock = threading.Lock()  # one step at a time (the shared-memory ring is not thread-safe)

    @staticmethod
    async def _make(target, namespace, kwargs) -> DrafterClient:
        return DrafterClient(target, namespace, **kwargs)

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> "SyncDrafterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until the drafter's health says SERVING; TimeoutError after timeout_s."""
        self._run(self._client.wait_ready(timeout_s))

    def get_info(self, timeout: float | None = None):
        """See DrafterClient.get_info."""
        return self._run(self._client.get_info(timeout))

    def propose(self, steps: list[SequenceStep], hidden_states: torch.Tensor | None = None,
                timeout: float | None = None) -> ProposeResult:
        """One engine step (see DrafterClient.propose): through the step channel on the calling thread when one is
        open and free, else a unary Propose on the client's loop. A sick drafter gives a fallback result (no drafts,
        ``result.fallback``) within the step deadline, as DrafterClient.propose does."""
        with self._propose_lock:
            result = self._client.propose_blocking(steps, hidden_states, timeout)  # through the step channel
            if result is None:
                result = self._run(self._client.propose(steps, hidden_states, timeout))
            return result

    def propose_batch(self, batch: StepBatch, timeout: float | None = None) -> BatchDrafts:
        """One engine step as columns (see DrafterClient.propose_batch), on the client's loop."""
        with self._propose_lock:
            return self._run(self._client.propose_batch(batch, timeout))

    def release(self, sequence_ids: list[str], timeout: float | None = None) -> ReleaseResult:
        """See DrafterClient.release."""
        return self._run(self._client.release(sequence_ids, timeout))

    def enable_shared_memory(self, max_step_tokens: int, **kwargs) -> str:
        """See DrafterClient.enable_shared_memory."""
        return self._run(self._client.enable_shared_memory(max_step_tokens, **kwargs))

    def open_step_channel(self, **kwargs) -> bool:
        """See DrafterClient.open_step_channel."""
        return self._run(self._client.open_step_channel(**kwargs))

    @property
    def breaker(self) -> CircuitBreaker:
        """The client's circuit breaker (state, failures, times_opened, times_closed)."""
        return self._client.breaker

    @property
    def data_plane(self) -> str:
        """"inline", "system" or "cuda": how hidden states travel now (see DrafterClient.enable_shared_memory)."""
        return self._client.data_plane

    def close(self) -> None:
        """Close the client and stop its loop thread."""
        if self._loop.is_running():
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()
