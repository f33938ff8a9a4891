"""Untrusted input: every malformed request gets a status naming the field; neighbours and state are unharmed."""
import grpc
import pytest
import torch

from drafter_client import DrafterClient, DrafterError, SequenceStep
from drafter_client.client import build_request
from drafter_client.protocol import pb, pb_grpc

H, V = 64, 512


def step(sid, p=0, m=4, nxt=1, k=3, hidden=None, tokens=None):
    tokens = tokens if tokens is not None else list(range(10, 10 + m))
    hidden = hidden if hidden is not None else torch.randn(m, H)
    return SequenceStep(sid, p, tokens, hidden, nxt, k)


async def refused(client, req_or_steps, code, *fragments):
    with pytest.raises(DrafterError) as e:
        if isinstance(req_or_steps, list):
            await client.propose(req_or_steps)
        else:
            try:
                await client._stub.Propose(req_or_steps)
            except grpc.aio.AioRpcError as err:
                raise DrafterError(err.code(), err.details()) from None
    assert e.value.code == code, e.value
    for f in fragments:
        assert f in e.value.message, e.value.message
    return e.value


@pytest.fixture
async def client(server):
    async with DrafterClient(server.tcp, namespace="bad") as c:
        yield c


async def test_request_level_errors_name_the_field(client):
    good = build_request("bad", [step("a")])

    r = pb.ProposeRequest(); r.CopyFrom(good); r.hidden_states.dtype = pb.INT32
    await refused(client, r, grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.dtype", "INT32")
    r = pb.ProposeRequest(); r.CopyFrom(good); r.token_ids.dtype = pb.FLOAT32
    await refused(client, r, grpc.StatusCode.INVALID_ARGUMENT, "token_ids.dtype")
    r = pb.ProposeRequest(); r.CopyFrom(good); r.hidden_states.raw = r.hidden_states.raw[:-3]
    await refused(client, r, grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.raw", "bytes")
    r = pb.ProposeRequest(); r.CopyFrom(good); del r.hidden_states.shape[:]; r.hidden_states.shape.extend([4, H, 1])
    await refused(client, r, grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.shape", "2 dimensions")
    r = pb.ProposeRequest(); r.CopyFrom(good); r.steps[0].num_tokens = 5
    await refused(client, r, grpc.StatusCode.INVALID_ARGUMENT, "token_ids has 4 rows", "add up to 5")
    r = pb.ProposeRequest(); r.CopyFrom(good); r.hidden_states.shm.region = "x"
    r.hidden_states.shm.byte_size = 4 * H * 4
    await refused(client, r, grpc.StatusCode.NOT_FOUND, "hidden_states.shm.region", "'x'")  # more: test_shared_memory

    await refused(client, [step("a", hidden=torch.randn(4, H + 1))], grpc.StatusCode.INVALID_ARGUMENT,
                  "hidden_states has 65 columns", "64")
    await refused(client, [step("a", tokens=[1, 2, V, 3])], grpc.StatusCode.INVALID_ARGUMENT, "token_ids[2]",
                  "vocabulary")
    await refused(client, [step("a", tokens=[1, -1, 2, 3])], grpc.StatusCode.INVALID_ARGUMENT, "token_ids[1]")
    await refused(client, [step("a", nxt=V + 7)], grpc.StatusCode.INVALID_ARGUMENT, "steps[0].next_token")
    await refused(client, [step("a", p=-1)], grpc.StatusCode.INVALID_ARGUMENT, "steps[0].start_position")
    await refused(client, [step("a", k=9)], grpc.StatusCode.INVALID_ARGUMENT, "steps[0].num_drafts", "at most 8")
    await refused(client, [step("a"), step("a")], grpc.StatusCode.INVALID_ARGUMENT, "steps[1].sequence_id",
                  "twice")
    await refused(client, [step("")], grpc.StatusCode.INVALID_ARGUMENT, "steps[0].sequence_id is empty")
    await refused(client, [step("x" * 300)], grpc.StatusCode.INVALID_ARGUMENT, "steps[0].sequence_id")


async def test_oversized_message_is_resource_exhausted(server, tiny_model, tmp_path):
    from conftest import ServerThread, make_config

    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path, max_message_bytes=64 * 1024)) as small:
        async with DrafterClient(small.tcp, namespace="big") as c:
            with pytest.raises(DrafterError) as e:
                await c.propose([step("a", m=400, tokens=list(range(400)), hidden=torch.randn(400, H))])
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            # the server is unharmed: a normal step still works
            r = await c.propose([step("a")])
            assert r.sequences[0].ok and r.sequences[0].drafts.numel() == 3


async def test_too_many_tokens_in_one_request(server, tiny_model, tmp_path):
    from conftest import ServerThread, make_config

    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path, max_batch_tokens=32)) as s:
        async with DrafterClient(s.tcp) as c:
            with pytest.raises(DrafterError) as e:
                await c.propose([step("a", m=20, tokens=list(range(20)), hidden=torch.randn(20, H)),
                                 step("b", m=20, tokens=list(range(20)), hidden=torch.randn(20, H))])
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 32" in e.value.message


async def test_per_sequence_statuses_leave_neighbours_intact(client, tiny_model):
    from naive_eagle import NaiveEagle1

    naive = NaiveEagle1(*tiny_model)
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, V, (9,), generator=g).tolist()
    hid = torch.randn(8, H, generator=g)
    ok0 = SequenceStep("n-ok", 0, toks[:8], hid, toks[8], 4)
    r = await client.propose([ok0])
    assert r.sequences[0].ok
    first = r.sequences[0].drafts.tolist()
    assert first == naive.drafts(toks, hid, 4)

    # One request mixing: an unknown sequence, a gap, a too-long step, and the good neighbour re-sending p=4.
    resend = SequenceStep("n-ok", 4, toks[4:8], hid[4:8], toks[8], 4)
    r = await client.propose([
        SequenceStep("never-started", 3, [1], torch.randn(1, H), 2, 2),
        SequenceStep("n-ok-gap", 0, [1, 2], torch.randn(2, H), 3, 1),
        resend,
    ])
    assert r.sequences[0].code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "unknown sequence" in r.sequences[0].message and "never-started" in r.sequences[0].message
    assert r.sequences[1].ok
    assert r.sequences[2].ok and r.sequences[2].drafts.tolist() == first  # same inputs, same drafts

    r = await client.propose([SequenceStep("n-ok-gap", 5, [1], torch.randn(1, H), 3, 1)])
    assert r.sequences[0].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "gap" in r.sequences[0].message and "committed length 2" in r.sequences[0].message

    r = await client.propose([SequenceStep("long", 0, [1] * 3, torch.randn(3, H), 3, 1),
                              SequenceStep("n-ok", 8, [toks[8]], torch.randn(1, H), 7, 2)])
    assert r.sequences[0].ok
    r = await client.propose([SequenceStep("long", 3, [1] * 1021, torch.randn(1021, H), 3, 1)])
    assert r.sequences[0].code == grpc.StatusCode.OUT_OF_RANGE.value[0] and "max_model_len" in r.sequences[0].message
    rel = await client.release(["n-ok", "n-ok-gap", "long", "nope"])
    assert rel.released == 3 and rel.not_found == ["nope"]


async def test_pool_full_is_a_per_sequence_status(tiny_model, tmp_path):
    from conftest import ServerThread, make_config

    head, target = tiny_model
    # 1024 tokens of pool (= max_model_len), block 16: 64 blocks.
    with ServerThread(make_config(head, target, tmp_path, kv_cache_tokens=1024)) as s:
        async with DrafterClient(s.tcp) as c:
            big = SequenceStep("big", 0, [i % 500 for i in range(900)], torch.randn(900, H), 5, 4)
            r = await c.propose([big])
            assert r.sequences[0].ok
            small = SequenceStep("small", 0, list(range(10)), torch.randn(10, H), 5, 4)
            huge = SequenceStep("huge", 0, list(range(200)), torch.randn(200, H), 5, 4)
            # "big" steps in the same batch: it is not idle, so it cannot be evicted (tests/test_leases.py) to make
            # room for "huge"
            big_next = SequenceStep("big", 900, [5], torch.randn(1, H), 6, 4)
            r = await c.propose([big_next, huge, small])
            assert r.sequences[0].ok
            assert r.sequences[1].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "KV pool full" in r.sequences[1].message
            assert r.sequences[2].ok and r.sequences[2].drafts.numel() == 4
            # the refused sequence was not created: it is unknown now
            r = await c.propose([SequenceStep("huge", 5, [1], torch.randn(1, H), 2, 1)])
            assert r.sequences[0].code == grpc.StatusCode.NOT_FOUND.value[0]
            await c.release(["big"])
            r = await c.propose([huge])
            assert r.sequences[0].ok


async def test_stream_keeps_going_after_a_bad_message(client):
    async with client.stream() as session:
        with pytest.raises(DrafterError) as e:
            await session.propose([step("s1", k=99)])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "num_drafts" in e.value.message
        r = await session.propose([step("s1")])
        assert r.sequences[0].ok and r.sequences[0].drafts.numel() == 3
    await client.release(["s1"])


async def test_release_validates(client):
    with pytest.raises(DrafterError) as e:
        await client.release([""])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sequence_ids[0]" in e.value.message


async def test_a_failing_batch_answers_internal_and_leaves_no_stale_state(tiny_model, tmp_path):
    """If the draft step raises, every sequence of that batch gets INTERNAL (the RPC still answers), new
    sequences are dropped, known ones must be re-sent from the failed step's start, and the server keeps going."""
    from conftest import ServerThread, make_config

    with ServerThread(make_config(*tiny_model, tmp_path)) as s:
        async with DrafterClient(s.tcp) as c:
            r = await c.propose([step("old", m=6, tokens=list(range(6)))])
            assert r.sequences[0].ok
            proposer = s.server.runtime.proposer
            real_run = proposer._run

            def broken(batch):
                raise RuntimeError("injected failure")

            s.call(setattr, proposer, "_run", broken)
            r = await c.propose([step("new"), step("old", p=6, m=1, tokens=[7])])
            assert [x.code for x in r.sequences] == [grpc.StatusCode.INTERNAL.value[0]] * 2
            assert "injected failure" in r.sequences[0].message
            s.call(setattr, proposer, "_run", real_run)
            r = await c.propose([step("new", p=2, m=1, tokens=[1])])
            assert r.sequences[0].code == grpc.StatusCode.NOT_FOUND.value[0]  # the new one was dropped
            r = await c.propose([step("old", p=6, m=1, tokens=[7])])
            assert r.sequences[0].ok  # re-sent from the failed step's start: fine
            assert s.call(lambda: proposer.kv.pool.num_free) < proposer.kv.pool.num_blocks
            await c.release(["old"])
            assert s.call(lambda: proposer.kv.pool.num_free) == proposer.kv.pool.num_blocks
