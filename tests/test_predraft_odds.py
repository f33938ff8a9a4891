"""Pre-drafting's odds check (drafter_service/engine/predraft_odds.py): passes only after step batches whose
pre-drafting sequences are all likely to hit, since a batch is answered when its last sequence is."""
import random

import pytest
import torch

from conftest import make_config
from drafter_service.engine.predraft_odds import PRIOR_HIT_RATE, OddsCheck
from drafter_service.engine.step_io import StepInput
from drafter_service.runtime import build_runtime
from naive_eagle import NaiveEagle1
from naive_predraft import Naive, picker

NS = "odds"


def test_the_odds_are_the_hit_rate_to_the_batch_size():
    check = OddsCheck(min_all_hit=0.25, probe_after=3)
    assert check.hit_rate == pytest.approx(PRIOR_HIT_RATE)
    assert check.all_hit(4) == pytest.approx(PRIOR_HIT_RATE ** 4)
    assert check.decide(1) and check.allowed  # 0.85
    assert check.decide(8)  # 0.27
    assert not check.decide(16) and not check.allowed  # 0.07: a batch of 16 mostly waits for a miss
    assert check.decide(1) and check.allowed  # sizes are decided apart
    for _ in range(200):
        check.observe(True)
    assert check.hit_rate > 0.98 and check.decide(64)  # hits all the time: even 64 sequences all hit
    for _ in range(200):
        check.observe(False)
    assert check.hit_rate < 0.02 and not check.decide(1)
    assert OddsCheck(min_all_hit=0.0).decide(10_000)  # 0: the check is off


def test_a_refused_size_comes_back_only_clearly_above_the_threshold():
    """Odds hovering at the threshold do not flip the decision every step: a refused size needs 1.25x the
    threshold to come back on."""
    check = OddsCheck(min_all_hit=0.25)
    check._hits, check._outcomes = 0.5, 1.0  # h = 0.5: batch 2 at 0.25 (on), batch 3 at 0.125 (off)
    assert check.decide(2) and not check.decide(3)
    check._hits = 0.6  # h = 0.6: batch 2 at 0.36, batch 3 at 0.216: still off (below 0.3125)
    assert check.decide(2) and not check.decide(3)
    check._hits = 0.7  # batch 3 at 0.343: on again
    assert check.decide(3)
    check._hits = 0.64  # batch 3 at 0.262: stays on (above 0.25)
    assert check.decide(3)


def test_a_refused_size_is_probed_now_and_then():
    """A size refused probe_after times in a row is let through once (its pass measures the hit rate again), then
    refused again while the estimate stays low."""
    check = OddsCheck(min_all_hit=0.25, probe_after=3)
    for _ in range(50):
        check.observe(False)
    decisions = [check.decide(4) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]
    check.decide(1)  # (another size does not reset the count of this one)
    assert [check.decide(4) for _ in range(4)] == [False, False, False, True]


def test_a_refused_batch_keeps_nothing_and_later_steps_stay_plain(tiny_model, tmp_path):
    """Four pre-drafting sequences: a pass, a step of three hits and a miss, then (the hit rate now measured low) a
    step whose batch the check refuses: it keeps nothing for a pass (counted), the hits' pending rows ride with that
    step, and every answer that is not predrafted equals the plain naive drafts (the KV is what plain drafting holds)."""
    head, target = tiny_model
    naive = Naive(NaiveEagle1(head, target))
    rt = build_runtime(make_config(head, target, tmp_path, max_model_len=512))
    proposer = rt.proposer
    pd = proposer.predraft
    assert pd.odds.min_all_hit == 0.25  # the default
    width, vocab = rt.limits.hidden_states_width, rt.limits.vocab_size
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    k = 3
    seqs = {}
    for sid in "abcd":
        P = rng.choice([6, 13])
        seqs[sid] = dict(tokens=[rng.randrange(vocab) for _ in range(P + 1)], hidden=torch.randn(P, width, generator=gen))

    def step(sid: str) -> StepInput:
        t, h, p = seqs[sid]["tokens"], seqs[sid]["hidden"], seqs[sid].get("sent", 0)
        C = len(t) - 1
        seqs[sid]["sent"] = C
        return StepInput(NS, sid, p, torch.tensor(t[p:C]), h[p:C], t[C], k, predraft_branches=8)

    def plain(sid: str) -> list[int]:
        t, h = seqs[sid]["tokens"], seqs[sid]["hidden"]
        return naive.drafts(t, h, [], k, picker(0.0, 0, len(t) - 1))

    def advance(sid: str, hit: bool) -> None:
        st = proposer.table.get(NS, sid).predraft
        d = seqs[sid]["drafts"]
        if hit:
            a, b = next(iter(st.branches.outcomes))
        else:
            a = rng.randint(0, k)
            b = next(t for t in range(vocab) if (a == k or t != d[a])
                     and (st.branches is None or (a, t) not in st.branches.outcomes))
        seqs[sid]["tokens"] += d[:a] + [b]
        seqs[sid]["hidden"] = torch.cat([seqs[sid]["hidden"], torch.randn(a + 1, width, generator=gen)])

    def run(sids) -> list:
        outs = proposer.step([step(sid) for sid in sids])
        for sid, out in zip(sids, outs):
            assert out.code == 0, out.message
            if not out.predrafted:
                assert out.drafts == plain(sid), sid
            seqs[sid]["drafts"] = out.drafts
        return outs

    run("abcd")
    assert pd.has_work() and pd.prepare(lambda: False)  # 0.85^4: the pass runs
    for sid, hit in zip("abcd", (True, True, True, False)):
        advance(sid, hit)
    outs = run("abcd")
    assert [o.predrafted for o in outs] == [True, True, True, False]
    assert pd.counters.hits == 3 and pd.counters.misses == 1 and pd.counters.refused_by_odds == 0
    for _ in range(60):  # the hit rate measured low from now on
        pd.odds.observe(False)
    for sid in "abcd":  # no pass ran: the hits' rows are still pending and ride with this step
        advance(sid, False)
    outs = run("abcd")
    assert not any(o.predrafted for o in outs)
    assert pd.counters.refused_by_odds == 1 and not pd.has_work()
    assert all(proposer.table.get(NS, sid).predraft.basis is None for sid in "abcd")
    for sid in "abcd":
        advance(sid, False)
    run("abcd")  # plain again, the KV as plain drafting holds it
    assert pd.counters.refused_by_odds == 2 and pd.counters.passes == 1
    assert pd.counters.unprepared == 8
    # one sequence alone is likely enough to hit: its batch keeps what a pass needs
    for _ in range(60):
        pd.odds.observe(True)
    advance("a", False)
    run("a")
    assert pd.has_work() and pd.prepare(lambda: False) and pd.counters.passes == 2
    for sid in "abcd":
        proposer.table.release(NS, sid)
    assert proposer.kv.pool.num_free == proposer.kv.pool.num_blocks


def test_a_large_batch_falls_back_through_the_server_and_the_metric_says_so(tiny_model, tmp_path):
    """Through gRPC: 16 sequences asking for pre-drafting are refused on the prior (0.85^16 = 0.07), answered as plain
    steps (none predrafted), and /metrics counts the refused batches; one sequence alone is prepared."""
    import asyncio

    from conftest import ServerThread
    from drafter_client import DrafterClient, SequenceStep

    head, target = tiny_model
    gen = torch.Generator().manual_seed(9)

    def steps(ids, p, m):
        return [SequenceStep(sid, p, list(range(10, 10 + m)), torch.randn(m, 64, generator=gen), 3, 3,
                             predraft_branches=8) for sid in ids]

    async def run(srv) -> list[bool]:
        async with DrafterClient(srv.uds, namespace="odds") as c:
            many = [f"s{i}" for i in range(16)]
            await c.propose(steps(many, 0, 5))
            r = await c.propose(steps(many, 5, 2))
            assert all(s.ok for s in r.sequences)
            return [s.predrafted for s in r.sequences]

    with ServerThread(make_config(head, target, tmp_path)) as srv:
        assert not any(asyncio.run(run(srv)))
        text = srv.server.runtime.metrics.prometheus_text()
        refused = [line for line in text.splitlines() if line.startswith("drafter_predraft_refused_by_odds_total")]
        assert refused and float(refused[0].split()[-1]) == 2.0, refused
        assert srv.call(lambda: srv.server.runtime.proposer.predraft.has_work()) is False
