"""host_staging: the rows of many tensors as one device tensor (pinned staging; one DMA for one pinned block)."""
import pytest
import torch

from drafter_service.engine.host_staging import one_block, rows_into, rows_to_device


def test_mixed_dtypes_are_promoted_as_cat_does():
    a, b = torch.randn(300, 64).to(torch.bfloat16), torch.randn(200, 64)
    got = rows_to_device([a, b], torch.device("cpu"))
    assert got.dtype == torch.float32 and torch.equal(got, torch.cat([a, b]))


@pytest.mark.gpu
def test_pinned_staging_to_cuda_equals_cat():
    """The CUDA path: the rows concatenated into pinned memory, one non_blocking copy (a large, ragged step)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(3, 4096, generator=g).to(torch.bfloat16) for _ in range(256)]  # 6.3 MB
    tensors[7] = torch.randn(1, 4096, generator=g).to(torch.bfloat16)  # a ragged one
    for _ in range(3):  # (a later call reuses pinned blocks the caching allocator keeps)
        got = rows_to_device(tensors, torch.device("cuda"))
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


@pytest.mark.gpu
def test_rows_on_the_device_and_on_the_host_together():
    """A batch merging a shared-memory step (its states on the GPU already) with inline ones (host tensors): the
    rows in order on the device; all on the device: one cat there."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    host = [torch.randn(3, 64) for _ in range(4)]
    mixed = [host[0], host[1].to(dev), host[2], host[3].to(dev)]
    assert torch.equal(rows_to_device(mixed, dev).cpu(), torch.cat(host))
    on_device = [t.to(dev) for t in host]
    got = rows_to_device(on_device, dev)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), torch.cat(host))


def test_rows_on_the_cpu_are_one_cat_of_new_memory():
    """A CPU drafter: one cat, a tensor of its own (the steps' own tensors may be views of a request's buffer)."""
    whole = torch.randn(10, 8)
    parts = [whole[0:4], whole[4:10]]
    got = rows_to_device(parts, torch.device("cpu"))
    assert torch.equal(got, whole) and got.data_ptr() != whole.data_ptr()


def test_rows_into_a_kept_buffer_are_the_cat_in_its_dtype():
    """rows_into: one block, separate tensors, and rows of another dtype than the buffer's (cast by the copy) all
    land as torch.cat of the rows; the rows past them are left as they were."""
    whole = torch.randn(10, 8)
    for parts in ([whole], [whole[0:4], whole[4:10]], [whole[0:3], torch.randn(2, 8)],
                  [whole[0:4].to(torch.bfloat16), whole[4:10].to(torch.bfloat16)]):
        out = torch.full((12, 8), 7.0)
        rows = sum(p.shape[0] for p in parts)
        rows_into(parts, out[:rows])
        assert torch.equal(out[:rows], torch.cat(parts).to(out.dtype)) and bool((out[rows:] == 7.0).all())
