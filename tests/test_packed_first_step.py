"""Packed first-step graphs (engine/cuda_graphs.py, "Packed first steps"): a greedy step that the padded first-step
graphs cannot take (a sequence joining with its prompt beside the others' decodes, any m past first_step_tokens)
replays a graph of (padded batch size, row bucket) whose rows are the step's own, packed, then padding rows.

On the CPU the same static-buffer steps run eagerly (as test_static_steps.py does for the padded ones): the drafts,
statuses and KV must be the plain proposer's, and the naive reference's. The captured graphs are checked on the GPU.
"""
import asyncio

import numpy as np
import pytest
import torch

from conftest import make_config
from drafter_service.config import ServerConfig
from drafter_service.engine.cuda_graphs import DecodeGraphs, packed_row_buckets
from drafter_service.runtime import build_runtime
from lockstep import ProposerDrafter, run_lockstep
from naive_eagle import NaiveEagle1
from test_static_steps import head_model, tiny_eagle3  # noqa: F401 (a fixture)
from test_step_batch import NS, OK, Traffic, as_batch, same


def with_packed_steps(rt, max_batch_seqs: int = 64, first_step_tokens: int = 8, first_step_rows: int = 512):
    p = rt.proposer
    p.decode_graphs = DecodeGraphs(p.model, p.kv_layers, rt.kv.block_size, rt.max_model_len, max_batch_seqs,
                                   rt.dtype, rt.device, first_step_tokens, first_step_rows=first_step_rows)
    return rt


def test_row_buckets_and_shapes(tiny_model, tmp_path):
    assert packed_row_buckets(0) == []
    assert packed_row_buckets(2048) == [32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert packed_row_buckets(1000) == [32, 64, 128, 256, 384, 512, 768, 1000]
    assert packed_row_buckets(16) == [16]
    buckets = packed_row_buckets(8192)
    assert all(b / a <= 2 for a, b in zip(buckets, buckets[1:])) and all(
        b / a <= 1.5 for a, b in zip(buckets, buckets[1:]) if a >= 256)
    rt = with_packed_steps(build_runtime(make_config(*tiny_model, tmp_path)), max_batch_seqs=48, first_step_rows=256)
    graphs = rt.proposer.decode_graphs
    assert graphs.packed_sizes == [1, 2, 4, 8, 16, 32, 48]  # (powers of two, and the cap's own size)
    assert graphs.packed_rows == [32, 64, 128, 256]
    assert graphs.packed_shapes() == [(bs, r) for bs in graphs.packed_sizes for r in graphs.packed_rows if r >= bs]
    off = with_packed_steps(build_runtime(make_config(*tiny_model, tmp_path / "off")), first_step_rows=0)
    assert off.proposer.decode_graphs.packed_shapes() == []


def test_which_steps_take_which_first_step(tiny_model, tmp_path):
    rt = with_packed_steps(build_runtime(make_config(*tiny_model, tmp_path)), max_batch_seqs=64,
                           first_step_tokens=4, first_step_rows=256)
    graphs = rt.proposer.decode_graphs

    def plan(ms: list[int], ks: list[int] | None = None, starts: list[int] | None = None):
        m = np.array(ms)
        k = np.array(ks if ks is not None else [3] * len(ms))
        p = np.array(starts) if starts is not None else np.where(m > 8, 0, 20)  # (a prompt starts at 0)
        return graphs.first_step_plan(p + m, m, k)

    assert plan([3, 1, 2]) == (False, 4, 3)  # padded where it fits
    # both fit, but 48 x 4 padded rows are 3x the packed graph's 64: packed (33 sequences -> 64, 36 rows -> 64)
    assert plan([4] + [1] * 32) == (True, 64, 64)
    assert plan([4] * 20 + [1] * 13) == (False, 48, 4)  # 192 padded rows, 1.5x the packed 128 (93 rows): padded
    assert plan([3, 40, 2]) == (True, 4, 64)  # a prompt beside decodes: packed, 45 rows -> 64
    assert plan([1] * 30 + [100]) == (True, 32, 256)  # 130 rows -> 256 (the next bucket)
    assert plan([200] + [1] * 40) == (True, 64, 256)  # 41 sequences -> 64, 240 rows -> 256
    assert plan([1] * 33 + [250]) is None  # 283 rows: above the largest bucket, eager
    assert plan([5]) == (True, 1, 32)  # m past first_step_tokens alone
    assert plan([1, 3], starts=[0, 20]) == (True, 2, 32)  # a new 1-token sequence: its context is shorter than M
    assert plan([1, 3], starts=[2, 20]) == (False, 2, 3)  # (padding rows would sit before position 0)
    assert plan([3, 40], ks=[3, 0]) is None  # a prefill chunk (k = 0) in the step: eager, unless
    m, p = np.array([3, 40]), np.array([20, 0])
    assert graphs.first_step_plan(p + m, m, np.array([3, 0]), prefill_chunks=True) == (True, 2, 64)  # (packed only)
    m, p = np.array([3, 2]), np.array([20, 20])
    assert graphs.first_step_plan(p + m, m, np.array([3, 0]), prefill_chunks=True) == (True, 2, 32)
    assert graphs.first_step_plan(p + m, m, np.array([0, 0]), prefill_chunks=True) == (True, 2, 32)
    assert plan([1] * 70) is None  # more sequences than the largest packed size


def joining_traffic(a, b, seed: int, steps: int, live_n: int, prompts: tuple[int, int], check):
    """Continuous batching through step_batch: every step 0-3 sequences finish and 1-3 start with a prompt of
    prompts[0]..prompts[1] tokens beside the others' decodes (m 1-4, k 3 or 5). `a` answers per sequence, `b` from
    columns; check(b) after each step."""
    t = Traffic(seed, a.limits.hidden_states_width, a.limits.vocab_size, live_n * 3, prompt=5)
    rng = t.rng
    live, waiting = sorted(t.tokens)[:live_n], sorted(t.tokens)[live_n:]
    for round in range(steps):
        starting = [waiting.pop() for _ in range(rng.randint(1, 3))] if round else []
        batch = []
        for sid in live + starting:
            if sid in starting:
                t.prompt = rng.randint(*prompts)
            batch.append(t.step(sid, m=rng.randint(1, 4), k=rng.choice([3, 5])))
        out_a = a.proposer.step_per_sequence(batch)
        same(out_a, b.proposer.step_batch(as_batch(batch)))
        assert all(o.code == OK for o in out_a)
        t.answered(batch, out_a)
        live += starting
        for sid in [live.pop(rng.randrange(len(live))) for _ in range(rng.randint(0, 3))]:
            assert a.proposer.table.release(NS, sid) and b.proposer.table.release(NS, sid)
        check(b)


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_steps_where_sequences_join_match_the_plain_proposer(tiny_model, tiny_eagle3, tmp_path, head):  # noqa: F811
    """Sequences join (prompts of 9-60 tokens) beside 20-30 decoding ones: every step after the first replays the
    packed first step (from columns), with the plain per-sequence step's answers and KV."""
    model = head_model(head, tiny_model, tiny_eagle3)
    plain = build_runtime(make_config(*model, tmp_path / "plain"))
    packed = with_packed_steps(build_runtime(make_config(*model, tmp_path / "packed")))
    graphs = packed.proposer.decode_graphs
    joining_traffic(plain, packed, seed=7, steps=8, live_n=20, prompts=(9, 60), check=lambda rt: None)
    assert graphs.packed_first_steps_run == 7  # (round 0: every sequence new, 20 prompts of 5: padded)
    assert graphs.first_steps_run == 8
    torch.testing.assert_close(packed.kv.kv, plain.kv.kv, atol=1e-5, rtol=1e-5)


def test_packed_graphs_without_padded_ones(tiny_model, tmp_path):
    """--first-step-graph-tokens 0 with packed graphs: every greedy step's first step is packed (the padded graphs'
    buffers are empty), with the plain step's answers and KV."""
    plain = build_runtime(make_config(*tiny_model, tmp_path / "plain"))
    packed = with_packed_steps(build_runtime(make_config(*tiny_model, tmp_path / "packed")), first_step_tokens=0,
                               first_step_rows=256)
    graphs = packed.proposer.decode_graphs
    assert graphs.first_sizes == [] and graphs.fs_hidden.shape[0] == 0 and graphs.packed_rows[-1] == 256
    joining_traffic(plain, packed, seed=3, steps=5, live_n=10, prompts=(9, 40), check=lambda rt: None)
    assert graphs.packed_first_steps_run == graphs.first_steps_run == 5
    torch.testing.assert_close(packed.kv.kv, plain.kv.kv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head,device", [("eagle1", "cpu"), ("eagle3", "cpu"),
                                         pytest.param("eagle1", "cuda", marks=pytest.mark.gpu),
                                         pytest.param("eagle3", "cuda", marks=pytest.mark.gpu)])
def test_prompts_in_chunks_ride_the_packed_graph(tiny_model, tiny_eagle3, tmp_path, head, device):  # noqa: F811
    """vLLM's chunked prefill: a long prompt comes over several steps, its chunks before the last with k = 0 (KV
    written, no draft), beside the others' decodes. Those steps replay the packed first step too (from columns),
    with the plain per-sequence step's answers (and KV, on the CPU; on CUDA the captured graphs in fp32 against the
    CPU's plain step)."""
    model = head_model(head, tiny_model, tiny_eagle3)
    plain = build_runtime(make_config(*model, tmp_path / "plain"))
    if device == "cpu":
        packed = with_packed_steps(build_runtime(make_config(*model, tmp_path / "packed")))
    else:
        packed = build_runtime(make_config(*model, tmp_path / "packed", device="cuda", dtype="float32",
                                           max_batch_seqs=64, first_step_graph_rows=512))
    graphs = packed.proposer.decode_graphs
    t = Traffic(13, plain.limits.hidden_states_width, plain.limits.vocab_size, 40, prompt=6)
    rng = t.rng
    live, waiting = sorted(t.tokens)[:16], sorted(t.tokens)[16:]
    chunking: dict[str, int] = {}  # sequence -> chunks still to send after this step
    for round in range(8):
        if round:
            sid = waiting.pop()
            chunking[sid] = rng.randint(1, 3)
            t.prompt = rng.randint(20, 50)  # (its first chunk)
            live.append(sid)
        batch = []
        for sid in live:
            if chunking.get(sid, 0) > 0:
                chunking[sid] -= 1
                m, k = (rng.randint(20, 50), 0) if t.committed[sid] else (t.prompt, 0)
                if chunking[sid] == 0:
                    k = 3  # (its last chunk drafts)
                batch.append(t.step(sid, m=m, k=k))
            else:
                batch.append(t.step(sid, m=rng.randint(1, 4), k=rng.choice([3, 5])))
        out_a = plain.proposer.step_per_sequence(batch)
        same(out_a, packed.proposer.step_batch(as_batch(batch)))
        assert all(o.code == OK for o in out_a)
        t.answered(batch, out_a)
    assert graphs.packed_first_steps_run == 7
    if device == "cpu":
        torch.testing.assert_close(packed.kv.kv, plain.kv.kv, atol=1e-5, rtol=1e-5)


def test_lockstep_with_prompts_matches_naive(tiny_model, tmp_path):
    """An engine loop in lockstep with the naive fp64 reference, prompts of 1-60 tokens at batch 1-3: the packed
    first steps (prompts past first_step_tokens, contexts shorter than M) give the reference's drafts."""
    naive = NaiveEagle1(*tiny_model)
    rt = with_packed_steps(build_runtime(make_config(*tiny_model, tmp_path)), max_batch_seqs=8, first_step_rows=128)
    graphs = rt.proposer.decode_graphs
    for num_seqs in (1, 3):
        records = asyncio.run(run_lockstep(
            [ProposerDrafter(rt.proposer)], naive=naive, width=naive.H, vocab=naive.lm_head.shape[0],
            seed=60 + num_seqs, engine_steps=30, num_seqs=num_seqs, max_model_len=1024, max_k=6,
            prompts=(1, 2, 7, 16, 17, 40, 60)))
        for r in records:
            assert r.replies[0].drafts == r.expected, r
    assert graphs.packed_first_steps_run >= 3, graphs.packed_first_steps_run


def test_first_step_graph_rows_flag(tiny_model):
    from drafter_service.cli import parse_args

    head, target = tiny_model
    base = ["--model", str(head), "--target-model", str(target)]
    assert parse_args(base).first_step_graph_rows == 2048
    assert parse_args(base + ["--first-step-graph-rows", "0"]).first_step_graph_rows == 0
    with pytest.raises((SystemExit, ValueError)):
        parse_args(base + ["--first-step-graph-rows", "9000"])


def test_first_step_graph_rows_is_checked(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="first_step_graph_rows"):
        make_config(*tiny_model, tmp_path, first_step_graph_rows=8193)
    with pytest.raises(ValueError, match="first_step_graph_rows"):
        make_config(*tiny_model, tmp_path, first_step_graph_rows=-1)
    assert isinstance(make_config(*tiny_model, tmp_path, first_step_graph_rows=0), ServerConfig)


@pytest.mark.gpu
@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_packed_graphs_on_cuda_match_cpu(tiny_model, tiny_eagle3, tmp_path, head):  # noqa: F811
    """The captured packed graphs (fp32) against the CPU's plain per-sequence step, sequences joining every step
    with prompts of 9-300 tokens (row buckets up to 512), at 20-40 sequences (padded sizes 32 and 64)."""
    model = head_model(head, tiny_model, tiny_eagle3)
    cpu = build_runtime(make_config(*model, tmp_path / "cpu"))
    gpu = build_runtime(make_config(*model, tmp_path / "gpu", device="cuda", dtype="float32", max_batch_seqs=64,
                                    first_step_graph_rows=512))
    graphs = gpu.proposer.decode_graphs
    assert sorted(graphs.packed_graphs) == graphs.packed_shapes() and (64, 512) in graphs.packed_graphs
    joining_traffic(cpu, gpu, seed=9, steps=10, live_n=20, prompts=(9, 300), check=lambda rt: None)
    assert graphs.packed_first_steps_run == 9
