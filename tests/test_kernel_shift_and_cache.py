"""shift_and_cache (multi-layer EAGLE): Triton kernels vs torch reference, 1-D and hidden, plus a worked example."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICE_DTYPES, DEVICES, POISON_INT, kernel_module, poisoned  # noqa: E402

shift_and_cache = kernel_module("shift_and_cache")
FUNCTIONS = {"ref": shift_and_cache.shift_and_cache_ref, "triton": shift_and_cache.shift_and_cache_triton}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_worked_example(device, function):
    # One window of 5 rows (1..5) shifted by 2 with cache [a3, a4] (cached_len 2, MAX_SHIFT 3):
    # dst window = [a3, a4, b0, b1, b2]; then the cache keeps dst rows 3..4 (store_start 3, store_len 2) + zero.
    src = torch.tensor([-1, 10, 11, 12, 13, 14, -1], device=device)
    dst = poisoned((7,), torch.int64, device)
    cache = torch.tensor([[3, 4, 0], [55, 55, 55]], device=device)  # row 1 belongs to no request
    as_tensor = lambda v: torch.tensor(v, device=device)  # noqa: E731
    FUNCTIONS[function](src, dst, cache, as_tensor([1]), as_tensor([5]), as_tensor([2]), as_tensor([2]),
                        as_tensor([3]), as_tensor([2]))
    assert dst.tolist() == [POISON_INT, 3, 4, 10, 11, 12, POISON_INT]
    assert cache.tolist() == [[10, 11, 0], [55, 55, 55]]


def random_round(window_lens, max_shift, gen):
    """Windows with gaps between them, and shifts / cached lengths / store windows like the proposer makes."""
    starts, cursor = [], 1
    for n in window_lens:
        starts.append(cursor)
        cursor += n + 2
    window_start = torch.tensor(starts)
    window_end = window_start + torch.tensor(window_lens) - 1
    cached_len = torch.randint(0, max_shift + 1, (len(window_lens),), generator=gen)
    shift = torch.minimum(torch.randint(0, max_shift + 1, (len(window_lens),), generator=gen), cached_len)
    sample_offset = (torch.rand(len(window_lens), generator=gen) * torch.tensor(window_lens)).long()
    store_start, store_len = shift_and_cache.shift_cache_store_window(window_start, window_start + sample_offset,
                                                                      max_shift)
    return cursor, (window_start, window_end, shift, cached_len, store_start, store_len)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("hidden_size", [None, 1, 40, 300])  # None: 1-D tensors (token ids, positions, slots)
@pytest.mark.parametrize("window_lens,max_shift", [([1], 1), ([5, 1, 3, 140], 3), ([2, 7], 4)])
def test_matches_reference(device, dtype, hidden_size, window_lens, max_shift):
    gen = torch.Generator().manual_seed(sum(window_lens) + max_shift + (hidden_size or 0))
    num_rows, metadata = random_round(window_lens, max_shift, gen)
    metadata = [t.to(device) for t in metadata]
    row_shape = () if hidden_size is None else (hidden_size,)
    num_requests = len(window_lens)
    if hidden_size is None:  # 1-D data are integers here (like token ids); the dtype axis does not apply
        if dtype != torch.float32:
            pytest.skip("1-D case runs once per device")
        dtype = torch.int64
        src = torch.randint(0, 10**6, (num_rows,), generator=gen).to(device)
        cache = torch.randint(0, 10**6, (num_requests + 1, max_shift), generator=gen).to(device)
    else:
        src = torch.randn(num_rows, *row_shape, generator=gen).to(device=device, dtype=dtype)
        cache = torch.randn(num_requests + 1, max_shift, *row_shape, generator=gen).to(device=device, dtype=dtype)

    results = {}
    for name, fn in FUNCTIONS.items():
        dst, cache_copy = poisoned(src.shape, dtype, device), cache.clone()
        fn(src, dst, cache_copy, *metadata)
        results[name] = (dst, cache_copy)
    (expected_dst, expected_cache), (actual_dst, actual_cache) = results["ref"], results["triton"]
    torch.testing.assert_close(actual_dst, expected_dst, atol=0, rtol=0, equal_nan=True)  # a copy: exact
    torch.testing.assert_close(actual_cache, expected_cache, atol=0, rtol=0)
    unwritten = expected_dst.isnan() if dtype.is_floating_point else expected_dst == POISON_INT
    assert int((~unwritten).sum()) == sum(window_lens) * (hidden_size or 1)  # exactly the windows
    assert torch.equal(expected_cache[num_requests], cache[num_requests])  # the spare cache row is untouched
