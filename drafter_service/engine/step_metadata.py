"""One engine step's metadata: built on the host (python lists for a small step, vectorized numpy above), moved to
the device in one copy. (A greedy step whose first step replays a CUDA graph needs none of it: the graph builds its
rows from the step's raw columns, first_step_record.py. This module serves every other sequential step.)

An engine step holds B sequences. Sequence i brings m_i committed rows at positions p_i .. p_i+m_i-1, its
next_token, its block table, its sampling settings, and asks for k_i drafts. The first draft step is one forward
over all T = sum(m_i) rows; the n sequences with k_i > 0 (batch indices ``active``, in batch order) then run
k_i - 1 decode steps.

Everything those forwards need from the host, the decode steps included, goes into ONE host tensor (pinned on
CUDA) and ONE non_blocking host->device copy; the device tensors are views of that copy. The host tensor has two
regions, so that no field needs a cast kernel on the device:

  int64 region (stored as int32 pairs on the host, viewed back as int64 on the device)
    input_ids         [T]      row t of sequence i gets x[t+1]; its last row gets next_token
    positions         [T]      p_i + r for the r-th row of sequence i
    slot_mapping      [T]      table_i[pos // block_size] * block_size + pos % block_size
    seed              [B]      sampling seed (uint64 from the wire, as int64)
    top_k             [B]      top-N of the draft distribution asked for (0 = none)
    draft_index       [n]      batch index of each drafting sequence
    draft_rows        [n]      its last first-step row, qsl[i+1] - 1 (the row that gives draft 1)
    draft_positions   [n]      p_i + m_i - 1: the position of that row (decode steps advance from it)
  int32 region
    query_start_loc   [B + 1]  sequence i owns first-step rows [qsl[i], qsl[i+1])
    seq_lens          [B]      p_i + m_i
    block_tables      [B * w]  row i: sequence i's block ids, zero-padded to w = the batch's longest table
    temperature       [B]      float32 bits (viewed back as float32 on the device)
    draft_seq_lens    [n]      p_i + m_i
    draft_steps       [n]      k_i - 1: the decode steps it needs

The proposer keeps both buffers from step to step (MetadataBuffers): the packing writes the host buffer in place,
the copy goes to the same device buffer, and the ~15 views that split it into fields are made once per layout (T, B,
n, w) and reused. A new host buffer for every step cost an allocation, a pin_memory copy and the views, host work
the device waits for.

Every field starts at a 16-byte boundary of the buffer (each is padded to a multiple of 16 bytes; the padding is
never read, and only the list packing writes it, as zeros): Triton
specializes a kernel on each pointer argument's 16-byte alignment, so a field at an offset that depends on the batch
would compile another variant of the attention kernel in the middle of a step (0.3-0.4 s on an H200).

The target hidden states (data, not metadata: [T, W] in the wire dtype) are concatenated straight into a second
pinned buffer and sent with a non_blocking copy (host_staging.py), or used in place when they came through CUDA
shared memory and are already on the device. Neither copy waits for the device. The states' source is pinned memory
from torch's caching host allocator, which keeps the block until its copy has completed; the metadata's is the
proposer's buffer, which the next step rewrites only after an event says the copy completed. So a later step never
overwrites a buffer still in flight.
"""
import itertools
import struct
from dataclasses import dataclass

import numpy as np
import torch

from drafter_service.engine.sequence_rows import SequenceRows
from drafter_service.engine.host_staging import rows_to_device
from drafter_service.models.attention_metadata import AttentionMetadata
from drafter_service.engine.sampling import seed_to_int64


class MetadataBuffers:
    """One proposer's step-metadata buffers, kept from step to step: ``host`` (int32, pinned on CUDA), which the
    packing writes in place, and on CUDA ``device``, which it is copied to. The fields are views of ``device`` (of
    ``host`` on the CPU), so a step's metadata tensors are valid until the next step's metadata is built: nothing
    keeps them past its step (pre-drafting builds its own, unbuffered). The host buffer is rewritten only once the
    copy from it has completed (an event recorded after the copy: a step that failed before its synchronization may
    have left one in flight). Both grow when a step needs more, and keep their size."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = torch.zeros(0, dtype=torch.int32)
        self.on_device = self.host
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._in_flight = False
        self._fields: dict[tuple, tuple] = {}  # layout (T, B, n, w) -> the device views of the fields
        self._packing: dict[tuple, tuple] = {}  # layout -> the host views the vectorized packing writes

    def _writable(self, size: int) -> None:
        """Wait for a copy from the host buffer still in flight, and grow both buffers to hold ``size`` elements."""
        if self._in_flight:  # (the buffer is rewritten or freed below; returns at once after the step's own sync)
            self._copied.synchronize()
            self._in_flight = False
        if size > self.host.shape[0]:
            capacity = max(size, 2 * self.host.shape[0])
            cuda = self.device.type == "cuda"
            self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=cuda)
            self.on_device = (torch.zeros(capacity, dtype=torch.int32, device=self.device) if cuda else self.host)
            self._fields.clear()
            self._packing.clear()

    def host_array(self, size: int) -> np.ndarray:
        """A zeroed int32 host array of ``size`` elements to pack a step into (a view of ``host``)."""
        self._writable(size)
        out = self.host[:size].numpy()
        out.fill(0)
        return out

    def packing_views(self, layout: tuple[int, int, int, int]) -> tuple[np.ndarray, list, list]:
        """_field_views of the host buffer for a step of ``layout`` (T, B, n, w), made once per layout. The packing
        writes every field whole; the padding between fields is never read, so the buffer is not zeroed."""
        views = self._packing.get(layout)
        if views is not None:  # (the buffers hold this layout already: growing them clears the views)
            self._writable(0)
            return views
        size = packed_size(layout)
        self._writable(size)
        if len(self._packing) >= 256:  # (a bound, as for the device views)
            self._packing.clear()
        views = self._packing[layout] = _field_views(self.host[:size].numpy(), layout)
        return views

    def send(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """host: a packed step (a view of host_array's, or a tensor of its own, which is copied in first) -> (its
        device copy, its host copy), views of the buffers; the device copy is non_blocking."""
        size = host.shape[0]
        if host.data_ptr() != self.host.data_ptr():
            self.host_array(size)
            self.host[:size].copy_(host)
        if self._copied is None:
            return self.host[:size], self.host[:size]
        self.on_device[:size].copy_(self.host[:size], non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.device))  # (the stream the copy went on, whatever the
        # thread's current device)
        self._in_flight = True
        return self.on_device[:size], self.host[:size]

    def fields(self, layout: tuple, split):
        """The field views (device, and the host block tables) for ``layout``, made by split() the first time, then
        reused: same buffers, same views."""
        views = self._fields.get(layout)
        if views is None:
            if len(self._fields) >= 256:  # (a bound: a stream of new layouts costs a split each, never memory)
                self._fields.clear()
            views = self._fields[layout] = split()
        return views


@dataclass
class StepMetadata:
    # first draft step: T rows over B sequences (device tensors, views of the one copy)
    input_ids: torch.Tensor  # [T] int64, shifted by one
    hidden_states: torch.Tensor  # [T, W] target hidden states, wire dtype
    first_step: AttentionMetadata  # positions/slot_mapping [T] int64, qsl [B+1], seq_lens [B], tables [B, w] int32
    temperature: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    top_k: torch.Tensor  # [B] int64
    # the n drafting sequences (k > 0), in batch order (device tensors)
    draft_rows: torch.Tensor  # [n] int64: first-step row giving draft 1
    draft_positions: torch.Tensor  # [n] int64: position of that row
    draft_seq_lens: torch.Tensor  # [n] int32: context length after the first step
    draft_block_tables: torch.Tensor  # [n, w] int32
    draft_steps: torch.Tensor  # [n] int32: decode steps each needs (k - 1)
    # host copies, for the eager decode loop and for collecting the drafts
    active: list[int]  # [n] batch indices of the drafting sequences
    num_drafts: list[int]  # [B] k per sequence
    host_seq_lens: list[int]  # [B] p + m
    host_block_tables: torch.Tensor  # [B, w] int32 (CPU)

    @classmethod
    def build(cls, batch, block_size: int, device: torch.device,
              tables: SequenceRows | None = None, buffers: MetadataBuffers | None = None) -> "StepMetadata":
        """From the proposer's admitted batch (``a.step``: StepInput, ``a.seq``: Sequence, ``a.num_drafts``);
        tables: the sequence table's block tables, whose rows (``a.seq.table_row``) a large step gathers; buffers:
        the proposer's MetadataBuffers (None: buffers of this step's own)."""
        return build_step_metadata(
            start_positions=[a.step.start_position for a in batch],
            token_ids=[a.step.token_ids for a in batch],
            hidden_states=[a.step.hidden_states for a in batch],
            next_tokens=[a.step.next_token for a in batch],
            num_drafts=[a.num_drafts for a in batch],
            block_tables=[a.seq.block_table for a in batch],
            temperatures=[a.step.temperature for a in batch],
            seeds=[seed_to_int64(a.step.seed) for a in batch],
            top_ks=[a.step.top_k_probs for a in batch],
            block_size=block_size, device=device,
            table_rows=(tables, [a.seq.table_row for a in batch]) if tables is not None else None, buffers=buffers)


SMALL_STEP_ROWS = 64  # up to this many first-step rows, the host buffer is built with plain python lists
ALIGN_BYTES = 16  # every field of the buffer starts at a multiple of this (see the module docstring)


def aligned_len(n: int, itemsize: int) -> int:
    """n elements of itemsize bytes, padded to a multiple of ALIGN_BYTES."""
    per = ALIGN_BYTES // itemsize
    return -(-n // per) * per


def _aligned_lists(fields: list[list[int]], itemsize: int) -> list[int]:
    """The fields one after the other, each padded with zeros to a multiple of ALIGN_BYTES."""
    out: list[int] = []
    for f in fields:
        out += f
        out += [0] * (aligned_len(len(f), itemsize) - len(f))
    return out


def build_step_metadata(start_positions: list[int], token_ids: list[torch.Tensor], hidden_states: list[torch.Tensor],
                        next_tokens: list[int], num_drafts: list[int], block_tables: list[list[int]],
                        temperatures: list[float], seeds: list[int], top_ks: list[int], block_size: int,
                        device: torch.device,
                        table_rows: "tuple[SequenceRows, list[int]] | None" = None,
                        buffers: MetadataBuffers | None = None) -> StepMetadata:
    """Packs the host buffer (two ways, same bytes: python lists for a small step, where ~50 small tensor ops would
    cost more than the lists; vectorized numpy above SMALL_STEP_ROWS rows), copies it to the device once.
    table_rows: (the block tables tensor, each sequence's row of it) holding the same tables as block_tables: a
    large step gathers them from there instead of flattening the lists."""
    B = len(start_positions)
    q_lens = [t.shape[0] for t in token_ids]  # m_i >= 1
    T, w = sum(q_lens), max(len(t) for t in block_tables)
    if T <= SMALL_STEP_ROWS:
        host, active, seq_lens = _pack_lists(start_positions, token_ids, q_lens, next_tokens, num_drafts,
                                             block_tables, temperatures, seeds, top_ks, block_size, w,
                                             buffers.host_array if buffers is not None else None)
    else:
        tables = (table_rows[0].gather(table_rows[1], w) if table_rows is not None
                  else _tables_from_lists(block_tables, w))
        i64 = np.int64
        host, active, seq_lens = _pack_vectorized(
            np.array(start_positions, dtype=i64), np.array(q_lens, dtype=i64), torch.cat(token_ids).numpy(),
            np.array(next_tokens, dtype=i64), np.array(num_drafts, dtype=i64), tables.numpy(),
            np.array(temperatures, dtype=np.float32), np.array(seeds, dtype=i64), np.array(top_ks, dtype=i64),
            block_size, buffers)
    return _to_device(host, active, seq_lens, list(num_drafts), max(q_lens), T, w, hidden_states, device, buffers)


def build_step_metadata_columns(start_positions: np.ndarray, num_tokens: np.ndarray, token_ids: np.ndarray,
                                hidden_states: list[torch.Tensor], next_tokens: np.ndarray, num_drafts: np.ndarray,
                                block_tables: np.ndarray, temperatures: np.ndarray, seeds: np.ndarray,
                                top_ks: np.ndarray, block_size: int, device: torch.device,
                                buffers: MetadataBuffers | None = None) -> StepMetadata:
    """The same metadata from a step's columns as numpy arrays (batch_io.BatchInput.arrays: [B] int64 start positions,
    num_tokens, next tokens, k after the max_model_len cut, float32 temperatures, int64 seed bits and top-N; token_ids
    [T] int64; block_tables [B, w] int32, zero-padded) and its hidden_states (tensors, host or device, whose rows in
    order are the [T, W] states: BatchInput.states()), vectorized whatever the batch size: no per-sequence Python
    object is read."""
    host, active, seq_lens = _pack_vectorized(start_positions, num_tokens, token_ids, next_tokens, num_drafts,
                                              block_tables, temperatures, seeds, top_ks, block_size, buffers)
    return _to_device(host, active, seq_lens, num_drafts.tolist(), int(num_tokens.max()),
                      token_ids.shape[0], block_tables.shape[1], hidden_states, device, buffers)


def _layout(T: int, B: int, n: int, w: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The buffer's fields in order (module docstring): (int64 field sizes, int32 field sizes, and each padded to
    ALIGN_BYTES), in elements: _pack_vectorized writes and _to_device splits by it (_pack_lists writes the same
    order with _aligned_lists)."""
    wide_sizes = [T, T, T, B, B, n, n, n]
    narrow_sizes = [B + 1, B, B * w, B, n, n]
    return (wide_sizes, narrow_sizes, [aligned_len(x, 8) for x in wide_sizes],
            [aligned_len(x, 4) for x in narrow_sizes])


def packed_size(layout: tuple[int, int, int, int]) -> int:
    """int32 elements of the packed buffer of a step of this layout (T, B, n, w)."""
    _, _, wide_padded, narrow_padded = _layout(*layout)
    return 2 * sum(wide_padded) + sum(narrow_padded)


def _field_views(host: np.ndarray, layout: tuple[int, int, int, int]) -> tuple[np.ndarray, list, list]:
    """(host, its 8 int64 fields, its 6 int32 fields) as numpy views of host (int32, packed_size(layout) elements),
    in the order of the module docstring, for the vectorized packing to write in place."""
    wide_sizes, narrow_sizes, wide_padded, narrow_padded = _layout(*layout)
    num_wide = sum(wide_padded)
    wide_all = host[: 2 * num_wide].view(np.int64)
    wide = [wide_all[at : at + size] for at, size in zip(itertools.accumulate([0] + wide_padded), wide_sizes)]
    narrow = [host[at : at + size]
              for at, size in zip(itertools.accumulate([2 * num_wide] + narrow_padded), narrow_sizes)]
    return host, wide, narrow


def _split(dev: torch.Tensor, host: torch.Tensor, T: int, B: int, n: int, w: int) -> tuple:
    """The fields of a packed buffer as views of its device copy: 8 int64 fields, then 6 int32 fields (the block
    tables as [B, w], the temperatures as float32), in the order of the module docstring; then the block tables as a
    [B, w] view of the host buffer."""
    wide_sizes, narrow_sizes, wide_padded, narrow_padded = _layout(T, B, n, w)
    num_wide = sum(wide_padded)  # int64 elements = 2 * num_wide int32 elements
    wide = [part[:size] for part, size in zip(torch.split(dev[: 2 * num_wide].view(torch.int64), wide_padded),
                                             wide_sizes)]
    narrow = [part[:size] for part, size in zip(torch.split(dev[2 * num_wide:], narrow_padded), narrow_sizes)]
    narrow[2] = narrow[2].view(B, w)
    narrow[3] = narrow[3].view(torch.float32)
    tables_at = 2 * num_wide + narrow_padded[0] + narrow_padded[1]
    return (*wide, *narrow, host[tables_at : tables_at + B * w].view(B, w))


def _to_device(host: torch.Tensor, active: list[int], seq_lens: list[int], num_drafts: list[int], max_q: int, T: int,
               w: int, hidden_states: list[torch.Tensor], device: torch.device,
               buffers: MetadataBuffers | None = None) -> StepMetadata:
    """The packed host buffer to the device in one copy, and the StepMetadata of views of it."""
    B, n = len(num_drafts), len(active)
    if buffers is not None:
        dev, host = buffers.send(host)  # (the same buffers every step: the views are made once per layout)
        fields = buffers.fields((T, B, n, w), lambda: _split(dev, host, T, B, n, w))
    else:
        if device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)  # the step's one metadata host->device copy (a no-op on the CPU)
        fields = _split(dev, host, T, B, n, w)
    ids_d, pos_d, slots_d, seed_d, top_k_d, index_d, rows_d, dpos_d = fields[:8]
    qsl_d, seq_lens_d, tables_d, temperature_d, dseq_d, dsteps_d, host_tables = fields[8:]
    return StepMetadata(
        input_ids=ids_d, hidden_states=rows_to_device(hidden_states, device),
        first_step=AttentionMetadata(positions=pos_d, slot_mapping=slots_d, query_start_loc=qsl_d,
                                     seq_lens=seq_lens_d, block_tables=tables_d, max_query_len=max_q),
        temperature=temperature_d, seed=seed_d, top_k=top_k_d,
        draft_rows=rows_d, draft_positions=dpos_d, draft_seq_lens=dseq_d,
        draft_block_tables=tables_d if n == B else tables_d[index_d],  # [n, w]: a gather on the device
        draft_steps=dsteps_d, active=active, num_drafts=num_drafts,
        host_seq_lens=seq_lens, host_block_tables=host_tables)


def _pack_lists(start_positions, token_ids, q_lens, next_tokens, num_drafts, block_tables, temperatures, seeds,
                top_ks, block_size, w, alloc=None) -> tuple[torch.Tensor, list[int], list[int]]:
    """The host buffer of a small step, sequence by sequence in python: (buffer, active, seq_lens). alloc(size): the
    zeroed int32 array to write it into (MetadataBuffers.host_array; None: a new tensor)."""
    ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
    for p, toks, m, nxt, table in zip(start_positions, token_ids, q_lens, next_tokens, block_tables):
        ids += toks.tolist()[1:]  # row t gets x[t+1] ...
        ids.append(nxt)  # ... and the last row next_token
        rows = range(p, p + m)
        pos += rows
        slots += [table[t // block_size] * block_size + t % block_size for t in rows]
        qsl.append(qsl[-1] + m)
        seq_lens.append(p + m)
        tables += table
        tables += [0] * (w - len(table))
    active = [i for i, k in enumerate(num_drafts) if k > 0]
    draft_seq_lens = [seq_lens[i] for i in active]
    wide = _aligned_lists([ids, pos, slots, list(seeds), list(top_ks), active, [qsl[i + 1] - 1 for i in active],
                           [s - 1 for s in draft_seq_lens]], 8)
    temperature_bits = list(struct.unpack(f"{len(temperatures)}i", struct.pack(f"{len(temperatures)}f", *temperatures)))
    narrow = _aligned_lists([qsl, seq_lens, tables, temperature_bits, draft_seq_lens,
                             [num_drafts[i] - 1 for i in active]], 4)
    if alloc is None:
        host = torch.cat([torch.tensor(wide, dtype=torch.int64).view(torch.int32),
                          torch.tensor(narrow, dtype=torch.int32)])
        return host, active, seq_lens
    out = alloc(2 * len(wide) + len(narrow))  # (numpy takes the lists faster than torch.tensor does)
    out[: 2 * len(wide)].view(np.int64)[:] = wide
    out[2 * len(wide):] = narrow
    return torch.from_numpy(out), active, seq_lens


def _tables_from_lists(block_tables: list[list[int]], w: int) -> torch.Tensor:
    """[B, w] int32, zero-padded: the concatenated tables scattered under a "column < table length" mask."""
    table_lens = torch.tensor([len(t) for t in block_tables], dtype=torch.int64)
    tables = torch.zeros(len(block_tables), w, dtype=torch.int32)
    tables[torch.arange(w)[None, :] < table_lens[:, None]] = torch.tensor(
        list(itertools.chain.from_iterable(block_tables)), dtype=torch.int32)
    return tables


def _pack_vectorized(p: np.ndarray, q: np.ndarray, committed: np.ndarray, next_tokens: np.ndarray,
                     k: np.ndarray, tables: np.ndarray, temperature: np.ndarray, seeds: np.ndarray,
                     top_ks: np.ndarray, block_size: int,
                     buffers: "MetadataBuffers | None" = None) -> tuple[torch.Tensor, list[int], list[int]]:
    """The host buffer of a large step (prefill, or many sequences), vectorized over the batch: no per-sequence
    op. p, q, next_tokens, k, seeds, top_ks: [B] int64; committed: [T] token ids; temperature: [B] float32;
    tables: [B, w] int32, zero-padded (numpy). buffers: the proposer's MetadataBuffers, whose host buffer it packs
    into through field views kept per layout (None: a new buffer). The arithmetic is numpy, each field written straight
    into its place in the buffer: small-array numpy ops cost about a microsecond where a torch op costs several, and
    there are some twenty of them."""
    B, T, w = p.shape[0], committed.shape[0], tables.shape[1]
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.add.accumulate(q, out=qsl[1:])
    seq_lens = p + q  # [B]
    draft_index = (k > 0).nonzero()[0]  # [n] batch index of each drafting sequence
    n = draft_index.shape[0]
    layout = (T, B, n, w)
    host, wide, narrow = (buffers.packing_views(layout) if buffers is not None
                          else _field_views(np.zeros(packed_size(layout), dtype=np.int32), layout))
    ids_f, positions, slots_f, seed_f, top_k_f, index_f, rows_f, dpos_f = wide
    qsl_f, seq_lens_f, tables_f, temperature_f, dseq_f, dsteps_f = narrow

    # first-step rows
    row_seq = np.repeat(np.arange(B), q)  # [T] sequence of each row
    np.add(p[row_seq] - qsl[row_seq], np.arange(T), out=positions)  # p_i + r for the r-th row of sequence i
    slots_f[:] = (tables[row_seq, positions // block_size].astype(np.int64) * block_size
                  + positions % block_size)
    ids_f[:-1] = committed[1:]  # row t gets x[t+1] ...
    ids_f[qsl[1:] - 1] = next_tokens  # ... and each sequence's last row next_token
    seed_f[:] = seeds
    top_k_f[:] = top_ks
    # drafting sequences
    index_f[:] = draft_index
    rows_f[:] = qsl[draft_index + 1] - 1  # the row that gives draft 1
    draft_seq_lens = seq_lens[draft_index]
    dpos_f[:] = draft_seq_lens - 1  # its position

    qsl_f[:] = qsl
    seq_lens_f[:] = seq_lens
    tables_f[:] = tables.reshape(-1)
    temperature_f[:] = temperature.view(np.int32)  # (float32 bits)
    dseq_f[:] = draft_seq_lens
    dsteps_f[:] = k[draft_index] - 1  # decode steps it needs
    return torch.from_numpy(host), draft_index.tolist(), seq_lens.tolist()
