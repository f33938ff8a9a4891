"""The one place that picks an implementation for each kernel: the torch reference on CPU tensors.

Triton kernels register here for CUDA tensors (see the kernels issue); callers never choose.
"""
from .kv_write import write_kv_ref as write_kv
from .paged_attention import paged_attention_ref as paged_attention
from .rms_norm import rms_norm_ref as rms_norm
from .rope import apply_rope_ref as apply_rope
from .sampling import argmax_ref as argmax

__all__ = ["write_kv", "paged_attention", "rms_norm", "apply_rope", "argmax"]
