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
CUDA_DTYPES = [p for p in DEVICE_DTYPES if p.values[0] == "cuda"]


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
        pos = torch.arange(ctx)
        blocks, offsets = block_tables[seq, pos // block_size].long(), pos % block_size
        k_cache[blocks, offsets] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        v_cache[blocks, offsets] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
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
    without_max_query_len = attention.paged_attention_triton(*args, out=poisoned(q.shape, dtype, device))  # bound T
    assert_matches(without_max_query_len, expected, atol=1e-5, rtol=1e-5)


# Split-K ("flash decoding") paths, with the split count and KV tile forced: splits of several tiles with a short
# last one, more splits than tiles (empty splits), KV tiles smaller than a cache block (split boundaries inside a
# block) and larger (a tile gathers several blocks), GQA 1 / 4 / 6 (padded heads) / 8 / 80 (two head blocks),
# and short prefill rows whose causal windows end inside a split.
SPLIT_CASES = {
    # name: (q_lens, ctx_lens, Hq, Hkv, head_dim, block_size, block_n, num_splits)
    "decode-gqa4-b1-19tiles-7splits": ([1], [300], 8, 2, 64, 16, 16, 7),
    "decode-gqa1-boundary-inside-bs128": ([1, 1, 0, 1], [200, 129, 7, 1], 2, 2, 32, 128, 16, 5),
    "decode-gqa8-tile-spans-4-blocks": ([1, 1, 1], [64, 65, 190], 8, 1, 48, 16, 64, 4),
    "decode-gqa6-padded-heads-bs8": ([1, 0, 1], [37, 9, 100], 12, 2, 16, 8, 16, 3),
    "decode-gqa80-two-head-blocks": ([1, 1], [40, 3], 80, 1, 16, 16, 16, 3),
    "decode-more-splits-than-tiles": ([1, 1], [20, 5], 4, 1, 32, 16, 16, 16),
    "prefill-short-rows-split": ([3, 1, 0, 2, 4], [200, 50, 4, 2, 70], 8, 2, 64, 32, 16, 6),
    "prefill-gqa1-rows-past-splits": ([5, 3], [21, 3], 2, 2, 32, 16, 16, 4),
}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_paths_match_reference(device, dtype, case):
    q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, block_n, num_splits = SPLIT_CASES[case]
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(
        q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=len(case))
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, head_dim**-0.5)
    expected = attention.paged_attention_ref(*args, out=poisoned(q.shape, dtype, device))
    split = attention._paged_attention_launch(*args, max(q_lens), poisoned(q.shape, dtype, device),
                                              num_splits=num_splits, block_n=block_n)
    assert_matches(split, expected, atol=1e-5, rtol=1e-5)
    unsplit = attention._paged_attention_launch(*args, max(q_lens), poisoned(q.shape, dtype, device),
                                                num_splits=1, block_n=block_n)
    assert_matches(unsplit, expected, atol=1e-5, rtol=1e-5)


# Packed grid (one program per query tile of the batch, its sequence found by a binary search): uneven batches of a
# long prefill beside short rows, empty sequences at the start, the middle and the end (padding sequences of a
# first-step graph), a sequence whose query starts mid-tile, and two trailing rows owned by no sequence.
PACKED_CASES = {
    # name: (q_lens, ctx_lens, Hq, Hkv, head_dim, block_size)
    "prompt-beside-decodes-gqa4": ([3, 1, 40, 2, 3, 1], [50, 9, 40, 17, 100, 1], 8, 2, 64, 16),
    "empty-first-middle-last-gqa1": ([0, 5, 0, 70, 1, 0, 0], [3, 30, 1, 75, 64, 2, 1], 2, 2, 32, 16),
    "one-long-many-short-gqa6": ([1] * 9 + [37] + [2] * 5, [5 + 7 * i for i in range(15)], 12, 2, 16, 8),
}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_packed_grid_matches_reference(device, dtype, case):
    q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size = PACKED_CASES[case]
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(
        q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, device, dtype, seed=len(case) + 3)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, head_dim**-0.5)
    expected = attention.paged_attention_ref(*args, out=poisoned(q.shape, dtype, device))
    packed = attention._paged_attention_launch(*args, max(q_lens), poisoned(q.shape, dtype, device), packed=True)
    assert_matches(packed, expected, atol=1e-5, rtol=1e-5)  # (rows of no sequence stay poisoned in both)
    # the public launcher picks it by itself for these batches (fewer programs than B x cdiv(max_query_len, BLOCK_M))
    cfg = attention.attention_launch_config(len(q_lens), max(q_lens), num_q_heads, num_kv_heads, head_dim,
                                            block_tables.shape[1] * block_size, fp32=dtype == torch.float32)
    assert attention.packed_grid_programs(q.shape[0], len(q_lens), cfg) is not None
    assert_matches(attention.paged_attention_triton(*args, out=poisoned(q.shape, dtype, device)), expected,
                   atol=1e-5, rtol=1e-5)


def test_packed_grid_programs_cover_every_query_tile():
    """The numbering behind the packed grid: for random batches (empty sequences included) the first tiles
    qsl[i] // BLOCK_M + i grow strictly, each sequence's tiles end before the next one's first, and all of them are
    below T // BLOCK_M + B, the grid's size."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        B = int(torch.randint(1, 40, (1,), generator=gen))
        q_lens = torch.randint(0, 70, (B,), generator=gen) * (torch.rand(B, generator=gen) < 0.8)
        block_m = int(2 ** torch.randint(0, 7, (1,), generator=gen))
        qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
        first = qsl[:-1] // block_m + torch.arange(B)
        ends = first + (q_lens + block_m - 1) // block_m  # one past each sequence's last tile
        assert bool((first[1:] > first[:-1]).all()) and bool((ends[:-1] <= first[1:]).all())
        assert int(ends.max()) <= int(qsl[-1]) // block_m + B


@pytest.mark.parametrize("device,dtype", CUDA_DTYPES)
def test_packed_grid_replays_in_cuda_graph(device, dtype):
    """Captured once for T rows and B sequences, the packed grid serves any split of those rows: the sequences'
    query lengths (query_start_loc) and contexts change between replays, rows past qsl[B] belong to none."""
    q_lens, ctx_lens = [1, 30, 3, 0], [40, 30, 70, 5]
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(
        q_lens, ctx_lens, 8, 2, 64, 16, device, dtype, seed=11)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 0.125)
    out = poisoned(q.shape, dtype, device)
    attention._paged_attention_launch(*args, q.shape[0], out, packed=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention._paged_attention_launch(*args, q.shape[0], out, packed=True)
    # (each context within the positions make_batch filled for its sequence: 40, 30, 70 and 5)
    for lens, ctx in (([1, 30, 3, 0], [40, 30, 70, 5]), ([20, 1, 1, 4], [20, 30, 9, 5]), ([0, 0, 34, 0], [1, 1, 60, 1])):
        query_start_loc.copy_(torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32))
        seq_lens.copy_(torch.tensor(ctx, dtype=torch.int32))
        out.copy_(poisoned(q.shape, dtype, device))
        graph.replay()
        torch.cuda.synchronize()
        expected = attention.paged_attention_ref(*args, out=poisoned(q.shape, dtype, device))
        assert_matches(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 2), (4, 4)])
def test_decode_batch_33_default_config(device, dtype, num_q_heads, num_kv_heads):
    # The public launcher with its own split choice on an odd batch: contexts 1..150, a few empty sequences.
    gen = torch.Generator().manual_seed(33)
    ctx_lens = torch.randint(1, 151, (33,), generator=gen).tolist()
    q_lens = [0 if i % 11 == 5 else 1 for i in range(33)]
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(
        q_lens, ctx_lens, num_q_heads, num_kv_heads, 32, 16, device, dtype, seed=num_q_heads)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 0.2)
    cfg = attention.attention_launch_config(33, 1, num_q_heads, num_kv_heads, 32, block_tables.shape[1] * 16)
    assert cfg["num_splits"] > 1  # the split path is what this test is about
    expected = attention.paged_attention_ref(*args, out=poisoned(q.shape, dtype, device))
    actual = attention.paged_attention_triton(*args, max_query_len=1, out=poisoned(q.shape, dtype, device))
    assert_matches(actual, expected, atol=1e-5, rtol=1e-5)


def test_launch_config_from_shapes_only():
    config = attention.attention_launch_config
    # Llama-3-8B head (32 q / 8 KV heads, D 128), decode: the 4 heads of a group share a program (padded to the
    # 16 rows tl.dot needs), and batch 1 splits the context into enough programs to fill 132 SMs twice.
    llama_b1 = config(1, 1, 32, 8, 128, 8192)
    assert (llama_b1["block_m"], llama_b1["block_h"], llama_b1["head_blocks"], llama_b1["m_blocks"]) == (1, 16, 1, 1)
    assert llama_b1["num_splits"] * 8 >= 2 * attention.DEFAULT_SM_COUNT
    assert config(1, 1, 32, 8, 128, 1024)["num_splits"] == 1024 // 64  # one 64-position tile per split at most
    assert config(128, 1, 32, 8, 128, 1024)["num_splits"] == 1  # 1024 programs already
    assert config(1, 1, 32, 8, 128, 64)["num_splits"] == 1  # never more splits than tiles of the longest context
    assert config(1, 1, 32, 8, 128, 10**6)["num_splits"] <= attention.MAX_SPLITS
    # Short prefill (3 draft rows): 4 rows x 4 heads in one program, still split; long prefill: no split.
    short = config(1, 3, 32, 8, 128, 1024)
    assert (short["block_m"], short["block_h"], short["m_blocks"]) == (4, 4, 1) and short["num_splits"] > 1
    long = config(2, 500, 32, 8, 128, 1024)
    assert long["m_blocks"] > 1 and long["num_splits"] == 1 and long["block_m"] * long["block_h"] == 64
    assert config(1, 1, 128, 1, 64, 1024)["head_blocks"] == 2  # groups over 64 heads take several programs
    long_fp32 = config(2, 500, 32, 8, 128, 1024, fp32=True)  # IEEE FMA dots: smaller tiles, no register spills
    assert long_fp32["block_m"] * long_fp32["block_h"] == 32 and long_fp32["block_n"] == 16


@pytest.mark.parametrize("device,dtype", CUDA_DTYPES)
def test_split_decode_replays_in_cuda_graph(device, dtype):
    # The decode path (split + reduce, scratch allocated inside the capture) replays correctly with new seq_lens:
    # the grid and split count depend on shapes only, each split's range on the device-side seq_len.
    q_lens, ctx_lens = [1, 1, 1], [700, 17, 1]
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(
        q_lens, ctx_lens, 32, 8, 128, 16, device, dtype, seed=7)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 128**-0.5)
    out = poisoned(q.shape, dtype, device)
    attention.paged_attention_triton(*args, max_query_len=1, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention.paged_attention_triton(*args, max_query_len=1, out=out)
    for new_lens in ([700, 17, 1], [5, 16, 1], [333, 1, 1]):
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        expected = attention.paged_attention_ref(*args, out=poisoned(q.shape, dtype, device))
        assert_matches(out, expected, atol=1e-5, rtol=1e-5)


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


# ---- the CPU serving path: paged_attention_batched (the whole batch at once) vs the per-sequence reference ----

@pytest.mark.parametrize("case", list(CASES))
def test_batched_cpu_path_matches_reference(case):
    q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size = CASES[case]
    args = make_batch(q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, "cpu", torch.float32,
                      seed=len(case) + 7)
    expected = attention.paged_attention_ref(*args, 0.2, out=poisoned(args[0].shape, torch.float32, "cpu"))
    actual = attention.paged_attention_batched(*args, 0.2, out=poisoned(args[0].shape, torch.float32, "cpu"))
    assert_matches(actual, expected, atol=1e-5, rtol=1e-5)  # (rows of no sequence stay poisoned in both)
    assert torch.equal(is_poison(actual), is_poison(expected))


@pytest.mark.parametrize("seed", range(6))
def test_batched_cpu_path_matches_reference_on_random_batches(seed):
    g = torch.Generator().manual_seed(100 + seed)
    B = int(torch.randint(1, 40, (1,), generator=g))
    decode = seed % 2 == 0  # decode batches (q_len 0 or 1), else mixed prefill chunks
    q_lens = torch.randint(0, 2 if decode else 9, (B,), generator=g)
    ctx_lens = q_lens + torch.randint(0, 90, (B,), generator=g)
    ctx_lens = torch.maximum(ctx_lens, torch.ones_like(ctx_lens))
    num_kv_heads = int(torch.randint(1, 4, (1,), generator=g))
    args = make_batch(q_lens.tolist(), ctx_lens.tolist(), num_kv_heads * 2, num_kv_heads, 16, 16, "cpu",
                      torch.float32, seed=seed)
    expected = attention.paged_attention_ref(*args, 0.25, out=poisoned(args[0].shape, torch.float32, "cpu"))
    actual = attention.paged_attention_batched(*args, 0.25, out=poisoned(args[0].shape, torch.float32, "cpu"))
    assert_matches(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(is_poison(actual), is_poison(expected))


@pytest.mark.parametrize("seed", range(8))
def test_batched_cpu_path_matches_reference_for_one_sequence(seed):
    """One sequence (its own fused-attention path): decode rows and prefill chunks, GQA groups 1-3, NaN in every cache
    position outside its context, in the rest of the last block included."""
    g = torch.Generator().manual_seed(300 + seed)
    q_len = 1 if seed % 2 == 0 else int(torch.randint(2, 12, (1,), generator=g))
    ctx_len = q_len + int(torch.randint(0, 80, (1,), generator=g))
    num_kv_heads, group = int(torch.randint(1, 3, (1,), generator=g)), 1 + seed % 3
    args = make_batch([q_len], [ctx_len], num_kv_heads * group, num_kv_heads, 16, 16, "cpu", torch.float32, seed=seed)
    expected = attention.paged_attention_ref(*args, 0.25, out=poisoned(args[0].shape, torch.float32, "cpu"))
    actual = attention.paged_attention_batched(*args, 0.25, out=poisoned(args[0].shape, torch.float32, "cpu"))
    assert_matches(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(is_poison(actual), is_poison(expected))  # (the two padding rows untouched)


def test_batched_cpu_path_falls_back_to_the_loop_when_padding_dominates():
    # one long prefill beside short decodes: padding every sequence to it would be many times the work
    q_lens, ctx_lens = [1] * 16 + [200], [20] * 16 + [200]
    args = make_batch(q_lens, ctx_lens, 2, 1, 16, 16, "cpu", torch.float32, seed=3)
    expected = attention.paged_attention_ref(*args, 0.25, out=poisoned(args[0].shape, torch.float32, "cpu"))
    actual = attention.paged_attention_batched(*args, 0.25, out=poisoned(args[0].shape, torch.float32, "cpu"))
    assert_matches(actual, expected, atol=1e-5, rtol=1e-5)


def _growing_batch(seed: int, B: int, steps: int, block_size: int = 16, num_kv_heads: int = 2, head_dim: int = 16):
    """B sequences of random contexts in a NaN-poisoned pool, each with room (blocks in its table) for `steps` more
    positions: (k_cache, v_cache, block_tables, ctx, gen)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 70, (B,), generator=gen)
    per_seq = (-(-(ctx + steps) // block_size)).tolist()
    num_blocks = sum(per_seq) + 4
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((B, max(per_seq) + 1), 10**6, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = ids[used : used + n].int()
        used += n
        pos = torch.arange(int(ctx[b]))
        blocks, offsets = tables[b, pos // block_size].long(), pos % block_size
        k_cache[blocks, offsets] = torch.randn(len(pos), num_kv_heads, head_dim, generator=gen)
        v_cache[blocks, offsets] = torch.randn(len(pos), num_kv_heads, head_dim, generator=gen)
    return k_cache, v_cache, tables, ctx, gen


def _write_next_position(k_cache, v_cache, tables, ctx, gen, block_size: int = 16):
    """Every sequence's next position gets fresh K/V (what a decode step's write_kv does); returns ctx + 1."""
    b = torch.arange(len(ctx))
    blocks, offsets = tables[b, ctx // block_size].long(), ctx % block_size
    k_cache[blocks, offsets] = torch.randn(len(ctx), *k_cache.shape[2:], generator=gen)
    v_cache[blocks, offsets] = torch.randn(len(ctx), *v_cache.shape[2:], generator=gen)
    return ctx + 1


@pytest.mark.parametrize("seed", range(4))
def test_batched_cpu_path_reuses_the_gathered_context_across_decode_steps(seed):
    """The context_cache of one engine step: the first call gathers, the decode steps after it (one new position per
    sequence, written to the cache between calls, crossing block boundaries) re-gather only their newest blocks and
    still equal the reference, with NaN in every cache position not written yet."""
    B, steps = 9 + seed, 20
    k_cache, v_cache, tables, ctx, gen = _growing_batch(seed, B, steps)
    cache: dict = {}
    kept = None
    for step in range(steps):
        if step:
            ctx = _write_next_position(k_cache, v_cache, tables, ctx, gen)
        q = torch.randn(B, 4, 16, generator=gen)
        args = (q, k_cache, v_cache, tables, ctx.int(), torch.arange(B + 1, dtype=torch.int32), 0.25)
        expected = attention.paged_attention_ref(*args)
        actual = attention.paged_attention_batched(*args, context_cache=cache)
        assert_matches(actual, expected, atol=1e-5, rtol=1e-5)
        (entry,) = cache.values()
        assert kept is None or entry is kept  # refreshed in place, never gathered again
        kept = entry


@pytest.mark.parametrize("seed", range(3))
def test_batched_cpu_path_copies_uneven_growth_into_the_gathered_context(seed):
    """Calls sharing a context_cache where the sequences grow by different amounts between calls (none, one, several
    positions, across block boundaries; a pre-drafting loop's or a prefill chunk's pattern): the copy takes in just
    the new positions and still equals the reference, with NaN in every cache position not written yet."""
    B, rounds, most = 7 + seed, 6, 5
    k_cache, v_cache, tables, ctx, gen = _growing_batch(50 + seed, B, rounds * most)
    cache: dict = {}
    kept, refreshed = None, 0
    for step in range(rounds):
        grow = torch.randint(0, most + 1, (B,), generator=gen) if step else torch.zeros(B, dtype=torch.int64)
        for _ in range(int(grow.max()) if step else 0):  # write positions ctx .. ctx + grow - 1 of each sequence
            b = (grow > 0).nonzero().flatten()
            blocks, offsets = tables[b, ctx[b] // 16].long(), ctx[b] % 16
            k_cache[blocks, offsets] = torch.randn(len(b), *k_cache.shape[2:], generator=gen)
            v_cache[blocks, offsets] = torch.randn(len(b), *v_cache.shape[2:], generator=gen)
            ctx[b] += 1
            grow[b] -= 1
        q_lens = torch.randint(1, 4, (B,), generator=gen).minimum(ctx)  # the newest rows attend
        qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).int()
        q = torch.randn(int(qsl[-1]), 4, 16, generator=gen)
        args = (q, k_cache, v_cache, tables, ctx.int(), qsl, 0.25)
        expected = attention.paged_attention_ref(*args)
        assert_matches(attention.paged_attention_batched(*args, context_cache=cache), expected, atol=1e-5, rtol=1e-5)
        (entry,) = cache.values()
        refreshed += entry is kept
        kept = entry
    assert refreshed >= 2  # (most calls update the copy in place; one past its spare block gathers again)


def test_batched_cpu_path_gathers_again_when_the_batch_changes():
    """A cached context is not reused for another batch: fewer sequences (the decode loop dropping finished ones), or
    a known position's block replaced (its data copied to another block)."""
    k_cache, v_cache, tables, ctx, gen = _growing_batch(11, 12, 4)
    cache: dict = {}

    def call(tables, ctx):
        B = len(ctx)
        q = torch.randn(B, 4, 16, generator=gen)
        args = (q, k_cache, v_cache, tables, ctx.int(), torch.arange(B + 1, dtype=torch.int32), 0.25)
        assert_matches(attention.paged_attention_batched(*args, context_cache=cache),
                       attention.paged_attention_ref(*args), atol=1e-5, rtol=1e-5)
        return next(iter(cache.values()))

    first = call(tables, ctx)
    ctx = _write_next_position(k_cache, v_cache, tables, ctx, gen)
    narrowed = call(tables[:7], ctx[:7])
    assert narrowed is not first and narrowed.k.shape[0] == 7
    # sequence 2's first block moves: same data in a block nobody owned, new K/V in the old one
    spare = next(b for b in range(k_cache.shape[0]) if not (tables == b).any())  # a block no sequence owns
    tables = tables[:7].clone()
    old = int(tables[2, 0])
    k_cache[spare], v_cache[spare] = k_cache[old].clone(), v_cache[old].clone()
    k_cache[old], v_cache[old] = torch.randn_like(k_cache[old]), torch.randn_like(v_cache[old])
    tables[2, 0] = spare
    moved = call(tables, ctx[:7])
    assert moved is not narrowed


@pytest.mark.parametrize("seed", range(6))
def test_batched_cpu_path_takes_short_queries_together_beside_a_long_prefill(seed, monkeypatch):
    """A new sequence's prompt (or two) beside decode and short first steps: the short ones go through one batched
    call, each long one alone (_short_and_long), never the per-sequence loop; the same answer as the reference, the
    rows of no sequence untouched."""
    g = torch.Generator().manual_seed(500 + seed)
    B = int(torch.randint(4, 24, (1,), generator=g))
    q_lens = torch.randint(0 if seed % 3 == 0 else 1, 4, (B,), generator=g)  # (decode steps: m = 1-3)
    q_lens[torch.randperm(B, generator=g)[: 1 + seed % 2]] = int(torch.randint(40, 120, (1,), generator=g))
    ctx_lens = q_lens + 40 + torch.randint(0, 60, (B,), generator=g)
    ctx_lens = torch.maximum(ctx_lens, torch.ones_like(ctx_lens))
    num_kv_heads = 1 + seed % 2
    args = make_batch(q_lens.tolist(), ctx_lens.tolist(), num_kv_heads * 2, num_kv_heads, 16, 16, "cpu",
                      torch.float32, seed=seed)
    expected = attention.paged_attention_ref(*args, 0.25, out=poisoned(args[0].shape, torch.float32, "cpu"))
    looped = []
    ref = attention.paged_attention_ref
    monkeypatch.setattr(attention, "paged_attention_ref", lambda *a, **kw: looped.append(1) or ref(*a, **kw))
    actual = attention.paged_attention_batched(*args, 0.25, out=poisoned(args[0].shape, torch.float32, "cpu"))
    assert_matches(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(is_poison(actual), is_poison(expected))
    assert not looped  # (the short ones batched: the padding check passes for them)
