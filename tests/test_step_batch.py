"""Proposer.step_batch (columns in, columns out: batch_io.py) answers exactly what Proposer.step_per_sequence answers
for the same steps: drafts, accepted-draft counts, committed lengths, per-sequence statuses, the acceptance and step
metrics, and the KV it leaves behind (later steps draft the same), over random traffic with mixed m and k,
rollbacks, block boundaries, sampling, sequences that fail their own checks, a full pool and a step that raises. Two
drafters built from the same head get the same traffic, one sequence by sequence, one by columns. Proposer.step given
StepInputs runs a step the columns path takes from its columns too (BatchInput.from_inputs), with the same
answers."""
import random

import pytest
import torch

from conftest import make_config
from drafter_service.engine.batch_io import BatchInput, BatchOutput
from drafter_service.engine.proposer import GROW_IN_ONE_CALL_MIN, STEP_INPUTS_AS_COLUMNS_MIN
from drafter_service.engine.step_io import FAILED_PRECONDITION, INTERNAL, OK, RESOURCE_EXHAUSTED, StepInput
from drafter_service.runtime import build_runtime

NS = "ns"


def runtimes(tiny_model, tmp_path, **kw):
    a = build_runtime(make_config(*tiny_model, tmp_path / "a", **kw))
    b = build_runtime(make_config(*tiny_model, tmp_path / "b", **kw))
    return a, b


class Traffic:
    """Random engine steps for a set of sequences, each with its own token history (the engine's committed text)."""

    def __init__(self, seed: int, width: int, vocab: int, n: int, prompt: int = 40):
        self.rng = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.width, self.vocab = width, vocab
        self.tokens = {f"s{i}": torch.randint(0, vocab, (prompt + 400,), generator=self.g) for i in range(n)}
        self.states = {sid: torch.randn(prompt + 400, width, generator=self.g) for sid in self.tokens}
        self.committed = {sid: 0 for sid in self.tokens}
        self.prompt = prompt

    def step(self, sid: str, m: int, k: int, back: int = 0, temperature: float = 0.0, logprobs: bool = False,
             top_k: int = 0) -> StepInput:
        p = max(0, self.committed[sid] - back)
        if self.committed[sid] == 0:
            m = self.prompt
        toks, hid = self.tokens[sid], self.states[sid]
        self.committed[sid] = p + m
        return StepInput(NS, sid, p, toks[p : p + m].clone(), hid[p : p + m].clone(), int(toks[p + m]), k,
                         temperature=temperature, seed=self.rng.randrange(2**64), return_logprobs=logprobs,
                         top_k_probs=top_k)

    def answered(self, steps: list[StepInput], outputs) -> None:
        """A refused step commits nothing: the engine sends it again."""
        for s, o in zip(steps, outputs):
            if o.code != OK:
                self.committed[s.sequence_id] = min(self.committed[s.sequence_id], s.start_position)


def as_batch(steps: list[StepInput]) -> BatchInput:
    return BatchInput.from_lists(
        NS, [s.sequence_id for s in steps], [s.start_position for s in steps], [s.num_tokens for s in steps],
        torch.cat([s.token_ids for s in steps]), torch.cat([s.hidden_states for s in steps]),
        [s.next_token for s in steps], [s.num_drafts for s in steps], [s.temperature for s in steps],
        [s.seed for s in steps], [s.return_logprobs for s in steps], [s.top_k_probs for s in steps],
        [s.predraft_branches for s in steps])


def same(out_a, out_b: BatchOutput):
    got = out_b.to_outputs()
    assert [o.code for o in out_a] == [o.code for o in got], [(o.code, o.message) for o in got]
    assert [o.message for o in out_a] == [o.message for o in got]
    assert [o.drafts for o in out_a] == [o.drafts for o in got]
    assert [o.accepted_drafts for o in out_a] == [o.accepted_drafts for o in got]
    assert [o.committed_length for o in out_a] == [o.committed_length for o in got]
    for x, y in zip(out_a, got):  # log q and top-N where asked
        assert len(x.logprobs) == len(y.logprobs)
        if x.logprobs:
            torch.testing.assert_close(torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-5, rtol=1e-4)
        assert (x.top_k_ids is None) == (y.top_k_ids is None)
        if x.top_k_ids is not None:
            assert torch.equal(x.top_k_ids, y.top_k_ids)
            torch.testing.assert_close(y.top_k_probs, x.top_k_probs, atol=1e-5, rtol=1e-4)


def metrics_of(rt):
    m = rt.metrics
    return (m.steps, m.sequence_steps, m.committed_tokens, m.draft_tokens, dict(m.sequence_errors),
            m.draft_proposals_evaluated, m.drafts_evaluated, m.drafts_accepted, list(m.evaluated_by_position),
            list(m.accepted_by_position))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_columns_answer_as_the_per_sequence_step_over_random_traffic(tiny_model, tmp_path, device):
    """On CUDA the greedy rounds replay the first-step and decode graphs (uniform small m) or run eagerly; the
    sampled rounds (some with log q, some with top-N) replay the sampled decode graphs."""
    a, b = runtimes(tiny_model, tmp_path, device=device)
    width, vocab = a.limits.hidden_states_width, a.limits.vocab_size
    t = Traffic(0, width, vocab, 40)
    fast_before = b.proposer.columns_steps_run
    for round in range(12):
        rng = t.rng
        sids = sorted(t.tokens, key=lambda _: rng.random())[: rng.randint(24, 40)]
        sampled = round % 3 == 2
        steps = [t.step(sid, m=rng.randint(1, 5), k=rng.choice([0, 1, 3, 5, 8]),
                         back=rng.choice([0, 0, 0, 1, 3]), temperature=rng.choice([0.0, 0.8]) if sampled else 0.0,
                         logprobs=sampled and round % 2 == 0 and rng.random() < 0.5,
                         top_k=rng.choice([0, 0, 2, 5]) if sampled and round > 5 else 0)
                 for sid in sids]
        out_a = a.proposer.step_per_sequence(steps)
        same(out_a, b.proposer.step_batch(as_batch(steps)))
        assert metrics_of(a) == metrics_of(b)
        t.answered(steps, out_a)
    # the first rounds create the sequences (the per-sequence path); the later ones ran from the columns
    assert b.proposer.columns_steps_run - fast_before >= 8


@pytest.mark.parametrize("share", [1.0, 0.3])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_growing_sequences_take_their_blocks_in_one_call_as_one_at_a_time(tiny_model, tmp_path, device, share,
                                                                           monkeypatch):
    """A columns step's growing sequences take their blocks in one call (SequenceTable.grow_rows) where the pool and
    the namespaces' shares hold the growth: the same answers, block tables, free list, namespace counts and live
    sequences as a drafter that takes them one sequence at a time (its _growth_fits always declines), over traffic
    of two namespaces in one batch with rollbacks (a table that shrinks: one at a time) and, with a namespace's
    share of the pool at 0.3, steps whose growth passes the share (one at a time: idle sequences evicted)."""
    a, b = runtimes(tiny_model, tmp_path, device=device, kv_cache_tokens=4096, namespace_pool_share=share)
    monkeypatch.setattr(a.proposer, "_growth_fits", lambda *args: None)
    grown, real = [], b.proposer.table.grow_rows
    monkeypatch.setattr(b.proposer.table, "grow_rows", lambda *args: grown.append(len(args[0])) or real(*args))
    t = Traffic(11, a.limits.hidden_states_width, a.limits.vocab_size, 40)
    namespace = {sid: NS if i % 2 else "other" for i, sid in enumerate(t.tokens)}
    first = [t.step(sid, 3, 4) for sid in t.tokens]
    for s in first:
        s.namespace = namespace[s.sequence_id]
    same(a.proposer.step_per_sequence(first), BatchOutput.from_outputs(b.proposer.step_per_sequence(first)))
    for round in range(14):
        rng = t.rng
        sids = sorted(t.tokens, key=lambda _: rng.random())[: rng.randint(24, 40)]
        steps = [t.step(sid, m=rng.randint(1, 5), k=rng.choice([1, 3, 5, 8]), back=rng.choice([0, 0, 0, 0, 2, 9]))
                 for sid in sids]
        for s in steps:
            s.namespace = namespace[s.sequence_id]
        batches = [as_batch(steps), as_batch(steps)]
        for batch in batches:
            batch.namespaces = [s.namespace for s in steps]
        out_a, out_b = a.proposer.step_batch(batches[0]), b.proposer.step_batch(batches[1])
        same(out_a.to_outputs(), out_b)
        assert metrics_of(a) == metrics_of(b)
        for sid in t.tokens:
            sa, sb = a.proposer.table.get(namespace[sid], sid), b.proposer.table.get(namespace[sid], sid)
            assert (sa is None) == (sb is None) and (sa is None or sa.block_table == sb.block_table), sid
        assert list(a.kv.pool._free) == list(b.kv.pool._free)
        assert a.proposer.table._ns_blocks == b.proposer.table._ns_blocks
        t.answered(steps, out_a.to_outputs())
    # (with the share, evicted sequences and refused steps send some steps the per-sequence way)
    assert a.proposer.columns_steps_run == b.proposer.columns_steps_run >= (8 if share == 1.0 else 5)
    assert len(grown) >= (5 if share == 1.0 else 2) and min(grown) >= GROW_IN_ONE_CALL_MIN  # (in one call a step)
    if share < 1.0:
        assert b.proposer.table.counters.evicted + b.proposer.table.counters.quota_refusals > 0  # (one at a time)


def rows_all_held(rt) -> bool:
    """Every row of the table's columns is free or held by a live sequence (none left to a sequence not started),
    and every KV block is free or in a live sequence's table."""
    R, table = rt.proposer.table.rows, rt.proposer.table
    live = list(table._seqs.values())
    return (len(R._free) + len(table) == R.num_blocks.shape[0]
            and sum(s.num_blocks for s in live) + rt.kv.pool.num_free == rt.kv.pool.num_blocks)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_new_sequences_start_from_the_columns_beside_known_ones(tiny_model, tmp_path, device):
    """Continuous batching: every step, some sequences finish (Release) and new ones start (their prompt at position
    0, 5-60 tokens) beside the others' decode steps. The step runs from its columns with them (_start_sequences),
    with the per-sequence step's answers, metrics and sequence state; no row is left behind."""
    a, b = runtimes(tiny_model, tmp_path, device=device)
    width, vocab = a.limits.hidden_states_width, a.limits.vocab_size
    t = Traffic(21, width, vocab, 60, prompt=5)
    rng = t.rng
    live = sorted(t.tokens)[:30]
    waiting = sorted(t.tokens)[30:]
    before = b.proposer.columns_steps_run
    for round in range(10):
        starting = [waiting.pop() for _ in range(rng.randint(1, 4))] if round else []
        steps = []
        for sid in live + starting:
            if sid in starting:
                t.prompt = rng.randint(5, 60)
            steps.append(t.step(sid, m=rng.randint(1, 4), k=rng.choice([3, 5])))
        out_a = a.proposer.step_per_sequence(steps)
        same(out_a, b.proposer.step_batch(as_batch(steps)))
        assert metrics_of(a) == metrics_of(b) and all(o.code == OK for o in out_a)
        t.answered(steps, out_a)
        live += starting
        for sid in [live.pop(rng.randrange(len(live))) for _ in range(rng.randint(0, 3))]:  # finished
            assert a.proposer.table.release(NS, sid) and b.proposer.table.release(NS, sid)
        for sid in live:
            sa, sb = a.proposer.table.get(NS, sid), b.proposer.table.get(NS, sid)
            assert (sa.committed_len, sa.num_blocks, sa.last_drafts) == (sb.committed_len, sb.num_blocks,
                                                                         sb.last_drafts)
        assert len(a.proposer.table) == len(b.proposer.table) and rows_all_held(b)
    assert b.proposer.columns_steps_run - before == 10  # (round 0: all new; then new ones beside known ones)


def test_new_sequences_the_columns_cannot_start_go_the_per_sequence_way(tiny_model, tmp_path, monkeypatch):
    """A new sequence that might be refused or make room takes the whole step the per-sequence way, nothing changed
    before: one not at position 0 (NOT_FOUND), one named twice, a draining drafter (UNAVAILABLE), --max-sequences
    reached (idle sequences evicted), a prompt past max_model_len (OUT_OF_RANGE), a pool too short for it without
    evicting. A step that raises keeps none of its new sequences. Same answers as the per-sequence step, and no row
    left behind."""
    a, b = runtimes(tiny_model, tmp_path, kv_cache_tokens=2048, max_sequences=40)  # (128 blocks of 16)
    width, vocab = a.limits.hidden_states_width, a.limits.vocab_size
    t = Traffic(22, width, vocab, 80, prompt=8)
    names = sorted(t.tokens)
    first = [t.step(sid, 0, 3) for sid in names[:30]]
    same(a.proposer.step_per_sequence(first), b.proposer.step_batch(as_batch(first)))
    spare = iter(names[30:])

    def step_with(kind):
        steps = [t.step(sid, 2, 3) for sid in names[:20]]
        sid = next(spare)
        fresh = t.step(sid, 0, 3)
        if kind == "not at 0":
            fresh.start_position = 5
        elif kind == "long prompt":
            n = a.proposer.max_model_len + 2
            fresh = StepInput(NS, sid, 0, torch.randint(0, vocab, (n,)), torch.randn(n, width), 1, 3)
        elif kind == "pool":
            n = 16 * (a.kv.pool.num_free + 1)  # (more than is free: the idle sequences must make room)
            fresh = StepInput(NS, sid, 0, torch.randint(0, vocab, (n,)), torch.randn(n, width), 1, 3)
        steps.append(fresh)
        if kind == "twice":
            steps.append(fresh)
        return steps

    for kind in ("not at 0", "twice", "draining", "long prompt", "pool", "max sequences"):
        if kind == "max sequences":
            more = [t.step(next(spare), 0, 3) for _ in range(10)]  # 40 live, at --max-sequences
            same(a.proposer.step_per_sequence(more), b.proposer.step_batch(as_batch(more)))
        for rt in (a, b):
            rt.proposer.draining = kind == "draining"
        steps = step_with(kind)
        before = b.proposer.columns_steps_run
        out_a = a.proposer.step_per_sequence(steps)
        same(out_a, b.proposer.step_batch(as_batch(steps)))
        assert metrics_of(a) == metrics_of(b)
        assert b.proposer.columns_steps_run == before, kind
        assert len(a.proposer.table) == len(b.proposer.table) and rows_all_held(a) and rows_all_held(b), kind
        t.answered(steps, out_a)
        if kind == "max sequences":
            assert b.proposer.table.counters.evicted > 0
    for rt in (a, b):
        rt.proposer.draining = False
    steps = [t.step(sid, 2, 3) for sid in names[:20]] + [t.step(next(spare), 0, 3)]
    for rt in (a, b):
        def broken(*args, **kw):
            raise RuntimeError("injected")
        monkeypatch.setattr(rt.proposer.model, "forward", broken)
    before = b.proposer.columns_steps_run
    out_a = a.proposer.step_per_sequence(steps)
    same(out_a, b.proposer.step_batch(as_batch(steps)))
    assert {o.code for o in out_a} == {INTERNAL}
    assert b.proposer.table.get(NS, steps[-1].sequence_id) is None and rows_all_held(a) and rows_all_held(b)
    assert len(a.proposer.table) == len(b.proposer.table)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_with_step_inputs_runs_from_the_columns_with_the_same_answers(tiny_model, tmp_path, device):
    """Proposer.step: a step of known sequences that step_batch would run from its columns goes there from its
    StepInputs (greedy, and sampled, log q or top-N where the batch is large), and answers, counts and leaves behind
    what the per-sequence step does; fewer sequences stay per sequence."""
    a, b = runtimes(tiny_model, tmp_path, device=device)
    width, vocab = a.limits.hidden_states_width, a.limits.vocab_size
    t = Traffic(7, width, vocab, 80)
    first = [t.step(sid, 3, 4) for sid in t.tokens]  # (new sequences: the per-sequence path)
    same(a.proposer.step_per_sequence(first), BatchOutput.from_outputs(b.proposer.step(first)))
    for round in range(10):
        rng = t.rng
        sids = sorted(t.tokens, key=lambda _: rng.random())[: rng.randint(STEP_INPUTS_AS_COLUMNS_MIN, 80)]
        sampled = round % 3 == 2
        steps = [t.step(sid, m=rng.randint(1, 5), k=rng.choice([0, 1, 3, 5, 8]),
                         back=rng.choice([0, 0, 0, 1, 3]), temperature=rng.choice([0.0, 0.8]) if sampled else 0.0,
                         logprobs=sampled and round % 2 == 0 and rng.random() < 0.5,
                         top_k=rng.choice([0, 0, 2, 5]) if sampled and round > 5 else 0)
                 for sid in sids]
        before = b.proposer.columns_steps_run
        out_a, out_b = a.proposer.step_per_sequence(steps), b.proposer.step(steps)
        assert b.proposer.columns_may_take(steps)
        # (Proposer.step checks the rule once, off the StepInputs: it must imply the columns' own check)
        assert b.proposer._fast_path_applies(BatchInput.from_inputs(steps))
        assert b.proposer.columns_steps_run - before == 1
        same(out_a, BatchOutput.from_outputs(out_b))
        assert metrics_of(a) == metrics_of(b)
        t.answered(steps, out_a)
    steps = [t.step(sid, 2, 3) for sid in sorted(t.tokens)[:STEP_INPUTS_AS_COLUMNS_MIN + 1]]
    for kind in ("fewer", "logprobs", "top_k", "new"):
        if kind == "fewer":
            ask = steps[: STEP_INPUTS_AS_COLUMNS_MIN - 1]
        elif kind == "new":
            ask = [*steps[1:], StepInput(NS, "fresh", 0, torch.arange(4), torch.randn(4, width), 3, 2)]
        else:
            ask = [StepInput(**{**s.__dict__, "return_logprobs": kind == "logprobs",
                                "top_k_probs": 2 if kind == "top_k" else 0}) for s in steps]
        before = b.proposer.columns_steps_run
        # (columns_may_take: fewer sequences than STEP_INPUTS_AS_COLUMNS_MIN stay StepInputs)
        assert b.proposer.columns_may_take(ask) is (kind != "fewer")
        assert b.proposer._fast_path_applies(BatchInput.from_inputs(ask))
        out_a, out_b = a.proposer.step_per_sequence(ask), b.proposer.step(ask)
        # (a new sequence starting at position 0 among known ones: the columns start it, _start_sequences)
        assert b.proposer.columns_steps_run == before + (kind != "fewer"), kind
        same(out_a, BatchOutput.from_outputs(out_b))
        t.answered(ask, out_a)


def test_a_sequence_failing_its_own_check_gets_its_status_and_the_rest_draft(tiny_model, tmp_path):
    a, b = runtimes(tiny_model, tmp_path)
    t = Traffic(1, a.limits.hidden_states_width, a.limits.vocab_size, 30)
    first = [t.step(sid, 3, 4) for sid in t.tokens]
    same(a.proposer.step_per_sequence(first), b.proposer.step_batch(as_batch(first)))
    steps = [t.step(sid, 3, 4) for sid in t.tokens]
    gap = steps[5]
    steps[5] = StepInput(NS, gap.sequence_id, gap.start_position + 7, gap.token_ids, gap.hidden_states,
                         gap.next_token, 4)  # beyond the committed length
    out_a, out_b = a.proposer.step_per_sequence(steps), b.proposer.step_batch(as_batch(steps))
    same(out_a, out_b)
    assert out_a[5].code == FAILED_PRECONDITION and all(o.code == OK for i, o in enumerate(out_a) if i != 5)


def test_a_full_pool_refuses_as_the_per_sequence_step_does(tiny_model, tmp_path):
    # 30 prompts of 40 tokens hold 3 blocks of 16 each, 90 of the pool's 100; as they grow past 48 positions the
    # pool runs out, and every sequence of the step is busy (none can be evicted)
    a, b = runtimes(tiny_model, tmp_path, kv_cache_tokens=1600)
    t = Traffic(2, a.limits.hidden_states_width, a.limits.vocab_size, 30)
    first = [t.step(sid, 3, 0) for sid in t.tokens]
    same(a.proposer.step_per_sequence(first), b.proposer.step_batch(as_batch(first)))
    codes = set()
    for _ in range(4):
        steps = [t.step(sid, 3, 5) for sid in t.tokens]
        out_a = a.proposer.step_per_sequence(steps)
        same(out_a, b.proposer.step_batch(as_batch(steps)))
        assert metrics_of(a) == metrics_of(b)
        t.answered(steps, out_a)
        codes |= {o.code for o in out_a}
    assert codes == {OK, RESOURCE_EXHAUSTED}
    assert b.proposer.columns_steps_run >= 1  # (the first decode step fits)


def test_a_step_that_raises_fails_its_sequences_and_keeps_their_earlier_kv(tiny_model, tmp_path, monkeypatch):
    a, b = runtimes(tiny_model, tmp_path)
    t = Traffic(3, a.limits.hidden_states_width, a.limits.vocab_size, 30)
    first = [t.step(sid, 3, 4) for sid in t.tokens]
    same(a.proposer.step_per_sequence(first), b.proposer.step_batch(as_batch(first)))
    second = [t.step(sid, 3, 4) for sid in t.tokens]
    same(a.proposer.step_per_sequence(second), b.proposer.step_batch(as_batch(second)))
    steps = [t.step(sid, 3, 4) for sid in t.tokens]
    for rt in (a, b):
        def broken(*args, **kw):
            raise RuntimeError("injected")
        monkeypatch.setattr(rt.proposer.model, "forward", broken)
    out_a, out_b = a.proposer.step_per_sequence(steps), b.proposer.step_batch(as_batch(steps))
    same(out_a, out_b)
    assert {o.code for o in out_a} == {INTERNAL} and "injected" in out_a[0].message
    monkeypatch.undo()
    # the engine sends the failed step again: both drafters draft it, and the same
    same(a.proposer.step_per_sequence(steps), b.proposer.step_batch(as_batch(steps)))
    again = [t.step(sid, 2, 5) for sid in t.tokens]
    same(a.proposer.step_per_sequence(again), b.proposer.step_batch(as_batch(again)))
    assert metrics_of(a) == metrics_of(b)


def test_log_q_and_top_n_run_from_the_columns_and_predrafting_and_small_steps_per_sequence(tiny_model, tmp_path):
    """Log-probabilities and top-N ride the columns path of a large step (its answer then one StepOutput per
    sequence, with its extras); pre-drafting budgets and small steps take the per-sequence way: same answers."""
    a, b = runtimes(tiny_model, tmp_path)
    t = Traffic(4, a.limits.hidden_states_width, a.limits.vocab_size, 30)
    first = [t.step(sid, 3, 4) for sid in t.tokens]
    same(a.proposer.step_per_sequence(first), b.proposer.step_batch(as_batch(first)))
    steps = [t.step(sid, 3, 4) for sid in t.tokens]
    for i, s in enumerate(steps):
        s.return_logprobs, s.top_k_probs, s.temperature = i % 2 == 0, (0, 3, 7)[i % 3], (0.0, 0.9)[i % 2]
    before = b.proposer.columns_steps_run
    out_a, out_b = a.proposer.step_per_sequence(steps), b.proposer.step_batch(as_batch(steps))
    assert b.proposer.columns_steps_run == before + 1
    same(out_a, out_b)
    assert out_b.outputs is not None and out_b.outputs[1].top_k_ids.shape == (4, 3)
    assert out_b.outputs[0].top_k_ids is None and len(out_b.outputs[0].logprobs) == 4 and not out_b.outputs[1].logprobs
    small = [t.step(sid, 1, 4) for sid in list(t.tokens)[:4]]  # 4 rows: below SMALL_STEP_ROWS
    same(a.proposer.step_per_sequence(small), b.proposer.step_batch(as_batch(small)))
    predrafting = [t.step(sid, 3, 4) for sid in list(t.tokens)[4:]]
    for s in predrafting:
        s.predraft_branches = 4
    same(a.proposer.step_per_sequence(predrafting), b.proposer.step_batch(as_batch(predrafting)))
    assert b.proposer.columns_steps_run == before + 1


def test_a_step_of_eight_sequences_with_few_rows_runs_from_its_columns(tiny_model, tmp_path):
    """STEP_BATCH_MIN_SEQUENCES sequences of 1-3 committed tokens each (far fewer rows than SMALL_STEP_ROWS) take the
    columns path, with the per-sequence step's answers, over a few steps of mixed m and k."""
    from drafter_service.engine.proposer import STEP_BATCH_MIN_SEQUENCES

    a, b = runtimes(tiny_model, tmp_path)
    t = Traffic(6, a.limits.hidden_states_width, a.limits.vocab_size, STEP_BATCH_MIN_SEQUENCES)
    first = [t.step(sid, 3, 4) for sid in t.tokens]
    same(a.proposer.step_per_sequence(first), b.proposer.step_batch(as_batch(first)))
    before = b.proposer.columns_steps_run
    for _ in range(4):
        steps = [t.step(sid, t.rng.randint(1, 3), t.rng.randint(1, 5)) for sid in t.tokens]
        assert sum(s.num_tokens for s in steps) <= 24
        out_a, out_b = a.proposer.step_per_sequence(steps), b.proposer.step_batch(as_batch(steps))
        same(out_a, out_b)
        t.answered(steps, out_a)
    assert b.proposer.columns_steps_run == before + 4


def test_a_sequence_named_twice_in_one_batch_goes_the_per_sequence_way(tiny_model, tmp_path):
    """The server never merges two steps of one sequence into a batch (scheduler.py), but an engine calling step_batch
    in its own process may: the columns path, which writes the sequences' state as columns by row, hands such a batch
    to Proposer.step, whose answers it gives."""
    a, b = runtimes(tiny_model, tmp_path)
    t = Traffic(5, a.limits.hidden_states_width, a.limits.vocab_size, 30)
    first = [t.step(sid, 3, 4) for sid in t.tokens]
    same(a.proposer.step_per_sequence(first), b.proposer.step_batch(as_batch(first)))
    steps = [t.step(sid, 3, 4) for sid in t.tokens]
    steps.append(steps[0])
    before = b.proposer.columns_steps_run
    same(a.proposer.step_per_sequence(steps), b.proposer.step_batch(as_batch(steps)))
    assert b.proposer.columns_steps_run == before
    later = [t.step(sid, 3, 4) for sid in t.tokens]  # and the state both left behind drafts the same
    same(a.proposer.step_per_sequence(later), b.proposer.step_batch(as_batch(later)))
    assert b.proposer.columns_steps_run == before + 1


@pytest.mark.parametrize("merged", [1, 3])
def test_batch_input_round_trips_through_to_inputs_and_cat(merged):
    t = Traffic(5, 8, 100, 12)
    parts = []
    for j in range(merged):
        steps = [t.step(sid, 2, j + 1) for sid in list(t.tokens)[j * 4 : j * 4 + 4]]
        parts.append((steps, as_batch(steps)))
    batch = BatchInput.cat([p[1] for p in parts])
    want = [s for p in parts for s in p[0]]
    got = batch.to_inputs()
    assert len(batch) == len(want)
    for w, g in zip(want, got):
        assert (w.namespace, w.sequence_id, w.start_position, w.next_token, w.num_drafts, w.seed) == \
            (g.namespace, g.sequence_id, g.start_position, g.next_token, g.num_drafts, g.seed)
        assert torch.equal(w.token_ids, g.token_ids) and torch.equal(w.hidden_states, g.hidden_states)


@pytest.mark.parametrize("transport", ["unary", "channel", "stream"])
async def test_a_columnar_request_runs_from_its_columns_through_the_server(server, transport):
    """A columnar request (here propose() of 40 sequences, which goes as columns) reaches Proposer.step_batch as one
    BatchInput and runs from the columns; its answers equal those of the same steps sent as per-sequence messages."""
    import contextlib

    from drafter_client import DrafterClient, SequenceStep

    proposer = server.server.runtime.proposer
    width, vocab = proposer.model.hidden_states_width, proposer.model.vocab_size
    t = Traffic(6, width, vocab, 40)
    async with DrafterClient(server.uds, namespace=f"bc-{transport}") as cols, \
            DrafterClient(server.uds, namespace=f"br-{transport}") as rows, contextlib.AsyncExitStack() as stack:
        rows._step_columns = False  # per-sequence messages
        by = {"cols": cols, "rows": rows}
        if transport == "channel":
            assert await cols.open_step_channel() and await rows.open_step_channel()
        if transport == "stream":
            by = {name: await stack.enter_async_context(c.stream()) for name, c in by.items()}
        before = server.call(lambda: proposer.columns_steps_run)
        for round in range(4):
            steps = [t.step(sid, 3, 4, back=round % 2) for sid in t.tokens]
            wire = [SequenceStep(s.sequence_id, s.start_position, s.token_ids, s.hidden_states, s.next_token,
                                 s.num_drafts) for s in steps]
            by_rows = await by["rows"].propose(wire)
            by_cols = await by["cols"].propose(wire)
            assert torch.equal(by_cols.draft_token_ids, by_rows.draft_token_ids)
            for c, r in zip(by_cols.sequences, by_rows.sequences, strict=True):
                assert (c.code, c.accepted_drafts, c.committed_length) == (r.code, r.accepted_drafts,
                                                                           r.committed_length)
                assert c.ok, c.message
        assert server.call(lambda: proposer.columns_steps_run) - before >= 3  # (the first round creates them)
        await cols.release(list(t.tokens))
        await rows.release(list(t.tokens))


@pytest.mark.parametrize("transport", ["unary", "channel"])
async def test_sequences_join_and_leave_a_batch_through_the_server(server, tiny_model, tmp_path, transport):
    """Continuous batching through the server: every step a new sequence starts (its prompt) beside the others'
    decode steps and one finishes (Release). Every step runs from its columns, the new sequences started there
    (Proposer._start_sequences), with the drafts, statuses and lengths of a drafter that steps them one sequence at a
    time (an in-process reference, Proposer.step_per_sequence)."""
    from drafter_client import DrafterClient, SequenceStep

    proposer = server.server.runtime.proposer
    reference = build_runtime(make_config(*tiny_model, tmp_path / "ref")).proposer
    t = Traffic(9, proposer.model.hidden_states_width, proposer.model.vocab_size, 30)
    rng = t.rng
    live, waiting = sorted(t.tokens)[:16], sorted(t.tokens)[16:]
    async with DrafterClient(server.uds, namespace=f"join-{transport}") as client:
        if transport == "channel":
            assert await client.open_step_channel()
        for round in range(6):
            joining = [waiting.pop()] if round else []
            steps = [t.step(sid, m=rng.randint(1, 3), k=4) for sid in live + joining]
            wire = [SequenceStep(s.sequence_id, s.start_position, s.token_ids, s.hidden_states, s.next_token,
                                 s.num_drafts) for s in steps]
            before = server.call(lambda: proposer.columns_steps_run)
            got = await client.propose(wire)
            assert server.call(lambda: proposer.columns_steps_run) == before + 1, round
            want = reference.step_per_sequence(steps)
            for g, w in zip(got.sequences, want, strict=True):
                assert (g.code, g.drafts.tolist(), g.accepted_drafts, g.committed_length) == (
                    w.code, w.drafts, w.accepted_drafts, w.committed_length), round
            live += joining
            gone = live.pop(rng.randrange(len(live)))
            await client.release([gone])
            assert reference.table.release(NS, gone)
        if transport == "channel":
            assert client.steps_through_channel == 6
        await client.release(live)


def test_merged_columnar_requests_run_as_one_batch_and_each_gets_its_share(tiny_model, tmp_path):
    """The scheduler merges columnar requests of two namespaces (and a per-sequence request, which sends the whole
    batch through Proposer.step's StepInputs) into one batch; each request gets exactly its own answers."""
    from drafter_service.engine.scheduler import PendingRequest, StepScheduler

    a, b = runtimes(tiny_model, tmp_path)
    width, vocab = a.limits.hidden_states_width, a.limits.vocab_size
    ta, tb = Traffic(7, width, vocab, 24), Traffic(8, width, vocab, 24)
    sched = StepScheduler(b.proposer, max_batch_tokens=1 << 20, max_batch_seqs=1024)

    def run_merged(parts):
        got = {}
        pending = [PendingRequest(p, lambda out, exc, i=i: got.__setitem__(i, (out, exc))) for i, p in enumerate(parts)]
        sched._run_batch(pending)
        return [got[i] for i in range(len(parts))]

    def steps_of(t, ns, m, k):
        steps = [t.step(sid, m, k) for sid in t.tokens]
        for s in steps:
            s.namespace = ns
        return steps

    for round, mixed in enumerate([False, False, False, True]):
        sa, sb = steps_of(ta, "na", 3, 4), steps_of(tb, "nb", 2, 5)
        want = a.proposer.step_per_sequence([*sa, *sb])
        ba, bb = as_batch(sa), as_batch(sb)
        ba.namespaces, bb.namespaces = ["na"] * len(sa), ["nb"] * len(sb)
        before = b.proposer.columns_steps_run
        extra = []
        if mixed:  # a per-sequence request in the same batch: everything goes the per-sequence way
            extra = [steps_of(Traffic(9 + round, width, vocab, 1), "nc", 3, 2)]
        results = run_merged([ba, bb, *extra])
        (out_a, exc_a), (out_b, exc_b) = results[:2]
        assert exc_a is None and exc_b is None
        assert isinstance(out_a, BatchOutput) and len(out_a) == len(sa) and len(out_b) == len(sb)
        same(want[: len(sa)], out_a)
        same(want[len(sa):], out_b)
        # every round from columns: round 0 starts its sequences there (_start_sequences), and the mixed round goes
        # through Proposer.step, which builds columns of its StepInputs and starts the new one ("nc") there too
        assert b.proposer.columns_steps_run - before == 1
        if extra:
            assert isinstance(results[2][0], list) and all(o.code == OK for o in results[2][0])


def test_early_work_sees_the_answer_before_its_drafts_and_is_dropped_when_the_step_fails(tiny_model, tmp_path,
                                                                                          monkeypatch):
    """Proposer.step_batch's early callback, through the scheduler (PendingRequest.early): each merged request gets its
    share of the answer with drafts None; the answer it is then delivered is that one with its drafts. A step that
    raises answers with another object: early is called again with None before deliver, so a step channel encodes
    its reply anew (step_channels.py)."""
    from drafter_service.engine.scheduler import PendingRequest, StepScheduler

    a, b = runtimes(tiny_model, tmp_path)
    t = Traffic(5, a.limits.hidden_states_width, a.limits.vocab_size, 20)
    sched = StepScheduler(b.proposer, max_batch_tokens=1 << 20, max_batch_seqs=1024)
    sids = sorted(t.tokens)

    def run_two_requests(steps):
        seen, delivered = {}, {}
        halves = [steps[:12], steps[12:]]
        pending = []
        for i, half in enumerate(halves):
            pending.append(PendingRequest(
                as_batch(half), lambda out, exc, i=i: delivered.__setitem__(i, (out, exc)),
                early=lambda out, i=i: seen.__setitem__(i, None if out is None else (
                    out.drafts, out.codes.clone(), out.accepted_drafts.clone()))))
        sched._run_batch(pending)
        return pending, seen, delivered

    for _ in range(2):  # the first round creates the sequences (the per-sequence path: no early work)
        steps = [t.step(sid, 3, 4) for sid in sids]
        out = a.proposer.step_per_sequence(steps)
        pending, seen, delivered = run_two_requests(steps)
        t.answered(steps, out)
    assert set(seen) == {0, 1} and all(drafts is None for drafts, _, _ in seen.values())
    for i in range(2):
        answer = delivered[i][0]
        assert torch.equal(answer.codes, seen[i][1]) and torch.equal(answer.accepted_drafts, seen[i][2])
    same(out[:12], delivered[0][0])
    same(out[12:], delivered[1][0])

    steps = [t.step(sid, 2, 3) for sid in sids]
    monkeypatch.setattr(b.proposer.model, "forward", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("injected")))
    pending, seen, delivered = run_two_requests(steps)
    assert seen == {0: None, 1: None}  # (given the answer while the GPU ran, then told to drop it)
    assert {c for i in (0, 1) for c in delivered[i][0].codes.tolist()} == {INTERNAL}
