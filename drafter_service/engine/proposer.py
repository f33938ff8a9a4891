"""One engine step for a batch of sequences: admit, prepare inputs, draft, sample.

Runs on the step worker thread only (scheduler.py), so it owns the sequence table and the KV pool.

For a sequence with start position p, m committed tokens x[p..p+m-1], hidden states h[p..p+m-1], next token
x[p+m] and k drafts, let C = p + m. The head's step structure (``model.drafting``) picks the path:

sequential (EAGLE-1, EAGLE-3): _run_sequential
  first step   rows t = p..C-1, inputs (x[t+1], combine(h[t])) -> draft-KV of those positions is (over)written;
               the head's output at row C-1 gives draft 1 (for position C+1).
  decode j     (j = 1..k-1) one row at position C-1+j with input (draft j, head output of the previous
               step) -> writes scratch draft-KV there, gives draft j+1.
parallel (P-EAGLE): _run_parallel
  one forward over the rows p..C-1 as above plus k-1 masked rows at positions C..C+k-2 (the parallel-drafting
  token, the head's mask hidden state); the outputs at row C-1 and at the masked rows give drafts 1..k
  (input layout: parallel_inputs.py).
multi_layer (multi-layer EAGLE): _run_multi_layer
  layer j = 0..n-1 runs over the rows [w0, C), the committed rows plus the rows re-fed from the sequence's
  shift cache, with the tokens shifted by j more; its output at row C-1 gives draft j+1 (multi_layer_inputs.py).
After the step the sequence's committed length is C; scratch KV past it is overwritten by the next step.

Two entry points: step(list[StepInput]) and step_batch(BatchInput). The common step of a sequential head (known
sequences, no pre-drafting; sampling, log-probabilities and top-N in large steps) runs from the step's columns (batch_io.py) with tensor ops
over the batch, whichever entry point it came through (step() builds the columns for a step of
STEP_INPUTS_AS_COLUMNS_MIN sequences or more); anything else runs sequence by sequence (step_per_sequence: admission
with each sequence's own status, pre-drafting, every head; log-probabilities and top-N in small steps).

On CUDA a step of a sequential head replays CUDA graphs (cuda_graphs.py; a sampling step its sampled graphs, where
one holds its top-N). Where its first step fits a first-step graph, both entry points hand the graph its raw columns
(first_step_record.py) and the graph builds its own rows; otherwise the host builds the step's metadata
(step_metadata.py) and the first step runs eagerly.

Every draft is sampled per sequence (sampling.py): greedy at temperature 0, otherwise Gumbel-max seeded by the
sequence's seed and the position of the drafted token minus one, so a replayed step gives the same drafts.

The head interface: method, drafting, num_kv_layers, vocab_size, draft_vocab_size, hidden_states_width, dims,
combine_hidden_states, draft_to_target; sequential and parallel heads add forward / compute_logits / next_hidden
and d2t (draft_to_target's offsets into the target vocabulary, or None; parallel ones parallel_token_id and
mask_hidden), multi-layer heads num_predict / forward_layer / compute_logits_layer.
"""
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from drafter_kernels import ops

from drafter_service.engine.batch_io import BatchInput, BatchOutput
from drafter_service.engine.cuda_graphs import FirstStepPlan, GraphSampling
from drafter_service.engine.host_staging import rows_to_device
from drafter_service.engine.kv_cache import KVCache
from drafter_service.metrics import Metrics
from drafter_service.models.attention_metadata import AttentionMetadata
from drafter_service.engine.multi_layer_inputs import ShiftCache, shift_and_cache
from drafter_service.engine.parallel_inputs import copy_and_expand_inputs_ref
from drafter_service.engine.predraft import Predrafter
from drafter_service.engine.sampling import DraftSample, SamplingSettings, sample_drafts, seed_to_int64
from drafter_service.engine.sequence import EVICTED_FOR_NAMESPACE, Sequence, SequenceLimits, SequenceTable
from drafter_service.engine.step_io import (FAILED_PRECONDITION, INTERNAL, NOT_FOUND, OUT_OF_RANGE,
                                            RESOURCE_EXHAUSTED, UNAVAILABLE, StepInput, StepOutput)
from drafter_service.engine.step_metadata import (SMALL_STEP_ROWS, MetadataBuffers, StepMetadata,
                                                  build_step_metadata_columns)

log = logging.getLogger(__name__)


@dataclass
class _Admitted:
    index: int  # into the step list
    seq: Sequence
    is_new: bool
    step: StepInput
    num_drafts: int  # k after the max_model_len cut


class _Drafts:
    """Drafts as they are sampled, column by column, then copied to the host once for the whole step."""

    def __init__(self, batch_size: int, top_k: list[int]):
        self.batch_size = batch_size
        self.top_k = top_k
        self.columns: list[tuple[list[int], DraftSample]] = []  # (batch index of each row, samples of the rows)
        self.host_rows: tuple[torch.Tensor, list[int], list[int]] | None = None  # graph path: ([n, K] drafts on the
        # host, the batch index of each row, each row's k), for finish() or as_tensor()
        # a sampled graph step's log q [n, K] (where asked) and top-N ids and probabilities [n, K, width] (width > 0)
        self.host_logprobs: torch.Tensor | None = None
        self.host_top: tuple[torch.Tensor, torch.Tensor] | None = None
        self.features: dict[int, torch.Tensor] = {}  # batch index -> [k, H] g_0..g_{k-1} (pre-drafting, eager path)
        # host work that needs nothing of the drafts: the graph path runs it after its launches, before it waits for
        # the GPU (run_meanwhile); otherwise the caller runs it after the step
        self.meanwhile: Callable[[], None] | None = None

    def run_meanwhile(self) -> None:
        """Run the host work of ``meanwhile`` once (a no-op after the first call, or with none)."""
        work, self.meanwhile = self.meanwhile, None
        if work is not None:
            work()

    def add(self, rows: list[int], sample: DraftSample) -> None:
        self.columns.append((rows, sample))

    def set_host_rows(self, rows: torch.Tensor, active: list[int], ks: list[int], logprobs: torch.Tensor | None = None,
                      top_ids: torch.Tensor | None = None, top_probs: torch.Tensor | None = None) -> None:
        """All drafts of a graphed step at once: rows [n, K] int64 on the host (a tensor of its own), row r the drafts
        of batch index active[r], of which its first ks[r] count; a sampled step's log q [n, K] float32 and top-N
        [n, K, width] (ids int64 in the target vocabulary, probabilities float32) likewise, where it has them."""
        assert not self.columns
        self.host_rows = (rows, active, ks)
        self.host_logprobs = logprobs
        self.host_top = (top_ids, top_probs) if top_ids is not None else None

    def as_tensor(self) -> torch.Tensor:
        """The drafts as one [B, K] int64 host tensor (row i's first num_drafts[i] entries count; K = the largest k),
        for a step without log-probabilities or top-N (Proposer.step_batch)."""
        B = self.batch_size
        if self.host_rows is not None:
            rows, active, _ = self.host_rows
            if len(active) == B:
                return rows
            out = torch.zeros(B, rows.shape[1], dtype=torch.int64)
            out[torch.tensor(active, dtype=torch.int64)] = rows
            return out
        if not self.columns:
            return torch.zeros(B, 0, dtype=torch.int64)
        everyone = list(range(B))
        if all(rows == everyone for rows, _ in self.columns):
            return torch.stack([c[1].tokens for c in self.columns], 1).cpu()
        K = len(self.columns)  # (one column per decode step: K = the largest k)
        flat = torch.cat([c[1].tokens for c in self.columns]).cpu()
        out = torch.zeros(B, K, dtype=torch.int64)
        r = 0
        for j, (rows, _) in enumerate(self.columns):
            out[torch.tensor(rows, dtype=torch.int64), j] = flat[r : r + len(rows)]
            r += len(rows)
        return out

    def finish(self) -> tuple[list[list[int]], list[list[float]], list[torch.Tensor | None], list[torch.Tensor | None]]:
        B = self.batch_size
        if self.host_rows is not None:
            rows, active, ks = self.host_rows
            host_rows = rows.tolist()
            per_seq: list[list[int]] = [[] for _ in range(B)]  # batch index -> drafts; k = 0 sequences: none
            for r, i in enumerate(active):  # drafts past a sequence's own k are dropped here
                per_seq[i] = host_rows[r][: ks[r]]
            logprobs: list[list[float]] = [[] for _ in range(B)]
            if self.host_logprobs is not None:
                lp = self.host_logprobs.tolist()
                for r, i in enumerate(active):
                    logprobs[i] = lp[r][: ks[r]]
            top_ids: list[torch.Tensor | None] = [None] * B
            top_probs: list[torch.Tensor | None] = [None] * B
            if self.host_top is not None:  # (a sequence's own N columns of its k drafts, [k, N], as the eager way)
                ids, probs = self.host_top
                for r, i in enumerate(active):
                    if self.top_k[i] > 0 and ks[r] > 0:
                        top_ids[i] = ids[r, : ks[r], : self.top_k[i]].clone()
                        top_probs[i] = probs[r, : ks[r], : self.top_k[i]].clone()
            return per_seq, logprobs, top_ids, top_probs
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        top_ids: list[list[torch.Tensor]] = [[] for _ in range(B)]
        top_probs: list[list[torch.Tensor]] = [[] for _ in range(B)]
        if not self.columns:
            return tokens, logprobs, [None] * B, [None] * B
        everyone = list(range(B))
        if all(rows == everyone and sample.top_ids is None for rows, sample in self.columns):
            # every sequence drafted every column (one k for all, no top-N): one [B, k] copy, rows as the lists
            tokens = torch.stack([c[1].tokens for c in self.columns], 1).cpu().tolist()
            if self.columns[0][1].logprobs is not None:
                logprobs = torch.stack([c[1].logprobs for c in self.columns], 1).cpu().tolist()
            return tokens, logprobs, [None] * B, [None] * B
        flat_tok = torch.cat([c[1].tokens for c in self.columns]).cpu().tolist()
        with_lp = self.columns[0][1].logprobs is not None
        flat_lp = torch.cat([c[1].logprobs for c in self.columns]).cpu().tolist() if with_lp else None
        r = 0
        for rows, sample in self.columns:
            ids = sample.top_ids.cpu() if sample.top_ids is not None else None
            probs = sample.top_probs.cpu() if sample.top_probs is not None else None
            for q, i in enumerate(rows):
                tokens[i].append(flat_tok[r])
                if flat_lp is not None:
                    logprobs[i].append(flat_lp[r])
                if ids is not None and self.top_k[i] > 0:
                    top_ids[i].append(ids[q, : self.top_k[i]])
                    top_probs[i].append(probs[q, : self.top_k[i]])
                r += 1
        stack = lambda rows: torch.stack(rows) if rows else None  # noqa: E731
        return tokens, logprobs, [stack(t) for t in top_ids], [stack(t) for t in top_probs]


# Substrings of the CUDA errors after which the CUDA context is unusable ("sticky": every later CUDA call fails the
# same way) and only a new process helps. (An out-of-memory error is not one of them.)
STICKY_DEVICE_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                        "misaligned address", "illegal instruction", "uncorrectable ecc", "launch timed out",
                        "an illegal", "cuda error: unknown error", "hardware stack error")
MAX_FAILED_BATCHES_IN_A_ROW = 3  # after this many failed batches in a row the step worker is considered broken
# step_batch runs a step of at least this many sequences from its columns (fewer: the per-sequence step, whose fixed
# cost is lower where the step metadata is built on the host; dev CPU, run stubbed: 60 against 137 us at 1 sequence,
# even at 4, 160 against 135 at 8, 280 against 150 at 16). Where first-step graphs run, a greedy step of any size goes
# the columns way (Proposer.takes_columns).
STEP_BATCH_MIN_SEQUENCES = 8
# Proposer.step builds the columns of a step of StepInputs from this many sequences (BatchInput.from_inputs): below it
# the conversion costs what the columns path saves. H200, 8B shapes, step() building columns at every size against the
# per-sequence step, three alternating rounds (docs/performance.md, eighteenth session): at 8 sequences 1.57-1.72
# against 1.53-1.56 ms (EAGLE-3), 2.52-2.93 against 2.49-2.91 (EAGLE-1); at 16 even; at 32 1.87-1.92 against
# 1.92-2.02 and 2.95-3.02 against 3.06-3.11; at 128 3.29-3.56 against 3.92-4.03 and 4.98-5.33 against 5.80-6.18.
STEP_INPUTS_AS_COLUMNS_MIN = 32


# A columns step's growing sequences take their KV blocks in one call from this many (SequenceTable.grow_rows: ~10
# numpy ops whatever their number), one at a time below it (_make_room and resize, ~3.5 us each on an H200 host;
# benchmarks/bench_block_growth.py, twenty-seventh session)
GROW_IN_ONE_CALL_MIN = 4


def large_enough_for_columns(num_sequences: int, num_tokens: int,
                             min_sequences: int = STEP_BATCH_MIN_SEQUENCES) -> bool:
    """Whether step_batch would run a step of this size from its columns (when nothing else sends it per sequence);
    a step channel's small request frame is parsed straight into StepInputs otherwise."""
    return num_sequences >= min_sequences or num_tokens > SMALL_STEP_ROWS


def unrecoverable(e: BaseException) -> bool:
    """Whether a step's exception leaves the device unusable (a sticky CUDA error)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)  # (torch >= 2.8 raises it for CUDA errors)
    text = str(e).lower()
    if "out of memory" in text:
        return False
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    return "cuda error" in text and any(s in text for s in STICKY_DEVICE_ERRORS)


class Proposer:
    def __init__(self, model, kv: KVCache, max_model_len: int, device: torch.device, metrics: Metrics | None = None,
                 sequence_limits: SequenceLimits | None = None):
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.device = device
        self.table = SequenceTable(kv.pool, kv.block_size, sequence_limits, max_model_len)
        self.clock = time.monotonic  # the lease's clock (tests replace it)
        self._step_serial = 0  # numbers the steps: a sequence whose last_step is the current one is not idle
        self._expiry_due = 0.0  # no sequence can expire before this clock time (expire_idle)
        self.metrics = metrics or Metrics()
        self.metrics.sequence_counters = self.table.counters
        self.kv_layers = [kv.layer(i) for i in range(model.num_kv_layers)]
        self.decode_graphs = None  # cuda_graphs.DecodeGraphs: set by runtime.py on CUDA with --cuda-graphs
        self.metadata_buffers = MetadataBuffers(device)  # the steps' metadata, packed and copied in place
        self.draining = False  # Drain / SIGTERM: new sequences get UNAVAILABLE, live ones keep drafting
        # Set when the step worker cannot go on (a sticky device error, or MAX_FAILED_BATCHES_IN_A_ROW failed
        # batches): every later step gets UNAVAILABLE without running, and on_fatal(reason) tells the server, which
        # turns health NOT_SERVING so that the liveness probe restarts the process.
        self.fatal: str | None = None
        self.on_fatal = lambda reason: None
        self._failed_in_a_row = 0
        self.columns_steps_run = 0  # steps step_batch ran from the columns (the rest went the per-sequence way)
        self.columns_rehearsals = 0  # rehearse_columns runs that went through the admission (diagnostics, tests)
        # diagnostics (the scheduler sets it while a traced request runs: DRAFTER_TRACE_RPC, scripts/rpc_timeline.py):
        # a columns step writes the time.perf_counter() of its phases here (admitted, launched, synced)
        self.phase_marks: dict | None = None
        self._multi_layer = model.drafting == "multi_layer"
        self.predraft = Predrafter(self)  # pre-drafting: hits answered at admission, branches prepared when idle
        self.metrics.predraft_counters = self.predraft.counters

    # ---- admission: per-sequence checks and block reservation; nothing is changed for a refused sequence ----

    def _admit(self, index: int, s: StepInput, out: StepOutput, seq: Sequence | None, now: float,
               state: tuple[int, int, list[int]] | None) -> _Admitted | None:
        """seq: the table's sequence for s (already touched by this step), None when the table has none; state: its
        (committed_len, last_drafts_base, last_drafts) as read for the whole step (SequenceRows.read_steps), or None
        to read them from seq now."""
        p, m = s.start_position, s.num_tokens
        if p + m >= self.max_model_len:
            out.code, out.message = OUT_OF_RANGE, (
                f"start_position + num_tokens = {p + m} leaves no room for next_token below max_model_len "
                f"{self.max_model_len}")
            return None
        is_new = seq is None
        if is_new:
            if self.draining:
                out.code, out.message = UNAVAILABLE, ("the drafter is draining: it takes no new sequences (start "
                                                      "this one on another drafter)")
                return None
            if p != 0:
                why = self.table.why_gone(s.namespace, s.sequence_id)
                out.code, out.message = NOT_FOUND, (
                    f"unknown sequence {s.sequence_id!r} in namespace {s.namespace!r}: a new sequence starts at "
                    f"start_position 0 (got {p})" if why is None else
                    f"sequence {s.sequence_id!r} in namespace {s.namespace!r} was {why}; start it again at "
                    f"start_position 0 (got {p})")
                return None
            seq = Sequence(s.namespace, s.sequence_id, owner=s.owner, last_used=now, last_step=self._step_serial)
            state = (0, 0, [])
        elif state is None:
            state = (seq.committed_len, seq.last_drafts_base, seq.last_drafts)
        if p > state[0]:
            out.code, out.message = FAILED_PRECONDITION, (
                f"gap: start_position {p} is beyond the committed length {state[0]} of sequence "
                f"{s.sequence_id!r}; resend from a position <= {state[0]}")
            return None
        k = max(0, min(s.num_drafts, self.max_model_len - 1 - (p + m)))
        if self._multi_layer:
            k = min(k, self.model.num_predict)
            positions_needed = p + m  # every layer works on the committed positions only
        else:
            positions_needed = p + m + max(k - 1, 0)  # scratch KV of the draft positions but the last
        blocks = self.table.blocks_for(positions_needed)
        have = seq.num_blocks
        if blocks != have or is_new:  # (a known sequence within its blocks, the common decode step: nothing to do)
            missing = max(0, blocks - have)
            if is_new or missing:
                refusal = self._make_room(seq, is_new, missing)
                if refusal is not None:
                    out.code, out.message = RESOURCE_EXHAUSTED, refusal
                    return None
            if not self.table.resize(seq, positions_needed):  # (cannot happen: _make_room left the blocks free)
                out.code, out.message = INTERNAL, f"KV pool: {self.kv.pool.num_free} blocks free after making room"
                return None
        if is_new:
            self.table.add(seq)
        committed, base, drafts = state
        out.accepted_drafts = self._count_accepted(drafts, base, s)
        if p < committed:
            seq.committed_len = p  # rollback: free of cost, the next writes overwrite
        return _Admitted(index, seq, is_new, s, k)

    def _make_room(self, seq: Sequence, is_new: bool, missing: int) -> str | None:
        """Make room for seq to take `missing` more blocks (and, when new, to exist): the quotas first, a
        namespace at its quota evicting its own idle sequences, then the global limits (--max-sequences, the pool),
        evicting idle sequences of any namespace. Idle: not named by this step; least recently used first. Returns
        the refusal message (RESOURCE_EXHAUSTED) when there is no room even so; None when seq fits."""
        t, lim, ns, serial = self.table, self.table.limits, seq.namespace, self._step_serial
        if is_new and lim.max_sequences_per_namespace:
            over = t.namespace_sequences(ns) + 1 - lim.max_sequences_per_namespace
            if over > 0 and not t.evict_idle(serial, sequences=over, namespace=ns, reason=EVICTED_FOR_NAMESPACE):
                t.counters.quota_refusals += 1
                return (f"quota: namespace {ns!r} holds {t.namespace_sequences(ns)} sequences, at most "
                        f"{lim.max_sequences_per_namespace} (--max-sequences-per-namespace), none of them idle; "
                        "release finished sequences")
        limit = t.namespace_block_limit
        if missing and limit is not None:
            over = t.namespace_blocks(ns) + missing - limit
            if over > 0 and not t.evict_idle(serial, blocks=over, namespace=ns, reason=EVICTED_FOR_NAMESPACE):
                t.counters.quota_refusals += 1
                return (f"quota: namespace {ns!r} holds {t.namespace_blocks(ns)} KV blocks and sequence "
                        f"{seq.sequence_id!r} needs {missing} more; the namespace's share is {limit} of "
                        f"{self.kv.pool.num_blocks} blocks (--namespace-pool-share {lim.namespace_pool_share:g}); "
                        "release finished sequences")
        if is_new and lim.max_sequences:
            over = len(t) + 1 - lim.max_sequences
            if over > 0 and not t.evict_idle(serial, sequences=over):
                t.counters.quota_refusals += 1
                return (f"quota: the drafter holds {len(t)} sequences, at most {lim.max_sequences} "
                        "(--max-sequences), none of them idle; release finished sequences or lower the load")
        free = self.kv.pool.num_free
        if missing > free and not t.evict_idle(serial, blocks=missing - free):
            t.counters.pool_refusals += 1
            return (f"KV pool full: sequence {seq.sequence_id!r} needs {missing} more blocks of {self.block_size} "
                    f"tokens, {self.kv.pool.num_free} free and too few held by idle sequences; release finished "
                    "sequences or lower the load")
        return None

    # ---- lifetime between steps (step thread: the scheduler calls these between batches) ----

    def expire_idle(self) -> int:
        """Free the sequences no step touched for the lease; cheap when none can be due yet."""
        if self.table.limits.lease_s <= 0:
            return 0
        now = self.clock()
        if now < self._expiry_due:
            return 0
        n = self.table.expire(now)
        self._expiry_due = self.table.expiry_due(now)
        if n:
            log.info("%d sequences expired (no step for %g s)", n, self.table.limits.lease_s)
            self._table_changed()
        return n

    def expiry_wait(self) -> float | None:
        """How long an idle step thread may sleep before a lease can run out; None: no lease or no sequence."""
        if self.table.limits.lease_s <= 0 or not len(self.table):
            return None
        return max(0.001, self._expiry_due - self.clock())

    def release_owner(self, owner: str) -> int:
        """Free the sequences a stream / step channel created, now that it has ended."""
        n = self.table.release_owner(owner)
        if n:
            log.info("freed %d sequences: the %s that created them closed", n, owner)
            self._table_changed()
        return n

    def _table_changed(self) -> None:
        self.metrics.live_sequences = len(self.table)
        self.metrics.kv_blocks_free = self.kv.pool.num_free

    def _count_accepted(self, drafts: list[int], base: int, s: StepInput) -> int:
        """Compare the drafts given last time (for positions base + 1, ...) with the committed tokens this step brings
        (acceptance metrics)."""
        p, m = s.start_position, s.num_tokens
        if not drafts or not (p <= base + 1 <= p + m):
            return 0
        committed = s.token_ids.tolist()  # (one conversion, not a tensor index per compared token)
        accepted = 0
        for i, d in enumerate(drafts, start=1):
            pos = base + i
            if pos > p + m:
                break
            tok = s.next_token if pos == p + m else committed[pos - p]
            if tok != d:
                break
            accepted += 1
        self.metrics.record_acceptance(len(drafts), accepted)
        return accepted

    def _fail_batch(self, batch: list[_Admitted], outputs: list[StepOutput], e: Exception) -> None:
        """A batch raised: every sequence in it gets INTERNAL, and none keeps KV the failed step may have touched:
        new sequences are dropped, the others only trust positions below this step's start (the engine re-sends
        from there)."""
        for a in batch:
            self._forget_failed_step(a.seq, a.step.start_position)
            if a.is_new:
                self.table.release(a.seq.namespace, a.seq.sequence_id)
            out = outputs[a.index]
            out.code = INTERNAL
            out.message = f"internal error in the draft step: {type(e).__name__}: {e}"
            out.accepted_drafts = 0

    def _forget_failed_step(self, seq: Sequence, start: int) -> None:
        """After a batch raised: seq trusts its KV only below the failed step's start (the engine re-sends from
        there) and gave no drafts."""
        seq.last_drafts = []
        seq.committed_len = min(seq.committed_len, start)
        if seq.shift_cache is not None:  # multi-layer: KV is only trusted below the final prefix
            seq.committed_len = min(seq.committed_len, seq.shift_cache.final_len)
        self.predraft.failed(seq)

    # ---- the step ----

    @torch.inference_mode()
    def step(self, steps: list[StepInput]) -> list[StepOutput]:
        """One engine step, one StepInput per sequence. A step of STEP_INPUTS_AS_COLUMNS_MIN sequences or more that
        step_batch would run from its columns (columns_may_take) runs there, as BatchInput.from_inputs, with the same
        answers (tests/test_step_batch.py): an engine calling the drafter in its own process with StepInputs at
        batch 128 of the 8B shapes on an H200 then took 3.29-3.56 against 3.92-4.03 ms per step (EAGLE-3, the fc
        by the engine) and 4.98-5.33 against 5.80-6.18 (EAGLE-1); any other step, and one the columns path
        declines, runs per sequence (step_per_sequence). An engine holding its batch as tensors calls step_batch,
        still the faster (2.70-2.76 and 4.09-4.32 ms there)."""
        if self.columns_may_take(steps):
            outputs = self._step_columns(BatchInput.from_inputs(steps))
            if outputs is not None:
                return outputs.to_outputs()
        return self.step_per_sequence(steps)

    def columns_may_take(self, steps: list[StepInput]) -> bool:
        """_fast_path_applies' rule (_columns_fit) read off the StepInputs before any column is built, for a step of
        at least STEP_INPUTS_AS_COLUMNS_MIN sequences."""
        if len(steps) < STEP_INPUTS_AS_COLUMNS_MIN:
            return False
        return self._columns_fit(len(steps), sum(s.token_ids.shape[0] for s in steps),
                                 any(s.temperature or s.return_logprobs or s.top_k_probs for s in steps),
                                 any(s.predraft_branches for s in steps))

    @torch.inference_mode()
    def step_per_sequence(self, steps: list[StepInput]) -> list[StepOutput]:
        """The step sequence by sequence: each one's admission, status, metadata and answer of its own (new
        sequences, pre-drafting, sampling, log-probabilities and top-N in small steps, a step the columns
        decline)."""
        t0 = time.perf_counter()
        outputs = [StepOutput() for _ in steps]
        # Touch every sequence of the step before admitting any: admission may evict idle sequences, and these are
        # not idle (sequence.py: the touched ones form the tail of the LRU order).
        self._step_serial += 1
        now, serial = self.clock(), self._step_serial
        found, rows = self.table.touch_batch([s.namespace for s in steps], [s.sequence_id for s in steps], now, serial)
        # The known sequences' state, read for the whole step at once; a step that names a sequence twice reads it
        # sequence by sequence (each of its steps at its own admission, after the one before).
        distinct = self.table.distinct(rows)  # (no known sequence named twice)
        if distinct and rows.shape[0] != len(steps):  # (nor a new one: its second step finds the first one's sequence)
            new = [(s.namespace, s.sequence_id) for s, seq in zip(steps, found) if seq is None]
            distinct = len(set(new)) == len(new)
        if distinct:
            known = iter(self.table.rows.read_steps(rows))
            states = [None if seq is None else next(known) for seq in found]
        else:
            states = [None] * len(steps)
        get = self.table.get  # (a new sequence named twice: its later steps find the sequence its first one added)
        batch = [a for i, s in enumerate(steps)
                 if (a := self._admit(i, s, outputs[i],
                                      found[i] if found[i] is not None else get(s.namespace, s.sequence_id), now,
                                      states[i])) is not None]
        self.predraft.on_step()
        refused = False  # by the odds check: this batch keeps nothing for a pass
        if self.fatal is None and any(a.seq.predraft is not None or a.step.predraft_branches for a in batch):
            asking = sum(1 for a in batch if a.step.predraft_branches)
            if asking:  # whether this batch's pass can pay: all its pre-drafting sequences must hit next time
                refused = not self.predraft.odds.decide(asking)
            # a hit is answered from the branches prepared during the verification: nothing to run
            batch = [a for a in batch if not self.predraft.admit(a, outputs[a.index])]
        if batch and self.fatal is not None:
            for a in batch:
                outputs[a.index].code = UNAVAILABLE
                outputs[a.index].message = f"the drafter is broken ({self.fatal}) and waits to be restarted"
                if a.is_new:
                    self.table.release(a.seq.namespace, a.seq.sequence_id)
        elif batch:
            try:
                drafts, logprobs, top_ids, top_probs, features = self._run(batch)
            except Exception as e:  # never leave a sequence claiming KV it may not have
                log.exception("step failed")
                self._fail_batch(batch, outputs, e)
                self._step_failed(e)
            else:
                self._failed_in_a_row = 0
                ends = [a.step.start_position + a.step.num_tokens for a in batch]
                if distinct:  # the sequences' state, for the whole step
                    self.table.rows.write_steps([a.seq.table_row for a in batch], ends, drafts)
                else:  # (a sequence named twice: in order, the later step's state last)
                    for a, end, d in zip(batch, ends, drafts):
                        a.seq.committed_len = a.seq.last_drafts_base = end
                        a.seq.last_drafts = d
                predrafting = []
                for i, (a, end, d, lp, ti, tp) in enumerate(zip(batch, ends, drafts, logprobs, top_ids, top_probs)):
                    out = outputs[a.index]
                    out.drafts, out.committed_length = d, end
                    out.logprobs = lp if a.step.return_logprobs else []
                    out.top_k_ids, out.top_k_probs = ti, tp
                    if not refused and a.seq.predraft is not None:
                        predrafting.append((a, d, features.get(i)))
                if predrafting:
                    self.predraft.after_step(predrafting)
                elif refused:
                    self.predraft.counters.refused_by_odds += 1
        self.metrics.record_step(steps, outputs, time.perf_counter() - t0, self.kv.pool.num_free,
                                 self.kv.pool.num_blocks)
        self.metrics.live_sequences = len(self.table)
        return outputs

    # ---- the step from columns (batch_io.py): the common step without a Python object per sequence ----

    @torch.inference_mode()
    def step_batch(self, b: BatchInput, early: "Callable[[BatchOutput], None] | None" = None) -> BatchOutput:
        """One engine step given as columns. The common step (known sequences, a sequential head, no pre-drafting,
        at least STEP_BATCH_MIN_SEQUENCES sequences or more than SMALL_STEP_ROWS committed rows, or any greedy step
        where first-step graphs run: takes_columns) runs from the columns: the checks,
        the acceptance count, the step metadata and the reply are array ops over the batch, and the only work per
        sequence is the table lookup and a few attribute reads and writes in list comprehensions. Any other step
        (or one where a check fails: then the per-sequence path works out each sequence's own status) runs as
        Proposer.step_per_sequence of b.to_inputs(); the answers are the same either way (tests/test_step_batch.py).

        early: on the columns path, called with the step's answer before its drafts are known (drafts None), while
        the GPU drafts on CUDA: the object returned is that one, its drafts filled in, unless the step failed (a new
        one then). A caller encodes there what of its reply needs no draft (scheduler.py, step_channels.py). A step
        that asks for log q or top-N is answered after its drafts, one StepOutput per sequence (early not called)."""
        outputs = self._step_columns(b, early) if self._fast_path_applies(b) else None
        return outputs if outputs is not None else BatchOutput.from_outputs(self.step_per_sequence(b.to_inputs()))

    def takes_columns(self, num_sequences: int, num_tokens: int) -> bool:
        """Whether a step of this size goes step_batch's columns way (given as columns, greedy where it is small):
        from STEP_BATCH_MIN_SEQUENCES sequences, or from one where the first step replays a graph (cuda_graphs.py).
        There the columns path's host work before the replay is the shorter one at every size (dev CPU, the replays
        stubbed, EAGLE-3 tiny head, medians over four rounds: 121-122 against 144-150 us at 1 sequence, 212-218
        against 385-394 at 4; the host work after the drafts 55 against 51-53 and 90-95 against 111-114), and its
        acceptance count runs while the GPU drafts."""
        graphs = self.decode_graphs
        least = 1 if graphs is not None and graphs.first_step_tokens > 0 else STEP_BATCH_MIN_SEQUENCES
        return large_enough_for_columns(num_sequences, num_tokens, least)

    def _fast_path_applies(self, b: BatchInput) -> bool:
        """What the columns tell alone (no table lookup yet): _columns_fit."""
        a = b.arrays  # (numpy views: a torch op on a small CPU tensor costs several microseconds, a numpy one about one)
        nonzero = np.count_nonzero  # (a C call: a quarter of ndarray.any()'s cost at these sizes, ~0.3 against 1.3-1.9 us)
        return self._columns_fit(len(b), b.total_tokens,
                                 bool(nonzero(a.temperatures) or nonzero(a.return_logprobs) or nonzero(a.top_k_probs)),
                                 bool(nonzero(a.predraft_branches)))

    def _columns_fit(self, n: int, T: int, sampled: bool, extras: bool) -> bool:
        """Whether a step of n sequences and T committed rows may run from its columns, by what its inputs tell alone:
        a sequential head and a working drafter, a size that takes_columns, greedy unless the step is large enough
        (sampled: some temperature above 0, log q or top-N; a small sampling step builds its metadata on the host,
        where the per-sequence way is cheaper), and no pre-drafting (extras)."""
        return (self.fatal is None and self.model.drafting == "sequential" and n > 0 and self.takes_columns(n, T)
                and (large_enough_for_columns(n, T) or not sampled) and not extras)

    def _step_columns(self, b: BatchInput, early=None) -> BatchOutput | None:
        """step_batch's columnar path, for a step whose inputs the caller found fit (_fast_path_applies, or
        columns_may_take before the columns were built: the rule is checked once); None (having changed nothing a
        step would not) where the sequences' state says no (pre-drafting, a gap, no room, a new sequence that the
        columns cannot start: _start_sequences)."""
        t0 = time.perf_counter()
        self._step_serial += 1
        now, serial = self.clock(), self._step_serial
        seqs, rows = self.table.touch_batch(b.namespaces, b.sequence_ids, now, serial)
        new: list[int] = []  # the step's new sequences (their first step), given rows but not yet members
        if rows.shape[0] != len(seqs):
            started = self._start_sequences(b, seqs, now, serial)
            if started is None:
                return None  # the per-sequence path
            seqs, rows, new = started
        B = len(seqs)
        admitted = self._admit_columns(b, rows)
        if admitted is None:
            self._unstart(seqs, new)
            return None
        C, k, needed, blocks, have = admitted
        R = self.table.rows
        nonzero = np.count_nonzero  # (for any(): _fast_path_applies)
        a = b.arrays
        p, m = a.start_positions, a.num_tokens
        # ---- blocks: the sequences whose table changes size (at batch 128, m = 3, 16-token blocks: ~22 a step) ----
        resized = blocks != have
        if nonzero(resized) and not self._resize_columns(b, seqs, rows, needed, blocks, have, np.flatnonzero(resized),
                                                          starting=bool(new)):
            self._unstart(seqs, new)
            return None  # the pool or a quota refuses: the per-sequence path gives each its status
        for i in new:
            self.table.add(seqs[i])  # (after the step's touches: the most recently used, as on the per-sequence path)
        # ---- run ----
        k_t = torch.from_numpy(k)
        self.predraft.on_step()
        # log q or top-N asked: the answer is one StepOutput per sequence (built after the drafts; no early reply)
        described = bool(nonzero(a.return_logprobs) or nonzero(a.top_k_probs))
        if described:
            early = None
        # the acceptance count, and with it the whole answer but the drafts, needs nothing of the run: on CUDA it is
        # done while the GPU drafts (_Drafts.meanwhile), and so is the caller's early work
        answer = []
        step_drafts = _Drafts(B, a.top_k_probs.tolist() if described else [0] * B)

        marks = self.phase_marks

        def meanwhile():
            if marks is not None:
                marks["launched"] = time.perf_counter()
            accepted = self._count_accepted_columns(rows, b, C)
            answer.append(BatchOutput(codes=torch.from_numpy(np.zeros(B, dtype=np.int32)), messages=[""] * B,
                                      num_drafts=k_t, accepted_drafts=torch.from_numpy(accepted),
                                      committed_lengths=torch.from_numpy(C)))
            if early is not None:
                try:
                    early(answer[0])
                except Exception:  # (the caller's: never the step's failure; it then encodes after the step)
                    log.exception("early reply work failed")
        step_drafts.meanwhile = meanwhile
        if marks is not None:
            marks["admitted"] = time.perf_counter()
        try:
            tables = R.block_tables_np[rows, : int(blocks.max())]
            greedy = not nonzero(a.temperatures > 0) and not described
            plan, sampling = self._columns_plan(b, C, k)
            if plan is not None:
                # the first step's rows are built on the device, inside its graph (cuda_graphs.py): no step metadata
                self.decode_graphs.draft_columns(plan, p, m, a.token_ids, a.next_tokens, k, tables, b.states(),
                                                 step_drafts, sampling)
            else:
                md = build_step_metadata_columns(
                    p, m, a.token_ids, b.states(), a.next_tokens, k, tables, a.temperatures, a.seeds,
                    a.top_k_probs if described else np.zeros(B, dtype=np.int64), self.block_size, self.device,
                    self.metadata_buffers)
                sp = SamplingSettings(temperature=md.temperature, seed=md.seed, top_k=md.top_k,
                                      want_logprobs=bool(nonzero(a.return_logprobs)), greedy_only=greedy,
                                      width=int(a.top_k_probs.max()) if described else 0,
                                      any_hot=bool(nonzero(a.temperatures > 0)))
                self._draft_sequential(md, sp, step_drafts, None)
            drafts = step_drafts.as_tensor()
            if marks is not None:
                marks["synced"] = time.perf_counter()
            step_drafts.run_meanwhile()  # (where no graph ran it)
        except Exception as e:  # never leave a sequence claiming KV it may not have
            log.exception("step failed")
            with contextlib.suppress(Exception):  # (counted either way; never in the way of the rollback)
                step_drafts.run_meanwhile()
            for seq, start in zip(seqs, p.tolist()):  # (p: numpy)
                self._forget_failed_step(seq, start)  # (rare: one sequence at a time)
            for i in new:  # (as the per-sequence path's _fail_batch: a new sequence keeps nothing)
                self.table.release(seqs[i].namespace, seqs[i].sequence_id)
            self._step_failed(e)
            failed = BatchOutput.failed(B, INTERNAL, f"internal error in the draft step: {type(e).__name__}: {e}")
            self._record_columns(b, failed, time.perf_counter() - t0)
            return failed
        self._failed_in_a_row = 0
        self.columns_steps_run += 1
        out = answer[0]
        out.drafts = drafts
        if described:
            out = self._described_outputs(out, step_drafts, a.return_logprobs)
        # ---- the sequences' state after the step: their rows' columns ----
        R.write_step_columns(rows, C, drafts.numpy(), k)
        self.metrics.record_step_totals(B, b.total_tokens, int(k.sum()), time.perf_counter() - t0,
                                        self.kv.pool.num_free, self.kv.pool.num_blocks)  # (every sequence drafted)
        self.metrics.live_sequences = len(self.table)
        return out

    @staticmethod
    def _described_outputs(out: BatchOutput, drafts: _Drafts, return_logprobs: np.ndarray) -> BatchOutput:
        """A columns step that asked for log q or top-N answered as one StepOutput per sequence (as the per-sequence
        path answers it: log q for the sequences that asked, top-N [k, N] for those with N > 0)."""
        tokens, logprobs, top_ids, top_probs = drafts.finish()
        wants = return_logprobs.tolist()
        return BatchOutput.from_outputs([
            StepOutput(drafts=d, logprobs=lp if want else [], top_k_ids=ti, top_k_probs=tp, accepted_drafts=acc,
                       committed_length=cl)
            for d, lp, want, ti, tp, acc, cl in zip(tokens, logprobs, wants, top_ids, top_probs,
                                                    out.accepted_drafts.tolist(), out.committed_lengths.tolist())])

    def _start_sequences(self, b: BatchInput, seqs: list[Sequence | None], now: float, serial: int):
        """The step's new sequences (None in seqs: an engine's new requests, their prompts' first step beside the
        others' decode steps, which at batch 128 is most steps) given rows of their own, so that the step runs from its
        columns with them: (seqs, rows, new) with every entry filled (new: their indices in the step), the new ones
        not members of the table until their blocks are taken (_step_columns adds them; _unstart undoes this). Only
        where nothing about them may refuse or evict: the drafter is not draining, each starts at position 0 and is
        named once, and the sequence limits (--max-sequences, per namespace) hold them as they are; their blocks go
        with the others' growth, in one call or not at all (_resize_columns with starting). None, with nothing
        changed, otherwise: the per-sequence path then admits each (its statuses, its evictions)."""
        new = [i for i, seq in enumerate(seqs) if seq is None]  # (the new ones only: a few a step)
        if self.draining or np.count_nonzero(b.arrays.start_positions[new]):
            return None  # UNAVAILABLE, or NOT_FOUND / a sequence gone: the per-sequence path names it
        keys = [(b.namespaces[i], b.sequence_ids[i]) for i in new]
        if len(set(keys)) != len(keys):
            return None
        t, lim = self.table, self.table.limits
        if lim.max_sequences and len(t) + len(new) > lim.max_sequences:
            return None
        if lim.max_sequences_per_namespace and any(
                t.namespace_sequences(ns) + n > lim.max_sequences_per_namespace
                for ns, n in Counter(ns for ns, _ in keys).items()):
            return None
        R, seqs = t.rows, list(seqs)
        for i, (ns, sequence_id) in zip(new, keys):
            seq = Sequence(ns, sequence_id, owner=b.owners[i], last_used=now, last_step=serial)
            seq.take_row(R, R.assign())
            seqs[i] = seq
        rows = np.fromiter([seq.table_row for seq in seqs], dtype=np.int64, count=len(seqs))
        return seqs, rows, new

    def _unstart(self, seqs: list[Sequence], new: list[int]) -> None:
        """Give back the rows _start_sequences gave the step's new sequences (before any block was taken)."""
        R = self.table.rows
        for i in new:
            R.release(seqs[i].give_row_back())

    def _admit_columns(self, b: BatchInput, rows: np.ndarray):
        """The columns path's admission arithmetic, which reads the sequences' rows and changes nothing: None where
        the per-sequence path must take the step (a sequence that pre-drafts or is named twice, a position out of
        range, a gap), else ([B] int64 each, numpy) C = p + m the committed length after the step, k the drafts after
        the max_model_len cut, needed the positions the step writes KV for, blocks the blocks that takes, and have
        the blocks held now. (_step_columns and rehearse_columns.)"""
        # The sequences' state is read and written as columns by table row (sequence_rows.py), and the batch
        # arithmetic below is numpy over views of the step's columns: some twenty ops on [B] arrays, each about a
        # microsecond where a torch op on a small CPU tensor costs several.
        R = self.table.rows
        nonzero = np.count_nonzero  # (for any(): _fast_path_applies)
        if nonzero(R.predrafting[rows]) or not self.table.distinct(rows):
            return None  # a sequence that pre-drafts, or one named twice: the per-sequence path
        a = b.arrays
        p = a.start_positions
        C = p + a.num_tokens  # [B] committed length after the step
        committed, have = R.committed_len[rows], R.num_blocks[rows]
        if nonzero(C >= self.max_model_len) or nonzero(p > committed):
            return None  # OUT_OF_RANGE or a gap: the per-sequence path names it
        k = np.maximum(np.minimum(a.num_drafts, self.max_model_len - 1 - C), 0)  # [B] after the cut
        needed = C + np.maximum(k - 1, 0)  # positions the step writes KV for (scratch KV of all drafts but the last)
        bs = self.block_size
        return C, k, needed, (needed + bs - 1) // bs, have

    def _resize_columns(self, b: BatchInput, seqs: list[Sequence], rows: np.ndarray, needed: np.ndarray,
                        blocks: np.ndarray, have: np.ndarray, idx: np.ndarray, starting: bool = False) -> bool:
        """The block tables of the step's sequences idx ([n] int64, indices into the step) resized from have to
        blocks ([B] int64 each; needed: the positions they cover). Where GROW_IN_ONE_CALL_MIN or more grow and the
        pool and the namespaces' shares hold their growth as they are (a decode step's usual case at batch 32 and
        up), the growing ones take their blocks in one call (SequenceTable.grow_rows: the blocks a resize of each in
        turn would take, in one allocation and one array write) and any shrinking ones give theirs back after it
        (rare; the free list ends as the one-at-a-time way leaves it, as the growth takes none of what they give
        back). Otherwise one sequence at a time, making room as the per-sequence path does (_make_room may evict
        idle sequences). False where the pool or a quota refuses (the sequences before the refused one keep their
        blocks, as after the per-sequence path's refusal). starting: the step starts new sequences
        (_start_sequences): one call whatever the number, and False with nothing changed where it cannot be one."""
        more = blocks[idx] - have[idx]  # [n] blocks each takes (< 0: gives back)
        grows = more > 0
        grow = idx if grows.all() else idx[grows]
        by_namespace = None
        if grow.shape[0] >= GROW_IN_ONE_CALL_MIN or starting:
            if grow is not idx:
                more = more[grows]
            by_namespace = self._growth_fits(b.namespaces, grow, more)
        if by_namespace is not None and self.table.grow_rows(rows[grow], have[grow], more, by_namespace):
            if grow is not idx:
                for i in idx[~grows].tolist():
                    self.table.resize(seqs[i], int(needed[i]))  # (a shrink always succeeds)
            return True
        if starting:
            return False  # (the per-sequence path makes room for its new sequences: nothing was taken here)
        for i in idx.tolist():
            seq, missing = seqs[i], int(blocks[i] - have[i])
            if missing > 0 and self._make_room(seq, False, missing) is not None:
                return False
            if not self.table.resize(seq, int(needed[i])):
                return False
        return True

    def _growth_fits(self, namespaces: list[str], idx: np.ndarray, more: np.ndarray) -> dict[str, int] | None:
        """The blocks each namespace takes when the step's sequences idx grow by more ([n] int64) blocks, where
        the pool's free blocks and every namespace's share hold them without evicting anything (then _make_room
        would pass each of them in turn, changing nothing); None otherwise."""
        total = int(more.sum())
        if total > self.kv.pool.num_free:
            return None
        first = namespaces[0]
        if namespaces.count(first) == len(namespaces):  # one namespace (one engine's step): the common case
            by_namespace = {first: total}
        else:
            by_namespace = {}
            for i, n in zip(idx.tolist(), more.tolist()):
                by_namespace[namespaces[i]] = by_namespace.get(namespaces[i], 0) + n
        limit = self.table.namespace_block_limit
        if limit is not None and any(self.table.namespace_blocks(ns) + n > limit for ns, n in by_namespace.items()):
            return None
        return by_namespace

    def rehearse_columns(self, b: BatchInput) -> bool:
        """The host work of _step_columns before its launches, on a step already run (the drafter's rehearsal of its
        last request while it waits for the next: transport/step_channels.py ChannelSet.rehearse), with nothing
        changed and nothing sent to the device: the table lookup (without marking the sequences used), the
        admission, the acceptance count (not recorded), the block tables' gather and, where a first-step graph would
        replay, the record's host copy (FirstStepRecord.write without its copy). Work that last ran milliseconds ago
        runs several times slower than warm on the hosts measured (docs/performance.md). Step thread only. Whether
        it ran: False where the step would not take the columns path now. Where some of its sequences are gone
        since (released: under continuous batching one finishes most steps), the others' step is rehearsed
        (BatchInput.take), if that one would take the columns path."""
        if not self._fast_path_applies(b):
            return False
        keep, rows = self.table.known_rows(b.namespaces, b.sequence_ids)
        if keep is not None:  # (some are gone since)
            if keep.shape[0] == 0:
                return False
            b = b.take(keep)
            if not self._fast_path_applies(b):
                return False
        admitted = self._admit_columns(b, rows)
        if admitted is None:
            return False
        C, k, _, blocks, _ = admitted
        self.columns_rehearsals += 1
        self._count_accepted_columns(rows, b, C, record=False)
        a = b.arrays
        tables = self.table.rows.block_tables_np[rows, : int(blocks.max())]
        if self._columns_plan(b, C, k)[0] is not None:
            self.decode_graphs.rehearse_columns(a.start_positions, a.num_tokens, a.token_ids, a.next_tokens, k, tables)
        return True

    def _columns_plan(self, b: BatchInput, C: np.ndarray,
                      k: np.ndarray) -> tuple[FirstStepPlan | None, GraphSampling | None]:
        """The first-step graph a columns step replays (DecodeGraphs.first_step_plan, prompt chunks of k = 0
        included) and, for a sampling step (a temperature above 0, log q or top-N), its settings for the sampled
        graphs; (None, None) where its first step runs eagerly (no graphs, no sampled graph for its top-N): what
        _step_columns runs and rehearse_columns rehearses. C, k: [B] the committed lengths and drafts after
        admission."""
        graphs, a, nonzero = self.decode_graphs, b.arrays, np.count_nonzero
        if graphs is None:
            return None, None
        sampling = None
        if nonzero(a.temperatures > 0) or nonzero(a.return_logprobs) or nonzero(a.top_k_probs):
            sampling = graphs.graph_sampling(a.temperatures, a.seeds, a.top_k_probs, bool(nonzero(a.return_logprobs)))
            if sampling is None:
                return None, None
        plan = graphs.first_step_plan(C, a.num_tokens, k, prefill_chunks=True)
        return plan, sampling if plan is not None else None

    def _count_accepted_columns(self, rows: np.ndarray, b: BatchInput, C: np.ndarray,
                                record: bool = True) -> np.ndarray:
        """[B] int64: _count_accepted for every sequence at once (the drafts given at its last step, n of them for
        positions base + 1, ..., against the committed tokens this step brings), recorded in the acceptance
        metrics (record False: not; rehearse_columns). rows: [B] the sequences' table rows; C: [B] p + m (numpy
        int64)."""
        R = self.table.rows
        n, base = R.num_drafts[rows], R.drafts_base[rows]
        B, K = rows.shape[0], int(n.max())
        if K == 0:
            return np.zeros(B, dtype=np.int64)
        given = R.drafts[rows, :K]  # [B, K]: entries past a row's n are not its drafts (masked below)
        a = b.arrays
        p, m = a.start_positions, a.num_tokens
        evaluated = (n > 0) & (p <= base + 1) & (base + 1 <= C)  # [B] (_count_accepted's condition)
        pos = base[:, None] + np.arange(1, K + 1)  # [B, K] position of each given draft
        qsl = np.cumsum(m) - m  # [B] first row of each sequence in token_ids
        rows_in = np.minimum(np.maximum(qsl[:, None] + pos - p[:, None], 0), b.total_tokens - 1)
        truth = np.where(pos < C[:, None], a.token_ids[rows_in], a.next_tokens[:, None])  # committed
        match = (pos <= C[:, None]) & (truth == given) & (np.arange(K) < n[:, None])
        accepted = np.cumprod(match, axis=1).sum(1) * evaluated
        if record and evaluated.any():
            self.metrics.record_acceptance_columns(n[evaluated], accepted[evaluated])
        return accepted

    def _step_failed(self, e: Exception) -> None:
        """A batch raised: count it, and give up on the step worker after a sticky device error or too many."""
        self._failed_in_a_row += 1
        sticky = unrecoverable(e)
        if sticky or self._failed_in_a_row >= MAX_FAILED_BATCHES_IN_A_ROW:
            self.fatal = (f"{type(e).__name__}: {e}" if sticky else
                          f"{self._failed_in_a_row} batches failed in a row, the last with "
                          f"{type(e).__name__}: {e}")
            log.critical("the step worker cannot go on: %s; health NOT_SERVING", self.fatal)
            self.metrics.step_worker_broken = True
            self.on_fatal(self.fatal)

    def _record_columns(self, b: BatchInput, out: BatchOutput, seconds: float) -> None:
        self.metrics.record_step_columns(b.num_tokens, out.codes, out.num_drafts, seconds, self.kv.pool.num_free,
                                         self.kv.pool.num_blocks)
        self.metrics.live_sequences = len(self.table)

    def _slots(self, seq: Sequence, positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _block_tables(self, batch: list[_Admitted]) -> torch.Tensor:
        """[n, the most blocks of any] int32: the batch's block tables, from their table rows (zeros past each one's
        blocks, as a row keeps them)."""
        return self.table.rows.gather([a.seq.table_row for a in batch], max(a.seq.num_blocks for a in batch))

    def _sampling(self, batch: list[_Admitted], md: StepMetadata | None = None) -> SamplingSettings:
        dev = self.device
        top_k = [a.step.top_k_probs for a in batch]
        want_logprobs = any(a.step.return_logprobs for a in batch)
        any_hot = any(a.step.temperature > 0 for a in batch)
        greedy_only = not want_logprobs and not any(top_k) and not any_hot
        width = max(top_k, default=0)
        if md is not None:  # ---- the step's packed metadata (step_metadata.py) holds the tensors: no copy ----
            return SamplingSettings(temperature=md.temperature, seed=md.seed, top_k=md.top_k,
                                    want_logprobs=want_logprobs, greedy_only=greedy_only, width=width,
                                    any_hot=any_hot)
        return SamplingSettings(
            temperature=torch.tensor([a.step.temperature for a in batch], dtype=torch.float32).to(dev),
            seed=torch.tensor([seed_to_int64(a.step.seed) for a in batch], dtype=torch.int64).to(dev),
            top_k=torch.tensor(top_k, dtype=torch.int64).to(dev), want_logprobs=want_logprobs,
            greedy_only=greedy_only, width=width, any_hot=any_hot)

    def _select(self, logits: torch.Tensor, rows: list[int], positions: list[int], sp: SamplingSettings) -> DraftSample:
        """One draft per row of logits [n, V_draft] (row r belongs to batch index rows[r]; positions[r] is the
        Gumbel position), as target-vocabulary ids, with log q and the top-N of q when asked."""
        if sp.greedy_only:
            return DraftSample(self.model.draft_to_target(ops.argmax(logits)), None, None, None)
        # (non_blocking: a blocking copy would wait for the forward before it to finish; the sources are fresh)
        idx = torch.tensor(rows).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        s = sample_drafts(logits, sp.temperature[idx], sp.seed[idx], pos, sp.top_k[idx], sp.want_logprobs,
                          width=sp.width, any_hot=sp.any_hot)
        top_ids = s.top_ids
        if top_ids is not None:
            top_ids = torch.where(top_ids >= 0, self.model.draft_to_target(top_ids.clamp(min=0)), -1)
        return DraftSample(self.model.draft_to_target(s.tokens), s.logprobs, top_ids, s.top_probs)

    def _run(self, batch: list[_Admitted]):
        drafting = self.model.drafting
        if drafting == "sequential":
            drafts = self._run_sequential(batch)
        elif drafting == "parallel":
            drafts = self._run_parallel(batch)
        elif drafting == "multi_layer":
            drafts = self._run_multi_layer(batch)
        else:
            raise ValueError(f"unknown drafting structure {drafting!r}")
        return (*drafts.finish(), drafts.features)

    # ---- sequential: first step over the committed rows, then one row per further draft ----

    def _run_sequential(self, batch: list[_Admitted]) -> _Drafts:
        out = _Drafts(len(batch), [a.step.top_k_probs for a in batch])
        predrafting = [a.seq.predraft is not None for a in batch]
        # ---- CUDA fast path (cuda_graphs.py): a batch of small m replays the first step from a graph too, which
        # builds its rows from the step's columns: no step metadata (a sampling step where a sampled graph holds its
        # top-N) ----
        graphs = self.decode_graphs
        sampling = self._graph_sampling(batch) if graphs is not None else False
        if sampling is not False:
            p = np.array([a.step.start_position for a in batch], dtype=np.int64)
            m = np.array([a.step.token_ids.shape[0] for a in batch], dtype=np.int64)
            k = np.array([a.num_drafts for a in batch], dtype=np.int64)
            plan = graphs.first_step_plan(p + m, m, k)
            if plan is not None:
                rows = [a.seq.table_row for a in batch]
                tables = self.table.rows.block_tables_np[rows, : int(self.table.rows.num_blocks[rows].max())]
                graphs.draft_columns(plan, p, m, torch.cat([a.step.token_ids for a in batch]).numpy(),
                                     np.array([a.step.next_token for a in batch], dtype=np.int64), k, tables,
                                     [a.step.hidden_states for a in batch], out, sampling)
                return self._keep_graph_features(predrafting, list(range(len(batch))), k.tolist(), out)
        # ---- step metadata (step_metadata.py): vectorized on the host, one host->device copy for the step ----
        md = StepMetadata.build(batch, self.block_size, self.device, self.table.rows, self.metadata_buffers)
        sp = self._sampling(batch, md)
        return self._draft_sequential(md, sp, out, predrafting)

    def _graph_sampling(self, batch: list[_Admitted]) -> "GraphSampling | None | bool":
        """For the first-step graphs: None (a greedy step), the settings of a sampling step for the sampled graphs,
        or False where no sampled graph holds its top-N."""
        if all(a.step.temperature <= 0 and not a.step.return_logprobs and not a.step.top_k_probs for a in batch):
            return None
        sampling = self.decode_graphs.graph_sampling(
            np.array([a.step.temperature for a in batch], dtype=np.float32),
            np.array([seed_to_int64(a.step.seed) for a in batch], dtype=np.int64),
            np.array([a.step.top_k_probs for a in batch], dtype=np.int64), any(a.step.return_logprobs for a in batch))
        return False if sampling is None else sampling

    def _draft_sequential(self, md: StepMetadata, sp: SamplingSettings, out: _Drafts,
                          predrafting: list[bool] | None) -> _Drafts:
        """The first draft step over the committed rows, then one row per further draft (greedy steps replay CUDA
        graphs where they can). predrafting: per batch index, whether the sequence pre-drafts (its features are kept
        for the forced pass); None: none does."""
        dev = self.device
        meta, seq_lens, block_tables = md.first_step, md.host_seq_lens, md.host_block_tables
        # CPU: the first step's gathered context is kept for the decode steps (the same sequences, one more position
        # each step), which then re-gather only their newest block
        context_cache = {} if dev.type == "cpu" else None
        meta.context_cache = context_cache
        hidden_in = self.model.combine_hidden_states(md.hidden_states)
        head_out = self.model.forward(md.input_ids, hidden_in, meta, self.kv_layers)

        # -- drafts: only sequences that asked for some (k = 0 is a prefill chunk) --
        ks = md.num_drafts
        active = list(md.active)  # batch indices still drafting
        if not active:
            return out
        last_rows = md.draft_rows  # [n] on the device
        head_last = head_out[last_rows]  # [n, H]
        sample = self._select(self.model.compute_logits(head_last), active, [seq_lens[i] for i in active], sp)
        # ---- CUDA fast path (cuda_graphs.py): greedy decode steps replayed from CUDA graphs, one copy to host ----
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(md):
            width = None if sp.greedy_only else graphs.sampled_width(sp.width)  # (sampling: the sampled graphs)
            if sp.greedy_only or width is not None:
                return self._keep_graph_features(
                    predrafting, md.active, md.num_drafts,
                    graphs.draft(md, out, sample, self.model.next_hidden(head_last), sp, width))
        # ---- end CUDA fast path ----
        out.add(active, sample)
        tok, hidden_prev = sample.tokens, self.model.next_hidden(head_last)
        # pre-drafting: with one k for every drafting sequence the features g_0..g_{k-1} of the decode rows are kept
        # for its forced pass (predraft.py), which then needs to run only the row of draft k
        features = [hidden_prev] if self._keeps_features(predrafting, active, ks) else None
        # decode steps j = 1..k-1: one row per sequence still drafting, at position C-1+j; the rows' block tables
        # and base positions are tensors, narrowed only when a sequence's k runs out
        ks_t = torch.tensor(ks)
        act = torch.tensor(active)  # batch indices of the rows
        base = torch.tensor(seq_lens, dtype=torch.int64)[act] - 1  # [n] C-1 of each row
        tables = block_tables[act]  # [n, max_blocks] int32, host
        tables_dev = tables.to(dev)
        bs = self.block_size
        for j in range(1, max(ks)):
            keep = ks_t[act] > j
            if not bool(keep.all()):
                sel = keep.nonzero().squeeze(1)
                tok, hidden_prev = tok[sel.to(dev)], hidden_prev[sel.to(dev)]
                act, base, tables = act[sel], base[sel], tables[sel]
                tables_dev = tables.to(dev)
                active = act.tolist()
            n = act.shape[0]
            positions = base + j
            slot = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1).to(torch.int64) * bs + positions % bs
            meta = AttentionMetadata(
                positions=positions.to(dev), slot_mapping=slot.to(dev),
                query_start_loc=torch.arange(n + 1, dtype=torch.int32).to(dev),
                seq_lens=(positions + 1).to(torch.int32).to(dev),
                block_tables=tables_dev, max_query_len=1, context_cache=context_cache)
            step_out = self.model.forward(tok, hidden_prev, meta, self.kv_layers)
            sample = self._select(self.model.compute_logits(step_out), active, (positions + 1).tolist(), sp)
            out.add(active, sample)
            tok, hidden_prev = sample.tokens, self.model.next_hidden(step_out)
            if features is not None:
                features.append(hidden_prev)
        if features is not None:  # g_0 and the k-1 decode rows' outputs
            kept = torch.stack(features, 1)  # [n, k, H]: g_0..g_{k-1} of the drafting sequences, in active order
            out.features = {i: kept[r] for r, i in enumerate(active) if predrafting[i]}
        return out

    def _keeps_features(self, predrafting: list[bool] | None, active: list[int], ks: list[int]) -> bool:
        """Whether this step keeps its pre-drafting sequences' features g_0..g_{k-1} for their forced pass: one k
        (ks, by batch index) for every drafting sequence (active), and passes over their number worth preparing."""
        if predrafting is None:
            return False
        n = sum(predrafting[i] for i in active)
        return n > 0 and len({ks[i] for i in active}) == 1 and self.predraft.worth_preparing(n)

    def _keep_graph_features(self, predrafting: list[bool] | None, active: list[int], ks: list[int],
                             out: _Drafts) -> _Drafts:
        """After the graphs drafted a step of uniform k (ks: k by batch index; active: the drafting batch indices, in
        row order): the pre-drafting sequences' features g_0..g_{k-1}, for their forced pass (as the eager loop keeps
        them)."""
        if self._keeps_features(predrafting, active, ks):
            kept = self.decode_graphs.kept_features(len(active), ks[active[0]])
            out.features = {i: kept[r] for r, i in enumerate(active) if predrafting[i]}
        return out

    # ---- parallel (P-EAGLE): the committed rows and k-1 masked rows in one forward ----

    def _run_parallel(self, batch: list[_Admitted]) -> _Drafts:
        dev, model = self.device, self.model
        B = len(batch)
        sp = self._sampling(batch)
        ks = [a.num_drafts for a in batch]
        n_slots = [max(k, 1) for k in ks]  # the bonus row (always: it writes the KV of position C-1) + k-1 masked
        C = [a.step.start_position + a.step.num_tokens for a in batch]
        q_lens = [a.step.num_tokens for a in batch]
        qsl = [0]
        for m in q_lens:
            qsl.append(qsl[-1] + m)
        layout = copy_and_expand_inputs_ref(
            target_token_ids=torch.cat([a.step.token_ids for a in batch]),
            target_positions=torch.cat([torch.arange(a.step.start_position, c, dtype=torch.int64)
                                        for a, c in zip(batch, C)]),
            next_token_ids=torch.tensor([a.step.next_token for a in batch], dtype=torch.int64),
            query_start_loc=torch.tensor(qsl), query_end_loc=torch.tensor(qsl[1:]) - 1,
            slots=torch.tensor(n_slots), padding_token_id=0, parallel_token_id=model.parallel_token_id)
        out_qsl = layout.query_start_loc.tolist()
        slots = torch.cat([self._slots(a.seq, layout.positions[out_qsl[i] : out_qsl[i + 1]])
                           for i, a in enumerate(batch)])
        target = model.combine_hidden_states(rows_to_device([a.step.hidden_states for a in batch], dev))
        hidden_in = torch.empty(layout.input_ids.shape[0], target.shape[1], dtype=target.dtype, device=dev)
        hidden_in[layout.hidden_state_mapping.to(dev)] = target
        hidden_in[layout.is_masked.to(dev)] = model.mask_hidden.to(target.dtype)
        meta = AttentionMetadata(
            positions=layout.positions.to(dev), slot_mapping=slots.to(dev),
            query_start_loc=layout.query_start_loc.to(torch.int32).to(dev),
            seq_lens=torch.tensor([c + n - 1 for c, n in zip(C, n_slots)], dtype=torch.int32).to(dev),
            block_tables=self._block_tables(batch).to(dev),
            max_query_len=max(m + n - 1 for m, n in zip(q_lens, n_slots)))
        head_out = model.forward(layout.input_ids.to(dev), hidden_in, meta, self.kv_layers)

        out = _Drafts(B, [a.step.top_k_probs for a in batch])
        new_rows = layout.new_token_indices.tolist()  # sequence i's slots are new_rows[sum(n_slots[:i]) ...]
        rows, batch_idx, positions, first = [], [], [], 0
        for i in range(B):
            for j in range(ks[i]):  # draft j+1 from slot j; a prefill chunk's bonus row gives no draft
                rows.append(new_rows[first + j])
                batch_idx.append(i)
                positions.append(C[i] + j)
            first += n_slots[i]
        if rows:
            logits = model.compute_logits(head_out[torch.tensor(rows, device=dev)])
            out.add(batch_idx, self._select(logits, batch_idx, positions, sp))
        return out

    # ---- multi-layer EAGLE: n layers over the same rows, each gives one draft ----

    def _run_multi_layer(self, batch: list[_Admitted]) -> _Drafts:
        dev, model = self.device, self.model
        n, B = model.num_predict, len(batch)
        sp = self._sampling(batch)
        width = model.hidden_states_width
        dtype = self.kv.kv.dtype
        # -- the window of each sequence: rows [w0, p) from its shift cache, then the committed rows [p, C) --
        shift, cached_len, w0s = [], [], []
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        empty = ShiftCache(zeros(n), zeros(n), zeros(n), zeros(n, width, dtype=dtype), length=0, start_position=0,
                           final_len=0)  # a new sequence
        caches = []
        for a in batch:
            p = a.step.start_position
            cache = a.seq.shift_cache if a.seq.shift_cache is not None else empty
            w0 = min(p, cache.final_len)
            usable = max(0, min(cache.length, p - cache.start_position))  # cached rows before position p
            if p > w0 and (cache.start_position + usable != p or usable < p - w0):
                raise RuntimeError(f"shift cache of {a.seq.sequence_id!r} holds positions "
                                   f"[{cache.start_position}, {cache.start_position + cache.length}) but the step "
                                   f"needs [{w0}, {p})")
            shift.append(p - w0)
            cached_len.append(usable)
            w0s.append(w0)
            caches.append(cache)
        qsl, C = [0], []
        for a in batch:
            qsl.append(qsl[-1] + a.step.num_tokens)
            C.append(a.step.start_position + a.step.num_tokens)
        positions = torch.cat([torch.arange(a.step.start_position, c, dtype=torch.int64) for a, c in zip(batch, C)])
        slots = torch.cat([self._slots(a.seq, torch.arange(a.step.start_position, c, dtype=torch.int64))
                           for a, c in zip(batch, C)])
        win = shift_and_cache(
            src_token_ids=torch.cat([a.step.token_ids for a in batch]).to(dev), src_positions=positions.to(dev),
            src_slot_mapping=slots.to(dev),
            src_hidden_states=rows_to_device([a.step.hidden_states for a in batch], dev).to(dtype),
            query_start_loc=qsl, shift=shift, cached_len=cached_len,
            cached_token_ids=torch.stack([c.token_ids for c in caches]),
            cached_positions=torch.stack([c.positions for c in caches]),
            cached_slot_mapping=torch.stack([c.slot_mapping for c in caches]),
            cached_hidden_states=torch.stack([c.hidden_states for c in caches]))
        wq = win.query_start_loc
        meta = AttentionMetadata(
            positions=win.positions, slot_mapping=win.slot_mapping,
            query_start_loc=torch.tensor(wq, dtype=torch.int32).to(dev),
            seq_lens=torch.tensor(C, dtype=torch.int32).to(dev), block_tables=self._block_tables(batch).to(dev),
            max_query_len=max(wq[i + 1] - wq[i] for i in range(B)))
        last_rows = torch.tensor([wq[i + 1] - 1 for i in range(B)], device=dev)
        next_tokens = torch.tensor([a.step.next_token for a in batch], dtype=torch.int64, device=dev)

        # -- layer j: row t takes x[t+1+j]; the last rows take the next token (j = 0), then the drafts --
        ks = [a.num_drafts for a in batch]
        out = _Drafts(B, [a.step.top_k_probs for a in batch])
        ids, hidden, new_tokens = win.token_ids, win.hidden_states, next_tokens
        everyone = list(range(B))
        for j in range(n):
            shifted = torch.empty_like(ids)
            shifted[:-1] = ids[1:]
            shifted[last_rows] = new_tokens
            ids = shifted
            hidden = model.forward_layer(j, ids, hidden, meta, self.kv_layers[j])
            logits = model.compute_logits_layer(j, hidden[last_rows])
            # every sequence drafts with every layer (the later layers' last rows need the drafts); the reply
            # keeps the first k
            sample = self._select(logits, everyone, [c + j for c in C], sp)
            keep = [i for i in everyone if ks[i] > j]
            if keep:
                out.add(keep, _take(sample, keep) if len(keep) < B else sample)
            new_tokens = sample.tokens

        # -- refresh the caches: the rows before C - n + 1 are final in every layer now --
        for i, a in enumerate(batch):
            L = win.cached_len[i]
            a.seq.shift_cache = ShiftCache(  # clones: a view would keep the whole batch's cache tensors alive
                token_ids=win.cached_token_ids[i].clone(), positions=win.cached_positions[i].clone(),
                slot_mapping=win.cached_slot_mapping[i].clone(), hidden_states=win.cached_hidden_states[i].clone(),
                length=L,
                start_position=C[i] - L, final_len=min(C[i], max(w0s[i], C[i] - n + 1)))
        return out


def _take(sample: DraftSample, rows: list[int]) -> DraftSample:
    idx = torch.tensor(rows, device=sample.tokens.device)
    pick = lambda t: None if t is None else t[idx]  # noqa: E731
    return DraftSample(sample.tokens[idx], pick(sample.logprobs), pick(sample.top_ids), pick(sample.top_probs))
