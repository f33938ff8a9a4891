"""Async client: one engine step per call (Propose), a streaming session (ProposeStream), Release, GetInfo,
the shared-memory data plane (enable_shared_memory; docs/shared_memory.md) and the shared-memory step channel
(open_step_channel; docs/step_channel.md)."""
import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_client.auth import bearer_metadata
from drafter_client.messages import (DrafterError, ProposeResult, ReleaseResult, SequenceDrafts, SequenceStep,
                                     build_request, hidden_parts, parse_response)
from drafter_client.protocol import pb, pb_grpc
from drafter_client.session import ProposeSession
from drafter_client.shm_ring import SharedTensorRef, SlotRing
from drafter_client.step_channel import StepChannel, StepChannelClosed, StepChannelError

# (re-exported: they were defined here before messages.py)
__all__ = ["DrafterClient", "DrafterError", "ProposeResult", "ReleaseResult", "SequenceDrafts", "SequenceStep",
           "build_request", "parse_response"]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# Request-level codes the drafter answers with once it is done with the request's shared-memory slot (or before it
# read it). After any other failure (CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE, ...) the drafter may still be
# reading the slot, so the slot is retired rather than reused.
ANSWERED_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNIMPLEMENTED}
# Registration failures that mean "this drafter cannot map that memory" (another node, another /dev/shm, another
# GPU set, shared memory off): enable_shared_memory(kind="auto") then tries the next kind, and finally inline.
FALLBACK_CODES = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass
class _Staged:
    """A step's hidden states written into a ring slot; the slot is busy until done()."""

    ring: SlotRing
    slot: int
    ref: SharedTensorRef

    def done(self, answered: bool) -> None:
        """answered: the drafter replied (or never got the request), so it reads the slot no more."""
        (self.ring.release if answered else self.ring.retire)(self.slot)


class DrafterClient:
    """Async client over TCP (``host:port``) or a Unix socket (``unix:/path``). One per engine process."""

    def __init__(self, target: str, namespace: str = "", max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 credentials: "grpc.ChannelCredentials | None" = None, token: str | None = None):
        """target: ``host:port`` or ``unix:/path``; namespace: this engine's sequences and regions live under it.
        credentials: TLS channel credentials (drafter_client.auth.tls_credentials) for a TLS listener; token: a
        bearer token sent with every call and in step-channel hellos (drafter --auth-token-file)."""
        self.target = target
        self.namespace = namespace
        self._token = token
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        # call metadata of every Drafter call (health checks go without: probes need no token)
        self._metadata = bearer_metadata(token)
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stub = pb_grpc.DrafterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._next_request_id = 1
        # shared-memory data plane (enable_shared_memory)
        self.data_plane = "inline"  # "system" or "cuda" while a ring is registered
        self.steps_by_reference = 0  # steps whose hidden states went through the ring
        self.steps_inline = 0  # steps sent inline (no ring, step larger than a slot, or every slot busy)
        self.staging_seconds = 0.0  # time spent copying steps' hidden states into ring slots (the client's copy)
        self._ring: SlotRing | None = None
        self._ring_settings: dict | None = None
        self._own_regions: set[str] = set()  # registered with register_cuda_tensor, unregistered on close
        self._heartbeat: asyncio.Task | None = None
        # step channel (open_step_channel)
        self._step_channel: StepChannel | None = None
        self.steps_through_channel = 0  # propose() calls answered through the step channel
        self.steps_through_grpc = 0  # ... and through a unary Propose

    async def __aenter__(self) -> "DrafterClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the step channel, unregister the shared-memory ring and this client's regions, close the channel."""
        self.close_step_channel()
        await self.disable_shared_memory()
        if self._own_regions:
            try:
                await self.unregister_shared_memory(sorted(self._own_regions))
            except DrafterError as e:  # the drafter's lease reclaims them
                log.info("unregistering %s: %s", sorted(self._own_regions), e)
        await self._stop_heartbeat()
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until the server's health says SERVING (the model is loaded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = await self._health.Check(health_pb2.HealthCheckRequest(service="drafter.v1.Drafter"),
                                             timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"drafter at {self.target} not SERVING after {timeout_s}s")
            await asyncio.sleep(0.05)

    async def _call(self, rpc, request, timeout: float | None):
        try:
            return await rpc(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise DrafterError(e.code(), e.details() or "") from None

    async def get_info(self, timeout: float | None = None) -> "pb.GetInfoResponse":
        """The drafter's model, method, limits and data planes (GetInfo)."""
        return await self._call(self._stub.GetInfo, pb.GetInfoRequest(), timeout)

    def _request_id(self) -> int:
        rid = self._next_request_id
        self._next_request_id += 1
        return rid

    async def propose(self, steps: list[SequenceStep], hidden_states: "torch.Tensor | SharedTensorRef | None" = None,
                      timeout: float | None = None) -> ProposeResult:
        """One engine step for a batch (unary RPC). Per-sequence problems come back in ``result.sequences``.

        hidden_states: the whole batch's states packed, or None to take each step's; or a SharedTensorRef into a
        region the caller registered itself. With enable_shared_memory they go through the ring."""
        staged = self._stage(steps, hidden_states)
        sent = answered = False
        try:
            req = build_request(self.namespace, steps, staged.ref if staged else hidden_states, self._request_id())
            sent = True
            resp = await self._send_step(req, timeout)
            answered = True
        except DrafterError as e:
            answered = e.code in ANSWERED_CODES
            raise
        finally:
            if staged is not None:
                staged.done(answered or not sent)
        return parse_response(resp)

    async def _send_step(self, req: "pb.ProposeRequest", timeout: float | None) -> "pb.ProposeResponse":
        """Through the step channel when one is open and free and the request fits it; else a unary Propose."""
        ch, payload = self._claim_channel(req)
        if ch is not None:
            reply = None
            with self._channel_errors():
                reply = await ch.call(payload, timeout)
            if reply is not None:
                self.steps_through_channel += 1
                return pb.ProposeResponse.FromString(reply)
        self.steps_through_grpc += 1
        return await self._call(self._stub.Propose, req, timeout)

    def _claim_channel(self, req: "pb.ProposeRequest") -> "tuple[StepChannel | None, bytes]":
        """(the claimed step channel, the request's bytes) when req can go through it now; else (None, b"")."""
        ch = self._step_channel
        if ch is None or not ch.try_claim():
            return None, b""
        payload = req.SerializeToString()
        if len(payload) > ch.request_capacity:
            ch.unclaim()
            return None, b""
        return ch, payload

    @contextlib.contextmanager
    def _channel_errors(self):
        """Around a channel call: a channel the drafter closed before taking the request is dropped and the step
        goes over gRPC (nothing happened); a failed call drops it and raises the DrafterError of a unary call."""
        try:
            yield
        except StepChannelClosed:
            log.warning("the drafter at %s closed the step channel: steps go over gRPC", self.target)
            self._step_channel = None
        except StepChannelError as e:
            self._step_channel = None
            raise DrafterError(e.code, e.message) from None

    def propose_blocking(self, steps: list[SequenceStep], hidden_states: "torch.Tensor | SharedTensorRef | None" = None,
                         timeout: float | None = None) -> ProposeResult | None:
        """propose() through the open step channel on the calling thread: no event loop and no thread hand-off
        (SyncDrafterClient's fast path). Returns None, having done nothing, when the step cannot go through the
        channel now (none open, another call holds it, the request is larger than its area, or the drafter
        closed it before taking the request): then call propose()."""
        ch = self._step_channel
        if ch is None or not ch.try_claim():
            return None
        staged = None
        called = sent = answered = False
        try:
            staged = self._stage(steps, hidden_states)
            req = build_request(self.namespace, steps, staged.ref if staged else hidden_states, self._request_id())
            payload = req.SerializeToString()
            if len(payload) > ch.request_capacity:
                return None
            called = sent = True  # (the call releases the claim, however it ends)
            reply = None
            with self._channel_errors():
                reply = ch.call_blocking(payload, timeout)
            if reply is None:  # the drafter closed the channel before taking the request
                sent = False
                return None
            answered = True
        except DrafterError as e:
            answered = e.code in ANSWERED_CODES
            raise
        finally:
            if not called:
                ch.unclaim()
            if staged is not None:
                staged.done(answered or not sent)
        self.steps_through_channel += 1
        return parse_response(pb.ProposeResponse.FromString(reply))

    async def open_step_channel(self, request_bytes: int = 16 * 2**20, reply_bytes: int = 2**20,
                                socket_path: str | None = None, spin_s: float = 0.05,
                                poll_s: float = 0.0001) -> bool:
        """Send propose() steps through a shared-memory step channel (same node only; docs/step_channel.md):
        the request and reply bytes go through a mailbox the drafter polls instead of a gRPC message each.

        request_bytes / reply_bytes: the largest serialized ProposeRequest / ProposeResponse the channel carries
        (larger ones, and calls made while the channel is busy with another, go over gRPC). With
        enable_shared_memory the request holds descriptors only, so a few hundred KiB suffice.
        socket_path: default GetInfo.step_channel_socket. spin_s / poll_s: while waiting for a reply this client
        busy-polls (yielding to the event loop) for spin_s, then every poll_s.
        Returns False (and steps stay on gRPC) when the drafter has no channels or its socket cannot be reached
        (another node, a container without the socket's volume); raises DrafterError when the drafter refuses."""
        self.close_step_channel()
        if socket_path is None:
            socket_path = (await self.get_info()).step_channel_socket
            if not socket_path:
                log.info("the drafter at %s has no step channels: steps go over gRPC", self.target)
                return False
        try:
            ch = await asyncio.get_running_loop().run_in_executor(
                None, lambda: StepChannel.open(socket_path, self.namespace, request_bytes, reply_bytes, spin_s,
                                               poll_s, token=self._token))
        except StepChannelError as e:
            raise DrafterError(e.code, e.message) from None
        except OSError as e:
            log.info("cannot open a step channel at %s (%s): steps go over gRPC", socket_path, e)
            return False
        self._step_channel = ch
        return True

    def close_step_channel(self) -> None:
        """Back to a unary Propose per step (the drafter closes its end within 0.1 s)."""
        ch, self._step_channel = self._step_channel, None
        if ch is not None:
            ch.close()

    @property
    def step_channel_open(self) -> bool:
        """True while propose() can go through an open step channel."""
        return self._step_channel is not None and not self._step_channel.closed

    def stream(self) -> "ProposeSession":
        """A bidirectional session: one message per engine step, replies in order. Use ``async with``."""
        return ProposeSession(self, self._stub.ProposeStream(metadata=self._metadata))

    async def release(self, sequence_ids: list[str], timeout: float | None = None) -> ReleaseResult:
        """Free these sequences' drafter state (KV blocks); ids the drafter does not hold come back in not_found."""
        r = await self._call(self._stub.Release, pb.ReleaseRequest(namespace=self.namespace,
                                                                   sequence_ids=list(sequence_ids)), timeout)
        return ReleaseResult(released=r.released, not_found=list(r.not_found))

    async def drain(self, grace_seconds: float = 0.0, timeout: float | None = None) -> "pb.DrainResponse":
        """Ask the drafter to drain (rollouts, preStop): it takes no new sequences, live ones keep drafting until
        released or grace_seconds (0: its --shutdown-grace-s) pass, then it exits. Needs a '*' token when the
        drafter checks tokens."""
        return await self._call(self._stub.Drain, pb.DrainRequest(grace_seconds=grace_seconds), timeout)

    # ---- the shared-memory data plane (docs/shared_memory.md) ----

    async def enable_shared_memory(self, max_step_tokens: int, dtype: torch.dtype = torch.bfloat16,
                                   kind: str = "auto", slots: int = 2, device: "torch.device | str | None" = None,
                                   width: int | None = None, lease_seconds: int = 0) -> str:
        """Send hidden states by reference, through a ring of ``slots`` shared-memory slots registered with the
        drafter, each holding ``max_step_tokens`` rows of ``width`` (default GetInfo.hidden_states_width) columns
        of ``dtype``: each step is one copy into the next free slot plus a descriptor in the message.

        kind: "system" (a /dev/shm segment; pinned when ``device`` is a GPU), "cuda" (a CUDA IPC buffer on
        ``device``), or "auto": CUDA IPC when ``device`` is a GPU and the drafter can map it, else host shared
        memory, else inline bytes (a drafter on another node, or with shared memory off).
        Returns the data plane now in use: "cuda", "system" or "inline". A step larger than a slot, or sent while
        every slot still waits for its reply, goes inline (counted in ``steps_inline``).
        """
        if kind not in ("auto", "system", "cuda"):
            raise ValueError(f"kind {kind!r}: choose auto, system or cuda")
        await self.disable_shared_memory()
        device = torch.device(device) if device is not None else None
        settings = dict(max_step_tokens=max_step_tokens, dtype=dtype, kind=kind, slots=slots, device=device,
                        width=width, lease_seconds=lease_seconds)
        info = await self.get_info()
        if kind == "auto":
            if not info.shared_memory_supported:
                log.info("the drafter at %s takes no shared memory: hidden states travel inline", self.target)
                return "inline"
            kinds = [pb.CUDA_IPC] if (device is not None and device.type == "cuda"
                                      and pb.CUDA_IPC in info.shared_memory_kinds) else []
            kinds.append(pb.SYSTEM)
        else:
            kinds = [pb.SYSTEM if kind == "system" else pb.CUDA_IPC]
        slot_bytes = max_step_tokens * (width or info.hidden_states_width) * dtype.itemsize
        for k in kinds:
            what = pb.SharedMemoryKind.Name(k)
            try:
                ring = SlotRing.create(k, slot_bytes, slots, device)
            except (OSError, RuntimeError) as e:  # no /dev/shm here, CUDA driver refused, ...
                if kind != "auto":
                    raise
                log.info("cannot allocate a %s ring here (%s): trying the next way", what, e)
                continue
            try:
                r = await self._call(self._stub.RegisterSharedMemory,
                                     ring.store.register_request(ring.name, self.namespace, lease_seconds), 30.0)
            except DrafterError as e:
                ring.close()
                if kind != "auto" or e.code not in FALLBACK_CODES:
                    raise
                log.info("the drafter at %s cannot map %s memory (%s): trying the next way", self.target, what, e)
                continue
            ring.store.registered()
            self._ring, self._ring_settings = ring, settings
            self.data_plane = "cuda" if k == pb.CUDA_IPC else "system"
            self._ensure_heartbeat(r.region.lease_seconds)
            log.info("hidden states to %s through %s shared memory: %d slots of %d bytes", self.target, what, slots,
                     ring.slot_bytes)
            return self.data_plane
        return "inline"

    async def disable_shared_memory(self) -> None:
        """Back to inline bytes: unregister the ring and free it (and stop the heartbeat, unless regions of
        register_cuda_tensor still need it)."""
        if not self._own_regions:
            await self._stop_heartbeat()
        ring, self._ring = self._ring, None
        self.data_plane = "inline"
        if ring is None:
            return
        try:
            await self._call(self._stub.UnregisterSharedMemory,
                             pb.UnregisterSharedMemoryRequest(namespace=self.namespace, names=[ring.name]), 5.0)
        except DrafterError as e:  # the drafter's lease reclaims it
            log.info("unregistering %r: %s", ring.name, e)
        ring.close()

    async def register_cuda_tensor(self, name: str, tensor: torch.Tensor,
                                   lease_seconds: int = 0) -> "pb.SharedMemoryRegion":
        """Register an engine-owned, contiguous GPU tensor as region ``name``; then send
        ``SharedTensorRef(name, byte_offset, dtype, shape)`` as hidden_states. The drafter can read the whole
        cudaMalloc allocation around the tensor (read-only); one region per allocation."""
        from drafter_client.protocol import cuda_driver  # (only where CUDA is in use)

        if not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError("register_cuda_tensor takes a contiguous CUDA tensor")
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        base, _ = cuda_driver.address_range(index, tensor.data_ptr())
        req = pb.RegisterSharedMemoryRequest(
            namespace=self.namespace, name=name, byte_size=tensor.numel() * tensor.element_size(),
            cuda=pb.CudaSharedMemory(ipc_handle=cuda_driver.ipc_get_handle(index, base),
                                     offset=tensor.data_ptr() - base, device_id=index),
            lease_seconds=lease_seconds)
        r = await self._call(self._stub.RegisterSharedMemory, req, 30.0)
        self._own_regions.add(name)
        self._ensure_heartbeat(r.region.lease_seconds)
        return r.region

    async def unregister_shared_memory(self, names: list[str] | None = None) -> list[str]:
        """Unregister regions of this namespace (all of them when names is None); returns the names unmapped."""
        r = await self._call(self._stub.UnregisterSharedMemory,
                             pb.UnregisterSharedMemoryRequest(namespace=self.namespace, names=names or []), None)
        self._own_regions -= set(r.unregistered)
        return list(r.unregistered)

    async def shared_memory_status(self, names: list[str] | None = None) -> list["pb.SharedMemoryRegion"]:
        """This namespace's regions on the drafter (and a renewal of their leases)."""
        r = await self._call(self._stub.SharedMemoryStatus,
                             pb.SharedMemoryStatusRequest(namespace=self.namespace, names=names or []), None)
        return list(r.regions)

    def _stage(self, steps: list[SequenceStep], hidden_states) -> "_Staged | None":
        """Copy the batch's hidden states into a free ring slot (one copy); None: they go as given."""
        if isinstance(hidden_states, SharedTensorRef):
            self.steps_by_reference += 1
            return None
        ring = self._ring
        parts = hidden_parts(steps, hidden_states) if ring is not None and steps else []
        slot = ring.acquire(sum(p.numel() * p.element_size() for p in parts)) if parts else None
        if slot is None:
            self.steps_inline += 1
            return None
        t0 = time.perf_counter()
        try:
            ref = ring.write(slot, parts)
            self.staging_seconds += time.perf_counter() - t0
        except BaseException:
            ring.release(slot)
            raise
        self.steps_by_reference += 1
        return _Staged(ring, slot, ref)

    async def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            try:
                await self._heartbeat
            except asyncio.CancelledError:
                pass
            self._heartbeat = None

    def _ensure_heartbeat(self, lease_seconds: int) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            period = max(0.2, lease_seconds / 3)
            self._heartbeat = asyncio.get_running_loop().create_task(self._renew_leases(period))

    async def _renew_leases(self, period: float) -> None:
        """Renew this namespace's regions every period (a third of the lease); re-register a lost ring."""
        while True:
            await asyncio.sleep(period)
            try:
                r = await self._stub.SharedMemoryStatus(pb.SharedMemoryStatusRequest(namespace=self.namespace),
                                                        metadata=self._metadata,
                                                        timeout=period)
            except grpc.aio.AioRpcError as e:
                log.warning("shared-memory heartbeat to %s failed: %s", self.target, e.code().name)
                continue
            ring = self._ring
            if ring is not None and ring.name not in {x.name for x in r.regions}:
                log.warning("the drafter at %s no longer holds region %r (restarted, or the lease ran out): "
                            "registering a new ring", self.target, ring.name)
                self._ring, self.data_plane, self._heartbeat = None, "inline", None
                ring.close()
                try:
                    await self.enable_shared_memory(**self._ring_settings)
                except Exception as e:  # stay inline
                    log.warning("shared memory stays off: %s", e)
                return
