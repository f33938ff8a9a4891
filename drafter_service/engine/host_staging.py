"""A step's target hidden states, from host memory to the device: the rows of many tensors, as one device tensor.

The states arrive on the host (decoded from a request, or the engine's own CPU tensors) as one tensor per
sequence, or one for the whole batch. On CUDA they are concatenated into a pinned buffer (from torch's caching host
allocator) and copied to the device with a non_blocking copy. At serving batch sizes that concatenation is one of
the largest host costs of a step (EAGLE-3 at batch 256, m = 3: 768 rows x 12288 bf16 columns = 18.9 MB, 1.96 ms
with its copy on the H200 VM), and the device waits for it. It runs on the step thread: splitting it over 2-8
threads was slower on the H200 VM (6.3 MB: 0.84 ms with one thread, 1.47 / 1.78 / 2.40 ms with 2 / 4 / 8;
benchmarks/bench_staging.py carries that variant and measures it on another host).

The caching host allocator keeps the pinned block until every copy queued from it has completed, so a later step
never overwrites rows still in flight.

A step channel's mailbox is registered as pinned memory on CUDA when the channel opens (pin_mapping), and a request
of 64 KiB or more is read in place, a view of the mailbox (where the registration failed: copied out of it into
pinned memory, pinned_bytes); a ProposeChunked upload is staged in pinned memory there. The inline states are a view
of it, sliced per sequence. Such rows (one_block) go to the device with one DMA, with no cat at all.
"""
import ctypes
import functools
import mmap
from typing import Callable

import torch

from drafter_client.messages import one_block  # (the client writes such rows in one copy, with the same test)


def pinned_bytes(n: int) -> memoryview:
    """A writable buffer of n bytes of pinned host memory from torch's caching host allocator (the step channels
    read a large request into one: step_channels.ChannelSet.read_buffer)."""
    return memoryview(torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy())


# A request's inline states from this size are copied into pinned memory where they are parsed (pinned_copy)
PIN_COPY_MIN_BYTES = 64 << 10


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """t copied into pinned host memory when it is a pageable CPU tensor of PIN_COPY_MIN_BYTES or more (a gRPC
    request's inline states, a view of the received message), else t itself. The server does it on the event loop's
    thread, which has just read those bytes, and the step then sends them to the device with one DMA; left to the
    step thread, the copy into pinned memory (rows_into) ran there cold: EAGLE-3 at batch 32 on an H200 took 472 us
    from its admission to its graph launches by unary gRPC against 160 through a step channel, whose states are
    pinned already (docs/performance.md, sixteenth session)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < PIN_COPY_MIN_BYTES or t.is_pinned():
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def pin_mapping(mm: mmap.mmap, device: torch.device) -> Callable[[], None]:
    """Register the whole mapping as pinned (page-locked) host memory for CUDA (cudaHostRegister, portable: for every
    device), so that a tensor over it is_pinned() and goes to the device in one DMA. Returns the function that
    undoes it (it waits for the device first: no copy from the mapping may still be in flight), to be called
    before the mapping is closed. Raises RuntimeError when CUDA refuses (the caller then copies instead)."""
    anchor = ctypes.c_char.from_buffer(mm)  # (only for the address: the export ends with this function)
    ptr, size = ctypes.addressof(anchor), len(mm)
    del anchor
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):  # (the caller may be another thread, whose current device is another GPU)
        err = cudart.cudaHostRegister(ptr, size, 1)  # cudaHostRegisterPortable
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed: {err}")

    def unpin() -> None:
        torch.cuda.synchronize(device)
        with torch.cuda.device(device):
            cudart.cudaHostUnregister(ptr)

    return unpin


def rows_to_device(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """torch.cat(tensors) on the device (tensors: [m_i, ...] with equal trailing shapes; dtypes promoted as cat
    does). CPU tensors to a CUDA device go through pinned memory as the module says; anything else is a plain cat."""
    if len(tensors) == 1 and tensors[0].device == device:  # (one tensor in place: a cat would copy it)
        return tensors[0]
    if device.type != "cuda" or any(t.device.type != "cpu" for t in tensors):  # CPU; or on a GPU already (shm)
        try:
            out = torch.cat(tensors)  # (one op: a .to() per tensor cost 0.1 ms more at batch 256 on the dev CPU)
        except RuntimeError:  # (on different devices: a batch merging inline steps with shared-memory ones)
            return torch.cat([t.to(device, non_blocking=True) for t in tensors])
        return out if out.device == device else out.to(device, non_blocking=True)
    block = one_block(tensors)
    if block is not None and block.is_pinned():  # (a step-channel request or an upload staged in pinned memory)
        # (a view made by torch.frombuffer carries no allocator context, so no event guards its block: the step
        # synchronizes before it returns, and its request, which holds the block, is dropped only then)
        return block.to(device, non_blocking=True)
    if _pinned_parts(tensors, device):  # (a merged batch of step-channel requests: a DMA from each mailbox)
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
        out = torch.empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), dtype=dtype, device=device)
        _copy_parts(tensors, out)
        return out
    return _pinned_cat(tensors).to(device, non_blocking=True)


def _pinned_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(tensors) of host tensors (dtypes promoted as cat does) into pinned memory from the caching host
    allocator, which keeps the block until every copy queued from it has completed."""
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    host = torch.empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), dtype=dtype, pin_memory=True)
    torch.cat(tensors, out=host)
    return host


MAX_DMA_PARTS = 16  # at most this many tensors go to the device one DMA each (a merged batch: one per request)


def _pinned_parts(tensors: list[torch.Tensor], device: torch.device) -> bool:
    """Whether each of a few tensors is in pinned host memory or on `device` already: each then goes to the
    device with one DMA of its own (no host copy); else they are concatenated into pinned memory first."""
    return len(tensors) <= MAX_DMA_PARTS and all(t.device == device or t.is_pinned() for t in tensors)


def _copy_parts(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """out = torch.cat(tensors), a non_blocking copy per tensor into its rows of out (the copy casts)."""
    at = 0
    for t in tensors:
        out[at : at + t.shape[0]].copy_(t, non_blocking=True)
        at += t.shape[0]


def rows_into(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """rows_to_device into a kept buffer: out (a tensor of the rows' concatenated shape, on the step's device, in
    any float dtype: the copy casts) = torch.cat(tensors). One copy where the rows are one block already on out's
    device or pinned (a step channel's mailbox, an upload staged in pinned memory, the engine's own device tensor);
    one cat for several tensors on out's device in its dtype; a copy each for a few tensors each pinned or on out's
    device (a merged batch's requests); host rows from pageable memory (a gRPC request's inline states, the engine's
    own CPU tensors) concatenated into pinned memory and copied into out with one DMA; otherwise rows_to_device
    first."""
    block = tensors[0] if len(tensors) == 1 else one_block(tensors)
    if block is not None and (block.device == out.device or block.is_pinned()):
        out.copy_(block, non_blocking=True)
    elif all(t.device == out.device and t.dtype == out.dtype for t in tensors):
        torch.cat(tensors, out=out)
    elif out.device.type == "cuda" and _pinned_parts(tensors, out.device):
        _copy_parts(tensors, out)  # (a merged batch of step-channel requests: a DMA from each mailbox)
    elif out.device.type == "cuda" and all(t.device.type == "cpu" for t in tensors):
        # (not through rows_to_device: that would land them in a device tensor of their own, then copy it into out)
        out.copy_(_pinned_cat(tensors), non_blocking=True)
    else:
        out.copy_(rows_to_device(tensors, out.device), non_blocking=True)
