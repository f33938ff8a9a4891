"""Property-based fuzzing (hypothesis) of a running drafter: malformed Propose requests, over gRPC and through a
step channel, and malformed request frames (step_frame.py), get a documented status and never INTERNAL / UNKNOWN,
never a crash or a hang; a victim sequence in another namespace, stepped between the fuzz cases, keeps getting
drafts identical to the naive reference.

Each case starts from a well-formed request and breaks it in a few random ways at once (dtypes, shapes, byte
lengths, ids, positions, k, sampling settings, shared-memory references, namespaces), so that every validation
path is reached with neighbouring fields both valid and invalid.
"""
import math
import struct

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafter_client import SequenceStep
from drafter_client.messages import build_request
from drafter_client.protocol import pb, pb_grpc
from drafter_client.step_channel import StepChannel, StepChannelError
from naive_eagle import NaiveEagle1

H, V, K_MAX = 64, 512, 8  # the tiny test head (conftest.tiny_model) and the server's max_draft_tokens

# What a whole request may be refused with (docs/protocol.md); per-sequence statuses in a reply likewise.
REQUEST_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.OUT_OF_RANGE}
SEQUENCE_CODES = {0, 3, 5, 8, 9, 11}
OUTCOMES: dict[str, int] = {}  # status name -> fuzz cases that got it (the last test checks the spread)
COLUMN_OUTCOMES: dict[str, int] = {}  # the same, of the columnar requests alone
FUZZ_SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

DTYPES = [pb.DType.Value(n) for n in pb.DType.keys()] + [99, -1]
ints = st.one_of(st.integers(-3, 40), st.sampled_from([2**31, 2**40, 2**62, -(2**40), V, V - 1]))
names = st.one_of(st.text(max_size=12), st.sampled_from(["", "x" * 300, "\x00", "a/../b", "é" * 80]))


def good_request(namespace: str, sid: str, m: int = 4) -> "pb.ProposeRequest":
    g = torch.Generator().manual_seed(m)
    step = SequenceStep(sid, 0, torch.randint(0, V, (m,), generator=g).tolist(), torch.randn(m, H, generator=g),
                        int(torch.randint(0, V, (1,), generator=g)), 3)
    return build_request(namespace, [step])


@st.composite
def mutations(draw):
    """A list of (field, value) edits to apply to a well-formed request (1 to 4 of them)."""
    edits = st.one_of(
        st.tuples(st.just("token_dtype"), st.sampled_from(DTYPES)),
        st.tuples(st.just("hidden_dtype"), st.sampled_from(DTYPES)),
        st.tuples(st.just("token_shape"), st.lists(ints, max_size=3)),
        st.tuples(st.just("hidden_shape"), st.lists(ints, max_size=3)),
        st.tuples(st.just("token_raw"), st.binary(max_size=64)),
        st.tuples(st.just("hidden_raw_cut"), st.integers(-9, 9)),
        st.tuples(st.just("hidden_nan"), st.sampled_from([math.nan, math.inf, -math.inf, 1e38])),
        st.tuples(st.just("num_tokens"), st.integers(0, 2**32 - 1)),
        st.tuples(st.just("start_position"), st.one_of(ints, st.integers(-(2**63), 2**63 - 1))),
        st.tuples(st.just("next_token"), st.one_of(ints, st.integers(-(2**63), 2**63 - 1))),
        st.tuples(st.just("num_drafts"), st.one_of(st.integers(0, 12), st.integers(0, 2**32 - 1))),
        st.tuples(st.just("sequence_id"), names),
        st.tuples(st.just("namespace"), names),
        st.tuples(st.just("temperature"), st.floats(allow_nan=True, allow_infinity=True, width=32)),
        st.tuples(st.just("top_k_probs"), st.integers(0, 2**32 - 1)),
        st.tuples(st.just("seed"), st.integers(0, 2**64 - 1)),
        st.tuples(st.just("extra_step"), st.integers(0, 6)),
        st.tuples(st.just("drop_steps"), st.just(True)),
        st.tuples(st.just("shm"), st.tuples(names, st.integers(-5, 2**40), st.integers(-5, 2**40))),
    )
    return draw(st.lists(edits, min_size=1, max_size=4))


def apply(req: "pb.ProposeRequest", edits) -> "pb.ProposeRequest":
    r = pb.ProposeRequest()
    r.CopyFrom(req)
    for field, value in edits:
        s = r.steps[0] if r.steps else None
        if field == "token_dtype":
            r.token_ids.dtype = value
        elif field == "hidden_dtype":
            r.hidden_states.dtype = value
        elif field == "token_shape":
            del r.token_ids.shape[:]
            r.token_ids.shape.extend(value)
        elif field == "hidden_shape":
            del r.hidden_states.shape[:]
            r.hidden_states.shape.extend(value)
        elif field == "token_raw":
            r.token_ids.raw = value
        elif field == "hidden_raw_cut" and r.hidden_states.WhichOneof("data") == "raw":
            raw = r.hidden_states.raw
            r.hidden_states.raw = raw[:value] if value < 0 else raw + b"\x00" * value
        elif field == "hidden_nan" and r.hidden_states.WhichOneof("data") == "raw" and r.hidden_states.raw:
            raw = bytearray(r.hidden_states.raw)
            raw[:4] = struct.pack("<f", value)
            r.hidden_states.raw = bytes(raw)
        elif field in ("num_tokens", "start_position", "next_token", "num_drafts", "sequence_id") and s:
            setattr(s, field, value)
        elif field == "namespace":
            r.namespace = value
        elif field in ("temperature", "top_k_probs", "seed") and s:
            setattr(s.sampling, field, value)
        elif field == "extra_step":
            r.steps.add(sequence_id=f"extra{value}", start_position=value, num_tokens=value, num_drafts=value % 9)
        elif field == "drop_steps":
            del r.steps[:]
        elif field == "shm":
            region, offset, size = value
            r.hidden_states.shm.CopyFrom(pb.SharedMemoryRef(region=region, offset=max(0, offset),
                                                            byte_size=max(0, size)))
    return r


class Victim:
    """A sequence in its own namespace stepped between fuzz cases; its drafts must equal the naive reference."""

    def __init__(self, stub, naive: NaiveEagle1, sequence_id: str = "victim"):
        self.stub, self.naive, self.sequence_id = stub, naive, sequence_id
        g = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, V, (64,), generator=g).tolist()
        self.hidden = torch.randn(64, H, generator=g)
        self.length = 0  # committed so far (the first step creates the sequence at position 0)
        self.checked = 0

    def step(self) -> None:
        p = max(0, self.length - 3)
        m = self.length + 1 - p if self.length < 60 else 1
        if self.length >= 60:  # start over from position 0 (re-sent positions are allowed)
            p, m, self.length = 0, 8, 7
        step = SequenceStep(self.sequence_id, p, self.tokens[p : p + m], self.hidden[p : p + m], self.tokens[p + m], 3)
        reply = self.stub.Propose(build_request("victim-ns", [step]), timeout=30)
        res = reply.results[0]
        assert res.status.code == 0, res.status.message
        drafts = list(struct.unpack(f"<{res.num_drafts}q", reply.draft_token_ids.raw))
        expected = self.naive.drafts(self.tokens[: p + m + 1], self.hidden[: p + m], 3)
        assert drafts == expected, (p, m, drafts, expected)
        self.length = p + m
        self.checked += 1


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, tmp_path_factory):
    from conftest import ServerThread, make_config

    head, target = tiny_model
    cfg = make_config(head, target, tmp_path_factory.mktemp("fuzz"), max_model_len=128, kv_cache_tokens=4096)
    with ServerThread(cfg) as s:
        channel = grpc.insecure_channel(s.tcp)
        yield s, pb_grpc.DrafterStub(channel)
        channel.close()


def check_reply(reply: "pb.ProposeResponse") -> None:
    for res in reply.results:
        assert res.status.code in SEQUENCE_CODES, (res.status.code, res.status.message)
    if reply.HasField("result_columns"):
        codes = torch.frombuffer(bytearray(reply.result_columns.status_codes.raw), dtype=torch.int32).tolist()
        assert set(codes) <= SEQUENCE_CODES, codes
        assert {p.index for p in reply.result_columns.problems} == {i for i, c in enumerate(codes) if c}


# ---- columnar requests (ProposeRequest.columns) ----

COLUMNS = ["start_positions", "num_tokens", "next_tokens", "num_drafts", "temperatures", "seeds", "predraft_branches"]


def good_column_request(namespace: str, prefix: str) -> "pb.ProposeRequest":
    from drafter_client import StepBatch
    from drafter_client.batch import build_column_request
    from drafter_client.protocol.wire import encode_tensor

    g = torch.Generator().manual_seed(3)
    batch = StepBatch(sequence_ids=[f"{prefix}a", f"{prefix}b"], start_positions=torch.tensor([0, 0]),
                      num_tokens=torch.tensor([3, 2]), token_ids=torch.randint(0, V, (5,), generator=g),
                      hidden_states=torch.randn(5, H, generator=g), next_tokens=torch.tensor([7, 9]),
                      num_drafts=torch.tensor([3, 2]), temperature=torch.tensor([0.0, 0.8]),
                      seed=torch.tensor([1, -5]), predraft_branches=torch.tensor([0, 4]))
    req = build_column_request(namespace, batch)
    encode_tensor(batch.hidden_states, into=req.hidden_states)
    return req


@st.composite
def column_mutations(draw):
    """Edits of a well-formed columnar request: its columns' dtypes, shapes, bytes and values, its ids, a step
    beside the columns, a shared-memory reference in a column; mixed with the edits of the tensors (mutations)."""
    column = st.sampled_from(COLUMNS)
    edits = st.one_of(
        st.tuples(st.just("col_dtype"), st.tuples(column, st.sampled_from(DTYPES))),
        st.tuples(st.just("col_shape"), st.tuples(column, st.lists(ints, max_size=3))),
        st.tuples(st.just("col_raw"), st.tuples(column, st.binary(max_size=40))),
        st.tuples(st.just("col_value"), st.tuples(column, st.integers(0, 1),
                                                  st.one_of(ints, st.integers(-(2**63), 2**63 - 1)))),
        st.tuples(st.just("col_unset"), column),
        st.tuples(st.just("col_shm"), column),
        st.tuples(st.just("ids"), st.lists(names, max_size=4)),
        st.tuples(st.just("add_step"), st.just(True)),
        st.tuples(st.just("col_top_k"), st.integers(0, 2**32 - 1)),
    )
    column_edits = draw(st.lists(edits, min_size=1, max_size=3))
    return column_edits + (draw(mutations()) if draw(st.booleans()) else [])


def apply_columns(req: "pb.ProposeRequest", edits) -> "pb.ProposeRequest":
    r = pb.ProposeRequest()
    r.CopyFrom(req)
    c = r.columns
    rest = []
    for field, value in edits:
        if field == "col_dtype":
            getattr(c, value[0]).dtype = value[1]
        elif field == "col_shape":
            t = getattr(c, value[0])
            del t.shape[:]
            t.shape.extend(value[1])
        elif field == "col_raw":
            getattr(c, value[0]).raw = value[1]
        elif field == "col_value":
            t = getattr(c, value[0])
            size = 4 if t.dtype in (pb.INT32, pb.FLOAT32) else 8
            raw = bytearray(t.raw)
            if len(raw) >= (value[1] + 1) * size:
                packed = (struct.pack("<f", float(value[2])) if t.dtype == pb.FLOAT32 else
                          struct.pack("<q", value[2]) if size == 8 else struct.pack("<i", value[2] % 2**31))
                raw[value[1] * size:(value[1] + 1) * size] = packed
                t.raw = bytes(raw)
        elif field == "col_unset":
            c.ClearField(value)
        elif field == "col_shm":
            getattr(c, value).shm.CopyFrom(pb.SharedMemoryRef(region="r", offset=0, byte_size=16))
        elif field == "ids":
            del c.sequence_ids[:]
            c.sequence_ids.extend(value)
        elif field == "add_step":
            r.steps.add(sequence_id="extra", num_tokens=1)
        elif field == "col_top_k":
            c.top_k_probs = value
        else:
            rest.append((field, value))
    return apply(r, rest)


@FUZZ_SETTINGS
@given(edits=column_mutations())
def test_malformed_columnar_propose_gets_a_documented_status(fuzz_server, tiny_model, edits):
    server, stub = fuzz_server
    cache = test_malformed_columnar_propose_gets_a_documented_status
    if getattr(cache, "victim", None) is None:
        cache.victim = Victim(stub, NaiveEagle1(*tiny_model), "victim-cols")
    req = apply_columns(good_column_request("fuzz-cols", "k"), edits)
    try:
        check_reply(stub.Propose(req, timeout=30))
        outcome = "OK"
    except grpc.RpcError as e:
        assert e.code() in REQUEST_CODES, (e.code(), e.details(), edits)
        assert e.details(), "a refusal names the problem"
        outcome = e.code().name
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
    COLUMN_OUTCOMES[outcome] = COLUMN_OUTCOMES.get(outcome, 0) + 1
    cache.victim.step()


@FUZZ_SETTINGS
@given(edits=mutations())
def test_malformed_propose_gets_a_documented_status(fuzz_server, tiny_model, edits):
    server, stub = fuzz_server
    victim = getattr(test_malformed_propose_gets_a_documented_status, "victim", None)
    if victim is None:
        victim = test_malformed_propose_gets_a_documented_status.victim = Victim(stub, NaiveEagle1(*tiny_model))
    req = apply(good_request("fuzz", "s0"), edits)
    try:
        check_reply(stub.Propose(req, timeout=30))
        outcome = "OK"
    except grpc.RpcError as e:
        assert e.code() in REQUEST_CODES, (e.code(), e.details(), edits)
        assert e.details(), "a refusal names the problem"
        outcome = e.code().name
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
    victim.step()


@FUZZ_SETTINGS
@given(edits=mutations())
def test_malformed_step_channel_requests_get_a_documented_status(fuzz_server, tiny_model, edits):
    server, stub = fuzz_server
    cache = test_malformed_step_channel_requests_get_a_documented_status
    if getattr(cache, "channel", None) is None or cache.channel.closed:
        path = server.server.config.step_channel_path()
        cache.channel = StepChannel.open(path, "fuzz", 1 << 20, 1 << 20)
        cache.victim = Victim(stub, NaiveEagle1(*tiny_model))
    req = apply(good_request("fuzz", "c0"), edits)
    payload = req.SerializeToString()
    if len(payload) > cache.channel.request_capacity:
        return
    assert cache.channel.try_claim()
    try:
        reply = pb.ProposeResponse.FromString(cache.channel.call_blocking(payload, timeout=30))
        if reply.HasField("error") and reply.error.code:
            assert grpc.StatusCode(_code(reply.error.code)) in REQUEST_CODES, reply.error
        else:
            check_reply(reply)
    except StepChannelError as e:  # the channel is closed after a refused request on it: reopen next time
        assert e.code in REQUEST_CODES, (e.code, e.message, edits)
    cache.victim.step()


FRAME_OUTCOMES: dict[str, int] = {}  # the request frames' outcomes (step_frame.py)


@st.composite
def frame_mutations(draw):
    """Edits to a well-formed request frame's bytes: header fields, column values, flipped bytes, a cut or an
    extension (1 to 4 of them)."""
    u32 = st.one_of(st.integers(0, 40), st.sampled_from([2**31, 2**32 - 1, 2**28, 2**28 + 1]))
    edits = st.one_of(
        st.tuples(st.just("header"), st.tuples(st.integers(1, 8), u32)),  # (n, t, w, dtype, flags, rid, ids, ns)
        st.tuples(st.just("column"), st.tuples(st.integers(0, 5), st.one_of(ints, st.integers(-(2**63), 2**63 - 1)))),
        st.tuples(st.just("temperature"), st.floats(allow_nan=True, allow_infinity=True, width=32)),
        st.tuples(st.just("flip"), st.tuples(st.integers(0, 10**6), st.integers(0, 255))),
        st.tuples(st.just("cut"), st.integers(1, 64)),
        st.tuples(st.just("extend"), st.binary(min_size=1, max_size=16)),
    )
    return draw(st.lists(edits, min_size=1, max_size=4))


def _frame(namespace: str, edits) -> bytes:
    from drafter_client.batch import frame_from_steps
    from drafter_client.protocol import step_frame

    g = torch.Generator().manual_seed(4)
    steps = [SequenceStep(f"f{i}", 0, torch.randint(0, V, (3,), generator=g).tolist(),
                          torch.randn(3, H, generator=g), int(torch.randint(0, V, (1,), generator=g)), 3)
             for i in range(2)]
    data = bytearray(bytes(frame_from_steps(namespace, steps, None, 5)))
    header = step_frame.REQUEST_HEADER
    for kind, value in edits:
        if kind == "header":
            fields = list(header.unpack_from(data))
            i, v = value
            fields[i] = v
            data[: header.size] = header.pack(*fields)
        elif kind == "column":  # [6, 2] int64 right after the header
            col, v = value
            struct.pack_into("<q", data, header.size + 16 * col, v)
        elif kind == "temperature":  # [2] float32 after the columns
            struct.pack_into("<f", data, header.size + 96, value)
        elif kind == "flip":
            where, v = value
            data[where % len(data)] = v
        elif kind == "cut":
            data = data[: max(0, len(data) - value)]
        else:
            data += value
    return bytes(data)


@FUZZ_SETTINGS
@given(edits=frame_mutations())
def test_malformed_request_frames_get_a_documented_status(fuzz_server, tiny_model, edits):
    """Request frames (a channel that speaks them) broken in a few ways at once: a reply frame whose counts add up,
    or an error reply with a documented code; the victim in another namespace keeps drafting as the reference."""
    from drafter_client.protocol import step_frame

    server, stub = fuzz_server
    cache = test_malformed_request_frames_get_a_documented_status
    if getattr(cache, "channel", None) is None or cache.channel.closed:
        path = server.server.config.step_channel_path()
        cache.channel = StepChannel.open(path, "fuzz-frames", 1 << 20, 1 << 20)
        assert cache.channel.frames
        cache.victim = Victim(stub, NaiveEagle1(*tiny_model), sequence_id="frames-victim")
    payload = _frame("fuzz-frames", edits)
    if not payload.startswith(step_frame.REQUEST_MAGIC):  # (a flipped magic: then it is a protobuf request)
        return
    assert cache.channel.try_claim()
    try:
        reply = cache.channel.call_blocking(payload, timeout=30)
        if step_frame.starts_with(reply, step_frame.REPLY_MAGIC):
            got = step_frame.read_reply(reply, 2)  # (the frame was answered: it held the two sequences)
            assert all(c in SEQUENCE_CODES for c in got.codes.tolist()), got
            outcome = "OK"
        else:
            err = pb.ProposeResponse.FromString(reply).error
            code = grpc.StatusCode(_code(err.code))
            assert code in REQUEST_CODES and err.message, (code, err.message, edits)
            outcome = code.name
    except StepChannelError as e:
        assert e.code in REQUEST_CODES, (e.code, e.message, edits)
        outcome = e.code.name
    FRAME_OUTCOMES[outcome] = FRAME_OUTCOMES.get(outcome, 0) + 1
    cache.victim.step()


def _code(number: int):
    return next(c for c in grpc.StatusCode if c.value[0] == number).value


def test_the_fuzzed_server_still_serves(fuzz_server):
    """After the fuzz tests (module order): health SERVING and the victims still checked against the reference."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server, stub = fuzz_server
    with grpc.insecure_channel(server.tcp) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="drafter.v1.Drafter"))
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    victims = [getattr(f, "victim", None) for f in (test_malformed_propose_gets_a_documented_status,
                                                     test_malformed_columnar_propose_gets_a_documented_status,
                                                     test_malformed_step_channel_requests_get_a_documented_status,
                                                     test_malformed_request_frames_get_a_documented_status)]
    assert all(v is not None and v.checked >= 50 for v in victims), [v and v.checked for v in victims]
    # not vacuous: the cases reached the accepting path and several refusal paths
    assert OUTCOMES.get("OK", 0) >= 5 and OUTCOMES.get("INVALID_ARGUMENT", 0) >= 20, OUTCOMES
    assert len(OUTCOMES) >= 3, OUTCOMES
    assert COLUMN_OUTCOMES.get("OK", 0) >= 3 and COLUMN_OUTCOMES.get("INVALID_ARGUMENT", 0) >= 20, COLUMN_OUTCOMES
    assert FRAME_OUTCOMES.get("OK", 0) >= 3 and FRAME_OUTCOMES.get("INVALID_ARGUMENT", 0) >= 20, FRAME_OUTCOMES
    print("fuzz outcomes over gRPC:", OUTCOMES, "of them columnar:", COLUMN_OUTCOMES, "request frames:", FRAME_OUTCOMES)
