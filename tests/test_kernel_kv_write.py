"""write_kv: Triton kernel vs torch reference (poisoned caches; slot -1 skipped)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICE_DTYPES, is_poison, kernel_module, poisoned  # noqa: E402

kv_write = kernel_module("kv_write")


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size,num_blocks",
    [(7, 1, 64, 16, 6), (13, 4, 40, 32, 5), (1, 2, 80, 16, 3), (33, 3, 17, 16, 4)],
)
def test_write_kv_matches_reference(device, dtype, num_tokens, num_kv_heads, head_dim, block_size, num_blocks):
    gen = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    # K and V as non-contiguous views of one fused [T, 2 * Hkv, D] projection output, like a real QKV split.
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # distinct slots
    slots[torch.rand(num_tokens, generator=gen) < 0.3] = kv_write.PADDING_SLOT_ID
    slots = slots.to(device)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_ref, v_ref = poisoned(cache_shape, dtype, device), poisoned(cache_shape, dtype, device)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    kv_write.write_kv_ref(key, value, k_ref, v_ref, slots)
    kv_write.write_kv_triton(key, value, k_tri, v_tri, slots)

    num_written = int((slots != -1).sum()) * num_kv_heads * head_dim
    for ref, tri in ((k_ref, k_tri), (v_ref, v_tri)):
        assert int((~is_poison(ref)).sum()) == num_written  # the reference wrote exactly the kept slots
        torch.testing.assert_close(tri, ref, atol=0, rtol=0, equal_nan=True)  # a copy: bit-exact, same region


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES[:1])
def test_write_kv_all_padding_writes_nothing(device, dtype):
    key = torch.randn(4, 2, 32, device=device, dtype=dtype)
    k_cache, v_cache = poisoned((2, 16, 2, 32), dtype, device), poisoned((2, 16, 2, 32), dtype, device)
    kv_write.write_kv_triton(key, key, k_cache, v_cache, torch.full((4,), -1, device=device))
    assert is_poison(k_cache).all() and is_poison(v_cache).all()
