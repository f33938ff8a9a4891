"""The raw columns of a greedy step whose first draft step replays a CUDA graph, at fixed addresses.

A first-step graph (cuda_graphs.py) starts with kernels/build_first_step.py, which builds the step's rows on the
device from this record: a captured kernel reads fixed addresses, so the record is one int32 buffer whose fields
sit at fixed offsets, sized for the largest step a graph takes. The host writes a step's columns into its host copy
(pinned on CUDA) with a few numpy assignments and sends the used prefix in one non_blocking copy: no positions, slots
or shifted ids are computed on the host, and no kernel is launched from Python before the replay.

  field             entries used     capacity
  header            2                2           B (sequences), w (block-table width of the step)
  start_positions   B                max_seqs    p_i
  query_start_loc   B + 1            max_seqs+1  sequence i's committed rows are [qsl[i], qsl[i+1])
  next_tokens       B                max_seqs    x[p_i + m_i]
  draft_steps       B                max_seqs    k_i - 1
  token_ids         T                max_rows    the committed tokens, sequence after sequence
  block_tables      B * w            max_seqs * table_width (last: the copy covers only B * w of it)

Every field starts at a 16-byte boundary (Triton specializes a kernel on its pointers' alignment). Values fit int32:
positions are below max_model_len (admission checks it), token ids below the vocabulary size (the request's checks,
transport/validation.py), block ids below the pool's size.

The host copy is rewritten only once the copy from it has completed: the step that wrote it synchronizes its stream
before it returns and then calls synchronized(); a write that finds the previous copy not marked so (that step
failed in between) synchronizes the device first. (No CUDA event per step: recording one, and the current-stream
lookup it needs, cost about 15 us of host time before the GPU can start, on every step.)
"""
import itertools

import numpy as np
import torch

from drafter_service.engine.step_metadata import aligned_len

MAX_KEPT_VIEWS = 256  # copy views kept, one per used length (batch size x block-table width) seen
FIELDS = ("header", "start_positions", "query_start_loc", "next_tokens", "draft_steps", "token_ids", "block_tables")


class FirstStepRecord:
    def __init__(self, max_seqs: int, max_rows: int, table_width: int, device: torch.device):
        sizes = [2, max_seqs, max_seqs + 1, max_seqs, max_seqs, max_rows, max_seqs * table_width]
        padded = [aligned_len(n, 4) for n in sizes]
        starts = list(itertools.accumulate([0] + padded))
        cuda = device.type == "cuda"
        self.host = torch.zeros(starts[-1], dtype=torch.int32, pin_memory=cuda)
        self.on_device = torch.zeros_like(self.host, device=device) if cuda else self.host
        # the kernel's inputs: views of the device copy, in FIELDS order (fixed: captured by the graphs)
        self.fields = tuple(self.on_device[at : at + n] for at, n in zip(starts, sizes))
        host = self.host.numpy()
        (self._header, self._start_positions, self._qsl, self._next_tokens, self._draft_steps, self._token_ids,
         self._block_tables) = (host[at : at + n] for at, n in zip(starts, sizes))
        self._tables_at = starts[-2]
        # used length -> (host, device) views of the record's prefix: a view made per step cost more host time than
        # the copy call itself (H200 host: 4.7 us for the copy of kept views, 8.6-14.5 us with the slicing)
        self._copy_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._in_flight = False  # the copy of the last write may still read the host copy

    def write(self, start_positions: np.ndarray, num_tokens: np.ndarray, next_tokens: np.ndarray,
              num_drafts: np.ndarray, token_ids: np.ndarray, block_tables: np.ndarray, send: bool = True) -> None:
        """A step's columns into the record, and the record to the device (non_blocking). start_positions, num_tokens,
        next_tokens, num_drafts: [B] integers (k >= 1); token_ids: [T] the committed tokens; block_tables: [B, w]
        int32 (each row holds the sequence's blocks for every position the step writes). send False: the host copy
        only, and only if no copy from it may be running (a rehearsal between steps: the next step rewrites it
        whole; the device copy, which a graph replays from, is left alone)."""
        if self._in_flight:  # (the step of the last write failed before its synchronization)
            if not send:
                return
            torch.cuda.synchronize(self.on_device.device)
            self._in_flight = False
        B, w = block_tables.shape
        T = token_ids.shape[0]
        self._header[0], self._header[1] = B, w
        self._start_positions[:B] = start_positions
        self._qsl[0] = 0
        np.cumsum(num_tokens, out=self._qsl[1 : B + 1])
        self._next_tokens[:B] = next_tokens
        np.subtract(num_drafts, 1, out=self._draft_steps[:B], casting="unsafe")
        self._token_ids[:T] = token_ids
        self._block_tables[: B * w].reshape(B, w)[:] = block_tables
        if send and self.on_device is not self.host:
            used = self._tables_at + B * w
            views = self._copy_views.get(used)
            if views is None:
                if len(self._copy_views) >= MAX_KEPT_VIEWS:
                    self._copy_views.clear()
                views = self._copy_views[used] = (self.host[:used], self.on_device[:used])
            views[1].copy_(views[0], non_blocking=True)
            self._in_flight = True

    def synchronized(self) -> None:
        """The step that wrote the record has synchronized the stream of its copy: the host copy may be rewritten."""
        self._in_flight = False

    def clear(self) -> None:
        """B = 0 on the device (graph capture: every sequence a padding one)."""
        self.host.zero_()
        if self.on_device is not self.host:
            self.on_device.zero_()
