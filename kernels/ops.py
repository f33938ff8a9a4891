"""The one place that picks an implementation for each kernel; callers never choose.

Every op takes exactly the arguments of its ``*_ref`` function. It runs the Triton launcher when its first tensor
argument is on CUDA and triton imports, and the torch reference otherwise (CPU tensors, no triton), except
paged_attention, which on CPU runs paged_attention_batched (the same function for the whole batch at once; the
reference loops over sequences). ``DRAFTER_KERNELS=torch`` in the environment (read at each call) forces the
references everywhere.
"""
import functools
import os

import torch

from drafter_kernels._triton_shim import HAS_TRITON
from drafter_kernels.copy_expand_inputs import copy_and_expand_inputs_ref, copy_and_expand_inputs_triton
from drafter_kernels.draft_step import advance_draft_step_ref, advance_draft_step_triton
from drafter_kernels.kv_write import PADDING_SLOT_ID, write_kv_ref, write_kv_triton
from drafter_kernels.build_first_step import build_first_step_rows_ref, build_first_step_rows_triton
from drafter_kernels.build_packed_first_step import (build_packed_first_step_rows_ref,
                                                     build_packed_first_step_rows_triton)
from drafter_kernels.mask_finished_rows import mask_finished_rows_ref, mask_finished_rows_triton
from drafter_kernels.paged_attention import paged_attention_batched, paged_attention_ref, paged_attention_triton
from drafter_kernels.prepare_inputs_padded import prepare_inputs_padded_ref, prepare_inputs_padded_triton
from drafter_kernels.prepare_next_token_padded import prepare_next_token_padded_ref, prepare_next_token_padded_triton
from drafter_kernels.rms_norm import rms_norm_ref, rms_norm_triton
from drafter_kernels.rope import apply_rope_ref, apply_rope_triton
from drafter_kernels.sampling import argmax_ref, argmax_triton, gumbel_sample_ref, gumbel_sample_triton
from drafter_kernels.shift_and_cache import shift_and_cache_ref, shift_and_cache_triton, shift_cache_store_window
from drafter_kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton
from drafter_kernels.store_draft_step import store_draft_step_ref, store_draft_step_triton


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op whose first tensor argument is ``tensor`` runs its Triton kernel."""
    if os.environ.get("DRAFTER_KERNELS", "").strip().lower() == "torch":
        return False
    return HAS_TRITON and tensor.is_cuda


def _dispatch(reference, triton_launcher, cpu=None):
    """cpu: what runs where Triton does not (default: the reference; DRAFTER_KERNELS=torch: always the reference)."""
    @functools.wraps(reference)
    def op(*args, **kwargs):
        first_tensor = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        if use_triton(first_tensor):
            return triton_launcher(*args, **kwargs)
        if cpu is not None and os.environ.get("DRAFTER_KERNELS", "").strip().lower() != "torch":
            return cpu(*args, **kwargs)
        return reference(*args, **kwargs)

    op.reference = reference
    op.triton = triton_launcher
    return op


write_kv = _dispatch(write_kv_ref, write_kv_triton)
paged_attention = _dispatch(paged_attention_ref, paged_attention_triton, cpu=paged_attention_batched)
rms_norm = _dispatch(rms_norm_ref, rms_norm_triton)
silu_and_mul = _dispatch(silu_and_mul_ref, silu_and_mul_triton)
apply_rope = _dispatch(apply_rope_ref, apply_rope_triton)
argmax = _dispatch(argmax_ref, argmax_triton)
gumbel_sample = _dispatch(gumbel_sample_ref, gumbel_sample_triton)
copy_and_expand_inputs = _dispatch(copy_and_expand_inputs_ref, copy_and_expand_inputs_triton)
prepare_inputs_padded = _dispatch(prepare_inputs_padded_ref, prepare_inputs_padded_triton)
prepare_next_token_padded = _dispatch(prepare_next_token_padded_ref, prepare_next_token_padded_triton)
advance_draft_step = _dispatch(advance_draft_step_ref, advance_draft_step_triton)
build_first_step_rows = _dispatch(build_first_step_rows_ref, build_first_step_rows_triton)
build_packed_first_step_rows = _dispatch(build_packed_first_step_rows_ref, build_packed_first_step_rows_triton)
mask_finished_rows = _dispatch(mask_finished_rows_ref, mask_finished_rows_triton)
store_draft_step = _dispatch(store_draft_step_ref, store_draft_step_triton)
shift_and_cache = _dispatch(shift_and_cache_ref, shift_and_cache_triton)

__all__ = [
    "PADDING_SLOT_ID",
    "write_kv", "paged_attention", "rms_norm", "silu_and_mul", "apply_rope", "argmax", "gumbel_sample",
    "copy_and_expand_inputs", "prepare_inputs_padded", "prepare_next_token_padded", "advance_draft_step",
    "build_first_step_rows", "build_packed_first_step_rows", "mask_finished_rows", "store_draft_step",
    "shift_and_cache", "shift_cache_store_window",
    "use_triton",
]
