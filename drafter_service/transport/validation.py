"""Turn an untrusted ProposeRequest into StepInputs, or raise RequestError naming the offending field.

Everything a client controls is checked here, before any tensor op: tensor dtypes, shapes and byte lengths,
hidden width, token ids against the vocabulary, per-step counts and limits, duplicate sequences.
Per-sequence *state* problems (unknown sequence, gap, pool full, too long) are not request errors: the proposer
answers them per sequence.
"""
import functools
import math
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np
import torch

from drafter_client.protocol import pb
from drafter_service.engine.batch_io import BatchArrays, BatchInput
from drafter_service.engine.sampling import int64_to_seed
from drafter_service.engine.step_io import StepInput
from drafter_client.protocol.step_frame import RequestFrame
from drafter_client.protocol.wire import WireError, decode_array, decode_tensor

HIDDEN_DTYPES = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16)
TOKEN_DTYPES = (pb.INT32, pb.INT64)
MAX_ID_LEN = 256
MAX_NAMESPACE_LEN = 128


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class Limits:
    hidden_states_width: int
    vocab_size: int
    max_draft_tokens: int
    max_request_tokens: int
    max_request_seqs: int
    max_top_k_probs: int = 256
    max_predraft_branches: int = 0  # largest SequenceStep.predraft_branches (0: pre-drafting not supported)
    width_note: str = ""  # said after hidden_states_width in a refusal (--engine-applies-fc: what to send instead)


def check_states_width(columns: int, limits: Limits, field: str) -> None:
    """A request's hidden states have the model's width (GetInfo.hidden_states_width)."""
    if columns != limits.hidden_states_width:
        raise invalid(f"{field} has {columns} columns; this model takes {limits.hidden_states_width} "
                      f"(GetInfo.hidden_states_width{limits.width_note})")


def check_namespace(namespace: str) -> None:
    if len(namespace) > MAX_NAMESPACE_LEN:
        raise invalid(f"namespace is {len(namespace)} characters; at most {MAX_NAMESPACE_LEN}")


def check_sequence_id(sequence_id: str, field: str) -> None:
    if not sequence_id:
        raise invalid(f"{field} is empty")
    if len(sequence_id) > MAX_ID_LEN:
        raise invalid(f"{field} is {len(sequence_id)} characters; at most {MAX_ID_LEN}")


def parse_propose(req: "pb.ProposeRequest", limits: Limits, read_shm: Callable | None = None,
                  hidden: torch.Tensor | None = None, states: memoryview | None = None,
                  columnar: bool = False,
                  keep_states: "Callable[[torch.Tensor], torch.Tensor] | None" = None,
                  steps_as_columns: "Callable[[int, int], bool] | None" = None) -> "list[StepInput] | BatchInput":
    """read_shm(ref, field, dtype, shape, to_host) resolves shared-memory references (None: refused).
    hidden: the request's hidden states when they did not come in the message (ProposeChunked's staging tensor,
    whose header chunked.staging_tensor checked); req.hidden_states is then not read. states: hidden_states.raw when
    it was read off the wire apart from the message (received_request.py; req.hidden_states has dtype and shape).
    columnar: a columnar request's steps come back as one BatchInput (no StepInput per sequence). keep_states: where
    the decoded states are kept, once checked (the server on CUDA: host_staging.pinned_copy). steps_as_columns:
    a request of per-sequence messages comes back as one BatchInput too when steps_as_columns(sequences, rows) says
    so and it is greedy and asks for no log-probabilities, top-N or pre-drafting (the step the proposer runs from
    columns: Proposer.takes_columns); its reply stays per-sequence messages (the caller's)."""
    check_namespace(req.namespace)
    tensors = None
    if req.HasField("columns"):
        if len(req.steps):
            raise invalid("the request has both steps and columns; send one of them")
        tensors = {} if columnar else None
        columns = _parse_columns(req.columns, limits, tensors)
    else:
        columns = _parse_steps(req.steps, limits)
    sids, ps, ms, nxts, ks, temps, seeds, lps, top_ns, branches = columns
    total = sum(ms)
    if total > limits.max_request_tokens:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the steps carry {total} committed tokens; at most {limits.max_request_tokens} per "
                           "request (send long prompts in chunks)")
    decoded = hidden is None  # (the states come with the request: keep_states applies)
    try:
        token_ids = decode_tensor(req.token_ids, "token_ids", TOKEN_DTYPES, rank=1,
                                  read_shm=read_shm and functools.partial(read_shm, to_host=True))
        if hidden is None:
            hidden = decode_tensor(req.hidden_states, "hidden_states", HIDDEN_DTYPES, rank=2, read_shm=read_shm,
                                   raw=states)
    except WireError as e:
        raise invalid(str(e)) from None
    if token_ids.shape[0] != total:
        raise invalid(f"token_ids has {token_ids.shape[0]} rows; the steps' num_tokens add up to {total}")
    if hidden.shape[0] != total:
        raise invalid(f"hidden_states has {hidden.shape[0]} rows; the steps' num_tokens add up to {total}")
    check_states_width(hidden.shape[1], limits, "hidden_states")
    token_ids = token_ids.to(torch.int64)
    _check_vocabulary(token_ids, limits.vocab_size)
    if keep_states is not None and decoded:
        hidden = keep_states(hidden)
    ns = req.namespace
    if tensors is not None:  # a columnar request as columns: its decoded (and checked) tensors, no list round trip
        return _batch_input(ns, sids, tensors, token_ids, hidden, lps, top_ns, branches)
    if (steps_as_columns is not None and sids and steps_as_columns(len(sids), total) and not any(temps)
            and not any(lps) and not any(top_ns) and not any(branches)):
        # (greedy: no temperature column; seeds as the int64 of the uint64 bits, as a columnar request carries them)
        columns = dict(start_positions=np.array(ps, dtype=np.int64), num_tokens=np.array(ms, dtype=np.int64),
                       next_tokens=np.array(nxts, dtype=np.int64), num_drafts=np.array(ks, dtype=np.int64),
                       seeds=np.array(seeds, dtype=np.uint64).view(np.int64))
        return _batch_input(ns, sids, columns, token_ids, hidden, lps, top_ns, branches)
    return _step_inputs(ns, sids, ps, ms, nxts, ks, temps, seeds, lps, top_ns, branches, token_ids, hidden)


def _step_inputs(ns: str, sids: list[str], ps: list[int], ms: list[int], nxts: list[int], ks: list[int],
                 temps: list[float], seeds: list[int], lps: list[bool], top_ns: list[int], branches: list[int],
                 token_ids: torch.Tensor, hidden: torch.Tensor) -> list[StepInput]:
    """One StepInput per sequence from a checked request's columns (lists; seeds as uint64 values), its token ids and
    its states split by num_tokens (views)."""
    if len(ms) == 1:  # (the common decode step at batch 1: no split)
        per_step = [(token_ids, hidden)]
    else:
        per_step = zip(token_ids.split(ms), hidden.split(ms))
    return [StepInput(namespace=ns, sequence_id=sid, start_position=p, token_ids=tok, hidden_states=hid,
                      next_token=nxt, num_drafts=k, temperature=t, seed=seed, return_logprobs=lp, top_k_probs=top_n,
                      predraft_branches=f)
            for sid, p, nxt, k, t, seed, lp, top_n, f, (tok, hid)
            in zip(sids, ps, nxts, ks, temps, seeds, lps, top_ns, branches, per_step)]


def _batch_input(namespace: str, sids: list[str], tensors: dict, token_ids: torch.Tensor, hidden: torch.Tensor,
                 lps: list[bool], top_ns: list[int], branches: list[int]) -> BatchInput:
    """A checked columnar request's BatchInput from its decoded columns (numpy views of the message; optional ones
    absent: zeros), each a tensor of its own."""
    n = len(sids)
    get = lambda name, dtype: tensors[name].astype(dtype) if name in tensors else np.zeros(n, dtype=dtype)  # noqa: E731
    arrays = BatchArrays(
        start_positions=get("start_positions", np.int64), num_tokens=get("num_tokens", np.int64),
        token_ids=token_ids.numpy(), next_tokens=get("next_tokens", np.int64), num_drafts=get("num_drafts", np.int64),
        temperatures=get("temperatures", np.float32), seeds=get("seeds", np.int64),
        # (one value for the whole request; np.zeros costs a sixth of np.full at these sizes)
        return_logprobs=np.ones(n, dtype=bool) if n and lps[0] else np.zeros(n, dtype=bool),
        top_k_probs=np.full(n, top_ns[0], dtype=np.int64) if n and top_ns[0] else np.zeros(n, dtype=np.int64),
        predraft_branches=get("predraft_branches", np.int64) if any(branches) else np.zeros(n, dtype=np.int64))
    return BatchInput.from_arrays(namespace, sids, arrays, token_ids, hidden)


def _check_sequence_count(n: int, limits: Limits) -> None:
    if n > limits.max_request_seqs:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"steps has {n} sequences; at most {limits.max_request_seqs} per request")


def _parse_steps(steps, limits: Limits) -> tuple[list, ...]:
    """The per-sequence SequenceStep messages, checked, as ten parallel lists (parse_propose's columns)."""
    _check_sequence_count(len(steps), limits)
    # One pass over the steps, each field read once (protobuf attribute access is the cost at large batches); the
    # precise error is worked out only for a step that fails the combined check (_step_error).
    seen: set[str] = set()
    # (sequence_id, start_position, num_tokens, next_token, num_drafts, temperature, seed, logprobs, N, branches)
    fields = []
    max_k, vocab, max_n = limits.max_draft_tokens, limits.vocab_size, limits.max_top_k_probs
    # a server that cannot pre-draft ignores the field (it is a hint); one that can refuses a budget above its limit
    max_f = limits.max_predraft_branches or 2**32
    for i, s in enumerate(steps):
        sid, p, m, nxt, k = s.sequence_id, s.start_position, s.num_tokens, s.next_token, s.num_drafts
        sp, f = s.sampling, s.predraft_branches
        t, top_n = sp.temperature, sp.top_k_probs
        if (not 0 < len(sid) <= MAX_ID_LEN or sid in seen or p < 0 or m < 1 or k > max_k or not 0 <= nxt < vocab
                or not 0 <= t < math.inf or top_n > max_n or f > max_f):
            _step_error(i, s, seen, limits)
        seen.add(sid)
        fields.append((sid, p, m, nxt, k, t, sp.seed, sp.return_logprobs, top_n,
                       f if limits.max_predraft_branches else 0))
    if not fields:
        return ([],) * 10
    return tuple(list(column) for column in zip(*fields))


INT_DTYPES = (pb.INT32, pb.INT64)


def committed_rows(req: "pb.ProposeRequest") -> int:
    """The request's committed tokens (rows of token_ids / hidden_states) as its steps or columns give them, before
    the rest of the request is read (ProposeChunked sizes its staging tensor with it); the column is checked."""
    if not req.HasField("columns"):
        return sum(s.num_tokens for s in req.steps)
    c = req.columns
    try:
        m = decode_tensor(c.num_tokens, "columns.num_tokens", INT_DTYPES, rank=1).to(torch.int64)
    except WireError as e:
        raise invalid(str(e)) from None
    if m.shape[0] != len(c.sequence_ids):
        raise invalid(f"columns.num_tokens has {m.shape[0]} values for {len(c.sequence_ids)} sequence_ids")
    if bool((m < 1).any()):
        i = int((m < 1).nonzero()[0, 0])
        raise invalid(f"columns.num_tokens[{i}] is {m[i].item()}; a step carries at least one committed token")
    return sum(m.tolist())  # (python ints: a torch sum of int64 values wraps around)


def _parse_columns(c: "pb.StepColumns", limits: Limits, tensors: dict | None = None) -> tuple[list, ...]:
    """A columnar request's steps (StepColumns), checked, as the ten lists of parse_propose. Each column is decoded
    as one numpy view and turned into a list in one call; the range checks are min/max over the lists (C
    loops, no tensor op per check: cheap at any batch size). Each error names the column and the first offending
    index."""
    sids = list(c.sequence_ids)
    _check_ids(sids, limits, "columns.sequence_ids")
    n = len(sids)
    arrays = {}
    for name, allowed, optional in (("start_positions", INT_DTYPES, False), ("num_tokens", INT_DTYPES, False),
                                    ("next_tokens", INT_DTYPES, False), ("num_drafts", INT_DTYPES, False),
                                    ("temperatures", (pb.FLOAT32,), True), ("seeds", (pb.INT64,), True),
                                    ("predraft_branches", INT_DTYPES, True)):
        if optional and not c.HasField(name):
            continue
        try:  # (a numpy view: a torch one costs several microseconds more, per column)
            x = decode_array(getattr(c, name), f"columns.{name}", allowed, rank=1)
        except WireError as e:
            raise invalid(str(e)) from None
        if x.shape[0] != n:
            raise invalid(f"columns.{name} has {x.shape[0]} values for {n} sequence_ids")
        arrays[name] = x
    if tensors is not None:  # (the decoded columns, kept for a BatchInput)
        tensors.update(arrays)
    p, m, nxt, k, t, seeds, f = _check_columns(arrays, n, limits, "columns")
    if c.top_k_probs > limits.max_top_k_probs:
        raise invalid(f"columns.top_k_probs is {c.top_k_probs}; at most {limits.max_top_k_probs} "
                      "(GetInfo.max_top_k_probs)")
    return sids, p, m, nxt, k, t, seeds, [c.return_logprobs] * n, [c.top_k_probs] * n, f


def _check_ids(sids: list[str], limits: Limits, field: str) -> None:
    """A columnar step's sequence ids: their count, each id's length, no id twice."""
    n = len(sids)
    _check_sequence_count(n, limits)
    if n:
        lens = list(map(len, sids))
        if min(lens) == 0 or max(lens) > MAX_ID_LEN:
            i = next(i for i, length in enumerate(lens) if not 0 < length <= MAX_ID_LEN)
            check_sequence_id(sids[i], f"{field}[{i}]")
        if len(set(sids)) != n:
            seen: set[str] = set()
            i = next(i for i, sid in enumerate(sids) if sid in seen or seen.add(sid))
            raise invalid(f"{field}[{i}] {sids[i]!r} appears twice in one request")


def _check_columns(arrays: dict[str, np.ndarray], n: int, limits: Limits, prefix: str) -> tuple[list, ...]:
    """The per-sequence columns of a columnar step ([n] numpy arrays by name; the optional temperatures, seeds and
    predraft_branches may be absent: zeros), checked, as the lists (p, m, next tokens, k, temperatures, seeds as
    uint64 values, pre-drafting budgets). Each error names {prefix}.{column}[first offending index]."""
    def values(name: str) -> list:
        return arrays[name].tolist() if name in arrays else [0] * n

    def check(name: str, values: list, ok: Callable, why: str) -> None:
        i = next(i for i, v in enumerate(values) if not ok(v))
        raise invalid(f"{prefix}.{name}[{i}] is {values[i]}; {why}")

    p, m, nxt, k = values("start_positions"), values("num_tokens"), values("next_tokens"), values("num_drafts")
    t, seeds, f = values("temperatures"), values("seeds"), values("predraft_branches")
    vocab, max_k = limits.vocab_size, limits.max_draft_tokens
    max_f = limits.max_predraft_branches or 2**32  # (a server that cannot pre-draft ignores the column)
    if n:
        if min(p) < 0:
            check("start_positions", p, lambda v: v >= 0, "positions are >= 0")
        if min(m) < 1:
            check("num_tokens", m, lambda v: v >= 1, "a step carries at least one committed token")
        if min(nxt) < 0 or max(nxt) >= vocab:
            check("next_tokens", nxt, lambda v: 0 <= v < vocab, f"outside the vocabulary [0, {vocab})")
        if min(k) < 0 or max(k) > max_k:
            check("num_drafts", k, lambda v: 0 <= v <= max_k,
                  f"this server drafts 0 to {max_k} (GetInfo.max_draft_tokens)")
        if min(t) < 0 or not math.isfinite(sum(t)):  # (the sum is finite exactly when every value is)
            check("temperatures", t, lambda v: 0 <= v < math.inf, "must be finite and >= 0")
        if min(f) < 0 or max(f) > max_f:
            check("predraft_branches", f, lambda v: 0 <= v <= max_f,
                  f"at most {limits.max_predraft_branches} (GetInfo.max_predraft_branches)")
        if min(seeds) < 0:  # the wire's uint64 seeds travel as int64 bits: back to the uint64 value
            seeds = [int64_to_seed(s) for s in seeds]
    if not limits.max_predraft_branches:
        f = [0] * n
    return p, m, nxt, k, t, seeds, f


def parse_frame(frame: RequestFrame, limits: Limits, columnar: bool = True) -> "BatchInput | list[StepInput]":
    """A step channel's request frame (drafter_client.protocol.step_frame), checked as parse_propose checks a
    columnar ProposeRequest (the same limits; errors name frame.<column>[index]), as one BatchInput; columnar False:
    as one StepInput per sequence instead (a step the proposer runs per sequence anyway: no BatchInput to build and
    take apart again)."""
    check_namespace(frame.namespace)
    sids = frame.sequence_ids
    _check_ids(sids, limits, "frame.sequence_ids")
    n = len(sids)
    arrays = dict(frame.columns, temperatures=frame.temperatures)
    ps, ms, nxts, ks, temps, seeds, branches = _check_columns(arrays, n, limits, "frame")
    total = int(frame.token_ids.shape[0])
    if sum(ms) != total:  # (no sequence, no token)
        raise invalid(f"frame.token_ids has {total} rows; the steps' num_tokens add up to {sum(ms)}")
    if total > limits.max_request_tokens:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the steps carry {total} committed tokens; at most {limits.max_request_tokens} per "
                           "request (send long prompts in chunks)")
    hidden = frame.states
    check_states_width(hidden.shape[1], limits, "frame.states")
    token_ids = torch.from_numpy(frame.token_ids)
    _check_vocabulary(token_ids, limits.vocab_size)
    if not columnar:
        return _step_inputs(frame.namespace, sids, ps, ms, nxts, ks, temps, seeds, [False] * n, [0] * n, branches,
                            token_ids, hidden)
    return _batch_input(frame.namespace, sids, arrays, token_ids, hidden, [False] * n, [0] * n, branches)


SMALL_CHECK_TOKENS = 64  # up to this many token ids, the range check runs in python (cheaper than numpy)


def _check_vocabulary(token_ids: torch.Tensor, vocab: int) -> None:
    """Raise naming the first token id outside [0, vocab) (token_ids: [T] int64 on the host)."""
    if token_ids.shape[0] <= SMALL_CHECK_TOKENS:
        ids = token_ids.tolist()
        if not ids or (min(ids) >= 0 and max(ids) < vocab):
            return
        r = next(r for r, t in enumerate(ids) if not 0 <= t < vocab)
    else:  # (numpy: two reductions, some 2 us; the torch ops on a small tensor cost 6-7)
        ids = token_ids.numpy()
        if ids.min() >= 0 and ids.max() < vocab:
            return
        r = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
    raise invalid(f"token_ids[{r}] = {int(token_ids[r])} is outside the vocabulary [0, {vocab})")


def _step_error(i: int, s: "pb.SequenceStep", seen: set[str], limits: Limits) -> None:
    """Raise the RequestError naming what is wrong with steps[i] (which failed parse_propose's combined check)."""
    f = f"steps[{i}]"
    check_sequence_id(s.sequence_id, f"{f}.sequence_id")
    if s.sequence_id in seen:
        raise invalid(f"{f}.sequence_id {s.sequence_id!r} appears twice in one request")
    if s.start_position < 0:
        raise invalid(f"{f}.start_position is {s.start_position}; positions are >= 0")
    if s.num_tokens < 1:
        raise invalid(f"{f}.num_tokens is 0; a step carries at least one committed token")
    if s.num_drafts > limits.max_draft_tokens:
        raise invalid(f"{f}.num_drafts is {s.num_drafts}; this server drafts at most "
                      f"{limits.max_draft_tokens} (GetInfo.max_draft_tokens)")
    if not 0 <= s.next_token < limits.vocab_size:
        raise invalid(f"{f}.next_token {s.next_token} is outside the vocabulary [0, {limits.vocab_size})")
    t = s.sampling.temperature
    if not math.isfinite(t) or t < 0:
        raise invalid(f"{f}.sampling.temperature is {t}; must be finite and >= 0")
    if s.sampling.top_k_probs > limits.max_top_k_probs:
        raise invalid(f"{f}.sampling.top_k_probs is {s.sampling.top_k_probs}; at most {limits.max_top_k_probs} "
                      "(GetInfo.max_top_k_probs)")
    if limits.max_predraft_branches and s.predraft_branches > limits.max_predraft_branches:
        raise invalid(f"{f}.predraft_branches is {s.predraft_branches}; at most {limits.max_predraft_branches} "
                      "(GetInfo.max_predraft_branches)")
    raise AssertionError(f"{f} failed the combined check but none of the precise ones")  # keep the two in sync
