"""host_staging.rows_to_device: the rows of many tensors as one, cut into parts filled by threads."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from drafter_service.engine import host_staging
from drafter_service.engine.host_staging import one_block, row_chunks, rows_to_device


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(0, 9), min_size=1, max_size=12), parts=st.integers(1, 6), data=st.data())
def test_row_chunks_cut_the_concatenation_at_the_bounds(lens, parts, data):
    tensors = [torch.arange(sum(lens[:i]), sum(lens[: i + 1])) for i in range(len(lens))]
    rows = sum(lens)
    inner = sorted(data.draw(st.lists(st.integers(1, max(1, rows - 1)), max_size=parts - 1, unique=True))) if rows > 1 else []
    bounds = [0, *inner, rows] if rows else [0, 0]
    chunks = row_chunks(tensors, bounds)
    assert len(chunks) == len(bounds) - 1
    for c, (a, b) in enumerate(zip(bounds, bounds[1:])):
        got = torch.cat(chunks[c]) if chunks[c] else torch.empty(0, dtype=torch.int64)
        assert got.tolist() == list(range(a, b))


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=20), threads=st.integers(1, 5),
       width=st.sampled_from([1, 8, 3000]), one_tensor=st.booleans())
def test_staged_rows_equal_torch_cat(lens, threads, width, one_tensor):
    g = torch.Generator().manual_seed(sum(lens) * 7 + threads)
    tensors = [torch.randn(m, width, generator=g).to(torch.bfloat16) for m in lens]
    if one_tensor:  # a columnar request: the whole batch in one tensor
        tensors = [torch.cat(tensors)]
    old = host_staging.PARALLEL_BYTES
    host_staging.PARALLEL_BYTES = 1024  # small enough that these sizes are cut into parts
    try:
        got = rows_to_device(tensors, torch.device("cpu"), threads=threads, pin=False)
    finally:
        host_staging.PARALLEL_BYTES = old
    assert torch.equal(got, torch.cat(tensors))


def test_fill_threads_write_an_inference_tensor(monkeypatch):
    """The step runs in inference mode, which is per thread: the fill threads must be in it to write the step's
    buffer (a CUDA step failed with "Inplace update to inference tensor outside InferenceMode" before)."""
    monkeypatch.setattr(host_staging, "PARALLEL_BYTES", 1024)
    tensors = [torch.randn(40, 64) for _ in range(5)]
    with torch.inference_mode():
        got = rows_to_device(tensors, torch.device("cpu"), threads=3, pin=False)
    assert torch.equal(got, torch.cat(tensors))


def test_mixed_dtypes_are_promoted_as_cat_does(monkeypatch):
    monkeypatch.setattr(host_staging, "PARALLEL_BYTES", 1024)
    a, b = torch.randn(300, 64).to(torch.bfloat16), torch.randn(200, 64)
    got = rows_to_device([a, b], torch.device("cpu"), threads=3, pin=False)
    assert got.dtype == torch.float32 and torch.equal(got, torch.cat([a, b]))


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [1, 4])
def test_pinned_staging_to_cuda_equals_cat(threads):
    """The real path: pinned parts, each queued to the device as it is filled (a large step: many parts)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(threads)
    tensors = [torch.randn(3, 4096, generator=g).to(torch.bfloat16) for _ in range(256)]  # 6.3 MB
    tensors[7] = torch.randn(1, 4096, generator=g).to(torch.bfloat16)  # a ragged one
    for _ in range(3):  # (a later call reuses pinned blocks the caching allocator keeps)
        got = rows_to_device(tensors, torch.device("cuda"), threads=threads)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), torch.cat(tensors))


def test_one_block_is_the_consecutive_slices_of_one_tensor():
    """A request's states sliced per sequence are one block again (one DMA on CUDA when it is pinned memory)."""
    whole = torch.randn(20, 6).to(torch.bfloat16)
    cuts = [0, 3, 4, 9, 20]
    slices = [whole[a:b] for a, b in zip(cuts, cuts[1:])]
    block = one_block(slices)
    assert block is not None and block.data_ptr() == whole.data_ptr() and torch.equal(block, whole)
    assert torch.equal(one_block(slices[1:3]), whole[3:9])
    assert one_block([whole[0:3], whole[4:9]]) is None  # a gap
    assert one_block([whole[3:4], whole[0:3]]) is None  # out of order
    assert one_block([whole[0:3], torch.randn(2, 6).to(torch.bfloat16)]) is None  # another tensor
    assert one_block([whole[0:3, :4], whole[3:5, :4]]) is None  # not contiguous
    assert one_block([whole[0:3], whole[3:5].float()]) is None  # another dtype
    flat = torch.arange(10)
    assert torch.equal(one_block([flat[0:4], flat[4:10]]), flat)


@pytest.mark.gpu
def test_rows_of_a_pinned_request_go_to_cuda_in_one_block():
    """As a step channel reads a large request on CUDA: into pinned_bytes, the states a view of it, sliced per
    sequence; rows_to_device sends that block as it is."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from drafter_service.engine.host_staging import pinned_bytes
    want = torch.randn(300, 4096).to(torch.bfloat16)
    buf = pinned_bytes(64 + want.numel() * 2)  # (the states sit after the message's other fields)
    buf[64:] = memoryview(want.view(-1).view(torch.uint8).numpy())
    states = torch.frombuffer(buf[64:], dtype=torch.bfloat16).view(300, 4096)
    slices = [states[i : i + 3] for i in range(0, 300, 3)]
    block = one_block(slices)
    assert block is not None and block.is_pinned()
    got = rows_to_device(slices, torch.device("cuda"))
    assert torch.equal(got.cpu(), want)
