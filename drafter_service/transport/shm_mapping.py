"""Mapping a client's shared-memory region into the server, once, read-only.

Two kinds:
  SYSTEM    a POSIX shared-memory object (/dev/shm/KEY): opened O_RDONLY|O_NOFOLLOW, must be a regular file,
            mmap'ed PROT_READ (the server can never write the client's memory). On a CUDA server the mapping is
            page-locked (cuMemHostRegister, read-only) so that the host-to-device copy into the staging buffer
            runs at full speed; if the driver refuses, the copy still works from pageable memory (pinned=False).
  CUDA_IPC  device memory another process exported (cuIpcGetMemHandle): opened with cuIpcOpenMemHandle in the
            server device's context (same GPU or a peer GPU of this node); its size comes from the driver
            (cuMemGetAddressRange), never from the client.

A Mapping says where the bytes are (a uint8 tensor over them), what object they belong to (identity: one
namespace per object) and how to unmap. Errors are RequestErrors naming the request field.
"""
import logging
import mmap
import os
import re
import stat
from dataclasses import dataclass
from typing import Callable

import grpc
import torch

from drafter_service.transport.validation import RequestError, invalid

log = logging.getLogger(__name__)

KEY_RE = re.compile(r"/?[A-Za-z0-9._-]{1,200}")


@dataclass
class Mapping:
    source: torch.Tensor | None  # uint8 [byte_size]: the region's bytes (host mapping or device memory)
    device: torch.device  # where the bytes live
    identity: tuple  # ("system", st_dev, st_ino) or ("cuda", handle): the object behind the region
    pinned: bool
    check_still_valid: Callable[[], None]  # raises RequestError if the object shrank under the mapping
    _close: Callable[[], None]

    def close(self) -> None:
        self.source = None
        self._close()


def open_system(key: str, offset: int, byte_size: int, shm_dir: str, pin_device: torch.device | None,
                check_identity: Callable[[tuple], None]) -> Mapping:
    f = "system.key"
    name = key.removeprefix("/")
    if not KEY_RE.fullmatch(key) or name in (".", ".."):
        raise invalid(f"{f} {key!r} is not a shared-memory object name (letters, digits, '.', '_', '-'; "
                      "one leading '/')")
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"{f} {key!r}: no such shared-memory object on the drafter's node ({shm_dir}); a drafter "
                           "on another node, or in a container that does not share /dev/shm, cannot map it: send "
                           "tensors inline") from None
    except PermissionError:
        raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                           f"{f} {key!r}: the drafter's user may not read it (create it readable by the drafter's "
                           "uid or group)") from None
    except OSError as e:  # ELOOP: a symbolic link
        raise invalid(f"{f} {key!r} cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise invalid(f"{f} {key!r} is not a regular shared-memory object")
        end = offset + byte_size
        if end > st.st_size:
            raise invalid(f"system.offset {offset} + byte_size {byte_size} = {end} exceeds the {st.st_size} bytes "
                          f"of shared-memory object {key!r}")
        identity = ("system", st.st_dev, st.st_ino)
        check_identity(identity)
        try:
            mm = mmap.mmap(fd, end, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as e:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{f} {key!r} cannot be mapped: {e.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # read-only buffer: never written
    pinned = False
    if pin_device is not None and pin_device.type == "cuda":
        from drafter_client.protocol import cuda_driver

        try:
            cuda_driver.host_register(pin_device.index or 0, whole.data_ptr(), end, read_only=True)
            pinned = True
        except cuda_driver.CudaDriverError as e:
            log.warning("region on %r stays pageable (host-to-device copies at lower speed): %s", key, e)

    def still_valid() -> None:
        size = os.fstat(fd).st_size
        if size < end:  # touching pages past the end of the object would raise SIGBUS
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"shared-memory object {key!r} shrank to {size} bytes under its registered region "
                               f"(needs {end}); unregister and register it again")

    def close() -> None:
        nonlocal whole
        if pinned:
            from drafter_client.protocol import cuda_driver

            try:
                cuda_driver.host_unregister(pin_device.index or 0, whole.data_ptr())
            except cuda_driver.CudaDriverError as e:
                log.warning("cuMemHostUnregister on %r: %s", key, e)
        whole = None
        try:
            mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes when it is collected
            log.warning("mapping of %r still referenced; it is unmapped when collected", key)
        os.close(fd)

    return Mapping(source=whole[offset:end], device=torch.device("cpu"), identity=identity, pinned=pinned,
                   check_still_valid=still_valid, _close=close)


def open_cuda(handle: bytes, offset: int, byte_size: int, server_device: torch.device,
              check_identity: Callable[[tuple], None]) -> Mapping:
    if server_device.type != "cuda":
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"cuda: this drafter runs on {server_device}; CUDA IPC regions need a drafter on a GPU "
                           "(GetInfo.shared_memory_kinds); register host shared memory instead")
    from drafter_client.protocol import cuda_driver

    if len(handle) != cuda_driver.IPC_HANDLE_BYTES:
        raise invalid(f"cuda.ipc_handle has {len(handle)} bytes; a cudaIpcMemHandle_t has "
                      f"{cuda_driver.IPC_HANDLE_BYTES}")
    identity = ("cuda", bytes(handle))
    check_identity(identity)
    dev = server_device.index if server_device.index is not None else torch.cuda.current_device()
    try:
        ptr, available, ordinal = cuda_driver.ipc_open(dev, handle)
    except cuda_driver.CudaDriverError as e:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"cuda.ipc_handle cannot be opened on the drafter's {server_device}: {e} (the handle must "
                           "come from a live allocation on a GPU of this node that the drafter can see)") from None
    end = offset + byte_size
    if end > available:
        cuda_driver.ipc_close(dev, ptr)
        raise invalid(f"cuda.offset {offset} + byte_size {byte_size} = {end} exceeds the {available} bytes of the "
                      "exported allocation")
    try:
        source = cuda_driver.device_bytes(ptr + offset, byte_size, ordinal)
    except Exception as e:
        cuda_driver.ipc_close(dev, ptr)
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"cuda.ipc_handle: the opened memory on cuda:{ordinal} cannot be used: {e}") from None

    def close() -> None:
        try:
            cuda_driver.ipc_close(dev, ptr)
        except cuda_driver.CudaDriverError as e:
            log.warning("cuIpcCloseMemHandle: %s", e)

    return Mapping(source=source, device=torch.device("cuda", ordinal), identity=identity, pinned=False,
                   check_still_valid=lambda: None, _close=close)
