"""Write the K/V of new tokens into the paged cache.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``; a *slot* is
``block_id * block_size + offset_in_block``. A slot of ``PADDING_SLOT_ID`` (-1) means "do not write"
(padding rows of a CUDA-graph batch, or positions clamped at max_model_len).
"""
import torch

from drafter_kernels._triton_shim import tl, triton

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


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  key, value [T, Hkv, D] (any strides with unit stride on D); slot_mapping [T] int32/int64.
# Writes:  k_cache, v_cache [num_blocks, block_size, Hkv, D] at (slot // block_size, slot % block_size, :, :)
#          for every token t with slot_mapping[t] != -1; nothing else.
# Grid:    (T,): one program copies one token's [Hkv, D] rows of K and of V.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    cache_stride_block, cache_stride_offset, cache_stride_h,  # k_cache and v_cache share strides
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # PADDING_SLOT_ID
        return
    block_id = slot // block_size
    offset_in_block = slot % block_size

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    src_k = key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :]
    src_v = value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :]
    cache_offsets = block_id * cache_stride_block + offset_in_block * cache_stride_offset \
        + heads[:, None] * cache_stride_h + dims[None, :]
    k_rows = tl.load(src_k, mask=mask)
    v_rows = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, k_rows.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v_rows.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (written)
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (written)
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and slot_mapping.shape == (num_tokens,)
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
