"""Host-side logic of the CUDA fast path, on the CPU: the packed step metadata and the padded graph sizes."""
import random

import pytest
import torch

from drafter_service.cli import parse_args
from drafter_service.engine.cuda_graphs import MAX_GRAPH_BATCH, graph_batch_sizes, padded_batch_size
from drafter_service.engine import step_metadata
from drafter_service.engine.sequence_rows import SequenceRows
from drafter_service.engine.step_metadata import build_step_metadata


def naive_metadata(starts, token_ids, next_tokens, num_drafts, tables, block_size):
    """Per sequence, in plain python: what the vectorized builder must produce."""
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    for p, toks, nxt, table in zip(starts, token_ids, next_tokens, tables):
        m = len(toks)
        ids += toks[1:].tolist() + [nxt]
        for t in range(p, p + m):
            pos.append(t)
            slots.append(table[t // block_size] * block_size + t % block_size)
        qsl.append(qsl[-1] + m)
        seq_lens.append(p + m)
    w = max(len(t) for t in tables)
    padded = [t + [0] * (w - len(t)) for t in tables]
    active = [i for i, k in enumerate(num_drafts) if k > 0]
    return dict(ids=ids, pos=pos, slots=slots, qsl=qsl, seq_lens=seq_lens, tables=padded, active=active,
                rows=[qsl[i + 1] - 1 for i in active], dpos=[seq_lens[i] - 1 for i in active],
                dseq=[seq_lens[i] for i in active], dsteps=[num_drafts[i] - 1 for i in active],
                dtables=[padded[i] for i in active])


def random_step(seed: int, packing: str) -> dict:
    """A random step's arguments to build_step_metadata (table_rows as `packing` says)."""
    rng = random.Random(seed)
    block_size = rng.choice([8, 16, 32])
    B = rng.choice([1, 2, 3, 5, 17, 40])
    starts, token_ids, hidden, next_tokens, num_drafts, tables = [], [], [], [], [], []
    temperatures = [rng.choice([0.0, 0.7, 1.5]) for _ in range(B)]
    seeds = [rng.randrange(-2**63, 2**63) for _ in range(B)]
    top_ks = [rng.choice([0, 0, 4]) for _ in range(B)]
    next_block = 0
    for _ in range(B):
        p, m = rng.randint(0, 300), rng.choice([1, 1, 2, 3, 7, 50])
        k = rng.choice([0, 1, 2, 5, 8])
        n_blocks = -(-(p + m + max(k - 1, 0)) // block_size)
        blocks = list(range(next_block, next_block + n_blocks))
        rng.shuffle(blocks)
        next_block += n_blocks
        starts.append(p)
        token_ids.append(torch.randint(0, 1000, (m,)))
        hidden.append(torch.randn(m, 4))
        next_tokens.append(rng.randrange(1000))
        num_drafts.append(k)
        tables.append(blocks)
    table_rows = None
    if packing == "vectorized-table-rows":  # rows handed out in another order than the batch, stale rows between
        bt = SequenceRows(max_blocks=max(len(t) for t in tables) + 3, rows=2)
        rows = [bt.assign() for _ in range(2 * B)]
        rng.shuffle(rows)
        for row, table in zip(rows, tables):
            bt.write(row, 0, table)
        for row in rows[B:]:
            bt.write(row, 0, [7] * 3)
        table_rows = (bt, rows[:B])
    return dict(start_positions=starts, token_ids=token_ids, hidden_states=hidden, next_tokens=next_tokens,
                num_drafts=num_drafts, block_tables=tables, temperatures=temperatures, seeds=seeds, top_ks=top_ks,
                block_size=block_size, device=torch.device("cpu"), table_rows=table_rows)


def check_metadata(md, step: dict) -> None:
    """md equals the per-sequence reference of step (random_step's arguments)."""
    token_ids, num_drafts = step["token_ids"], step["num_drafts"]
    ref = naive_metadata(step["start_positions"], token_ids, step["next_tokens"], num_drafts, step["block_tables"],
                         step["block_size"])
    meta = md.first_step
    assert md.input_ids.tolist() == ref["ids"] and md.input_ids.dtype == torch.int64
    assert meta.positions.tolist() == ref["pos"] and meta.positions.dtype == torch.int64
    assert meta.slot_mapping.tolist() == ref["slots"] and meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == ref["qsl"] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == ref["seq_lens"] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == ref["tables"] and meta.block_tables.dtype == torch.int32
    assert meta.max_query_len == max(len(t) for t in token_ids)
    assert torch.equal(md.hidden_states, torch.cat(step["hidden_states"]))
    assert md.temperature.tolist() == torch.tensor(step["temperatures"]).tolist()
    assert md.temperature.dtype == torch.float32
    assert md.seed.tolist() == step["seeds"] and md.seed.dtype == torch.int64
    assert md.top_k.tolist() == step["top_ks"] and md.top_k.dtype == torch.int64
    assert md.active == ref["active"] and md.num_drafts == num_drafts
    assert md.draft_rows.tolist() == ref["rows"] and md.draft_rows.dtype == torch.int64
    assert md.draft_positions.tolist() == ref["dpos"] and md.draft_positions.dtype == torch.int64
    assert md.draft_seq_lens.tolist() == ref["dseq"] and md.draft_seq_lens.dtype == torch.int32
    assert md.draft_steps.tolist() == ref["dsteps"] and md.draft_steps.dtype == torch.int32
    assert md.draft_block_tables.tolist() == (ref["dtables"] or []) and md.draft_block_tables.dtype == torch.int32
    assert md.host_seq_lens == ref["seq_lens"] and md.host_block_tables.tolist() == ref["tables"]
    for t in (md.input_ids, meta.positions, meta.slot_mapping, meta.seq_lens, meta.block_tables, md.draft_steps):
        assert t.is_contiguous()
    # every field a kernel reads starts 16-byte aligned, whatever the batch (Triton compiles a variant per alignment)
    for name in ("input_ids", "temperature", "seed", "top_k", "draft_rows", "draft_positions", "draft_seq_lens",
                 "draft_block_tables", "draft_steps"):
        assert getattr(md, name).data_ptr() % 16 == 0, name
    for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert getattr(meta, name).data_ptr() % 16 == 0, name


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("packing", ["lists", "vectorized", "vectorized-table-rows"])
def test_step_metadata_matches_per_sequence_reference(seed, packing, monkeypatch):
    """Every way of packing the host buffer: python lists for small steps, vectorized torch for large ones, with
    the block tables from the lists or gathered from the sequence table's rows (SequenceRows)."""
    monkeypatch.setattr(step_metadata, "SMALL_STEP_ROWS", 10**9 if packing == "lists" else 0)
    step = random_step(seed, packing)
    check_metadata(build_step_metadata(**step), step)


@pytest.mark.parametrize("packing", ["lists", "vectorized", "vectorized-table-rows"])
def test_step_metadata_in_kept_buffers(packing, monkeypatch):
    """A proposer's MetadataBuffers across many steps of different sizes (the buffer grows; a smaller step after a
    larger one finds stale bytes past its end): each step's metadata equals the reference; a step of a layout seen
    before reuses its views, and a step of another layout gets views of its own."""
    monkeypatch.setattr(step_metadata, "SMALL_STEP_ROWS", 10**9 if packing == "lists" else 0)
    buffers = step_metadata.MetadataBuffers(torch.device("cpu"))
    capacities = set()
    for seed in [0, 1, 2, 3, 4, 5, 6, 7, 1, 8, 0]:
        step = random_step(seed, packing)
        md = build_step_metadata(**step, buffers=buffers)
        check_metadata(md, step)
        capacities.add(buffers.host.shape[0])
        again = build_step_metadata(**step, buffers=buffers)  # the same layout: the same views, refilled
        check_metadata(again, step)
        assert again.input_ids is md.input_ids and again.first_step.block_tables is md.first_step.block_tables
    assert len(capacities) > 1  # (it grew at least once)
    small, large = random_step(2, packing), random_step(4, packing)
    md_small = build_step_metadata(**small, buffers=buffers)
    assert md_small.input_ids.data_ptr() == buffers.host.data_ptr()  # (in place, at the start of the buffer)
    build_step_metadata(**large, buffers=buffers)
    check_metadata(build_step_metadata(**small, buffers=buffers), small)


def test_step_metadata_no_drafting_sequence():
    md = build_step_metadata([0, 4], [torch.tensor([1, 2, 3]), torch.tensor([9])],
                             [torch.zeros(3, 2), torch.zeros(1, 2)], [7, 8], [0, 0], [[5], [2]], [0.0, 0.0],
                             [0, 0], [0, 0], 16, torch.device("cpu"))
    assert md.input_ids.tolist() == [2, 3, 7, 8] and md.first_step.positions.tolist() == [0, 1, 2, 4]
    assert md.first_step.slot_mapping.tolist() == [80, 81, 82, 36]
    assert md.active == [] and md.draft_rows.numel() == 0 and md.draft_block_tables.shape == (0, 1)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(1024) == [1, 2, 4, 8, *range(16, MAX_GRAPH_BATCH + 1, 16)]
    assert graph_batch_sizes(1024)[-1] == MAX_GRAPH_BATCH == 256


def test_padded_batch_size():
    sizes = graph_batch_sizes(1024)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 255, 256)] == \
        [1, 2, 4, 8, 8, 16, 16, 32, 48, 256, 256]
    assert padded_batch_size(257, sizes) is None  # the eager decode loop takes it
    for n in range(1, 257):
        size = padded_batch_size(n, sizes)
        assert size >= n and all(s < n for s in sizes if s < size)


def test_cli_cuda_graphs_flag():
    assert parse_args([]).cuda_graphs is True
    assert parse_args(["--no-cuda-graphs"]).cuda_graphs is False
    assert parse_args(["--cuda-graphs"]).cuda_graphs is True
