"""Helpers for tests/test_kernel_*.py (imported by tests only; needs pytest).

Each test module sets ``TRITON_INTERPRET=1`` when there is no CUDA device *before* triton is imported, then loads
the kernel module through :func:`kernel_module`, which re-imports it so that its ``@triton.jit`` kernels are defined
in the current mode even if another test module imported ``drafter_kernels`` first.

Modes: without CUDA the Triton kernels run on CPU tensors under the interpreter (the ``cpu`` cases); with CUDA and
without TRITON_INTERPRET they are compiled and the ``gpu`` cases (marked ``@pytest.mark.gpu``) run on CUDA tensors.
"""
import importlib
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
HAS_CUDA = torch.cuda.is_available()

POISON_INT = -7777  # sentinel for integer outputs; float outputs are poisoned with NaN

_needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
_needs_compiled_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET,
                                          reason="needs a CUDA device and compiled Triton (TRITON_INTERPRET unset)")

# (device, dtype) cases: CPU fp32 under the interpreter; CUDA fp32 and bf16 compiled.
DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, marks=_needs_interpreter, id="cpu-fp32"),
    pytest.param("cuda", torch.float32, marks=[pytest.mark.gpu, _needs_compiled_cuda], id="cuda-fp32"),
    pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.gpu, _needs_compiled_cuda], id="cuda-bf16"),
]
# device-only cases, for the integer bookkeeping kernels
DEVICES = [
    pytest.param("cpu", marks=_needs_interpreter, id="cpu"),
    pytest.param("cuda", marks=[pytest.mark.gpu, _needs_compiled_cuda], id="cuda"),
]


def kernel_module(name: str):
    """``drafter_kernels.<name>``, (re)imported so its kernels match the current TRITON_INTERPRET."""
    return importlib.reload(importlib.import_module(f"drafter_kernels.{name}"))


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer whose every element is a value no kernel writes: NaN, or POISON_INT for integers."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    assert dtype != torch.bool, "poison bool outputs by running twice, once filled with False and once with True"
    return torch.full(shape, POISON_INT, dtype=dtype, device=device)


def is_poison(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.isnan() if tensor.dtype.is_floating_point else tensor == POISON_INT


def relative_norm_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp32 (the bf16 criterion)."""
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, bf16_rel: float = 1e-2):
    """Same poison pattern, and close values elsewhere: fp32 by atol/rtol, bf16 by relative norm error."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    unwritten = is_poison(expected)
    assert torch.equal(is_poison(actual), unwritten), "written region differs from the reference's"
    written_actual, written_expected = actual[~unwritten], expected[~unwritten]
    if expected.dtype == torch.bfloat16:
        assert relative_norm_error(written_actual, written_expected) < bf16_rel
    else:
        torch.testing.assert_close(written_actual, written_expected, atol=atol, rtol=rtol)
