"""An upload spread over several ProposeChunked calls (ProposeChunk.part; DrafterClient(upload_streams=N)).

The spread path gives the same drafts as one message; its parts may arrive in any order; a malformed or missing
part fails the step with a status naming it, the other calls end, and nothing stays staged or registered."""
import asyncio

import grpc
import pytest
import torch

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, DrafterError, SequenceStep
from drafter_client.messages import ChunkedRequest, parse_response, serialize_request, upload_part_range
from drafter_client.protocol import pb
from drafter_service.config import ServerConfig
from drafter_service.transport.chunked import parse_chunk

MAX_UPLOAD_PARTS = ServerConfig.max_upload_parts  # (the default: what the test server allows)
from test_chunked_upload import H, NBYTES, ROWS, V, chunk, header, prefill, states_bytes


def test_part_ranges_tile_the_bytes():
    for nbytes in (0, 1, 7, 4096, NBYTES, 10**6 + 3):
        for count in range(2, MAX_UPLOAD_PARTS + 1):
            ranges = [upload_part_range(nbytes, count, i) for i in range(count)]
            assert ranges[0][0] == 0 and ranges[-1][1] == nbytes
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # no gap, no overlap
            assert all(0 <= hi - lo <= -(-nbytes // count) for lo, hi in ranges)


def test_part_messages_round_trip_through_the_parser():
    steps = [prefill("p", 300)]
    req = serialize_request("ns", steps, None, 3, chunk_min_bytes=0)
    assert isinstance(req, ChunkedRequest)
    got = bytearray(req.nbytes)
    for i in range(3):
        part = pb.UploadPart(namespace="ns" if i else "", upload_id="u1", index=i, count=3)
        msgs = [parse_chunk(m) for m in req.messages(1000, part)]
        assert all(c.error == "" for c in msgs)
        assert msgs[0].part == part and all(c.part is None for c in msgs[1:])
        assert (msgs[0].request is not None) == (i == 0) and all(c.request is None for c in msgs[1:])
        assert msgs[0].namespace == "ns"  # what the auth interceptor checks, first call and extra calls alike
        lo, hi = upload_part_range(req.nbytes, 3, i)
        at = lo
        for c in msgs:
            if c.request is None or len(c.data):
                assert c.offset == at
            got[at : at + len(c.data)] = c.data
            at += len(c.data)
        assert at == hi
    assert bytes(got) == states_bytes(steps)


@pytest.mark.parametrize("streams", [2, 3, 8])
async def test_spread_upload_gives_the_drafts_of_one_message(server, streams):
    async with DrafterClient(server.tcp, namespace=f"one{streams}", chunk_min_bytes=None) as one, \
            DrafterClient(server.tcp, namespace=f"spread{streams}", chunk_min_bytes=0, chunk_bytes=4099,
                          upload_streams=streams, upload_streams_min_bytes=0) as spread:
        batches = [[prefill("a", seed=1)],
                   [prefill("b", 300, seed=2), prefill("c", 5, k=3, seed=3), prefill("d", 400, k=0, seed=4)]]
        for steps in batches:
            r1, r2 = await one.propose(steps), await spread.propose(steps)
            assert [s.code for s in r2.sequences] == [0] * len(steps), [s.message for s in r2.sequences]
            assert torch.equal(r1.draft_token_ids, r2.draft_token_ids)
        nxt = [SequenceStep("a", ROWS, [7], torch.randn(1, H), 9, 4)]
        assert torch.equal((await one.propose(nxt)).draft_token_ids, (await spread.propose(nxt)).draft_token_ids)
        assert spread.steps_spread == spread.steps_chunked == 2
        assert len(spread._upload_channels) == streams - 1
    registry = server.server.runtime.metrics.registry
    sample = lambda name, calls: registry.get_sample_value(name, {"calls": calls}) or 0  # noqa: E731
    assert sample("drafter_chunked_uploads_total", "spread") >= 2
    assert sample("drafter_chunked_upload_bytes_total", "spread") >= 2 * NBYTES
    servicer = server.server.servicer
    assert servicer.staging.in_flight == 0 and servicer.uploads.uploads == {} and servicer.uploads.waiting == {}


async def test_spread_only_from_its_threshold_and_where_the_drafter_allows(server):
    async with DrafterClient(server.tcp, namespace="thr", chunk_min_bytes=0, upload_streams=4,
                             upload_streams_min_bytes=NBYTES + 1) as c:
        assert (await c.get_info()).max_upload_parts == MAX_UPLOAD_PARTS
        await c.propose([prefill("t1")])
        assert (c.steps_chunked, c.steps_spread) == (1, 0)
        c.upload_streams_min_bytes = NBYTES
        await c.propose([prefill("t2")])
        assert (c.steps_chunked, c.steps_spread) == (2, 1)
        c._max_upload_parts = 0  # (an older drafter: GetInfo.max_upload_parts unset)
        await c.propose([prefill("t3")])
        assert (c.steps_chunked, c.steps_spread) == (3, 1)
    with pytest.raises(ValueError, match="upload_streams"):
        DrafterClient(server.tcp, upload_streams=9)


async def raw(client: DrafterClient, rpc, messages: list[bytes], timeout: float = 30) -> "pb.ProposeResponse":
    try:
        return await rpc(iter(messages), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        raise DrafterError(e.code(), e.details() or "") from None


def part_msg(upload_id: str, index: int, count: int, offset: int, data: bytes, namespace: str = "raw") -> bytes:
    return pb.ProposeChunk(part=pb.UploadPart(namespace=namespace, upload_id=upload_id, index=index, count=count),
                           offset=offset, data=data).SerializeToString()


def first_msg(steps, upload_id: str, count: int, namespace: str = "raw") -> bytes:
    return header(steps, namespace=namespace) + pb.ProposeChunk(
        part=pb.UploadPart(upload_id=upload_id, index=0, count=count)).SerializeToString()


async def second_rpc(client: DrafterClient):
    """ProposeChunked on a connection of its own (as the client's extra upload calls go)."""
    ch = grpc.aio.insecure_channel(client.target, options=[("grpc.use_local_subchannel_pool", 1)])
    return ch, ch.stream_unary("/drafter.v1.Drafter/ProposeChunked", request_serializer=None,
                               response_deserializer=pb.ProposeResponse.FromString)


async def test_parts_in_any_order_and_malformed_parts_are_refused_by_name(server):
    steps = [prefill("m", 100)]
    data, nbytes = states_bytes(steps), 100 * H * 4
    half = upload_part_range(nbytes, 2, 1)[0]
    async with DrafterClient(server.tcp, namespace="raw", chunk_min_bytes=0) as c:
        ch, rpc2 = await second_rpc(c)
        one = c._propose_chunked

        async def both(first: list[bytes], second: list[bytes], second_first: bool = False, second_timeout=30.0):
            """(the first call's outcome, the extra call's), each a response or a DrafterError"""
            async def run(rpc, msgs, delay, timeout=30.0):
                await asyncio.sleep(delay)
                try:
                    return await raw(c, rpc, msgs, timeout)
                except DrafterError as e:
                    return e
            return await asyncio.gather(run(one, first, 0.2 if second_first else 0.0),
                                        run(rpc2, second, 0.0 if second_first else 0.2, second_timeout))

        # the extra call first (it waits for the first call), or the first call first: the same drafts
        for n, second_first in enumerate((True, False)):
            sid = f"ok{n}"
            s = [prefill(sid, 100)]
            r0, r1 = await both([first_msg(s, sid, 2), chunk(0, data[:half])],
                                [part_msg(sid, 1, 2, half, data[half:])], second_first)
            assert isinstance(r0, pb.ProposeResponse) and r0.results[0].status.code == 0, r0
            assert isinstance(r1, pb.ProposeResponse) and len(r1.results) == 0
        async with DrafterClient(server.tcp, namespace="ref", chunk_min_bytes=None) as ref:
            want = (await ref.propose([prefill("ok1", 100)])).draft_token_ids
        assert parse_response(r0).draft_token_ids.tolist() == want.tolist()

        async def refused_pair(first, second, code, *fragments, second_code=grpc.StatusCode.ABORTED,
                               second_timeout=30.0):
            r0, r1 = await both(first, second, second_timeout=second_timeout)
            assert isinstance(r0, DrafterError) and r0.code == code, r0
            for f in fragments:
                assert f in r0.message, r0.message
            assert isinstance(r1, DrafterError) and r1.code == second_code, r1

        bad = grpc.StatusCode.INVALID_ARGUMENT
        # the extra call's bytes break the rules: the step fails naming the part; the extra call gets that error
        await refused_pair([first_msg(steps, "w1", 2), chunk(0, data[:half])],
                           [part_msg("w1", 1, 2, half + 4, data[half + 4:])], bad,
                           "part 1: chunk 0 starts at byte", f"expected {half}", second_code=bad)
        await refused_pair([first_msg(steps, "w2", 2), chunk(0, data[:half])],
                           [part_msg("w2", 1, 2, half, data[half:] + b"xxxx")], bad,
                           "part 1: chunk 0 ends at byte", second_code=bad)
        await refused_pair([first_msg(steps, "w3", 2), chunk(0, data[:half])],
                           [part_msg("w3", 1, 2, half, data[half:-4])], bad,
                           "part 1: the upload ended after", second_code=bad)
        await refused_pair([first_msg(steps, "w4", 2), chunk(0, data[:half])],
                           [part_msg("w4", 1, 3, half, data[half:])], bad,
                           "part.count is 3", "says 2", second_code=bad)
        # the first call's own part breaks the rules: the extra call ends with ABORTED
        await refused_pair([first_msg(steps, "w5", 2), chunk(0, data[: half + 4])],
                           [part_msg("w5", 1, 2, half, data[half:])], bad, "part 0: chunk 1 ends at byte")
        # the request is refused before any data: the extra call waiting for it ends at once
        bad_ids = [prefill("m", 100)]
        bad_ids[0].token_ids[7] = V + 1
        await refused_pair([first_msg(bad_ids, "w6", 2)], [part_msg("w6", 1, 2, half, data[half:])], bad,
                           "token_ids[7]")
        # (refused before its upload was registered: the extra call waits for a first part that never comes, until
        # its own deadline, here 1 s; the drafter's --chunked-upload-timeout-s ends it otherwise)
        await refused_pair([first_msg(steps, "w7", 2) + pb.ProposeChunk(
            part=pb.UploadPart(namespace="other")).SerializeToString()], [part_msg("w7", 1, 2, half, data[half:])],
                           bad, "part.namespace is 'other'", second_code=grpc.StatusCode.DEADLINE_EXCEEDED,
                           second_timeout=1.0)
        # malformed parts, alone
        for msg, frag in [(part_msg("x", 1, 1, 0, b""), "part.count is 1"),
                          (part_msg("x", 1, MAX_UPLOAD_PARTS + 1, 0, b""), f"2 to {MAX_UPLOAD_PARTS} calls"),
                          (part_msg("x", 2, 2, 0, b""), "part.index is 2"),
                          (part_msg("", 1, 2, 0, b""), "part.upload_id has 0 characters"),
                          (part_msg("x" * 129, 1, 2, 0, b""), "part.upload_id has 129"),
                          (header(steps) + part_msg("x", 1, 2, 0, b""), "chunk 0 of part 1 has a request")]:
            with pytest.raises(DrafterError) as e:
                await raw(c, rpc2, [msg])
            assert e.value.code == bad and frag in e.value.message, e.value
        # a part inside a later chunk, and the same upload id twice in flight
        await refused_pair([first_msg(steps, "w8", 2), chunk(0, data[:10]),
                            pb.ProposeChunk(offset=10, data=data[10:half],
                                            part=pb.UploadPart(upload_id="w8")).SerializeToString()],
                           [part_msg("w8", 1, 2, half, data[half:])], bad, "part 0: chunk 2 has a part")
        await ch.close()
        # nothing stays: the drafter is unharmed
        assert (await c.propose([prefill("after")])).sequences[0].ok
    servicer = server.server.servicer
    assert servicer.staging.in_flight == 0 and servicer.uploads.uploads == {} and servicer.uploads.waiting == {}


async def test_missing_parts_time_out_and_waiting_parts_are_bounded(tiny_model, tmp_path):
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path, chunked_upload_timeout_s=0.5)) as srv:
        steps = [prefill("s")]
        data = states_bytes(steps)
        half = upload_part_range(NBYTES, 2, 1)[0]
        async with DrafterClient(srv.tcp, namespace="raw", chunk_min_bytes=0) as c:
            ch, rpc2 = await second_rpc(c)
            # the extra call never comes: the step ends with DEADLINE_EXCEEDED
            with pytest.raises(DrafterError) as e:
                await raw(c, c._propose_chunked, [first_msg(steps, "m1", 2), chunk(0, data[:half])])
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "--chunked-upload-timeout-s" in e.value.message
            # the first call never comes: the extra call ends with DEADLINE_EXCEEDED
            with pytest.raises(DrafterError) as e:
                await raw(c, rpc2, [part_msg("m2", 1, 2, half, data[half:])])
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            # extra calls of at most MAX_WAITING_UPLOADS uploads wait at once per namespace
            from drafter_service.transport.chunked import MAX_WAITING_UPLOADS
            waits = [asyncio.ensure_future(raw(c, rpc2, [part_msg(f"w{i}", 1, 2, half, data[half:])]))
                     for i in range(MAX_WAITING_UPLOADS + 1)]
            outcomes = await asyncio.gather(*waits, return_exceptions=True)
            codes = sorted(o.code.name for o in outcomes)
            assert codes.count("RESOURCE_EXHAUSTED") == 1 and codes.count("DEADLINE_EXCEEDED") == MAX_WAITING_UPLOADS
            await ch.close()
            servicer = srv.server.servicer
            assert servicer.staging.in_flight == 0 and servicer.uploads.uploads == {}
            assert servicer.uploads.waiting == {} and servicer.uploads.waiters == {}
            assert (await c.propose([prefill("s2")])).sequences[0].ok


async def test_a_spread_upload_cut_by_the_deadline_leaves_nothing_behind(server):
    """The step's deadline passes mid-upload: the client cancels every call of it (a fallback result), and the
    drafter frees the staging bytes and forgets the upload; the next spread step works."""
    big = prefill("late", rows=1000)  # 256 kB of states in 1 KiB chunks over 4 calls
    async with DrafterClient(server.tcp, namespace="late", chunk_min_bytes=0, chunk_bytes=1024, upload_streams=4,
                             upload_streams_min_bytes=0) as c:
        r = await c.propose([big], timeout=0.002)
        assert r.fallback and not r.sequences[0].ok
        servicer = server.server.servicer
        for _ in range(500):
            if servicer.staging.in_flight == 0 and not servicer.uploads.uploads and not servicer.uploads.waiting:
                break
            await asyncio.sleep(0.01)
        assert servicer.staging.in_flight == 0 and servicer.uploads.uploads == {} and servicer.uploads.waiting == {}
        c.breaker.success()  # (the missed deadline opened the breaker: close it for the next step)
        r = await c.propose([prefill("late2", rows=1000)], timeout=30)
        assert r.sequences[0].ok and c.steps_spread == 1, (r.fallback_reason, r.sequences[0].message)


async def test_the_same_upload_id_in_two_namespaces_are_two_uploads(server):
    """Uploads are keyed by (namespace, upload_id): two clients that pick the same id do not mix their bytes."""
    outcomes = {}
    async with DrafterClient(server.tcp, namespace="ns-x", chunk_min_bytes=0) as x, \
            DrafterClient(server.tcp, namespace="ns-y", chunk_min_bytes=0) as y:
        ch, rpc2 = await second_rpc(x)

        async def upload(client, ns, seed):
            steps = [prefill("same", 100, seed=seed)]
            data = states_bytes(steps)
            half = upload_part_range(len(data), 2, 1)[0]
            first = header(steps, namespace=ns) + pb.ProposeChunk(
                part=pb.UploadPart(upload_id="dup", index=0, count=2)).SerializeToString()
            r0, r1 = await asyncio.gather(raw(client, client._propose_chunked, [first, chunk(0, data[:half])]),
                                          raw(client, rpc2, [part_msg("dup", 1, 2, half, data[half:], ns)]))
            outcomes[ns] = parse_response(r0).draft_token_ids.tolist()
            async with DrafterClient(server.tcp, namespace=f"{ns}-ref", chunk_min_bytes=None) as ref:
                want = (await ref.propose([prefill("same", 100, seed=seed)])).draft_token_ids.tolist()
            assert outcomes[ns] == want, ns

        await asyncio.gather(upload(x, "ns-x", 11), upload(y, "ns-y", 12))
        await ch.close()
    assert outcomes["ns-x"] != outcomes["ns-y"]


async def test_max_upload_parts_1_turns_spreading_off(tiny_model, tmp_path):
    from drafter_service.cli import parse_args

    assert parse_args(["--max-upload-parts", "3"]).max_upload_parts == 3
    for bad in (0, 65):
        with pytest.raises(ValueError, match="max_upload_parts"):
            ServerConfig(model="m", max_upload_parts=bad)
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path, max_upload_parts=1)) as srv:
        async with DrafterClient(srv.tcp, namespace="raw", chunk_min_bytes=0, upload_streams=4,
                                 upload_streams_min_bytes=0) as c:
            assert (await c.get_info()).max_upload_parts == 1
            assert (await c.propose([prefill("one")])).sequences[0].ok
            assert (c.steps_chunked, c.steps_spread) == (1, 0)  # the client asked GetInfo and sent one call
            steps = [prefill("m", 100)]
            with pytest.raises(DrafterError) as e:
                await raw(c, c._propose_chunked, [first_msg(steps, "u", 2), chunk(0, states_bytes(steps))])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-upload-parts 1" in e.value.message
