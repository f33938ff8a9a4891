"""Per request, the number of valid sampled tokens and the token the next draft round starts from, no host sync.

``sampled_token_ids[r]`` holds the tokens the rejection sampler emitted for request r (num_spec + 1 columns),
rejected ones as -1. A token is valid when ``0 <= token < vocab_size``. The next token is the valid token in the
highest column, or ``backup_next_token_ids[r]`` when none is valid or the request is discarded
(``discard_request_mask[r]``, e.g. a partial prefill); a discarded request counts 0 valid tokens.
"""
import torch

from drafter_kernels._triton_shim import tl, triton


def prepare_next_token_padded_ref(
    sampled_token_ids: torch.Tensor,  # [B, S] int, -1 = rejected
    discard_request_mask: torch.Tensor,  # [B] bool
    backup_next_token_ids: torch.Tensor,  # [B] int
    vocab_size: int,
    out_next_token_ids: torch.Tensor,  # [B] int (written)
    out_valid_sampled_tokens_count: torch.Tensor,  # [B] int32 (written)
) -> None:
    num_columns = sampled_token_ids.shape[1]
    is_valid = (sampled_token_ids >= 0) & (sampled_token_ids < vocab_size)  # [B, S]
    valid_count = is_valid.sum(dim=1)
    columns = torch.arange(num_columns, device=sampled_token_ids.device)
    last_valid_column = torch.where(is_valid, columns, -1).max(dim=1).values.clamp(min=0)  # [B]
    last_valid_token = sampled_token_ids.gather(1, last_valid_column[:, None]).squeeze(1)
    use_backup = discard_request_mask | (valid_count == 0)
    out_next_token_ids.copy_(torch.where(use_backup, backup_next_token_ids.to(last_valid_token.dtype), last_valid_token))
    out_valid_sampled_tokens_count.copy_(torch.where(discard_request_mask, 0, valid_count))


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  sampled_token_ids [B, S] (unit stride on S); discard_request_mask, backup_next_token_ids [B].
# Writes:  out_next_token_ids [B], out_valid_sampled_tokens_count [B], every entry.
# Grid:    (cdiv(B, BLOCK_R),): one program handles a [BLOCK_R, BLOCK_S] tile of requests x columns.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _prepare_next_token_padded_kernel(
    sampled_token_ids_ptr, sampled_stride, discard_request_mask_ptr, backup_next_token_ids_ptr,
    out_next_token_ids_ptr, out_valid_sampled_tokens_count_ptr,
    vocab_size, num_requests, num_columns,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    requests = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    columns = tl.arange(0, BLOCK_S)
    request_mask = requests < num_requests
    tile_mask = request_mask[:, None] & (columns[None, :] < num_columns)
    tokens = tl.load(sampled_token_ids_ptr + requests[:, None].to(tl.int64) * sampled_stride + columns[None, :],
                     mask=tile_mask, other=-1)
    is_valid = (tokens >= 0) & (tokens < vocab_size) & tile_mask
    valid_count = tl.sum(is_valid.to(tl.int32), 1)  # [BLOCK_R]
    last_valid_column = tl.max(tl.where(is_valid, columns[None, :], -1), 1)
    last_valid_token = tl.sum(tl.where(columns[None, :] == last_valid_column[:, None], tokens, 0), 1)

    is_discarded = tl.load(discard_request_mask_ptr + requests, mask=request_mask, other=0) != 0
    backup = tl.load(backup_next_token_ids_ptr + requests, mask=request_mask, other=0)
    use_backup = is_discarded | (valid_count == 0)
    next_token = tl.where(use_backup, backup.to(last_valid_token.dtype), last_valid_token)
    tl.store(out_next_token_ids_ptr + requests, next_token.to(out_next_token_ids_ptr.dtype.element_ty),
             mask=request_mask)
    tl.store(out_valid_sampled_tokens_count_ptr + requests,
             tl.where(is_discarded, 0, valid_count).to(out_valid_sampled_tokens_count_ptr.dtype.element_ty),
             mask=request_mask)


def prepare_next_token_padded_triton(
    sampled_token_ids: torch.Tensor,  # [B, S] int, -1 = rejected
    discard_request_mask: torch.Tensor,  # [B] bool
    backup_next_token_ids: torch.Tensor,  # [B] int
    vocab_size: int,
    out_next_token_ids: torch.Tensor,  # [B] int (written)
    out_valid_sampled_tokens_count: torch.Tensor,  # [B] int32 (written)
) -> None:
    num_requests, num_columns = sampled_token_ids.shape
    assert sampled_token_ids.stride(1) == 1
    assert all(t.is_contiguous() for t in (discard_request_mask, backup_next_token_ids, out_next_token_ids,
                                           out_valid_sampled_tokens_count))
    if num_requests == 0:
        return
    block_s = triton.next_power_of_2(num_columns)
    block_r = max(1, min(128, 4096 // block_s, triton.next_power_of_2(num_requests)))
    _prepare_next_token_padded_kernel[(triton.cdiv(num_requests, block_r),)](
        sampled_token_ids, sampled_token_ids.stride(0), discard_request_mask, backup_next_token_ids,
        out_next_token_ids, out_valid_sampled_tokens_count,
        vocab_size, num_requests, num_columns,
        BLOCK_R=block_r, BLOCK_S=block_s,
    )
