"""RMSNorm, optionally fused with the residual add that precedes it (Llama layout).

With ``residual``: ``x = x + residual``; returns ``(rms_norm(x) * weight, x)`` so the caller keeps ``x`` as the
next residual. Without: returns ``(rms_norm(x) * weight, None)``. Statistics in fp32.
"""
import torch

from drafter_kernels._triton_shim import tl, triton


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
    *,
    out: torch.Tensor | None = None,  # [T, H]: written instead of a new tensor
    residual_out: torch.Tensor | None = None,  # [T, H]: receives x + residual instead of a new tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        x = x + residual
        residual = x if residual_out is None else residual_out.copy_(x)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    result = (normed * weight.float()).to(x.dtype)
    return (result if out is None else out.copy_(result)), residual


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  x, residual [T, H] (unit stride on H); weight [H].
# Writes:  out [T, H] (all of it); with residual also residual_out [T, H] = x + residual (all of it).
# Grid:    (T,): one program normalises one row held whole in registers (BLOCK_H = next_pow2(H)).
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    x_stride, residual_stride, out_stride, residual_out_stride,
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first, as torch's `x + residual` does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, x, mask=mask)
    x = x.to(tl.float32)
    mean_square = tl.sum(x * x, 0) / hidden_size
    normed = x * tl.rsqrt(mean_square + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
    *,
    out: torch.Tensor | None = None,  # [T, H]
    residual_out: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_rows, hidden_size = x.shape
    assert weight.shape == (hidden_size,) and x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x) if out is None else out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
    assert out.shape == x.shape and out.stride(1) == 1
    if num_rows == 0:
        return out, residual_out if residual is not None else None
    block_h = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, residual_out if residual is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), residual_out.stride(0) if residual is not None else 0,
        hidden_size, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_H=block_h,
        num_warps=4 if block_h <= 2048 else 8,
    )
    return out, (residual_out if residual is not None else None)
