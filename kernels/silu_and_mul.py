"""The gated activation of a Llama MLP: ``silu(gate) * up`` where gate_up = [gate | up] (one fused GEMM's output).

``x`` [T, 2I] holds gate in columns [0, I) and up in [I, 2I); the result is [T, I]. Rounded as torch rounds
``F.silu(gate) * up`` in the activation dtype: silu in fp32, rounded to the dtype, then the product in fp32,
rounded once more. The reference is that expression. On the GPU torch runs it as two elementwise kernels over the
strided column halves (the non-vectorized path, 7-17 us each at batch 128 on an H100); the kernel reads x once.
"""
import torch
import torch.nn.functional as F

from drafter_kernels._triton_shim import tl, triton


def silu_and_mul_ref(
    x: torch.Tensor,  # [T, 2I]
    *,
    out: torch.Tensor | None = None,  # [T, I]: written instead of a new tensor
) -> torch.Tensor:
    half = x.shape[1] // 2
    result = F.silu(x[:, :half]) * x[:, half:]
    return result if out is None else out.copy_(result)


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  x [T, 2I] (unit stride on columns).
# Writes:  out [T, I] (all of it).
# Grid:    (T, cdiv(I, BLOCK)): one program per row and BLOCK columns.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["x_stride", "out_stride", "half"])
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, half, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + half + cols, mask=mask, other=0.0).to(tl.float32)
    # silu rounded to the activation dtype first, as torch's F.silu(gate) returns it
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(
    x: torch.Tensor,  # [T, 2I]
    *,
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:
    rows, width = x.shape
    assert width % 2 == 0 and x.stride(1) == 1
    half = width // 2
    out = torch.empty(rows, half, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (rows, half) and out.stride(1) == 1 and out.dtype == x.dtype
    if rows == 0 or half == 0:
        return out
    block = min(1024, triton.next_power_of_2(half))
    _silu_and_mul_kernel[(rows, triton.cdiv(half, block))](
        x, out, x.stride(0), out.stride(0), half, BLOCK=block, num_warps=4)
    return out
