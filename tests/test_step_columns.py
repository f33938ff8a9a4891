"""Columnar requests and replies (ProposeRequest.columns, ProposeResponse.result_columns): a columnar request decodes
to exactly the steps its per-sequence twin decodes to, every bad column value is refused naming the column and the
index, and a columnar reply parses to the same BatchDrafts as the per-sequence reply of the same outputs. (The
server round trip against the per-sequence API is in tests/test_batch_api.py.)"""
import dataclasses
import random

import grpc
import pytest
import torch

from drafter_client import SequenceStep, StepBatch
from drafter_client.batch import (build_column_request, columns_can_carry, parse_batch_response, serialize_batch,
                                  serialize_steps_as_columns, steps_as_batch)
from drafter_client.messages import build_request
from drafter_client.protocol import pb
from drafter_client.protocol.wire import encode_tensor
from drafter_service.engine.step_io import StepOutput
from drafter_service.transport.servicer import build_column_response, build_response
from drafter_service.transport.validation import Limits, RequestError, committed_rows, parse_propose

W, V = 16, 1000
LIMITS = Limits(hidden_states_width=W, vocab_size=V, max_draft_tokens=8, max_request_tokens=4096,
                max_request_seqs=64, max_top_k_probs=16, max_predraft_branches=32)


def random_batch(rng: random.Random, n: int, sampled: bool) -> tuple[StepBatch, list[SequenceStep]]:
    """The same step as a StepBatch and as SequenceSteps (per-sequence sampling only where the batch has columns)."""
    m = [rng.randint(1, 5) for _ in range(n)]
    temps = [rng.choice([0.0, 0.7, 1.3]) for _ in range(n)] if sampled else [0.0] * n
    seeds = [rng.choice([0, 5, 2**63 + 11, 2**64 - 1]) for _ in range(n)] if sampled else [0] * n
    lp, top = (True, 4) if sampled else (False, 0)
    steps = [SequenceStep(f"seq-{i}", rng.randrange(200), [rng.randrange(V) for _ in range(m[i])],
                          torch.randn(m[i], W).to(torch.bfloat16), rng.randrange(V), rng.randrange(9),
                          temperature=temps[i], seed=seeds[i], return_logprobs=lp, top_k_probs=top,
                          predraft_branches=rng.choice([0, 8, 32])) for i in range(n)]
    as_int64 = [s - 2**64 if s >= 2**63 else s for s in seeds]  # (a tensor column holds the uint64 seeds' bits)
    batch = StepBatch(
        sequence_ids=[s.sequence_id for s in steps], start_positions=torch.tensor([s.start_position for s in steps]),
        num_tokens=torch.tensor(m), token_ids=torch.tensor([t for s in steps for t in s.token_ids]),
        hidden_states=torch.cat([s.hidden_states for s in steps]), next_tokens=torch.tensor([s.next_token for s in steps]),
        num_drafts=torch.tensor([s.num_drafts for s in steps]), temperature=torch.tensor(temps),
        seed=torch.tensor(as_int64), return_logprobs=lp, top_k_probs=top,
        predraft_branches=torch.tensor([s.predraft_branches for s in steps]))
    return batch, steps


def parse_bytes(data) -> list:
    return parse_propose(pb.ProposeRequest.FromString(bytes(data)), LIMITS)


@pytest.mark.parametrize("sampled", [False, True])
def test_columns_decode_to_the_steps_of_the_per_sequence_request(sampled):
    rng = random.Random(sampled)
    for n in (1, 2, 7, 64):
        batch, steps = random_batch(rng, n, sampled)
        data = serialize_batch("ns", batch, request_id=4, columns=True)
        by_cols = parse_bytes(data)
        by_rows = parse_propose(pb.ProposeRequest.FromString(build_request("ns", steps).SerializeToString()), LIMITS)
        assert len(by_cols) == len(by_rows) == n
        # the server's form: the same steps as one BatchInput of the decoded columns (Proposer.step_batch's input)
        as_batch = parse_propose(pb.ProposeRequest.FromString(bytes(data)), LIMITS, columnar=True)
        assert len(as_batch) == n and as_batch.total_tokens == sum(len(s.token_ids) for s in steps)
        by_cols_batch = as_batch.to_inputs()
        for c, r in zip(by_cols_batch, by_cols, strict=True):
            for f in ("namespace", "sequence_id", "start_position", "next_token", "num_drafts", "seed",
                      "return_logprobs", "top_k_probs", "predraft_branches", "temperature"):
                assert getattr(c, f) == getattr(r, f), f
            assert torch.equal(c.token_ids, r.token_ids) and torch.equal(c.hidden_states, r.hidden_states)
        for c, r in zip(by_cols, by_rows):
            for f in ("namespace", "sequence_id", "start_position", "next_token", "num_drafts", "seed",
                      "return_logprobs", "top_k_probs", "predraft_branches"):
                assert getattr(c, f) == getattr(r, f), f
            assert c.temperature == pytest.approx(r.temperature)
            assert torch.equal(c.token_ids, r.token_ids) and torch.equal(c.hidden_states, r.hidden_states)


def test_greedy_per_sequence_steps_decode_as_columns_where_asked():
    """parse_propose(steps_as_columns=...): a greedy request of SequenceStep messages comes back as one BatchInput
    holding exactly its steps (uint64 seeds included) when the predicate says so for its size; one that samples,
    asks for log-probabilities, top-N or pre-drafting, or that the predicate refuses, as StepInputs."""
    from drafter_service.engine.batch_io import BatchInput

    rng = random.Random(3)
    sizes = []

    def predicate(n, rows):
        sizes.append((n, rows))
        return n > 1

    for n in (1, 2, 7):
        _, steps = random_batch(rng, n, sampled=False)
        steps = [dataclasses.replace(s, predraft_branches=0, seed=rng.choice([0, 5, 2**63 + 11, 2**64 - 1]))
                 for s in steps]
        def req(steps):
            return pb.ProposeRequest.FromString(build_request("ns", steps).SerializeToString())
        by_rows = parse_propose(req(steps), LIMITS)
        got = parse_propose(req(steps), LIMITS, steps_as_columns=predicate)
        assert sizes[-1] == (n, sum(len(s.token_ids) for s in steps))
        if n == 1:
            assert isinstance(got, list)
            continue
        assert isinstance(got, BatchInput) and len(got) == n
        for c, r in zip(got.to_inputs(), by_rows, strict=True):
            for f in ("namespace", "sequence_id", "start_position", "next_token", "num_drafts", "seed",
                      "return_logprobs", "top_k_probs", "predraft_branches", "temperature"):
                assert getattr(c, f) == getattr(r, f), f
            assert torch.equal(c.token_ids, r.token_ids) and torch.equal(c.hidden_states, r.hidden_states)
        for change in (dict(temperature=0.5), dict(return_logprobs=True), dict(top_k_probs=2),
                       dict(predraft_branches=8)):
            changed = [dataclasses.replace(s, **change) if i == n - 1 else s for i, s in enumerate(steps)]
            assert isinstance(parse_propose(req(changed), LIMITS, steps_as_columns=predicate), list), change


@pytest.mark.parametrize("tokens", ["lists", "tensors", "mixed"])
def test_steps_sent_as_columns_decode_to_the_steps_themselves(tokens):
    """propose()'s columnar form of per-sequence steps (steps_as_batch + serialize_steps_as_columns): the drafter
    decodes it to exactly what the per-sequence request decodes to (token ids as lists, 1-D tensors of any int
    dtype, or a mix; states per step or packed)."""
    rng = random.Random(len(tokens))
    for n in (1, 7, 64):
        for sampled in (False, True):
            _, steps = random_batch(rng, n, sampled)
            lp, top = steps[0].return_logprobs, steps[0].top_k_probs
            steps = [dataclasses.replace(s, return_logprobs=lp, top_k_probs=top) for s in steps]
            if tokens != "lists":
                steps = [dataclasses.replace(s, token_ids=torch.tensor(s.token_ids, dtype=torch.int32))
                         if tokens == "tensors" or i % 2 else s for i, s in enumerate(steps)]
            assert columns_can_carry(steps)
            packed = torch.cat([s.hidden_states for s in steps]) if n == 7 else None
            sent = [dataclasses.replace(s, hidden_states=None) for s in steps] if packed is not None else steps
            by_cols = parse_bytes(serialize_steps_as_columns("ns", sent, steps_as_batch(sent), packed))
            by_rows = parse_propose(pb.ProposeRequest.FromString(build_request("ns", steps).SerializeToString()),
                                    LIMITS)
            for c, r in zip(by_cols, by_rows, strict=True):
                for f in ("sequence_id", "start_position", "next_token", "num_drafts", "seed", "return_logprobs",
                          "top_k_probs", "predraft_branches"):
                    assert getattr(c, f) == getattr(r, f), f
                assert c.temperature == pytest.approx(r.temperature)
                assert torch.equal(c.token_ids, r.token_ids) and torch.equal(c.hidden_states, r.hidden_states)
    _, steps = random_batch(rng, 3, True)
    assert not columns_can_carry([steps[0], dataclasses.replace(steps[1], return_logprobs=not steps[0].return_logprobs)])


def test_an_all_greedy_batch_sends_no_optional_column():
    batch, _ = random_batch(random.Random(0), 5, sampled=False)
    batch.temperature, batch.seed, batch.predraft_branches = 0.0, 0, 0
    req = build_column_request("ns", batch)
    assert not any(req.columns.HasField(f) for f in ("temperatures", "seeds", "predraft_branches"))
    assert all(s.temperature == 0 and s.seed == 0 and s.predraft_branches == 0
               for s in parse_bytes(serialize_batch("ns", batch, columns=True)))


def _request(n: int = 4) -> pb.ProposeRequest:
    batch, _ = random_batch(random.Random(n), n, sampled=True)
    return pb.ProposeRequest.FromString(bytes(serialize_batch("ns", batch, columns=True)))


def _set(column: str, index: int, value):
    def mutate(req):
        c = getattr(req.columns, column)
        dtype = torch.float32 if c.dtype == pb.FLOAT32 else torch.int64
        x = torch.frombuffer(bytearray(c.raw), dtype=dtype).clone()
        x[index] = value
        encode_tensor(x, into=c)
    return mutate


def _both(req):
    req.steps.append(pb.SequenceStep(sequence_id="x", num_tokens=1))


def _short(req):
    encode_tensor(torch.zeros(3, dtype=torch.int64), into=req.columns.start_positions)


def _float_positions(req):
    encode_tensor(torch.zeros(4, dtype=torch.float32), into=req.columns.start_positions)


def _shm_column(req):
    req.columns.num_drafts.shm.region = "r"


def _ids(ids):
    def mutate(req):
        del req.columns.sequence_ids[:]
        req.columns.sequence_ids.extend(ids)
    return mutate


def _top_k(req):
    req.columns.top_k_probs = 17


@pytest.mark.parametrize("mutate, message", [
    (_set("start_positions", 2, -1), "columns.start_positions[2] is -1"),
    (_set("num_tokens", 1, 0), "columns.num_tokens[1] is 0"),
    (_set("next_tokens", 3, V), f"columns.next_tokens[3] is {V}; outside the vocabulary"),
    (_set("num_drafts", 0, 9), "columns.num_drafts[0] is 9"),
    (_set("num_drafts", 1, -2), "columns.num_drafts[1] is -2"),
    (_set("temperatures", 2, float("nan")), "columns.temperatures[2] is nan"),
    (_set("temperatures", 1, -0.5), "columns.temperatures[1] is -0.5"),
    (_set("predraft_branches", 3, 33), "columns.predraft_branches[3] is 33"),
    (_top_k, "columns.top_k_probs is 17"),
    (_both, "both steps and columns"),
    (_short, "columns.start_positions has 3 values for 4 sequence_ids"),
    (_float_positions, "columns.start_positions.dtype is FLOAT32"),
    (_shm_column, "columns.num_drafts.shm"),
    (_ids(["a", "b", "a", "c"]), "columns.sequence_ids[2] 'a' appears twice"),
    (_ids(["a", "", "b", "c"]), "columns.sequence_ids[1] is empty"),
    (_ids(["a", "b", "c", "d" * 300]), "columns.sequence_ids[3] is 300 characters"),
])
def test_bad_columns_are_refused_by_name(mutate, message):
    req = _request()
    mutate(req)
    with pytest.raises(RequestError) as e:
        parse_propose(req, LIMITS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.message, e.value.message


def test_too_many_sequences_or_tokens_are_resource_exhausted():
    batch, _ = random_batch(random.Random(1), 65, sampled=False)
    with pytest.raises(RequestError) as e:
        parse_bytes(serialize_batch("ns", batch, columns=True))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    req = _request()
    _set("num_tokens", 0, 5000)(req)
    with pytest.raises(RequestError) as e:
        parse_propose(req, LIMITS)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_committed_rows_checks_the_column_first():
    req = _request()
    assert committed_rows(req) == int(torch.frombuffer(bytearray(req.columns.num_tokens.raw), dtype=torch.int64).sum())
    _set("num_tokens", 2, -7)(req)
    with pytest.raises(RequestError, match=r"columns.num_tokens\[2\] is -7"):
        committed_rows(req)


def random_outputs(rng: random.Random, n: int) -> list[StepOutput]:
    outs = []
    for i in range(n):
        o = StepOutput(accepted_drafts=rng.randrange(4), committed_length=rng.randrange(1000),
                       predrafted=rng.random() < 0.3)
        if rng.random() < 0.25:
            o.code, o.message = rng.choice([(5, "unknown sequence"), (9, "gap: start_position 9"),
                                            (8, "KV pool full")])
            o.predrafted = False
        else:
            k = rng.randrange(6)
            o.drafts = [rng.randrange(V) for _ in range(k)]
            if rng.random() < 0.5:
                o.logprobs = [-rng.random() for _ in range(k)]
            if k and rng.random() < 0.5:
                width = rng.randint(1, 4)
                o.top_k_ids = torch.randint(0, V, (k, width))
                o.top_k_probs = torch.rand(k, width)
        outs.append(o)
    return outs


def test_a_column_reply_parses_as_the_per_sequence_reply():
    rng = random.Random(3)
    for n in (1, 5, 40):
        outs = random_outputs(rng, n)
        ids = [f"s{i}" for i in range(n)]
        by_rows = parse_batch_response(pb.ProposeResponse.FromString(
            build_response(outs, ids, 9).SerializeToString()), ids)
        reply = pb.ProposeResponse.FromString(build_column_response(outs, 9).SerializeToString())
        assert not reply.results  # no message per sequence
        by_cols = parse_batch_response(reply, ids)
        for f in ("codes", "num_drafts", "draft_token_ids", "accepted_drafts", "committed_lengths", "needs_resync",
                  "predrafted", "logprobs", "top_k_ids", "top_k_probs"):
            a, b = getattr(by_cols, f), getattr(by_rows, f)
            assert (a is None and b is None) or torch.equal(a, b), f
        assert by_cols.messages == by_rows.messages and by_cols.request_id == by_rows.request_id == 9


def early_answer(rng: random.Random, n: int, k: int) -> "BatchOutput":
    """A step from columns' answer as its early callback sees it (drafts None): about one sequence in five failed
    (code 5, with a message), random draft counts up to k, accepted drafts and committed lengths."""
    from drafter_service.engine.batch_io import BatchOutput

    codes = torch.tensor([0 if rng.random() < 0.8 else 5 for _ in range(n)], dtype=torch.int32)
    return BatchOutput(codes=codes, messages=["" if c == 0 else f"gone {i}" for i, c in enumerate(codes.tolist())],
                       num_drafts=torch.tensor([rng.randint(0, k) for _ in range(n)]),
                       accepted_drafts=torch.tensor([rng.randint(0, 3) for _ in range(n)]),
                       committed_lengths=torch.tensor([rng.randint(1, 2000) for _ in range(n)]))


def test_a_reply_whose_head_was_encoded_before_the_drafts_is_the_whole_reply():
    """ReplyHead: the head serialized from the answer before its drafts were known (drafts None, as
    Proposer.step_batch hands it to its early callback), then the drafts: the same message as
    build_batch_column_response, with every draft count, failed sequences and no drafts at all."""
    from drafter_service.transport.servicer import ReplyHead, build_batch_column_response

    rng = random.Random(4)
    for n, K in ((1, 5), (6, 3), (40, 8), (7, 0)):
        early = early_answer(rng, n, K)
        head = ReplyHead(17)
        head(early)
        early.drafts = torch.randint(0, 50000, (n, K))
        whole = build_batch_column_response(early, 17)
        assert pb.ProposeResponse.FromString(head.reply(early)) == whole
        ids = [f"s{i}" for i in range(n)]
        a = parse_batch_response(pb.ProposeResponse.FromString(head.reply(early)), ids)
        b = parse_batch_response(whole, ids)
        assert torch.equal(a.draft_token_ids, b.draft_token_ids) and a.messages == b.messages


def test_draft_pick_takes_each_sequences_first_drafts():
    """DraftPick (made before the drafts, used after them): each sequence's first num_drafts entries of its row, none
    for a failed one, in order, whether every sequence drafted K (a reshape), fewer, a mix, or there is no
    sequence."""
    from drafter_service.engine.batch_io import BatchOutput
    from drafter_service.transport.servicer import DraftPick

    def answer(counts, codes, K):
        n = len(counts)
        out = BatchOutput(codes=torch.tensor(codes, dtype=torch.int32), messages=[""] * n,
                          num_drafts=torch.tensor(counts, dtype=torch.int64),
                          accepted_drafts=torch.zeros(n, dtype=torch.int64),
                          committed_lengths=torch.ones(n, dtype=torch.int64))
        out.drafts = torch.arange(n * K, dtype=torch.int64).reshape(n, K)
        return out

    for counts, codes, K in (([4, 4, 4], [0, 0, 0], 4), ([2, 2], [0, 0], 4), ([1, 3, 0], [0, 0, 0], 3),
                             ([3, 3, 3], [0, 5, 0], 3), ([], [], 5), ([0, 0], [0, 0], 0)):
        out = answer(counts, codes, K)
        pick = DraftPick(out)
        want = [t for i, (c, code) in enumerate(zip(counts, codes)) if code == 0 for t in out.drafts[i, :c].tolist()]
        ids = pick.ids(out.drafts)
        assert ids.tolist() == want and pick.total == len(want) and ids.dtype.str == "<i8", (counts, codes, K)


def test_a_per_sequence_reply_whose_head_was_encoded_before_the_drafts_is_the_whole_reply():
    """ReplyHead with sequence ids (a request of SequenceStep messages that ran from columns): the SequenceResult
    messages serialized before the drafts were known, then the drafts, parse as build_response of the same answer,
    with failed sequences and no drafts at all."""
    from drafter_service.transport.servicer import ReplyHead

    rng = random.Random(5)
    for n, K in ((1, 5), (6, 3), (9, 8), (7, 0)):
        early = early_answer(rng, n, K)
        early.num_drafts = early.num_drafts * (early.codes == 0)  # (the proposer gives a failed sequence no drafts)
        ids = [f"s{i}" for i in range(n)]
        head = ReplyHead(23, ids)
        head(early)
        early.drafts = torch.randint(0, 50000, (n, K))
        got = pb.ProposeResponse.FromString(head.reply(early))
        assert got == build_response(early.to_outputs(), ids, 23)
        assert len(got.results) == n and not got.HasField("result_columns")
        head(None)  # (a step that failed after the early work: no head, the caller encodes the whole reply)
        assert head.reply(early) is None


def test_tensor_fields_written_by_hand_parse_as_protobufs():
    """wire.tensor_field_head (the reply's draft_token_ids, a request's hidden_states, a ProposeChunked header's):
    the key, the length and Tensor{dtype, shape[, raw]} parse to the message protobuf builds, for 0-3 dimensions,
    sizes across varint boundaries, with and without data; and a ProposeChunked header parses to its request."""
    from drafter_client.messages import ChunkedRequest
    from drafter_client.protocol.wire import tensor_field_head, varint

    rng = random.Random(9)
    for n in (0, 1, 127, 128, 300, 2**14, 2**21 + 5):
        if n:  # (request_id = 4, a uint64: its key, then the varint)
            assert bytes([4 << 3]) + varint(n) == pb.ProposeResponse(request_id=n).SerializeToString()
        shape = [n] if n < 2**14 else [n // 64, 64]
        for dtype in (pb.INT64, pb.BFLOAT16):
            raw = bytes(rng.getrandbits(8) for _ in range(min(n, 300))) if n < 300 else b"\x01" * n
            want = pb.ProposeResponse(draft_token_ids=pb.Tensor(dtype=dtype, shape=shape, raw=raw))
            got = pb.ProposeResponse.FromString(tensor_field_head(2, dtype, shape, len(raw)) + raw)
            assert got == want
            bare = pb.ProposeResponse.FromString(tensor_field_head(2, dtype, shape, None))
            assert bare == pb.ProposeResponse(draft_token_ids=pb.Tensor(dtype=dtype, shape=shape))
    req = pb.ProposeRequest(namespace="ns", request_id=5, token_ids=encode_tensor(torch.tensor([1, 2, 3, 4, 5])),
                            steps=[pb.SequenceStep(sequence_id="a", num_tokens=5, next_token=6, num_drafts=2)])
    chunked = ChunkedRequest(req, [torch.zeros(5, 8, dtype=torch.bfloat16)])
    expected = pb.ProposeRequest()
    expected.CopyFrom(req)
    expected.hidden_states.dtype, expected.hidden_states.shape[:] = pb.BFLOAT16, [5, 8]
    assert pb.ProposeChunk.FromString(chunked.header()) == pb.ProposeChunk(request=expected)
    part = pb.UploadPart(upload_id="u", index=0, count=2)
    assert pb.ProposeChunk.FromString(chunked.header(part)) == pb.ProposeChunk(request=expected, part=part)
    assert not req.HasField("hidden_states")  # (the step's own request: left as it was)


def test_a_column_reply_for_another_batch_size_is_internal():
    outs = random_outputs(random.Random(0), 3)
    reply = pb.ProposeResponse.FromString(build_column_response(outs, 1).SerializeToString())
    from drafter_client.messages import DrafterError
    with pytest.raises(DrafterError) as e:
        parse_batch_response(reply, ["a", "b"])
    assert e.value.code == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("field,damage", [("status_codes", "dtype"), ("num_drafts", "bytes"), ("predrafted", "rank"),
                                          ("draft_token_ids", "bytes"), ("committed_lengths", "dtype")])
def test_a_malformed_column_reply_is_internal_naming_the_field(field, damage):
    """A reply the client cannot read is the drafter's fault: INTERNAL, with the field named (the columns are read as
    numpy views with the same checks as any tensor field)."""
    outs = random_outputs(random.Random(1), 3)
    reply = pb.ProposeResponse.FromString(build_column_response(outs, 1).SerializeToString())
    t = reply.draft_token_ids if field == "draft_token_ids" else getattr(reply.result_columns, field)
    if damage == "dtype":
        t.dtype = pb.FLOAT32
    elif damage == "bytes":
        t.raw = t.raw + b"\x00"
    else:
        t.shape.append(1)
    from drafter_client.messages import DrafterError
    with pytest.raises(DrafterError) as e:
        parse_batch_response(reply, ["a", "b", "c"])
    assert e.value.code == grpc.StatusCode.INTERNAL and field in str(e.value), str(e.value)


@pytest.mark.parametrize("damage", ["dtype", "bytes", "count"])
def test_a_malformed_per_sequence_reply_is_internal(damage):
    """The batch API's parse of a per-sequence reply (a batch under COLUMNS_MIN_SEQUENCES): draft ids it cannot read,
    or num_drafts that do not add up to them, are the drafter's fault: INTERNAL."""
    from drafter_client.messages import DrafterError
    outs = [StepOutput(drafts=[1, 2, 3], committed_length=7), StepOutput(drafts=[4], committed_length=9)]
    reply = pb.ProposeResponse.FromString(build_response(outs, ["a", "b"], 1).SerializeToString())
    if damage == "dtype":
        reply.draft_token_ids.dtype = pb.FLOAT32
    elif damage == "bytes":
        reply.draft_token_ids.raw = reply.draft_token_ids.raw + b"\x00"
    else:
        reply.results[1].num_drafts = 2
    with pytest.raises(DrafterError) as e:
        parse_batch_response(reply, ["a", "b"])
    assert e.value.code == grpc.StatusCode.INTERNAL, str(e.value)
    assert ("draft_token_ids" if damage != "count" else "add up") in str(e.value)


def test_a_batch_from_arrays_makes_its_tensor_columns_on_first_use():
    """BatchInput.from_arrays (a decoded request's columns) makes each tensor column from its numpy array only when
    it is first read (the columns path reads the arrays alone); the tensor shares the array's memory, is made once,
    and every other use (cat, to_inputs, dataclasses.replace) sees the same columns."""
    import numpy as np

    from drafter_service.engine.batch_io import BatchArrays, BatchInput

    n = 3
    arrays = BatchArrays(start_positions=np.array([0, 4, 9]), num_tokens=np.array([1, 2, 1]),
                         token_ids=np.array([5, 6, 7, 8]), next_tokens=np.array([1, 2, 3]),
                         num_drafts=np.array([2, 0, 3]), temperatures=np.zeros(n, dtype=np.float32),
                         seeds=np.array([0, -2, 7]), return_logprobs=np.zeros(n, dtype=bool),
                         top_k_probs=np.zeros(n, dtype=np.int64), predraft_branches=np.zeros(n, dtype=np.int64))
    b = BatchInput.from_arrays("ns", ["a", "b", "c"], arrays, torch.from_numpy(arrays.token_ids), torch.zeros(4, W))
    assert "num_drafts" not in vars(b) and b.arrays is arrays
    k = b.num_drafts
    assert k.tolist() == [2, 0, 3] and k.data_ptr() == arrays.num_drafts.ctypes.data and b.num_drafts is k
    assert "num_drafts" in vars(b) and "seeds" not in vars(b)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        b.nonexistent
    steps = b.to_inputs()
    assert [s.start_position for s in steps] == [0, 4, 9] and [s.num_drafts for s in steps] == [2, 0, 3]
    assert [s.token_ids.tolist() for s in steps] == [[5], [6, 7], [8]]
    merged = BatchInput.cat([b, dataclasses.replace(b, sequence_ids=["d", "e", "f"])])
    assert merged.start_positions.tolist() == [0, 4, 9, 0, 4, 9] and merged.seeds.tolist() == [0, -2, 7] * 2
