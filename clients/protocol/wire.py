"""Tensors on the wire: drafter.v1.Tensor <-> torch, raw little-endian row-major bytes (KServe v2 convention).

decode_tensor validates everything a client controls (dtype, rank, shape, byte length) before any tensor op,
and raises WireError naming the field.
"""
import array
import math
import sys
import warnings
from typing import Callable

import numpy as np
import torch

from drafter_client.protocol import pb

assert sys.byteorder == "little", "the wire format is little-endian; big-endian hosts are not supported"

# torch.frombuffer warns that `bytes` is read-only; decoded tensors are only ever read (and copied to the device).
warnings.filterwarnings("ignore", message="The given buffer is not writable")

TORCH_DTYPE = {
    pb.FLOAT32: torch.float32, pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16,
    pb.INT32: torch.int32, pb.INT64: torch.int64,
}
WIRE_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}
NUMPY_DTYPE = {pb.FLOAT32: np.float32, pb.INT32: np.int32, pb.INT64: np.int64}  # (decode_array; numpy has no bf16)


class WireError(ValueError):
    """A tensor field the server cannot accept; str(e) names the field."""


def dtype_name(code: int) -> str:
    return pb.DType.Name(code) if code in pb.DType.values() else str(code)


def decode_tensor(t: "pb.Tensor", field: str, allowed: tuple[int, ...], rank: int,
                  read_shm: Callable | None = None, raw: "memoryview | None" = None) -> torch.Tensor:
    """Inline bytes become a zero-copy view of the message; a shared-memory reference (Tensor.shm) is handed to
    read_shm(ref, field, dtype, shape), which checks it and returns the tensor (shm_regions.RegionTable.read).
    raw: the tensor's raw bytes when they were read apart from the message t (t then has dtype and shape only)."""
    shape = _checked_shape(t, field, allowed, rank)
    which = t.WhichOneof("data") if raw is None else "raw"
    dtype = TORCH_DTYPE[t.dtype]
    if which == "shm":
        if read_shm is None:
            raise _shm_refused(field)
        expected = math.prod(shape) * dtype.itemsize
        if t.shm.byte_size != expected:
            raise WireError(f"{field}.shm.byte_size is {t.shm.byte_size}; shape {shape} of {dtype_name(t.dtype)} "
                            f"needs {expected}")
        return read_shm(t.shm, field, dtype, shape)
    raw = _checked_raw(t, field, shape, dtype.itemsize, raw)
    if len(raw) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).view(shape)


def _checked_shape(t: "pb.Tensor", field: str, allowed: tuple[int, ...], rank: int) -> list[int]:
    """t's shape, once its dtype is one of allowed and its shape has rank dimensions, none negative."""
    if t.dtype not in allowed:
        raise WireError(f"{field}.dtype is {dtype_name(t.dtype)}; accepted: "
                        f"{', '.join(dtype_name(d) for d in allowed)}")
    shape = list(t.shape)
    if len(shape) != rank:
        raise WireError(f"{field}.shape is {shape}; expected {rank} dimensions")
    if any(d < 0 for d in shape):
        raise WireError(f"{field}.shape {shape} has a negative dimension")
    return shape


def _shm_refused(field: str) -> WireError:
    return WireError(f"{field}.shm: this server does not accept shared-memory references "
                     "(GetInfo.shared_memory_supported is false); send raw bytes")


def _checked_raw(t: "pb.Tensor", field: str, shape: list[int], itemsize: int,
                 raw: "bytes | memoryview | None" = None) -> "bytes | memoryview":
    """t's inline bytes (or raw, when they were read apart from t), once their length is what shape needs."""
    if raw is None:
        raw = t.raw if t.WhichOneof("data") == "raw" else b""
    expected = math.prod(shape) * itemsize
    if len(raw) != expected:
        raise WireError(f"{field}.raw has {len(raw)} bytes; shape {shape} of {dtype_name(t.dtype)} needs {expected}")
    return raw


def decode_array(t: "pb.Tensor", field: str, allowed: tuple[int, ...], rank: int) -> np.ndarray:
    """decode_tensor for a small inline tensor (a request's or a reply's per-sequence columns) as a read-only numpy view
    of the message's bytes: the same checks and messages, about a microsecond where a torch view costs several.
    allowed: FLOAT32, INT32 or INT64 only; a shared-memory reference is refused (as decode_tensor without read_shm)."""
    shape = _checked_shape(t, field, allowed, rank)
    if t.WhichOneof("data") == "shm":
        raise _shm_refused(field)
    dtype = np.dtype(NUMPY_DTYPE[t.dtype])
    return np.frombuffer(_checked_raw(t, field, shape, dtype.itemsize), dtype=dtype).reshape(shape)


# The encoders fill ``into`` (a Tensor field of the message being built, e.g. req.hidden_states) when given, else a
# new Tensor: filling the field in place spares an intermediate message and a CopyFrom of its bytes.


def _fill(into: "pb.Tensor | None", dtype: int, shape, raw: bytes) -> "pb.Tensor":
    t = pb.Tensor() if into is None else into
    t.dtype = dtype
    del t.shape[:]
    t.shape.extend(shape)
    t.raw = raw
    return t


def encode_int64s(values: list[int], into: "pb.Tensor | None" = None) -> "pb.Tensor":
    """A python list as an int64 [n] tensor message, without building a torch tensor (small replies)."""
    return _fill(into, pb.INT64, [len(values)], array.array("q", values).tobytes())


def encode_int32s(values: list[int], into: "pb.Tensor | None" = None) -> "pb.Tensor":
    """A python list as an int32 [n] tensor message (the reply's per-sequence columns)."""
    return _fill(into, pb.INT32, [len(values)], array.array("i", values).tobytes())


def encode_float32s(values: list[float], into: "pb.Tensor | None" = None) -> "pb.Tensor":
    return _fill(into, pb.FLOAT32, [len(values)], array.array("f", values).tobytes())


def varint(n: int) -> bytes:
    """A non-negative int as a protobuf varint."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tensor_field_head(field: int, dtype: int, shape, raw_len: int | None) -> bytes:
    """A Tensor field (number ``field`` of the message being written) by hand, up to its data: the key, the length,
    then Tensor{dtype (a DType number), shape, raw: raw_len bytes, which the caller writes right after}; raw_len
    None: no raw field. Lets a large tensor's bytes go into a message once, without protobuf's copy of them."""
    dims = b"".join(varint(d) for d in shape)
    head = (bytes([1 << 3]) + varint(dtype)  # dtype = 1 (varint)
            + bytes([2 << 3 | 2]) + varint(len(dims)) + dims)  # shape = 2 (packed int64)
    if raw_len is not None:
        head += bytes([3 << 3 | 2]) + varint(raw_len)  # raw = 3 (bytes)
    return bytes([field << 3 | 2]) + varint(len(head) + (raw_len or 0)) + head


def encode_tensor(x: torch.Tensor, into: "pb.Tensor | None" = None) -> "pb.Tensor":
    if x.dtype not in WIRE_DTYPE:
        raise TypeError(f"dtype {x.dtype} has no wire encoding")
    x = x.detach().contiguous().cpu()
    if x.dtype == torch.bfloat16:
        raw = x.view(torch.int16).numpy().tobytes()
    else:
        raw = x.numpy().tobytes()
    return _fill(into, WIRE_DTYPE[x.dtype], x.shape, raw)
