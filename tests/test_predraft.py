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
from drafter_service.engine.predraft import MAX_PREDRAFT_BRANCHES, fan_out
from drafter_service.engine.sampling import gumbel_sample, seed_to_int64
from drafter_service.engine.step_io import StepInput
from drafter_service.runtime import build_runtime
from naive_eagle import NaiveEagle1
from naive_eagle3 import NaiveEagle3

NS = "predraft"


class Naive:
    """One interface over the EAGLE-1 and EAGLE-3 references: drafts after forced rows with own features."""

    def __init__(self, naive):
        self.n = naive
        self.eagle3 = isinstance(naive, NaiveEagle3)

    def _inputs(self, feats: torch.Tensor) -> torch.Tensor:
        f = feats.double()
        return f @ self.n.w["fc.weight"].T if self.eagle3 else f

    def _logits(self, row: torch.Tensor) -> torch.Tensor:
        return self.n.logits(row) if self.eagle3 else row @ self.n.lm_head.T

    def _to_target(self, d: int) -> int:
        return self.n.to_target(d) if self.eagle3 else d

    def drafts(self, tokens: list[int], feats: torch.Tensor, forced: list[int], k: int, pick) -> list[int]:
        """tokens x[0..L] (the last is the next token), feats h[0..L-1] of the target; then the rows of `forced`
        tokens (target ids) with the head's own outputs as features; then k drafts (pick(logits, j) for draft j)."""
        L = len(tokens) - 1
        ids, hid = list(tokens[1 : L + 1]), self._inputs(feats[:L])
        for t in forced:
            o = self.n.forward(ids, hid)
            ids.append(t)
            hid = torch.cat([hid, o[-1:]])
        out = []
        for j in range(k):
            o = self.n.forward(ids, hid)
            d = self._to_target(pick(self._logits(o[-1]), j))
            out.append(d)
            ids.append(d)
            hid = torch.cat([hid, o[-1:]])
        return out


def picker(temperature: float, seed: int, position: int):
    """Draft j's choice: greedy, or the server's Gumbel noise at (seed, position + j)."""
    def pick(logits: torch.Tensor, j: int) -> int:
        if temperature == 0:
            return int(logits.argmax())
        return int(gumbel_sample(logits[None].float(), torch.tensor([temperature]),
                                 torch.tensor([seed_to_int64(seed)]), torch.tensor([position + j]))[0])
    return pick


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
    assert proposer.predraft.branch_blocks == 0


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
    assert proposer.kv.pool.num_blocks - proposer.kv.pool.num_free == used + pd.branch_blocks == used
    assert not pd.has_work()  # backing off: 2 steps
    proposer.step([StepInput(NS, "other", 0, torch.arange(2), hidden[:2], 1, 0)])
    proposer.step([StepInput(NS, "other", 2, torch.arange(1), hidden[:1], 1, 0)])
    assert pd.has_work() and pd.prepare(lambda: False)
    st = proposer.table.get(NS, "s").predraft
    assert st.branches is not None and len(st.branches.outcomes) == 8
    assert pd.branch_blocks == len(st.branches.blocks) > 0
    # the branches give way when a real step needs their blocks, and leave with their sequence
    assert pd.drop_all_branches() > 0 and pd.branch_blocks == 0
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
    before = proposer.kv.pool.num_free
    proposer.step([StepInput(NS, "s", 4, torch.tensor([3]), torch.randn(1, width), 5, 2)])
    assert proposer.table.get(NS, "s").predraft is None and proposer.predraft.branch_blocks == 0
    assert proposer.kv.pool.num_free > before and not proposer.predraft.has_work()


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
    between steps, none starts (counted as skipped, the step is plain); as the estimate decays it tries again."""
    head, target = tiny_model
    rt = build_runtime(make_config(head, target, tmp_path))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    pd = proposer.predraft
    pd.observe_window(0.002)  # 2 ms between a reply and the next request
    pd._timed(1, 0.010, finished=True)  # passes over one sequence took 10 ms
    out = proposer.step([StepInput(NS, "s", 0, torch.arange(5), torch.randn(5, width), 3, 3, predraft_branches=4)])[0]
    assert out.code == 0 and pd.has_work()
    assert pd.prepare(lambda: False)  # (nothing stopped it: it did not start)
    assert pd.counters.passes_skipped == 1 and pd.counters.passes == 1 and pd.counters.branches_prepared == 0
    assert proposer.table.get(NS, "s").predraft.branches is None and not pd.has_work()
    tries = 0
    while not pd._fits(1):  # 5% less each skip: 10 ms -> below 0.8 * 2 ms after ~36 skips
        tries += 1
    assert 30 < tries < 40
    pd.observe_window(1.0)  # long verifications from now on: the average follows
    assert pd.window_s > 0.1


def test_branches_give_way_when_a_step_needs_room(tiny_model, tmp_path):
    """A full pool: a new sequence's step takes the blocks of prepared branches (dropped first) before any live
    sequence is evicted or the step refused."""
    head, target = tiny_model
    rt = build_runtime(make_config(head, target, tmp_path, kv_cache_tokens=512, max_model_len=512))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    pd, pool = proposer.predraft, proposer.kv.pool
    out = proposer.step([StepInput(NS, "a", 0, torch.arange(300), torch.randn(300, width), 3, 5,
                                   predraft_branches=32)])[0]
    assert out.code == 0 and pd.prepare(lambda: False)
    assert pd.branch_blocks > 0
    need = pool.num_free + 1  # blocks: more than are free, fewer than free + the branches' blocks
    assert need * proposer.block_size < 512 and pool.num_free + pd.branch_blocks >= need
    m = need * proposer.block_size - 4 - 1  # p + m + k - 1 positions: exactly `need` blocks
    out = proposer.step([StepInput(NS, "b", 0, torch.arange(m), torch.randn(m, width), 3, 5)])[0]
    assert out.code == 0, out.message
    assert pd.branch_blocks == 0 and proposer.table.get(NS, "a") is not None  # nobody evicted
    assert proposer.table.counters.evicted == 0
