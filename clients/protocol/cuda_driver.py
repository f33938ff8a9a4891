"""The few CUDA driver-API calls the shared-memory data plane needs, through ctypes over libcuda.so.1.

Why the driver API and not torch: torch has no binding for cudaIpcGetMemHandle / cudaIpcOpenMemHandle of raw
allocations (its own CUDA IPC, `storage._share_cuda_()`, ships a torch-specific ref-counting file and event
with each tensor, so only another torch process can open it, and it trusts the size it is told), and a failed
runtime call such as `torch.cuda.cudart().cudaHostRegister` leaves an error in the runtime's per-thread
last-error slot that a later, unrelated torch kernel-launch check would report. The driver API returns every
error to its caller and nothing else; libcuda.so.1 is present wherever a CUDA device is, and the 64-byte IPC
handle it produces is the same one cudaIpcGetMemHandle gives, so an engine in any language can register memory.

Every call makes the device's primary context (the one the CUDA runtime, hence torch, uses) current on the
calling thread first. Nothing here is imported unless CUDA is in use.
"""
import ctypes
import threading

import torch

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_READ_ONLY = 0x08
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
IPC_HANDLE_BYTES = 64

CUdeviceptr = ctypes.c_uint64


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudaDriverError(RuntimeError):
    def __init__(self, call: str, code: int, text: str):
        super().__init__(f"{call} failed: CUDA driver error {code} ({text})")
        self.call, self.code = call, code


_lib = None
_lock = threading.Lock()
_contexts: dict[int, ctypes.c_void_p] = {}


def _load():
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            sig = {
                "cuInit": [ctypes.c_uint],
                "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
                "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
                "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
                "cuCtxSetCurrent": [ctypes.c_void_p],
                "cuMemAlloc_v2": [ctypes.POINTER(CUdeviceptr), ctypes.c_size_t],
                "cuMemFree_v2": [CUdeviceptr],
                "cuMemGetAddressRange_v2": [ctypes.POINTER(CUdeviceptr), ctypes.POINTER(ctypes.c_size_t), CUdeviceptr],
                "cuIpcGetMemHandle": [ctypes.POINTER(CUipcMemHandle), CUdeviceptr],
                "cuIpcOpenMemHandle_v2": [ctypes.POINTER(CUdeviceptr), CUipcMemHandle, ctypes.c_uint],
                "cuIpcCloseMemHandle": [CUdeviceptr],
                "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, CUdeviceptr],
                "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
                "cuMemHostUnregister": [ctypes.c_void_p],
            }
            for name, argtypes in sig.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            _check(lib, "cuInit", lib.cuInit(0))
            _lib = lib
    return _lib


def _check(lib, call: str, code: int) -> None:
    if code != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(code, ctypes.byref(text))
        raise CudaDriverError(call, code, (text.value or b"unknown").decode())


def _use_device(device: int):
    """Make device's primary context current on this thread; returns the library."""
    lib = _load()
    ctx = _contexts.get(device)
    if ctx is None:
        dev = ctypes.c_int()
        _check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device))
        ctx = ctypes.c_void_p()
        _check(lib, "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value))
        _contexts[device] = ctx
    _check(lib, "cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))
    return lib


def available() -> bool:
    try:
        _load()
        return True
    except (OSError, CudaDriverError):
        return False


# ---- device memory owned by this process ----

def mem_alloc(device: int, nbytes: int) -> int:
    """cuMemAlloc: a whole allocation of its own (IPC-exportable, unlike torch's expandable segments)."""
    lib = _use_device(device)
    ptr = CUdeviceptr()
    _check(lib, "cuMemAlloc", lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes))
    return ptr.value


def mem_free(device: int, ptr: int) -> None:
    lib = _use_device(device)
    _check(lib, "cuMemFree", lib.cuMemFree_v2(ptr))


def address_range(device: int, ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation that contains ptr."""
    lib = _use_device(device)
    base, size = CUdeviceptr(), ctypes.c_size_t()
    _check(lib, "cuMemGetAddressRange", lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr))
    return base.value, size.value


def ipc_get_handle(device: int, base_ptr: int) -> bytes:
    """The IPC handle of the allocation starting at base_ptr (pass an allocation's base, see address_range)."""
    lib = _use_device(device)
    h = CUipcMemHandle()
    _check(lib, "cuIpcGetMemHandle", lib.cuIpcGetMemHandle(ctypes.byref(h), base_ptr))
    return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)  # all 64 bytes (h.reserved stops at a NUL)


# ---- memory of another process, opened here ----

def ipc_open(device: int, handle: bytes) -> tuple[int, int, int]:
    """Open another process's allocation in device's context: (pointer, bytes from it to the allocation's end,
    the ordinal of the device whose context addresses it). Close the pointer with ipc_close.

    The allocation may live on another GPU of this node (peer access is enabled lazily): the driver then reports
    the opening device's ordinal (measured on 2 x H200: an allocation of cuda:1 opened from cuda:0 says 0), and
    copies from the pointer read the peer's memory over NVLink / PCIe."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    lib = _use_device(device)
    h = CUipcMemHandle()
    ctypes.memmove(ctypes.byref(h), handle, IPC_HANDLE_BYTES)
    ptr = CUdeviceptr()
    _check(lib, "cuIpcOpenMemHandle", lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h,
                                                                 CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
    try:
        base, size = address_range(device, ptr.value)
        ordinal = ctypes.c_int()
        _check(lib, "cuPointerGetAttribute", lib.cuPointerGetAttribute(
            ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr.value))
    except Exception:
        lib.cuIpcCloseMemHandle(ptr.value)
        raise
    return ptr.value, base + size - ptr.value, ordinal.value


def ipc_close(device: int, ptr: int) -> None:
    lib = _use_device(device)
    _check(lib, "cuIpcCloseMemHandle", lib.cuIpcCloseMemHandle(ptr))


# ---- page-locking host memory (a shared-memory mapping) ----

def host_register(device: int, ptr: int, nbytes: int, read_only: bool) -> None:
    flags = CU_MEMHOSTREGISTER_PORTABLE | (CU_MEMHOSTREGISTER_READ_ONLY if read_only else 0)
    lib = _use_device(device)
    _check(lib, "cuMemHostRegister", lib.cuMemHostRegister_v2(ptr, nbytes, flags))


def host_unregister(device: int, ptr: int) -> None:
    lib = _use_device(device)
    _check(lib, "cuMemHostUnregister", lib.cuMemHostUnregister(ptr))


# ---- a raw device pointer as a torch tensor ----

class _DeviceBytes:
    """Holds a device pointer for torch.as_tensor (the __cuda_array_interface__ protocol, version 3)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def device_bytes(ptr: int, nbytes: int, device: int) -> torch.Tensor:
    """A uint8 tensor [nbytes] over memory this module allocated or opened; it does not own the memory."""
    return torch.as_tensor(_DeviceBytes(ptr, nbytes), device=torch.device("cuda", device))
