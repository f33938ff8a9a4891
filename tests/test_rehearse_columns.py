"""Proposer.rehearse_columns: the columns path's host work before its launches, run on a step with nothing changed
and nothing sent (the drafter's rehearsal of its last request while it waits: transport/step_channels.py). A drafter
that rehearses every step before and after running it answers exactly as one that never does, and the rehearsal
leaves the sequences' rows, the block pool, the metrics and (on CUDA) the first-step record's device copy as they
were; steps the columns path would not take are not rehearsed."""
import pytest
import torch

from conftest import make_config
from drafter_service.engine.sequence_rows import STATE_COLUMNS
from drafter_service.runtime import build_runtime
from test_step_batch import NS, Traffic, as_batch, metrics_of, same


def state_of(rt):
    """Everything a rehearsal must leave as it was (copies)."""
    p = rt.proposer
    R = p.table.rows
    state = {name: getattr(R, name).copy() for name in STATE_COLUMNS}
    state.update(block_tables=R.block_tables_np.copy(), free_blocks=p.kv.pool.num_free, metrics=metrics_of(rt),
                 serial=p._step_serial, touches=p.table._touches, live=len(p.table))
    if p.decode_graphs is not None:
        state["record_on_device"] = p.decode_graphs.record.on_device.cpu().clone()
    return state


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        elif hasattr(value, "shape"):
            assert (value == after[key]).all(), key
        else:
            assert value == after[key], key


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rehearsing_every_step_changes_no_answer_and_no_state(tiny_model, tmp_path, device):
    """Greedy traffic of 8-24 sequences with mixed m and k and some rollbacks (on CUDA, the uniform small-m rounds
    replay a first-step graph, whose record's host copy the rehearsal writes): each step is rehearsed before it runs
    (its sequences all known) and again after (as the drafter rehearses its last frame)."""
    plain = build_runtime(make_config(*tiny_model, tmp_path / "plain", device=device))
    rehearsing = build_runtime(make_config(*tiny_model, tmp_path / "rehearsing", device=device))
    t = Traffic(3, plain.limits.hidden_states_width, plain.limits.vocab_size, 24)
    first = [t.step(sid, 3, 4) for sid in t.tokens]
    same(plain.proposer.step_per_sequence(first), rehearsing.proposer.step_batch(as_batch(first)))
    p = rehearsing.proposer
    rehearsed = ran = 0
    for round in range(10):
        rng = t.rng
        sids = sorted(t.tokens, key=lambda _: rng.random())[: rng.randint(8, 24)]
        uniform = round % 2 == 0  # (CUDA: a first-step graph takes these)
        steps = [t.step(sid, m=2 if uniform else rng.randint(1, 4), k=3 if uniform else rng.choice([1, 3, 5]),
                         back=0 if uniform else rng.choice([0, 0, 1, 2]))
                 for sid in sids]
        batch = as_batch(steps)
        before = state_of(rehearsing)
        rehearsed += p.rehearse_columns(batch)
        assert_same_state(before, state_of(rehearsing))
        runs_before = p.columns_steps_run
        out = plain.proposer.step_per_sequence(steps)
        same(out, p.step_batch(batch))
        ran += p.columns_steps_run - runs_before
        assert metrics_of(plain) == metrics_of(rehearsing)
        before = state_of(rehearsing)
        assert p.rehearse_columns(batch)  # (the step just run, re-sent: its positions are committed)
        assert_same_state(before, state_of(rehearsing))
        t.answered(steps, out)
    assert ran == 10 and rehearsed == 10 and p.columns_rehearsals == 20
    if device == "cuda":
        assert p.decode_graphs.first_step_rehearsals >= 10


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_step_one_of_whose_sequences_is_gone_is_rehearsed_for_the_others(tiny_model, tmp_path, device):
    """Continuous batching: after each step one of its sequences finishes (Release) before the drafter rehearses that
    step. The others' step is rehearsed (BatchInput.take), nothing changed, and the next steps answer as a drafter
    that never rehearses; where too few are left for the columns path (the CPU: fewer than 8), it is not."""
    plain = build_runtime(make_config(*tiny_model, tmp_path / "plain", device=device))
    rehearsing = build_runtime(make_config(*tiny_model, tmp_path / "rehearsing", device=device))
    t = Traffic(8, plain.limits.hidden_states_width, plain.limits.vocab_size, 11)
    live = sorted(t.tokens)
    first = [t.step(sid, 3, 4) for sid in live]
    same(plain.proposer.step_per_sequence(first), rehearsing.proposer.step_batch(as_batch(first)))
    p = rehearsing.proposer
    for round in range(6):
        steps = [t.step(sid, 2, 3) for sid in live]
        out = plain.proposer.step_per_sequence(steps)
        same(out, p.step_batch(as_batch(steps)))
        gone = live.pop(round % len(live))
        assert plain.proposer.table.release(NS, gone) and p.table.release(NS, gone)
        before, count = state_of(rehearsing), p.columns_rehearsals
        # (CPU: the columns path from 8 sequences; with graphs (CUDA) from 1)
        expected = len(live) >= 8 or p.decode_graphs is not None
        assert p.rehearse_columns(as_batch(steps)) is expected, round
        assert p.columns_rehearsals == count + expected
        assert_same_state(before, state_of(rehearsing))
        t.answered(steps, out)
    assert metrics_of(plain) == metrics_of(rehearsing)


def test_batch_input_take_keeps_the_chosen_sequences_columns():
    """BatchInput.take: the kept sequences' columns and token ids, in order; no states."""
    import numpy as np

    t = Traffic(2, 8, 100, 6)
    steps = [t.step(sid, m, 2) for sid, m in zip(sorted(t.tokens), [1, 4, 2, 5, 3, 1])]
    batch = as_batch(steps)
    batch.namespaces = [f"n{i}" for i in range(6)]
    keep = np.array([4, 1, 5], dtype=np.int64)
    part = batch.take(keep)
    assert part.sequence_ids == [steps[i].sequence_id for i in keep] and part.namespaces == ["n4", "n1", "n5"]
    assert part.hidden_states is None and len(part) == 3
    assert part.arrays.token_ids.tolist() == [x for i in keep for x in steps[i].token_ids.tolist()]
    for name in ("start_positions", "num_tokens", "next_tokens", "num_drafts", "seeds"):
        assert getattr(part.arrays, name).tolist() == getattr(batch.arrays, name)[keep].tolist(), name
    assert len(batch.take(np.array([], dtype=np.int64))) == 0


def test_a_step_the_columns_path_would_not_take_is_not_rehearsed(tiny_model, tmp_path):
    """An unknown sequence, one named twice, a gap, a request for log-probabilities, a step too small for the columns
    path (CPU: fewer than 8 sequences): False, nothing changed."""
    rt = build_runtime(make_config(*tiny_model, tmp_path))
    t = Traffic(4, rt.limits.hidden_states_width, rt.limits.vocab_size, 8)
    first = [t.step(sid, 3, 4) for sid in t.tokens]
    rt.proposer.step_batch(as_batch(first))
    committed = dict(t.committed)
    p = rt.proposer
    before = state_of(rt)

    def again(**changes):
        t.committed.update(committed)
        steps = [t.step(sid, 2, 3) for sid in t.tokens]
        for i, (field, value) in enumerate(changes.items()):
            setattr(steps[i], field, value)
        return steps

    assert p.rehearse_columns(as_batch(again()))  # (the control: all known, in range)
    unknown = again()
    unknown[0].sequence_id = "never seen"
    twice = again()
    twice[1].sequence_id = twice[0].sequence_id
    gap = again(start_position=committed["s0"] + 5)
    predrafting = again(predraft_branches=4)
    small = again()[:3]
    for steps in (unknown, twice, gap, predrafting, small):
        assert not p.rehearse_columns(as_batch(steps))
    assert p.columns_rehearsals == 1
    assert_same_state(before, state_of(rt))
    assert all(s.namespace == NS for s in unknown)
