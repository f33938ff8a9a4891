"""The CUDA fast path (one host->device copy of the step metadata, decode steps replayed from CUDA graphs, one
device->host copy) against the CPU path and the naive reference. GPU only: every test is marked `gpu`.

Greedy drafts in fp32 must be identical (CPU server, CUDA server with graphs, CUDA server without graphs, naive
fp64 reference), over many engine steps with batch sizes that need padding (3, 5, 33 sequences: padded to 4, 8,
48), k mixed per sequence (1..8), sequences running into max_model_len (k cut, masked rows clamped), EAGLE-1 and
EAGLE-3 (draft vocabulary + d2t) heads. Steps with sampling/logprobs/top-k replay sampled decode graphs (their first
step runs eagerly): the same drafts as the eager loop, checked too.
bf16 on CUDA must agree with the fp32 CPU drafts on >= 90% of draft positions (on the CPU, bf16 vs fp32 agrees on
about 95% of positions for this test model; one early mismatch changes the rest of that sequence's drafts).
"""
import asyncio
import warnings
from contextlib import AsyncExitStack, ExitStack

import pytest
import torch

from checkpoints import write_eagle3
from conftest import ServerThread, make_config
from drafter_client import DrafterClient
from drafter_service.engine.cuda_graphs import graph_batch_sizes
from drafter_service.runtime import build_runtime
from lockstep import ClientDrafter, ProposerDrafter, run_lockstep
from naive_eagle import NaiveEagle1
from naive_eagle3 import NaiveEagle3
from sampled_steps import check_sampled_steps

pytestmark = pytest.mark.gpu


async def lockstep_servers(configs, naive, channels: bool = False, stats: dict | None = None, **kw):
    """Start one server per config, drive them in lockstep through the client; the first is the reference.
    channels: the clients of the servers after the first send their steps through a step channel (request frames).
    stats: filled with each server's columns steps during the traffic and each client's steps through a channel."""
    with ExitStack() as servers:
        threads = [servers.enter_context(ServerThread(c)) for c in configs]
        async with AsyncExitStack() as clients:
            drafters = [ClientDrafter(await clients.enter_async_context(DrafterClient(t.uds, namespace="ls")))
                        for t in threads]
            for d in drafters[1:] if channels else ():
                assert await d.client.open_step_channel()
            for t in threads[1:]:
                if t.config.device == "cuda" and t.config.cuda_graphs:
                    assert t.server.runtime.proposer.decode_graphs is not None
            if isinstance(naive, NaiveEagle1):
                kw.update(width=naive.H, vocab=naive.lm_head.shape[0])
            else:
                kw.update(width=naive.width, vocab=naive.vocab)
            # (the servers' own steps before the traffic, the warm-up's, are not counted in stats)
            columns_before = [t.server.runtime.proposer.columns_steps_run for t in threads]
            records = await run_lockstep(drafters, naive=naive, **kw)
            graphs_used = [t.server.runtime.proposer.decode_graphs.steps_run for t in threads
                           if t.server.runtime.proposer.decode_graphs is not None]
            if stats is not None:
                stats["columns_steps"] = [t.server.runtime.proposer.columns_steps_run - before
                                          for t, before in zip(threads, columns_before)]
                stats["channel_steps"] = [d.client.steps_through_channel for d in drafters]
            return records, graphs_used


def test_graphs_captured_at_startup(tiny_model, tmp_path, monkeypatch):
    rt = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", max_batch_seqs=40))
    graphs = rt.proposer.decode_graphs
    assert graphs.sizes == graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 48]
    assert sorted(graphs.graphs) == graphs.sizes
    assert sorted(graphs.chains) == sorted((bs, n) for bs in graphs.sizes for n in (4, 2))  # (k <= 8: --max-draft-tokens)
    assert graphs.capture_seconds > 0
    assert build_runtime(make_config(*tiny_model, tmp_path, device="cuda", cuda_graphs=False)).proposer \
        .decode_graphs is None
    monkeypatch.setenv("DRAFTER_KERNELS", "torch")  # torch references synchronize: no graphs, eager decode
    assert build_runtime(make_config(*tiny_model, tmp_path, device="cuda")).proposer.decode_graphs is None


@pytest.mark.parametrize("num_seqs,logprobs", [(3, False), (5, False), (33, False), (5, True)])
async def test_cuda_graphs_match_cpu_server_and_naive(tiny_model, tmp_path, num_seqs, logprobs):
    """logprobs=True: no step is greedy-only; the decode steps replay the sampled decode graphs (same drafts, log q 0:
    greedy)."""
    naive = NaiveEagle1(*tiny_model)
    configs = [make_config(*tiny_model, tmp_path / "cpu"),
               make_config(*tiny_model, tmp_path / "graphs", device="cuda", dtype="float32"),
               make_config(*tiny_model, tmp_path / "eager", device="cuda", dtype="float32", cuda_graphs=False)]
    records, graphs_used = await lockstep_servers(
        configs, naive, seed=100 + num_seqs, engine_steps=40 if num_seqs < 10 else 16, num_seqs=num_seqs,
        max_model_len=1024, max_k=8, logprobs=logprobs)
    assert len(records) >= num_seqs * 5
    assert graphs_used[0] >= 10, graphs_used
    for r in records:
        cpu, graphs, eager = r.replies
        assert cpu.drafts == r.expected, r
        assert graphs.drafts == r.expected, r
        assert eager.drafts == r.expected, r
        if logprobs:
            assert graphs.logprobs == eager.logprobs == cpu.logprobs == [0.0] * len(r.expected)  # greedy: log 1


@pytest.mark.parametrize("head,channels", [("eagle1", True), ("eagle3", True), ("eagle1", False),
                                           ("eagle3", False)])
async def test_small_channel_steps_from_their_columns_match_naive(tiny_model, tmp_path, head, channels):
    """Step-channel frames of 2-7 sequences, and unary requests of 2-7 SequenceStep messages (channels False), go the
    columns way where first-step graphs run (Proposer.takes_columns, DrafterServicer.steps_as_columns; one-sequence
    steps stay per sequence): the drafts of the CPU server and of the naive reference, at 3 and 1 sequences."""
    if head == "eagle1":
        naive, model = NaiveEagle1(*tiny_model), tiny_model
    else:
        model = write_eagle3(tmp_path / "model", seed=12)
        naive = NaiveEagle3(*model)
    for num_seqs in (3, 1):
        configs = [make_config(*model, tmp_path / f"cpu{num_seqs}"),
                   make_config(*model, tmp_path / f"graphs{num_seqs}", device="cuda", dtype="float32")]
        stats = {}
        records, graphs_used = await lockstep_servers(configs, naive, channels=channels, stats=stats,
                                                      seed=40 + num_seqs, engine_steps=30, num_seqs=num_seqs,
                                                      max_model_len=1024, max_k=6)
        assert graphs_used[0] >= 10, graphs_used
        for r in records:
            assert [a.drafts for a in r.replies] == [r.expected, r.expected], r
        # (the CUDA server's client: frames through its channel, or unary calls)
        assert (stats["channel_steps"][1] >= 20) if channels else (stats["channel_steps"][1] == 0), stats
        # 3 sequences: from their columns; 1 sequence: per sequence (its frame parsed into a StepInput)
        assert (stats["columns_steps"][1] >= 10) if num_seqs == 3 else (stats["columns_steps"][1] == 0), stats


async def test_cuda_graphs_near_max_model_len(tiny_model, tmp_path):
    """max_model_len 72: sequences run into the end (k cut by admission), masked rows of the padded batch pass it
    (advance_draft_step clamps them); drafts still equal the naive ones and no stray KV write shows later."""
    naive = NaiveEagle1(*tiny_model)
    configs = [make_config(*tiny_model, tmp_path / "cpu", max_model_len=72),
               make_config(*tiny_model, tmp_path / "graphs", device="cuda", dtype="float32", max_model_len=72)]
    records, graphs_used = await lockstep_servers(configs, naive, seed=7, engine_steps=60, num_seqs=6,
                                                  max_model_len=72, max_k=8, prompts=(1, 2, 7, 16, 17, 40, 60))
    assert graphs_used[0] >= 20
    assert any(len(r.expected) < r.num_drafts for r in records)
    for r in records:
        assert [a.drafts for a in r.replies] == [r.expected, r.expected], r


async def test_cuda_graphs_eagle3_match_naive(tmp_path):
    head, target = write_eagle3(tmp_path / "model", seed=10)  # draft vocabulary 200 of 512, d2t
    naive = NaiveEagle3(head, target)
    configs = [make_config(head, target, tmp_path / "cpu"),
               make_config(head, target, tmp_path / "graphs", device="cuda", dtype="float32")]
    records, graphs_used = await lockstep_servers(configs, naive, seed=3, engine_steps=40, num_seqs=9,
                                                  max_model_len=1024, max_k=6)
    assert len(records) >= 100 and graphs_used[0] >= 20
    for r in records:
        assert [a.drafts for a in r.replies] == [r.expected, r.expected], r


async def test_cuda_graphs_bf16_agree_with_fp32_cpu(tiny_model, tmp_path):
    naive = NaiveEagle1(*tiny_model)
    configs = [make_config(*tiny_model, tmp_path / "cpu"),
               make_config(*tiny_model, tmp_path / "graphs", device="cuda", dtype="bfloat16")]
    records, graphs_used = await lockstep_servers(configs, naive, seed=11, engine_steps=40, num_seqs=16,
                                                  max_model_len=1024, max_k=6)
    assert graphs_used[0] >= 20
    pairs = [(a, b) for r in records for a, b in zip(r.replies[0].drafts, r.replies[1].drafts)]
    assert all(len(r.replies[1].drafts) == len(r.replies[0].drafts) for r in records)
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    assert len(pairs) > 1000 and agreement >= 0.90, agreement


def test_graphs_in_process_same_drafts_and_kv_as_eager(tiny_model, tmp_path):
    """Proposers called directly (no server): graphs on vs off on the same device; after the run the KV pools
    match (padding and finished rows wrote nothing)."""
    naive = NaiveEagle1(*tiny_model)
    on = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32"))
    off = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32", cuda_graphs=False))
    chains_replayed = []  # (the decode steps of k = 3..8 replay chains of 4 and 2 steps: counted, then run)

    class Counted:
        def __init__(self, key, chain):
            self.key, self.chain = key, chain

        def replay(self):
            chains_replayed.append(self.key)
            self.chain.replay()
    chains = on.proposer.decode_graphs.chains
    chains.update({key: Counted(key, chain) for key, chain in chains.items()})
    records = asyncio.run(run_lockstep([ProposerDrafter(off.proposer), ProposerDrafter(on.proposer)], naive=naive,
                                       width=naive.H, vocab=naive.lm_head.shape[0], seed=5, engine_steps=30,
                                       num_seqs=33, max_model_len=1024, max_k=8))
    for r in records:
        assert [a.drafts for a in r.replies] == [r.expected, r.expected], r
    assert on.proposer.decode_graphs.steps_run >= 20
    assert {n for _, n in chains_replayed} == {4, 2}, chains_replayed
    torch.testing.assert_close(on.kv.kv, off.kv.kv, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_seqs", [5, 33])
def test_sampled_decode_graphs_match_the_eager_loop(tiny_model, tmp_path, num_seqs):
    """Sampling steps (temperature > 0 beside greedy rows, log q, top-N) replay the first-step graph, the draw of
    draft 1 and the sampled decode graphs (5 sequences: from the per-sequence path, 33: from the columns): the same
    drafts, top-N ids and KV as the eager loop on the same device, log q and probabilities to rounding."""
    on = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32"))
    off = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32", sampled_step_graphs=False))
    graphs = on.proposer.decode_graphs
    assert off.proposer.decode_graphs.widths == [] and not off.proposer.decode_graphs.sampled_graphs
    assert sorted(graphs.sampled_graphs) == [(bs, w) for bs in graphs.sizes for w in graphs.widths]
    assert sorted(graphs.first_draw_graphs) == sorted(graphs.sampled_graphs)
    first_before, columns_before = graphs.first_steps_run, on.proposer.columns_steps_run
    check_sampled_steps(off, on, num_seqs=num_seqs, seed=num_seqs)
    # (and the 33 sequences' prefill, 924 rows of k = 0 from the columns: a packed graph)
    assert graphs.first_steps_run - first_before == 3 + (num_seqs > 32)
    assert on.proposer.columns_steps_run - columns_before == (4 if num_seqs > 32 else 0)


def test_a_sampled_graph_step_synchronizes_once(tiny_model, tmp_path):
    """With torch's sync debug mode on, a sampling step (temperature > 0, log q, top-N) whose decode steps replay
    the sampled graphs makes one synchronizing call, as a greedy one; with them off the eager loop makes more."""
    from drafter_client import SequenceStep

    def count_syncs(rt) -> int:
        drafter = ProposerDrafter(rt.proposer)
        g = torch.Generator().manual_seed(0)
        steps = [SequenceStep(f"q{i}", 0, torch.randint(0, 512, (20,), generator=g),
                              torch.randn(20, 64, generator=g), 3, 0) for i in range(5)]
        asyncio.run(drafter.propose(steps))
        decode = [SequenceStep(s.sequence_id, 17, s.token_ids[17:], s.hidden_states[17:], 4, 5, temperature=0.8,
                               seed=i, return_logprobs=True, top_k_probs=4) for i, s in enumerate(steps)]
        asyncio.run(drafter.propose(decode))  # (warm-up of every kernel)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                replies = asyncio.run(drafter.propose(decode))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert [len(r.drafts) for r in replies] == [5] * 5
        return sum("synchroniz" in str(w.message) for w in caught)

    graphs = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32"))
    before = graphs.proposer.decode_graphs.sampled_steps_run  # (the warm-up's sampled step)
    assert count_syncs(graphs) <= 1 and graphs.proposer.decode_graphs.sampled_steps_run - before == 2
    eager = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32",
                                      sampled_step_graphs=False))
    assert count_syncs(eager) > 4


def test_graph_step_synchronizes_once(tiny_model, tmp_path):
    """With torch's sync debug mode on, a decode step with graphs makes one synchronizing call (the stream sync
    after the copy of the drafts to the host); the eager loop makes several (one per decode step at least), which
    also shows that the warnings are caught."""
    from drafter_client import SequenceStep

    def count_syncs(rt) -> int:
        drafter = ProposerDrafter(rt.proposer)
        g = torch.Generator().manual_seed(0)
        steps = [SequenceStep(f"q{i}", 0, torch.randint(0, 512, (20,), generator=g),
                              torch.randn(20, 64, generator=g), 3, 0) for i in range(5)]
        asyncio.run(drafter.propose(steps))  # prefill, and warm-up of every kernel
        # mixed m (1..3 rows): the first step is padded into the first-step graphs' layout
        decode = [SequenceStep(s.sequence_id, 17 + i % 3, s.token_ids[17 + i % 3:], s.hidden_states[17 + i % 3:], 4,
                               1 + i) for i, s in enumerate(steps)]
        asyncio.run(drafter.propose(decode))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                replies = asyncio.run(drafter.propose(decode))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert [len(r.drafts) for r in replies] == [1, 2, 3, 4, 5]
        return sum("synchroniz" in str(w.message) for w in caught)

    graphs = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32"))
    # the first propose is a prefill (k = 0: no decode steps); the two decode proposes replay graphs, the first
    # step included
    assert count_syncs(graphs) <= 1 and graphs.proposer.decode_graphs.steps_run == 2
    assert graphs.proposer.decode_graphs.first_steps_run == 2
    eager = build_runtime(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32", cuda_graphs=False))
    assert count_syncs(eager) > 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="cuda:1: a second GPU is needed")
async def test_a_drafter_on_the_second_gpu_matches_cpu_and_naive(tiny_model, tmp_path):
    """--device cuda:1 with both GPUs visible: the step thread's current device is cuda:1 (a new thread's is cuda:0,
    and Triton launches on the current device: a 2 x H200 run of the predraft benchmark failed every step before)."""
    naive = NaiveEagle1(*tiny_model)
    configs = [make_config(*tiny_model, tmp_path / "cpu"),
               make_config(*tiny_model, tmp_path / "graphs1", device="cuda:1", dtype="float32"),
               make_config(*tiny_model, tmp_path / "eager1", device="cuda:1", dtype="float32", cuda_graphs=False)]
    current = torch.cuda.current_device()
    try:
        records, graphs_used = await lockstep_servers(configs, naive, seed=105, engine_steps=40, num_seqs=5,
                                                      max_model_len=1024, max_k=8)
    finally:
        torch.cuda.set_device(current)  # (build_runtime made cuda:1 this thread's device; later tests expect cuda:0)
    assert len(records) >= 25 and graphs_used[0] >= 10
    for r in records:
        cpu, graphs, eager = r.replies
        assert cpu.drafts == graphs.drafts == eager.drafts == r.expected, r


def test_a_pinned_mapping_goes_to_the_device_in_one_dma_and_unpins():
    """host_staging.pin_mapping: a tensor over a registered mapping (a step channel's mailbox) is pinned memory, so a
    request read in place goes to the GPU from the mailbox with one DMA (rows_to_device); unpin undoes it."""
    import mmap

    from drafter_service.engine.host_staging import pin_mapping, rows_to_device

    mm = mmap.mmap(-1, 1 << 22)
    dev = torch.device("cuda", torch.cuda.current_device())
    unpin = pin_mapping(mm, dev)
    view = memoryview(mm)[4096 : 4096 + 3 * 1024 * 64 * 2]
    rows = torch.frombuffer(view, dtype=torch.bfloat16).view(3 * 1024, 64)
    rows.copy_(torch.randn(3 * 1024, 64))
    assert rows.is_pinned()
    parts = list(rows.split([1024, 1024, 1024]))
    out = rows_to_device(parts, dev)
    assert torch.equal(out.cpu(), rows)
    unpin()
    assert not rows.is_pinned()
    assert torch.equal(rows_to_device(parts, dev).cpu(), rows)  # (copied through pinned memory as any host rows)
    del rows, parts
    view.release()
    mm.close()


async def test_a_large_channel_step_is_read_in_place_on_cuda(tiny_model, tmp_path):
    """On CUDA a channel's mailbox is pinned when it opens: a large step (1 MiB of states) is read in place and
    drafts what it drafts over gRPC and on the CPU."""
    from drafter_client import SequenceStep

    rows = 4500  # 4500 x 64 fp32 = 1.15 MB
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (rows + 1,), generator=g)
    step = SequenceStep("long", 0, tokens[:rows], torch.randn(rows, 64, generator=g), int(tokens[rows]), 5)
    with ServerThread(make_config(*tiny_model, tmp_path / "gpu", device="cuda", dtype="float32", max_model_len=8192,
                                  kv_cache_tokens=32768)) as srv, \
            ServerThread(make_config(*tiny_model, tmp_path / "cpu", max_model_len=8192, kv_cache_tokens=32768)) as cpu:
        async with DrafterClient(srv.uds, namespace="a", chunk_min_bytes=None) as c, \
                DrafterClient(srv.uds, namespace="b", chunk_min_bytes=None) as grpc_client, \
                DrafterClient(cpu.uds, namespace="c", chunk_min_bytes=None) as on_cpu:
            assert await c.open_step_channel(request_bytes=4 << 20)
            channels = srv.server.runtime.metrics.channels
            a = await c.propose([step])
            assert c.steps_through_channel == 1 and channels.in_place_reads == 1
            assert channels._open[0].unpin is not None  # (pinned)
            b, d = await grpc_client.propose([step]), await on_cpu.propose([step])
            assert a.sequences[0].drafts.tolist() == b.sequences[0].drafts.tolist() == d.sequences[0].drafts.tolist()
            c.close_step_channel()


def test_the_first_step_record_is_rewritten_only_after_its_copy(monkeypatch):
    """first_step_record.py: a write after a step that synchronized (synchronized()) needs no device sync; a write
    after one that failed before its synchronization waits for the device first, so the host copy is never rewritten
    under a copy still reading it. Either way the device copy ends up holding the last write."""
    import numpy as np

    from drafter_service.engine.first_step_record import FirstStepRecord
    record = FirstStepRecord(4, 16, 3, torch.device("cuda"))
    syncs = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (syncs.append(a), real(*a)))

    def write(base):
        record.write(np.array([base, base + 1]), np.array([1, 2]), np.array([7, 8]), np.array([2, 3]),
                     np.array([base, base + 2, base + 3]), np.full((2, 3), base, dtype=np.int32))

    write(10)
    torch.cuda.current_stream().synchronize()
    record.synchronized()
    write(20)  # (the step before synchronized: no wait)
    assert syncs == []
    write(30)  # (the step of 20 "failed": never synchronized)
    assert len(syncs) == 1
    torch.cuda.current_stream().synchronize()
    header, starts, qsl, nxt, steps, tokens, tables = (f.cpu() for f in record.fields)
    assert header.tolist() == [2, 3] and starts[:2].tolist() == [30, 31] and qsl[:3].tolist() == [0, 1, 3]
    assert nxt[:2].tolist() == [7, 8] and steps[:2].tolist() == [1, 2] and tokens[:3].tolist() == [30, 32, 33]
    assert tables[:6].tolist() == [30] * 6
    record.synchronized()
    record.write(np.array([40]), np.array([1]), np.array([9]), np.array([1]), np.array([41]),
                 np.full((1, 2), 4, dtype=np.int32))  # (another length: copy views of its own)
    torch.cuda.current_stream().synchronize()
    header, starts, qsl, nxt, steps, tokens, tables = (f.cpu() for f in record.fields)
    assert header.tolist() == [1, 2] and starts[:1].tolist() == [40] and tokens[:1].tolist() == [41]
    assert tables[:2].tolist() == [4, 4] and len(record._copy_views) == 2
