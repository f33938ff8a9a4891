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
import random

import pytest
import torch

from checkpoints import write_eagle3
from conftest import make_config
from drafter_service.engine.predraft import fan_out
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


@pytest.mark.parametrize("method,temperature", [("eagle1", 0.0), ("eagle1", 0.8), ("eagle3", 0.0)])
def test_branches_and_later_steps_match_naive(method, temperature, tiny_model, tmp_path):
    head, target, ref = heads(method, tiny_model, tmp_path)
    naive = Naive(ref)
    rt = build_runtime(make_config(head, target, tmp_path, max_model_len=512))
    proposer = rt.proposer
    width, vocab = rt.limits.hidden_states_width, rt.limits.vocab_size
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    k, budget, seed = 3, 6, rng.randrange(2**64)
    counts = {"hit": 0, "plain": 0}
    for sid in ("a", "b"):
        P = rng.choice([5, 19])
        tokens = [rng.randrange(vocab) for _ in range(P + 1)]  # x[0..P]
        hidden = torch.randn(P, width, generator=gen)  # h[0..P-1]

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
