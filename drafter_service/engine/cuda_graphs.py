"""The draft steps of an engine step, replayed from CUDA graphs captured at start-up (greedy steps; sampling steps
too: "Sampling steps" below).

Decode steps (drafts 2..k). After the first draft step every drafting sequence runs single-token decode steps.
Their shapes depend only on the number of rows, so one CUDA graph per *padded* batch size (1, 2, 4, 8, 16, 32,
48, ... 256, up to --max-batch-seqs) holds one whole decode step of a sequential head (EAGLE-1, EAGLE-3):
device-side advance of positions / slots / seq_lens, the head's forward, lm_head, argmax. The graph reads and
writes only the static buffers below, so a replay needs no host work and no host<->device copy:

  static buffer      shape              before replay j (for rows r < bs)              after replay j
  input_ids          [max_bs] int64     draft j (target vocabulary)                    draft j+1
  hidden             [max_bs, H]        head output of step j-1                        head output of step j
  positions          [max_bs] int64     position of step j-1                           position of step j
  seq_lens           [max_bs] int32     context length of step j-1                     of step j
  slot_mapping       [max_bs] int64     -                                              KV slot written at step j
  block_tables       [max_bs, W] int32  the sequence's blocks (W = cdiv(max_model_len, block_size))
  steps_left         [max_bs] int32     decode steps the row still needs               minus 1
  draft_ids          [max_bs] int64     -                                              argmax (draft vocabulary)
  draft_column       [1] int64          j - 1                                          j
  drafts_out         [max_bs, K] int64  drafts 1..j in columns 0..j-1                  draft j+1 in column j

Rows past their own k (a sequence asked for fewer drafts than the batch's largest k) and padding rows (n <= r < bs)
keep running in the padded batch, masked: steps_left <= 0 gives slot PADDING_SLOT_ID (no KV write), seq_len 1
(attention over one cached position of the row's first block) and a zero input; their drafts are discarded when
the results are collected. Rows that are still drafting never reach the max_model_len clamp of
advance_draft_step (admission cuts k to fit), masked rows may: the clamp keeps their position inside the RoPE
cache and their slot at -1.

The host copies the drafting rows' inputs into the static buffers with device->device copies (a step whose first
step replays a graph too: its first-step graph builds them, below), runs max(k) - 1 decode steps, and copies
drafts_out to the host once (into a pinned buffer of its own): the step's only device->host synchronization.
(K = --max-draft-tokens.) The decode steps replay *chains* where they can: per padded batch size, one more graph
holds DECODE_CHAIN_LENGTHS[0] decode steps back to back, and one DECODE_CHAIN_LENGTHS[1] (the same kernels as that
many replays of the one-step graph, reading and advancing the same buffers), so that k = 5 is one replay instead of
four and any k up to 8 at most three: a decode step in a chain takes 1-2 us less GPU time than a replay of its own
(H200, graphs queued back to back; profile_step --timeline), and a step of k = 3..8 makes 1-4 launches fewer.
Pre-drafting (run_rows, run_forced), which looks at the host between decode steps, replays single steps.
The graphs above are greedy (argmax); sampling steps replay graphs of their own (below); the proposer runs batches of
more than MAX_GRAPH_BATCH drafting sequences with its eager decode loop.

Sampling steps. A step where some sequence has a temperature above 0, asks for log q (return_logprobs) or the top-N
of q (top_k_probs) draws its drafts as sampling.sample_from_q does (Gumbel-max over Philox noise keyed by (seed,
position): a pure function of device tensors, so a graph holds it). Per padded batch size and top-N width w in
sampled_widths (0, 16, the top-N cap; --sampled-step-graphs) one more graph holds one sampled decode step: the same
step, then the draw from the per-row settings in temperature / seed / top_k, log q into logprobs_out and the top-N
of q over w columns into top_ids_out / top_probs_out at the step's column (as drafts_out). A step replays the
narrowest w that holds its largest N (its own top-N are the first N of those w). Where the step's first step replays a
(greedy) first-step graph, one graph per (padded batch size, w) then draws draft 1 again from the head output of each
sequence's last row that the first-step graph left in `hidden` (_first_draw: one more lm_head pass over bs rows);
otherwise the first step runs eagerly and its draft 1 (with its log q and top-N) is loaded into column 0. The step's
drafts, log q (where asked) and top-N (w > 0) come to the host in the same one wait. Sampled decode steps replay
single steps (no chains).

The first draft step (draft 1). Its rows are the committed tokens, m_i per sequence, so its shapes vary with the
batch. It is replayed from one more graph per (padded batch size, M), captured at start-up too, when every sequence
asks for drafts, M = max m_i <= --first-step-graph-tokens, every context holds at least M positions and the batch
pads to a captured size (up to MAX_FIRST_STEP_GRAPH_BATCH): each sequence gets M rows, its m_i real rows *last*
(right-aligned, as the seeds' padded drafter keeps a fixed number of rows per request), the M - m_i rows before them
padding. The attention kernel places query row j of a sequence at seq_len - M + j, so the real rows sit at their
own positions p_i .. p_i+m_i-1 and the padding rows at the positions just before p_i (already in the cache; they
read it, write nothing, and their outputs are dropped). Row i*M + M - 1 gives draft 1 for every sequence, so the
graph's query_start_loc (i * M) and its last rows are constants. A uniform batch (every m_i = M) is the case with no
padding rows.

Such a step needs no step metadata from the host. The host writes the step's raw columns into a record at fixed
addresses (pinned on CUDA) and copies it to the device in one copy, and the target hidden states into fs_states with
one more; the first-step graph's first kernel (kernels/build_first_step.py) builds every row from them: positions,
KV slots, shifted input ids, padded rows, the decode rows' positions, seq_lens, steps and block tables. So the whole
greedy step is two copies in, graph replays, and one copy of the drafts out:

  record (int32)    header [2] (B, w); start_positions, query_start_loc, next_tokens, draft_steps (k - 1) [<= bs];
                    token_ids [T] (the committed tokens); block_tables [B * w] (sequence i's blocks at i * w)
  fs_states         [R, W_in] the step's target hidden states, rows in batch order (model dtype)

  static buffer      shape              after the first-step graph's first kernel
  fs_input_ids       [R] int64          real row j of sequence i (row i*M + M - m_i + j): x[t+1], its last row
                                        next_token; 0 on padding rows
  fs_hidden          [R, W]             the target hidden states of the real rows; padding rows keep what they held
  fs_positions       [R] int64          seq_len_i - M + r for row r of sequence i (p_i + j on the real rows)
  fs_slots           [R] int64          the real rows' KV slots; PADDING_SLOT_ID for every padding row
  seq_lens           (decode buffer)    p_i + m_i; M for padding sequences (their rows are positions 0..M-1)
  positions, steps_left, block_tables   the decode rows, as for decode (steps_left 0 for padding sequences)
  R = MAX_FIRST_STEP_GRAPH_BATCH * --first-step-graph-tokens.
Padding sequences (B <= i < bs) read block-table rows left by earlier steps and write nothing; their outputs are
discarded.

Packed first steps. A step in which a sequence joins brings its prompt (tens to thousands of rows) beside the others'
1-8 row decodes: M passes --first-step-graph-tokens (and a new sequence's context holds no position before its
prompt), so the padded graphs above cannot take it, and its first step ran eagerly (~20 launches of the head's
forward from Python, ~1 ms of host time at batch 128 on an H200 host). It replays a *packed* first-step graph
instead, one per (bs, R) captured at start-up, bs in PACKED_BATCH_SIZES (up to the batch cap) and R in
packed_row_buckets(--first-step-graph-rows): the step's T <= R rows sequence after sequence as they come, then R - T
padding rows owned by no sequence (kernels/build_packed_first_step.py builds them from the same record; padding
sequences are empty queries). The attention takes it on its packed grid (kernels/paged_attention.py: programs per
query tile of the batch, not per sequence times the longest query), the head reads the hidden states from fs_states
in place, and draft 1 of sequence i comes from row fs_packed_last_rows[i]. Then the decode graphs, as for any step.
A step uses the padded graph where it fits (fewer rows for short steps) and holds at most PADDED_OVER_PACKED_MAX
times the packed graph's rows, else the packed one, else runs eagerly. From the columns path a packed graph also takes
a prompt's chunks before its last (k = 0: KV written, no draft; their decode rows masked by steps_left -1), which
vLLM's chunked prefill sends beside the others' decodes.

On the CPU (tests) the same static-buffer steps run eagerly, with no graphs.
"""
import gc
import logging
import time
from typing import NamedTuple

import numpy as np
import torch

from drafter_kernels import ops

from drafter_service.models.attention_metadata import AttentionMetadata
from drafter_service.engine.first_step_record import FirstStepRecord
from drafter_service.engine.host_staging import rows_into
from drafter_service.engine.sampling import DraftSample, SamplingSettings, sample_from_q
from drafter_service.engine.step_metadata import StepMetadata

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256  # larger batches run the eager decode loop
MAX_FIRST_STEP_GRAPH_BATCH = MAX_GRAPH_BATCH  # batches of more sequences run the first step eagerly
# Padded first steps of up to this many rows replay a graph whatever their padding; above it only those padded to at
# most twice their rows. Measured (benchmarks/bench_first_step_padding.py, H200, both heads, context 1024 and 4096):
# a batch of mostly 1-token steps padded to 384 or 768 rows (batch 64 / 128, M = 6) ran 4-31% faster through the
# graph than eagerly; padded to 1536 (batch 256) 4-9% slower. (256 until then: a guess from FLOP counts.)
FIRST_STEP_SMALL_ROWS = 768
# Padded batch sizes of the packed first-step graphs (up to the batch cap, and the cap itself): the decode graphs
# that follow keep their own finer sizes, the packed step masks the sequences between (steps_left 0).
PACKED_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# the fewest rows a packed first-step graph holds (batch 1 with a prompt of up to this many tokens)
PACKED_MIN_ROWS = 32
# A step both kinds of first-step graph can take replays the padded one unless its padded rows are more than this many
# times the packed graph's. Measured (bench_first_step_padding.py, H200, EAGLE-3 8B shape, engine-applied fc, context
# 1024, k = 5, 2026-11-28): padded 3x the packed rows ("low": batch 32 192 / 64, batch 128 768 / 256) ran 3-6% slower
# than packed; 1.5x ("spread") within 1-2%; uniform batches (no padding) 2-12% faster padded, whose short queries
# split the context in the attention (the packed grid does not).
PADDED_OVER_PACKED_MAX = 2


def packed_row_buckets(max_rows: int) -> list[int]:
    """Rows of the packed first-step graphs, up to max_rows (--first-step-graph-rows; 0: none): 32, 64, 128, 256,
    then steps of at most 1.5x (384, 512, 768, 1024, 1536, 2048, ...), so a step's padding rows stay under half its
    own above 256 rows; max_rows itself is the last bucket."""
    buckets, rows = [], PACKED_MIN_ROWS
    while rows < max_rows:
        buckets.append(rows)
        if rows < 256:
            rows *= 2
        else:  # 256 -> 384 -> 512 -> 768 -> 1024 ...
            rows = rows * 3 // 2 if rows & (rows - 1) == 0 else rows * 4 // 3
    return buckets + [max_rows] if max_rows > 0 else []


# Top-N widths of the sampled decode-step graphs (besides 0, no top-N): a step asking for top-N replays the narrowest
# that holds its largest N (its own top-N are the first N of the graph's); the largest is --max-top-k-probs' cap
# (GetInfo.max_top_k_probs), added where it is not one of these.
SAMPLED_TOP_WIDTHS = (16,)


def sampled_widths(max_top_k: int) -> list[int]:
    """Top-N widths of the sampled decode graphs: 0 (Gumbel draws and log q only), SAMPLED_TOP_WIDTHS below
    max_top_k, then max_top_k itself (0: no top-N graph)."""
    return [0, *(w for w in SAMPLED_TOP_WIDTHS if w < max_top_k), *([max_top_k] if max_top_k > 0 else [])]


# Decode-step chains captured per padded batch size (longest first; only those shorter than --max-draft-tokens):
# n decode steps replay the longest chains that fit, then single steps (DecodeGraphs._replay_steps).
DECODE_CHAIN_LENGTHS = (4, 2)


class GraphSampling(NamedTuple):
    """A sampling step's settings for draft_columns (numpy columns of the step, [B] each)."""
    temperature: np.ndarray  # float32
    seed: np.ndarray  # int64 (the uint64 seeds' bits)
    top_k: np.ndarray  # int64, N per sequence
    width: int  # the sampled graphs' top-N width (DecodeGraphs.sampled_width)
    want_logprobs: bool


class FirstStepPlan(NamedTuple):
    """How a greedy step's first draft step replays (DecodeGraphs.first_step_plan)."""
    packed: bool  # a packed graph (the step's rows as they come) or a padded one (M rows for every sequence)
    batch_size: int  # the graph's padded batch size
    size: int  # packed: the graph's rows; padded: M, the rows of each sequence


def graph_batch_sizes(max_batch_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 16, up to the first that covers
    min(max_batch_seqs, MAX_GRAPH_BATCH)."""
    cap = min(max_batch_seqs, MAX_GRAPH_BATCH)
    sizes = []
    for size in [1, 2, 4, 8, *range(16, MAX_GRAPH_BATCH + 1, 16)]:
        sizes.append(size)
        if size >= cap:
            break
    return sizes


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest size in ``sizes`` (ascending) holding n rows; None when n is larger than all of them."""
    return next((size for size in sizes if size >= n), None)


class DecodeGraphs:
    """Static buffers, one CUDA graph per padded batch size for one greedy decode step (and one per chain length
    for that many steps back to back), and one per (padded batch size, M) for the first step (every sequence's rows
    padded to the batch's largest m, M)."""

    def __init__(self, model, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_model_len: int, max_batch_seqs: int, dtype: torch.dtype, device: torch.device,
                 first_step_tokens: int = 0, max_drafts: int = 16, first_step_rows: int = 0,
                 max_top_k: int | None = None):
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.sizes = graph_batch_sizes(max_batch_seqs)
        max_bs, H = self.sizes[-1], model.dims.hidden_size
        W = -(-max_model_len // block_size)
        with torch.inference_mode():
            z = dict(device=device)
            self.input_ids = torch.zeros(max_bs, dtype=torch.int64, **z)
            self.hidden = torch.zeros(max_bs, H, dtype=dtype, **z)
            self.positions = torch.zeros(max_bs, dtype=torch.int64, **z)
            self.seq_lens = torch.ones(max_bs, dtype=torch.int32, **z)
            self.slot_mapping = torch.full((max_bs,), ops.PADDING_SLOT_ID, dtype=torch.int64, **z)
            self.block_tables = torch.zeros(max_bs, W, dtype=torch.int32, **z)
            self.steps_left = torch.zeros(max_bs, dtype=torch.int32, **z)
            self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, **z)  # one query row per sequence
            self.draft_ids = torch.zeros(max_bs, dtype=torch.int64, **z)
            self.max_drafts = max_drafts
            self.draft_column = torch.zeros(1, dtype=torch.int64, **z)
            # columns 0..K: an engine step's drafts 1..K, or a pre-drafting branch's bonus token and drafts 1..K
            self.drafts_out = torch.zeros(max_bs, max_drafts + 1, dtype=torch.int64, **z)
            # column j: the head's output g_j that step j + 1 takes as its hidden input (g_0 from the first step);
            # pre-drafting's forced pass reuses g_0..g_{k-1} of a plain step (predraft.py)
            self.hidden_steps = torch.zeros(max_bs, max_drafts + 1, H, dtype=dtype, **z)
            # where drafts_out lands on the host: pinned, so that the copy is asynchronous until the one sync
            self.drafts_host = (torch.zeros(max_bs, max_drafts + 1, dtype=torch.int64, pin_memory=True)
                                if device.type == "cuda" else None)
        # sampled decode steps (temperature > 0, log q, top-N): per-row settings in, log q and top-N out, by column as
        # drafts_out; widths: the top-N each graph takes (None: no sampled graphs)
        self.widths = sampled_widths(max_top_k) if max_top_k is not None else []
        top = max(self.widths, default=0)
        with torch.inference_mode():
            self.temperature = torch.zeros(max_bs, dtype=torch.float32, **z)
            self.seed = torch.zeros(max_bs, dtype=torch.int64, **z)
            self.top_k = torch.zeros(max_bs, dtype=torch.int64, **z)
            self.logprobs_out = torch.zeros(max_bs, max_drafts + 1, **z)  # log q(draft), float32
            self.top_ids_out = torch.full((max_bs, max_drafts + 1, top), -1, dtype=torch.int64, **z)  # target ids
            self.top_probs_out = torch.zeros(max_bs, max_drafts + 1, top, **z)
        # first step: padded batch sizes up to MAX_FIRST_STEP_GRAPH_BATCH, M = 1..first_step_tokens rows per sequence
        self.first_sizes = [s for s in self.sizes if s <= MAX_FIRST_STEP_GRAPH_BATCH] if first_step_tokens > 0 else []
        self.first_step_tokens = first_step_tokens if self.first_sizes else 0
        max_fs = self.first_sizes[-1] if self.first_sizes else 0
        padded_rows = max_fs * self.first_step_tokens
        # packed first steps: (padded batch size, rows) pairs with rows >= size
        cap = min(max_batch_seqs, MAX_FIRST_STEP_GRAPH_BATCH)
        self.packed_sizes = sorted({s for s in PACKED_BATCH_SIZES if s < cap} | {self.sizes[-1]}) \
            if first_step_rows > 0 else []
        self.packed_rows = packed_row_buckets(first_step_rows) if self.packed_sizes else []
        R = max(padded_rows, self.packed_rows[-1] if self.packed_rows else 0)  # rows of any first step
        max_fs = max(max_fs, self.packed_sizes[-1] if self.packed_sizes else 0)
        with torch.inference_mode():
            self.fs_input_ids = torch.zeros(R, dtype=torch.int64, **z)
            self.fs_hidden = torch.zeros(padded_rows, model.hidden_states_width, dtype=dtype, **z)
            self.fs_positions = torch.zeros(R, dtype=torch.int64, **z)
            self.fs_slots = torch.full((R,), ops.PADDING_SLOT_ID, dtype=torch.int64, **z)
            # a step's target hidden states, rows in batch order: the padded graphs lay them out in fs_hidden, the
            # packed ones read them in place
            self.fs_states = torch.zeros(R, model.hidden_states_width, dtype=dtype, **z)
            seq = torch.arange(max_fs + 1, **z)
            self.fs_query_start_loc = {m: (seq * m).to(torch.int32) for m in range(1, self.first_step_tokens + 1)}
            self.fs_last_rows = {m: seq[1:] * m - 1 for m in range(1, self.first_step_tokens + 1)}
            # a packed step's query layout, built by its graph (build_packed_first_step.py)
            self.fs_packed_query_start_loc = torch.zeros(max_fs + 1, dtype=torch.int32, **z)
            self.fs_packed_last_rows = torch.zeros(max_fs, dtype=torch.int64, **z)
        # the raw columns of a step whose first step replays a graph (first_step_record.py)
        self.record = FirstStepRecord(max_fs, R, W, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # padded batch size -> graph; empty: run eagerly
        # (padded batch size, L) -> a graph of L decode steps back to back; empty: single steps
        self.chain_lengths = tuple(n for n in DECODE_CHAIN_LENGTHS if 1 < n < max_drafts)
        self.chains: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.first_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (padded batch size, M) -> graph
        self.packed_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (padded batch size, rows) -> graph
        self.sampled_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (padded batch size, width) -> graph
        # (padded batch size, width) -> a sampling step's draft 1 drawn after its (greedy) first-step graph
        self.first_draw_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.steps_run = 0  # engine steps whose decode steps ran here
        self.first_steps_run = 0  # engine steps whose first step ran here too
        self.packed_first_steps_run = 0  # of which packed (a sequence joining, or any m past first_step_tokens)
        self.first_step_rehearsals = 0  # rehearse_columns calls: the record's host copy written, nothing sent
        self.rows_runs = 0  # run_rows calls (pre-drafting branch passes)
        self.sampled_steps_run = 0  # engine steps whose decode steps ran here sampled (of steps_run)

    # ---- the step that is captured ----

    def _step(self, bs: int, width: int | None = None) -> None:
        """One decode step for static rows [0, bs): reads and writes the static buffers only. width None: greedy;
        else sampled with top-N over that many columns (_sample)."""
        positions, seq_lens, slots = self.positions[:bs], self.seq_lens[:bs], self.slot_mapping[:bs]
        input_ids, hidden, steps_left = self.input_ids[:bs], self.hidden[:bs], self.steps_left[:bs]
        block_tables = self.block_tables[:bs]
        # (and this step's column of drafts_out / hidden_steps: draft_column + 1, clamped; the clamp only matters for
        # the warm-up and capture runs)
        ops.advance_draft_step(positions, block_tables, seq_lens, self.block_size, self.max_model_len,
                               positions, slots, self.draft_column, self.max_drafts)
        # padding rows and rows past their own k (steps_left <= 0): no KV write, seq_len 1, zero inputs; steps - 1
        ops.mask_finished_rows(steps_left, slots, seq_lens, input_ids, hidden)
        meta = AttentionMetadata(positions=positions, slot_mapping=slots,
                                 query_start_loc=self.query_start_loc[: bs + 1], seq_lens=seq_lens,
                                 block_tables=block_tables, max_query_len=1)
        head_out = self.model.forward(input_ids, hidden, meta, self.kv_layers)  # [bs, H]
        self._store_draft(head_out, bs, width)

    def _store_draft(self, head_out: torch.Tensor, bs: int, width: int | None = None) -> None:
        """The draft of each of rows [0, bs) from its head output [bs, H] (the greedy argmax of its logits, or with
        a width sampled: _sample): input_ids and drafts_out[:, column] = the draft (target vocabulary), hidden and
        hidden_steps[:, column] = the next hidden input, in one kernel (kernels/store_draft_step.py). Every static
        step ends so: the decode step, and the first steps (padded and packed) with their sequences' last rows."""
        logits = self.model.compute_logits(head_out)
        draft = ops.argmax(logits, out=self.draft_ids[:bs]) if width is None else self._sample(logits, bs, width)
        ops.store_draft_step(draft, self.model.d2t, self.model.next_hidden(head_out), self.draft_column,
                             self.input_ids[:bs], self.hidden[:bs], self.drafts_out[:bs], self.hidden_steps[:bs])

    def _sample(self, logits: torch.Tensor, bs: int, width: int) -> torch.Tensor:
        """Drafts of rows [0, bs) drawn from q as sampling.sample_from_q draws them (temperature, seed, top_k by row;
        the Gumbel position is the row's position + 1, as the eager loop's), with log q(draft) into logprobs_out and
        the top-N of q over `width` columns (target ids) into top_ids_out / top_probs_out, at the step's column.
        Returns the drafts [bs] (draft vocabulary)."""
        s = sample_from_q(logits, self.temperature[:bs], self.seed[:bs], self.positions[:bs] + 1, self.top_k[:bs],
                          width, want_logprobs=True)
        column = self.draft_column  # [1] int64 (device)
        self.logprobs_out[:bs].index_copy_(1, column, s.logprobs[:, None])
        if width > 0:
            ids = torch.where(s.top_ids >= 0, self.model.draft_to_target(s.top_ids.clamp(min=0)), -1)
            self.top_ids_out[:bs, :, :width].index_copy_(1, column, ids[:, None])
            self.top_probs_out[:bs, :, :width].index_copy_(1, column, s.top_probs[:, None])
        return s.tokens

    def _first_draw(self, bs: int, width: int) -> None:
        """Draft 1 of a sampling step drawn from q after its first step replayed a (greedy) first-step graph, which
        left each sequence's last-row head output in hidden[:bs] (sequential heads: the next hidden input is the head
        output itself), its last position C - 1 in positions[:bs] and column 0 in draft_column: the draw overwrites
        that graph's argmax in input_ids and drafts_out[:, 0] and writes log q and top-N into column 0 (_sample).
        (The head's logits are computed again: one more lm_head pass over bs rows.)"""
        self._store_draft(self.hidden[:bs].clone(), bs, width)

    def _first_step(self, bs: int, m: int) -> None:
        """The first draft step of bs (padded) sequences with m rows each (real rows right-aligned), built from the
        record and fs_states; writes draft 1 and the head output of each sequence's last row into the decode
        buffers."""
        T = bs * m
        ops.build_first_step_rows(*self.record.fields, self.fs_states, self.block_size, m, self.positions[:bs],
                                  self.seq_lens[:bs], self.block_tables[:bs], self.steps_left[:bs],
                                  self.fs_positions[:T], self.fs_input_ids[:T], self.fs_slots[:T], self.fs_hidden[:T],
                                  self.draft_column)  # (draft 1 goes to column 0)
        meta = AttentionMetadata(positions=self.fs_positions[:T], slot_mapping=self.fs_slots[:T],
                                 query_start_loc=self.fs_query_start_loc[m][: bs + 1], seq_lens=self.seq_lens[:bs],
                                 block_tables=self.block_tables[:bs], max_query_len=m)
        hidden_in = self.model.combine_hidden_states(self.fs_hidden[:T])
        head_out = self.model.forward(self.fs_input_ids[:T], hidden_in, meta, self.kv_layers)  # [T, H]
        self._store_draft(head_out[self.fs_last_rows[m][:bs]], bs)  # (each sequence's last row)

    def _packed_first_step(self, bs: int, rows: int) -> None:
        """The first draft step of bs (padded) sequences whose rows are packed into `rows` (the step's own first,
        then padding rows), built from the record; reads the hidden states from fs_states in place; writes draft 1
        and the head output of each sequence's last row into the decode buffers."""
        qsl, last_rows = self.fs_packed_query_start_loc[: bs + 1], self.fs_packed_last_rows[:bs]
        ops.build_packed_first_step_rows(*self.record.fields, self.block_size, self.positions[:bs],
                                         self.seq_lens[:bs], self.block_tables[:bs], self.steps_left[:bs], qsl,
                                         last_rows, self.fs_positions[:rows], self.fs_input_ids[:rows],
                                         self.fs_slots[:rows], self.draft_column)  # (draft 1 goes to column 0)
        meta = AttentionMetadata(positions=self.fs_positions[:rows], slot_mapping=self.fs_slots[:rows],
                                 query_start_loc=qsl, seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
                                 max_query_len=rows)  # (any one sequence may hold every row)
        hidden_in = self.model.combine_hidden_states(self.fs_states[:rows])
        head_out = self.model.forward(self.fs_input_ids[:rows], hidden_in, meta, self.kv_layers)  # [rows, H]
        self._store_draft(head_out[last_rows], bs)  # (each sequence's last row)

    def _replay_first(self, packed: bool, bs: int, size: int) -> None:
        """The first step of a plan (first_step_plan): its graph, or on the CPU (nothing captured) the same steps."""
        graphs, run = (self.packed_graphs, self._packed_first_step) if packed else (self.first_graphs, self._first_step)
        graph = graphs.get((bs, size))
        if graph is None:
            run(bs, size)
        else:
            graph.replay()

    def _replay(self, bs: int, width: int | None = None) -> None:
        graph = self.graphs.get(bs) if width is None else self.sampled_graphs.get((bs, width))
        if graph is None:
            self._step(bs, width)
        else:
            graph.replay()

    def _replay_steps(self, bs: int, n: int, width: int | None = None) -> None:
        """n decode steps of rows [0, bs): the longest captured chains that fit, then single steps (4 + 2 + 1 for
        seven; on the CPU, with nothing captured, n single steps). Sampled steps (a width) replay single steps."""
        for length in self.chain_lengths if width is None else ():
            chain = self.chains.get((bs, length))
            while chain is not None and n >= length:
                chain.replay()
                n -= length
        for _ in range(n):
            self._replay(bs, width)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size; largest first, so that the smaller ones reuse its memory pool."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # so that device free memory before/after counts the graphs' pool only
        free_before = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        self.steps_left.zero_()  # every row is a padding row while capturing: the warm-up runs write no KV
        self.record.clear()  # (and every sequence of a first step: B = 0)
        pool = None
        # No garbage collection while capturing: a collection on this thread that frees a pinned host tensor makes
        # the host allocator record a CUDA event on the capturing stream, which invalidates the capture (seen once
        # on the H200: "operation failed due to a previous error during capture"). vLLM disables GC here too.
        gc.collect()
        gc.disable()
        # a capture stream of this device: torch.cuda.graph's default one is made once per process, on the device
        # current at the first capture, and capturing on it switches to that device (a process with drafters on two
        # GPUs would capture the second one's Triton launches on the first device's stream)
        stream = torch.cuda.Stream(device=dev)

        def captured(run, *args) -> torch.cuda.CUDAGraph:
            """run(*args) captured into a graph of the shared pool (the first capture makes the pool)."""
            nonlocal pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                run(*args)
            pool = graph.pool() if pool is None else pool
            return graph

        def steps(bs: int, length: int) -> None:  # (a chain: the same launches as `length` one-step replays)
            for _ in range(length):
                self._step(bs)

        try:
            for bs in reversed(self.sizes):
                self._step(bs)  # warm-up: compiles this size's Triton specializations outside the capture
                torch.cuda.synchronize(dev)
                self.graphs[bs] = captured(self._step, bs)
                for length in self.chain_lengths:
                    self.chains[(bs, length)] = captured(steps, bs, length)
                for width in self.widths:  # (temperature 0 in every row while capturing: argmax draws)
                    self._step(bs, width)  # warm-up
                    torch.cuda.synchronize(dev)
                    self.sampled_graphs[(bs, width)] = captured(self._step, bs, width)
            # first-step graphs: every row a padding row (slot PADDING_SLOT_ID: no KV write), seq_len m
            for bs in reversed(self.first_sizes):
                for m in range(self.first_step_tokens, 0, -1):
                    self._first_step(bs, m)  # warm-up
                    torch.cuda.synchronize(dev)
                    self.first_graphs[(bs, m)] = captured(self._first_step, bs, m)
            for bs, rows in reversed(self.packed_shapes()):  # (every row a padding row: B = 0)
                self._packed_first_step(bs, rows)  # warm-up
                torch.cuda.synchronize(dev)
                self.packed_graphs[(bs, rows)] = captured(self._packed_first_step, bs, rows)
            for bs in reversed(self.sizes if self.first_sizes or self.packed_sizes else []):
                for width in self.widths:
                    self._first_draw(bs, width)  # warm-up
                    torch.cuda.synchronize(dev)
                    self.first_draw_graphs[(bs, width)] = captured(self._first_draw, bs, width)
            self.seq_lens.fill_(1)
        finally:
            gc.enable()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # the warm-ups' cached blocks; the graphs' private pool stays
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = free_before - torch.cuda.mem_get_info(dev)[0]
        buffer_bytes = sum(t.numel() * t.element_size() for t in (
            self.input_ids, self.hidden, self.positions, self.seq_lens, self.slot_mapping, self.block_tables,
            self.steps_left, self.query_start_loc, self.draft_ids, self.fs_input_ids, self.fs_hidden,
            self.fs_positions, self.fs_slots, self.fs_states, self.record.on_device, self.drafts_out,
            self.hidden_steps, self.fs_packed_query_start_loc, self.fs_packed_last_rows, self.temperature,
            self.seed, self.top_k, self.logprobs_out, self.top_ids_out, self.top_probs_out))
        log.info("captured %d decode CUDA graphs (batch sizes %s; and %d chains of %s decode steps; %d sampled "
                 "decode steps, top-N widths %s, and %d draws of a sampled draft 1), %d padded "
                 "first-step graphs (batches of up to %d sequences with up to 1..%d tokens each) and %d packed ones "
                 "(batches of up to %d sequences, %s rows) in %.2f s; they hold %.1f MiB of device memory (graph "
                 "pool, kernels, workspaces), plus %.1f MiB of static buffers", len(self.graphs),
                 ",".join(map(str, self.sizes)), len(self.chains), "/".join(map(str, self.chain_lengths)),
                 len(self.sampled_graphs), ",".join(map(str, self.widths)) or "none", len(self.first_draw_graphs),
                 len(self.first_graphs), self.first_sizes[-1] if self.first_sizes else 0, self.first_step_tokens,
                 len(self.packed_graphs), self.packed_sizes[-1] if self.packed_sizes else 0,
                 ",".join(map(str, self.packed_rows)) or "no", self.capture_seconds, self.capture_bytes / 2**20,
                 buffer_bytes / 2**20)

    def packed_shapes(self) -> list[tuple[int, int]]:
        """(padded batch size, rows) of the packed first-step graphs, ascending: every size with every row bucket
        that can hold its sequences (rows >= size)."""
        return [(bs, rows) for bs in self.packed_sizes for rows in self.packed_rows if rows >= bs]

    # ---- one engine step ----

    def first_step_plan(self, seq_lens: np.ndarray, num_tokens: np.ndarray, num_drafts: np.ndarray,
                        prefill_chunks: bool = False) -> FirstStepPlan | None:
        """How a greedy step of these columns ([B] p + m, m and k after the max_model_len cut) replays its first
        step (draft_columns), or None where it runs eagerly. Every sequence must draft (1 <= k <= max_drafts), except
        that with prefill_chunks a packed graph also takes sequences of k = 0 (a prompt's chunk before its last: its
        KV written, no draft; its decode rows masked, steps_left -1): vLLM's chunked prefill sends a long prompt so
        (the columns path; the per-sequence path keeps pre-drafting features by row, for drafting rows only).
        Padded, (False, bs, M): its largest m (M) is <= first_step_tokens, every context holds at least M positions
        (the padding rows sit before the real ones), the batch pads to a captured size, and the padded rows are at
        most twice the real ones (or few): a large batch of mostly short steps runs fewer rows eagerly than the
        graph would. Otherwise packed, (True, bs, rows): its T rows fit a row bucket and its batch a packed size;
        packed too where both fit and the padded rows are more than PADDED_OVER_PACKED_MAX times the packed ones."""
        B = num_tokens.shape[0]
        if B == 0 or int(num_drafts.max()) > self.max_drafts:
            return None
        M, T, least_k = int(num_tokens.max()), int(num_tokens.sum()), int(num_drafts.min())
        if M <= 0 or least_k < 0 or (least_k == 0 and not prefill_chunks):
            return None
        packed = self.packed_plan(B, T)
        if least_k == 0:
            return packed
        bs = padded_batch_size(B, self.first_sizes)
        if (bs is not None and M <= self.first_step_tokens and bs * M <= max(2 * T, FIRST_STEP_SMALL_ROWS)
                and int(seq_lens.min()) >= M and (packed is None or bs * M <= PADDED_OVER_PACKED_MAX * packed.size)):
            return FirstStepPlan(False, bs, M)
        return packed

    def packed_plan(self, B: int, T: int) -> FirstStepPlan | None:
        """(True, bs, rows) of the packed graph that holds B sequences and T rows; None where none does."""
        bs = padded_batch_size(B, self.packed_sizes)
        rows = None if bs is None else padded_batch_size(max(T, bs), self.packed_rows)  # (rows >= bs: packed_shapes)
        return None if rows is None else FirstStepPlan(True, bs, rows)

    def can_run(self, md: StepMetadata) -> bool:
        """Whether the decode steps of this (greedy) step can replay the decode graphs."""
        n = len(md.active)
        return (padded_batch_size(n, self.sizes) is not None
                and max(md.num_drafts[i] for i in md.active) <= self.max_drafts)

    def sampled_width(self, top_n: int | None) -> int | None:
        """The top-N width of the sampled graphs that a sampling step whose largest N is top_n replays (the narrowest
        that holds it), or None where none does (no sampled graphs, or N unknown)."""
        if top_n is None:
            return None
        return next((w for w in self.widths if w >= top_n), None)

    def graph_sampling(self, temperature: np.ndarray, seed: np.ndarray, top_k: np.ndarray,
                       want_logprobs: bool) -> GraphSampling | None:
        """A sampling step's settings for draft_columns ([B] numpy columns: float32 temperatures, int64 seed bits,
        int64 N), or None where no sampled graph holds its largest N (sampled_width)."""
        width = self.sampled_width(int(top_k.max()))
        return None if width is None else GraphSampling(temperature, seed, top_k, width, want_logprobs)

    def draft(self, md: StepMetadata, out, first: DraftSample, hidden: torch.Tensor,
              sp: SamplingSettings | None = None, width: int | None = None):
        """Drafts 2..k of every drafting sequence; all drafts 1..k go to ``out`` (the proposer's _Drafts), as host
        lists per batch index.

        first: draft 1 of the n = len(md.active) drafting sequences in md.active order (tokens [n] int64, target
        vocabulary; for a sampling step also its log q and top-N where asked) and hidden [n, H]: the head's next
        hidden input. sp and width (sampled_width): the decode steps sample with these settings (sp's tensors by
        batch index), log q and top-N collected with the drafts; width None: greedy.
        """
        n = len(md.active)
        bs = padded_batch_size(n, self.sizes)
        assert bs is not None and tuple(hidden.shape) == (n, self.hidden.shape[1]), (n, tuple(hidden.shape))
        self._load_decode_rows(md, n, bs)
        self.input_ids[:n].copy_(first.tokens)
        self.hidden[:n].copy_(hidden)
        self.hidden_steps[:n, 0].copy_(hidden)
        self.drafts_out[:n, 0].copy_(first.tokens)
        self.draft_column.zero_()
        if width is not None:
            self._load_sampling(md.active, sp, first, n)
        return self._decode_and_collect(out, md.active, [md.num_drafts[i] for i in md.active], n, bs, width,
                                        sp is not None and sp.want_logprobs)

    def _load_sampling(self, active: list[int], sp: SamplingSettings, first: DraftSample, n: int) -> None:
        """Rows [0, n) (batch indices `active`) of a sampling step: their settings, and draft 1's log q and top-N
        in column 0."""
        rows = slice(0, n) if active == list(range(n)) else torch.tensor(active).to(self.device, non_blocking=True)
        self.temperature[:n].copy_(sp.temperature[rows])
        self.seed[:n].copy_(sp.seed[rows])
        self.top_k[:n].copy_(sp.top_k[rows])
        if first.logprobs is not None:
            self.logprobs_out[:n, 0].copy_(first.logprobs)
        if first.top_ids is not None:  # ([n, max N] of draft 1; the graphs' width may be more)
            w = first.top_ids.shape[1]
            self.top_ids_out[:n, 0, :w].copy_(first.top_ids)
            self.top_probs_out[:n, 0, :w].copy_(first.top_probs)

    def draft_columns(self, plan: FirstStepPlan, start_positions: np.ndarray, num_tokens: np.ndarray,
                      token_ids: np.ndarray, next_tokens: np.ndarray, num_drafts: np.ndarray, block_tables: np.ndarray,
                      hidden_states: list[torch.Tensor], out, sampling: GraphSampling | None = None):
        """Drafts 1..k of a step, the first step replayed too, as first_step_plan planned it. Its columns ([B] p, m,
        next tokens, k; token_ids [T]; block_tables [B, w] int32, numpy) go into the record, its hidden states
        (tensors of [m_i or T, W_in] rows, in batch order) into fs_states: two copies in, then only replays. A
        sampling step (sampling: its settings, three more small copies) draws draft 1 again after the first-step
        graph (_first_draw) and replays the sampled decode graphs."""
        packed, bs, size = plan
        B = num_tokens.shape[0]
        self.record.write(start_positions, num_tokens, next_tokens, num_drafts, token_ids, block_tables)
        rows_into(hidden_states, self.fs_states[: token_ids.shape[0]])
        width = None
        if sampling is not None:
            width = sampling.width
            for buffer, column in ((self.temperature, sampling.temperature), (self.seed, sampling.seed),
                                   (self.top_k, sampling.top_k)):
                buffer[:B].copy_(torch.tensor(column), non_blocking=True)  # (a copy: a wire column may be read-only)
        self._replay_first(packed, bs, size)
        if width is not None:
            graph = self.first_draw_graphs.get((bs, width))
            if graph is None:
                self._first_draw(bs, width)
            else:
                graph.replay()
        self.first_steps_run += 1
        if packed:
            self.packed_first_steps_run += 1
            bs = padded_batch_size(B, self.sizes)  # (the decode graphs' size: <= the packed one)
        return self._decode_and_collect(out, list(range(B)), num_drafts.tolist(), B, bs, width,
                                        sampling is not None and sampling.want_logprobs)

    def rehearse_columns(self, start_positions: np.ndarray, num_tokens: np.ndarray, token_ids: np.ndarray,
                         next_tokens: np.ndarray, num_drafts: np.ndarray, block_tables: np.ndarray) -> None:
        """draft_columns' host work before its copies and replays, with nothing sent: the record's host copy
        (Proposer.rehearse_columns; the next step rewrites the record before its copy)."""
        self.record.write(start_positions, num_tokens, next_tokens, num_drafts, token_ids, block_tables, send=False)
        self.first_step_rehearsals += 1

    def kept_features(self, n: int, k: int) -> torch.Tensor:
        """After an engine step of uniform k: g_0..g_{k-1} of its n drafting rows, [n, k, H] (a copy: the next
        replays overwrite the buffer)."""
        return self.hidden_steps[:n, :k].clone()

    def fits(self, n: int, steps: int) -> bool:
        """Whether run_rows can take n rows of `steps` decode steps."""
        return padded_batch_size(n, self.sizes) is not None and steps <= self.max_drafts

    def _load_rows(self, hidden: torch.Tensor, positions_before: torch.Tensor, block_tables: torch.Tensor,
                   steps: int) -> int:
        """Rows [0, n) of run_rows / run_forced: hidden inputs, positions before the first step, block tables and
        steps; padding rows [n, bs) masked. Returns the padded batch size bs."""
        n = hidden.shape[0]
        bs = padded_batch_size(n, self.sizes)
        w = block_tables.shape[1]
        self.positions[:n].copy_(positions_before.to(self.device, non_blocking=True))
        self.seq_lens[:n].copy_((positions_before + 1).to(torch.int32).to(self.device, non_blocking=True))
        self.block_tables[:n, :w].copy_(block_tables.to(self.device, non_blocking=True))
        self.steps_left[:n].fill_(steps)
        self.steps_left[n:bs].zero_()
        self.hidden[:n].copy_(hidden)
        self.draft_column.zero_()
        self.rows_runs += 1
        return bs

    def run_rows(self, tokens: torch.Tensor, hidden: torch.Tensor, positions_before: torch.Tensor,
                 block_tables: torch.Tensor, steps: int, between) -> torch.Tensor | None:
        """`steps` greedy decode steps for n rows that are not an engine step's sequences (pre-drafting branches,
        predraft.py): row r's first step runs at position positions_before[r] + 1 with input (tokens[r], hidden[r]).
        tokens [n] int64 target ids, hidden [n, H] (device); positions_before [n] int64 and block_tables [n, w] int32
        (host). between() after each replay: True stops (returns None). Returns the drafts [n, steps] (host)."""
        n = tokens.shape[0]
        bs = self._load_rows(hidden, positions_before, block_tables, steps)
        self.input_ids[:n].copy_(tokens)
        for j in range(steps):
            self._replay(bs)
            if j < steps - 1 and between():
                return None
        return self.drafts_out[:n, 1 : steps + 1].cpu()

    def run_forced(self, tokens: torch.Tensor, hidden: torch.Tensor, positions_before: torch.Tensor,
                   block_tables: torch.Tensor, steps: int, between) -> torch.Tensor | None:
        """`steps` decode steps for n rows whose inputs are given, not sampled (pre-drafting's forced pass,
        predraft.py): step j (0-based) runs at position positions_before[r] + 1 + j with input (tokens[r, j], the
        head output of the step before; hidden[r] for j = 0). Between two replays the next forced tokens replace the
        graph's own argmax in input_ids (one device copy). tokens [n, steps] int64 target ids, hidden [n, H]
        (device); positions_before [n] int64, block_tables [n, w] int32 (host). between() after each replay: True
        stops (returns None). Returns the head outputs of the steps [n, steps, H] (device)."""
        n = tokens.shape[0]
        bs = self._load_rows(hidden, positions_before, block_tables, steps)
        out = torch.empty(n, steps, self.hidden.shape[1], dtype=self.hidden.dtype, device=self.device)
        for j in range(steps):
            self.input_ids[:n].copy_(tokens[:, j])
            self._replay(bs)
            out[:, j].copy_(self.hidden[:n])  # next_hidden(head output) = the head output (sequential heads)
            if j < steps - 1 and between():
                return None
        return out

    def _load_decode_rows(self, md: StepMetadata, n: int, bs: int) -> None:
        """Drafting rows [0, n) from this step's metadata; padding rows [n, bs) are masked by steps_left = 0."""
        w = md.draft_block_tables.shape[1]
        self.positions[:n].copy_(md.draft_positions)
        self.seq_lens[:n].copy_(md.draft_seq_lens)
        self.block_tables[:n, :w].copy_(md.draft_block_tables)
        self.steps_left[:n].copy_(md.draft_steps)
        if n < bs:
            self.steps_left[n:bs].zero_()

    def _decode_and_collect(self, out, active: list[int], ks: list[int], n: int, bs: int,
                            width: int | None = None, want_logprobs: bool = False):
        """input_ids/hidden rows [0, n) hold draft 1 and its hidden input (row r: batch index active[r], which
        asked for ks[r] drafts): replay the decode steps (sampled with a width), copy all drafts to the host once
        (and a sampling step's log q where asked and top-N where width > 0, in the same wait), give each sequence
        its first k of them."""
        num_steps = max(ks) - 1
        K = num_steps + 1
        self._replay_steps(bs, num_steps, width)  # each step writes its draft into the next column of drafts_out
        outputs = [self.drafts_out[:n, :K]]  # device views, then host tensors of their own
        if width is not None:
            outputs.append(self.logprobs_out[:n, :K] if want_logprobs else None)
            outputs += [self.top_ids_out[:n, :K, :width], self.top_probs_out[:n, :K, :width]] if width else [None] * 2
        if self.drafts_host is None:  # CPU
            host = [None if t is None else t.clone() for t in outputs]
        else:
            pinned = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in outputs[1:]]
            self.drafts_host[:n].copy_(self.drafts_out[:n], non_blocking=True)
            for dst, src in zip(pinned, outputs[1:]):
                if dst is not None:
                    dst.copy_(src, non_blocking=True)
            out.run_meanwhile()  # (the caller's host work that needs no draft, while the GPU runs the graphs)
            torch.cuda.current_stream(self.device).synchronize()  # the step's one device->host synchronization
            self.record.synchronized()  # (its copy, if this step wrote it, is done)
            host = [self.drafts_host[:n, :K].clone(), *pinned]  # (drafts_host is the next step's)
        self.steps_run += 1
        if width is not None:
            self.sampled_steps_run += 1
        out.set_host_rows(host[0], active, ks, *host[1:])
        return out


def capture_decode_graphs(proposer, block_size: int, max_model_len: int, max_batch_seqs: int,
                          dtype: torch.dtype, device: torch.device, first_step_tokens: int = 0,
                          max_drafts: int = 16, first_step_rows: int = 0,
                          max_top_k: int | None = None) -> DecodeGraphs | None:
    """At start-up, after the KV pool exists: the proposer's decode graphs, or None when they cannot run."""
    if proposer.model.drafting != "sequential":
        log.info("CUDA graphs: not used by %s drafting (only sequential heads have decode steps)",
                 proposer.model.drafting)
        return None
    if not ops.use_triton(proposer.kv.kv):
        log.warning("CUDA graphs are off: the Triton kernels are not in use (DRAFTER_KERNELS=torch or no triton), "
                    "and the torch references synchronize with the host; decode steps run eagerly")
        return None
    graphs = DecodeGraphs(proposer.model, proposer.kv_layers, block_size, max_model_len, max_batch_seqs, dtype,
                          device, first_step_tokens, max_drafts, first_step_rows, max_top_k)
    graphs.capture()
    return graphs
