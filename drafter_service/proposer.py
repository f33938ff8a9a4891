"""One engine step for a batch of sequences: admit, prepare inputs, first draft step, k-1 decode steps.

Runs on the step worker thread only (scheduler.py), so it owns the sequence table and the KV pool.

For a sequence with start position p, m committed tokens x[p..p+m-1], hidden states h[p..p+m-1], next token
x[p+m] and k drafts:
  first step   rows t = p..p+m-1, inputs (x[t+1], h[t]) -> draft-KV of those positions is (over)written;
               the head's output at row p+m-1 gives draft 1 (for position p+m+1).
  decode j     (j = 1..k-1) one row at position p+m-1+j with input (draft j, head output of the previous
               step) -> writes scratch draft-KV there, gives draft j+1.
After the step the sequence's committed length is p+m; the scratch KV past it is overwritten by the next step.
"""
import logging
import time
from dataclasses import dataclass

import torch

from drafter_kernels import ops

from .kv_cache import KVCache
from .metrics import Metrics
from .models.attention_metadata import AttentionMetadata
from .sequence import Sequence, SequenceTable
from .step_io import (FAILED_PRECONDITION, INTERNAL, NOT_FOUND, OUT_OF_RANGE, RESOURCE_EXHAUSTED, StepInput,
                      StepOutput)
from .step_metadata import StepMetadata

log = logging.getLogger(__name__)


@dataclass
class _Admitted:
    index: int  # into the step list
    seq: Sequence
    is_new: bool
    step: StepInput
    num_drafts: int  # k after the max_model_len cut


class Proposer:
    def __init__(self, model, kv: KVCache, max_model_len: int, device: torch.device, metrics: Metrics | None = None):
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.device = device
        self.table = SequenceTable(kv.pool, kv.block_size)
        self.metrics = metrics or Metrics()
        self.kv_layers = [kv.layer(i) for i in range(model.num_kv_layers)]
        self.decode_graphs = None  # cuda_graphs.DecodeGraphs: set by runtime.py on CUDA with --cuda-graphs

    # ---- admission: per-sequence checks and block reservation; nothing is changed for a refused sequence ----

    def _admit(self, index: int, s: StepInput, out: StepOutput) -> _Admitted | None:
        p, m = s.start_position, s.num_tokens
        if p + m >= self.max_model_len:
            out.code, out.message = OUT_OF_RANGE, (
                f"start_position + num_tokens = {p + m} leaves no room for next_token below max_model_len "
                f"{self.max_model_len}")
            return None
        seq = self.table.get(s.namespace, s.sequence_id)
        is_new = seq is None
        if is_new:
            if p != 0:
                out.code, out.message = NOT_FOUND, (
                    f"unknown sequence {s.sequence_id!r} in namespace {s.namespace!r}: a new sequence starts at "
                    f"start_position 0 (got {p})")
                return None
            seq = Sequence(s.namespace, s.sequence_id)
        elif p > seq.committed_len:
            out.code, out.message = FAILED_PRECONDITION, (
                f"gap: start_position {p} is beyond the committed length {seq.committed_len} of sequence "
                f"{s.sequence_id!r}; resend from a position <= {seq.committed_len}")
            return None
        k = max(0, min(s.num_drafts, self.max_model_len - 1 - (p + m)))
        positions_needed = p + m + max(k - 1, 0)
        missing = self.table.blocks_missing(seq, positions_needed)
        if not self.table.resize(seq, positions_needed):
            out.code, out.message = RESOURCE_EXHAUSTED, (
                f"KV pool full: sequence {s.sequence_id!r} needs {missing} more blocks of {self.block_size} tokens, "
                f"{self.kv.pool.num_free} free; release finished sequences or lower the load")
            return None
        if is_new:
            self.table.add(seq)
        out.accepted_drafts = self._count_accepted(seq, s)
        seq.committed_len = min(seq.committed_len, p)  # rollback: free of cost, the next writes overwrite
        return _Admitted(index, seq, is_new, s, k)

    def _count_accepted(self, seq: Sequence, s: StepInput) -> int:
        """Compare the drafts given last time with the committed tokens this step brings (acceptance metrics)."""
        drafts, base = seq.last_drafts, seq.last_drafts_base
        p, m = s.start_position, s.num_tokens
        if not drafts or not (p <= base + 1 <= p + m):
            return 0
        accepted = 0
        for i, d in enumerate(drafts, start=1):
            pos = base + i
            if pos > p + m:
                break
            tok = s.next_token if pos == p + m else int(s.token_ids[pos - p])
            if tok != d:
                break
            accepted += 1
        self.metrics.record_acceptance(len(drafts), accepted)
        return accepted

    # ---- the step ----

    @torch.inference_mode()
    def step(self, steps: list[StepInput]) -> list[StepOutput]:
        t0 = time.perf_counter()
        outputs = [StepOutput() for _ in steps]
        batch = [a for i, s in enumerate(steps) if (a := self._admit(i, s, outputs[i])) is not None]
        if batch:
            try:
                drafts, logprobs = self._run(batch)
            except Exception as e:  # never leave a sequence claiming KV it may not have
                log.exception("step failed")
                for a in batch:
                    a.seq.last_drafts = []
                    if a.is_new:
                        self.table.release(a.seq.namespace, a.seq.sequence_id)
                    outputs[a.index].code = INTERNAL
                    outputs[a.index].message = f"internal error in the draft step: {type(e).__name__}: {e}"
                    outputs[a.index].accepted_drafts = 0
                batch = []
            for a, d, lp in zip(batch, drafts, logprobs):
                p, m = a.step.start_position, a.step.num_tokens
                a.seq.committed_len = p + m
                a.seq.last_drafts, a.seq.last_drafts_base = d, p + m
                out = outputs[a.index]
                out.drafts, out.committed_length = d, p + m
                out.logprobs = lp if a.step.return_logprobs else []
        self.metrics.record_step(steps, outputs, time.perf_counter() - t0, self.kv.pool.num_free,
                                 self.kv.pool.num_blocks)
        self.metrics.live_sequences = len(self.table)
        return outputs

    def _slots(self, seq: Sequence, positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _run(self, batch: list[_Admitted]) -> tuple[list[list[int]], list[list[float]]]:
        dev, bs = self.device, self.block_size
        B = len(batch)
        # ---- step metadata (step_metadata.py): vectorized on the host, one host->device copy for the step ----
        md = StepMetadata.build(batch, self.block_size, dev)
        meta, seq_lens, block_tables = md.first_step, md.host_seq_lens, md.host_block_tables
        # ---- end step metadata ----
        head_out = self.model.forward(md.input_ids, md.hidden_states, meta, self.kv_layers)

        # -- drafts: only sequences that asked for some (k = 0 is a prefill chunk) --
        ks = [a.num_drafts for a in batch]
        active = [i for i in range(B) if ks[i] > 0]  # batch indices still drafting
        drafts: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[float]] = [[] for _ in batch]
        if not active:
            return drafts, logprobs
        want_logprobs = any(batch[i].step.return_logprobs for i in active)
        last_rows = md.draft_rows  # [n] on the device
        head_last = head_out[last_rows]  # [n, H]
        tok, lp = self._select(head_last, want_logprobs)
        hidden_prev = self.model.next_hidden(head_last)
        # ---- CUDA fast path (cuda_graphs.py): decode steps replayed from CUDA graphs, one device->host copy ----
        if self.decode_graphs is not None and self.decode_graphs.can_run(len(active)):
            return self.decode_graphs.draft(md, tok, lp, hidden_prev)
        # ---- end CUDA fast path ----
        # per decode step: (batch indices drafting, their tokens [n], their logprobs [n] or None)
        columns = [(active, tok, lp)]
        for j in range(1, max(ks)):
            still = [r for r, i in enumerate(active) if ks[i] > j]
            if len(still) < len(active):
                sel = torch.tensor(still, device=dev)
                tok, hidden_prev = tok[sel], hidden_prev[sel]
                active = [active[r] for r in still]
            n = len(active)
            positions = torch.tensor([seq_lens[i] - 1 + j for i in active], dtype=torch.int64)
            slot = torch.cat([self._slots(batch[i].seq, positions[r : r + 1]) for r, i in enumerate(active)])
            meta = AttentionMetadata(
                positions=positions.to(dev), slot_mapping=slot.to(dev),
                query_start_loc=torch.arange(n + 1, dtype=torch.int32).to(dev),
                seq_lens=(positions + 1).to(torch.int32).to(dev),
                block_tables=block_tables[torch.tensor(active)].to(dev), max_query_len=1)
            out = self.model.forward(tok, hidden_prev, meta, self.kv_layers)
            tok, lp = self._select(out, want_logprobs)
            hidden_prev = self.model.next_hidden(out)
            columns.append((active, tok, lp))
        # one device->host copy for the whole step
        flat_tok = torch.cat([c[1] for c in columns]).cpu().tolist()
        flat_lp = torch.cat([c[2] for c in columns]).cpu().tolist() if want_logprobs else None
        r = 0
        for rows, _, _ in columns:
            for i in rows:
                drafts[i].append(flat_tok[r])
                if flat_lp is not None:
                    logprobs[i].append(flat_lp[r])
                r += 1
        return drafts, logprobs

    def _select(self, head_out: torch.Tensor, want_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy draft (target-vocabulary id) per row, and its log-probability when asked."""
        logits = self.model.compute_logits(head_out)
        draft = ops.argmax(logits)
        target_ids = self.model.draft_to_target(draft)
        lp = None
        if want_logprobs:
            lp = torch.log_softmax(logits.float(), dim=-1).gather(1, draft[:, None]).squeeze(1)
        return target_ids, lp
