"""The server's greedy drafts equal a naive, cache-free EAGLE-1 over hundreds of engine steps.

Four simulated engines run at once against one server: over TCP and a Unix socket, with the unary RPC and the
stream, each driving several sequences (mixed prompt lengths, whole and chunked prefills, random acceptance,
occasional re-sent positions, sequences released and new ones started along the way).
"""
import asyncio
import random

import pytest

from drafter_client import DrafterClient
from fake_engine import FakeSequence
from naive_eagle import NaiveEagle1

STEPS_PER_ENGINE = 60


async def drive_engine(target: str, use_stream: bool, name: str, naive: NaiveEagle1, seed: int) -> dict:
    rng = random.Random(seed)
    width, vocab = naive.H, naive.lm_head.shape[0]
    counter = 0

    def new_seq() -> FakeSequence:
        nonlocal counter
        counter += 1
        prompt = rng.choice([1, 2, 7, 16, 17, 40, 95, 150])
        chunk = rng.choice([None, None, 5, 16, 33])
        return FakeSequence(f"{name}-{counter}", prompt, width, vocab, rng, chunk)

    seqs = [new_seq() for _ in range(3)]
    checked = engine_steps = 0
    async with DrafterClient(target, namespace=name) as client:
        session = client.stream() if use_stream else None
        try:
            for _ in range(STEPS_PER_ENGINE):
                ks = [rng.randint(1, 6) for _ in seqs]
                steps = [s.next_step(k) for s, k in zip(seqs, ks)]
                result = await (session.propose(steps) if session else client.propose(steps))
                engine_steps += 1
                for s, step, res in zip(seqs, steps, result.sequences):
                    assert res.ok, f"{s.seq_id}: {res.code} {res.message}"
                    assert res.sequence_id == s.seq_id
                    assert res.committed_length == s.committed
                    if step.num_drafts == 0:
                        assert res.drafts.numel() == 0
                        continue
                    if s.last_drafts and step.start_position <= len(s.tokens) - 1 - s.expected_accepted:
                        assert res.accepted_drafts == s.expected_accepted, s.seq_id
                    expected = naive.drafts(s.tokens, s.hidden, step.num_drafts)
                    got = res.drafts.tolist()
                    assert got == expected, f"{s.seq_id} step at p={step.start_position}: {got} != {expected}"
                    s.last_drafts = got
                    checked += 1
                # retire a long sequence now and then, and start a new one in its place
                for i, s in enumerate(seqs):
                    if not s.in_prefill and (len(s.tokens) > 300 or rng.random() < 0.03):
                        assert (await client.release([s.seq_id])).released == 1
                        seqs[i] = new_seq()
        finally:
            if session:
                await session.close()
        await client.release([s.seq_id for s in seqs])
    return {"engine_steps": engine_steps, "sequence_steps_checked": checked}


async def test_greedy_drafts_match_naive_reference(server, tiny_model):
    naive = NaiveEagle1(*tiny_model)
    runs = await asyncio.gather(
        drive_engine(server.tcp, False, "tcp-unary", naive, 1),
        drive_engine(server.tcp, True, "tcp-stream", naive, 2),
        drive_engine(server.uds, False, "uds-unary", naive, 3),
        drive_engine(server.uds, True, "uds-stream", naive, 4),
    )
    assert sum(r["engine_steps"] for r in runs) >= 200
    assert sum(r["sequence_steps_checked"] for r in runs) >= 400
    # everything released: the pool is whole again
    free, total = server.call(lambda: (server.server.runtime.kv.pool.num_free, server.server.runtime.kv.num_blocks))
    assert free == total
    m = server.server.runtime.metrics
    assert m.drafts_evaluated > 0 and m.drafts_accepted > 0


@pytest.mark.gpu
async def test_cuda_server_matches_naive_reference(tiny_model, tmp_path):
    """The same check with the server on CUDA in fp32 (runs on the GPU machine; skipped without CUDA)."""
    from conftest import ServerThread, make_config

    naive = NaiveEagle1(*tiny_model)
    with ServerThread(make_config(*tiny_model, tmp_path, device="cuda", dtype="float32")) as s:
        runs = await asyncio.gather(drive_engine(s.uds, True, "cuda-stream", naive, 11),
                                    drive_engine(s.tcp, False, "cuda-unary", naive, 12))
    assert sum(r["sequence_steps_checked"] for r in runs) >= 200
