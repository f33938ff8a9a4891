"""Step frames (drafter_client.protocol.step_frame): a step channel's requests and replies as raw arrays.

The codec round-trips and refuses frames of a wrong structure with FrameError, whatever the bytes (hypothesis); the
drafter checks a frame's values as it checks a columnar ProposeRequest (each error names frame.<column>[index]);
end to end, steps sent as frames (propose and propose_batch; greedy and sampled, uint64 seeds, an unknown
sequence, packed states) answer exactly what the same steps answer as protobuf; steps a frame cannot carry
(log-probabilities, top-N) go as protobuf on the same channel; a malformed frame, or one of another namespace, gets
an error reply and the channel stays usable; a drafter without frames leaves the client on protobuf.
"""
import asyncio
import contextlib
import dataclasses
import random
import time

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ServerThread, make_config
from drafter_client import DrafterClient, SequenceStep
from drafter_client.batch import frame_from_batch, frame_from_steps, parse_frame_reply, steps_as_batch
from drafter_client.messages import DrafterError
from drafter_client.protocol import pb, step_frame
from drafter_service.transport.validation import Limits, RequestError, parse_frame
from test_batch_api import as_batch, commit_some, next_steps

H, V, K = 64, 512, 4
LIMITS = Limits(hidden_states_width=H, vocab_size=V, max_draft_tokens=8, max_request_tokens=4096, max_request_seqs=64)
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def frame_bytes(steps: list[SequenceStep], namespace: str = "ns", request_id: int = 7) -> bytes:
    return bytes(frame_from_steps(namespace, steps, None, request_id))


def some_steps(n: int = 3, dtype=torch.float32, seed: int = 0) -> list[SequenceStep]:
    g = torch.Generator().manual_seed(seed)
    return [SequenceStep(f"séq-{i}", 10 * i, list(range(i + 1, 2 * i + 3)), torch.randn(i + 2, H, generator=g).to(dtype),
                         100 + i, i % 5, temperature=0.5 * (i % 2), seed=2**64 - 1 - i if i % 2 else 0,
                         predraft_branches=i % 3) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_request_frame_reads_back_what_was_written(dtype):
    steps = some_steps(dtype=dtype)
    f = step_frame.read_request(frame_bytes(steps, "namespace-ü", 2**63 + 5))
    assert f.namespace == "namespace-ü" and f.request_id == 2**63 + 5
    assert f.sequence_ids == [s.sequence_id for s in steps]
    assert f.columns["start_positions"].tolist() == [0, 10, 20]
    assert f.columns["num_tokens"].tolist() == [2, 3, 4]
    assert f.columns["next_tokens"].tolist() == [100, 101, 102]
    assert f.columns["num_drafts"].tolist() == [0, 1, 2]
    assert f.columns["seeds"].tolist() == [0, -2, 0]  # (uint64 2**64 - 2: its int64 bits)
    assert f.columns["predraft_branches"].tolist() == [0, 1, 2]
    assert f.temperatures.tolist() == [0.0, 0.5, 0.0]
    assert f.token_ids.tolist() == [t for s in steps for t in s.token_ids]
    assert f.states.dtype == dtype and torch.equal(f.states, torch.cat([s.hidden_states for s in steps]))
    # the batch API writes the same frame
    batch = dataclasses.replace(steps_as_batch(steps), hidden_states=torch.cat([s.hidden_states for s in steps]))
    assert bytes(frame_from_batch("namespace-ü", batch, 2**63 + 5)) == frame_bytes(steps, "namespace-ü", 2**63 + 5)


def test_a_frame_cut_before_its_states_reads_back_with_states_that_take_no_memory():
    """without_states / read_request(with_states=False): the copy of its last frame that the drafter rehearses."""
    data = frame_bytes(some_steps(dtype=torch.bfloat16))
    whole = step_frame.read_request(data)
    cut = step_frame.without_states(data, whole)
    assert len(cut) == len(data) - whole.states.numel() * 2
    f = step_frame.read_request(cut, with_states=False)
    assert (f.namespace, f.request_id, f.sequence_ids) == (whole.namespace, whole.request_id, whole.sequence_ids)
    assert all(np.array_equal(f.columns[k], whole.columns[k]) for k in step_frame.REQUEST_COLUMNS)
    assert np.array_equal(f.token_ids, whole.token_ids) and np.array_equal(f.temperatures, whole.temperatures)
    assert f.states.shape == whole.states.shape and f.states.dtype == torch.bfloat16
    assert f.states.stride() == (0, 0) and not f.states.any()
    for bad in (cut + b"\0" * 8, data):  # (a cut frame is read only as one, and a whole one only as whole)
        with pytest.raises(step_frame.FrameError, match="describes"):
            step_frame.read_request(bad, with_states=False)
    with pytest.raises(step_frame.FrameError, match="describes"):
        step_frame.read_request(cut)


def test_steps_a_frame_cannot_carry_are_left_to_protobuf():
    steps = some_steps()
    assert frame_from_steps("ns", [dataclasses.replace(steps[0], return_logprobs=True), *steps[1:]], None, 1) is None
    assert frame_from_steps("ns", [dataclasses.replace(steps[0], top_k_probs=2), *steps[1:]], None, 1) is None
    assert frame_from_steps("ns", [dataclasses.replace(steps[0], hidden_states=torch.randn(2, H + 1)),
                                   *steps[1:]], None, 1) is None  # (states of two widths)
    assert frame_from_steps("ns", [dataclasses.replace(steps[0], hidden_states=torch.zeros(2, H, dtype=torch.int32)),
                                   *steps[1:]], None, 1) is None
    batch = dataclasses.replace(steps_as_batch(steps), hidden_states=torch.cat([s.hidden_states for s in steps]))
    assert frame_from_batch("ns", dataclasses.replace(batch, return_logprobs=True), 1) is None
    assert frame_from_batch("ns", dataclasses.replace(batch, hidden_states=batch.hidden_states[:-1]), 1) is None


def test_a_frame_of_the_wrong_structure_is_refused():
    good = frame_bytes(some_steps())
    header = step_frame.REQUEST_HEADER
    cases = {"shorter than its": good[:20], "not a request frame": b"DFX1" + good[4:],
             "describes": good[:-1], "describes ": good + b"\0"}

    def with_field(i: int, value) -> bytes:  # (fields: magic, n, t, w, dtype, flags, request_id, ids, namespace)
        fields = list(header.unpack_from(good))
        fields[i] = value
        return header.pack(*fields) + good[header.size:]
    cases["states dtype"] = with_field(4, pb.INT64)
    cases["flags"] = with_field(5, 1)
    cases["out of range"] = with_field(1, 2**31)
    for why, data in cases.items():
        with pytest.raises(step_frame.FrameError, match=why.strip()):
            step_frame.read_request(data)


@SETTINGS
@given(cut=st.integers(0, 2000), flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), max_size=4))
def test_corrupted_frames_raise_frame_error_or_request_error_only(cut, flips):
    """Whatever the bytes, reading a frame raises FrameError or gives a frame, and checking that frame raises
    RequestError or gives a BatchInput whose columns hold exactly its sequences and rows."""
    data = bytearray(frame_bytes(some_steps(5)))
    for where, value in flips:
        data[where % len(data)] = value
    data = bytes(data[: len(data) - cut % len(data)])
    try:
        frame = step_frame.read_request(data)
    except step_frame.FrameError:
        return
    try:
        b = parse_frame(frame, LIMITS)
    except RequestError as e:  # (the per-sequence form refuses the same frame, with the same words)
        with pytest.raises(RequestError) as again:
            parse_frame(frame, LIMITS, columnar=False)
        assert again.value.message == e.message
        return
    assert len(b) == len(frame.sequence_ids) and int(b.num_tokens.sum()) == b.token_ids.shape[0]
    assert b.hidden_states.shape == (b.token_ids.shape[0], H)
    assert_same_inputs(parse_frame(frame, LIMITS, columnar=False), b.to_inputs())


def assert_same_inputs(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert dataclasses.asdict(g).keys() == dataclasses.asdict(w).keys()
        for name in ("namespace", "sequence_id", "start_position", "next_token", "num_drafts", "temperature", "seed",
                     "return_logprobs", "top_k_probs", "owner", "predraft_branches"):
            assert getattr(g, name) == getattr(w, name), name
            assert type(getattr(g, name)) is type(getattr(w, name)), name
        assert torch.equal(g.token_ids, w.token_ids) and g.token_ids.dtype == torch.int64
        assert torch.equal(g.hidden_states, w.hidden_states) and g.hidden_states.dtype == w.hidden_states.dtype


@pytest.mark.parametrize("max_predraft_branches", [0, 4])
def test_a_small_frame_parses_straight_into_the_per_sequence_inputs(max_predraft_branches):
    """A step too small for the proposer's columns path is parsed into one StepInput per sequence (columnar=False):
    the same inputs as the BatchInput taken apart (uint64 seeds, float32 temperatures, pre-drafting budgets)."""
    limits = dataclasses.replace(LIMITS, max_predraft_branches=max_predraft_branches)
    for n in (1, 3, 7):
        frame = step_frame.read_request(frame_bytes(some_steps(n, dtype=torch.bfloat16, seed=n)))
        got = parse_frame(frame, limits, columnar=False)
        assert_same_inputs(got, parse_frame(frame, limits).to_inputs())
        assert [s.seed for s in got][:2] == [0, 2**64 - 2][:n] and all(isinstance(s.seed, int) for s in got)
        assert [s.predraft_branches for s in got] == [i % 3 if max_predraft_branches else 0 for i in range(n)]


@SETTINGS
@given(data=st.binary(max_size=600))
def test_random_bytes_with_a_frame_magic_raise_frame_error_only(data):
    try:
        step_frame.read_request(step_frame.REQUEST_MAGIC + data)
    except step_frame.FrameError:
        pass


def _broken(steps, **changes) -> "step_frame.RequestFrame":
    f = step_frame.read_request(frame_bytes(steps))
    for name, (i, value) in changes.items():
        if name == "temperatures":
            f.temperatures[i] = value
        elif name == "token_ids":
            f.token_ids[i] = value
        elif name == "sequence_ids":
            f.sequence_ids[i] = value
        else:
            f.columns[name][i] = value
    return f


@pytest.mark.parametrize("change,message", [
    (dict(start_positions=(1, -1)), r"frame.start_positions\[1\] is -1"),
    (dict(num_tokens=(0, 0)), r"frame.num_tokens\[0\] is 0"),
    (dict(next_tokens=(2, V)), r"frame.next_tokens\[2\] is 512; outside the vocabulary"),
    (dict(num_drafts=(1, 9)), r"frame.num_drafts\[1\] is 9; this server drafts 0 to 8"),
    (dict(temperatures=(2, float("nan"))), r"frame.temperatures\[2\] is nan"),
    (dict(temperatures=(0, -1.0)), r"frame.temperatures\[0\] is -1.0"),
    (dict(token_ids=(3, V + 7)), r"token_ids\[3\] = 519 is outside the vocabulary"),
    (dict(sequence_ids=(2, "séq-0")), r"frame.sequence_ids\[2\] 'séq-0' appears twice"),
    (dict(sequence_ids=(1, "")), r"frame.sequence_ids\[1\] is empty"),
    (dict(sequence_ids=(0, "x" * 300)), r"frame.sequence_ids\[0\] is 300 characters"),
])
def test_frame_values_are_checked_as_columns_are(change, message):
    with pytest.raises(RequestError, match=message) as e:
        parse_frame(_broken(some_steps(), **change), LIMITS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_frame_without_sequences_carries_no_tokens():
    f = step_frame.read_request(frame_bytes(some_steps()))
    empty = step_frame.RequestFrame(namespace="ns", request_id=1, sequence_ids=[],
                                    columns={k: v[:0] for k, v in f.columns.items()}, temperatures=f.temperatures[:0],
                                    token_ids=f.token_ids, states=f.states)
    with pytest.raises(RequestError, match="frame.token_ids has 9 rows; the steps' num_tokens add up to 0"):
        parse_frame(empty, LIMITS)
    empty.token_ids, empty.states = f.token_ids[:0], f.states[:0]
    assert len(parse_frame(empty, LIMITS)) == 0


def test_frame_limits():
    steps = some_steps()
    with pytest.raises(RequestError, match="frame.states has 64 columns; this model takes 32"):
        parse_frame(step_frame.read_request(frame_bytes(steps)), dataclasses.replace(LIMITS, hidden_states_width=32))
    with pytest.raises(RequestError, match="at most 8 per request") as e:
        parse_frame(step_frame.read_request(frame_bytes(steps)), dataclasses.replace(LIMITS, max_request_tokens=8))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(RequestError, match="at most 2 per request"):
        parse_frame(step_frame.read_request(frame_bytes(steps)), dataclasses.replace(LIMITS, max_request_seqs=2))
    with pytest.raises(RequestError, match="namespace is 129 characters"):
        parse_frame(step_frame.read_request(frame_bytes(steps, "n" * 129)), LIMITS)
    # a drafter that cannot pre-draft ignores the budgets (zeros); one that can refuses more than its limit
    assert parse_frame(step_frame.read_request(frame_bytes(steps)), LIMITS).predraft_branches.tolist() == [0, 0, 0]
    can = dataclasses.replace(LIMITS, max_predraft_branches=1)
    with pytest.raises(RequestError, match=r"frame.predraft_branches\[2\] is 2; at most 1"):
        parse_frame(step_frame.read_request(frame_bytes(steps)), can)


def test_a_reply_frame_reads_back_and_a_bad_one_is_internal():
    cols = np.array([[0, 5, 0], [3, 0, 2], [1, 0, 4], [12, 9, 30], [0, 0, 1]], dtype=np.int64)
    data = step_frame.write_reply(11, cols, np.arange(5), {1: "unknown sequence 'b'"})
    d = parse_frame_reply(data, ["a", "b", "c"])
    assert d.codes.tolist() == [0, 5, 0] and d.codes.dtype == torch.int32
    assert d.num_drafts.tolist() == [3, 0, 2] and d.draft_token_ids.tolist() == [0, 1, 2, 3, 4]
    assert d.accepted_drafts.tolist() == [1, 0, 4] and d.committed_lengths.tolist() == [12, 9, 30]
    assert d.predrafted.tolist() == [False, False, True] and d.needs_resync.tolist() == [False, True, False]
    assert d.messages == {1: "unknown sequence 'b'"} and d.request_id == 11
    for bad, ids in ((data[:-3], ["a", "b", "c"]), (data, ["a", "b"]),
                     (step_frame.write_reply(11, cols, np.arange(4), {}), ["a", "b", "c"])):
        with pytest.raises(DrafterError) as e:
            parse_frame_reply(bad, ids)
        assert e.value.code == grpc.StatusCode.INTERNAL


@pytest.fixture(scope="module")
def frames_server(tiny_model, tmp_path_factory):
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path_factory.mktemp("frames"))) as s:
        yield s


async def test_frames_answer_what_protobuf_answers(frames_server):
    """The same steps from two engines, one through a channel that speaks frames, one through a channel that does
    not: the same drafts, codes, messages, counts and lengths, for propose() and propose_batch(), over greedy and
    sampled steps, uint64 seeds, an unknown sequence and packed states; a step asking for log-probabilities goes as
    protobuf on the frames channel, answered alike."""
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    n = 12
    async with DrafterClient(frames_server.uds, namespace="fr") as fr, \
            DrafterClient(frames_server.uds, namespace="pb") as pbc:
        assert await fr.open_step_channel() and fr.channel_frames
        assert await pbc.open_step_channel(frames=False) and not pbc.channel_frames
        seqs = {f"s{i}": dict(tokens=[rng.randrange(V) for _ in range(rng.randint(2, 9) + 1)], sent=0)
                for i in range(n)}
        for s in seqs.values():
            s["hidden"] = torch.randn(len(s["tokens"]) - 1, H, generator=g)
        taken = frames_server.server.runtime.metrics.channels.frames_taken
        for step in range(6):
            lp = step == 3
            steps = next_steps(seqs, rng, step, lp)
            if step == 2:
                steps.insert(5, SequenceStep("ghost", 4, [1], torch.randn(1, H, generator=g), 2, 3))
            packed = torch.cat([st.hidden_states for st in steps]) if step == 4 else None
            if packed is not None:
                steps = [dataclasses.replace(st, hidden_states=None) for st in steps]
            frames_before = fr.steps_as_frames
            if step % 2 == 0 or lp:
                by_fr = await fr.propose(steps, hidden_states=packed)
            else:  # the batch API, answered as BatchDrafts
                by_fr = await fr.propose_batch(as_batch(steps))
            by_pb = await pbc.propose(steps, hidden_states=packed)
            assert fr.steps_as_frames == frames_before + (0 if lp else 1) and pbc.steps_as_frames == 0
            if step % 2 == 1 and not lp:
                assert by_fr.codes.tolist() == [r.code for r in by_pb.sequences]
                assert torch.equal(by_fr.draft_token_ids, by_pb.draft_token_ids)
                assert by_fr.committed_lengths.tolist() == [r.committed_length for r in by_pb.sequences]
                assert by_fr.accepted_drafts.tolist() == [r.accepted_drafts for r in by_pb.sequences]
            else:
                assert torch.equal(by_fr.draft_token_ids, by_pb.draft_token_ids)
                for a, b in zip(by_fr.sequences, by_pb.sequences, strict=True):
                    assert (a.sequence_id, a.code, a.accepted_drafts, a.committed_length, a.needs_resync) == \
                        (b.sequence_id, b.code, b.accepted_drafts, b.committed_length, b.needs_resync)
                    assert a.message == b.message.replace("'pb'", "'fr'")
                    assert torch.equal(a.drafts, b.drafts)
                    assert (a.logprobs is None) == (b.logprobs is None)
                if step == 2:
                    ghost = by_fr.sequences[5]
                    assert ghost.code == grpc.StatusCode.NOT_FOUND.value[0] and ghost.needs_resync and ghost.message
            commit_some(seqs, steps, by_pb.sequences, rng, g)
        assert frames_server.server.runtime.metrics.channels.frames_taken - taken == 5
        assert fr.steps_through_channel == 6
        await fr.release(list(seqs))
        await pbc.release(list(seqs))


async def test_the_client_rehearses_the_last_reply_while_it_waits(frames_server, monkeypatch):
    """While the client waits for a reply it re-parses the last reply frame (StepChannel.rehearse), on a copy, keeping
    nothing: the same steps through a protobuf channel draft the same. A rehearsal that fails is dropped and the step
    goes on."""
    from drafter_client import step_channel

    waits = []
    rehearse = step_channel.StepChannel._rehearse
    monkeypatch.setattr(step_channel.StepChannel, "_rehearse", lambda self: (waits.append(1), rehearse(self)))
    rng, g = random.Random(5), torch.Generator().manual_seed(5)
    async with DrafterClient(frames_server.uds, namespace="re") as fr, \
            DrafterClient(frames_server.uds, namespace="rp") as pbc:
        assert await fr.open_step_channel() and fr.channel_frames and fr._step_channel.rehearse is None
        assert await pbc.open_step_channel(frames=False)
        seqs = {f"r{i}": dict(tokens=[rng.randrange(V) for _ in range(rng.randint(2, 6) + 1)], sent=0)
                for i in range(3)}
        for s in seqs.values():
            s["hidden"] = torch.randn(len(s["tokens"]) - 1, H, generator=g)
        for step in range(5):
            steps = next_steps(seqs, rng, step, False)
            batch_api = step < 2  # (as_batch drafts greedily: the steps before the sampled ones)
            by_fr = await (fr.propose_batch(as_batch(steps)) if batch_api else fr.propose(steps))
            assert fr._step_channel.rehearse is not None
            by_pb = await pbc.propose(steps)
            assert torch.equal(by_fr.draft_token_ids, by_pb.draft_token_ids)
            lengths = (by_fr.committed_lengths.tolist() if batch_api
                       else [r.committed_length for r in by_fr.sequences])
            assert lengths == [r.committed_length for r in by_pb.sequences]
            commit_some(seqs, steps, by_pb.sequences, rng, g)
        assert waits  # (the tiny model's CPU step lasts longer than a rehearsal period)
        fr._step_channel.rehearse = lambda: 1 / 0
        r = await fr.propose(next_steps(seqs, rng, 5, False))
        assert all(x.ok for x in r.sequences) and fr._step_channel.rehearse is not None
        await fr.release(list(seqs))
        await pbc.release(list(seqs))


@pytest.fixture(scope="module")
def rehearsing_server(tiny_model, tmp_path_factory):
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path_factory.mktemp("rehearse"),
                                  step_channel_rehearse_after_s=0.002, step_channel_spin_s=5.0)) as s:
        # (a long spin: rehearsals happen while the thread spins, and a loaded test machine may not run it for a
        # while)
        yield s


@pytest.fixture(scope="module")
def unrehearsed_server(tiny_model, tmp_path_factory):
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path_factory.mktemp("unrehearsed"),
                                  step_channel_rehearse_after_s=0)) as s:
        yield s


@contextlib.asynccontextmanager
async def frame_clients(rehearsing_server, unrehearsed_server, tag: str):
    """A client of each drafter (namespaces re-TAG and plain-TAG), each with a step channel that speaks frames."""
    async with DrafterClient(rehearsing_server.uds, namespace=f"re-{tag}") as re_, \
            DrafterClient(unrehearsed_server.uds, namespace=f"plain-{tag}") as plain:
        assert await re_.open_step_channel() and re_.channel_frames
        assert await plain.open_step_channel() and plain.channel_frames
        yield re_, plain


def random_sequences(rng: random.Random, g: torch.Generator, n: int, prefix: str, most: int) -> dict:
    """n sequences (next_steps' form) of 3 to most + 1 random tokens and their random states."""
    seqs = {f"{prefix}{i}": dict(tokens=[rng.randrange(V) for _ in range(rng.randint(2, most) + 1)], sent=0)
            for i in range(n)}
    for s in seqs.values():
        s["hidden"] = torch.randn(len(s["tokens"]) - 1, H, generator=g)
    return seqs


async def test_the_step_thread_rehearses_the_last_frame_once_it_has_waited(rehearsing_server, unrehearsed_server):
    """--step-channel-rehearse-after-s: once the step thread has spun that long after its last batch it re-reads and
    re-checks the last request frame (ChannelSet.rehearse). Rehearsals change nothing: the same steps through a
    drafter that never rehearses draft the same. A rehearsal that fails is dropped and the steps go on. (When one is
    due: test_rehearsals_are_due_only_once_the_thread_has_waited.)"""
    channels = rehearsing_server.server.channels
    assert channels.rehearse_frames and not unrehearsed_server.server.channels.rehearse_frames
    rng, g = random.Random(5), torch.Generator().manual_seed(5)
    async with frame_clients(rehearsing_server, unrehearsed_server, "frames") as (re_, plain):
        seqs = random_sequences(rng, g, 3, "r", 6)
        counts = []
        for step in range(5):
            steps = next_steps(seqs, rng, step, False)
            by_re = await re_.propose(steps)
            counts.append(channels.rehearsals)
            await asyncio.sleep(0.02)  # (an engine's target forward: the step thread spins, then rehearses)
            by_plain = await plain.propose(steps)
            assert torch.equal(by_re.draft_token_ids, by_plain.draft_token_ids)
            assert [r.committed_length for r in by_re.sequences] == [r.committed_length for r in by_plain.sequences]
            commit_some(seqs, steps, by_plain.sequences, rng, g)
        assert channels.rehearsals > counts[0] and channels._rehearsal is not None
        assert all(x.ok for x in (await re_.propose(next_steps(seqs, rng, 5, False))).sequences)
        channels._rehearsal = b"not a frame"  # a rehearsal that fails is dropped (within the thread's spin)
        for _ in range(200):
            await asyncio.sleep(0.01)
            if channels._rehearsal is None:
                break
        assert channels._rehearsal is None
        r = await re_.propose(next_steps(seqs, rng, 6, False))
        assert all(x.ok for x in r.sequences) and channels._rehearsal is not None
        await re_.release(list(seqs))


async def test_a_columns_step_is_rehearsed_up_to_its_launches(rehearsing_server, unrehearsed_server):
    """A request of 8 greedy sequences runs from its columns: the step thread's rehearsal then also runs the proposer's host
    work before that step's launches (Proposer.rehearse_columns; nothing changed: the same steps through a drafter that
    never rehearses draft the same). With the servicer's rehearse_admission off (--no-step-channel-rehearse-admission)
    the parse alone is rehearsed."""
    from drafter_service.cli import parse_args

    assert parse_args([]).step_channel_rehearse_admission
    assert parse_args(["--no-step-channel-rehearse-admission"]).step_channel_rehearse_admission is False
    proposer = rehearsing_server.server.runtime.proposer
    servicer = rehearsing_server.server.servicer
    assert servicer.rehearse_admission  # (from the config: attach)
    rng, g = random.Random(8), torch.Generator().manual_seed(8)
    async with frame_clients(rehearsing_server, unrehearsed_server, "columns") as (re_, plain):
        seqs = random_sequences(rng, g, 8, "c", 5)

        async def steps_alike(n):
            for step in range(n):
                steps = [dataclasses.replace(s, temperature=0.0, seed=0) for s in next_steps(seqs, rng, step, False)]
                by_re = await re_.propose(steps)
                await asyncio.sleep(0.02)  # (the engine's target forward: the step thread spins, then rehearses)
                by_plain = await plain.propose(steps)
                assert torch.equal(by_re.draft_token_ids, by_plain.draft_token_ids)
                assert [r.committed_length for r in by_re.sequences] == [r.committed_length for r in by_plain.sequences]
                commit_some(seqs, steps, by_plain.sequences, rng, g)

        columns_before, rehearsed_before = proposer.columns_steps_run, proposer.columns_rehearsals
        await steps_alike(4)
        assert proposer.columns_steps_run - columns_before >= 3  # (the first step creates the sequences)
        assert proposer.columns_rehearsals > rehearsed_before
        servicer.rehearse_admission = False
        try:
            rehearsed, parses = proposer.columns_rehearsals, rehearsing_server.server.channels.rehearsals
            await steps_alike(2)
            assert proposer.columns_rehearsals == rehearsed
            assert rehearsing_server.server.channels.rehearsals > parses
        finally:
            servicer.rehearse_admission = True
        await re_.release(list(seqs))
        await plain.release(list(seqs))


def test_a_rehearsal_takes_at_most_a_fifth_of_the_spin():
    """ChannelSet.rehearse: after a rehearsal of d seconds the next one waits d * (1 / REHEARSE_DUTY - 1) (at least
    REHEARSE_EVERY_S: step_frame.rehearsal_pause, the client's rule too), so that a long check (a large frame's) is not what the next request waits behind most of the
    time; rehearse() before then does nothing. The frame is checked as a rehearsal (decode_frame(...,
    rehearsal=True))."""
    from drafter_service.transport import step_channels as sc

    calls = []

    def decode_frame(frame, rehearsal=False):
        calls.append((frame.request_id, rehearsal))
        time.sleep(0.004)  # (a long check)
        return [], False

    data = frame_bytes(some_steps(), request_id=9)
    cs = sc.ChannelSet("unused", sc.ChannelLimits(1, 4096, 4096), decode=None, encode=None, metrics=None,
                       checksums=False, decode_frame=decode_frame)
    cs.rehearse()
    assert cs.rehearsals == 0  # (no frame yet)
    cs._rehearsal = step_frame.without_states(data, step_frame.read_request(data))
    cs.rehearse()
    assert calls == [(9, True)] and cs.rehearsals == 1
    assert cs._next_rehearsal - time.perf_counter() > 0.004 * (1 / sc.REHEARSE_DUTY - 1) - 0.001  # (16 ms after)
    cs.rehearse()
    assert cs.rehearsals == 1
    cs._next_rehearsal = 0.0
    cs.rehearse()
    assert cs.rehearsals == 2


def test_rehearsals_are_due_only_once_the_thread_has_waited():
    """StepScheduler._rehearsal_due: never with rehearse_after_s 0 or before the first batch; after a batch, only
    once rehearse_after_s has passed (a step back to back with the last finds its code warm and no rehearsal in its
    way)."""
    from drafter_service.engine.scheduler import StepScheduler

    waited = StepScheduler(object(), 1024, 64, rehearse_after_s=10.0)
    assert not waited._rehearsal_due()  # (no batch yet)
    waited._last_batch_end = time.perf_counter()
    assert not waited._rehearsal_due()
    waited.rehearse_after_s = 0.002
    waited._last_batch_end = time.perf_counter() - 1.0
    assert waited._rehearsal_due()
    never = StepScheduler(object(), 1024, 64)
    never._last_batch_end = time.perf_counter() - 1.0
    assert never.rehearse_after_s == 0 and not never._rehearsal_due()


async def test_a_bad_frame_gets_an_error_reply_and_the_channel_goes_on(frames_server):
    """Frames written by hand into the mailbox: a malformed one is INVALID_ARGUMENT naming the problem, one of
    another namespace PERMISSION_DENIED, one with a bad column INVALID_ARGUMENT naming it; after each, a good step
    through the same channel drafts."""
    async with DrafterClient(frames_server.uds, namespace="hand") as c:
        assert await c.open_step_channel() and c.channel_frames
        ch = c._step_channel
        good = some_steps(3)
        cases = [(frame_bytes(good, "hand")[:-5], grpc.StatusCode.INVALID_ARGUMENT, "frame: its header describes"),
                 (frame_bytes(good, "other"), grpc.StatusCode.PERMISSION_DENIED, "this channel was opened by"),
                 (frame_bytes([dataclasses.replace(good[0], next_token=V)], "hand"), grpc.StatusCode.INVALID_ARGUMENT,
                  r"frame.next_tokens\[0\] is 512")]
        for data, code, message in cases:
            assert ch.try_claim()
            reply = pb.ProposeResponse.FromString(await ch.call(data, 5.0))
            assert reply.error.code == code.value[0] and reply.request_id in (0, 7), reply
            assert __import__("re").search(message, reply.error.message), reply.error.message
            r = await c.propose([SequenceStep("g", 0, [1, 2, 3], torch.randn(3, H), 4, 3)])
            assert r.sequences[0].ok and r.sequences[0].drafts.numel() == 3
        assert c.steps_as_frames == 3
        await c.release(["g"])


async def test_a_drafter_without_frames_keeps_the_client_on_protobuf(tiny_model, tmp_path):
    """--no-step-channel-frames, or a drafter from before frames (it ignores the hello's key): protobuf only."""
    from drafter_service.cli import parse_args

    assert parse_args(["--no-step-channel-frames"]).step_channel_frames is False and parse_args([]).step_channel_frames
    head, target = tiny_model
    cfg = make_config(head, target, tmp_path)
    cfg.step_channel_frames = False
    with ServerThread(cfg) as s:
        assert s.server.channels.decode_frame is None
        async with DrafterClient(s.uds, namespace="old") as c:
            assert await c.open_step_channel() and not c.channel_frames
            r = await c.propose([SequenceStep("a", 0, [1, 2, 3], torch.randn(3, H), 4, 3)])
            assert r.sequences[0].ok and c.steps_through_channel == 1 and c.steps_as_frames == 0


def test_the_sync_client_sends_frames_on_the_calling_thread(frames_server):
    """SyncDrafterClient's channel path (on the calling thread) sends frames too: the same drafts as a gRPC-only
    client over steps with random acceptance, never through its event loop."""
    from drafter_client.sync import SyncDrafterClient

    rng = random.Random(4)
    g = torch.Generator().manual_seed(4)
    with SyncDrafterClient(frames_server.uds, namespace="sync-fr") as fast, \
            SyncDrafterClient(frames_server.uds, namespace="sync-pb") as slow:
        assert fast.open_step_channel() and fast._client.channel_frames

        async def not_on_the_loop(*args, **kwargs):
            raise AssertionError("propose() went to the event loop although the channel was free")

        fast._client.propose = not_on_the_loop
        seqs = {f"s{i}": dict(tokens=[rng.randrange(V) for _ in range(6)], sent=0) for i in range(3)}
        for s in seqs.values():
            s["hidden"] = torch.randn(5, H, generator=g)
        for _ in range(5):
            steps = [SequenceStep(sid, s["sent"], s["tokens"][s["sent"]:-1], s["hidden"][s["sent"]:],
                                  s["tokens"][-1], rng.randint(1, K)) for sid, s in seqs.items()]
            a, b = fast.propose(steps), slow.propose(steps)
            assert [x.drafts.tolist() for x in a.sequences] == [y.drafts.tolist() for y in b.sequences]
            commit_some(seqs, steps, a.sequences, rng, g)
        assert fast._client.steps_as_frames == 5 and fast._client.steps_through_channel == 5
        fast.release(list(seqs))
        slow.release(list(seqs))


def test_a_reply_frame_whose_head_was_encoded_before_the_drafts_is_the_whole_reply():
    """frame_reply with the head frame_reply_head made from the answer before its drafts (drafts None, as the
    step's early callback sees it) is the reply frame_reply makes from the finished answer: every draft count,
    failed sequences, no drafts at all; and it reads back to those values."""
    from drafter_service.transport.servicer import frame_reply, frame_reply_head
    from test_step_columns import early_answer

    rng = random.Random(6)
    for n, k in ((1, 5), (6, 3), (40, 8), (7, 0)):
        out = early_answer(rng, n, k)
        codes = out.codes
        head = frame_reply_head(out, 9)
        out.drafts = torch.randint(0, 50000, (n, k))
        whole = frame_reply(out, 9)
        assert frame_reply(out, 9, head) == whole
        d = parse_frame_reply(whole, [f"s{i}" for i in range(n)])
        counts = out.num_drafts * (codes == 0)
        assert d.num_drafts.tolist() == counts.tolist() and d.codes.tolist() == codes.tolist()
        assert d.draft_token_ids.tolist() == [t for i in range(n) for t in out.drafts[i, : counts[i]].tolist()]
        assert d.messages == {i: f"gone {i}" for i, c in enumerate(codes.tolist()) if c}
        assert d.accepted_drafts.tolist() == out.accepted_drafts.tolist()
        assert d.committed_lengths.tolist() == out.committed_lengths.tolist()


@pytest.mark.parametrize("frames", [True, False])
async def test_a_reply_larger_than_the_reply_area_is_resource_exhausted(frames_server, frames):
    """A step whose answer does not fit the channel's reply area gets RESOURCE_EXHAUSTED naming reply_bytes, as a
    frame and as protobuf, and the channel takes the next (smaller) step."""
    g = torch.Generator().manual_seed(8)
    n = 150  # (5 drafts each: 6 KB of draft ids alone, for a 4 KiB reply area)
    async with DrafterClient(frames_server.uds, namespace=f"big-{frames}", raise_on_error=True) as c:
        assert await c.open_step_channel(reply_bytes=4096, frames=frames) and c.channel_frames == frames
        steps = [SequenceStep(f"s{i}", 0, [1, 2, 3], torch.randn(3, H, generator=g), 4, 5) for i in range(n)]
        with pytest.raises(DrafterError) as e:
            await c.propose(steps)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "reply_bytes" in e.value.message
        r = await c.propose([SequenceStep("small", 0, [1, 2, 3], torch.randn(3, H, generator=g), 4, 3)])
        assert r.sequences[0].ok and c.steps_through_channel == 2 and c.steps_as_frames == (2 if frames else 0)
        await c.release([f"s{i}" for i in range(n)] + ["small"])


async def test_an_ingest_only_drafter_answers_small_and_large_frames_without_drafting(tiny_model, tmp_path):
    """Benchmarks' ingest-only mode (DrafterServicer.ingest_only): a small frame (parsed per sequence) and one of 8
    sequences (columns) are checked, their states moved to the device, and answered with no drafts, code 0."""
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path)) as s:
        s.server.servicer.ingest_only = True
        async with DrafterClient(s.uds, namespace="dry") as c:
            assert await c.open_step_channel() and c.channel_frames
            for n in (1, 8):
                steps = [SequenceStep(f"d{i}", 0, [1, 2], torch.randn(2, H), 3, 2) for i in range(n)]
                r = await c.propose(steps)
                assert [x.code for x in r.sequences] == [0] * n and r.draft_token_ids.numel() == 0
            assert c.steps_as_frames == 2
