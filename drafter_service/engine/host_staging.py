"""A step's target hidden states, from host memory to the device: the rows of many tensors, as one device tensor.

The states arrive on the host (decoded from a request, or the engine's own CPU tensors) as one tensor per
sequence, or one for the whole batch. On CUDA they are concatenated into a pinned buffer (from torch's caching host
allocator) and copied to the device with a non_blocking copy. At serving batch sizes that concatenation is one of
the largest host costs of a step (EAGLE-3 at batch 256, m = 3: 768 rows x 12288 bf16 columns = 18.9 MB, 1.96 ms
with its copy on the H200 VM), and the device waits for it.

With STAGING_THREADS > 1 a large one is split by rows over that many threads (torch releases the GIL while it
copies), each part's host->device copy is queued as soon as that part is in pinned memory, and the step thread
builds the step's metadata meanwhile (start_rows_to_device). The default is 1 (the cat on the step thread, as
before): on the H200 VM 2-8 threads were slower (STAGING_THREADS says by how much); benchmarks/bench_staging.py
measures it on another host.

The caching host allocator keeps the pinned block until every copy queued from it has completed, so a later step
never overwrites rows still in flight.

A step-channel request of 1 MiB or more is read out of the mailbox into pinned memory on CUDA (pinned_bytes); its
inline states are a view of it, sliced per sequence. Such rows (one_block) go to the device with one DMA, with no
cat at all.
"""
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

# threads that fill the pinned buffer of a large step. 1 (no fill thread, the cat on the step thread): on the H200
# VM (16 vCPUs, 2026-11-25, benchmarks/bench_staging.py, docs/performance.md) 2, 4 and 8 threads were slower than one
# for 3-19 MB (e.g. 6.3 MB: 0.84 ms with one, 1.47 / 1.78 / 2.40 ms with 2 / 4 / 8), while on the 2-vCPU dev VM two
# threads filled 19 MB of pageable memory in 0.85 ms against 1.32 for one. Measure before raising it.
STAGING_THREADS = 1
PARALLEL_BYTES = 1 << 20  # below this one thread copies: a hand-off to the pool costs more than it saves


@functools.lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="drafter-staging")


def _fill(chunk: list[torch.Tensor], out: torch.Tensor) -> None:
    # (inference mode is per thread: the step's pinned buffer is an inference tensor, which only a thread in
    # inference mode may write into; a normal tensor may be written in inference mode too)
    with torch.inference_mode():
        torch.cat(chunk, out=out)


def row_chunks(tensors: list[torch.Tensor], bounds: list[int]) -> list[list[torch.Tensor]]:
    """The rows of the concatenated tensors cut at bounds (0 = bounds[0] < ... < bounds[-1] = total rows): for
    chunk c, the views (of the given tensors, no copy) that hold rows bounds[c] .. bounds[c+1] - 1, in order."""
    chunks: list[list[torch.Tensor]] = [[] for _ in bounds[:-1]]
    c, start = 0, 0
    for t in tensors:
        end, r = start + t.shape[0], start
        while r < end:
            while bounds[c + 1] <= r:
                c += 1
            stop = min(end, bounds[c + 1])
            chunks[c].append(t[r - start : stop - start])
            r = stop
        start = end
    return chunks


def pinned_bytes(n: int) -> memoryview:
    """A writable buffer of n bytes of pinned host memory from torch's caching host allocator (the step channels
    read a large request into one: step_channels.ChannelSet.read_buffer)."""
    return memoryview(torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy())


def one_block(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one view when they are consecutive row ranges of one memory block (the steps of a request
    whose states were read as one tensor, sliced per sequence): contiguous, alike in dtype and row shape, each
    starting where the one before it ends. None otherwise."""
    first = tensors[0]
    row_shape, dtype = first.shape[1:], first.dtype
    at = first.data_ptr()
    rows = 0
    for t in tensors:
        if t.dtype != dtype or t.shape[1:] != row_shape or t.data_ptr() != at or not t.is_contiguous():
            return None
        at += t.numel() * t.element_size()
        rows += t.shape[0]
    if first.untyped_storage().data_ptr() != tensors[-1].untyped_storage().data_ptr():  # (one allocation)
        return None
    shape = (rows, *row_shape)
    return torch.as_strided(first, shape, torch.empty(shape, device="meta").stride())


def rows_to_device(tensors: list[torch.Tensor], device: torch.device, threads: int | None = None,
                   pin: bool = True) -> torch.Tensor:
    """torch.cat(tensors) on the device (tensors: [m_i, ...] with equal trailing shapes; dtypes promoted as cat
    does). CPU tensors to a CUDA device go through pinned memory as the module says; anything else is a plain cat.
    threads: fill threads for a large step (default STAGING_THREADS); pin=False (tests on a CPU-only torch) stages
    in pageable memory and copies with the same chunking."""
    return start_rows_to_device(tensors, device, threads, pin)()


def start_rows_to_device(tensors: list[torch.Tensor], device: torch.device, threads: int | None = None,
                         pin: bool = True) -> Callable[[], torch.Tensor]:
    """rows_to_device in two halves: the fill threads start now, and the returned function waits for them, queues
    the parts' copies and returns the device tensor. The caller's thread works in between (the step's metadata):
    it must call the function before the step uses the rows."""
    on_host = all(t.device.type == "cpu" for t in tensors)
    if not on_host or (device.type != "cuda" and pin):
        out = torch.cat([t.to(device, non_blocking=True) for t in tensors])  # CPU; or already on the device (shm)
        return lambda: out
    if device.type == "cuda":
        block = one_block(tensors)
        if block is not None and block.is_pinned():  # (a step-channel request read into pinned memory)
            # (a view made by torch.frombuffer carries no allocator context, so no event guards its block: the
            # step synchronizes before it returns, and its request, which holds the block, is dropped only then)
            out = block.to(device, non_blocking=True)
            return lambda: out
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows, *tensors[0].shape[1:])
    host = torch.empty(shape, dtype=dtype, pin_memory=pin)
    threads = STAGING_THREADS if threads is None else threads
    row_bytes = host[:1].numel() * host.element_size()
    parts = max(1, min(threads, rows, rows * row_bytes // PARALLEL_BYTES))
    if parts == 1:
        torch.cat(tensors, out=host)
        out = host.to(device, non_blocking=True)
        return lambda: out
    bounds = [rows * c // parts for c in range(parts + 1)]
    pool = _pool(threads)
    filled = [pool.submit(_fill, chunk, host[a:b]) for chunk, a, b in zip(row_chunks(tensors, bounds), bounds, bounds[1:])]

    def finish() -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        for fill, a, b in zip(filled, bounds, bounds[1:]):  # in order: part c's transfer overlaps part c+1's fill
            fill.result()
            out[a:b].copy_(host[a:b], non_blocking=True)
        return out

    return finish
