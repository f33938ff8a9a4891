"""ProposeChunked: a large step's hidden states in chunks on a client stream (drafter_service/transport/chunked.py).

The chunked path gives the same drafts as one message; malformed chunk streams get a status naming the problem;
the staging limits and the upload time limit hold, and leave the server and other clients unharmed."""
import asyncio
import dataclasses

import grpc
import pytest
import torch

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, DrafterError, SequenceStep
from drafter_client.batch import StepBatch
from drafter_client.messages import ChunkedRequest, _request_without_states, serialize_request
from drafter_client.protocol import pb
from drafter_service.transport.chunked import parse_chunk

H, V = 64, 512  # the tiny head's hidden_states_width and vocabulary
ROWS = 600  # 600 x 64 fp32 = 150 KiB of states: above DIRECT_STATES_MIN_BYTES, so chunking applies
NBYTES = ROWS * H * 4


def prefill(sid: str, rows: int = ROWS, k: int = 4, seed: int = 0, dtype=torch.float32) -> SequenceStep:
    g = torch.Generator().manual_seed(seed)
    return SequenceStep(sid, 0, torch.randint(0, V, (rows,), generator=g), torch.randn(rows, H, generator=g).to(dtype),
                        int(torch.randint(0, V, (1,), generator=g)), k)


def header(steps: list[SequenceStep], namespace: str = "raw", dtype=pb.FLOAT32, shape=None) -> bytes:
    """The first ProposeChunk of a step, as the client library writes it (shape/dtype overridable)."""
    req = _request_without_states(namespace, steps, 1)
    req.hidden_states.dtype = dtype
    req.hidden_states.shape.extend(shape if shape is not None else [sum(len(s.token_ids) for s in steps), H])
    return pb.ProposeChunk(request=req).SerializeToString()


def chunk(offset: int, data: bytes) -> bytes:
    return pb.ProposeChunk(offset=offset, data=data).SerializeToString()


def states_bytes(steps: list[SequenceStep]) -> bytes:
    return torch.cat([s.hidden_states for s in steps]).numpy().tobytes()


async def raw_upload(client: DrafterClient, messages: list[bytes]) -> "pb.ProposeResponse":
    """ProposeChunked with hand-made messages; raises DrafterError with the call's status."""
    try:
        return await client._propose_chunked(iter(messages), timeout=30)
    except grpc.aio.AioRpcError as e:
        raise DrafterError(e.code(), e.details() or "") from None


async def refused(client, messages, code, *fragments):
    with pytest.raises(DrafterError) as e:
        await raw_upload(client, messages)
    assert e.value.code == code, e.value
    for f in fragments:
        assert f in e.value.message, e.value.message


@pytest.fixture
async def clients(server):
    """(one message per step, ProposeChunked for every large step in odd-sized chunks)"""
    async with DrafterClient(server.tcp, namespace="one", chunk_min_bytes=None) as one, \
            DrafterClient(server.tcp, namespace="chunked", chunk_min_bytes=0, chunk_bytes=4099) as chunked:
        yield one, chunked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_chunked_prefill_gives_the_drafts_of_one_message(clients, dtype):
    one, chunked = clients
    batches = [[prefill("a", dtype=dtype, seed=1)],  # one long prefill
               [prefill("b", 300, seed=2, dtype=dtype), prefill("c", 5, k=3, seed=3, dtype=dtype),
                prefill("d", 400, k=0, seed=4, dtype=dtype)]]  # a batch: the staging tensor split per step
    for steps in batches:
        r1 = await one.propose(steps)
        r2 = await chunked.propose(steps)
        assert [s.code for s in r1.sequences] == [0] * len(steps), [s.message for s in r1.sequences]
        assert [s.code for s in r2.sequences] == [0] * len(steps), [s.message for s in r2.sequences]
        assert torch.equal(r1.draft_token_ids, r2.draft_token_ids)
        assert r2.draft_token_ids.numel() == sum(s.num_drafts for s in steps)
    # then a decode step of each sequence, through both paths (the chunked prefill's KV is the same)
    nxt = [SequenceStep("a", ROWS, [7], torch.randn(1, H).to(dtype), 9, 4)]
    assert torch.equal((await one.propose(nxt)).draft_token_ids, (await chunked.propose(nxt)).draft_token_ids)
    assert one.steps_chunked == 0
    assert chunked.steps_chunked == 2  # the prefills (the decode step is small: one message)


async def test_batch_api_chunks_too(clients):
    one, chunked = clients
    steps = [prefill("x", seed=5), prefill("y", 200, seed=6)]
    batch = StepBatch(sequence_ids=["x", "y"], start_positions=torch.tensor([0, 0]),
                      num_tokens=torch.tensor([ROWS, 200]), token_ids=torch.cat([torch.as_tensor(s.token_ids)
                                                                                  for s in steps]),
                      hidden_states=torch.cat([s.hidden_states for s in steps]),
                      next_tokens=torch.tensor([s.next_token for s in steps]), num_drafts=4)
    b1 = await one.propose_batch(batch)
    b2 = await chunked.propose_batch(batch)
    assert b1.codes.tolist() == b2.codes.tolist() == [0, 0]
    assert torch.equal(b1.draft_token_ids, b2.draft_token_ids)
    assert chunked.steps_chunked == 1


async def test_threshold_and_non_contiguous_states(server):
    """Below chunk_min_bytes one message; a non-contiguous tensor is gathered once and chunked alike."""
    async with DrafterClient(server.tcp, namespace="thr", chunk_min_bytes=NBYTES + 1) as c:
        await c.propose([prefill("t1")])
        assert c.steps_chunked == 0
        wide = torch.randn(ROWS + 1, 2 * H)
        s = prefill("t2", rows=ROWS + 1)
        s.hidden_states = wide[:ROWS + 1, ::2]  # [ROWS+1, H], not contiguous
        r = await c.propose([s])
        assert c.steps_chunked == 1 and r.sequences[0].ok
        async with DrafterClient(server.tcp, namespace="thr1", chunk_min_bytes=None) as ref:
            s.sequence_id = "t3"
            assert torch.equal((await ref.propose([s])).draft_token_ids, r.draft_token_ids)


def test_chunk_messages_round_trip_through_the_parser():
    steps = [prefill("p", 300)]
    req = serialize_request("ns", steps, None, 3, chunk_min_bytes=0)
    assert isinstance(req, ChunkedRequest) and req.nbytes == 300 * H * 4
    msgs = list(req.messages(1000))
    first = parse_chunk(msgs[0])
    assert first.error == "" and first.offset == 0 and len(first.data) == 0
    assert first.request.namespace == "ns" and list(first.request.hidden_states.shape) == [300, H]
    assert first.request.hidden_states.WhichOneof("data") is None
    got = bytearray()
    for m in msgs[1:]:
        c = parse_chunk(m)
        assert c.error == "" and c.request is None and c.offset == len(got)
        assert pb.ProposeChunk.FromString(m).data == bytes(c.data)  # the hand parser reads what protobuf reads
        got += c.data
    assert bytes(got) == states_bytes(steps)
    assert len(msgs) == 1 + -(-len(got) // 1000)
    # unknown fields are skipped; malformed messages give an error, never an exception
    assert bytes(parse_chunk(b"\x28\x05" + chunk(8, b"abc")).data) == b"abc"  # field 5 (varint) first
    assert "does not parse" in parse_chunk(chunk(0, b"abcdef")[:-2]).error
    assert "does not parse" in parse_chunk(b"\x1a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01").error
    assert "does not parse" in parse_chunk(b"\x18\x05").error  # data as a varint
    assert "does not parse" in parse_chunk(b"\x0a\x03abc").error  # a request that is not a ProposeRequest


async def test_malformed_chunk_streams_are_refused_by_name(server, clients):
    _, c = clients
    steps = [prefill("m", 100)]
    data, nbytes = states_bytes(steps), 100 * H * 4
    good = header(steps)
    bad_ids = [prefill("m", 100)]
    bad_ids[0].token_ids[7] = V + 1
    tainted = _request_without_states("raw", steps, 1)
    tainted.hidden_states.dtype, tainted.hidden_states.raw = pb.FLOAT32, b"x" * 4
    tainted.hidden_states.shape.extend([100, H])

    await refused(c, [], grpc.StatusCode.INVALID_ARGUMENT, "got no message")
    await refused(c, [chunk(0, data)], grpc.StatusCode.INVALID_ARGUMENT, "chunk 0 has no request")
    await refused(c, [b"\x0a\x02\xff\xff"], grpc.StatusCode.INVALID_ARGUMENT, "chunk 0", "does not parse")
    await refused(c, [pb.ProposeChunk(request=tainted).SerializeToString(), chunk(0, data)],
                  grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.raw is set")
    await refused(c, [header(steps, shape=[100, H + 1])], grpc.StatusCode.INVALID_ARGUMENT, "65 columns")
    await refused(c, [header(steps, shape=[99, H])], grpc.StatusCode.INVALID_ARGUMENT, "99 rows", "add up to 100")
    await refused(c, [header(steps, shape=[100, H, 1])], grpc.StatusCode.INVALID_ARGUMENT, "2 dimensions")
    await refused(c, [header(steps, dtype=pb.INT64)], grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.dtype")
    # the whole request is checked before any data is taken
    await refused(c, [header(bad_ids)], grpc.StatusCode.INVALID_ARGUMENT, "token_ids[7]", "vocabulary")
    await refused(c, [header([prefill("", 100)])], grpc.StatusCode.INVALID_ARGUMENT, "steps[0].sequence_id")
    # order, gaps, overlaps, sizes
    await refused(c, [good, chunk(0, data[:1000]), chunk(1001, data[1001:])], grpc.StatusCode.INVALID_ARGUMENT,
                  "chunk 2 starts at byte 1001", "expected 1000")
    await refused(c, [good, chunk(0, data[:1000]), chunk(500, data[500:])], grpc.StatusCode.INVALID_ARGUMENT,
                  "chunk 2 starts at byte 500", "expected 1000")
    await refused(c, [good, chunk(0, data + b"xx")], grpc.StatusCode.INVALID_ARGUMENT,
                  f"chunk 1 ends at byte {nbytes + 2}", f"{nbytes} bytes")
    await refused(c, [good, chunk(0, data[:-4])], grpc.StatusCode.INVALID_ARGUMENT,
                  f"ended after {nbytes - 4} of the {nbytes} bytes")
    await refused(c, [good], grpc.StatusCode.INVALID_ARGUMENT, f"ended after 0 of the {nbytes} bytes")
    await refused(c, [good, chunk(0, data[:10]), good], grpc.StatusCode.INVALID_ARGUMENT,
                  "chunk 2 has a request")
    await refused(c, [good, chunk(0, b""), chunk(0, data)], grpc.StatusCode.INVALID_ARGUMENT, "chunk 1 has no data")
    await refused(c, [good, chunk(0, data[:10]), b"\xff"], grpc.StatusCode.INVALID_ARGUMENT, "chunk 2",
                  "does not parse")
    first = pb.ProposeChunk.FromString(good)
    first.offset = 5
    await refused(c, [first.SerializeToString()], grpc.StatusCode.INVALID_ARGUMENT, "chunk 0 starts at byte 5")
    # data in the first chunk is allowed (offset 0), and the rest follows it
    first = pb.ProposeChunk.FromString(good)
    first.data = data[:777]
    r = await raw_upload(c, [first.SerializeToString(), chunk(777, data[777:])])
    assert r.results[0].status.code == 0 and r.results[0].num_drafts == 4
    # the server is unharmed, and nothing stays staged
    assert (await c.propose([prefill("after")])).sequences[0].ok
    assert server.server.servicer.staging.in_flight == 0


async def test_too_many_tokens_is_resource_exhausted(tiny_model, tmp_path):
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path, max_batch_tokens=512)) as srv:
        async with DrafterClient(srv.tcp, namespace="big", chunk_min_bytes=0) as c:
            with pytest.raises(DrafterError) as e:
                await c.propose([prefill("a", 513)])
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 512" in e.value.message


async def test_staging_limits_hold_per_namespace_and_in_all(tiny_model, tmp_path):
    """One namespace's uploads in flight cannot take more than its share, nor the server more than its total; an
    upload held open by one client leaves other namespaces able to upload; the budget comes back."""
    head, target = tiny_model
    cfg = make_config(head, target, tmp_path, max_chunked_bytes=2 * NBYTES + NBYTES // 2,
                      max_chunked_bytes_per_namespace=NBYTES + NBYTES // 2)
    with ServerThread(cfg) as srv:
        staging = srv.server.servicer.staging
        async with DrafterClient(srv.tcp, namespace="a", chunk_min_bytes=0) as a, \
                DrafterClient(srv.tcp, namespace="b", chunk_min_bytes=0) as b, \
                DrafterClient(srv.tcp, namespace="c", chunk_min_bytes=0) as c:
            steps = [prefill("held")]
            held = a._propose_chunked(timeout=30)  # namespace "a" opens an upload and sends only its header
            await held.write(header(steps, namespace="a"))
            for _ in range(500):
                if staging.in_flight == NBYTES:
                    break
                await asyncio.sleep(0.01)
            assert staging.in_flight == NBYTES and staging.by_namespace == {"a": NBYTES}
            with pytest.raises(DrafterError) as e:  # a second one of "a" passes its namespace's share
                await a.propose([prefill("a2")])
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-chunked-bytes-per-namespace" in e.value.message and "'a'" in e.value.message
            assert (await b.propose([prefill("b1")])).sequences[0].ok  # another namespace is not held up
            # b holds one too: now the server's total is the limit, for anyone
            held_b = b._propose_chunked(timeout=30)
            await held_b.write(header([prefill("held_b")], namespace="b"))
            for _ in range(500):
                if staging.in_flight == 2 * NBYTES:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(DrafterError) as e:
                await c.propose([prefill("c1")])
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-chunked-bytes)" in e.value.message
            # the held uploads finish normally; a cancelled one gives its bytes back
            await held.write(chunk(0, states_bytes(steps)))
            await held.done_writing()
            assert (await held).results[0].status.code == 0
            held_b.cancel()
            for _ in range(500):
                if staging.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert staging.in_flight == 0 and staging.by_namespace == {}
            assert (await c.propose([prefill("c2")])).sequences[0].ok


async def test_an_upload_that_stalls_ends_with_deadline_exceeded(tiny_model, tmp_path):
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path, chunked_upload_timeout_s=0.5)) as srv:
        async with DrafterClient(srv.tcp, namespace="slow", chunk_min_bytes=0) as c:
            steps = [prefill("s")]
            call = c._propose_chunked(timeout=30)
            await call.write(header(steps, namespace="slow"))
            await call.write(chunk(0, states_bytes(steps)[:100]))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "--chunked-upload-timeout-s" in e.value.details()
            assert srv.server.servicer.staging.in_flight == 0
            assert (await c.propose([prefill("s2")])).sequences[0].ok  # a prompt upload still works


async def test_a_drafter_without_propose_chunked_gets_one_message(server):
    """An older drafter answers UNIMPLEMENTED: the client sends the step as one message, and stops chunking."""
    async with DrafterClient(server.tcp, namespace="old", chunk_min_bytes=0) as c:
        c._propose_chunked = c._channel.stream_unary("/drafter.v1.Drafter/NoSuchMethod", request_serializer=None,
                                                     response_deserializer=pb.ProposeResponse.FromString)
        r = await c.propose([prefill("o")])
        assert r.sequences[0].ok and r.sequences[0].drafts.numel() == 4
        assert c.chunk_min_bytes is None and c.steps_chunked == 0
        async with DrafterClient(server.tcp, namespace="old-ref", chunk_min_bytes=None) as ref:
            assert torch.equal((await ref.propose([prefill("o")])).draft_token_ids, r.draft_token_ids)


def test_cli_flags_and_config_checks():
    from drafter_service.cli import parse_args
    from drafter_service.config import ServerConfig

    cfg = parse_args(["--max-chunked-bytes", "1000", "--max-chunked-bytes-per-namespace", "500",
                      "--chunked-upload-timeout-s", "2.5", "--no-tune-malloc"])
    assert (cfg.max_chunked_bytes, cfg.max_chunked_bytes_per_namespace) == (1000, 500)
    assert cfg.chunked_upload_timeout_s == 2.5 and cfg.tune_malloc is False
    assert parse_args([]).tune_malloc is True
    for bad in (dict(chunked_upload_timeout_s=0), dict(max_chunked_bytes=-1)):
        with pytest.raises(ValueError):
            ServerConfig(model="m", **bad)


@pytest.mark.parametrize("num_tokens", [[2**63 - 1, 2], [2**63 - 1, 2**63 - 1, 6]])
def test_num_tokens_that_overflow_int64_are_refused_by_name(num_tokens):
    """columns.num_tokens whose sum wraps around in int64 (to a negative or a small count): the header's staging
    size is refused as a request error, never a RuntimeError of torch.empty (UNKNOWN to the client)."""
    from drafter_client.protocol.wire import encode_tensor
    from drafter_service.transport.chunked import staging_tensor
    from drafter_service.transport.validation import Limits, RequestError, committed_rows

    limits = Limits(hidden_states_width=H, vocab_size=512, max_draft_tokens=8, max_request_tokens=4096,
                    max_request_seqs=64)
    req = pb.ProposeRequest(namespace="ns")
    c = req.columns
    c.sequence_ids.extend([f"s{i}" for i in range(len(num_tokens))])
    for name in ("start_positions", "next_tokens", "num_drafts"):
        encode_tensor(torch.zeros(len(num_tokens), dtype=torch.int64), into=getattr(c, name))
    encode_tensor(torch.tensor(num_tokens, dtype=torch.int64), into=c.num_tokens)
    assert committed_rows(req) == sum(num_tokens)  # exact, no wrap-around
    for rows in (-(2**63 - 1), 4, sum(num_tokens) % 2**63):
        req.hidden_states.dtype = pb.FLOAT32
        del req.hidden_states.shape[:]
        req.hidden_states.shape.extend([rows, H])
        with pytest.raises(RequestError) as e:
            staging_tensor(req, limits)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "committed tokens" in e.value.message


async def test_a_refused_upload_reports_its_status_while_the_client_still_writes(tiny_model, tmp_path):
    """The server refuses an upload at its first chunk while the client is still writing the rest. grpcio's asyncio
    client reports a write that fails after the server's answer as INTERNAL "Internal error from Core" in place of
    that answer (grpc/grpc#36066); the server reads what is left of a refused upload first, so that every refusal
    arrives with its own code and message."""
    head, target = tiny_model
    cfg = make_config(head, target, tmp_path, max_chunked_bytes_per_namespace=NBYTES // 2)
    with ServerThread(cfg) as srv:
        big = prefill("big", rows=8000)  # 2 MB of states, in 125 chunks of 16 KiB: more than flow control lets out
        async with DrafterClient(srv.tcp, namespace="a", chunk_min_bytes=0, chunk_bytes=16384) as a:
            for i in range(20):
                with pytest.raises(DrafterError) as e:
                    await a.propose([dataclasses.replace(big, sequence_id=f"s{i}")])
                assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (i, e.value)
                assert "--max-chunked-bytes-per-namespace" in e.value.message
            assert srv.server.servicer.staging.in_flight == 0


async def test_draining_a_refused_upload_is_bounded():
    """drain_refused reads until the client half-closes, but no longer than max_s and no more than max_bytes: a
    client that keeps writing (or stalls) gets its answer anyway."""
    from drafter_service.transport.chunked import Chunk, drain_refused

    async def chunks(n: int | None, size: int = 1000, pause: float = 0.0):
        i = 0
        while n is None or i < n:
            if pause:
                await asyncio.sleep(pause)
            yield Chunk(None, i * size, memoryview(bytes(size)))
            i += 1

    assert await drain_refused(chunks(5))  # the client half-closed after 5 chunks
    assert not await drain_refused(chunks(None), max_bytes=10_000, max_s=5.0)  # endless: cut at 10 kB
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert not await drain_refused(chunks(None, pause=0.05), max_bytes=10**9, max_s=0.3)  # slow and endless
    assert loop.time() - t0 < 2.0
