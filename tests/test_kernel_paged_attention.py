"""paged_attention: Triton prefill and decode kernels vs torch reference.

Caches are NaN everywhere except the context positions of the batch, so any read outside a sequence's context
(another block, a position past seq_len) turns the output into NaN. Output rows owned by no sequence stay NaN.
Tolerances: fp32 atol = rtol = 1e-5 (interpreter and CUDA with IEEE fp32 dots); bf16 relative norm error < 1e-2.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICE_DTYPES, assert_matches, is_poison, kernel_module, poisoned  # noqa: E402

attention = kernel_module("paged_attention")


def make_batch(q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence owns
    block_ids = torch.randperm(num_blocks, generator=gen)  # scattered, non-monotonic block tables
    block_tables = torch.full((len(ctx_lens), max(blocks_per_seq) + 2), 10**6, dtype=torch.int32)  # junk past use
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    next_block = 0
    for seq, (ctx, n_blocks) in enumerate(zip(ctx_lens, blocks_per_seq)):
        block_tables[seq, :n_blocks] = block_ids[next_block:next_block + n_blocks].int()
        next_block += n_blocks
        for pos in range(ctx):
            block, offset = int(block_tables[seq, pos // block_size]), pos % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    num_rows = int(query_start_loc[-1]) + 2  # two trailing padding rows owned by no sequence
    q = torch.randn(num_rows, num_q_heads, head_dim, generator=gen)
    on = dict(device=device)
    return (q.to(**on, dtype=dtype), k_cache.to(**on, dtype=dtype), v_cache.to(**on, dtype=dtype),
            block_tables.to(**on), torch.tensor(ctx_lens, dtype=torch.int32, **on), query_start_loc.to(**on))


CASES = {
    # name: (q_lens, ctx_lens, Hq, Hkv, head_dim, block_size)
    "mixed-gqa4-bs16": ([5, 1, 17, 0, 3], [40, 1, 17, 3, 35], 8, 2, 64, 16),
    "mixed-gqa1-bs32-d80": ([1, 33, 2], [1, 70, 35], 3, 3, 80, 32),
    "chunk-past-cached-gqa4-d40": ([20, 4], [64, 4], 4, 1, 40, 16),
}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pass_max_query_len", [True, False])
def test_prefill_matches_reference(device, dtype, case, pass_max_query_len):
    q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size = CASES[case]
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(
        q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=len(case))
    scale = head_dim**-0.5
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    expected = attention.paged_attention_ref(*args, out=poisoned(q.shape, dtype, device))
    actual = attention.paged_attention_triton(
        *args, max_query_len=max(q_lens) if pass_max_query_len else None, out=poisoned(q.shape, dtype, device))
    assert int(is_poison(expected).sum()) == (q.shape[0] - sum(q_lens)) * num_q_heads * head_dim
    assert_matches(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", [(8, 2, 64, 32), (3, 3, 40, 16)])
def test_decode_matches_reference(device, dtype, num_q_heads, num_kv_heads, head_dim, block_size):
    q_lens, ctx_lens = [1, 1, 0, 1, 1], [1, 77, 5, block_size, block_size + 1]
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(
        q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=head_dim)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 0.125)
    expected = attention.paged_attention_ref(*args, out=poisoned(q.shape, dtype, device))
    decoded = attention.paged_attention_triton(*args, max_query_len=1, out=poisoned(q.shape, dtype, device))
    assert_matches(decoded, expected, atol=1e-5, rtol=1e-5)
    via_prefill_kernel = attention.paged_attention_triton(*args, out=poisoned(q.shape, dtype, device))
    assert_matches(via_prefill_kernel, expected, atol=1e-5, rtol=1e-5)


def test_reference_single_row_attends_to_its_prefix_only():
    # Independent check of the reference's causal rule on a hand-built case: one sequence, 3 context positions,
    # the last 2 are queries; keys are one-hot so the output of row j is the mean of values 0..position(j).
    k_cache = torch.zeros(1, 16, 1, 4)
    v_cache = torch.zeros(1, 16, 1, 4)
    for pos in range(3):
        v_cache[0, pos, 0, pos] = 1.0  # value of position p = e_p; keys all zero -> uniform attention
    q = torch.zeros(2, 1, 4)
    out = attention.paged_attention_ref(q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32),
                                        torch.tensor([3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                                        1.0)
    torch.testing.assert_close(out[0, 0], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    torch.testing.assert_close(out[1, 0], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))
