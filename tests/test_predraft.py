"""Pre-drafting (drafter_service/engine/predraft.py, docs/predraft.md): prepared branches against a naive reference.

A simulated engine drives one proposer in-process over many steps with random outcomes (half of them picked among
the prepared branches, so that hits happen), random re-sent positions, and preparation passes run between steps
only some of the time (so that steps also find nothing prepared, and a hit's pending rows ride with the next step).
Every answer is checked against the cache-free naive reference (fp64):
  * a predrafted answer: the naive drafts of the branch, i.e. of the context up to the previous step's committed
    length C with the target's states, then the served drafts D_1..D_a and the bonus b with the head's own features
    in place of the states the drafter did not know when it prepared;
  * any other answer: the plain naive drafts with the target's states of every committed position: after any mix of
    hits and misses the drafter's KV is what plain drafting holds.
"""
import asyncio
import random
import time

import grpc
import pytest
import torch

from checkpoints import write_eagle3
from conftest import ServerThread, make_config
from drafter_client import DrafterClient, DrafterError, SequenceStep
from drafter_service.engine.cuda_graphs import DecodeGraphs
from drafter_service.engine.predraft import MAX_PREDRAFT_BRANCHES, PROBE_AFTER_SKIPS, fan_out
from drafter_service.engine.step_io import StepInput
from drafter_service.runtime import build_runtime
from naive_eagle import NaiveEagle1
from naive_eagle3 import NaiveEagle3
from naive_predraft import Naive, picker

NS = "predraft"


def heads(name, tiny_model, tmp_path):
    if name == "eagle1":
        head, target = tiny_model
        return head, target, NaiveEagle1(head, target)
    head, target = write_eagle3(tmp_path / "e3", seed=21)  # draft vocab 200 of 512 (d2t)
    return head, target, NaiveEagle3(head, target)


def test_fan_out_is_geometric_and_adds_up():
    assert fan_out(8, 3, 0.5) == [4, 2, 1, 1]
    for budget in (1, 4, 7, 16, 64):
        for k in (1, 3, 5):
            for alpha in (0.1, 0.5, 0.9):
                n = fan_out(budget, k, alpha)
                assert len(n) == k + 1 and sum(n) == budget and min(n) >= 0
    assert fan_out(10, 4, 0.95)[-1] > fan_out(10, 4, 0.95)[0]  # a good drafter: most branches on a = k


# static_decode: greedy branches run through the decode-graph buffers (cuda_graphs.DecodeGraphs.run_rows), which on
# the CPU run the captured step eagerly
# On CUDA the runtime captures the decode graphs itself: greedy branches replay them.
@pytest.mark.parametrize("method,temperature,static_decode,device", [
    ("eagle1", 0.0, False, "cpu"), ("eagle1", 0.0, True, "cpu"), ("eagle1", 0.8, False, "cpu"),
    ("eagle3", 0.0, True, "cpu"),
    pytest.param("eagle1", 0.0, True, "cuda", marks=pytest.mark.gpu),
    pytest.param("eagle1", 0.8, False, "cuda", marks=pytest.mark.gpu),
    pytest.param("eagle3", 0.0, True, "cuda", marks=pytest.mark.gpu)])
def test_branches_and_later_steps_match_naive(method, temperature, static_decode, device, tiny_model, tmp_path):
    head, target, ref = heads(method, tiny_model, tmp_path)
    naive = Naive(ref)
    rt = build_runtime(make_config(head, target, tmp_path, max_model_len=512, device=device))
    proposer = rt.proposer
    if static_decode and device == "cpu":
        proposer.decode_graphs = DecodeGraphs(proposer.model, proposer.kv_layers, rt.config.block_size,
                                              rt.max_model_len, 64, rt.dtype, rt.device, max_drafts=8)
    width, vocab = rt.limits.hidden_states_width, rt.limits.vocab_size
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    k, budget, seed = 3, 6, rng.randrange(2**64)
    counts = {"hit": 0, "plain": 0}
    for sid in ("a", "b"):
        P = rng.choice([5, 19])
        tokens = [rng.randrange(vocab) for _ in range(P + 1)]  # x[0..P]
        hidden = torch.randn(P, width, generator=gen)  # h[0..P-1] (on the CPU; the server copies them)

        def step(p: int) -> StepInput:
            C = len(tokens) - 1
            return StepInput(NS, sid, p, torch.tensor(tokens[p:C]), hidden[p:C], tokens[C], k, temperature=temperature,
                             seed=seed, predraft_branches=budget)

        def expect(prefix_len: int, forced: list[int]) -> list[int]:
            return naive.drafts(tokens[: prefix_len + 1], hidden[:prefix_len], forced, k,
                                picker(temperature, seed, prefix_len + len(forced)))

        out = proposer.step([step(0)])[0]
        assert out.code == 0 and not out.predrafted and out.drafts == expect(P, [])
        drafts = out.drafts
        for _ in range(24):
            C = len(tokens) - 1
            if rng.random() < 0.7:
                assert proposer.predraft.prepare(lambda: False)
            st = proposer.table.get(NS, sid).predraft
            outcomes = list(st.branches.outcomes) if st.branches is not None else []
            if outcomes and rng.random() < 0.6:
                a, b = rng.choice(outcomes)
            else:
                a = rng.randint(0, k)
                b = rng.choice([t for t in range(vocab) if a == k or t != drafts[a]])
            tokens += drafts[:a] + [b]
            hidden = torch.cat([hidden, torch.randn(a + 1, width, generator=gen)])
            p = C if rng.random() < 0.8 else rng.randint(max(0, C - 4), C)  # now and then re-send positions
            out = proposer.step([step(p)])[0]
            assert out.code == 0 and out.committed_length == C + a + 1
            if out.predrafted:
                counts["hit"] += 1
                assert p == C and (a, b) in outcomes
                assert out.drafts == expect(C, drafts[:a] + [b]), (sid, C, a, b)
            else:
                counts["plain"] += 1
                assert out.drafts == expect(len(tokens) - 1, []), (sid, C, a, b)
            drafts = out.drafts
    assert counts["hit"] >= 5 and counts["plain"] >= 5, counts
    c = proposer.predraft.counters
    if static_decode:
        assert proposer.decode_graphs.rows_runs > 0
    assert c.short_forced_passes > 0  # plain steps (eager or graphs) kept their features: one-row forced passes
    c = proposer.predraft.counters
    assert c.hits == counts["hit"] and c.misses > 0 and c.unprepared > 0 and c.branches_prepared > 0
    for sid in ("a", "b"):
        proposer.table.release(NS, sid)
    assert proposer.kv.pool.num_free == proposer.kv.pool.num_blocks  # no branch block leaked


@pytest.mark.parametrize("method,temperature,static_decode", [
    ("eagle1", 0.0, True), ("eagle1", 0.8, False), ("eagle3", 0.0, False)])
def test_passes_over_several_sequences_match_naive(method, temperature, static_decode, tiny_model, tmp_path):
    """Four sequences stepping together (a random subset each step), one pass over all of them between steps: every
    answer, predrafted or plain, equals the naive reference, and every block comes back. With static_decode the
    static-buffer steps serve the engine's first steps too (padded mixed m: the graphs' layout on CUDA)."""
    head, target, ref = heads(method, tiny_model, tmp_path)
    naive = Naive(ref)
    # (every batch's pass runs: the random outcomes hit about half of the time, which the odds check would refuse)
    rt = build_runtime(make_config(head, target, tmp_path, max_model_len=512, predraft_min_all_hit=0.0))
    proposer = rt.proposer
    if static_decode:
        proposer.decode_graphs = DecodeGraphs(proposer.model, proposer.kv_layers, rt.config.block_size,
                                              rt.max_model_len, 64, rt.dtype, rt.device, first_step_tokens=8,
                                              max_drafts=8)
    width, vocab = rt.limits.hidden_states_width, rt.limits.vocab_size
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    k, budget, seed = 3, 6, 1234
    seqs = {}
    for sid in "abcd":
        P = rng.choice([5, 14, 19, 30])
        seqs[sid] = dict(tokens=[rng.randrange(vocab) for _ in range(P + 1)],
                         hidden=torch.randn(P, width, generator=gen))

    def step(sid: str, p: int) -> StepInput:
        t, h = seqs[sid]["tokens"], seqs[sid]["hidden"]
        C = len(t) - 1
        return StepInput(NS, sid, p, torch.tensor(t[p:C]), h[p:C], t[C], k, temperature=temperature, seed=seed,
                         predraft_branches=budget)

    def expect(sid: str, prefix_len: int, forced: list[int]) -> list[int]:
        t, h = seqs[sid]["tokens"], seqs[sid]["hidden"]
        return naive.drafts(t[: prefix_len + 1], h[:prefix_len], forced, k,
                            picker(temperature, seed, prefix_len + len(forced)))

    for sid, out in zip(seqs, proposer.step([step(sid, 0) for sid in seqs])):
        assert out.code == 0 and out.drafts == expect(sid, len(seqs[sid]["tokens"]) - 1, [])
        seqs[sid]["drafts"] = out.drafts
    hits = plain = 0
    for _ in range(14):
        if rng.random() < 0.8:
            assert proposer.predraft.prepare(lambda: False)
        stepping = [sid for sid in seqs if rng.random() < 0.85]
        outcome = {}
        for sid in stepping:
            st = proposer.table.get(NS, sid).predraft
            prepared = list(st.branches.outcomes) if st.branches is not None else []
            C, d = len(seqs[sid]["tokens"]) - 1, seqs[sid]["drafts"]
            if prepared and rng.random() < 0.6:
                a, b = rng.choice(prepared)
            else:
                a = rng.randint(0, k)
                b = rng.choice([t for t in range(vocab) if a == k or t != d[a]])
            seqs[sid]["tokens"] += d[:a] + [b]
            seqs[sid]["hidden"] = torch.cat([seqs[sid]["hidden"], torch.randn(a + 1, width, generator=gen)])
            outcome[sid] = (C, a, b)
        for sid, out in zip(stepping, proposer.step([step(sid, outcome[sid][0]) for sid in stepping])):
            C, a, b = outcome[sid]
            assert out.code == 0, out.message
            if out.predrafted:
                hits += 1
                assert out.drafts == expect(sid, C, seqs[sid]["drafts"][:a] + [b]), (sid, C, a, b)
            else:
                plain += 1
                assert out.drafts == expect(sid, len(seqs[sid]["tokens"]) - 1, []), (sid, C, a, b)
            seqs[sid]["drafts"] = out.drafts
    assert hits >= 5 and plain >= 5, (hits, plain)
    if static_decode:
        assert proposer.decode_graphs.first_steps_run >= 3
    for sid in seqs:
        proposer.table.release(NS, sid)
    assert proposer.kv.pool.num_free == proposer.kv.pool.num_blocks


def test_stopped_pass_keeps_nothing_and_backs_off(tiny_model, tmp_path):
    head, target = tiny_model
    rt = build_runtime(make_config(head, target, tmp_path))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    pd = proposer.predraft
    hidden = torch.randn(9, width)
    out = proposer.step([StepInput(NS, "s", 0, torch.arange(9), hidden, 3, 4, predraft_branches=8)])[0]
    assert out.code == 0 and pd.has_work()
    used = proposer.kv.pool.num_blocks - proposer.kv.pool.num_free
    assert not pd.prepare(lambda: True)  # a request is waiting: stop after the first forward
    assert pd.counters.passes_stopped == 1 and proposer.table.get(NS, "s").predraft.branches is None
    assert proposer.kv.pool.num_blocks - proposer.kv.pool.num_free == used
    assert not pd.has_work()  # backing off: 2 steps
    proposer.step([StepInput(NS, "other", 0, torch.arange(2), hidden[:2], 1, 0)])
    proposer.step([StepInput(NS, "other", 2, torch.arange(1), hidden[:1], 1, 0)])
    assert pd.has_work() and pd.prepare(lambda: False)
    st = proposer.table.get(NS, "s").predraft
    assert st.branches is not None and len(st.branches.outcomes) == 8
    # the branches' private blocks went back to the pool when the pass ended: only the sequences' own are held
    held = sum(len(proposer.table.get(NS, sid).block_table) for sid in ("s", "other"))
    assert proposer.kv.pool.num_blocks - proposer.kv.pool.num_free == held
    proposer.table.release(NS, "s")
    proposer.table.release(NS, "other")
    assert proposer.kv.pool.num_free == proposer.kv.pool.num_blocks


def test_a_step_without_budget_turns_it_off(tiny_model, tmp_path):
    head, target = tiny_model
    rt = build_runtime(make_config(head, target, tmp_path))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    proposer.step([StepInput(NS, "s", 0, torch.arange(4), torch.randn(4, width), 3, 2, predraft_branches=4)])
    assert proposer.predraft.prepare(lambda: False)
    assert proposer.table.get(NS, "s").predraft.branches is not None
    proposer.step([StepInput(NS, "s", 4, torch.tensor([3]), torch.randn(1, width), 5, 2)])
    assert proposer.table.get(NS, "s").predraft is None and not proposer.predraft.has_work()


@pytest.mark.parametrize("path", ["unary", "stream", "channel"])
def test_hits_through_every_path(path, tiny_model, tmp_path):
    """Through the server (the scheduler prepares while the client waits): GetInfo announces it, a step matching a
    prepared outcome is answered with its branch's drafts and predrafted set, another step is not, a budget over
    the limit is INVALID_ARGUMENT naming the field, and the metrics count the hits."""
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path)) as server:
        proposer = server.server.runtime.proposer
        # This engine sends its next step only once the pass is done, so the idle window it shows the drafter is
        # barely longer than a pass, and the fit check (test_a_pass_that_would_outlast...) would skip passes.
        proposer.predraft._fits = lambda n: True
        width = server.server.runtime.limits.hidden_states_width
        rng = random.Random(1)

        def prepared(sid: str):  # (read from the test's thread: the step thread writes it, once, per pass)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                seq = proposer.table.get(NS, sid)
                if seq is not None and seq.predraft is not None and seq.predraft.branches is not None:
                    return seq.predraft.branches
                time.sleep(0.01)
            raise AssertionError("nothing was prepared within 30 s")

        async def run():
            async with DrafterClient(server.uds, namespace=NS) as client:
                info = await client.get_info()
                assert info.predraft_supported and info.max_predraft_branches == MAX_PREDRAFT_BRANCHES
                if path == "channel":
                    assert await client.open_step_channel()
                session = client.stream() if path == "stream" else None
                propose = session.propose if session is not None else client.propose
                tokens = [rng.randrange(100) for _ in range(7)]
                step = SequenceStep("s", 0, tokens[:6], torch.randn(6, width), tokens[6], 3, predraft_branches=8)
                drafts = (await propose([step])).sequences[0].drafts.tolist()
                hits = 0
                for i in range(4):
                    br = await asyncio.to_thread(prepared, "s")
                    C = len(tokens) - 1
                    assert br.base == C and len(br.outcomes) == 8
                    if i < 3:
                        (a, b), row = next(iter(br.outcomes.items()))
                    else:  # an outcome nobody prepared
                        a, b, row = 0, next(t for t in range(100) if (0, t) not in br.outcomes and t != drafts[0]), None
                    tokens += drafts[:a] + [b]
                    step = SequenceStep("s", C, tokens[C : C + a + 1], torch.randn(a + 1, width), b, 3,
                                        predraft_branches=8)
                    answer = (await propose([step])).sequences[0]
                    assert answer.ok and answer.committed_length == C + a + 1
                    assert answer.predrafted == (row is not None)
                    if row is not None:
                        assert answer.drafts.tolist() == br.drafts[row]
                        hits += 1
                    drafts = answer.drafts.tolist()
                with pytest.raises(DrafterError) as e:
                    await client.propose([SequenceStep("t", 0, [1], torch.randn(1, width), 2, 3,
                                                       predraft_branches=MAX_PREDRAFT_BRANCHES + 1)])
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "predraft_branches" in e.value.message
                if session is not None:
                    await session.close()
                return hits

        assert asyncio.run(run()) == 3
        text = server.server.runtime.metrics.prometheus_text()
        assert "drafter_predraft_hits_total 3.0" in text and "drafter_predraft_misses_total 1.0" in text


def test_a_pass_that_would_outlast_the_idle_window_is_not_started(tiny_model, tmp_path):
    """The drafter falls back by itself when it is too busy: with passes known to take longer than the idle time
    between steps, none starts and a plain step keeps nothing for one (counted as skipped; the step costs what it
    costs with pre-drafting off); now and then one runs anyway (a probe) and measures itself again, so that one
    slow pass (compiling kernels) does not keep pre-drafting off."""
    head, target = tiny_model
    rt = build_runtime(make_config(head, target, tmp_path))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    pd = proposer.predraft
    pd.observe_window(0.002)  # 2 ms between a reply and the next request
    pd._timed(1, 0.010, finished=True)  # passes over one sequence took 10 ms

    def step(p: int, m: int) -> None:
        out = proposer.step([StepInput(NS, "s", p, torch.arange(m), torch.randn(m, width), 3, 3,
                                       predraft_branches=4)])[0]
        assert out.code == 0 and not out.predrafted

    step(0, 5)
    state = proposer.table.get(NS, "s").predraft
    assert state.basis is None and not pd.has_work()  # nothing kept: its pass would not fit
    assert pd.counters.passes_skipped == 1 and pd.counters.passes == 0 and pd.counters.branches_prepared == 0
    # it tries again: after PROBE_AFTER_SKIPS skips in a row a step keeps its basis, and its pass runs (a probe)
    for i in range(1, PROBE_AFTER_SKIPS):
        assert not pd.has_work()
        step(4 + i, 1)
    assert pd.counters.passes_skipped == PROBE_AFTER_SKIPS
    step(4 + PROBE_AFTER_SKIPS, 1)
    assert pd.has_work() and state.basis is not None
    assert pd.prepare(lambda: False)
    assert pd.counters.passes == 1 and pd.counters.branches_prepared > 0 and state.branches is not None
    # the probe's time replaces the estimate: down at once when it was faster
    pd._timed(1, 0.001, finished=True)  # the probe took 1 ms (the 10 ms passes were compiling kernels, say)
    assert pd.worth_preparing(1) and pd._fits(1) and pd._fits(1)  # passes run again
    pd._timed(1, 0.5, finished=False)  # one that a request stopped after 0.5 ms: twice that is the guess
    assert not pd.worth_preparing(1) and not pd._fits(1)
    pd.observe_window(1.0)  # long verifications from now on: the average follows
    assert pd.window_s > 0.1
    # a probe that a request stops replaces the estimate too, with twice its time: the old estimate may come from
    # a pass that compiled kernels, and max(old, guess) would keep passes off for good
    pd._timed(1, 5.0, finished=True)  # a pass that compiled kernels for 5 s
    assert not pd._fits(1)
    pd._skips[1] = PROBE_AFTER_SKIPS
    assert pd._fits(1)  # the probe
    pd._timed(1, 0.004, finished=False)
    assert pd._pass_s[1] == 0.008 and pd.recent_passes[-1] == (1, 0.004, False, True)
    assert pd._fits(1)
    pd._timed(1, 0.5, finished=False)  # a stopped pass that is no probe only raises the estimate
    assert pd._pass_s[1] == 1.0 and pd.recent_passes[-1] == (1, 0.5, False, False)


def test_branches_hold_no_blocks_after_their_pass(tiny_model, tmp_path):
    """A branch's KV is read only during its pass (a hit is answered from the drafts on the host): its private blocks
    go back to the pool when the pass ends, so that a full pool serves a new sequence with the prepared branches
    still in place, nobody evicted."""
    head, target = tiny_model
    rt = build_runtime(make_config(head, target, tmp_path, kv_cache_tokens=512, max_model_len=512))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    pd, pool = proposer.predraft, proposer.kv.pool
    out = proposer.step([StepInput(NS, "a", 0, torch.arange(300), torch.randn(300, width), 3, 5,
                                   predraft_branches=32)])[0]
    assert out.code == 0 and pd.prepare(lambda: False)
    seq = proposer.table.get(NS, "a")
    assert seq.predraft.branches is not None and pd.counters.branches_prepared > 0
    assert pool.num_blocks - pool.num_free == len(seq.block_table)  # the sequence's own blocks only
    m = pool.num_free * proposer.block_size - 4 - 1  # p + m + k - 1 positions: every free block
    out = proposer.step([StepInput(NS, "b", 0, torch.arange(m), torch.randn(m, width), 3, 5)])[0]
    assert out.code == 0, out.message
    assert seq.predraft.branches is not None and proposer.table.counters.evicted == 0


class _DyingChannel:
    """The part of ChannelSet the scheduler uses: one open channel, whose client is found gone (liveness check in
    poll) while a pre-drafting pass runs; it created sequence "b"."""

    def __init__(self):
        self.wake = self.release_owner = None
        self.closed = False

    def open_count(self) -> int:
        return 0 if self.closed else 1

    def poll(self, enqueue, read_ahead: bool = True) -> bool:
        import traceback

        if not self.closed and any(f.name == "_prepare_group" for f in traceback.extract_stack()):
            self.closed = True
            self.release_owner("step channel 1")
        return False

    def close_all(self, why: str) -> None:
        pass


async def test_a_channel_gone_during_a_pass_frees_its_sequences_after_it(tiny_model, tmp_path):
    """The scheduler polls the step channels from inside a pass; a channel whose client died frees its sequences
    as a job between batches (the pass stops for it), never under the running pass: no leaked block, no crash."""
    from drafter_service.engine.scheduler import StepScheduler

    head, target = tiny_model
    rt = build_runtime(make_config(head, target, tmp_path))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    scheduler = StepScheduler(proposer, 100000, 256)
    channel = _DyingChannel()
    scheduler.attach_channels(channel)
    scheduler.start()
    try:
        steps = [StepInput(NS, "a", 0, torch.arange(9), torch.randn(9, width), 3, 3, predraft_branches=8),
                 StepInput(NS, "b", 0, torch.arange(9), torch.randn(9, width), 3, 2, predraft_branches=8,
                           owner="step channel 1")]
        assert [o.code for o in await scheduler.submit(steps)] == [0, 0]
        for _ in range(200):  # the pass runs on the idle step thread
            if channel.closed and proposer.table.get(NS, "b") is None:
                break
            await asyncio.sleep(0.01)
        assert channel.closed and proposer.table.get(NS, "b") is None
        later = await asyncio.wait_for(scheduler.submit([StepInput(NS, "c", 0, torch.arange(4),
                                                                   torch.randn(4, width), 3, 3)]), 30)
        assert later[0].code == 0 and scheduler._thread.is_alive()
        await scheduler.run_exclusive(lambda: [proposer.table.release(NS, sid) for sid in ("a", "c")])
        assert proposer.kv.pool.num_free == proposer.kv.pool.num_blocks
    finally:
        await scheduler.stop()


async def test_a_pass_that_raises_leaves_the_step_thread_serving(tiny_model, tmp_path, monkeypatch):
    """An exception inside a pass (a device error, a bug) is logged; prepared branches are dropped and the sequences
    go on with plain steps; the step thread keeps answering."""
    from drafter_service.engine.scheduler import StepScheduler

    head, target = tiny_model
    rt = build_runtime(make_config(head, target, tmp_path))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    pd = proposer.predraft
    raised = []

    def broken(*args):
        raised.append(1)
        raise RuntimeError("injected")

    monkeypatch.setattr(pd, "_prepare_group", broken)
    scheduler = StepScheduler(proposer, 100000, 256)
    scheduler.start()
    try:
        out = await scheduler.submit([StepInput(NS, "a", 0, torch.arange(9), torch.randn(9, width), 3, 3,
                                                predraft_branches=8)])
        assert out[0].code == 0
        for _ in range(200):
            if raised and not pd.has_work():
                break
            await asyncio.sleep(0.01)
        assert raised and not pd.has_work() and proposer.table.get(NS, "a").predraft.branches is None
        out = await asyncio.wait_for(scheduler.submit([StepInput(NS, "a", 9, torch.tensor([3]),
                                                                 torch.randn(1, width), 4, 3)]), 30)
        assert out[0].code == 0 and not out[0].predrafted and scheduler._thread.is_alive()
    finally:
        await scheduler.stop()


def test_a_hit_stays_right_when_the_next_pass_raises(tiny_model, tmp_path, monkeypatch):
    """A hit leaves its rows' KV to be written later (by the next pass, or with the next step). When that pass
    raises, the scheduler's reset() keeps the pending rows: the next plain step still equals the naive reference."""
    head, target, ref = heads("eagle1", tiny_model, tmp_path)
    naive = Naive(ref)
    rt = build_runtime(make_config(head, target, tmp_path))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    pd = proposer.predraft
    k, g = 3, torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (12,), generator=g).tolist()  # x[0..11]; x[11] the next token
    hidden = torch.randn(11, width, generator=g)
    out = proposer.step([StepInput(NS, "s", 0, torch.tensor(tokens[:11]), hidden, tokens[11], k,
                                   predraft_branches=8)])[0]
    assert out.code == 0 and pd.prepare(lambda: False)
    (a, b), _ = next(iter(proposer.table.get(NS, "s").predraft.branches.outcomes.items()))
    tokens += out.drafts[:a] + [b]  # the engine accepted a drafts, then the bonus b of a prepared branch
    hidden = torch.cat([hidden, torch.randn(a + 1, width, generator=g)])
    out = proposer.step([StepInput(NS, "s", 11, torch.tensor(tokens[11 : 12 + a]), hidden[11:], b, k,
                                   predraft_branches=8)])[0]
    assert out.code == 0 and out.predrafted and proposer.table.get(NS, "s").predraft.basis.pending

    def broken(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(pd, "_prepare_group", broken)
    with pytest.raises(RuntimeError):
        pd.prepare(lambda: False)
    pd.reset()  # what the scheduler does after a pass raised
    tokens += out.drafts[:1] + [7]
    hidden = torch.cat([hidden, torch.randn(2, width, generator=g)])
    C = len(tokens) - 1
    out = proposer.step([StepInput(NS, "s", 12 + a, torch.tensor(tokens[12 + a : C]), hidden[12 + a :],
                                   tokens[C], k)])[0]
    assert out.code == 0 and not out.predrafted
    assert out.drafts == naive.drafts(tokens, hidden, [], k, picker(0.0, 0, C))


def test_a_pass_keeps_within_the_namespace_share(tiny_model, tmp_path):
    """A pass extends a sequence's blocks by the forced decode's scratch position: not past its namespace's share of
    the pool (--namespace-pool-share); such a sequence is left out of the pass, the others are prepared."""
    head, target = tiny_model
    rt = build_runtime(make_config(head, target, tmp_path, kv_cache_tokens=1024, namespace_pool_share=0.125))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    table, bs = proposer.table, proposer.block_size
    limit = table.namespace_block_limit
    m, k = limit * bs - 4, 5  # p + m + k - 1 positions: exactly the namespace's share; the pass would need one more
    out = proposer.step([StepInput("full", "s", 0, torch.arange(m), torch.randn(m, width), 3, k,
                                   predraft_branches=8)])[0]
    assert out.code == 0 and table.namespace_blocks("full") == limit
    out = proposer.step([StepInput("roomy", "t", 0, torch.arange(9), torch.randn(9, width), 3, k,
                                   predraft_branches=8)])[0]
    assert out.code == 0 and proposer.predraft.prepare(lambda: False)
    assert table.get("full", "s").predraft.branches is None and table.namespace_blocks("full") == limit
    assert table.get("roomy", "t").predraft.branches is not None
