"""RMSNorm, optionally fused with the residual add that precedes it (Llama layout).

With ``residual``: ``x = x + residual``; returns ``(rms_norm(x) * weight, x)`` so the caller keeps ``x`` as the
next residual. Without: returns ``(rms_norm(x) * weight, None)``. Statistics in fp32. With ``rows``, x is a table
and row t of the result normalises ``x[rows[t]]``: the gather and the norm in one kernel (EAGLE-3's
``input_layernorm(embed_tokens[ids])``, on every forward).
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
    rows: torch.Tensor | None = None,  # [T] int: row t normalises x[rows[t]] (x a table, e.g. [V, H] embeddings)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if rows is not None:
        x = x[rows]
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
# Inputs:  x, residual [T, H] (unit stride on H); weight [H]. With rows [T] (int64), x is a table [V, H] and row t
#          reads x[rows[t]]: an embedding gather fused into its norm (EAGLE-3's input_layernorm(embed(x))).
# Writes:  out [T, H] (all of it); with residual also residual_out [T, H] = x + residual (all of it).
# Grid:    (T,): one program normalises one row held whole in registers (BLOCK_H = next_pow2(H)).
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, rows_ptr,
    x_stride, residual_stride, out_stride, residual_out_stride, rows_stride,
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    if HAS_ROWS:
        src = tl.load(rows_ptr + row * rows_stride).to(tl.int64)
    else:
        src = row
    x = tl.load(x_ptr + src * x_stride + cols, mask=mask, other=0.0)
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
    rows: torch.Tensor | None = None,  # [T] int32/int64 rows of x (a table [V, H]), any stride; each in [0, V)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden_size = x.shape[1]
    num_rows = x.shape[0] if rows is None else rows.shape[0]
    assert weight.shape == (hidden_size,) and x.stride(1) == 1 and weight.is_contiguous()
    assert rows is None or (rows.dim() == 1 and rows.dtype in (torch.int32, torch.int64))
    shape = (num_rows, hidden_size)
    out = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    if residual is not None:
        assert residual.shape == shape and residual.stride(1) == 1
        residual_out = torch.empty(shape, dtype=x.dtype, device=x.device) if residual_out is None else residual_out
    assert out.shape == shape and out.stride(1) == 1
    if num_rows == 0:
        return out, residual_out if residual is not None else None
    block_h = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, residual_out if residual is not None else out,
        rows if rows is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), residual_out.stride(0) if residual is not None else 0, rows.stride(0) if rows is not None else 0,
        hidden_size, eps,
        HAS_RESIDUAL=residual is not None, HAS_ROWS=rows is not None, BLOCK_H=block_h,
        num_warps=4 if block_h <= 2048 else 8,
    )
    return out, (residual_out if residual is not None else None)
