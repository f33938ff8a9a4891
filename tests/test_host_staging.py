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


@pytest.mark.gpu
def test_a_merged_batchs_pinned_parts_go_to_cuda_one_dma_each():
    """A merged batch's states (BatchInput.cat keeps each request's tensor: in serving, each a view of its channel's
    pinned mailbox) go to the device with a copy each, no host cat: rows_to_device and rows_into equal torch.cat of
    them, in the buffer's dtype too, and a part already on the device joins them; more parts than MAX_DMA_PARTS, or a
    pageable one among them, take the pinned-staging path and land the same."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from drafter_service.engine import host_staging

    g = torch.Generator().manual_seed(3)
    dev = torch.device("cuda")
    parts = [torch.randn(n, 512, generator=g).to(torch.bfloat16).pin_memory() for n in (96, 3, 40, 96)]
    assert all(p.is_pinned() for p in parts) and host_staging._pinned_parts(parts, dev)
    want = torch.cat(parts)
    for _ in range(2):
        assert torch.equal(rows_to_device(parts, dev).cpu(), want)
        out = torch.full((want.shape[0] + 5, 512), 7.0, device=dev)  # float32: the copies cast
        rows_into(parts, out[: want.shape[0]])
        assert torch.equal(out[: want.shape[0]].cpu(), want.float()) and bool((out[want.shape[0]:] == 7.0).all())
    with_device = parts[:2] + [parts[2].to(dev)] + parts[3:]
    assert torch.equal(rows_to_device(with_device, dev).cpu(), want)
    out = torch.zeros_like(want, device=dev)
    rows_into(with_device, out)
    assert torch.equal(out.cpu(), want)
    pageable = parts[:1] + [parts[1].clone()] + parts[2:]  # (not pinned)
    assert not host_staging._pinned_parts(pageable, dev)
    assert torch.equal(rows_to_device(pageable, dev).cpu(), want)
    # pageable rows into a kept buffer (a gRPC request's inline states): through pinned memory, one DMA into out; one
    # block of a pageable message, separate tensors, in out's dtype or another; rows past them untouched
    message = torch.cat(parts).clone()
    for rows in ([message], [message[:99], message[99:]], [p.clone() for p in parts]):
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.full((want.shape[0] + 5, 512), 7.0, device=dev, dtype=dtype)
            rows_into(rows, out[: want.shape[0]])
            assert torch.equal(out[: want.shape[0]].cpu(), want.to(dtype)) and bool((out[want.shape[0]:] == 7.0).all())
    many = [p for p in parts for _ in range(5)]  # 20 parts: past MAX_DMA_PARTS
    assert not host_staging._pinned_parts(many, dev) and torch.equal(rows_to_device(many, dev).cpu(), torch.cat(many))


def test_merged_batch_states_stay_apart_and_split_per_sequence():
    """BatchInput.cat keeps each request's states as its own tensor (states(): no host cat), and to_inputs() gives
    each sequence its rows as views of its request's tensor; merging merged batches flattens the parts."""
    from drafter_service.engine.batch_io import BatchInput, _rows_split

    def batch(ns, counts, width=6):
        T = sum(counts)
        return BatchInput.from_lists(ns, [f"{ns}{i}" for i in range(len(counts))], [0] * len(counts), counts,
                                     torch.arange(T), torch.randn(T, width), [1] * len(counts), [2] * len(counts),
                                     [0.0] * len(counts), [0] * len(counts), [False] * len(counts),
                                     [0] * len(counts), [0] * len(counts))

    a, b, c = batch("a", [3, 1, 2]), batch("b", [2]), batch("c", [1, 4])
    ab = BatchInput.cat([a, b])
    assert ab.hidden_states is None and [t.data_ptr() for t in ab.states()] == [a.hidden_states.data_ptr(),
                                                                                 b.hidden_states.data_ptr()]
    abc = BatchInput.cat([ab, c])
    assert len(abc.states()) == 3 and len(abc) == 6
    want = torch.cat([a.hidden_states, b.hidden_states, c.hidden_states]).split([3, 1, 2, 2, 1, 4])
    got = abc.to_inputs()
    assert [s.sequence_id for s in got] == ["a0", "a1", "a2", "b0", "c0", "c1"]
    for s, w in zip(got, want):
        assert torch.equal(s.hidden_states, w)
    assert got[4].hidden_states.data_ptr() == c.hidden_states.data_ptr()  # (a view, not a copy)
    # pieces that would span two parts (never from whole requests) come from their concatenation
    parts = [torch.randn(3, 2), torch.randn(3, 2)]
    assert [p.tolist() for p in _rows_split(parts, [2, 2, 2])] == \
        [p.tolist() for p in torch.cat(parts).split([2, 2, 2])]


@pytest.mark.gpu
def test_pinned_copy_pins_large_pageable_states_only():
    """pinned_copy (the server's keep_states on CUDA): a pageable CPU tensor of PIN_COPY_MIN_BYTES or more comes back
    as an equal copy in pinned memory; a smaller one, a pinned one and a device one come back as they are."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from drafter_service.engine.host_staging import PIN_COPY_MIN_BYTES, pinned_copy

    rows = PIN_COPY_MIN_BYTES // (512 * 2)
    big = torch.randn(rows, 512).to(torch.bfloat16)
    got = pinned_copy(big)
    assert got is not big and got.is_pinned() and torch.equal(got, big)
    small = big[: rows - 1]
    assert pinned_copy(small) is small
    pinned = big.pin_memory()
    assert pinned_copy(pinned) is pinned
    on_device = big.cuda()
    assert pinned_copy(on_device) is on_device
