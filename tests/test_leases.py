"""Sequence lifetime (docs/protocol.md, "Sequence lifetime: leases, eviction, quotas"): one client can never starve
another. Idle sequences are evicted least recently used first when the pool is short, a sequence no step touched for
the lease is freed, the sequences a stream or a step channel created go when it ends, quotas are per-sequence
RESOURCE_EXHAUSTED naming the quota, and the drafts of the sequences that survive stay exactly the naive ones.
"""
import random
import time

import grpc
import pytest
import torch

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, SequenceStep
from drafter_client.client import build_request
from drafter_client.protocol import pb_grpc
from drafter_service.config import ServerConfig
from drafter_service.engine.step_io import NOT_FOUND, OK, RESOURCE_EXHAUSTED, StepInput
from drafter_service.runtime import build_runtime
from fake_engine import FakeSequence
from naive_eagle import NaiveEagle1

H, V = 64, 512
NOT_FOUND_CODE = grpc.StatusCode.NOT_FOUND.value[0]
EXHAUSTED_CODE = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def step(sid, p=0, m=4, nxt=1, k=3):
    return SequenceStep(sid, p, [(10 + i) % V for i in range(m)], torch.randn(m, H), nxt, k)


def wait_until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def table_of(server: ServerThread):
    return server.server.runtime.proposer.table


@pytest.fixture
def small_server(tiny_model, tmp_path):
    """The pool of the measured problem: 640 tokens (40 blocks of 16), max_model_len 256."""
    with ServerThread(make_config(*tiny_model, tmp_path, kv_cache_tokens=640, max_model_len=256)) as s:
        yield s


# ---- in the engine, with a clock of our own ----


def _inputs(ns, sid, p, m, k=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return StepInput(ns, sid, p, torch.randint(0, V, (m,), generator=g), torch.randn(m, H, generator=g), 7, k)


def test_lru_eviction_order_lease_and_config(tiny_model, tmp_path):
    # 256 tokens of pool: 16 blocks of 16; a sequence of 16 committed tokens and k = 1 holds one block
    rt = build_runtime(make_config(*tiny_model, tmp_path, kv_cache_tokens=256, max_model_len=128,
                                   sequence_lease_s=10.0))
    proposer, table = rt.proposer, rt.proposer.table
    now = [100.0]
    proposer.clock = lambda: now[0]
    outs = proposer.step([_inputs("ns", f"s{i}", 0, 16, seed=i) for i in range(16)])
    assert [o.code for o in outs] == [OK] * 16 and rt.kv.pool.num_free == 0
    now[0] = 101.0
    outs = proposer.step([_inputs("ns", f"s{i}", 15, 1) for i in (0, 1, 2, 3)])  # s0..s3: used again
    assert [o.code for o in outs] == [OK] * 4
    # a new sequence of 40 positions needs 3 blocks: the 3 least recently used idle ones go (s4, s5, s6)
    now[0] = 102.0
    outs = proposer.step([_inputs("other", "big", 0, 40), _inputs("ns", "s7", 15, 1)])
    assert [o.code for o in outs] == [OK, OK]
    gone = [f"s{i}" for i in range(16) if table.get("ns", f"s{i}") is None]
    assert gone == ["s4", "s5", "s6"] and table.counters.evicted == 3
    assert "evicted" in table.why_gone("ns", "s4")
    out = proposer.step([_inputs("ns", "s4", 15, 1)])[0]
    assert out.code == NOT_FOUND and "evicted" in out.message and "start_position 0" in out.message
    out = proposer.step([_inputs("ns", "s4", 0, 16)])[0]  # start_position 0 re-creates it (evicting s8)
    assert out.code == OK and table.why_gone("ns", "s4") is None and table.get("ns", "s8") is None
    # nothing idle left to evict: a step of every sequence plus a new one is refused, the others are served
    live = [(sq.namespace, sq.sequence_id) for sq in table._seqs.values()]
    outs = proposer.step([_inputs(ns, sid, 15, 1) for ns, sid in live if sid != "big"]
                         + [_inputs("other", "big", 39, 1), _inputs("ns", "late", 0, 16)])
    assert [o.code for o in outs[:-1]] == [OK] * (len(outs) - 1)
    assert outs[-1].code == RESOURCE_EXHAUSTED and "KV pool full" in outs[-1].message
    assert table.counters.pool_refusals == 1

    # the lease: the order is last-use order, so expiry looks at the head only
    blocks = rt.kv.pool.num_blocks
    now[0] = 105.0
    proposer.step([_inputs("ns", "s0", 15, 1)])
    assert proposer.expire_idle() == 0
    assert proposer.expiry_wait() == pytest.approx(10.0 - 3.0)  # the oldest was used at 102
    now[0] = 112.5  # everything but s0 (used at 105) is past its lease
    assert proposer.expire_idle() == len(live) - 1
    assert [sq.sequence_id for sq in table._seqs.values()] == ["s0"]
    out = proposer.step([_inputs("ns", "s1", 15, 1)])[0]
    assert out.code == NOT_FOUND and "expired" in out.message and "--sequence-lease-s" in out.message
    now[0] = 120.0
    assert proposer.expire_idle() == 1 and len(table) == 0 and rt.kv.pool.num_free == blocks
    assert proposer.expiry_wait() is None  # nothing live: the step thread sleeps until woken
    assert table.counters.expired == len(live)

    for bad in (dict(sequence_lease_s=-1), dict(namespace_pool_share=0.0), dict(namespace_pool_share=1.5),
                dict(max_sequences=-1), dict(max_sequences_per_namespace=-2)):
        with pytest.raises(ValueError):
            ServerConfig(model="m", **bad)


# ---- through the server ----


async def test_a_client_that_vanishes_without_release_cannot_starve_another(small_server, tiny_model):
    """The measured problem: client A opens 60 sequences and goes away without Release; B still gets drafts."""
    naive = NaiveEagle1(*tiny_model)
    async with DrafterClient(small_server.tcp, namespace="A") as a:
        for r in range(6):  # 60 sequences of 12 tokens, 10 a request; 40 blocks: A evicts its own oldest
            res = await a.propose([step(f"a{r * 10 + i}", m=12) for i in range(10)])
            assert all(x.ok for x in res.sequences), res
    # A is gone (no Release); the pool is full of its idle sequences
    assert small_server.call(lambda: small_server.server.runtime.kv.pool.num_free) == 0
    assert table_of(small_server).counters.evicted == 20
    g = torch.Generator().manual_seed(3)
    async with DrafterClient(small_server.uds, namespace="B") as b:
        steps, tokens = [], []
        for i in range(4):
            toks = torch.randint(0, V, (41,), generator=g).tolist()
            steps.append(SequenceStep(f"b{i}", 0, toks[:40], torch.randn(40, H, generator=g), toks[40], 4))
            tokens.append(toks)
        res = await b.propose(steps)
        for s, toks, x in zip(steps, tokens, res.sequences):
            assert x.ok, x
            assert x.drafts.tolist() == naive.drafts(toks, s.hidden_states, 4)
        await b.release([s.sequence_id for s in steps])
    # the oldest of A's remaining sequences were evicted for B, and say so
    async with DrafterClient(small_server.tcp, namespace="A") as a:
        res = await a.propose([step("a20", p=12, m=1)])
        assert res.sequences[0].code == NOT_FOUND_CODE and "evicted" in res.sequences[0].message
        res = await a.propose([step("never", p=3, m=1)])
        assert "unknown sequence" in res.sequences[0].message and "evicted" not in res.sequences[0].message


async def test_an_expired_lease_frees_the_sequence(tiny_model, tmp_path):
    with ServerThread(make_config(*tiny_model, tmp_path, sequence_lease_s=1.0)) as s:
        table = table_of(s)
        async with DrafterClient(s.tcp, namespace="lease") as c:
            assert (await c.propose([step("e1"), step("e2")])).sequences[0].ok
            # nothing wakes the step thread from here on: it wakes itself when the lease can run out
            wait_until(lambda: table.counters.expired == 2)
            assert len(table) == 0
            res = await c.propose([step("e1", p=4, m=1)])
            assert res.sequences[0].code == NOT_FOUND_CODE and "expired" in res.sequences[0].message
            assert (await c.propose([step("e1")])).sequences[0].ok  # start_position 0: a new one
            await c.release(["e1"])
        free = s.call(lambda: s.server.runtime.kv.pool.num_free)
        assert free == s.server.runtime.kv.pool.num_blocks


async def test_a_stream_that_ends_frees_the_sequences_it_created(small_server):
    table = table_of(small_server)
    async with DrafterClient(small_server.tcp, namespace="st") as c:
        assert (await c.propose([step("unary")])).sequences[0].ok  # unary: the lease and eviction cover it
        # 1: the client ends the stream
        async with c.stream() as session:
            r = await session.propose([step("s1"), step("s2")])
            assert all(x.ok for x in r.sequences)
            r = await session.propose([step("unary", p=4, m=1)])  # a step through the stream does not adopt it
            assert r.sequences[0].ok
        # (the step thread counts them after dropping the last: wait for the count, not only for the table)
        wait_until(lambda: table.namespace_sequences("st") == 1 and table.counters.owner_closed == 2)
        assert table.get("st", "unary") is not None
        res = await c.propose([step("s1", p=4, m=1)])
        assert res.sequences[0].code == NOT_FOUND_CODE and "stream" in res.sequences[0].message
        # 2: the client vanishes (its connection closes with the stream open)
        channel = grpc.aio.insecure_channel(small_server.tcp)
        call = pb_grpc.DrafterStub(channel).ProposeStream()
        await call.write(build_request("st", [step("s3"), step("s4")]))
        reply = await call.read()
        assert len(reply.results) == 2 and not any(x.HasField("status") for x in reply.results)
        assert table.namespace_sequences("st") == 3
        await channel.close()
        wait_until(lambda: table.namespace_sequences("st") == 1 and table.counters.owner_closed == 4)
        await c.release(["unary"])


async def test_a_step_channel_whose_client_goes_frees_the_sequences_it_created(small_server):
    table = table_of(small_server)
    async with DrafterClient(small_server.uds, namespace="ch") as c:
        assert (await c.propose([step("by-grpc")])).sequences[0].ok
        assert await c.open_step_channel()
        r = await c.propose([step("c1"), step("c2")])
        assert all(x.ok for x in r.sequences) and c.steps_through_channel == 1
        assert table.namespace_sequences("ch") == 3
        c.close_step_channel()
        wait_until(lambda: table.namespace_sequences("ch") == 1)
        assert table.get("ch", "by-grpc") is not None
        res = await c.propose([step("c1", p=4, m=1)])  # (over gRPC now)
        assert res.sequences[0].code == NOT_FOUND_CODE and "step channel" in res.sequences[0].message
        await c.release(["by-grpc"])


async def test_quotas_are_per_sequence_refusals_naming_the_quota(tiny_model, tmp_path):
    # 40 blocks; a namespace may hold 2 sequences and a quarter of the blocks (10)
    cfg = make_config(*tiny_model, tmp_path, kv_cache_tokens=640, max_model_len=256, max_sequences_per_namespace=2,
                      namespace_pool_share=0.25)
    with ServerThread(cfg) as s:
        table = table_of(s)
        async with DrafterClient(s.tcp, namespace="q") as q, DrafterClient(s.tcp, namespace="r") as r, \
                DrafterClient(s.tcp, namespace="w") as w:
            res = await q.propose([step("q1"), step("q2"), step("q3")])
            assert [x.code for x in res.sequences] == [0, 0, EXHAUSTED_CODE]
            assert "--max-sequences-per-namespace" in res.sequences[2].message and "'q'" in res.sequences[2].message
            # another namespace is not affected
            assert all(x.ok for x in (await r.propose([step("r1"), step("r2")])).sequences)
            # q at its count: a new one evicts q's own least recently used idle sequence, not r's
            assert (await q.propose([step("q2", p=4, m=1)])).sequences[0].ok
            assert (await q.propose([step("q3")])).sequences[0].ok
            assert table.get("q", "q1") is None and table.namespace_sequences("r") == 2
            res = await q.propose([step("q1", p=4, m=1)])
            assert res.sequences[0].code == NOT_FOUND_CODE and "evicted" in res.sequences[0].message
            assert "its namespace was at its quota" in res.sequences[0].message
            # the share of the pool: 10 blocks; 168 tokens and k = 3 need 170 positions: 11 blocks
            big = SequenceStep("big", 0, [1] * 168, torch.randn(168, H), 2, 3)
            res = await w.propose([big])
            assert res.sequences[0].code == EXHAUSTED_CODE
            assert "--namespace-pool-share 0.25" in res.sequences[0].message and "'w'" in res.sequences[0].message
            # room within the share is made by evicting the namespace's own idle sequences
            assert (await w.propose([step("mid", m=120)])).sequences[0].ok  # 122 positions: 8 blocks
            assert (await w.propose([step("w2", m=40)])).sequences[0].ok  # 3 more: 11 > 10, "mid" goes
            assert table.get("w", "mid") is None and table.namespace_blocks("w") == 3
            assert table.counters.quota_refusals == 2 and table.counters.evicted == 2
            assert table.namespace_sequences("r") == 2  # (r was never touched)
            await q.release(["q2", "q3"])
            await r.release(["r1", "r2"])
            await w.release(["w2"])
        assert s.call(lambda: s.server.runtime.kv.pool.num_free) == s.server.runtime.kv.pool.num_blocks
    cfg = make_config(*tiny_model, tmp_path, kv_cache_tokens=640, max_model_len=256, max_sequences=2)
    with ServerThread(cfg) as s:
        async with DrafterClient(s.tcp, namespace="g") as g:
            res = await g.propose([step("g1"), step("g2"), step("g3")])
            assert [x.code for x in res.sequences] == [0, 0, EXHAUSTED_CODE]
            assert "at most 2 (--max-sequences)" in res.sequences[2].message
            assert (await g.propose([step("g3")])).sequences[0].ok  # g1 and g2 idle now: g1 goes
            assert table_of(s).get("g", "g1") is None and len(table_of(s)) == 2


async def test_drafts_of_surviving_sequences_match_naive_while_others_are_evicted(tiny_model, tmp_path):
    """Three sequences step on (random acceptance, re-sent positions) while another namespace keeps opening
    sequences into a full pool: the churn's own oldest go, block by block reused around the survivors, whose drafts
    stay exactly the naive reference's."""
    naive = NaiveEagle1(*tiny_model)
    rng = random.Random(7)
    cfg = make_config(*tiny_model, tmp_path, kv_cache_tokens=1024, max_model_len=256)  # 64 blocks
    with ServerThread(cfg) as s:
        table = table_of(s)
        seqs = [FakeSequence(f"keep{i}", prompt, H, V, rng, chunk)
                for i, (prompt, chunk) in enumerate([(40, None), (33, 16), (7, None)])]
        checked = churned = 0
        async with DrafterClient(s.uds, namespace="keep") as keep, DrafterClient(s.tcp, namespace="churn") as churn:
            for n in range(24):
                batch = [sq.next_step(rng.randint(1, 4)) for sq in seqs]
                res = await keep.propose(batch)
                for sq, st, x in zip(seqs, batch, res.sequences):
                    assert x.ok, (sq.seq_id, x)
                    if st.num_drafts:
                        assert x.drafts.tolist() == naive.drafts(sq.tokens, sq.hidden, st.num_drafts)
                        checked += 1
                    sq.last_drafts = x.drafts.tolist()
                # 6 new sequences of 2 blocks each, every round: the pool is full after a few rounds
                res = await churn.propose([step(f"c{n}-{i}", m=30) for i in range(6)])
                assert all(x.ok for x in res.sequences)
                churned += 6
            assert table.counters.evicted > 20 and checked >= 40
            assert table.namespace_sequences("keep") == 3
            await keep.release([sq.seq_id for sq in seqs])
