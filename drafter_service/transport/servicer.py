"""The drafter.v1.Drafter gRPC service: decode and validate, hand steps to the scheduler, encode the reply."""
import asyncio
import itertools
import json
import logging
import math
import os
import time

import grpc
import numpy as np
import torch

from drafter_service import __version__
from drafter_client.messages import upload_part_range
from drafter_client.protocol import pb, pb_grpc, step_frame
from drafter_service.runtime import Runtime
from drafter_service.engine.scheduler import StepScheduler
from drafter_service.transport.chunked import (StagingBudget, UploadRegistry, drain_refused,
                                                first_chunk_error, receive_range, receive_states, staging_tensor)
from drafter_service.transport.received_request import as_received
from drafter_service.transport.shm_regions import RegionTable, ShmSettings
from drafter_service.engine.batch_io import BatchInput, BatchOutput
from drafter_service.engine.host_staging import pinned_copy
from drafter_service.engine.proposer import large_enough_for_columns
from drafter_service.engine.scheduler import dry_outputs, set_owner
from drafter_service.engine.step_io import StepInput, StepOutput
from drafter_service import tracing
from drafter_service.logs import request_context
from drafter_service.transport.validation import (HIDDEN_DTYPES, TOKEN_DTYPES, RequestError, check_namespace, check_sequence_id,
                         parse_frame, parse_propose)
from drafter_client.protocol.wire import (encode_float32s, encode_int32s, encode_int64s, encode_tensor,
                                         tensor_field_head)

log = logging.getLogger(__name__)

MAX_RELEASE_IDS = 65536


_DRAFT_TOKEN_IDS_FIELD = 2  # ProposeResponse.draft_token_ids (proto/drafter/v1/drafter.proto)


def serialize_reply(reply: "pb.ProposeResponse | bytes") -> bytes:
    """The response serializer of Propose, ProposeStream and ProposeChunked: a reply the step thread encoded already
    (a columnar request's, DrafterServicer._propose) is its bytes; any other is a message."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def _sequence_result(sequence_id: str, code: int, message: str, num_drafts: int, accepted_drafts: int,
                     committed_length: int, predrafted: bool = False) -> "pb.SequenceResult":
    """One sequence's SequenceResult: a status only where it failed or has a message (status OK: left unset)."""
    if code == 0 and not message:
        return pb.SequenceResult(sequence_id=sequence_id, num_drafts=num_drafts, accepted_drafts=accepted_drafts,
                                 committed_length=committed_length, predrafted=predrafted)
    return pb.SequenceResult(sequence_id=sequence_id, status=pb.Status(code=code, message=message),
                             num_drafts=num_drafts, accepted_drafts=accepted_drafts, committed_length=committed_length)


def build_response(outputs: list[StepOutput], sequence_ids: list[str], request_id: int) -> "pb.ProposeResponse":
    results = [_sequence_result(sid, o.code, o.message, len(o.drafts), o.accepted_drafts, o.committed_length,
                                o.predrafted) for sid, o in zip(sequence_ids, outputs)]
    resp = pb.ProposeResponse(results=results, request_id=request_id)
    _encode_drafts(outputs, [len(o.drafts) for o in outputs], resp)
    return resp


def build_column_response(outputs: list[StepOutput], request_id: int) -> "pb.ProposeResponse":
    """The reply to a columnar request (ProposeRequest.columns): the per-sequence results as ResultColumns tensors,
    a message only for the sequences with a status; drafts, log-probabilities and top-N as build_response writes
    them."""
    resp = pb.ProposeResponse(request_id=request_id)
    cols = resp.result_columns
    codes = [o.code for o in outputs]
    counts = [len(o.drafts) for o in outputs]
    encode_int32s(codes, into=cols.status_codes)
    encode_int32s(counts, into=cols.num_drafts)
    encode_int32s([o.accepted_drafts for o in outputs], into=cols.accepted_drafts)
    encode_int64s([o.committed_length for o in outputs], into=cols.committed_lengths)
    encode_int32s([int(o.predrafted) for o in outputs], into=cols.predrafted)
    if any(codes):
        cols.problems.extend(pb.IndexedStatus(index=i, status=pb.Status(code=o.code, message=o.message))
                             for i, o in enumerate(outputs) if o.code)
    _encode_drafts(outputs, counts, resp)
    return resp


def build_batch_column_response(out: BatchOutput, request_id: int) -> "pb.ProposeResponse":
    """build_column_response of a step that ran from columns (Proposer.step_batch): every column encoded from its
    tensor, the drafts as one masked select of the [B, K] drafts."""
    if out.outputs is not None:
        return build_column_response(out.outputs, request_id)
    resp = batch_column_head(out, request_id)
    _encode_batch_drafts(out, into=resp)
    return resp


def batch_column_head(out: BatchOutput, request_id: int) -> "pb.ProposeResponse":
    """build_batch_column_response without draft_token_ids: what a step from columns knows before its drafts (its
    drafts may still be None)."""
    resp = pb.ProposeResponse(request_id=request_id)
    cols = resp.result_columns
    counts = out.num_drafts * (out.codes == 0)  # (a failed sequence has no drafts)
    encode_tensor(out.codes.to(torch.int32), into=cols.status_codes)
    encode_tensor(counts.to(torch.int32), into=cols.num_drafts)
    encode_tensor(out.accepted_drafts.to(torch.int32), into=cols.accepted_drafts)
    encode_tensor(out.committed_lengths.to(torch.int64), into=cols.committed_lengths)
    encode_tensor(torch.zeros(len(out), dtype=torch.int32), into=cols.predrafted)
    if bool(out.codes.any()):
        cols.problems.extend(pb.IndexedStatus(index=i, status=pb.Status(code=code, message=out.messages[i]))
                             for i, code in enumerate(out.codes.tolist()) if code)
    return resp


def batch_sequence_head(out: BatchOutput, sequence_ids: list[str], request_id: int) -> "pb.ProposeResponse":
    """build_response of a step that ran from columns without draft_token_ids (the reply to a request of
    SequenceStep messages decoded as columns, before its drafts are known): one SequenceResult per sequence."""
    counts = (out.num_drafts * (out.codes == 0)).tolist()  # (a failed sequence has no drafts)
    results = [_sequence_result(*r) for r in zip(sequence_ids, out.codes.tolist(), out.messages, counts,
                                                  out.accepted_drafts.tolist(), out.committed_lengths.tolist())]
    return pb.ProposeResponse(results=results, request_id=request_id)


class ReplyHead:
    """A reply encoded in two parts on the step thread, for a request whose steps run from columns (a Propose,
    ProposeStream or step-channel request): called as PendingRequest.early with the step's answer before its drafts,
    it serializes all but the drafts while the GPU drafts (None, a step that failed after it: dropped);
    reply(outputs) appends the drafts, or is None where no head was made (the caller encodes the whole reply then).
    sequence_ids: the request's, when it came as SequenceStep messages (answered as SequenceResult messages:
    batch_sequence_head); None for a columnar request (result columns: batch_column_head)."""

    def __init__(self, request_id: int, sequence_ids: list[str] | None = None):
        self.request_id = request_id
        self.sequence_ids = sequence_ids
        self.head: bytes | None = None
        self.pick: DraftPick | None = None  # (with the head: which drafts, and their field's head, known early too)
        self.drafts_head = b""

    def __call__(self, answer: "BatchOutput | None") -> None:
        if answer is None:
            self.head = None
            return
        if self.sequence_ids is None:
            self.head = batch_column_head(answer, self.request_id).SerializeToString()
        else:
            self.head = batch_sequence_head(answer, self.sequence_ids, self.request_id).SerializeToString()
        self.pick = pick = DraftPick(answer)
        self.drafts_head = tensor_field_head(_DRAFT_TOKEN_IDS_FIELD, pb.INT64, (pick.total,), 8 * pick.total)

    def reply(self, outputs: BatchOutput) -> bytes | None:
        """The whole reply, or None where no head was made: the head's bytes, then the drafts' field. Protobuf parses
        two serialized messages one after the other as their merge, and the two set no field in common, so the bytes
        parse as build_batch_column_response's (build_response's) message."""
        if self.head is None:
            return None
        return self.head + self.drafts_head + self.pick.ids(outputs.drafts).tobytes()


def frame_reply_head(out: BatchOutput, request_id: int) -> "tuple[bytes, bytes, DraftPick]":
    """A reply frame's bytes before and after its drafts (step_frame.reply_head) for a step from columns, and which
    drafts go between them, from its answer before the drafts are known (out.drafts may be None): encoded while the
    GPU drafts."""
    pick = DraftPick(out)
    codes = out.codes.numpy()
    columns = np.stack([codes.astype(np.int64), pick.counts, out.accepted_drafts.numpy(), out.committed_lengths.numpy(),
                        np.zeros(codes.shape[0], dtype=np.int64)])
    messages = {i: out.messages[i] for i in np.flatnonzero(codes).tolist()} if np.count_nonzero(codes) else {}
    return (*step_frame.reply_head(request_id, columns, pick.total, messages), pick)


def frame_reply(out: BatchOutput, request_id: int, head: "tuple[bytes, bytes, DraftPick] | None" = None) -> bytes:
    """The reply frame (drafter_client.protocol.step_frame) of a step that came as a request frame: its answer from
    the columns path (head: frame_reply_head of it, when encoded already), or from the per-sequence path
    (out.outputs). numpy throughout: a torch op on a small tensor costs several microseconds."""
    if out.outputs is not None:
        outs = out.outputs
        columns = np.array([(o.code, 0 if o.code else len(o.drafts), o.accepted_drafts, o.committed_length,
                             int(o.predrafted)) for o in outs], dtype=np.int64).reshape(len(outs), 5).T
        drafts = np.fromiter(itertools.chain.from_iterable(o.drafts for o in outs if not o.code), dtype=np.int64)
        return step_frame.write_reply(request_id, columns, drafts,
                                      {i: o.message for i, o in enumerate(outs) if o.code})
    before, after, pick = head if head is not None else frame_reply_head(out, request_id)
    return before + pick.ids(out.drafts).tobytes() + after


class DraftPick:
    """Which entries of a step from columns' [B, K] drafts its reply carries: each sequence's first num_drafts, none
    for a failed sequence, in batch order. Made from the step's answer before its drafts are known (the early reply
    work), so that after them only a reshape (every sequence drafted K) or one mask is left (numpy: a torch op on a
    small tensor costs several microseconds)."""

    def __init__(self, out: BatchOutput):
        self.counts = out.num_drafts.numpy() * (out.codes.numpy() == 0)  # [B] int64
        self.total = int(self.counts.sum())
        c = self.counts
        self.uniform = int(c[0]) if c.shape[0] and not np.count_nonzero(c - c[0]) else -1  # every count, or -1

    def ids(self, drafts: torch.Tensor) -> np.ndarray:
        """[total] little-endian int64 draft ids out of the [B, K] host drafts."""
        d = drafts.numpy()
        K = d.shape[1]
        ids = d.reshape(-1) if self.uniform == K else d[np.arange(K) < self.counts[:, None]]
        return np.ascontiguousarray(ids, dtype="<i8")


def _encode_batch_drafts(out: BatchOutput, into: "pb.ProposeResponse") -> None:
    """draft_token_ids of a step from columns (DraftPick)."""
    encode_tensor(torch.from_numpy(DraftPick(out).ids(out.drafts)), into=into.draft_token_ids)


def _encode_drafts(outputs: list[StepOutput], counts: list[int], resp: "pb.ProposeResponse") -> None:
    """draft_token_ids, and draft_logprobs / draft_top_k_* when any sequence has them, for the whole batch."""
    encode_int64s(list(itertools.chain.from_iterable(o.drafts for o in outputs)), into=resp.draft_token_ids)
    if any(o.logprobs for o in outputs):
        encode_float32s(list(itertools.chain.from_iterable(o.logprobs or [0.0] * n for o, n in zip(outputs, counts))),
                        into=resp.draft_logprobs)
    width = max((o.top_k_ids.shape[1] for o in outputs if o.top_k_ids is not None), default=0)
    if width:  # [sum k, N], rows of sequences that asked for fewer (or none) padded with -1 / 0
        total = sum(counts)
        ids = torch.full((total, width), -1, dtype=torch.int64)
        probs = torch.zeros(total, width, dtype=torch.float32)
        r = 0
        for o, n in zip(outputs, counts):
            if o.top_k_ids is not None:
                ids[r : r + n, : o.top_k_ids.shape[1]] = o.top_k_ids
                probs[r : r + n, : o.top_k_probs.shape[1]] = o.top_k_probs
            r += n
        encode_tensor(ids, into=resp.draft_top_k_ids)
        encode_tensor(probs, into=resp.draft_top_k_probs)


def shared_memory_table(runtime: Runtime) -> RegionTable | None:
    """The region table, or None where shared memory is off (--no-shared-memory, or no POSIX shm directory)."""
    cfg = runtime.config
    if not cfg.shared_memory:
        return None
    if not os.path.isdir(cfg.shm_dir):
        log.warning("shared memory off: %s is not a directory (POSIX shared memory needs Linux /dev/shm)", cfg.shm_dir)
        return None
    return RegionTable(runtime.device, ShmSettings(
        shm_dir=cfg.shm_dir, lease_s=cfg.shm_lease_s, max_lease_s=cfg.shm_max_lease_s,
        max_regions_per_namespace=cfg.shm_max_regions_per_namespace,
        max_bytes_per_namespace=cfg.shm_max_bytes_per_namespace))


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self):
        self.runtime: Runtime | None = None  # None while the model loads: RPCs answer UNAVAILABLE
        self.scheduler: StepScheduler | None = None
        self.regions: RegionTable | None = None  # shared-memory regions; None = shared memory off
        self.staging: StagingBudget | None = None  # bytes of ProposeChunked uploads in flight (attach)
        self.uploads: UploadRegistry | None = None  # uploads spread over several ProposeChunked calls (attach)
        self._sweeper: asyncio.Task | None = None
        # Benchmarks only (benchmarks/bench_data_plane.py): decode, check and stage the tensors, then answer with
        # no drafts and without running the head, to time the data plane alone.
        self.ingest_only = False
        self.rehearse_admission = False  # (attach: --no-step-channel-rehearse-admission; decode_frame)
        self.step_channel_socket = ""  # where step channels open (server.py), "" when they are off
        self.authorizer = None  # auth.Authorizer (server.py); the AuthInterceptor applies it to every call
        self.on_drain = None  # async (grace_s) -> (live sequences, grace in force): server.py's DrafterServer.drain
        self._stream_numbers = itertools.count(1)  # names the owner of a stream's sequences: "stream N"
        # columnar replies whose all but the drafts was encoded while the step ran (_propose; diagnostics, tests)
        self.early_replies = 0
        # Diagnostics (scripts/rpc_timeline.py): with DRAFTER_TRACE_RPC=PATH, one JSON line per Propose with the
        # time.perf_counter() of each phase (enter, parsed, worker_start, worker_end, resumed, replied). On Linux it
        # is CLOCK_MONOTONIC, shared by the processes of a machine, so a client on the same node can line its own
        # send/receive times up with these.
        trace_path = os.environ.get("DRAFTER_TRACE_RPC")
        self.trace_file = open(trace_path, "a", buffering=1) if trace_path else None

    def attach(self, runtime: Runtime, scheduler: StepScheduler) -> None:
        self.runtime, self.scheduler = runtime, scheduler
        self.regions = shared_memory_table(runtime)
        cfg = runtime.config
        self.rehearse_admission = cfg.step_channel_rehearse_admission
        self.staging = StagingBudget(cfg.max_chunked_bytes, cfg.max_chunked_bytes_per_namespace)
        self.uploads = UploadRegistry()
        runtime.metrics.shm = self.regions
        if self.regions is not None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_leases(), name="drafter-shm-leases")

    async def _sweep_leases(self) -> None:
        period = min(1.0, self.regions.settings.lease_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                self.regions.expire()
            except Exception:  # never let the sweeper die
                log.exception("expiring shared-memory regions")

    async def close(self) -> None:
        """Stop the lease sweeper and unmap every region (server shutdown)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        if self.regions is not None:
            self.regions.close_all()
        if self.trace_file is not None:
            self.trace_file.close()
            self.trace_file = None

    async def _ready(self, context) -> Runtime:
        if self.runtime is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is still loading its model")
        return self.runtime

    async def _fail(self, context, e: RequestError):
        log.info("refused: %s: %s", e.code.name, e.message)
        self.runtime.metrics.record_rpc_error(e.code.name)
        await context.abort(e.code, e.message)

    async def GetInfo(self, request, context):
        rt = await self._ready(context)
        free_blocks = await self.scheduler.run_exclusive(lambda: rt.kv.pool.num_free)
        return pb.GetInfoResponse(
            server_version=__version__, model_name=rt.model_name, method=rt.model.method,
            hidden_size=rt.model.dims.hidden_size, hidden_states_width=rt.limits.hidden_states_width,
            hidden_states_source=rt.hidden_states_source, target_layer_ids=rt.target_layer_ids,
            vocab_size=rt.limits.vocab_size, draft_vocab_size=rt.model.draft_vocab_size,
            parallel_drafting=rt.model.drafting == "parallel", max_top_k_probs=rt.limits.max_top_k_probs,
            max_draft_tokens=rt.limits.max_draft_tokens, max_model_len=rt.max_model_len,
            accepted_hidden_dtypes=list(HIDDEN_DTYPES), accepted_token_dtypes=list(TOKEN_DTYPES),
            model_dtype=str(rt.dtype).removeprefix("torch."), device=str(rt.device),
            kv_capacity_tokens=rt.kv.capacity_tokens, kv_block_size=rt.kv.block_size,
            kv_free_tokens=free_blocks * rt.kv.block_size, max_message_bytes=rt.config.max_message_bytes,
            shared_memory_supported=self.regions is not None,
            shared_memory_kinds=self.regions.kinds() if self.regions is not None else [],
            shared_memory_lease_seconds=math.ceil(rt.config.shm_lease_s) if self.regions is not None else 0,
            step_channel_socket=self.step_channel_socket,
            predraft_supported=rt.limits.max_predraft_branches > 0,
            max_predraft_branches=rt.limits.max_predraft_branches, step_columns_supported=True,
            max_upload_parts=rt.config.max_upload_parts, engine_applies_fc=rt.config.engine_applies_fc)

    def decode_propose(self, request, hidden: torch.Tensor | None = None,
                       states: memoryview | None = None) -> "tuple[list[StepInput] | BatchInput, bool]":
        """Check and decode one engine step (a Propose, a ProposeStream message or a step-channel request; runs on
        the event loop or on the step thread). Returns the steps, and whether to answer without running the head
        (ingest-only benchmarks); a columnar request's steps stay columns (a BatchInput, for Proposer.step_batch).
        Raises RequestError for a request that is malformed as a whole. hidden: the
        staging tensor of a ProposeChunked request (its states are not in the message); states: the inline states
        that received_request.read_request left out of the message, as a view of the received bytes."""
        rt = self.runtime
        read_shm = None
        if self.regions is not None:
            regions, namespace = self.regions, request.namespace

            def read_shm(ref, field, dtype, shape, to_host=False):
                return regions.read(namespace, ref, field, dtype, shape, to_host)

        # (inline states to pinned memory here, on CUDA: pinned_copy says why; a per-sequence request that the
        # proposer would run from columns comes as columns too, its reply still per sequence: encode_propose)
        steps = parse_propose(request, rt.limits, read_shm, hidden, states, columnar=True,
                              keep_states=pinned_copy if rt.device.type == "cuda" else None,
                              steps_as_columns=self.steps_as_columns)
        inline = states is not None or request.hidden_states.WhichOneof("data") == "raw"
        if self.ingest_only and hidden is None and inline and len(steps):
            # Inline states are still views of the message: move them to the device as the proposer would
            # (one copy), so that both data planes end with the bytes in a tensor of their own there.
            (steps.hidden_states if isinstance(steps, BatchInput)
             else torch.cat([s.hidden_states for s in steps])).to(rt.device)
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
        return steps, self.ingest_only

    def decode_frame(self, frame: "step_frame.RequestFrame",
                     rehearsal: bool = False) -> "tuple[BatchInput | list[StepInput], bool]":
        """decode_propose for a step channel's request frame: checked by validation.parse_frame (the same limits as a
        columnar request; a frame carries no shared-memory references). A step too small for the proposer's columns
        path (Proposer.takes_columns: batch 1 to 7 and a few rows, where no first-step graph runs) comes back as one
        StepInput per sequence, and so does a frame of one sequence of a few rows: its columnar parse costs about
        what the columns path saves (dev CPU: 90-107 against 67-84 us for the parse, 121 against 146 us before the
        replay), while from two sequences the columnar parse is the faster one too (105-110 against 125-131 us).
        rehearsal: the step thread re-reading its last frame while it waits, to keep this code warm
        (step_channels.ChannelSet.rehearse): the parse, and for steps that come as columns the proposer's host work
        before their launches, nothing changed (Proposer.rehearse_columns; --no-step-channel-rehearse-admission: the
        parse alone)."""
        rt = self.runtime
        steps = parse_frame(frame, rt.limits, self.steps_as_columns(len(frame.sequence_ids), frame.token_ids.shape[0]))
        if rehearsal:
            if self.rehearse_admission and not self.ingest_only and isinstance(steps, BatchInput):
                rt.proposer.rehearse_columns(steps)
        elif self.ingest_only and len(steps):  # (as decode_propose: the states onto the device)
            frame.states.to(rt.device)
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
        return steps, self.ingest_only

    def steps_as_columns(self, num_sequences: int, num_tokens: int) -> bool:
        """Whether a request of per-sequence steps (a frame, or greedy SequenceStep messages) of this size is decoded
        as columns: where the proposer runs it from columns (Proposer.takes_columns), from two sequences; a step of
        one sequence and a few rows stays a StepInput (its columnar parse costs about what the columns path saves:
        decode_frame)."""
        if num_sequences > 1:
            return self.runtime.proposer.takes_columns(num_sequences, num_tokens)
        return large_enough_for_columns(num_sequences, num_tokens)

    def encode_propose(self, outputs: "list[StepOutput] | BatchOutput", request) -> "pb.ProposeResponse":
        """The reply in the request's form: result columns to a columnar request, SequenceResult messages to one of
        per-sequence steps (also when its steps ran from columns: decode_propose)."""
        if request.HasField("columns"):
            if isinstance(outputs, BatchOutput):
                return build_batch_column_response(outputs, request.request_id)
            return build_column_response(outputs, request.request_id)
        if isinstance(outputs, BatchOutput):
            outputs = outputs.to_outputs()
        return build_response(outputs, [s.sequence_id for s in request.steps], request.request_id)

    async def _propose(self, request, transport: str = "unary", metadata=None, owner: str | None = None,
                       hidden: torch.Tensor | None = None, receive=None,
                       states: memoryview | None = None,
                       t_handler: float | None = None) -> "pb.ProposeResponse | bytes":
        """One engine step; its reply (a columnar request's as serialized bytes: serialize_reply); raises RequestError
        for a request that is malformed as a whole. transport / metadata:
        for its trace span (tracing.py; nothing is recorded while tracing is off). owner: the stream whose end frees
        the sequences this step creates (None: unary, only the lease and eviction free them). ProposeChunked:
        hidden is the staging tensor, and receive() fills it once the request checked out; t_handler: when its
        handler began, before the first chunk was read (the RPC trace's "handler")."""
        request_context.set((request.namespace, request.request_id))  # (this call's task only: log lines carry it)
        rt = self.runtime
        t_enter = time.perf_counter()
        try:
            steps, dry = self.decode_propose(request, hidden, states)
            t_checked = time.perf_counter()
            if receive is not None:
                await receive()
                if dry:  # ingest-only: the staging tensor is ours already; onto the device, as the proposer would
                    hidden.to(rt.device)
                    if rt.device.type == "cuda":
                        torch.cuda.synchronize(rt.device)
        except RequestError as e:
            if tracing.enabled():
                tracing.record_step(transport, request, {"enter": t_enter, "parsed": time.perf_counter()},
                                    e.code.name, metadata)
            raise
        if owner is not None:
            set_owner(steps, owner)
        t_parsed = time.perf_counter()
        trace = {} if self.trace_file is not None else None
        if dry:
            response = self.encode_propose(dry_outputs(steps), request)
            t_stepped = t_replied = time.perf_counter()
        elif isinstance(steps, BatchInput):
            # the reply of a request whose steps run from columns is encoded on the step thread: all but its drafts
            # while the GPU drafts (ReplyHead; result columns, or SequenceResult messages to SequenceStep messages),
            # the drafts appended as soon as they are known (finish), as a step channel's reply is; the handler
            # returns those bytes (serialize_reply passes them through)
            head = ReplyHead(request.request_id, None if request.HasField("columns") else steps.sequence_ids)

            def finish(outputs: BatchOutput) -> bytes:
                reply = head.reply(outputs)
                if reply is None:
                    return self.encode_propose(outputs, request).SerializeToString()
                self.early_replies += 1  # (the step thread's only write)
                return reply

            response = await self.scheduler.submit(steps, trace, early=head, finish=finish)
            t_stepped = t_replied = time.perf_counter()
        else:
            outputs = await self.scheduler.submit(steps, trace)
            t_stepped = time.perf_counter()
            response = self.encode_propose(outputs, request)
            t_replied = time.perf_counter()
        rt.metrics.record_rpc_timing(t_parsed - t_enter, t_stepped - t_parsed, t_replied - t_stepped)
        if trace is not None and self.trace_file is not None:  # (closed at shutdown)
            trace.update(request_id=request.request_id, enter=t_enter, checked=t_checked, parsed=t_parsed,
                         resumed=t_stepped, replied=t_replied)
            if t_handler is not None:
                trace["handler"] = t_handler
            self.trace_file.write(json.dumps(trace) + "\n")
        if tracing.enabled():
            tracing.record_step(transport, request, {"enter": t_enter, "parsed": t_parsed, "stepped": t_stepped,
                                                     "replied": t_replied}, "OK", metadata)
        return response

    async def Propose(self, request, context):
        """request: a ReceivedRequest (server.py registers received_request.read_request as the deserializer)."""
        await self._ready(context)
        received = as_received(request)
        try:
            return await self._propose(received.request, "unary", context.invocation_metadata(),
                                       states=received.states)
        except RequestError as e:
            await self._fail(context, e)

    async def ProposeChunked(self, chunks, context):
        """One step whose hidden states come in chunks (transport/chunked.py). ``chunks`` yields chunked.Chunk:
        server.py registers this method with chunked.parse_chunk as its deserializer."""
        t_handler = time.perf_counter()
        await self._ready(context)
        chunks = aiter(chunks)  # (the upload's, then drain_refused's)
        try:
            return await self._propose_chunked(chunks, context.invocation_metadata(), t_handler)
        except RequestError as e:
            if e.code != grpc.StatusCode.DEADLINE_EXCEEDED:  # (a stalled upload is not waited for again)
                await drain_refused(chunks)
            await self._fail(context, e)

    async def _propose_chunked(self, chunks, metadata, t_handler: float) -> "pb.ProposeResponse | bytes":
        # the upload (first chunk to last) within --chunked-upload-timeout-s; the step after it is not counted
        limit_s = self.runtime.config.chunked_upload_timeout_s
        deadline = asyncio.get_running_loop().time() + limit_s

        async def uploading(awaitable):
            try:
                async with asyncio.timeout_at(deadline):
                    return await awaitable
            except TimeoutError:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"the chunked upload did not finish within {limit_s:g} s "
                                   "(--chunked-upload-timeout-s)") from None

        chunks = aiter(chunks)
        first = await uploading(anext(chunks, None))
        error = first_chunk_error(first, self.runtime.config.max_upload_parts)
        if error is not None:
            raise error
        part = first.part
        if part is not None and part.index > 0:
            return await self._upload_part(first, chunks, uploading)
        request = first.request
        try:
            check_namespace(request.namespace)
            # (checks hidden_states' header: bounded size; pinned on CUDA)
            staging = staging_tensor(request, self.runtime.limits, pin=self.runtime.proposer.device.type == "cuda")
            nbytes, namespace = staging.numel() * staging.element_size(), request.namespace
            self.staging.acquire(namespace, nbytes)
        except RequestError as e:
            if part is not None:  # (its extra calls waiting for it end now)
                self.uploads.refuse(request.namespace, part.upload_id, e)
            raise
        if part is not None:
            try:
                upload = self.uploads.open(namespace, part.upload_id, staging.view(-1).view(torch.uint8), part.count)
            except RequestError:  # (an upload of that id is in flight: left alone)
                self.staging.release(namespace, nbytes)
                raise
        ended = RequestError(grpc.StatusCode.ABORTED, "the upload's first call has ended")
        try:
            async def receive():  # (the whole upload; spread: this call's part, then the extra calls')
                if part is None:
                    await uploading(receive_states(first, chunks, staging))
                else:
                    lo, hi = upload_part_range(nbytes, part.count, 0)
                    await uploading(receive_range(first, chunks, upload.flat, lo, hi, "part 0: ", upload.check_parts))
                    await uploading(upload.all_parts())
                self.runtime.metrics.record_upload(part is not None, nbytes)
            # _propose checks the whole request before receive() takes any data
            return await self._propose(request, "chunked", metadata, hidden=staging, receive=receive,
                                       t_handler=t_handler)
        except RequestError as e:
            ended = e
            raise
        finally:
            if part is not None:  # (its extra calls still reading stop, and later ones end at once, with why)
                self.uploads.close(namespace, part.upload_id, ended)
            self.staging.release(namespace, nbytes)

    async def _upload_part(self, first, chunks, uploading) -> "pb.ProposeResponse":
        """An extra call of an upload spread over several (part.index >= 1): its bytes into the staging tensor of
        the upload's first call; an empty reply once they are all in (the step's reply goes to the first call)."""
        part = first.part
        check_namespace(part.namespace)
        upload = await uploading(self.uploads.join(part.namespace, part.upload_id))
        upload.claim(part.index, part.count)
        where = f"part {part.index}: "
        try:
            upload.check_alive()
            lo, hi = upload_part_range(upload.flat.numel(), part.count, part.index)
            await uploading(receive_range(first, chunks, upload.flat, lo, hi, where, upload.check_alive))
        except RequestError as e:
            upload.part_done(part.index, e)
            raise
        except BaseException:  # (cancelled: the client went away)
            upload.part_done(part.index, RequestError(grpc.StatusCode.CANCELLED, f"{where}the call was cancelled"))
            raise
        upload.part_done(part.index)
        return pb.ProposeResponse()

    async def ProposeStream(self, request_iterator, context):
        await self._ready(context)
        replies: asyncio.Queue = asyncio.Queue()

        metadata = context.invocation_metadata()
        owner = f"stream {next(self._stream_numbers)}"  # the sequences this stream creates end with it

        async def one(received):
            req = received.request
            try:
                return await self._propose(req, "stream", metadata, owner, states=received.states)
            except RequestError as e:
                self.runtime.metrics.record_rpc_error(e.code.name)
                return pb.ProposeResponse(request_id=req.request_id, error=pb.Status(code=e.code.value[0],
                                                                                     message=e.message))

        async def read():
            # Each message is submitted as soon as it arrives (tasks start in creation order, so the scheduler
            # sees them in stream order); replies are written in the same order.
            async for req in request_iterator:
                await replies.put(asyncio.ensure_future(one(as_received(req))))
            await replies.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (fut := await replies.get()) is not None:
                yield await fut
            await reader
        finally:
            reader.cancel()
            # The stream is over (the client half-closed it, or vanished: then this task is being cancelled). Steps
            # of it still queued are skipped (cancelling their tasks cancels the futures the scheduler checks), and
            # the sequences it created are freed on the step thread after whatever batch is running.
            while not replies.empty():
                pending = replies.get_nowait()
                if pending is not None:
                    pending.cancel()
            self.scheduler.call_soon(self.runtime.proposer.release_owner, owner)

    async def Drain(self, request, context):
        await self._ready(context)
        grace = request.grace_seconds
        if not (grace >= 0 and grace <= 24 * 3600):  # (also refuses NaN)
            await self._fail(context, RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                                   f"grace_seconds {grace!r}: from 0 to 86400"))
        live, grace = await self.on_drain(grace or None)
        return pb.DrainResponse(live_sequences=live, grace_seconds=grace)

    async def Release(self, request, context):
        rt = await self._ready(context)
        try:
            check_namespace(request.namespace)
            if len(request.sequence_ids) > MAX_RELEASE_IDS:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"sequence_ids has {len(request.sequence_ids)} entries; at most {MAX_RELEASE_IDS}")
            for i, sid in enumerate(request.sequence_ids):
                check_sequence_id(sid, f"sequence_ids[{i}]")
        except RequestError as e:
            await self._fail(context, e)
        ns, ids = request.namespace, list(request.sequence_ids)

        def release():
            table = rt.proposer.table
            missing = [sid for sid in ids if not table.release(ns, sid)]
            rt.metrics.live_sequences = len(table)
            rt.metrics.kv_blocks_free = rt.kv.pool.num_free
            return missing

        missing = await self.scheduler.run_exclusive(release)
        return pb.ReleaseResponse(released=len(ids) - len(missing), not_found=missing)

    # ---- shared-memory regions (shm_regions.py, docs/shared_memory.md) ----

    async def _regions(self, context) -> RegionTable:
        await self._ready(context)
        if self.regions is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "shared memory is off on this drafter (GetInfo.shared_memory_supported is false); "
                                "send tensors inline")
        return self.regions

    async def RegisterSharedMemory(self, request, context):
        regions = await self._regions(context)
        try:
            region = regions.register(request)
        except RequestError as e:
            await self._fail(context, e)
        return pb.RegisterSharedMemoryResponse(region=region.to_pb(regions.clock()))

    async def UnregisterSharedMemory(self, request, context):
        regions = await self._regions(context)
        try:
            done, missing = regions.unregister(request.namespace, list(request.names))
        except RequestError as e:
            await self._fail(context, e)
        return pb.UnregisterSharedMemoryResponse(unregistered=done, not_found=missing)

    async def SharedMemoryStatus(self, request, context):
        regions = await self._regions(context)
        try:
            found = regions.status(request.namespace, list(request.names))
        except RequestError as e:
            await self._fail(context, e)
        now = regions.clock()
        return pb.SharedMemoryStatusResponse(regions=[r.to_pb(now) for r in found])
