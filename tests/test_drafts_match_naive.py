"""The server's greedy drafts equal a naive, cache-free EAGLE-1 over hundreds of engine steps.

Four simulated engines run at once against one server: over TCP and a Unix socket, with the unary RPC and the
stream, each driving several sequences (mixed prompt lengths, whole and chunked prefills, random acceptance,
occasional re-sent positions, sequences released and new ones started along the way).
"""
import asyncio
import random

import pytest

from fake_engine import FakeSequence, drive_engine
from naive_eagle import NaiveEagle1

STEPS_PER_ENGINE = 60


def drive(target: str, use_stream: bool, name: str, naive: NaiveEagle1, seed: int):
    rng = random.Random(seed)
    counter = 0

    def new_seq() -> FakeSequence:
        nonlocal counter
        counter += 1
        prompt = rng.choice([1, 2, 7, 16, 17, 40, 95, 150])
        chunk = rng.choice([None, None, 5, 16, 33])
        return FakeSequence(f"{name}-{counter}", prompt, naive.H, naive.lm_head.shape[0], rng, chunk)

    return drive_engine(target, use_stream, name, new_seq,
                        lambda s, step: naive.drafts(s.tokens, s.hidden, step.num_drafts),
                        steps=STEPS_PER_ENGINE, max_k=6, retire_len=300, retire_p=0.03, rng=rng)


async def test_greedy_drafts_match_naive_reference(server, tiny_model):
    naive = NaiveEagle1(*tiny_model)
    runs = await asyncio.gather(
        drive(server.tcp, False, "tcp-unary", naive, 1),
        drive(server.tcp, True, "tcp-stream", naive, 2),
        drive(server.uds, False, "uds-unary", naive, 3),
        drive(server.uds, True, "uds-stream", naive, 4),
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
        runs = await asyncio.gather(drive(s.uds, True, "cuda-stream", naive, 11),
                                    drive(s.tcp, False, "cuda-unary", naive, 12))
    assert sum(r["sequence_steps_checked"] for r in runs) >= 200


def test_the_reference_says_where_and_by_how_much_drafts_diverge(tiny_model):
    """naive_eagle.divergence, which the soak uses to tell a float32 near-tie from a wrong draft: None for the
    reference's own drafts; for a draft changed at index i, (i, the reference's logit gap there, > 0)."""
    import torch

    naive = NaiveEagle1(*tiny_model)
    g = torch.Generator().manual_seed(3)
    tokens, hidden = torch.randint(0, 512, (21,), generator=g).tolist(), torch.randn(20, 64, generator=g)
    want = naive.drafts(tokens, hidden, 4)
    assert naive.divergence(tokens, hidden, want) is None
    other = list(want)
    other[2] = (want[2] + 1) % 512
    index, gap = naive.divergence(tokens, hidden, other)
    assert index == 2 and gap > 0
