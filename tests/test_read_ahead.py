"""Request frames read ahead (step_channels.py, "Reading ahead"): the client rings the head bell between a frame's head
and its states; the step thread checks the head then, and at the doorbell queues what it read. These tests drive a
mailbox by hand on one thread, calling the step thread's poll while the "client" is between the two halves."""
import mmap
import os
import socket

import grpc
import pytest
import torch

from drafter_client import SequenceStep
from drafter_client.batch import frame_from_steps
from drafter_client.protocol import pb, step_frame
from drafter_client.protocol.mailbox import Mailbox
from drafter_service.engine.batch_io import BatchInput
from drafter_service.transport.step_channels import Channel, ChannelLimits, ChannelSet
from drafter_service.transport.validation import parse_frame
from test_step_frames import H, LIMITS, V, some_steps


class Drafter:
    """A ChannelSet of one open channel over a memfd mailbox (both ends map it here), its frames checked by
    validation.parse_frame; queued requests land in .queued."""

    def __init__(self, checksums: bool = False, namespace: str = "ns"):
        self.decoded = 0
        self.may = True

        def decode_frame(frame):
            self.decoded += 1
            return parse_frame(frame, LIMITS), False

        self.set = ChannelSet(socket_path="/nonexistent", limits=ChannelLimits(1, 1 << 20, 1 << 22),
                              decode=None, encode=None, metrics=_NoMetrics(), checksums=checksums,
                              decode_frame=decode_frame, may_read_ahead=lambda: self.may)
        size = Mailbox.segment_bytes(1 << 20, 1 << 12)
        self.fd = os.memfd_create("t", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.box = Mailbox.initialize(self.mm, 1 << 20, 1 << 12, checksums)
        self.ours, self.theirs = socket.socketpair()
        self.ch = Channel(id=1, namespace=namespace, conn=self.ours, fd=self.fd, mm=self.mm, box=self.box,
                          in_place=True, frames=True)
        self.set._open.append(self.ch)
        self.set._count = 1
        self.queued = []

    def poll(self) -> bool:
        return self.set.poll(self.queued.append)

    def close(self) -> None:
        self.queued.clear()
        self.set._close(self.ch, "test")
        self.theirs.close()


class _NoMetrics:
    def record_rpc_error(self, code):
        pass

    def record_rpc_timing(self, *args, **kwargs):
        pass


class PollBetween:
    """A request frame that calls between() after the mailbox's head bell (Mailbox.write's head_written), before its
    states are written: the drafter polling while the client copies the states."""

    head_first = True

    def __init__(self, frame, between):
        self.frame, self.between = frame, between

    def __len__(self) -> int:
        return len(self.frame)

    def write_into(self, dest, head_written=None):
        def then():
            if head_written is not None:
                head_written()
            self.between()
        self.frame.write_into(dest, then)


def _frame(steps, namespace="ns"):
    return frame_from_steps(namespace, steps, None, 7)


def _reply_error(box: Mailbox, seq: int) -> "pb.ProposeResponse":
    assert box.doorbell(box.reply) == seq
    return pb.ProposeResponse.FromString(box.read(box.reply, seq))


def test_a_frame_read_ahead_is_queued_at_its_doorbell_with_the_states_written_after_its_check():
    d = Drafter()
    steps = some_steps(12)
    seen_between = []

    def between():
        assert not d.poll()  # no doorbell yet: nothing queued ...
        seen_between.append(d.ch.ahead is not None and d.decoded == 1)  # ... but the head is checked
        assert not d.poll() and d.decoded == 1  # (read once)

    d.box.write(d.box.request, 1, PollBetween(_frame(steps), between))
    assert seen_between == [True]
    assert d.poll() and d.decoded == 1 and len(d.queued) == 1  # the doorbell: queued as read ahead, no second read
    assert d.set.frames_read_ahead == 1 and d.set.frames_taken == 1 and d.ch.ahead is None
    assert d.box.taken_seq == 1
    got = d.queued[0].steps
    want = parse_frame(step_frame.read_request(bytes(_frame(steps))), LIMITS)
    assert isinstance(got, BatchInput) and got.sequence_ids == want.sequence_ids
    assert got.owners == ["step channel 1"] * len(steps)  # (sequences it creates belong to the channel)
    for name in ("start_positions", "num_tokens", "next_tokens", "num_drafts", "temperatures", "seeds",
                 "predraft_branches", "token_ids"):
        assert (getattr(got.arrays, name) == getattr(want.arrays, name)).all(), name
    # the states were copied into the mailbox after the head was checked: the step reads them from there
    assert torch.equal(got.hidden_states, torch.cat([s.hidden_states for s in steps]))
    d.close()


def test_a_request_other_than_the_one_read_ahead_is_read_at_its_doorbell():
    """The head bell is a hint: when request_len at the doorbell is not what was read ahead (here the client rang the
    bell for one frame, then sent another under that sequence number), the request is read again."""
    d = Drafter()
    first = _frame(some_steps(12))
    box = d.box
    with memoryview(d.mm) as whole, whole[box.request.start : box.request.start + len(first)] as dest:
        def bell():
            box.words[box.request.length] = len(first)
            box.words[box.request.head_seq] = 1
        first.write_into(dest, bell)  # (its head and states, no doorbell)
    assert not d.poll() and d.ch.ahead is not None and d.ch.ahead.seq == 1 and d.decoded == 1
    other = some_steps(3, seed=2)
    box.write(box.request, 1, bytes(_frame(other)))  # (bytes: no head bell of its own)
    assert d.poll() and d.decoded == 2 and d.set.frames_read_ahead == 0 and len(d.queued) == 1
    assert d.queued[0].steps.sequence_ids == [s.sequence_id for s in other]
    assert torch.equal(d.queued[0].steps.hidden_states, torch.cat([s.hidden_states for s in other]))
    d.close()


def test_a_frame_refused_when_read_ahead_is_answered_at_its_doorbell_and_not_before():
    d = Drafter(namespace="mine")
    replies_between = []

    def between():
        d.poll()
        replies_between.append(d.box.doorbell(d.box.reply))

    d.box.write(d.box.request, 1, PollBetween(_frame(some_steps(4), namespace="theirs"), between))
    assert replies_between == [0] and d.ch.ahead is not None  # checked, refused, not answered yet
    assert d.poll() and d.queued == [] and d.set.frames_read_ahead == 1  # answered at the doorbell, nothing queued
    reply = _reply_error(d.box, 1)
    assert reply.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "'theirs'" in reply.error.message
    d.close()


def test_no_read_ahead_while_a_batch_is_about_to_run():
    """The scheduler's poll with requests queued (read_ahead False) leaves a rung head bell for later: checking a
    frame that cannot join the coming batch would only delay the batch."""
    d = Drafter()
    polls = []

    def between():
        polls.append((d.set.poll(d.queued.append, read_ahead=False), d.ch.ahead is None, d.decoded))
        polls.append((d.poll(), d.ch.ahead is None, d.decoded))  # (then, with nothing queued, it is read ahead)

    d.box.write(d.box.request, 1, PollBetween(_frame(some_steps(12)), between))
    assert polls == [(False, True, 0), (False, False, 1)]
    assert d.poll() and d.set.frames_read_ahead == 1 and d.decoded == 1
    d.close()


def test_a_head_bell_over_bytes_that_are_no_frame_is_looked_at_once():
    """A head bell rung over bytes that are not a request frame (only a misbehaving client does that) is looked at by
    one poll, not by every poll until its doorbell: the other engines' requests wait for no view per poll."""
    d = Drafter()
    box = d.box
    views = []
    view = box.view
    box.view = lambda area, seq, *a: views.append(seq) or view(area, seq, *a)
    junk = b"\x00" * 64
    with memoryview(d.mm) as whole:
        whole[box.request.start : box.request.start + len(junk)] = junk
    box.words[box.request.length] = len(junk)
    box.words[box.request.head_seq] = 1
    for _ in range(5):
        assert not d.poll()
    assert views == [1] and d.ch.ahead is None and d.decoded == 0
    box.write(box.request, 1, bytes(_frame(some_steps(3))))  # (then a frame, at its doorbell: read as always)
    assert d.poll() and d.decoded == 1 and len(d.queued) == 1 and d.set.frames_read_ahead == 0
    d.close()


@pytest.mark.parametrize("why", ["checksums", "ingest-only", "not in place"])
def test_no_read_ahead_where_it_is_off(why):
    """A mailbox with CHECKSUMS gets no head bell (and a bell rung anyway is not read: the crc covers the whole
    request), an ingest-only drafter (may_read_ahead False) and a mapping read by copy wait for the doorbell."""
    d = Drafter(checksums=why == "checksums")
    d.may = why != "ingest-only"
    d.ch.in_place = why != "not in place"
    bells = []

    def between():
        bells.append(d.box.head_bell())
        d.box.words[d.box.request.head_seq] = 1  # (a bell rung anyway)
        d.poll()

    d.box.write(d.box.request, 1, PollBetween(_frame(some_steps(12)), between))
    assert bells == [0 if why == "checksums" else 1]
    assert d.decoded == 0 and d.ch.ahead is None
    assert d.poll() and d.decoded == 1 and d.set.frames_read_ahead == 0 and len(d.queued) == 1
    d.close()


def test_the_flag_and_ingest_only_turn_reading_ahead_off(tiny_model, tmp_path):
    from conftest import ServerThread, make_config
    from drafter_service.cli import parse_args

    assert parse_args([]).step_channel_read_ahead and not parse_args(
        ["--no-step-channel-read-ahead"]).step_channel_read_ahead
    head, target = tiny_model
    with ServerThread(make_config(head, target, tmp_path / "on")) as s:
        channels = s.server.runtime.metrics.channels
        assert channels.may_read_ahead()
        s.server.servicer.ingest_only = True  # (benchmarks: its parse copies the states to the device)
        assert not channels.may_read_ahead()
    with ServerThread(make_config(head, target, tmp_path / "off", step_channel_read_ahead=False)) as s:
        assert not s.server.runtime.metrics.channels.may_read_ahead()


async def test_steps_through_a_channel_that_reads_ahead_draft_as_over_grpc(tiny_model, tmp_path):
    """End to end (a real drafter and client; whether a given step is read ahead depends on timing): the same batch
    steps through a frames channel and by unary gRPC draft alike, and the channel's frames were taken."""
    from conftest import ServerThread, make_config
    from drafter_client import DrafterClient
    from test_batch_api import as_batch

    head, target = tiny_model
    g = torch.Generator().manual_seed(5)
    with ServerThread(make_config(head, target, tmp_path)) as s:
        async with DrafterClient(s.uds, namespace="a") as ch, DrafterClient(s.uds, namespace="b") as un:
            assert await ch.open_step_channel() and ch.channel_frames
            steps = [SequenceStep(f"s{i}", 0, torch.randint(0, V, (6,), generator=g).tolist(),
                                  torch.randn(6, H, generator=g), 3, 4) for i in range(64)]
            for _ in range(3):
                a = await ch.propose_batch(as_batch(steps))
                b = await un.propose_batch(as_batch(steps))
                assert torch.equal(a.codes, b.codes) and torch.equal(a.draft_token_ids, b.draft_token_ids)
                assert torch.equal(a.committed_lengths, b.committed_lengths)
            assert ch.steps_as_frames == 3 and un.steps_through_channel == 0
            assert s.server.runtime.metrics.channels.frames_taken == 3
