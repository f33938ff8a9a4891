"""received_request.read_request: large inline hidden states read off the wire as a view of the received bytes.

Whatever the bytes, it must give what protobuf gives: the same message (with hidden_states.raw moved out into
``states``), or the same DecodeError. Checked with hypothesis over well-formed requests serialized in every field
order (the states first, in the middle, last, twice), over the client library's own serialization, and over
random and corrupted bytes; then end to end: a step of more than MIN_SCAN_BYTES of inline states through Propose,
ProposeStream and a step channel gives the in-process drafts.
"""
import asyncio
import dataclasses

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, SequenceStep
from drafter_client.messages import DirectRequest, build_request, serialize_request
from drafter_client.protocol import pb
from drafter_service.runtime import build_runtime
from drafter_service.engine.step_io import StepInput
from drafter_service.transport import received_request
from drafter_service.transport.received_request import read_request

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def scan_everything(monkeypatch):
    monkeypatch.setattr(received_request, "MIN_SCAN_BYTES", 0)
    monkeypatch.setattr(received_request, "MIN_SCAN_FIELDS", 10**6)


def as_protobuf_gives(message: bytes) -> "pb.ProposeRequest | type[DecodeError]":
    try:
        return pb.ProposeRequest.FromString(message)
    except DecodeError:
        return DecodeError


def put_back(received: received_request.ReceivedRequest) -> "pb.ProposeRequest":
    """The message as protobuf would have parsed it: the states back in hidden_states.raw."""
    request = pb.ProposeRequest()
    request.CopyFrom(received.request)
    if received.states is not None:
        request.hidden_states.raw = bytes(received.states)
    return request


def check_same(message: bytes) -> received_request.ReceivedRequest | None:
    want = as_protobuf_gives(message)
    if want is DecodeError:
        with pytest.raises(DecodeError):
            read_request(message)
        return None
    got = read_request(message)
    assert put_back(got) == want
    return got


tensors = st.builds(
    lambda dtype, shape, raw, shm: pb.Tensor(dtype=dtype, shape=shape, raw=raw) if shm is None else
    pb.Tensor(dtype=dtype, shape=shape, shm=pb.SharedMemoryRef(region=shm, offset=4, byte_size=8)),
    st.sampled_from([pb.FLOAT32, pb.BFLOAT16, pb.INT64, 0]), st.lists(st.integers(0, 2**40), max_size=3),
    st.binary(max_size=300), st.one_of(st.none(), st.text(max_size=5)))
steps = st.lists(st.builds(lambda sid, p, m, k: pb.SequenceStep(sequence_id=sid, start_position=p, num_tokens=m,
                                                                  next_token=3, num_drafts=k),
                           st.text(max_size=8), st.integers(0, 2**40), st.integers(0, 9), st.integers(0, 9)),
                 max_size=4)


@SETTINGS
@given(namespace=st.text(max_size=10), steps=steps, tokens=tensors, hidden=st.one_of(st.none(), tensors),
       second=st.one_of(st.none(), tensors), request_id=st.integers(0, 2**64 - 1),
       order=st.permutations(range(5)))
def test_every_field_order_gives_what_protobuf_gives(scan_everything, namespace, steps, tokens, hidden, second,
                                                     request_id, order):
    """Fields in any order, hidden_states absent, once or twice (protobuf merges the two), raw or shm."""
    parts = [pb.ProposeRequest(namespace=namespace).SerializeToString(),
             pb.ProposeRequest(steps=steps).SerializeToString(),
             pb.ProposeRequest(token_ids=tokens, request_id=request_id).SerializeToString(),
             pb.ProposeRequest(hidden_states=hidden).SerializeToString() if hidden is not None else b"",
             pb.ProposeRequest(hidden_states=second).SerializeToString() if second is not None else b""]
    message = b"".join(parts[i] for i in order)
    got = check_same(message)
    assert got is not None  # (well-formed: protobuf parses it)
    once_with_raw = (hidden is None) != (second is None) and (hidden or second).WhichOneof("data") == "raw"
    assert (got.states is not None) == once_with_raw


@SETTINGS
@given(data=st.binary(max_size=400))
def test_random_bytes_give_what_protobuf_gives(scan_everything, data):
    check_same(data)


@SETTINGS
@given(cut=st.integers(0, 10**6), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                  max_size=3))
def test_corrupted_client_requests_give_what_protobuf_gives(scan_everything, cut, flips):
    """The client library's serialization (the states written by hand, last), truncated and with bytes flipped."""
    g = torch.Generator().manual_seed(0)
    steps = [SequenceStep(f"s{i}", 0, torch.randint(0, 100, (5,), generator=g), torch.randn(5, 8, generator=g),
                          1, 3) for i in range(40)]
    message = bytearray(bytes(serialize_request("ns", steps)))  # 40 x 5 x 8 fp32 = 6.4 KB of states
    assert check_same(bytes(message)).states is not None  # (intact: the view path)
    for where, value in flips:
        message[where % len(message)] = value
    check_same(bytes(message[: len(message) - cut % len(message)]))


def test_small_requests_go_to_protobuf_whole():
    steps = [SequenceStep("s", 0, [1, 2], torch.randn(2, 8), 1, 3)]
    got = read_request(bytes(serialize_request("ns", steps)))
    assert got.states is None and got.request.hidden_states.WhichOneof("data") == "raw"


def test_which_requests_are_scanned():
    """From MIN_SCAN_BYTES (64 KiB) a request is scanned, until its top-level fields pass max(MIN_SCAN_FIELDS,
    size // SCAN_BYTES_PER_FIELD): a columnar step (five fields) always is; one SequenceStep per sequence with little
    state per row goes to protobuf whole. Either way the message is what protobuf gives."""
    from drafter_client.batch import serialize_batch, steps_as_batch
    g = torch.Generator().manual_seed(3)

    def steps(n: int, width: int) -> list[SequenceStep]:
        return [SequenceStep(f"s{i}", 0, [1, 2, 3], torch.randn(3, width, generator=g), 1, 3) for i in range(n)]

    def read(request) -> received_request.ReceivedRequest:
        message = bytes(request)
        return check_same(message)

    assert len(bytes(serialize_request("ns", steps(1, 2048)))) < received_request.MIN_SCAN_BYTES
    assert read(serialize_request("ns", steps(1, 2048))).states is None  # (24 KiB: too small to scan)
    assert read(serialize_request("ns", steps(2, 4096))).states is not None  # (96 KiB, 6 fields)
    # 48 sequences of 3 x 128 fp32 (72 KiB): 52 fields for a budget of 8: protobuf's
    assert read(serialize_request("ns", steps(48, 128))).states is None
    # the same rows as columns: 5 fields
    ss = steps(48, 128)
    batch = dataclasses.replace(steps_as_batch(ss), hidden_states=torch.cat([s.hidden_states for s in ss]))
    assert read(serialize_batch("ns", batch, request_id=1, columns=True)).states is not None
    # 8 sequences of 3 x 4096 fp32 (384 KiB): 12 fields within a budget of 24
    assert read(serialize_request("ns", steps(8, 4096))).states is not None


def test_shared_memory_is_copied_before_protobuf_parses_it(monkeypatch):
    """A mailbox view that is not scanned (or whose scan gives up) is copied first: protobuf never parses memory
    the client can still write; only the states of a scanned request stay a view."""
    parsed = []
    from_string = pb.ProposeRequest.FromString
    monkeypatch.setattr(pb.ProposeRequest, "FromString",
                        staticmethod(lambda data: parsed.append(type(data)) or from_string(data)))
    small = memoryview(bytearray(bytes(serialize_request("ns", [SequenceStep("s", 0, [1], torch.randn(1, 8), 1, 3)]))))
    assert read_request(small).request.namespace == "ns" and parsed == [bytes]
    parsed.clear()
    many = [SequenceStep(f"s{i}", 0, [1, 2, 3], torch.randn(3, 128), 1, 3) for i in range(48)]
    got = read_request(memoryview(bytearray(bytes(serialize_request("ns", many)))))
    assert got.states is None and len(got.request.steps) == 48 and parsed == [bytes]
    parsed.clear()
    large = [SequenceStep("s", 0, [1, 2, 3], torch.randn(3, 8192), 1, 3)]
    got = read_request(memoryview(bytearray(bytes(serialize_request("ns", large)))))
    assert isinstance(got.states, memoryview) and parsed == [bytes]


def test_large_inline_states_through_every_path_give_the_in_process_drafts(tiny_model, tmp_path):
    """A prefill of 4500 x 64 fp32 states (1.15 MB, above MIN_SCAN_BYTES) sent as one message by Propose,
    ProposeStream and a step channel (read in place, and copied out of the mailbox): each is read as a view and drafts
    what the in-process proposer drafts."""
    head, target = tiny_model
    rows = 4500
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 512, (rows + 1,), generator=g)
    states = torch.randn(rows, 64, generator=g)
    step = SequenceStep("long", 0, tokens[:rows], states, int(tokens[rows]), 5)
    assert read_request(bytes(serialize_request("ns", [step]))).states is not None
    local = build_runtime(make_config(head, target, tmp_path / "local", max_model_len=8192, kv_cache_tokens=32768))
    want = local.proposer.step([StepInput("ns", "long", 0, tokens[:rows], states, int(tokens[rows]), 5)])[0].drafts
    assert len(want) == 5
    cfg = make_config(head, target, tmp_path / "srv", max_model_len=8192, kv_cache_tokens=32768)

    async def run(srv) -> list[list[int]]:
        got = []
        async with DrafterClient(srv.tcp, namespace="ns", chunk_min_bytes=None) as c:
            r = await c.propose([step])
            got.append(r.sequences[0].drafts.tolist())
            async with c.stream() as session:
                await session.send([step])
                got.append((await session.recv()).sequences[0].drafts.tolist())
        async with DrafterClient(srv.uds, namespace="ns", chunk_min_bytes=None) as c:
            assert await c.open_step_channel(request_bytes=4 << 20)
            channels = srv.server.runtime.metrics.channels
            r = await c.propose([step])
            assert c.steps_through_channel == 1 and channels.in_place_reads == 1  # (a view of the mailbox)
            got.append(r.sequences[0].drafts.tolist())
            # as on CUDA where the mailbox could not be pinned, the channel reads a large request into a buffer of
            # its own (pinned memory there)
            buffers = []
            channels.read_buffer = lambda n: buffers.append(n) or memoryview(bytearray(n))
            channels._open[0].in_place = False
            r = await c.propose([step])  # (the same prefill again: a rewind to 0)
            assert c.steps_through_channel == 2 and len(buffers) == 1 and buffers[0] > rows * 64 * 4
            assert channels.in_place_reads == 1
            got.append(r.sequences[0].drafts.tolist())
        return got

    with ServerThread(cfg) as srv:
        assert asyncio.run(run(srv)) == [want] * 4


def test_states_fields_of_the_wrong_wire_type_go_to_protobuf(scan_everything):
    """hidden_states (a message) or its raw (bytes) written as a varint: protobuf's answer, whatever it is."""
    good = bytes(serialize_request("ns", [SequenceStep("s", 0, [1, 2], torch.randn(2, 8), 1, 3)]))
    check_same(good + bytes([4 << 3 | 0, 5]))  # a second hidden_states, as a varint
    check_same(pb.ProposeRequest(namespace="ns").SerializeToString() + bytes([4 << 3 | 2, 2, 3 << 3 | 0, 7]))


@pytest.mark.parametrize("threads", [1, 2])
def test_states_are_written_alike_with_any_torch_thread_count(threads):
    """write_rows copies with memmove (a memmove per part, on the calling thread and, for a large copy, a helper
    thread; whatever torch's thread count): the bytes of a cat."""
    from drafter_client.messages import write_rows
    parts = [torch.randn(m, 3000).to(torch.bfloat16) for m in (1, 3, 7, 2)] + [torch.randn(4, 6000)[:, ::2]]
    want = torch.cat([p.to(torch.bfloat16) for p in parts]).contiguous().view(-1).view(torch.uint8)
    parts[-1] = parts[-1].to(torch.bfloat16)  # (non-contiguous: a strided view)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = bytearray(want.numel())
        write_rows(parts, memoryview(buf))
        request = serialize_request("ns", [SequenceStep(f"s{i}", 0, list(range(p.shape[0])), p, 1, 2)
                                           for i, p in enumerate(parts)])
        assert isinstance(request, DirectRequest)  # (the states written by hand, with write_rows)
        as_bytes = bytes(request)
    finally:
        torch.set_num_threads(before)
    assert bytes(buf) == bytes(want.numpy())
    assert pb.ProposeRequest.FromString(as_bytes) == build_request(
        "ns", [SequenceStep(f"s{i}", 0, list(range(p.shape[0])), p, 1, 2) for i, p in enumerate(parts)])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(cuts=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40), st.booleans()), min_size=1, max_size=7),
       threshold=st.sampled_from([1, 700, 10**9]))
def test_a_large_copy_split_with_a_helper_thread_writes_the_same_bytes(cuts, threshold):
    """From PARALLEL_COPY_MIN_BYTES write_rows copies the second half of the bytes on a helper thread (the half cut
    inside a span where it falls): the same bytes as a cat, for any mix of slices of one tensor (adjacent or not)
    and tensors of their own."""
    import threading

    from drafter_client import messages
    whole = torch.randn(80, 7)
    parts = [whole[a : a + n] if own is False else torch.randn(n, 7) for a, n, own in cuts]
    want = torch.cat(parts).view(-1).view(torch.uint8)
    threads = set()
    memmove = messages.ctypes.memmove

    def counted(dst, src, n):
        threads.add(threading.get_ident())
        return memmove(dst, src, n)
    before, cpus = messages.PARALLEL_COPY_MIN_BYTES, messages._cpus
    messages.PARALLEL_COPY_MIN_BYTES, messages.ctypes.memmove, messages._cpus = threshold, counted, lambda: 2
    try:
        buf = bytearray(want.numel())
        messages.write_rows(parts, memoryview(buf))
    finally:
        messages.PARALLEL_COPY_MIN_BYTES, messages.ctypes.memmove, messages._cpus = before, memmove, cpus
    assert bytes(buf) == bytes(want.numpy())
    split = want.numel() >= threshold and want.numel() > 1
    assert (len(threads) == 2) == split and threading.get_ident() in threads


def test_a_process_on_one_cpu_copies_on_its_calling_thread(monkeypatch):
    """Pinned to one CPU (its affinity), a process gains nothing from a second thread: every copy stays on the
    calling thread, whatever its size."""
    import threading

    from drafter_client import messages
    monkeypatch.setattr(messages, "PARALLEL_COPY_MIN_BYTES", 1)
    monkeypatch.setattr(messages.os, "sched_getaffinity", lambda pid: {0})
    threads = set()
    memmove = messages.ctypes.memmove
    monkeypatch.setattr(messages.ctypes, "memmove", lambda *a: (threads.add(threading.get_ident()), memmove(*a))[1])
    parts = [torch.randn(50, 10), torch.randn(7, 10)]
    buf = bytearray(57 * 40)
    messages.write_rows(parts, memoryview(buf))
    assert bytes(buf) == bytes(torch.cat(parts).view(-1).view(torch.uint8).numpy())
    assert threads == {threading.get_ident()}


def test_states_sliced_from_one_tensor_are_written_in_one_copy(monkeypatch):
    """Steps whose states are consecutive slices of one tensor (an engine's batch) are copied as one span (one
    memmove); a gap, a reordering or another tensor starts another span; a part that is not contiguous is made so
    first: the bytes are the same every way."""
    import ctypes

    from drafter_client import messages
    from drafter_client.messages import one_block, write_rows
    copies = []
    memmove = ctypes.memmove
    monkeypatch.setattr(messages.ctypes, "memmove", lambda dst, src, n: copies.append(n) or memmove(dst, src, n))
    whole = torch.randn(30, 500).to(torch.bfloat16)
    cuts = [0, 4, 5, 17, 30]
    slices = [whole[a:b] for a, b in zip(cuts, cuts[1:])]
    block = one_block(slices)
    assert block is not None and block.data_ptr() == whole.data_ptr() and block.shape == whole.shape
    buf = bytearray(whole.numel() * 2)
    write_rows(slices, memoryview(buf))
    assert bytes(buf) == bytes(whole.view(-1).view(torch.uint8).numpy()) and copies == [whole.numel() * 2]
    other = torch.randn(3, 500).to(torch.bfloat16)
    for parts, spans in (([whole[0:4], whole[5:17]], 2), ([whole[4:5], whole[0:4]], 2), ([whole[0:4], other], 2),
                         ([whole[0:4, :250], whole[4:6, :250]], None), ([whole[0:4], whole[4:9], other], 2)):
        assert one_block(parts) is None
        want = torch.cat([p.contiguous() for p in parts]).view(-1).view(torch.uint8)
        buf = bytearray(want.numel())
        copies.clear()
        write_rows(parts, memoryview(buf))
        assert bytes(buf) == bytes(want.numpy())
        assert spans is None or len(copies) == spans, (len(copies), spans)  # (None: contiguous copies, anywhere)


def test_a_large_copy_in_a_child_forked_after_one_does_not_hang(monkeypatch):
    """An engine that forks its workers after a large copy: the child makes a helper thread of its own (the parent's
    does not exist there) and copies the same bytes."""
    import os
    import time

    from drafter_client import messages
    monkeypatch.setattr(messages, "PARALLEL_COPY_MIN_BYTES", 1)
    parts = [torch.randn(100, 10), torch.randn(3, 10)]
    buf = bytearray(4120)
    messages.write_rows(parts, memoryview(buf))  # (the parent's helper thread now exists)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when its copy is right
        try:
            again = bytearray(4120)
            messages.write_rows(parts, memoryview(again))
            os._exit(0 if again == buf else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 30
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's copy hung")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(done[1]) == 0
