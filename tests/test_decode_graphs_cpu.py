"""The decode step that cuda_graphs.py captures, run eagerly on the CPU on its static buffers (no graphs).

This checks, without a GPU, the logic the graphs replay: padded batches (rows masked by steps_left), sequences
asking fewer drafts than others, the max_model_len clamp of masked rows, drafts and logprobs collected with one
copy. The proposer with the static-buffer decode step must give the naive greedy drafts, the same drafts and
logprobs as the eager decode loop, and leave the same KV pool (padding and finished rows write no KV).
"""
import asyncio

import pytest
import torch

from conftest import make_config
from drafter_service.cuda_graphs import DecodeGraphs
from drafter_service.runtime import build_runtime
from lockstep import ProposerDrafter, run_lockstep
from naive_eagle import NaiveEagle1


def cpu_runtime(tiny_model, tmp_path, static_decode: bool, **kw):
    rt = build_runtime(make_config(*tiny_model, tmp_path, **kw))
    if static_decode:
        p = rt.proposer
        p.decode_graphs = DecodeGraphs(p.model, p.kv_layers, rt.config.block_size, rt.max_model_len,
                                       rt.config.max_batch_seqs, rt.dtype, rt.device)
        assert not p.decode_graphs.graphs  # never captured: _replay runs the step eagerly
    return rt


@pytest.mark.parametrize("num_seqs,max_model_len,max_batch_seqs", [(3, 1024, 1024), (5, 1024, 1024),
                                                                     (33, 1024, 1024), (6, 72, 8)])
def test_static_decode_step_matches_naive_and_eager(tiny_model, tmp_path, num_seqs, max_model_len, max_batch_seqs):
    naive = NaiveEagle1(*tiny_model)
    kw = dict(max_model_len=max_model_len, max_batch_seqs=max_batch_seqs)
    eager = cpu_runtime(tiny_model, tmp_path, False, **kw)
    static = cpu_runtime(tiny_model, tmp_path, True, **kw)
    steps = 10 if num_seqs > 8 else 24
    records = asyncio.run(run_lockstep(
        [ProposerDrafter(eager.proposer), ProposerDrafter(static.proposer)], naive=naive, width=naive.H,
        vocab=naive.lm_head.shape[0], seed=num_seqs, engine_steps=steps, num_seqs=num_seqs,
        max_model_len=max_model_len, max_k=8, logprobs=True, prompts=(1, 2, 7, 16, 17, 40, 60), retire_len=150))
    assert len(records) >= num_seqs * steps // 2
    for r in records:
        got_eager, got_static = r.replies
        assert got_eager.drafts == r.expected, r
        assert got_static.drafts == r.expected, r
        torch.testing.assert_close(torch.tensor(got_static.logprobs), torch.tensor(got_eager.logprobs),
                                   atol=1e-4, rtol=1e-4)
        assert len(got_static.logprobs) == len(r.expected)
    if max_model_len < 100:  # sequences ran into the end: k cut by admission, masked rows clamped
        assert any(len(r.expected) < min(r.num_drafts, 8) for r in records)
    # same history -> the same blocks hold the same KV: no padding/finished row wrote anywhere
    torch.testing.assert_close(static.kv.kv, eager.kv.kv, atol=1e-4, rtol=1e-4)
    assert static.kv.pool.num_free == static.kv.num_blocks


def test_static_decode_step_masks_padding_rows(tiny_model, tmp_path):
    """After a step of n = 3 drafting rows in a padded batch of 4: the padding row wrote no KV (slot -1), and the
    row that asked for 1 draft was masked from the first decode step on."""
    rt = cpu_runtime(tiny_model, tmp_path, True, max_batch_seqs=4)
    graphs = rt.proposer.decode_graphs
    drafter = ProposerDrafter(rt.proposer)
    from drafter_client import SequenceStep

    g = torch.Generator().manual_seed(0)
    steps = [SequenceStep(f"q{i}", 0, torch.randint(0, 512, (m,), generator=g), torch.randn(m, 64, generator=g),
                          7, k) for i, (m, k) in enumerate([(5, 4), (9, 1), (3, 4)])]
    before = rt.kv.kv.clone()
    replies = asyncio.run(drafter.propose(steps))
    assert [len(r.drafts) for r in replies] == [4, 1, 4]
    assert graphs.slot_mapping[1].item() == -1 and graphs.slot_mapping[3].item() == -1  # finished, padding
    assert graphs.seq_lens[1].item() == 1 and graphs.seq_lens[3].item() == 1
    # rows 0 and 2 wrote scratch KV at positions m .. m+2 (3 decode steps); row 1 and the padding row nothing
    assert graphs.positions[0].item() == 5 - 1 + 3 and graphs.positions[2].item() == 3 - 1 + 3
    written = (rt.kv.kv != before).flatten(4).any(-1)  # [layers, 2, blocks, offsets]
    tables = {s.sequence_id: rt.proposer.table.get("lockstep", s.sequence_id).block_table for s in steps}
    expected = torch.zeros_like(written)
    for sid, last in (("q0", 5 + 3), ("q1", 9), ("q2", 3 + 3)):  # positions 0 .. last-1 written
        for t in range(last):
            expected[:, :, tables[sid][t // 16], t % 16] = True
    assert torch.equal(written, expected)
