"""EAGLE-3, P-EAGLE (parallel drafting) and multi-layer EAGLE: the server's drafts equal a naive, cache-free
reference of each method over many engine steps.

Per method one server; two simulated engines drive it at once (unary over TCP, the stream over the Unix socket),
each with three sequences: mixed prompt lengths, whole and chunked prefills, random acceptance, re-sent
positions, sequences retired and new ones started. Every sequence has its own sampling settings: greedy, or a
temperature with a seed, where the reference samples with the same Gumbel noise (seed, position of the drafted
token - 1); the noise itself is tested against softmax(logits / T) in test_sampling.py.
"""
import asyncio
import random

import pytest
import torch

from checkpoints import write_eagle3, write_multi_layer
from conftest import ServerThread, make_config
from drafter_client import DrafterClient
from drafter_service.sampling import gumbel_sample, seed_to_int64
from fake_engine import FakeSequence
from naive_eagle3 import NaiveEagle3, NaiveMultiLayer

STEPS_PER_ENGINE = 30

METHODS = {
    # published EAGLE-3 layout: pytorch_model.bin, LlamaForCausalLMEagle3, draft vocab 200 of 512 with d2t
    "eagle3": dict(write=lambda root: write_eagle3(root, seed=10), naive=NaiveEagle3, drafts="drafts", max_k=5),
    # Eagle3LlamaForCausalLM in safetensors, full vocabulary, target hidden 48 != head hidden 64, own embed_tokens,
    # vLLM's norm_before_residual option
    "eagle3_wide": dict(write=lambda root: write_eagle3(root, seed=11, draft_vocab=None, target_hidden=48, embed=True,
                                                        bin_format=False, architecture="Eagle3LlamaForCausalLM",
                                                        norm_before_residual=True),
                        naive=NaiveEagle3, drafts="drafts", max_k=4),
    "peagle": dict(write=lambda root: write_eagle3(root, seed=12, parallel_token_id=7), naive=NaiveEagle3,
                   drafts="parallel_drafts", max_k=5),
    "multi_layer": dict(write=lambda root: write_multi_layer(root, seed=13, n_predict=3), naive=NaiveMultiLayer,
                        drafts="drafts", max_k=3),
}


def gumbel_pick(temperature: float, seed: int, position: int):
    """The reference's sampler: the server's Gumbel noise for (seed, position of the drafted token - 1)."""
    def pick(logits: torch.Tensor, j: int) -> int:
        if temperature == 0:
            return int(logits.argmax())
        return int(gumbel_sample(logits[None], torch.tensor([temperature]),
                                     torch.tensor([seed_to_int64(seed)]), torch.tensor([position + j]))[0])
    return pick


async def drive_engine(target: str, use_stream: bool, name: str, naive, draft_fn, max_k: int, seed: int) -> int:
    rng = random.Random(seed)
    counter = 0

    def new_seq() -> FakeSequence:
        nonlocal counter
        counter += 1
        s = FakeSequence(f"{name}-{counter}", rng.choice([1, 2, 7, 16, 17, 40]), naive.width, naive.vocab, rng,
                         rng.choice([None, 5, 16]))
        s.temperature, s.seed = rng.choice([0.0, 0.0, 0.8, 1.5]), rng.randrange(2**64)
        return s

    seqs = [new_seq() for _ in range(3)]
    checked = 0
    async with DrafterClient(target, namespace=name) as client:
        session = client.stream() if use_stream else None
        try:
            for _ in range(STEPS_PER_ENGINE):
                steps = []
                for s in seqs:
                    step = s.next_step(rng.randint(1, max_k))
                    step.temperature, step.seed = s.temperature, s.seed
                    steps.append(step)
                result = await (session.propose(steps) if session else client.propose(steps))
                for s, step, res in zip(seqs, steps, result.sequences):
                    assert res.ok, f"{s.seq_id}: {res.code} {res.message}"
                    assert res.committed_length == s.committed
                    if step.num_drafts == 0:
                        assert res.drafts.numel() == 0
                        continue
                    if s.last_drafts and step.start_position <= len(s.tokens) - 1 - s.expected_accepted:
                        assert res.accepted_drafts == s.expected_accepted, s.seq_id
                    C = len(s.tokens) - 1
                    expected = draft_fn(s.tokens, s.hidden, step.num_drafts, gumbel_pick(s.temperature, s.seed, C))
                    got = res.drafts.tolist()
                    assert got == expected, (f"{s.seq_id} (T={s.temperature}) step at p={step.start_position}: "
                                             f"{got} != {expected}")
                    s.last_drafts = got
                    checked += 1
                for i, s in enumerate(seqs):
                    if not s.in_prefill and (len(s.tokens) > 200 or rng.random() < 0.05):
                        assert (await client.release([s.seq_id])).released == 1
                        seqs[i] = new_seq()
        finally:
            if session:
                await session.close()
        await client.release([s.seq_id for s in seqs])
    return checked


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("method", list(METHODS))
def test_drafts_match_naive_reference(method, device, tmp_path):
    spec = METHODS[method]
    head, target = spec["write"](tmp_path / "model")
    naive = spec["naive"](head, target)
    draft_fn = getattr(naive, spec["drafts"])
    with ServerThread(make_config(head, target, tmp_path, device=device)) as server:
        async def run():
            return await asyncio.gather(
                drive_engine(server.tcp, False, "tcp", naive, draft_fn, spec["max_k"], 1),
                drive_engine(server.uds, True, "uds", naive, draft_fn, spec["max_k"], 2))

        checked = asyncio.run(run())
        assert sum(checked) >= 90
        free, total = server.call(lambda: (server.server.runtime.kv.pool.num_free,
                                           server.server.runtime.kv.num_blocks))
        assert free == total
        assert server.server.runtime.metrics.drafts_accepted > 0
