"""RMSNorm, optionally fused with the residual add that precedes it (Llama layout).

With ``residual``: ``x = x + residual``; returns ``(rms_norm(x) * weight, x)`` so the caller keeps ``x`` as the
next residual. Without: returns ``(rms_norm(x) * weight, None)``. Statistics in fp32.
"""
import torch


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype), residual
