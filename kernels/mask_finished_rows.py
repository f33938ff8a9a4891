"""Mask the rows of a padded decode step that draft nothing (cuda_graphs.py): padding rows and rows past their k.

For row r with ``steps_left[r] <= 0``: its KV slot becomes PADDING_SLOT_ID (no KV write), its seq_len 1 (attention
over one cached position), its input token 0 and its hidden input row zeros. Every row's ``steps_left`` then drops
by one. In place. (Before, the captured decode step ran this as six torch kernels: a compare, four masked fills and
a subtraction.)
"""
import torch

from drafter_kernels._triton_shim import tl, triton
from drafter_kernels.kv_write import PADDING_SLOT_ID


def mask_finished_rows_ref(
    steps_left: torch.Tensor,  # [bs] int32 (decremented)
    slot_mapping: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int32
    input_ids: torch.Tensor,  # [bs] int64
    hidden: torch.Tensor,  # [bs, H]
) -> None:
    finished = steps_left <= 0
    slot_mapping.masked_fill_(finished, PADDING_SLOT_ID)
    seq_lens.masked_fill_(finished, 1)
    input_ids.masked_fill_(finished, 0)
    hidden.masked_fill_(finished[:, None], 0)
    steps_left.sub_(1)


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  steps_left [bs]; hidden [bs, H] (unit stride on H).
# Writes:  steps_left [bs] (all); for finished rows only: slot_mapping, seq_lens, input_ids, hidden's row.
# Grid:    (bs,): one program per row (it reads its steps_left before it writes it: no other program reads it).
# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["hidden_size", "hidden_stride"])
def _mask_finished_rows_kernel(steps_left_ptr, slots_ptr, seq_lens_ptr, input_ids_ptr, hidden_ptr, hidden_size,
                               hidden_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    left = tl.load(steps_left_ptr + row)
    if left <= 0:
        tl.store(slots_ptr + row, tl.full((), -1, dtype=slots_ptr.dtype.element_ty))  # PADDING_SLOT_ID
        tl.store(seq_lens_ptr + row, tl.full((), 1, dtype=seq_lens_ptr.dtype.element_ty))
        tl.store(input_ids_ptr + row, tl.zeros((), dtype=input_ids_ptr.dtype.element_ty))
        cols = tl.arange(0, BLOCK)
        base = hidden_ptr + row.to(tl.int64) * hidden_stride
        for c in range(0, hidden_size, BLOCK):
            tl.store(base + c + cols, tl.zeros((BLOCK,), dtype=hidden_ptr.dtype.element_ty),
                     mask=c + cols < hidden_size)
    tl.store(steps_left_ptr + row, left - 1)


def mask_finished_rows_triton(
    steps_left: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, input_ids: torch.Tensor,
    hidden: torch.Tensor,
) -> None:
    bs = steps_left.shape[0]
    assert slot_mapping.shape[0] == seq_lens.shape[0] == input_ids.shape[0] == hidden.shape[0] == bs
    assert hidden.stride(1) == 1
    if bs == 0:
        return
    _mask_finished_rows_kernel[(bs,)](steps_left, slot_mapping, seq_lens, input_ids, hidden, hidden.shape[1],
                                      hidden.stride(0), BLOCK=1024)
