"""silu_and_mul: Triton kernel vs torch reference (F.silu(gate) * up), including a strided input and widths that
are not a multiple of the block.

Tolerances: fp32 atol = rtol = 1e-5; bf16 relative norm error < 1e-2 (the kernel's exp may differ from torch's in
the last fp32 bit, which can move a rounded bf16 value by one unit)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICE_DTYPES, assert_matches, kernel_module, poisoned  # noqa: E402

silu_and_mul = kernel_module("silu_and_mul")


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("rows,half", [(1, 64), (5, 100), (3, 1030), (17, 33), (2, 14336)])
def test_silu_and_mul_matches_reference(device, dtype, rows, half):
    gen = torch.Generator().manual_seed(rows * half)
    x = (torch.randn(rows, 2 * half, generator=gen) * 4).to(device=device, dtype=dtype)

    def run(fn):
        out = poisoned((rows + 1, half), dtype, device)  # (the row past the end must stay unwritten)
        fn(x, out=out[:rows])
        return out

    expected, actual = run(silu_and_mul.silu_and_mul_ref), run(silu_and_mul.silu_and_mul_triton)
    assert not expected[:rows].isnan().any() and expected[rows].isnan().all()
    assert_matches(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES[:1])
def test_silu_and_mul_strided_input_and_allocated_output(device, dtype):
    """x a column slice of a wider tensor (row stride > 2I), the output allocated by the launcher."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 300, generator=gen).to(device=device, dtype=dtype)
    x = wide[:, 50:250]
    expected = silu_and_mul.silu_and_mul_ref(x)
    actual = silu_and_mul.silu_and_mul_triton(x)
    assert actual.shape == (6, 100)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
