"""Write the K/V of new tokens into the paged cache.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``; a *slot* is
``block_id * block_size + offset_in_block``. A slot of ``PADDING_SLOT_ID`` (-1) means "do not write"
(padding rows of a CUDA-graph batch, or positions clamped at max_model_len).
"""
import torch

PADDING_SLOT_ID = -1


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (written)
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (written)
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    keep = slot_mapping != PADDING_SLOT_ID
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    assert slots.numel() == 0 or int(slots.max()) < k_flat.shape[0], "slot out of range"
    k_flat[slots] = key[keep].to(k_cache.dtype)
    v_flat[slots] = value[keep].to(v_cache.dtype)
