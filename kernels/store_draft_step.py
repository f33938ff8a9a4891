"""Store a graphed draft step's result in the decode graphs' static buffers (engine/cuda_graphs.py), in one kernel.

After a draft step's argmax, for every row r of the (padded) batch, with c = column[0] (the graphs' draft column,
already advanced to this step's) and t = the row's draft in the target vocabulary (draft_ids[r] + d2t[draft_ids[r]]
for a head with a draft vocabulary, else draft_ids[r]):

  input_ids[r] = t                         the next step's input token
  drafts_out[r, c] = t                     the step's draft, collected once per engine step
  hidden[r, :] = head_out[r, :]            the next step's hidden input (sequential heads: the pre-norm output)
  hidden_steps[r, c, :] = head_out[r, :]   kept for pre-drafting's forced pass (engine/predraft.py)

(Before, the captured step ran this as six torch kernels: the d2t gather and add, two copies and two scatters at a
device-side column. With this one an EAGLE-3 step of the 8B shape takes 40-50 us less GPU time at batch 1-128 on an
H200: docs/performance.md, fourteenth session.)
"""
import torch

from drafter_kernels._triton_shim import tl, triton


def store_draft_step_ref(
    draft_ids: torch.Tensor,  # [bs] int64, draft vocabulary
    d2t: torch.Tensor | None,  # [V_draft] int64 offsets to the target vocabulary, or None (the same vocabulary)
    head_out: torch.Tensor,  # [bs, H]
    column: torch.Tensor,  # [1] int64 (device): the drafts_out / hidden_steps column to write
    input_ids: torch.Tensor,  # [bs] int64 (written)
    hidden: torch.Tensor,  # [bs, H] (written)
    drafts_out: torch.Tensor,  # [bs, K] int64 (column c written)
    hidden_steps: torch.Tensor,  # [bs, K, H] (column c written)
) -> None:
    bs, H = head_out.shape
    target = draft_ids if d2t is None else draft_ids + d2t[draft_ids]
    input_ids.copy_(target)
    hidden.copy_(head_out)
    drafts_out.scatter_(1, column.expand(bs, 1), target[:, None])
    hidden_steps.scatter_(1, column.view(1, 1, 1).expand(bs, 1, H), head_out[:, None].to(hidden_steps.dtype))


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  draft_ids [bs]; d2t [V_draft] (read only with HAS_D2T); head_out [bs, H] (unit stride on H); column [1].
# Writes:  input_ids [bs], drafts_out[:, c], hidden [bs, H], hidden_steps[:, c, :] (unit stride on H).
# Grid:    (bs, cdiv(H, BLOCK)): program (r, j) copies columns [j * BLOCK, (j + 1) * BLOCK) of row r's hidden output;
#          program (r, 0) also stores the row's token. Nothing a program writes is read by another.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["hidden_size", "head_out_stride", "hidden_stride", "drafts_out_stride",
                               "steps_row_stride", "steps_column_stride"])
def _store_draft_step_kernel(draft_ids_ptr, d2t_ptr, head_out_ptr, column_ptr, input_ids_ptr, hidden_ptr,
                             drafts_out_ptr, hidden_steps_ptr, hidden_size, head_out_stride, hidden_stride,
                             drafts_out_stride, steps_row_stride, steps_column_stride, HAS_D2T: tl.constexpr,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    column = tl.load(column_ptr)
    if part == 0:
        token = tl.load(draft_ids_ptr + row)
        if HAS_D2T:
            token += tl.load(d2t_ptr + token)
        tl.store(input_ids_ptr + row, token)
        tl.store(drafts_out_ptr + row * drafts_out_stride + column, token)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    inside = cols < hidden_size
    x = tl.load(head_out_ptr + row * head_out_stride + cols, mask=inside)
    tl.store(hidden_ptr + row * hidden_stride + cols, x.to(hidden_ptr.dtype.element_ty), mask=inside)
    steps = hidden_steps_ptr + row * steps_row_stride + column * steps_column_stride
    tl.store(steps + cols, x.to(hidden_steps_ptr.dtype.element_ty), mask=inside)


def store_draft_step_triton(
    draft_ids: torch.Tensor, d2t: torch.Tensor | None, head_out: torch.Tensor, column: torch.Tensor,
    input_ids: torch.Tensor, hidden: torch.Tensor, drafts_out: torch.Tensor, hidden_steps: torch.Tensor,
) -> None:
    bs, H = head_out.shape
    assert draft_ids.shape[0] == input_ids.shape[0] == hidden.shape[0] == drafts_out.shape[0] == bs
    assert hidden_steps.shape[0] == bs and hidden.shape[1] == hidden_steps.shape[2] == H
    assert head_out.stride(1) == 1 and hidden.stride(1) == 1 and hidden_steps.stride(2) == 1
    assert draft_ids.is_contiguous() and input_ids.is_contiguous() and drafts_out.stride(1) == 1
    if bs == 0:
        return
    block = 1024
    _store_draft_step_kernel[(bs, triton.cdiv(H, block))](
        draft_ids, draft_ids if d2t is None else d2t, head_out, column, input_ids, hidden, drafts_out, hidden_steps,
        H, head_out.stride(0), hidden.stride(0), drafts_out.stride(0), hidden_steps.stride(0), hidden_steps.stride(1),
        HAS_D2T=d2t is not None, BLOCK=block)
