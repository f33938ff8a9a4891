"""The batch API (drafter_client.batch): StepBatch in, BatchDrafts out, against the per-sequence API on the same
drafter: same drafts, codes, counts and lengths over steps with random acceptance, a bad sequence in the batch,
log-probabilities, the step channel and the fallback of a drafter that is not there."""
import dataclasses
import random

import grpc

import pytest
import torch

from drafter_client import BatchDrafts, DrafterClient, SequenceStep, StepBatch
from drafter_client.batch import serialize_batch
from drafter_client.messages import build_request
from drafter_client.protocol import pb

H, V, K = 64, 512, 4


def as_batch(steps: list[SequenceStep], temperature: float = 0.0, logprobs: bool = False) -> StepBatch:
    return StepBatch(
        sequence_ids=[s.sequence_id for s in steps],
        start_positions=torch.tensor([s.start_position for s in steps]),
        num_tokens=torch.tensor([len(s.token_ids) for s in steps]),
        token_ids=torch.tensor([t for s in steps for t in s.token_ids]),
        hidden_states=torch.cat([s.hidden_states for s in steps]),
        next_tokens=torch.tensor([s.next_token for s in steps]),
        num_drafts=torch.tensor([s.num_drafts for s in steps]),
        temperature=temperature, seed=7 if temperature else 0, return_logprobs=logprobs)


def next_steps(seqs: dict, rng: random.Random, step: int, return_logprobs: bool = False,
               top_k_probs: int = 0) -> list[SequenceStep]:
    """Each sequence's next step (its uncommitted tokens and states, a random k); from step 2 on, half of them sampled
    with seeds that include uint64 values of 2**63 and up."""
    steps = []
    for sid, s in seqs.items():
        end = len(s["tokens"]) - 1
        sampled = step >= 2 and rng.random() < 0.5
        steps.append(SequenceStep(sid, s["sent"], s["tokens"][s["sent"]:end], s["hidden"][s["sent"]:end],
                                  s["tokens"][end], rng.randint(0, K),
                                  temperature=rng.choice([0.6, 1.2]) if sampled else 0.0,
                                  seed=rng.choice([3, 2**63 + 5, 2**64 - 1]) if sampled else 0,
                                  return_logprobs=return_logprobs, top_k_probs=top_k_probs))
    return steps


def commit_some(seqs: dict, steps: list[SequenceStep], results, rng: random.Random, g: torch.Generator) -> None:
    """The engine's side after a step: each sequence (but "ghost") commits some of its drafts and a token of its own,
    with new hidden states."""
    for st, r in zip(steps, results):
        if st.sequence_id == "ghost":
            continue
        s = seqs[st.sequence_id]
        assert r.ok, r.message
        s["sent"] = st.start_position + len(st.token_ids)
        new = r.drafts.tolist()[: rng.randint(0, r.drafts.numel())] + [rng.randrange(V)]
        s["tokens"] = s["tokens"] + new
        s["hidden"] = torch.cat([s["hidden"], torch.randn(len(new), H, generator=g)])


def test_serialized_batch_is_the_per_sequence_request():
    g = torch.Generator().manual_seed(0)
    steps = [SequenceStep(f"s{i}", 3 * i, [i, i + 1, 5], torch.randn(3, H, generator=g), 9, i % 5) for i in range(6)]
    for temperature, logprobs in ((0.0, False), (0.5, True)):
        steps_t = [SequenceStep(**{**s.__dict__, "temperature": temperature, "seed": 7 if temperature else 0,
                                   "return_logprobs": logprobs}) for s in steps]
        got = pb.ProposeRequest.FromString(bytes(serialize_batch("ns", as_batch(steps_t, temperature, logprobs),
                                                                 request_id=3)))
        assert got == build_request("ns", steps_t, request_id=3)


def test_uint64_seeds_go_alike_as_messages_and_as_columns():
    """Seeds of 2**63 and up, in an int64 seed column as the int64 of the same bits (negative), reach the drafter as
    the same uint64 seeds in both forms (messages: below 32 sequences or a drafter without columns)."""
    from drafter_service.transport.validation import Limits, parse_propose

    limits = Limits(hidden_states_width=H, vocab_size=V, max_draft_tokens=8, max_request_tokens=4096,
                    max_request_seqs=64)
    steps = [SequenceStep(f"s{i}", 0, [1, 2], torch.randn(2, H), 3, 2) for i in range(3)]
    wanted = [2**64 - 1, 2**63, 5]
    for seed in (torch.tensor([-1, -(2**63), 5]), -1, 2**64 - 1):
        batch = as_batch(steps, temperature=0.5)
        batch.seed = seed
        expect = wanted if isinstance(seed, torch.Tensor) else [2**64 - 1] * 3
        for columns in (False, True):
            req = pb.ProposeRequest.FromString(bytes(serialize_batch("ns", batch, request_id=1, columns=columns)))
            assert [s.seed for s in parse_propose(req, limits)] == expect, (seed, columns)


def test_padded_is_the_per_row_layout():
    d = BatchDrafts(sequence_ids=["a", "b", "c"], codes=torch.zeros(3, dtype=torch.int32),
                    num_drafts=torch.tensor([2, 0, 3]), draft_token_ids=torch.tensor([1, 2, 3, 4, 5]),
                    accepted_drafts=torch.zeros(3, dtype=torch.int64), committed_lengths=torch.zeros(3),
                    needs_resync=torch.zeros(3, dtype=torch.bool))
    assert d.padded().tolist() == [[1, 2, -1], [-1, -1, -1], [3, 4, 5]]


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("transport", ["unary", "channel", "stream"])
async def test_batch_api_answers_as_the_per_sequence_api(server, transport, columns, monkeypatch):
    """columns: the batches go as columnar requests (ProposeRequest.columns, answered with result_columns); else as
    per-sequence messages (batches below COLUMNS_MIN_SEQUENCES, or a drafter without columns). transport: unary
    calls, a step channel, or a ProposeStream session (ProposeSession.propose_batch; the per-sequence steps on a
    session of their own)."""
    import contextlib

    import drafter_client.client

    monkeypatch.setattr(drafter_client.client, "COLUMNS_MIN_SEQUENCES", 1 if columns else 10**9)
    channel = transport == "channel"
    rng = random.Random(channel)
    g = torch.Generator().manual_seed(1)
    async with DrafterClient(server.uds, namespace=f"cols-{transport}-{columns}") as cols, \
            DrafterClient(server.uds, namespace=f"rows-{transport}-{columns}") as rows, \
            contextlib.AsyncExitStack() as stack:
        rows._step_columns = False  # (propose() sends columns too, to a drafter that takes them: not here)
        if channel:  # (protobuf through the channel: test_step_frames.py has the frames)
            assert await cols.open_step_channel(frames=False) and await rows.open_step_channel(frames=False)
        rows_api, cols_api = rows, cols
        if transport == "stream":
            rows_api = await stack.enter_async_context(rows.stream())
            cols_api = await stack.enter_async_context(cols.stream())
        seqs = {f"s{i}": dict(tokens=[rng.randrange(V) for _ in range(rng.randint(3, 12) + 1)], sent=0)
                for i in range(5)}
        for s in seqs.values():
            s["hidden"] = torch.randn(len(s["tokens"]) - 1, H, generator=g)
        for step in range(6):
            steps = []
            for sid, s in seqs.items():
                n = len(s["tokens"]) - 1
                steps.append(SequenceStep(sid, s["sent"], s["tokens"][s["sent"]:n], s["hidden"][s["sent"]:n],
                                          s["tokens"][n], rng.randint(0, K), return_logprobs=step % 2 == 1))
            if step == 3:  # an unknown sequence in the middle: a per-sequence NOT_FOUND in both
                steps.insert(2, SequenceStep("ghost", 4, [1], torch.randn(1, H, generator=g), 2, 3,
                                             return_logprobs=True))
            by_rows = await rows_api.propose(steps)
            by_cols = await cols_api.propose_batch(as_batch(steps, logprobs=step % 2 == 1))
            assert not by_rows.fallback and not by_cols.fallback
            assert by_cols.sequence_ids == [s.sequence_id for s in steps]
            assert by_cols.codes.tolist() == [r.code for r in by_rows.sequences]
            assert by_cols.num_drafts.tolist() == [r.drafts.numel() for r in by_rows.sequences]
            assert torch.equal(by_cols.draft_token_ids, by_rows.draft_token_ids)
            assert torch.equal(by_cols.padded(), by_rows.padded())
            assert by_cols.committed_lengths.tolist() == [r.committed_length for r in by_rows.sequences]
            assert by_cols.accepted_drafts.tolist() == [r.accepted_drafts for r in by_rows.sequences]
            assert by_cols.needs_resync.tolist() == [r.needs_resync for r in by_rows.sequences]
            assert by_cols.messages == {i: r.message.replace("'rows-", "'cols-")  # (the namespaces differ)
                                        for i, r in enumerate(by_rows.sequences) if r.code}
            if step % 2:
                assert torch.allclose(by_cols.logprobs, torch.cat([r.logprobs for r in by_rows.sequences]))
            commit_some(seqs, steps, by_rows.sequences, rng, g)
        assert (cols.steps_through_channel > 0) == channel
        assert (cols.steps_through_grpc > 0) == (transport == "unary")  # (a session's steps are its stream's)
        assert cols._step_columns is (True if columns else None)  # asked GetInfo only when a batch could use columns
        if transport == "stream":
            assert cols_api.streams_opened == 1
        await cols.release(list(seqs))
        await rows.release(list(seqs))


@pytest.mark.parametrize("transport", ["unary", "channel", "stream"])
async def test_propose_sends_a_large_step_as_columns_with_the_same_answer(server, transport, monkeypatch):
    """propose(list[SequenceStep]) of COLUMNS_MIN_SEQUENCES sequences or more goes as a columnar request (when the
    steps share return_logprobs and top_k_probs) and answers exactly what the per-sequence messages answer: drafts,
    codes and messages, log-probabilities, top-N, counts, over sampled and greedy steps, uint64 seeds, a sequence
    the drafter does not know, per-step and packed states. Unary calls, a step channel, and a ProposeStream session
    (whose messages go the same way)."""
    import contextlib

    import drafter_client.batch
    import drafter_client.client

    channel = transport == "channel"
    sent_as_columns = []
    as_columns = drafter_client.batch.serialize_steps_as_columns
    monkeypatch.setattr(drafter_client.client, "serialize_steps_as_columns",  # (a stream session's steps too)
                        lambda *a, **kw: sent_as_columns.append(1) or as_columns(*a, **kw))
    rng = random.Random(10 + channel)
    g = torch.Generator().manual_seed(2)
    n = drafter_client.client.COLUMNS_MIN_SEQUENCES + 8
    async with DrafterClient(server.uds, namespace=f"pc-{transport}") as cols, \
            DrafterClient(server.uds, namespace=f"pr-{transport}") as rows, contextlib.AsyncExitStack() as stack:
        rows._step_columns = False  # a drafter without columns, as far as this client knows: messages
        if channel:  # (protobuf through the channel: test_step_frames.py has the frames)
            assert await cols.open_step_channel(frames=False) and await rows.open_step_channel(frames=False)
        early_before = server.server.runtime.metrics.channels.early_replies
        grpc_early_before = server.server.servicer.early_replies
        by = {"cols": cols, "rows": rows}
        if transport == "stream":
            by = {"cols": await stack.enter_async_context(cols.stream()),
                  "rows": await stack.enter_async_context(rows.stream())}
        seqs = {f"s{i}": dict(tokens=[rng.randrange(V) for _ in range(rng.randint(2, 9) + 1)], sent=0)
                for i in range(n)}
        for s in seqs.values():
            s["hidden"] = torch.randn(len(s["tokens"]) - 1, H, generator=g)
        for step in range(5):
            lp, top = step in (1, 3), 3 if step == 3 else 0
            steps = next_steps(seqs, rng, step, lp, top)
            if step == 2:  # a sequence the drafter does not know: its own NOT_FOUND, the rest drafted
                steps.insert(5, SequenceStep("ghost", 4, [1], torch.randn(1, H, generator=g), 2, 3))
            packed = torch.cat([st.hidden_states for st in steps]) if step == 4 else None
            if packed is not None:
                steps = [dataclasses.replace(st, hidden_states=None) for st in steps]
            before = len(sent_as_columns)
            by_rows = await by["rows"].propose(steps, hidden_states=packed)
            by_cols = await by["cols"].propose(steps, hidden_states=packed)
            assert len(sent_as_columns) == before + 1  # (the rows client never asked the columns' way)
            assert not by_rows.fallback and not by_cols.fallback
            assert torch.equal(by_cols.draft_token_ids, by_rows.draft_token_ids)
            for c, r in zip(by_cols.sequences, by_rows.sequences, strict=True):
                assert (c.sequence_id, c.code, c.accepted_drafts, c.committed_length, c.needs_resync, c.predrafted) \
                    == (r.sequence_id, r.code, r.accepted_drafts, r.committed_length, r.needs_resync, r.predrafted)
                assert c.message == r.message.replace("'pr-", "'pc-")  # (the namespaces differ)
                assert torch.equal(c.drafts, r.drafts)
                for f in ("logprobs", "top_k_ids", "top_k_probs"):
                    a, b = getattr(c, f), getattr(r, f)
                    assert (a is None and b is None) or torch.equal(a, b), f
                if lp:
                    assert c.logprobs is not None and c.logprobs.numel() == c.drafts.numel()
            commit_some(seqs, steps, by_rows.sequences, rng, g)
        # steps that do not share return_logprobs go as messages, answered alike
        mixed = [SequenceStep(sid, 0, s["tokens"][:3], s["hidden"][:3], 7, 2, return_logprobs=i % 2 == 0)
                 for i, (sid, s) in enumerate(seqs.items())]
        before = len(sent_as_columns)
        r = await by["cols"].propose(mixed)
        assert len(sent_as_columns) == before and all(x.ok for x in r.sequences)
        assert len(r.sequences) == n
        assert (cols.steps_through_channel > 0) == channel and cols._step_columns is True
        # a step that ran from its columns: its reply's head was encoded while it ran (step_channels.py; for gRPC,
        # DrafterServicer._propose: on the step thread, the handler returning the bytes)
        assert (server.server.runtime.metrics.channels.early_replies > early_before) == channel
        assert (server.server.servicer.early_replies > grpc_early_before) == (not channel)
        await cols.release(list(seqs))
        await rows.release(list(seqs))


def test_sync_client_batch_api(server):
    from drafter_client import SyncDrafterClient

    steps = [SequenceStep("a", 0, [1, 2, 3], torch.randn(3, H), 4, 3), SequenceStep("b", 0, [5], torch.randn(1, H), 6, 2)]
    with SyncDrafterClient(server.uds, namespace="sync-cols") as c:
        r = c.propose_batch(as_batch(steps))
        assert r.codes.tolist() == [0, 0] and r.num_drafts.tolist() == [3, 2] and r.padded().shape == (2, 3)
        c.release(["a", "b"])


async def test_batch_api_falls_back_when_the_drafter_is_not_there(tmp_path):
    steps = [SequenceStep("a", 0, [1, 2], torch.randn(2, H), 3, 2), SequenceStep("b", 0, [4], torch.randn(1, H), 5, 2)]
    async with DrafterClient(f"unix:{tmp_path / 'none.sock'}", namespace="x", step_timeout_s=0.5) as c:
        r = await c.propose_batch(as_batch(steps))
    assert r.fallback and r.codes.tolist() == [14, 14] and r.draft_token_ids.numel() == 0
    assert r.padded().shape == (2, 0) and set(r.messages) == {0, 1}


async def test_a_session_pipelines_both_apis_and_falls_back_when_the_drafter_is_not_there(server, tmp_path):
    """ProposeSession: send() and send_batch() queued on one stream, each reply read back as its own kind (a
    ProposeResult, then BatchDrafts) with the same drafts; a large step (chunk_min_bytes) by ProposeChunked instead
    of the stream; propose_batch on a session to a drafter that is not there gives the batch API's fallback (every
    code UNAVAILABLE, no drafts)."""
    from drafter_client import ProposeResult

    g = torch.Generator().manual_seed(5)
    steps = [SequenceStep(f"p{i}", 0, [1 + i, 2, 3], torch.randn(3, H, generator=g), 4, 3) for i in range(3)]
    async with DrafterClient(server.uds, namespace="pipe-a") as a, DrafterClient(server.uds, namespace="pipe-b") as b:
        async with a.stream() as session:
            await session.send(steps)
            await session.send_batch(as_batch(steps))  # (the same steps in another namespace's twin below)
            first, second = await session.recv(), await session.recv()
        twin = await b.propose(steps)
        assert isinstance(first, ProposeResult) and isinstance(second, BatchDrafts)
        assert [r.code for r in first.sequences] == [0, 0, 0] and second.codes.tolist() == [0, 0, 0]
        assert torch.equal(first.draft_token_ids, twin.draft_token_ids)
        # the batch re-sent the same positions: the same drafts again (the protocol lets a step re-send positions)
        assert torch.equal(second.draft_token_ids, twin.draft_token_ids)
        await a.release([s.sequence_id for s in steps])
        await b.release([s.sequence_id for s in steps])
    # a step whose inline states reach chunk_min_bytes goes by ProposeChunked (the client's own call), a smaller one
    # on the stream; both answer as the unary twin does
    # (ProposeChunked carries states of DIRECT_STATES_MIN_BYTES, 64 KiB, and more: 3 x 100 float32 rows of 64)
    async with DrafterClient(server.uds, namespace="pipe-c", chunk_min_bytes=70_000) as c, \
            DrafterClient(server.uds, namespace="pipe-d") as d:
        async with c.stream() as session:
            on_stream = await session.propose_batch(as_batch(steps))
            assert c.steps_chunked == 0
            bigger = [SequenceStep(s.sequence_id, 3, list(range(5, 105)), torch.randn(100, H, generator=g), 7, 2)
                      for s in steps]
            chunked = await session.propose_batch(as_batch(bigger))
            assert c.steps_chunked == 1 and session.streams_opened == 1
            per_step = await session.propose(bigger)  # (the same positions again: the same drafts)
            assert c.steps_chunked == 2
        twin = [await d.propose(steps), await d.propose(bigger)]
        assert torch.equal(on_stream.draft_token_ids, twin[0].draft_token_ids)
        assert torch.equal(chunked.draft_token_ids, twin[1].draft_token_ids)
        assert torch.equal(per_step.draft_token_ids, twin[1].draft_token_ids)
    async with DrafterClient(f"unix:{tmp_path / 'none.sock'}", namespace="x", step_timeout_s=0.5) as c:
        async with c.stream() as session:
            r = await session.propose_batch(as_batch(steps))
    assert r.fallback and r.codes.tolist() == [14, 14, 14] and r.draft_token_ids.numel() == 0
    assert set(r.messages) == {0, 1, 2}


async def test_the_first_batch_asks_get_info_within_the_step_deadline(tmp_path, monkeypatch):
    """A batch large enough for columns asks GetInfo first (once per client); that call comes out of the step's
    deadline: the step itself gets only what is left, so the whole call stays within step_timeout_s."""
    import asyncio

    from drafter_client import DrafterError
    from drafter_client.client import COLUMNS_MIN_SEQUENCES

    n = COLUMNS_MIN_SEQUENCES
    steps = [SequenceStep(f"s{i}", 0, [1], torch.randn(1, H), 2, 2) for i in range(n)]
    async with DrafterClient(f"unix:{tmp_path / 'none.sock'}", namespace="x", step_timeout_s=0.5) as c:
        async def slow_get_info(timeout=None):
            assert timeout == 0.5
            await asyncio.sleep(0.3)
            raise DrafterError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")

        given = []

        async def send_step(payload, timeout):
            given.append(timeout)
            raise DrafterError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")

        monkeypatch.setattr(c, "get_info", slow_get_info)
        monkeypatch.setattr(c, "_send_step", send_step)
        r = await c.propose_batch(as_batch(steps))
    assert r.fallback and len(given) == 1 and given[0] <= 0.5 - 0.3, given


async def test_a_failed_drafter_is_asked_again_whether_it_takes_columns(tmp_path, monkeypatch):
    """After a fault (the drafter down, maybe replaced by another version: a rollback), the next columnar-size batch
    asks GetInfo again instead of trusting the answer of the drafter before."""
    from drafter_client import DrafterError
    from drafter_client.client import COLUMNS_MIN_SEQUENCES

    steps = [SequenceStep(f"s{i}", 0, [1], torch.randn(1, H), 2, 2) for i in range(COLUMNS_MIN_SEQUENCES)]
    async with DrafterClient(f"unix:{tmp_path / 'none.sock'}", namespace="x", step_timeout_s=0.5) as c:
        asked = []

        async def get_info(timeout=None):
            asked.append(1)
            return pb.GetInfoResponse(step_columns_supported=True)

        async def send_step(payload, timeout):
            raise DrafterError(grpc.StatusCode.UNAVAILABLE, "down")

        monkeypatch.setattr(c, "get_info", get_info)
        monkeypatch.setattr(c, "_send_step", send_step)
        assert (await c.propose_batch(as_batch(steps))).fallback and len(asked) == 1
        assert c._step_columns is None  # forgotten with the fault: the batch after the breaker's probe asks again


@pytest.mark.parametrize("frames", [False, True])
async def test_channel_steps_are_freed_without_the_cyclic_collector(server, frames):
    """A step channel's columnar requests (with their reply's head encoded while the step ran), and its request
    frames, leave nothing for the cyclic garbage collector: each request, its columns and its views of the mailbox
    are freed by reference count as soon as it is answered (a first version kept every request in a cycle through
    its PendingRequest)."""
    import gc

    n = 40
    g = torch.Generator().manual_seed(5)
    toks, hid = torch.randint(0, V, (n, 64), generator=g), torch.randn(n, 64, H, generator=g)
    async with DrafterClient(server.uds, namespace=f"gc-{frames}") as c:
        assert await c.open_step_channel(frames=frames)
        channels = server.server.runtime.metrics.channels
        await c.propose([SequenceStep(f"s{i}", 0, toks[i, :20], hid[i, :20], int(toks[i, 20]), 3) for i in range(n)])
        early_before, frames_before = channels.early_replies, channels.frames_taken
        gc.collect()
        gc.disable()
        try:
            for p in range(19, 27):
                await c.propose([SequenceStep(f"s{i}", p, toks[i, p : p + 2], hid[i, p : p + 2], int(toks[i, p + 2]), 3)
                                 for i in range(n)])
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left = [type(o).__name__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert channels.early_replies - early_before == 8  # (a frame's reply head too: frame_reply_head)
        assert channels.frames_taken - frames_before == (8 if frames else 0)
        assert "PendingRequest" not in left and "BatchInput" not in left, sorted(set(left))
        await c.release([f"s{i}" for i in range(n)])
