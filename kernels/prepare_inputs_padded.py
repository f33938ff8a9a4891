"""Per request, the row to sample the first draft from and the number of rejected rows, without a host sync.

The target batch keeps every request's draft rows (accepted or not) so its shapes need not change. Request r
verified ``num_draft = cu_num_draft_tokens[r] - cu_num_draft_tokens[r - 1]`` drafts (inclusive cumsum, so the
first request's count is ``cu_num_draft_tokens[0]``) and kept ``valid_sampled_tokens_count[r]`` sampled tokens
(1 + accepted). Then ``num_rejected = num_draft + 1 - valid_count`` (0 when the request had no drafts) and the row
to sample from is its last row minus the rejected ones: ``query_start_loc[r + 1] - 1 - num_rejected``.
"""
import torch

from drafter_kernels._triton_shim import tl, triton


def prepare_inputs_padded_ref(
    cu_num_draft_tokens: torch.Tensor,  # [B] int32, inclusive cumulative sum of drafts per request
    valid_sampled_tokens_count: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    out_token_indices_to_sample: torch.Tensor,  # [B] int32 (written)
    out_num_rejected_tokens: torch.Tensor,  # [B] int32 (written)
) -> None:
    num_draft = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))
    num_rejected = torch.where(num_draft > 0, num_draft + 1 - valid_sampled_tokens_count, 0)
    out_num_rejected_tokens.copy_(num_rejected)
    out_token_indices_to_sample.copy_(query_start_loc[1:] - 1 - num_rejected)


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  cu_num_draft_tokens, valid_sampled_tokens_count [B]; query_start_loc [B + 1] (all int, contiguous).
# Writes:  out_token_indices_to_sample [B], out_num_rejected_tokens [B], every entry.
# Grid:    (cdiv(B, BLOCK),): one program handles BLOCK requests.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _prepare_inputs_padded_kernel(
    cu_num_draft_tokens_ptr, valid_sampled_tokens_count_ptr, query_start_loc_ptr,
    out_token_indices_to_sample_ptr, out_num_rejected_tokens_ptr,
    num_requests,
    BLOCK: tl.constexpr,
):
    requests = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = requests < num_requests
    cu_draft = tl.load(cu_num_draft_tokens_ptr + requests, mask=mask, other=0)
    cu_draft_before = tl.load(cu_num_draft_tokens_ptr + requests - 1, mask=mask & (requests > 0), other=0)
    num_draft = cu_draft - cu_draft_before
    valid_count = tl.load(valid_sampled_tokens_count_ptr + requests, mask=mask, other=0)
    num_rejected = tl.where(num_draft > 0, num_draft + 1 - valid_count, 0)
    last_row = tl.load(query_start_loc_ptr + requests + 1, mask=mask, other=0) - 1
    tl.store(out_num_rejected_tokens_ptr + requests,
             num_rejected.to(out_num_rejected_tokens_ptr.dtype.element_ty), mask=mask)
    tl.store(out_token_indices_to_sample_ptr + requests,
             (last_row - num_rejected).to(out_token_indices_to_sample_ptr.dtype.element_ty), mask=mask)


def prepare_inputs_padded_triton(
    cu_num_draft_tokens: torch.Tensor,  # [B] int32
    valid_sampled_tokens_count: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    out_token_indices_to_sample: torch.Tensor,  # [B] int32 (written)
    out_num_rejected_tokens: torch.Tensor,  # [B] int32 (written)
) -> None:
    num_requests = cu_num_draft_tokens.shape[0]
    tensors = (cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc,
               out_token_indices_to_sample, out_num_rejected_tokens)
    assert all(t.is_contiguous() for t in tensors) and query_start_loc.shape[0] >= num_requests + 1
    if num_requests == 0:
        return
    block = min(1024, triton.next_power_of_2(num_requests))
    _prepare_inputs_padded_kernel[(triton.cdiv(num_requests, block),)](*tensors, num_requests, BLOCK=block)
