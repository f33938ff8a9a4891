"""The client's half of the shared-memory data plane: a ring of slots in memory the drafter mapped once.

Backing stores (one region each):
  HostSegment  a POSIX shared-memory object /dev/shm/drafter-<random> (mode 0600), mapped read-write here. When
               the engine's tensors are on a GPU it is page-locked (cuMemHostRegister), so the one device-to-host
               copy into it runs at full speed. Once the drafter registered it, the client unlinks the name: no
               other process can open it any more, and a client that dies leaves no file behind (the memory
               lives until the drafter's lease on it runs out).
  CudaBuffer   one cuMemAlloc allocation on the engine's GPU, exported with cuIpcGetMemHandle (a whole
               allocation of its own: torch's caching allocator may use expandable segments, which IPC cannot
               export).

The ring: `num_slots` slots of `slot_bytes` (4 KiB aligned). acquire() takes a free slot, or None (the step is
too big, or every slot waits for a reply: the caller then sends inline); write() copies the step's hidden states
into it (the one copy of the client side) and returns the reference to send; release() gives the slot back once
the step's reply arrived (the drafter copies a reference's bytes before it answers). retire() takes a slot out of
use for good when a call ended without a reply from the drafter (it may still read the slot).
"""
import logging
import mmap
import os
import uuid
from collections import deque
from dataclasses import dataclass

import torch

from drafter_client.protocol import pb
from drafter_client.protocol.wire import WIRE_DTYPE

log = logging.getLogger(__name__)

SLOT_ALIGNMENT = 4096
SHM_DIR = "/dev/shm"


@dataclass
class SharedTensorRef:
    """A tensor the drafter reads from a registered region: pass it as ``hidden_states`` to propose()."""

    region: str
    offset: int  # bytes from the region's start
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def byte_size(self) -> int:
        """Bytes the referenced tensor spans in the region."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def to_pb(self) -> "pb.Tensor":
        """The protocol Tensor that carries this reference (a descriptor, no bytes)."""
        return pb.Tensor(dtype=WIRE_DTYPE[self.dtype], shape=list(self.shape),
                         shm=pb.SharedMemoryRef(region=self.region, offset=self.offset, byte_size=self.byte_size))


def align(n: int, to: int = SLOT_ALIGNMENT) -> int:
    """n rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


class HostSegment:
    """A POSIX shared-memory segment under /dev/shm, mapped read-write here (and pinned for a GPU when asked)."""
    kind = pb.SYSTEM

    def __init__(self, nbytes: int, pin_device: torch.device | None = None, shm_dir: str = SHM_DIR):
        self.nbytes = nbytes
        self.key = f"drafter-{uuid.uuid4().hex}"
        self.path = os.path.join(shm_dir, self.key)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes)  # MAP_SHARED, read-write
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.bytes: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.device = torch.device("cpu")
        self._pinned_on: int | None = None
        if pin_device is not None and pin_device.type == "cuda":
            from drafter_client.protocol import cuda_driver

            index = pin_device.index if pin_device.index is not None else torch.cuda.current_device()
            try:
                cuda_driver.host_register(index, self.bytes.data_ptr(), nbytes, read_only=False)
                self._pinned_on = index
            except cuda_driver.CudaDriverError as e:
                log.warning("shared-memory ring stays pageable (device-to-host copies at lower speed): %s", e)
        self._unlinked = False

    def register_request(self, name: str, namespace: str, lease_seconds: int) -> "pb.RegisterSharedMemoryRequest":
        """The RegisterSharedMemory request that lets the drafter map this segment."""
        return pb.RegisterSharedMemoryRequest(namespace=namespace, name=name, byte_size=self.nbytes,
                                              system=pb.SystemSharedMemory(key=self.key, offset=0),
                                              lease_seconds=lease_seconds)

    def registered(self) -> None:
        """The drafter holds its own mapping now: drop the name."""
        self.unlink()

    def unlink(self) -> None:
        """Remove the segment's name from /dev/shm (mappings stay valid)."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink, unpin and unmap the segment."""
        self.unlink()
        if self.bytes is None:
            return
        if self._pinned_on is not None:
            from drafter_client.protocol import cuda_driver

            try:
                cuda_driver.host_unregister(self._pinned_on, self.bytes.data_ptr())
            except cuda_driver.CudaDriverError as e:
                log.warning("cuMemHostUnregister: %s", e)
        self.bytes = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive: unmapped when it is collected
            pass


class CudaBuffer:
    """A cudaMalloc'd device buffer the drafter opens by CUDA IPC handle."""
    kind = pb.CUDA_IPC

    def __init__(self, nbytes: int, device: torch.device):
        from drafter_client.protocol import cuda_driver

        self.nbytes = nbytes
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        self.ptr = cuda_driver.mem_alloc(self.index, nbytes)
        try:
            self.handle = cuda_driver.ipc_get_handle(self.index, self.ptr)
            self.bytes: torch.Tensor | None = cuda_driver.device_bytes(self.ptr, nbytes, self.index)
        except BaseException:
            cuda_driver.mem_free(self.index, self.ptr)
            raise

    def register_request(self, name: str, namespace: str, lease_seconds: int) -> "pb.RegisterSharedMemoryRequest":
        """The RegisterSharedMemory request carrying this buffer's IPC handle."""
        return pb.RegisterSharedMemoryRequest(namespace=namespace, name=name, byte_size=self.nbytes,
                                              cuda=pb.CudaSharedMemory(ipc_handle=self.handle, offset=0,
                                                                       device_id=self.index),
                                              lease_seconds=lease_seconds)

    def registered(self) -> None:
        """Nothing to do: an IPC buffer has no name to drop."""
        pass

    def close(self) -> None:
        """Wait for pending copies on the device, then free the buffer."""
        if self.bytes is None:
            return
        from drafter_client.protocol import cuda_driver

        torch.cuda.synchronize(self.device)
        self.bytes = None
        cuda_driver.mem_free(self.index, self.ptr)


class SlotRing:
    """Fixed-size slots in one shared region: a step's hidden states are copied into a free slot and sent by
    reference; the slot is free again once the reply came (or retired when the call ended without one)."""
    def __init__(self, name: str, store: "HostSegment | CudaBuffer", slot_bytes: int, num_slots: int):
        self.name = name  # the region's name on the drafter
        self.store = store
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self.retired: set[int] = set()

    @classmethod
    def create(cls, kind: int, slot_bytes: int, num_slots: int, device: torch.device | None) -> "SlotRing":
        slot_bytes = align(slot_bytes)
        total = slot_bytes * num_slots
        if kind == pb.CUDA_IPC:
            store = CudaBuffer(total, device)
        else:
            store = HostSegment(total, pin_device=device)
        return cls(f"ring-{uuid.uuid4().hex}", store, slot_bytes, num_slots)

    @property
    def free_slots(self) -> int:
        """Slots free for the next step."""
        return len(self._free)

    def acquire(self, nbytes: int) -> int | None:
        """A free slot for nbytes, or None (too large for a slot, or every slot waits for its reply)."""
        if nbytes > self.slot_bytes or not self._free:
            return None
        return self._free.popleft()

    def release(self, slot: int) -> None:
        """The slot's call was answered: it may be reused."""
        self._free.append(slot)

    def retire(self, slot: int) -> None:
        """The slot's call ended without a reply (the drafter may still read it): never reuse it."""
        self.retired.add(slot)
        log.warning("shared-memory slot %d of %r retired: its call ended without a reply (%d of %d slots left)",
                    slot, self.name, self.num_slots - len(self.retired), self.num_slots)

    def write(self, slot: int, parts: list[torch.Tensor]) -> SharedTensorRef:
        """Copy parts (each [rows, W], one dtype) one after another into the slot: one cat on the slot's GPU when they
        are all there (an engine's per-sequence slices of its target's states; 128 copies cost 128 launches), else
        one copy per part."""
        dtype, width = parts[0].dtype, parts[0].shape[-1]
        rows = sum(p.shape[0] for p in parts)
        itemsize = dtype.itemsize
        offset = slot * self.slot_bytes
        dst = self.store.bytes[offset : offset + rows * width * itemsize].view(dtype).view(rows, width)
        if dst.is_cuda and all(p.device == dst.device and p.dtype == dtype for p in parts):
            torch.cat(parts, out=dst)  # (D2D into the IPC buffer: one kernel, not one launch per sequence)
        else:
            r = 0
            for p in parts:
                dst[r : r + p.shape[0]].copy_(p)  # D2H / H2H into the mapping (or D2D from another GPU)
                r += p.shape[0]
        if dst.is_cuda:  # device copies are asynchronous: done before the descriptor leaves
            torch.cuda.current_stream(dst.device).synchronize()
        return SharedTensorRef(self.name, offset, dtype, (rows, width))

    def close(self) -> None:
        """Free the region (host segment or CUDA buffer)."""
        self.store.close()
