"""The decode step that cuda_graphs.py captures, run eagerly on the CPU on its static buffers (no graphs).

This checks, without a GPU, the logic the graphs replay: padded batches (rows masked by steps_left), sequences
asking fewer drafts than others, the max_model_len clamp of masked rows, drafts collected with one copy. The
proposer with the static-buffer decode step must give the naive greedy drafts, the same drafts as the eager decode
loop, and leave the same KV pool (padding and finished rows write no KV). EAGLE-1 and EAGLE-3 (draft vocabulary
with d2t) heads.
"""
import asyncio

import pytest
import torch

from checkpoints import write_eagle3
from conftest import make_config
from drafter_client import SequenceStep
from drafter_service.engine.cuda_graphs import DecodeGraphs
from drafter_service.runtime import build_runtime
from lockstep import ProposerDrafter, run_lockstep
from naive_eagle import NaiveEagle1
from sampled_steps import check_sampled_steps
from naive_eagle3 import NaiveEagle3


def cpu_runtime(head, target, tmp_path, static_decode: bool, **kw):
    rt = build_runtime(make_config(head, target, tmp_path, **kw))
    if static_decode:
        p = rt.proposer
        p.decode_graphs = DecodeGraphs(p.model, p.kv_layers, rt.config.block_size, rt.max_model_len,
                                       rt.config.max_batch_seqs, rt.dtype, rt.device)
        assert not p.decode_graphs.graphs  # never captured: _replay runs the step eagerly
    return rt


@pytest.fixture(scope="module")
def tiny_eagle3(tmp_path_factory):
    return write_eagle3(tmp_path_factory.mktemp("e3") / "model", seed=10)


@pytest.mark.parametrize("head,num_seqs,max_model_len,max_batch_seqs", [
    ("eagle1", 3, 1024, 1024), ("eagle1", 5, 1024, 1024), ("eagle1", 33, 1024, 1024), ("eagle1", 6, 72, 8),
    ("eagle3", 5, 1024, 1024)])
def test_static_decode_step_matches_naive_and_eager(tiny_model, tiny_eagle3, tmp_path, head, num_seqs,
                                                    max_model_len, max_batch_seqs):
    model = tiny_model if head == "eagle1" else tiny_eagle3
    naive = NaiveEagle1(*model) if head == "eagle1" else NaiveEagle3(*model)
    width, vocab = (naive.H, naive.lm_head.shape[0]) if head == "eagle1" else (naive.width, naive.vocab)
    kw = dict(max_model_len=max_model_len, max_batch_seqs=max_batch_seqs)
    eager = cpu_runtime(*model, tmp_path, False, **kw)
    static = cpu_runtime(*model, tmp_path, True, **kw)
    steps = 10 if num_seqs > 8 else 24
    records = asyncio.run(run_lockstep(
        [ProposerDrafter(eager.proposer), ProposerDrafter(static.proposer)], naive=naive, width=width,
        vocab=vocab, seed=num_seqs, engine_steps=steps, num_seqs=num_seqs, max_model_len=max_model_len, max_k=8,
        prompts=(1, 2, 7, 16, 17, 40, 60), retire_len=150))
    assert len(records) >= num_seqs * steps // 2
    for r in records:
        got_eager, got_static = r.replies
        assert got_eager.drafts == r.expected, r
        assert got_static.drafts == r.expected, r
    if max_model_len < 100:  # sequences ran into the end: k cut by admission, masked rows clamped
        assert any(len(r.expected) < min(r.num_drafts, 8) for r in records)
    # same history -> the same blocks hold the same KV: no padding/finished row wrote anywhere
    torch.testing.assert_close(static.kv.kv, eager.kv.kv, atol=1e-4, rtol=1e-4)
    assert static.kv.pool.num_free == static.kv.num_blocks


def test_static_decode_step_masks_padding_rows(tiny_model, tmp_path):
    """After a step of n = 3 drafting rows in a padded batch of 4: the padding row wrote no KV (slot -1), and the
    row that asked for 1 draft was masked from the first decode step on."""
    rt = cpu_runtime(*tiny_model, tmp_path, True, max_batch_seqs=4)
    graphs = rt.proposer.decode_graphs
    g = torch.Generator().manual_seed(0)
    steps = [SequenceStep(f"q{i}", 0, torch.randint(0, 512, (m,), generator=g), torch.randn(m, 64, generator=g),
                          7, k) for i, (m, k) in enumerate([(5, 4), (9, 1), (3, 4)])]
    before = rt.kv.kv.clone()
    replies = asyncio.run(ProposerDrafter(rt.proposer).propose(steps))
    assert [len(r.drafts) for r in replies] == [4, 1, 4]
    assert graphs.slot_mapping[1].item() == -1 and graphs.slot_mapping[3].item() == -1  # finished, padding
    assert graphs.seq_lens[1].item() == 1 and graphs.seq_lens[3].item() == 1
    # rows 0 and 2 ran 3 decode steps, at positions m .. m+2
    assert graphs.positions[0].item() == 5 - 1 + 3 and graphs.positions[2].item() == 3 - 1 + 3
    written = (rt.kv.kv != before).flatten(4).any(-1)  # [layers, 2, blocks, offsets]
    tables = {s.sequence_id: rt.proposer.table.get("lockstep", s.sequence_id).block_table for s in steps}
    expected = torch.zeros_like(written)
    for sid, end in (("q0", 5 + 3), ("q1", 9), ("q2", 3 + 3)):  # committed rows, then scratch rows; q1 none
        for t in range(end):
            expected[:, :, tables[sid][t // 16], t % 16] = True
    assert torch.equal(written, expected)


def test_sampling_steps_take_the_eager_loop(tiny_model, tmp_path):
    """A step with a sampled sequence (or logprobs, or top-k) is not greedy-only: the graphs are not used."""
    rt = cpu_runtime(*tiny_model, tmp_path, True)
    calls = []
    rt.proposer.decode_graphs.draft = lambda *a: calls.append(a)  # would fail the step if it were called
    g = torch.Generator().manual_seed(1)
    steps = [SequenceStep(f"t{i}", 0, torch.randint(0, 512, (6,), generator=g), torch.randn(6, 64, generator=g),
                          3, 4, temperature=t, seed=9, return_logprobs=lp) for i, (t, lp) in
             enumerate([(0.0, False), (0.9, False), (0.0, True)])]
    for batch in ([steps[0], steps[1]], [steps[2]]):
        replies = asyncio.run(ProposerDrafter(rt.proposer).propose(batch))
        assert all(r.code == 0 and len(r.drafts) == 4 for r in replies)
    assert calls == []


def test_decode_steps_replay_the_longest_chains_first(tiny_model, tmp_path):
    """n decode steps replay the captured chains that fit, longest first, then single steps; a batch size without
    chains, or none captured (the CPU), runs n single steps."""
    rt = cpu_runtime(*tiny_model, tmp_path, True)
    graphs = rt.proposer.decode_graphs
    assert graphs.chain_lengths == (4, 2)
    replayed = []

    class Recorded:
        def __init__(self, name):
            self.name = name

        def replay(self):
            replayed.append(self.name)

    graphs.graphs = {4: Recorded(1), 8: Recorded(1)}
    graphs.chains = {(4, 4): Recorded(4), (4, 2): Recorded(2)}
    for n, expected in [(0, []), (1, [1]), (2, [2]), (3, [2, 1]), (4, [4]), (5, [4, 1]), (7, [4, 2, 1]),
                        (11, [4, 4, 2, 1])]:
        replayed.clear()
        graphs._replay_steps(4, n)
        assert replayed == expected, n
    replayed.clear()
    graphs._replay_steps(8, 3)  # no chains at this size
    assert replayed == [1, 1, 1]
    # --max-draft-tokens caps the decode steps at k - 1: no chain longer than that is captured
    for k, lengths in [(2, ()), (3, (2,)), (4, (2,)), (5, (4, 2))]:
        p = rt.proposer
        assert DecodeGraphs(p.model, p.kv_layers, rt.config.block_size, rt.max_model_len, 8, rt.dtype, rt.device,
                            max_drafts=k).chain_lengths == lengths, k


def test_capture_takes_every_graph_into_one_pool(tiny_model, tmp_path, monkeypatch):
    """DecodeGraphs.capture's bookkeeping, with torch.cuda's graph calls faked on the CPU: per padded batch size one
    decode-step graph, a chain of each length (that many decode steps inside one capture), a sampled decode step
    and a sampled draw of draft 1 per top-N width, per (size, M) a first-step graph, per (size, rows) a packed one;
    the first capture makes the pool and every later one captures into it."""
    import contextlib

    rt = cpu_runtime(*tiny_model, tmp_path, False)
    p = rt.proposer
    graphs = DecodeGraphs(p.model, p.kv_layers, rt.config.block_size, rt.max_model_len, 4, rt.dtype, rt.device,
                          first_step_tokens=2, max_drafts=8, first_step_rows=64, max_top_k=8)
    captures = []  # (pool given, what ran inside the capture)
    running: list | None = None

    class FakeGraph:
        def pool(self):
            return "the pool"

    @contextlib.contextmanager
    def fake_capture(graph, pool=None, stream=None, capture_error_mode=None):
        nonlocal running
        running = []
        yield
        captures.append((pool, running))
        running = None

    def counted(name, method):
        def run(*args):
            if running is not None:
                running.append((name, *args))
            return method(*args)
        return run

    for name, value in (("synchronize", lambda *a: None), ("empty_cache", lambda: None),
                        ("mem_get_info", lambda *a: (0, 0)), ("Stream", lambda **kw: None),
                        ("CUDAGraph", FakeGraph), ("graph", fake_capture)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(graphs, "_step", counted("step", graphs._step))
    monkeypatch.setattr(graphs, "_first_step", counted("first", graphs._first_step))
    monkeypatch.setattr(graphs, "_packed_first_step", counted("packed", graphs._packed_first_step))
    monkeypatch.setattr(graphs, "_first_draw", counted("draw", graphs._first_draw))
    graphs.capture()
    assert graphs.sizes == [1, 2, 4] and graphs.chain_lengths == (4, 2)
    assert sorted(graphs.graphs) == [1, 2, 4] and sorted(graphs.chains) == [(bs, n) for bs in (1, 2, 4) for n in (2, 4)]
    assert sorted(graphs.first_graphs) == [(bs, m) for bs in (1, 2, 4) for m in (1, 2)]
    assert sorted(graphs.packed_graphs) == [(bs, rows) for bs in (1, 2, 4) for rows in (32, 64)]
    assert graphs.widths == [0, 8] and sorted(graphs.sampled_graphs) == [(bs, w) for bs in (1, 2, 4) for w in (0, 8)]
    assert sorted(graphs.first_draw_graphs) == sorted(graphs.sampled_graphs)
    assert [pool for pool, _ in captures] == [None] + ["the pool"] * (len(captures) - 1)
    expected = []
    for bs in (4, 2, 1):  # largest first
        expected += [[("step", bs)], [("step", bs)] * 4, [("step", bs)] * 2, [("step", bs, 0)], [("step", bs, 8)]]
    for bs in (4, 2, 1):
        expected += [[("first", bs, m)] for m in (2, 1)]
    for bs in (4, 2, 1):
        expected += [[("packed", bs, rows)] for rows in (64, 32)]
    for bs in (4, 2, 1):
        expected += [[("draw", bs, w)] for w in (0, 8)]
    assert [ran for _, ran in captures] == expected


@pytest.mark.parametrize("head,first_step_graphs,num_seqs", [
    ("eagle1", False, 5), ("eagle3", False, 5), ("eagle1", True, 5), ("eagle3", True, 5), ("eagle3", True, 33)])
def test_sampled_decode_steps_match_the_eager_loop(tiny_model, tiny_eagle3, tmp_path, head, first_step_graphs,
                                                   num_seqs):
    """Sampling steps (temperatures above 0 beside greedy rows, log q, top-N of mixed N, mixed k) run their decode
    steps on the sampled static steps (top-N width 0, 16 or the cap, the narrowest that holds the step's largest N),
    and with first-step graphs their first step on the (greedy) static first step followed by draft 1 drawn again
    (_first_draw; 5 sequences: the per-sequence path, 33: the columns path, a new sequence's prompt chunk of k = 0
    beside the decodes in its last step: a packed first-step graph): the same drafts, log q and top-N as the eager
    loop, and the same KV."""
    from drafter_service.runtime import max_top_k_probs

    model = tiny_model if head == "eagle1" else tiny_eagle3
    eager = cpu_runtime(*model, tmp_path / "eager", False)
    static = cpu_runtime(*model, tmp_path / "static", False)
    p = static.proposer
    p.decode_graphs = graphs = DecodeGraphs(p.model, p.kv_layers, static.config.block_size, static.max_model_len,
                                            static.config.max_batch_seqs, static.dtype, static.device,
                                            first_step_tokens=8 if first_step_graphs else 0,
                                            first_step_rows=256 if first_step_graphs else 0,
                                            max_top_k=max_top_k_probs(p.model))
    assert not graphs.sampled_graphs and not graphs.first_draw_graphs  # (never captured: the steps run eagerly)
    draws = []
    first_draw = graphs._first_draw
    graphs._first_draw = lambda bs, width: (draws.append(width), first_draw(bs, width))
    columns_before = p.columns_steps_run
    check_sampled_steps(eager, static, num_seqs=num_seqs, seed=num_seqs, prompt_chunk=num_seqs > 32)
    # (33: the third step brings a prompt chunk of k = 0 beside the decodes: a packed first-step graph)
    assert graphs.first_steps_run == (3 if first_step_graphs else 0)
    assert graphs.packed_first_steps_run == (1 if num_seqs > 32 else 0)
    assert draws == ([0, 16, max_top_k_probs(p.model)] if first_step_graphs else [])
    # (33: the prefill's new sequences start from the columns too; its 924 rows pass the packed graphs' 256)
    assert p.columns_steps_run - columns_before == (4 if num_seqs >= 32 else 0)


def test_sampled_step_graphs_flag_and_widths(tiny_model):
    """--sampled-step-graphs (on by default) / --no-sampled-step-graphs; the top-N widths captured: 0, 16 and the
    cap (the cap alone where it is 16 or less)."""
    from drafter_service.cli import parse_args
    from drafter_service.engine.cuda_graphs import sampled_widths

    head, target = tiny_model
    base = ["--model", str(head), "--target-model", str(target)]
    assert parse_args(base).sampled_step_graphs is True
    assert parse_args(base + ["--no-sampled-step-graphs"]).sampled_step_graphs is False
    assert sampled_widths(256) == [0, 16, 256] and sampled_widths(16) == [0, 16] and sampled_widths(8) == [0, 8]
    assert sampled_widths(0) == [0]
