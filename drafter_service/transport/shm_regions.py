"""Shared-memory regions the clients registered: names, owners, leases, reference checks and the one copy in.

Lifecycle (docs/shared_memory.md):
  RegisterSharedMemory    maps the region once (shm_mapping.py) under a server-wide name owned by the request's
                          namespace, with a lease.
  Tensor.shm in a request checks the reference (known region, same namespace, in bounds, size, alignment) and
                          copies the bytes once into a fresh staging tensor on the server's device (host-to-device
                          from the pinned mapping, or device-to-device/peer from the IPC buffer) before the request
                          is queued: nothing later reads the client's memory, so the client may reuse the slot as
                          soon as the reply arrived.
  Lease                   a region nobody renewed for lease_s (Register, SharedMemoryStatus of its namespace, a
                          reference to it) is unmapped by expire(), which the servicer calls every second: a client
                          that dies holding regions loses them within one lease.
  UnregisterSharedMemory  unmaps at once; so does the server's shutdown.

Register, unregister, status and the lease sweeper run on the event loop thread; reads run there (Propose) and on
the step thread (step-channel requests, step_channels.py). One lock serializes them (@_locked), so a region is
never unmapped in the middle of a copy.
"""
import functools
import logging
import math
import re
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from drafter_client.protocol import pb
from drafter_service.transport.shm_mapping import Mapping, open_cuda, open_system
from drafter_service.transport.validation import RequestError, check_namespace, invalid

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
OFFSET_ALIGNMENT = 8  # region starts: every tensor dtype's element size divides it


def _locked(method):
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


@dataclass
class ShmSettings:
    shm_dir: str  # where POSIX shared-memory objects live (/dev/shm on Linux)
    lease_s: float  # default lease
    max_lease_s: float
    max_regions_per_namespace: int
    max_bytes_per_namespace: int


@dataclass
class Region:
    name: str
    namespace: str
    kind: int  # pb.SYSTEM or pb.CUDA_IPC
    byte_size: int
    mapping: Mapping
    lease_s: float
    expires_at: float
    references_read: int = 0
    bytes_read: int = 0

    def to_pb(self, now: float) -> "pb.SharedMemoryRegion":
        return pb.SharedMemoryRegion(
            name=self.name, kind=self.kind, byte_size=self.byte_size, device=str(self.mapping.device),
            pinned=self.mapping.pinned, lease_seconds=math.ceil(self.lease_s),
            expires_in_seconds=max(0.0, self.expires_at - now), references_read=self.references_read,
            bytes_read=self.bytes_read)


class RegionTable:
    def __init__(self, device: torch.device, settings: ShmSettings, clock=time.monotonic):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device  # the server's device: where staging tensors go
        self.settings = settings
        self.clock = clock
        self.regions: dict[str, Region] = {}
        # totals for /metrics (metrics.py): references read, their bytes, the seconds spent checking + copying them,
        # regions whose lease expired (their client went away without unregistering)
        self.reads_total = 0
        self.read_bytes_total = 0
        self.read_seconds_total = 0.0
        self.expired_total = 0
        self._ingest_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.RLock()  # see the module docstring

    def kinds(self) -> list[int]:
        if self.device.type != "cuda":
            return [pb.SYSTEM]
        from drafter_client.protocol import cuda_driver

        return [pb.SYSTEM, pb.CUDA_IPC] if cuda_driver.available() else [pb.SYSTEM]

    # ---- register / unregister / status ----

    @_locked
    def register(self, req: "pb.RegisterSharedMemoryRequest") -> Region:
        s = self.settings
        check_namespace(req.namespace)
        if not NAME_RE.fullmatch(req.name):
            raise invalid(f"name {req.name!r}: 1 to 128 letters, digits, '.', '_', '-', ':'")
        if req.byte_size == 0:
            raise invalid("byte_size is 0; a region holds at least one byte")
        owner = self.regions.get(req.name)
        if owner is not None:
            whose = "this namespace: unregister it first" if owner.namespace == req.namespace else "another namespace"
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"name {req.name!r} is already registered by {whose}")
        mine = [r for r in self.regions.values() if r.namespace == req.namespace]
        if len(mine) >= s.max_regions_per_namespace:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"namespace {req.namespace!r} holds {len(mine)} regions; at most "
                               f"{s.max_regions_per_namespace}: unregister some first")
        held = sum(r.byte_size for r in mine)
        if held + req.byte_size > s.max_bytes_per_namespace:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"byte_size {req.byte_size}: namespace {req.namespace!r} would hold "
                               f"{held + req.byte_size} bytes of regions; at most {s.max_bytes_per_namespace}")

        def check_identity(identity: tuple) -> None:
            for r in self.regions.values():
                if r.mapping.identity == identity:
                    if r.namespace != req.namespace:
                        raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                                           f"{req.WhichOneof('source')}: this memory is registered by another "
                                           "namespace; a namespace maps only memory no other namespace holds")
                    raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                                       f"{req.WhichOneof('source')}: this memory is already registered as region "
                                       f"{r.name!r}; reference it with offsets")

        which = req.WhichOneof("source")
        if which == "system":
            offset = req.system.offset
            if offset % OFFSET_ALIGNMENT:
                raise invalid(f"system.offset {offset} is not a multiple of {OFFSET_ALIGNMENT}")
            mapping = open_system(req.system.key, offset, req.byte_size, s.shm_dir, self.device, check_identity)
            kind = pb.SYSTEM
        elif which == "cuda":
            offset = req.cuda.offset
            if offset % OFFSET_ALIGNMENT:
                raise invalid(f"cuda.offset {offset} is not a multiple of {OFFSET_ALIGNMENT}")
            mapping = open_cuda(req.cuda.ipc_handle, offset, req.byte_size, self.device, check_identity)
            kind = pb.CUDA_IPC
        else:
            raise invalid("source is not set: give system (a /dev/shm object) or cuda (an IPC handle)")
        lease = min(float(req.lease_seconds or s.lease_s), s.max_lease_s)
        region = Region(name=req.name, namespace=req.namespace, kind=kind, byte_size=req.byte_size,
                        mapping=mapping, lease_s=lease, expires_at=self.clock() + lease)
        self.regions[req.name] = region
        log.info("namespace %r registered %s region %r: %d bytes on %s%s, lease %.0fs", req.namespace,
                 pb.SharedMemoryKind.Name(kind), req.name, req.byte_size, mapping.device,
                 " (pinned)" if mapping.pinned else "", lease)
        return region

    def _owned(self, namespace: str, names: list[str]) -> tuple[list[Region], list[str]]:
        """The namespace's regions among names (all of its regions when names is empty), and the names not found."""
        if not names:
            return [r for r in self.regions.values() if r.namespace == namespace], []
        found, missing = [], []
        for i, name in enumerate(names):
            r = self.regions.get(name)
            if r is None:
                missing.append(name)
            elif r.namespace != namespace:
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                                   f"names[{i}] {name!r} belongs to another namespace")
            else:
                found.append(r)
        return found, missing

    @_locked
    def unregister(self, namespace: str, names: list[str]) -> tuple[list[str], list[str]]:
        check_namespace(namespace)
        found, missing = self._owned(namespace, names)
        for r in found:
            self._drop(r, "unregistered")
        return [r.name for r in found], missing

    @_locked
    def status(self, namespace: str, names: list[str]) -> list[Region]:
        """The namespace's regions, renewed (this is the client's heartbeat)."""
        check_namespace(namespace)
        found, _ = self._owned(namespace, names)
        now = self.clock()
        for r in found:
            r.expires_at = now + r.lease_s
        return found

    @_locked
    def expire(self) -> list[str]:
        now = self.clock()
        gone = [r for r in self.regions.values() if r.expires_at <= now]
        for r in gone:
            self._drop(r, f"lease of {r.lease_s:.0f}s expired (client gone?)")
        self.expired_total += len(gone)
        return [r.name for r in gone]

    @_locked
    def close_all(self) -> None:
        for r in list(self.regions.values()):
            self._drop(r, "server shutting down")

    def _drop(self, r: Region, why: str) -> None:
        del self.regions[r.name]
        r.mapping.close()
        log.info("region %r of namespace %r unmapped: %s", r.name, r.namespace, why)

    # ---- a tensor passed by reference ----

    @_locked
    def read(self, namespace: str, ref: "pb.SharedMemoryRef", field: str, dtype: torch.dtype, shape: list[int],
             to_host: bool = False) -> torch.Tensor:
        """Check the reference and copy its bytes once into a new tensor on the server's device (on the host when
        to_host). ref.byte_size was already checked against shape and dtype (wire.decode_tensor)."""
        t0 = time.perf_counter()
        out = self._read(namespace, ref, field, dtype, shape, to_host)
        self.reads_total += 1
        self.read_bytes_total += out.numel() * out.element_size()
        self.read_seconds_total += time.perf_counter() - t0
        return out

    def _read(self, namespace: str, ref: "pb.SharedMemoryRef", field: str, dtype: torch.dtype, shape: list[int],
              to_host: bool) -> torch.Tensor:
        r = self.regions.get(ref.region)
        if r is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND,
                               f"{field}.shm.region {ref.region!r} is not registered (never registered, unregistered, "
                               "or its lease expired)")
        if r.namespace != namespace:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"{field}.shm.region {ref.region!r} belongs to another namespace")
        itemsize = dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        if ref.offset % itemsize:
            raise invalid(f"{field}.shm.offset {ref.offset} is not a multiple of the {itemsize}-byte element size")
        if ref.offset + nbytes > r.byte_size:
            raise invalid(f"{field}.shm: offset {ref.offset} + byte_size {nbytes} = {ref.offset + nbytes} is past the "
                          f"end of region {ref.region!r} ({r.byte_size} bytes)")
        r.expires_at = self.clock() + r.lease_s
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        r.mapping.check_still_valid()
        src = r.mapping.source[ref.offset : ref.offset + nbytes].view(dtype).view(shape)
        target = torch.device("cpu") if to_host else self.device
        if target.type == "cpu" and src.is_cuda:
            raise invalid(f"{field}.shm: {field} must be inline or in host shared memory, not in a CUDA region")
        try:
            out = self._copy_in(src, target)
        except RuntimeError as e:  # e.g. a CUDA error reading another process's memory
            raise RequestError(grpc.StatusCode.INTERNAL,
                               f"{field}.shm: reading region {ref.region!r} failed: {e}") from None
        r.references_read += 1
        r.bytes_read += nbytes
        return out

    def _copy_in(self, src: torch.Tensor, target: torch.device) -> torch.Tensor:
        """The one copy: from the mapping (host or device) into a new tensor on target."""
        if target.type == "cpu":
            out = torch.empty(src.shape, dtype=src.dtype)
            out.copy_(src)
            return out
        # On a side stream (it overlaps a draft step running on the default stream), finished before we return.
        # The staging tensor is then used on the step thread's default stream: record_stream keeps the caching
        # allocator from handing its memory to the next ingest before that use is done.
        with torch.cuda.device(target), torch.cuda.stream(self._ingest_stream):
            out = torch.empty(src.shape, dtype=src.dtype, device=target)
            out.copy_(src, non_blocking=True)
        self._ingest_stream.synchronize()
        out.record_stream(torch.cuda.default_stream(target))
        return out
