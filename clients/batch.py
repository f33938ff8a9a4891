"""The batch API: one engine step for B sequences as columns (tensors), and its answer as columns.

An engine that keeps its batch as tensors (positions, token ids, the states of the committed rows, the next tokens)
hands them over as they are: ``DrafterClient.propose_batch(StepBatch(...))`` returns ``BatchDrafts`` with the
drafts of all sequences in one tensor and per-sequence codes, counts and lengths as tensors. No Python object per
sequence is built on the client's side of the call: from COLUMNS_MIN_SEQUENCES (32) sequences, with a drafter that
takes columnar requests (GetInfo.step_columns_supported), the request carries the columns as tensors
(ProposeRequest.columns) and the reply the results as tensors (ProposeResponse.result_columns); below that, or with
an older drafter, the protocol's per-sequence messages are written from the columns in one pass. Inline states of
chunk_min_bytes (2 MiB) or more go by ProposeChunked either way. ``propose(list[SequenceStep])`` is the per-sequence
convenience over the same request.
"""
from dataclasses import dataclass, field
from typing import Callable

import grpc
import numpy as np
import torch

from drafter_client.messages import (RESYNC_CODES, UNAVAILABLE, ChunkedRequest, DirectRequest, DrafterError,
                                     ProposeResult, SequenceDrafts, SequenceStep, _alike_rows, _status_code,
                                     flat_token_ids, hidden_parts, serialize_with_states, write_rows)
from drafter_client.protocol import pb, step_frame
from drafter_client.protocol.wire import decode_array, decode_tensor, encode_tensor
from drafter_client.shm_ring import SharedTensorRef

RESYNC_ARRAY = np.array(sorted(RESYNC_CODES), dtype=np.int32)  # (np.isin of a reply's status codes)


# A batch of at least this many sequences goes as a columnar request (when the drafter takes them): below it the
# per-sequence messages cost the host less (a few fixed tensor ops against a few message fields). On the dev CPU
# (docs/bench/request_codec_cpu_2026-11-25.json) the columns' host work was 0.90x the batch API's messages at 32
# sequences, 0.80x at 64, 0.73x at 128, 0.76x at 256; at batch 1 1.7x: benchmarks/bench_request_codec.py.
COLUMNS_MIN_SEQUENCES = 32


@dataclass
class StepBatch:
    """One engine step for B sequences. Row r of token_ids / hidden_states belongs to sequence i when
    offsets[i] <= r < offsets[i + 1], offsets being the running sum of num_tokens (sequence order)."""

    sequence_ids: list[str]  # [B]
    start_positions: torch.Tensor  # [B] int: p of each sequence
    num_tokens: torch.Tensor  # [B] int: m of each sequence (>= 1)
    token_ids: torch.Tensor  # [sum m] int: the committed tokens, sequence after sequence
    hidden_states: "torch.Tensor | SharedTensorRef"  # [sum m, GetInfo.hidden_states_width], same rows
    next_tokens: torch.Tensor  # [B] int: x[p + m] of each sequence
    num_drafts: "torch.Tensor | int"  # [B] int, or one k for every sequence
    temperature: "torch.Tensor | float" = 0.0  # [B] float, or one for all (0: greedy)
    seed: "torch.Tensor | int" = 0  # [B] int, or one for all: uint64 seeds; in an int64 tensor, those of 2**63 and up
    # as the int64 of the same bits (negative)
    return_logprobs: bool = False
    top_k_probs: int = 0
    predraft_branches: "torch.Tensor | int" = 0  # [B] int, or one F for all: pre-drafting budget (docs/predraft.md)

    def __len__(self) -> int:
        return len(self.sequence_ids)


@dataclass
class BatchDrafts:
    """The answer to a StepBatch, as columns in the batch's sequence order. codes[i] != 0: sequence i got no
    drafts (messages[i] says why; needs_resync[i]: resend its context from position 0, docs/protocol.md)."""

    sequence_ids: list[str]
    codes: torch.Tensor  # [B] int32: gRPC code numbers, 0 = OK
    num_drafts: torch.Tensor  # [B] int64: drafts given to each sequence
    draft_token_ids: torch.Tensor  # [sum num_drafts] int64, sequence after sequence
    accepted_drafts: torch.Tensor  # [B] int64: the previous step's drafts the engine committed, as counted
    committed_lengths: torch.Tensor  # [B] int64: p + m
    needs_resync: torch.Tensor  # [B] bool
    predrafted: torch.Tensor | None = None  # [B] bool: answered from drafts prepared during the verification
    messages: dict[int, str] = field(default_factory=dict)  # index -> message, for the sequences with a code
    logprobs: torch.Tensor | None = None  # [sum num_drafts] float32, when asked for
    top_k_ids: torch.Tensor | None = None  # [sum num_drafts, N] int64, when asked for
    top_k_probs: torch.Tensor | None = None  # [sum num_drafts, N] float32
    request_id: int = 0
    fallback: bool = False  # the drafter was not asked or did not answer (see ProposeResult.fallback)
    fallback_reason: str = ""

    def padded(self, fill: int = -1) -> torch.Tensor:
        """Drafts as [B, max num_drafts] int64, short rows filled with ``fill`` (one scatter, no loop)."""
        n = self.num_drafts
        width = int(n.max()) if n.numel() else 0
        out = torch.full((n.numel(), width), fill, dtype=torch.int64)
        if self.draft_token_ids.numel():
            rows = torch.repeat_interleave(torch.arange(n.numel()), n)
            starts = torch.cumsum(n, 0) - n
            cols = torch.arange(self.draft_token_ids.numel()) - starts[rows]
            out[rows, cols] = self.draft_token_ids
        return out


def _column(value, n: int, dtype: torch.dtype) -> list:
    """A per-sequence column as a list: a tensor's values, or one value repeated."""
    if isinstance(value, torch.Tensor):
        if value.numel() != n:
            raise ValueError(f"a column has {value.numel()} values for {n} sequences")
        return value.to(dtype).tolist()
    return [value] * n


def _int64_bits(seed: int) -> int:
    """A uint64 seed as the int64 of the same bits (the seed column's form: those of 2**63 and up are negative)."""
    return seed - 2**64 if seed >= 2**63 else seed


def _column_tensor(value, n: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A per-sequence column as a [n] CPU tensor of dtype: the tensor's values, or one value repeated."""
    if isinstance(value, torch.Tensor):
        if value.numel() != n:
            raise ValueError(f"{name} has {value.numel()} values for {n} sequences")
        if value.dtype == dtype and value.dim() == 1 and value.device.type == "cpu" and not value.requires_grad:
            return value  # (the common case as it is: detach, reshape and to cost a few microseconds each)
        return value.detach().reshape(-1).to(device="cpu", dtype=dtype)
    return torch.full((n,), value, dtype=dtype)


def build_column_request(namespace: str, batch: StepBatch, request_id: int = 0) -> "pb.ProposeRequest":
    """The batch's ProposeRequest with the steps as columns (ProposeRequest.columns: tensors, no message per
    sequence), all but the hidden states (serialize_batch adds them). Needs GetInfo.step_columns_supported."""
    n = len(batch)
    req = pb.ProposeRequest(namespace=namespace, request_id=request_id)
    c = req.columns
    c.sequence_ids.extend(batch.sequence_ids)
    m = _column_tensor(batch.num_tokens, n, torch.int64, "num_tokens")
    total = int(m.sum())
    if batch.token_ids.numel() != total:
        raise ValueError(f"token_ids has {batch.token_ids.numel()} values; num_tokens adds up to {total}")
    encode_tensor(_column_tensor(batch.start_positions, n, torch.int64, "start_positions"), into=c.start_positions)
    encode_tensor(m, into=c.num_tokens)
    encode_tensor(_column_tensor(batch.next_tokens, n, torch.int64, "next_tokens"), into=c.next_tokens)
    encode_tensor(_column_tensor(batch.num_drafts, n, torch.int64, "num_drafts"), into=c.num_drafts)
    # the optional columns only when some sequence needs them (unset: 0 for every sequence)
    if isinstance(batch.temperature, torch.Tensor) or batch.temperature:
        encode_tensor(_column_tensor(batch.temperature, n, torch.float32, "temperature"), into=c.temperatures)
    if isinstance(batch.seed, torch.Tensor) or batch.seed:
        seeds = batch.seed if isinstance(batch.seed, torch.Tensor) else _int64_bits(batch.seed)
        encode_tensor(_column_tensor(seeds, n, torch.int64, "seed"), into=c.seeds)
    if isinstance(batch.predraft_branches, torch.Tensor) or batch.predraft_branches:
        encode_tensor(_column_tensor(batch.predraft_branches, n, torch.int64, "predraft_branches"),
                      into=c.predraft_branches)
    c.return_logprobs = batch.return_logprobs
    c.top_k_probs = batch.top_k_probs
    encode_tensor(batch.token_ids.detach().reshape(-1).to(torch.int64).cpu(), into=req.token_ids)
    return req


def build_batch_request(namespace: str, batch: StepBatch, request_id: int = 0) -> "pb.ProposeRequest":
    """Every field of the batch's ProposeRequest but the hidden states (serialize_batch adds them), as one
    SequenceStep message per sequence (for a drafter without columnar requests)."""
    n = len(batch)
    m = _column(batch.num_tokens, n, torch.int64)
    p = _column(batch.start_positions, n, torch.int64)
    nxt = _column(batch.next_tokens, n, torch.int64)
    k = _column(batch.num_drafts, n, torch.int64)
    temp = _column(batch.temperature, n, torch.float32)
    seed = [s + 2**64 if s < 0 else s for s in _column(batch.seed, n, torch.int64)]  # (uint64 on the wire)
    branches = _column(batch.predraft_branches, n, torch.int64)
    if batch.token_ids.numel() != sum(m):
        raise ValueError(f"token_ids has {batch.token_ids.numel()} values; num_tokens adds up to {sum(m)}")
    plain = not (batch.return_logprobs or batch.top_k_probs)
    greedy = pb.SamplingParams()
    req = pb.ProposeRequest(namespace=namespace, request_id=request_id, steps=[
        pb.SequenceStep(sequence_id=sid, start_position=p_, num_tokens=m_, next_token=x, num_drafts=k_,
                        sampling=greedy if plain and not (t or s) else pb.SamplingParams(
                            temperature=t, seed=s, return_logprobs=batch.return_logprobs,
                            top_k_probs=batch.top_k_probs), predraft_branches=f)
        for sid, p_, m_, x, k_, t, s, f in zip(batch.sequence_ids, p, m, nxt, k, temp, seed, branches)])
    encode_tensor(batch.token_ids.detach().reshape(-1).to(torch.int64).cpu(), into=req.token_ids)
    return req


def serialize_batch(namespace: str, batch: StepBatch, hidden_states: "torch.Tensor | SharedTensorRef | None" = None,
                    request_id: int = 0, chunk_min_bytes: int | None = None,
                    columns: bool = False) -> "bytes | DirectRequest | ChunkedRequest":
    """The batch's serialized ProposeRequest (hidden_states: in place of the batch's own, e.g. a ring slot); a
    ChunkedRequest for ProposeChunked when the inline states reach chunk_min_bytes (None: never). columns: the steps
    as columns (the drafter's GetInfo.step_columns_supported), else one message per sequence."""
    states = batch.hidden_states if hidden_states is None else hidden_states
    parts = None if isinstance(states, SharedTensorRef) else [states]
    build = build_column_request if columns else build_batch_request
    return serialize_with_states(build(namespace, batch, request_id), states, parts, chunk_min_bytes)


def parse_batch_response(resp: "pb.ProposeResponse", sequence_ids: list[str]) -> BatchDrafts:
    """A ProposeResponse as BatchDrafts; raises DrafterError for a request-level error, INTERNAL when the reply's
    draft counts do not add up or it answers another number of sequences."""
    if resp.HasField("error") and resp.error.code != 0:
        raise DrafterError(_status_code(resp.error.code), resp.error.message)
    if resp.HasField("result_columns"):
        return _parse_result_columns(resp, sequence_ids)
    results = resp.results
    n = len(sequence_ids)
    if len(results) != n:
        raise DrafterError(grpc.StatusCode.INTERNAL, f"the reply answers {len(results)} sequences of {n}")
    # [n, 5]: code, num_drafts, accepted_drafts, committed_length, predrafted (numpy: a torch op per column cost
    # ~0.2 ms of fixed cost per reply on the H100 host)
    cols = np.array([(r.status.code, r.num_drafts, r.accepted_drafts, r.committed_length, r.predrafted)
                     for r in results], dtype=np.int64).reshape(n, 5)
    try:
        flat = decode_array(resp.draft_token_ids, "draft_token_ids", (pb.INT64,), 1).copy()
    except ValueError as e:
        raise DrafterError(grpc.StatusCode.INTERNAL, f"the reply is malformed: {e}") from None
    codes = cols[:, 0].astype(np.int32)
    return _batch_drafts(resp, sequence_ids, codes, cols[:, 1].copy(), flat, cols[:, 2].copy(), cols[:, 3].copy(),
                         cols[:, 4] != 0, lambda failed: {i: results[i].status.message for i in failed})


def _batch_drafts(resp: "pb.ProposeResponse | None", sequence_ids: list[str], codes: np.ndarray, counts: np.ndarray,
                  flat: np.ndarray, accepted: np.ndarray, lengths: np.ndarray, predrafted: np.ndarray,
                  messages: Callable[[list[int]], dict[int, str]], request_id: int | None = None) -> BatchDrafts:
    """BatchDrafts over a reply's decoded columns (numpy arrays of their own: [n] int32 codes; [n] int64 counts,
    accepted drafts and committed lengths; [n] bool predrafted; the flat draft ids): checks that the counts add up
    to the draft ids. messages(failed indices) -> their status messages. resp: the ProposeResponse, for its request
    id and distributions; None for a reply frame (request_id given; a frame carries no distributions)."""
    if int(counts.sum()) != flat.shape[0]:
        raise DrafterError(grpc.StatusCode.INTERNAL, f"the reply's num_drafts add up to {int(counts.sum())}, but "
                                                     f"it holds {flat.shape[0]} draft ids")
    failed = np.flatnonzero(codes).tolist() if codes.any() else []
    out = BatchDrafts(sequence_ids=list(sequence_ids), codes=torch.from_numpy(codes),
                      num_drafts=torch.from_numpy(counts), draft_token_ids=torch.from_numpy(flat),
                      accepted_drafts=torch.from_numpy(accepted), committed_lengths=torch.from_numpy(lengths),
                      needs_resync=torch.from_numpy(np.isin(codes, RESYNC_ARRAY) if failed
                                                    else np.zeros(codes.shape[0], bool)),
                      messages=messages(failed) if failed else {},
                      request_id=resp.request_id if resp is not None else request_id,
                      predrafted=torch.from_numpy(predrafted))
    return _with_distributions(out, resp) if resp is not None else out


def _parse_result_columns(resp: "pb.ProposeResponse", sequence_ids: list[str]) -> BatchDrafts:
    """parse_batch_response for a reply with ResultColumns (the answer to a columnar request). The columns are read
    as numpy views and handed out as tensors of their own (torch.from_numpy of copies): some fifteen torch ops on
    [n] tensors cost ~0.1 ms of fixed cost per reply on a 2-core VM, the numpy ones a few microseconds."""
    n = len(sequence_ids)
    cols = resp.result_columns

    def read(t: "pb.Tensor", field: str, allowed: tuple[int, ...]) -> np.ndarray:
        try:
            return decode_array(t, field, allowed, 1)
        except ValueError as e:
            raise DrafterError(grpc.StatusCode.INTERNAL, f"the reply is malformed: {e}") from None

    def column(name: str, allowed: tuple[int, ...]) -> np.ndarray:
        x = read(getattr(cols, name), f"result_columns.{name}", allowed)
        if x.shape[0] != n:
            raise DrafterError(grpc.StatusCode.INTERNAL, f"the reply answers {x.shape[0]} sequences of {n}")
        return x

    codes = column("status_codes", (pb.INT32,)).astype(np.int32)  # (astype: a writable copy, off the message)
    counts = column("num_drafts", (pb.INT32,)).astype(np.int64)
    flat = read(resp.draft_token_ids, "draft_token_ids", (pb.INT64,)).copy()

    def messages(failed: list[int]) -> dict[int, str]:
        given = {p.index: p.status.message for p in cols.problems if p.index < n}
        return {i: given.get(i, "") for i in failed}
    return _batch_drafts(resp, sequence_ids, codes, counts, flat,
                         column("accepted_drafts", (pb.INT32,)).astype(np.int64),
                         column("committed_lengths", (pb.INT64,)).astype(np.int64),
                         column("predrafted", (pb.INT32,)) != 0, messages)


def frame_from_batch(namespace: str, batch: StepBatch, request_id: int) -> "step_frame.FrameRequest | None":
    """The batch as a step channel's request frame (step_frame.py), or None where a frame cannot carry it: states
    that are not one [rows, W] tensor of a frame dtype (a SharedTensorRef, ...), token ids of another row count,
    log-probabilities or top-N asked for."""
    states = batch.hidden_states
    if (batch.return_logprobs or batch.top_k_probs or not isinstance(states, torch.Tensor) or states.dim() != 2
            or states.dtype not in step_frame.DTYPE_NUMBERS or batch.token_ids.numel() != states.shape[0]):
        return None
    n, rows = len(batch), states.shape[0]
    seeds = batch.seed if isinstance(batch.seed, torch.Tensor) else _int64_bits(batch.seed)
    # (one value for every sequence is written into its row by numpy: a torch.full per column cost more)
    columns = np.empty((len(step_frame.REQUEST_COLUMNS), n), dtype=np.int64)
    for row, (name, value) in enumerate((
            ("start_positions", batch.start_positions), ("num_tokens", batch.num_tokens),
            ("next_tokens", batch.next_tokens), ("num_drafts", batch.num_drafts), ("seed", seeds),
            ("predraft_branches", batch.predraft_branches))):
        columns[row] = _column_tensor(value, n, torch.int64, name).numpy() if isinstance(value, torch.Tensor) \
            else value
    temperature = batch.temperature
    temperatures = (_column_tensor(temperature, n, torch.float32, "temperature").numpy()
                    if isinstance(temperature, torch.Tensor) else np.full(n, temperature, dtype=np.float32))
    return step_frame.FrameRequest(namespace, request_id, batch.sequence_ids, columns, temperatures,
                                   _column_tensor(batch.token_ids, rows, torch.int64, "token_ids").numpy(), rows,
                                   states.shape[1], states.dtype, lambda dest: write_rows([states], dest))


def frame_from_steps(namespace: str, steps: list[SequenceStep], hidden_states: "torch.Tensor | None",
                     request_id: int) -> "step_frame.FrameRequest | None":
    """propose()'s steps as a request frame (the states copied once, from the steps' own tensors), or None where a
    frame cannot carry them (as frame_from_batch)."""
    if not steps or isinstance(hidden_states, SharedTensorRef):
        return None
    parts = hidden_parts(steps, hidden_states)
    alike = _alike_rows(parts)
    if alike is None or parts[0].dtype not in step_frame.DTYPE_NUMBERS:
        return None
    # one pass over the steps, then a column per field (zip transposes in C)
    sids, starts, nexts, ks, temps, seeds, branches, asks = zip(*[
        (s.sequence_id, s.start_position, int(s.next_token), s.num_drafts, s.temperature, s.seed, s.predraft_branches,
         s.return_logprobs or s.top_k_probs) for s in steps])
    if any(asks):
        return None
    counts, token_ids = flat_token_ids(steps)
    rows, width = alike
    if token_ids.shape[0] != rows:
        return None
    columns = np.array([starts, counts, nexts, ks, [_int64_bits(x) for x in seeds], branches], dtype=np.int64)
    return step_frame.FrameRequest(namespace, request_id, list(sids), columns, np.array(temps, dtype=np.float32),
                                   token_ids.numpy(), rows, width, parts[0].dtype, lambda dest: write_rows(parts, dest))


def parse_frame_reply(reply, sequence_ids: list[str]) -> BatchDrafts:
    """A reply frame (step_frame.py) as BatchDrafts; one that does not read is the drafter's fault (INTERNAL)."""
    try:
        f = step_frame.read_reply(reply, len(sequence_ids))
    except step_frame.FrameError as e:
        raise DrafterError(grpc.StatusCode.INTERNAL, f"a step channel reply frame that does not read: {e}") from None
    return _batch_drafts(None, sequence_ids, f.codes, f.num_drafts, f.draft_token_ids, f.accepted_drafts,
                         f.committed_lengths, f.predrafted, lambda failed: {i: f.messages.get(i, "") for i in failed},
                         f.request_id)


def columns_can_carry(steps: list[SequenceStep]) -> bool:
    """Whether a list of per-sequence steps can go as columns: return_logprobs and top_k_probs are one setting for
    the whole request there (every other field is a per-sequence column)."""
    first = steps[0]
    return all(s.return_logprobs == first.return_logprobs and s.top_k_probs == first.top_k_probs for s in steps)


def steps_as_batch(steps: list[SequenceStep]) -> StepBatch:
    """The per-sequence steps as a StepBatch of columns (propose() sends a large step this way: the drafter then
    decodes it without a message per sequence). hidden_states is left None: the caller passes the steps' own
    (serialize_steps_as_columns). Needs columns_can_carry(steps)."""
    counts, token_ids = flat_token_ids(steps)
    first = steps[0]
    # one pass over the steps, then a column per field (zip transposes in C)
    sids, starts, nexts, ks, temps, seeds, branches = zip(*[
        (s.sequence_id, s.start_position, int(s.next_token), s.num_drafts, s.temperature, s.seed, s.predraft_branches)
        for s in steps])
    return StepBatch(
        sequence_ids=list(sids), start_positions=torch.tensor(starts, dtype=torch.int64),
        num_tokens=torch.tensor(counts, dtype=torch.int64), token_ids=token_ids, hidden_states=None,
        next_tokens=torch.tensor(nexts, dtype=torch.int64), num_drafts=torch.tensor(ks, dtype=torch.int64),
        temperature=torch.tensor(temps, dtype=torch.float32) if any(temps) else 0.0,
        # (uint64 seeds of 2**63 and up as the int64 of the same bits, as the seed column holds them)
        seed=torch.tensor([_int64_bits(x) for x in seeds], dtype=torch.int64) if any(seeds) else 0,
        return_logprobs=first.return_logprobs, top_k_probs=first.top_k_probs,
        predraft_branches=torch.tensor(branches, dtype=torch.int64) if any(branches) else 0)


def serialize_steps_as_columns(namespace: str, steps: list[SequenceStep], batch: StepBatch,
                               hidden_states: "torch.Tensor | SharedTensorRef | None" = None, request_id: int = 0,
                               chunk_min_bytes: int | None = None) -> "bytes | DirectRequest | ChunkedRequest":
    """serialize_request's step as a columnar request (batch: steps_as_batch(steps)); the states as the caller gave
    them (the packed tensor, or each step's, copied once where the request goes), or a ring slot's reference."""
    parts = None if isinstance(hidden_states, SharedTensorRef) else hidden_parts(steps, hidden_states)
    return serialize_with_states(build_column_request(namespace, batch, request_id), hidden_states, parts,
                                 chunk_min_bytes)


def batch_as_result(drafts: BatchDrafts) -> ProposeResult:
    """BatchDrafts as propose()'s ProposeResult: one SequenceDrafts per sequence (views of the drafts tensor)."""
    counts = drafts.num_drafts.tolist()
    flat = drafts.draft_token_ids
    split = (lambda t: [t] if len(counts) == 1 else t.split(counts))  # noqa: E731
    none = [None] * len(counts)
    per_seq = split(flat)
    lps = split(drafts.logprobs) if drafts.logprobs is not None else none
    top_ids = split(drafts.top_k_ids) if drafts.top_k_ids is not None else none
    top_probs = split(drafts.top_k_probs) if drafts.top_k_probs is not None else none
    predrafted = drafts.predrafted.tolist() if drafts.predrafted is not None else [False] * len(counts)
    # (by position, in SequenceDrafts' field order: sequence_id, code, message, drafts, logprobs, accepted_drafts,
    # committed_length, top_k_ids, top_k_probs, needs_resync, predrafted; by keyword the call cost 3x more, ~0.6 us
    # a sequence, the largest part of parsing a batch-128 reply)
    messages = drafts.messages
    seqs = [SequenceDrafts(sid, code, messages.get(i, "") if code else "", d, lp, acc, length, ti, tp,
                           code in RESYNC_CODES, pre)
            for i, (sid, code, d, lp, acc, length, ti, tp, pre) in enumerate(zip(
                drafts.sequence_ids, drafts.codes.tolist(), per_seq, lps, drafts.accepted_drafts.tolist(),
                drafts.committed_lengths.tolist(), top_ids, top_probs, predrafted))]
    return ProposeResult(sequences=seqs, draft_token_ids=flat, request_id=drafts.request_id,
                         fallback=drafts.fallback, fallback_reason=drafts.fallback_reason)


def fallback_batch(sequence_ids: list[str], reason: str) -> BatchDrafts:
    """The "no drafts" answer (code 14 for every sequence, fallback=True) of a step the drafter did not answer."""
    n = len(sequence_ids)
    zeros = torch.zeros(n, dtype=torch.int64)
    return BatchDrafts(sequence_ids=list(sequence_ids), codes=torch.full((n,), UNAVAILABLE, dtype=torch.int32),
                       num_drafts=zeros, draft_token_ids=torch.empty(0, dtype=torch.int64), accepted_drafts=zeros,
                       committed_lengths=zeros.clone(), needs_resync=torch.zeros(n, dtype=torch.bool),
                       messages={i: reason for i in range(n)}, fallback=True, fallback_reason=reason,
                       predrafted=torch.zeros(n, dtype=torch.bool))


def _with_distributions(out: BatchDrafts, resp: "pb.ProposeResponse") -> BatchDrafts:
    """The reply's draft log-probabilities and top-N distributions, when it has them, into out."""
    if resp.HasField("draft_logprobs"):
        out.logprobs = decode_tensor(resp.draft_logprobs, "draft_logprobs", (pb.FLOAT32,), 1).clone()
    if resp.HasField("draft_top_k_ids"):
        out.top_k_ids = decode_tensor(resp.draft_top_k_ids, "draft_top_k_ids", (pb.INT64,), 2).clone()
        out.top_k_probs = decode_tensor(resp.draft_top_k_probs, "draft_top_k_probs", (pb.FLOAT32,), 2).clone()
    return out
