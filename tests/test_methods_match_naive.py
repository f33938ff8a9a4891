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
from drafter_service.engine.sampling import gumbel_sample, seed_to_int64
from fake_engine import FakeSequence, drive_engine
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


def drive(target: str, use_stream: bool, name: str, naive, draft_fn, max_k: int, seed: int):
    rng = random.Random(seed)
    counter = 0

    def new_seq() -> FakeSequence:
        nonlocal counter
        counter += 1
        s = FakeSequence(f"{name}-{counter}", rng.choice([1, 2, 7, 16, 17, 40]), naive.width, naive.vocab, rng,
                         rng.choice([None, 5, 16]))
        s.temperature, s.seed = rng.choice([0.0, 0.0, 0.8, 1.5]), rng.randrange(2**64)
        return s

    def expected(s: FakeSequence, step) -> list[int]:
        position = len(s.tokens) - 1  # of next_token: the first draft is sampled with noise at this position
        return draft_fn(s.tokens, s.hidden, step.num_drafts, gumbel_pick(s.temperature, s.seed, position))

    return drive_engine(target, use_stream, name, new_seq, expected, steps=STEPS_PER_ENGINE, max_k=max_k,
                        retire_len=200, retire_p=0.05, rng=rng)


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
                drive(server.tcp, False, "tcp", naive, draft_fn, spec["max_k"], 1),
                drive(server.uds, True, "uds", naive, draft_fn, spec["max_k"], 2))

        runs = asyncio.run(run())
        assert sum(r["sequence_steps_checked"] for r in runs) >= 90
        free, total = server.call(lambda: (server.server.runtime.kv.pool.num_free,
                                           server.server.runtime.kv.num_blocks))
        assert free == total
        assert server.server.runtime.metrics.drafts_accepted > 0
