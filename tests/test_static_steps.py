"""The static-buffer steps that cuda_graphs.py captures (first step, decode steps), run eagerly
on the CPU: the same code a CUDA graph records, checked in CI against the plain proposer and the naive fp64
reference. The graphs themselves (capture and replay) are checked on the GPU in test_cuda_fast_path.py.

A batch whose sequences all ask for drafts and bring at most first_step_tokens committed tokens each runs its first
step on the static rows: every sequence padded to the batch's largest m (its real rows last), padding sequences up
to the padded batch size; the others run it eagerly. Drafts must be identical, and so must the KV pools afterwards
(padding rows write nothing).
"""
import asyncio

import numpy as np
import pytest
import torch

from checkpoints import write_eagle3
from conftest import make_config
from drafter_service.engine.cuda_graphs import DecodeGraphs
from drafter_service.engine.proposer import STEP_BATCH_MIN_SEQUENCES
from drafter_service.runtime import build_runtime
from drafter_service.engine.step_io import StepInput
from lockstep import ProposerDrafter, run_lockstep
from naive_eagle import NaiveEagle1


@pytest.fixture(scope="module")
def tiny_eagle3(tmp_path_factory):
    """An EAGLE-3 head (fc over three target states inside the first step, a draft vocabulary with d2t)."""
    return write_eagle3(tmp_path_factory.mktemp("e3") / "model", seed=11)


def head_model(head: str, tiny_model, tiny_eagle3):
    return tiny_model if head == "eagle1" else tiny_eagle3


def with_static_steps(rt, max_batch_seqs: int = 8, first_step_tokens: int = 8):
    p = rt.proposer
    p.decode_graphs = DecodeGraphs(p.model, p.kv_layers, rt.kv.block_size, rt.max_model_len, max_batch_seqs,
                                   rt.dtype, rt.device, first_step_tokens)
    return rt


@pytest.mark.parametrize("num_seqs,max_model_len", [(1, 1024), (2, 1024), (3, 1024), (2, 72)])
def test_static_first_and_decode_steps_match_eager_and_naive(tiny_model, tmp_path, num_seqs, max_model_len):
    naive = NaiveEagle1(*tiny_model)
    plain = build_runtime(make_config(*tiny_model, tmp_path / "plain", max_model_len=max_model_len))
    static = with_static_steps(build_runtime(make_config(*tiny_model, tmp_path / "static",
                                                         max_model_len=max_model_len)))
    records = asyncio.run(run_lockstep(
        [ProposerDrafter(plain.proposer), ProposerDrafter(static.proposer)], naive=naive, width=naive.H,
        vocab=naive.lm_head.shape[0], seed=20 + num_seqs, engine_steps=40, num_seqs=num_seqs,
        max_model_len=max_model_len, max_k=6, prompts=(1, 2, 7, 16, 17, 40, 60)))
    assert len(records) >= 30
    for r in records:
        assert [a.drafts for a in r.replies] == [r.expected, r.expected], r
    graphs = static.proposer.decode_graphs
    # batch 1 is uniform unless a prompt of more than 8 tokens comes in one step; larger batches now and then
    assert graphs.first_steps_run >= (20 if num_seqs == 1 else 2), graphs.first_steps_run
    assert graphs.steps_run > graphs.first_steps_run  # non-uniform steps still replay the decode steps
    torch.testing.assert_close(static.kv.kv, plain.kv.kv, atol=1e-5, rtol=1e-5)


def test_which_batches_take_the_static_first_step(tiny_model, tmp_path):
    rt = with_static_steps(build_runtime(make_config(*tiny_model, tmp_path)), max_batch_seqs=8,
                           first_step_tokens=4)
    graphs = rt.proposer.decode_graphs
    assert graphs.first_sizes == [1, 2, 4, 8]

    def fits(ms: list[int], ks: list[int], start: int = 0) -> bool:
        m, k = np.array(ms), np.array(ks)
        return graphs.first_step_plan(start + m, m, k) is not None

    assert fits([3], [5])
    assert fits([2, 2, 2], [1, 4, 2])  # k may differ: steps_left masks the rows
    assert fits([4] * 8, [2] * 8)
    assert fits([2, 3], [2, 2], start=10)  # m differs: padded to 3 rows each
    assert fits([1, 4, 2, 1], [3, 1, 2, 5], start=3)  # contexts 4..7 >= M = 4
    assert not fits([1, 4, 2, 1], [3, 1, 2, 5], start=2)  # context 3 < M = 4
    assert not fits([2, 3], [2, 2])  # context 2 < M = 3: no room for the padding rows
    assert not fits([5], [2])  # m > first_step_tokens
    assert not fits([2, 2], [2, 0])  # a prefill chunk (k = 0) in the batch
    assert not fits([1] * 9, [2] * 9)  # more sequences than the largest size
    assert not fits([2], [17])  # more drafts than the decode buffers hold


def test_first_step_graphs_skip_batches_mostly_padding(tiny_model, tmp_path):
    """A big batch of mostly 1-token steps with one 7-token step would run 7x its rows through the graph: eager
    instead (bs * M <= max(2 T, FIRST_STEP_SMALL_ROWS)); padded batches of up to 768 rows still take the graph. And the flag is
    bounded: one graph per (size, m) is captured."""
    from drafter_service.config import ServerConfig

    rt = with_static_steps(build_runtime(make_config(*tiny_model, tmp_path)), max_batch_seqs=256)
    graphs = rt.proposer.decode_graphs

    def fits(ms: list[int]) -> bool:
        m = np.array(ms)
        return graphs.first_step_plan(20 + m, m, np.full(len(ms), 3)) is not None

    assert fits([1] * 31 + [8])  # 32 x 8 = 256 rows: small enough
    assert fits([1] * 127 + [6])  # 128 x 6 = 768 rows for 133 real ones: still small enough (measured: faster)
    assert not fits([1] * 127 + [7])  # 128 x 7 = 896 rows for 134 real ones
    assert not fits([1] * 255 + [6])  # 256 x 6 = 1536 rows for 261 real ones
    assert fits([4] * 127 + [8])  # 1024 rows for 516: at most twice
    assert fits([3] * 200)  # uniform
    with pytest.raises(ValueError, match="first_step_graph_tokens"):
        make_config(*tiny_model, tmp_path, first_step_graph_tokens=17)
    assert isinstance(make_config(*tiny_model, tmp_path, first_step_graph_tokens=16), ServerConfig)


def mixed_batches(num_seqs: int, seed: int, width: int = 64, vocab: int = 512, max_m: int = 8):
    """A prefill of 24..40 tokens per sequence (eager), then steps where each sequence re-sends one position and
    brings 1..max_m rows of its own (m differs between sequences and steps), k = 1..6."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, vocab, (num_seqs, 400), generator=g)
    hid = torch.randn(num_seqs, 400, width, generator=g)
    pos = torch.randint(24, 41, (num_seqs,), generator=g).tolist()
    batches = [[StepInput("ns", f"s{i}", 0, toks[i, :p], hid[i, :p], int(toks[i, p]), 0)
                for i, p in enumerate(pos)]]
    for _ in range(12):
        ms = torch.randint(1, max_m + 1, (num_seqs,), generator=g).tolist()
        ks = torch.randint(1, 7, (num_seqs,), generator=g).tolist()
        batch = []
        for i in range(num_seqs):
            p, m = pos[i] - 1, ms[i]
            batch.append(StepInput("ns", f"s{i}", p, toks[i, p : p + m], hid[i, p : p + m], int(toks[i, p + m]),
                                   ks[i]))
            pos[i] = p + m
        batches.append(batch)
    return batches


@pytest.mark.parametrize("head,num_seqs", [("eagle1", 3), ("eagle1", 8), ("eagle1", 13), ("eagle3", 3),
                                            ("eagle3", 13)])
def test_mixed_m_first_step_matches_eager(tiny_model, tiny_eagle3, tmp_path, head, num_seqs):
    """Batches of mixed m (1..8 rows per sequence): the padded static first step gives the eager drafts and the same
    KV, with padding rows inside sequences (right-aligned real rows) and padding sequences (13 -> 16)."""
    model = head_model(head, tiny_model, tiny_eagle3)
    plain = build_runtime(make_config(*model, tmp_path / "plain"))
    static = with_static_steps(build_runtime(make_config(*model, tmp_path / "static")), max_batch_seqs=16)
    batches = mixed_batches(num_seqs, seed=num_seqs, width=plain.limits.hidden_states_width,
                            vocab=plain.limits.vocab_size)
    assert any(len({len(s.token_ids) for s in b}) > 1 for b in batches[1:])
    for batch in batches:
        want = [(o.code, o.drafts) for o in plain.proposer.step(batch)]
        got = [(o.code, o.drafts) for o in static.proposer.step(batch)]
        assert got == want
        assert all(code == 0 for code, _ in got)
    assert static.proposer.decode_graphs.first_steps_run == len(batches) - 1  # every step after the prefill
    torch.testing.assert_close(static.kv.kv, plain.kv.kv, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 2])
def test_first_step_graphs_on_cuda_match_naive(tiny_model, tmp_path, num_seqs):
    """The captured graphs (first step + decode) in fp32 against the naive reference, at batch 1 and 2."""
    naive = NaiveEagle1(*tiny_model)
    rt = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32", max_batch_seqs=8))
    graphs = rt.proposer.decode_graphs
    assert sorted(graphs.first_graphs) == [(bs, m) for bs in (1, 2, 4, 8) for m in range(1, 9)]
    records = asyncio.run(run_lockstep([ProposerDrafter(rt.proposer)], naive=naive, width=naive.H,
                                       vocab=naive.lm_head.shape[0], seed=40 + num_seqs, engine_steps=40,
                                       num_seqs=num_seqs, max_model_len=1024, max_k=6))
    for r in records:
        assert r.replies[0].drafts == r.expected, r
    assert graphs.first_steps_run >= (20 if num_seqs == 1 else 2), graphs.first_steps_run


@pytest.mark.gpu
def test_padded_uniform_batches_on_cuda_match_cpu(tiny_model, tmp_path):
    """3 sequences (padded to 4) with the same m every step, m changing between steps: CUDA graphs == CPU."""
    cpu = build_runtime(make_config(*tiny_model, tmp_path / "cpu"))
    gpu = build_runtime(make_config(*tiny_model, tmp_path / "gpu", device="cuda", dtype="float32",
                                    max_batch_seqs=8))
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, 512, (3, 200), generator=g)
    hid = torch.randn(3, 200, 64, generator=g)

    def steps(p: int, m: int, k: int) -> list[StepInput]:
        return [StepInput("ns", f"s{i}", p, toks[i, p : p + m], hid[i, p : p + m], int(toks[i, p + m]), k + i)
                for i in range(3)]

    batches = [steps(0, 30, 0)]  # prefill, eager
    p = 30
    for m in (1, 3, 2, 5, 8, 4, 1):
        batches.append(steps(p - 1, m, 3))  # re-sends one position, then m - 1 new ones
        p += m - 1
    for batch in batches:
        want = [o.drafts for o in cpu.proposer.step(batch)]
        got = [o.drafts for o in gpu.proposer.step(batch)]
        assert got == want
    assert gpu.proposer.decode_graphs.first_steps_run == len(batches) - 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs,max_m", [(5, 8), (48, 6)])
def test_mixed_m_batches_on_cuda_match_cpu(tiny_model, tmp_path, num_seqs, max_m):
    """Mixed m on the captured first-step graphs, batch 5 (padded to 8, m 1..8) and 48 (above the old limit of 32,
    m 1..6 as with k = 5): CUDA graphs == CPU, and every step after the prefill that the row budget admits (padded
    rows at most twice the real ones, or <= 256) replayed from a first-step graph; at 48 (the columns path) the
    prefill (k = 0) too, from a packed first-step graph."""
    cpu = build_runtime(make_config(*tiny_model, tmp_path / "cpu"))
    gpu = build_runtime(make_config(*tiny_model, tmp_path / "gpu", device="cuda", dtype="float32",
                                    max_batch_seqs=64))
    batches = mixed_batches(num_seqs, seed=100 + num_seqs, max_m=max_m)
    padded = 8 if num_seqs == 5 else 48
    admitted = sum(padded * max(len(s.token_ids) for s in b) <= max(2 * sum(len(s.token_ids) for s in b), 256)
                   for b in batches[1:])
    assert admitted >= 10  # the workload exercises the graphs (this seed: 12 of 12)
    for batch in batches:
        want = [o.drafts for o in cpu.proposer.step(batch)]
        got = [o.drafts for o in gpu.proposer.step(batch)]
        assert got == want
    graphs = gpu.proposer.decode_graphs
    prefill_packed = int(num_seqs >= STEP_BATCH_MIN_SEQUENCES)  # (the per-sequence path keeps k >= 1 for graphs)
    # (a step the padded graph does not admit replays the packed one: every step after the prefill is graphed)
    assert graphs.first_steps_run == len(batches) - 1 + prefill_packed
    assert graphs.packed_first_steps_run >= prefill_packed


@pytest.mark.parametrize("head,num_seqs", [("eagle1", 9), ("eagle1", 24), ("eagle3", 9), ("eagle1", 1),
                                            ("eagle3", 3)])
def test_a_columns_step_builds_its_first_step_rows_from_the_record(tiny_model, tiny_eagle3, tmp_path, head,
                                                                   num_seqs):
    """step_batch's columns path on the static steps: the record (first_step_record.py) and the first-step build
    kernel stand in for the step metadata. Same drafts, statuses and KV as the plain per-sequence step, with mixed m,
    mixed k, re-sent positions and a padded batch (9 -> 16, 24 -> 32). Where first-step graphs run, greedy steps of
    fewer than STEP_BATCH_MIN_SEQUENCES take it too (1, 3 -> 4: Proposer.takes_columns)."""
    from test_step_batch import Traffic, as_batch, same

    model = head_model(head, tiny_model, tiny_eagle3)
    plain = build_runtime(make_config(*model, tmp_path / "plain"))
    static = with_static_steps(build_runtime(make_config(*model, tmp_path / "static")), max_batch_seqs=32)
    graphs = static.proposer.decode_graphs
    t = Traffic(num_seqs, plain.limits.hidden_states_width, plain.limits.vocab_size, num_seqs)
    sids = sorted(t.tokens)
    for round in range(10):
        steps = [t.step(sid, m=t.rng.randint(1, 6), k=t.rng.randint(1, 6), back=t.rng.choice([0, 0, 1, 2]))
                 for sid in sids]
        before = (graphs.first_steps_run, static.proposer.columns_steps_run)
        out = plain.proposer.step(steps)
        same(out, static.proposer.step_batch(as_batch(steps)))
        t.answered(steps, out)
        if round > 0:  # (the first round creates the sequences: the per-sequence path, a 40-token prefill)
            assert (graphs.first_steps_run, static.proposer.columns_steps_run) == (before[0] + 1, before[1] + 1)
    torch.testing.assert_close(static.kv.kv, plain.kv.kv, atol=1e-5, rtol=1e-5)


def test_small_steps_take_the_columns_way_only_where_first_step_graphs_run(tiny_model, tmp_path):
    """Below STEP_BATCH_MIN_SEQUENCES: a greedy step goes the columns way with first-step graphs, the per-sequence
    way without them (its step metadata is built on the host: cheaper per sequence there) and when it samples; the
    step channel's frames are parsed to match (Proposer.takes_columns). Same answers every way."""
    from test_step_batch import Traffic, as_batch, same

    plain = build_runtime(make_config(*tiny_model, tmp_path / "plain"))
    static = with_static_steps(build_runtime(make_config(*tiny_model, tmp_path / "static")), max_batch_seqs=8)
    assert static.proposer.takes_columns(1, 1) and not plain.proposer.takes_columns(7, 20)
    assert plain.proposer.takes_columns(8, 8) and plain.proposer.takes_columns(1, 65)  # (> SMALL_STEP_ROWS rows)
    t = Traffic(4, plain.limits.hidden_states_width, plain.limits.vocab_size, 3)
    first = [t.step(sid, 3, 4) for sid in t.tokens]
    same(plain.proposer.step(first), static.proposer.step_batch(as_batch(first)))
    for temperature, columns in ((0.0, 1), (0.7, 0), (0.0, 1)):
        steps = [t.step(sid, t.rng.randint(1, 3), t.rng.randint(1, 5), temperature=temperature) for sid in t.tokens]
        before = static.proposer.columns_steps_run
        out = plain.proposer.step(steps)
        same(out, static.proposer.step_batch(as_batch(steps)))
        t.answered(steps, out)
        assert static.proposer.columns_steps_run == before + columns
    assert plain.proposer.columns_steps_run == 0


async def test_small_per_sequence_requests_run_from_their_columns(tiny_model, tmp_path):
    """A request of SequenceStep messages (what the client sends below COLUMNS_MIN_SEQUENCES) that the proposer would
    run from columns is decoded as columns (DrafterServicer.steps_as_columns): where first-step graphs run, greedy
    steps of 2-7 sequences by unary Propose, by a ProposeStream and through a step channel that takes protobuf go
    the columns way, and are answered as SequenceResult messages (encoded but for the drafts while the step ran) with
    the plain server's drafts, statuses and lengths; a step that samples, asks for log-probabilities or is one
    sequence goes per sequence as before."""
    import random

    from conftest import ServerThread
    from drafter_client import DrafterClient, SequenceStep

    H, V = 64, 512
    rng, g = random.Random(5), torch.Generator().manual_seed(5)
    with ServerThread(make_config(*tiny_model, tmp_path / "plain")) as plain, \
            ServerThread(make_config(*tiny_model, tmp_path / "static")) as static:
        with_static_steps(static.server.runtime, max_batch_seqs=8)  # (before any request: the step thread is idle)
        proposer = static.server.runtime.proposer
        reference = DrafterClient(plain.uds, namespace="ns")
        unary, channel = DrafterClient(static.uds, namespace="ns"), DrafterClient(static.uds, namespace="ns")
        seqs = {f"s{i}": {"tokens": [rng.randrange(V) for _ in range(rng.randint(2, 9))], "sent": 0}
                for i in range(4)}
        for s in seqs.values():
            s["hidden"] = torch.randn(len(s["tokens"]), H, generator=g)
        session = None
        try:
            assert await channel.open_step_channel(frames=False)  # (ProposeRequest bytes through the channel)
            session = await unary.stream().__aenter__()
            for step in range(13):
                ids = list(seqs) if step % 4 else list(seqs)[: rng.randint(1, 3)]
                sampled, logprobs = step in (5, 10), step == 7
                steps = []
                for sid in ids:
                    s = seqs[sid]
                    end = len(s["tokens"]) - 1
                    steps.append(SequenceStep(sid, s["sent"], s["tokens"][s["sent"]:end], s["hidden"][s["sent"]:end],
                                              s["tokens"][end], rng.randint(1, 5),
                                              temperature=0.8 if sampled and sid == "s1" else 0.0, seed=3,
                                              return_logprobs=logprobs))
                before = proposer.columns_steps_run
                early = (static.server.servicer.early_replies, static.server.runtime.metrics.channels.early_replies)
                transport = ("unary", "stream", "channel")[step % 3]
                if transport == "unary":
                    got = await unary.propose(steps)
                elif transport == "stream":
                    got = await session.propose(steps)
                else:
                    got = await channel.propose(steps)
                    assert channel.step_channel_open
                want = await reference.propose(steps)
                assert not got.fallback and not want.fallback, (got.fallback_reason, want.fallback_reason)
                # (a step that starts sequences too: Proposer._start_sequences starts them from the columns)
                goes_columns = len(ids) > 1 and not sampled and not logprobs
                assert proposer.columns_steps_run == before + goes_columns, (step, transport, ids, sampled, logprobs)
                # (such a step's reply but its drafts was encoded while it ran: ReplyHead with the sequence ids)
                assert (static.server.servicer.early_replies - early[0],
                        static.server.runtime.metrics.channels.early_replies - early[1]) == \
                    ((0, goes_columns) if transport == "channel" else (goes_columns, 0)), (step, transport)
                for a, b in zip(got.sequences, want.sequences, strict=True):
                    assert (a.sequence_id, a.code, a.drafts.tolist(), a.accepted_drafts, a.committed_length) == \
                        (b.sequence_id, b.code, b.drafts.tolist(), b.accepted_drafts, b.committed_length), step
                for st, r in zip(steps, want.sequences):
                    assert r.ok, r.message
                    s = seqs[st.sequence_id]
                    s["sent"] = st.start_position + len(st.token_ids)
                    new = r.drafts.tolist()[: rng.randint(0, r.drafts.numel())] + [rng.randrange(V)]
                    s["tokens"] += new
                    s["hidden"] = torch.cat([s["hidden"], torch.randn(len(new), H, generator=g)])
        finally:
            if session is not None:
                await session.__aexit__(None, None, None)
            for c in (reference, unary, channel):
                await c.close()
