"""Several drafters driven step for step by one simulated engine; every answer recorded for comparison.

The engine (fake_engine.FakeSequence: random prompts, whole and chunked prefills, random acceptance, re-sent
positions) advances with the FIRST drafter's drafts. Every drafter gets the very same steps, and a step carries only
committed tokens, so a drafter whose drafts differ still holds the same committed state as the others. Sequences
are retired now and then, and when they run into max_model_len (the drafters must all refuse that step with
OUT_OF_RANGE); new ones take their place, so the number of drafting sequences per step varies.
"""
import random
from dataclasses import dataclass

import torch

from drafter_service.engine.step_io import OUT_OF_RANGE, StepInput
from fake_engine import FakeSequence


@dataclass
class Reply:
    code: int
    drafts: list[int]
    logprobs: list[float]


@dataclass
class Record:
    """One sequence step that asked for drafts: the naive drafts and each drafter's reply."""
    seq_id: str
    start_position: int
    num_drafts: int  # k asked for (the drafters cut it at max_model_len)
    expected: list[int] | None  # naive greedy drafts for the cut k, when a naive model was given
    replies: list[Reply]


class ClientDrafter:
    """A drafter server, through the client (the whole server path: gRPC, scheduler, proposer)."""

    def __init__(self, client):
        self.client = client

    async def propose(self, steps) -> list[Reply]:
        result = await self.client.propose(steps)
        return [Reply(s.code, s.drafts.tolist(), [] if s.logprobs is None else s.logprobs.tolist())
                for s in result.sequences]

    async def release(self, ids: list[str]) -> None:
        await self.client.release(ids)


class ProposerDrafter:
    """A proposer called in-process, on the caller's thread (as the benchmark does)."""

    def __init__(self, proposer, namespace: str = "lockstep"):
        self.proposer = proposer
        self.namespace = namespace

    async def propose(self, steps) -> list[Reply]:
        inputs = [StepInput(self.namespace, s.sequence_id, s.start_position,
                            torch.as_tensor(s.token_ids, dtype=torch.int64), s.hidden_states, int(s.next_token),
                            s.num_drafts, temperature=s.temperature, seed=s.seed,
                            return_logprobs=s.return_logprobs, top_k_probs=s.top_k_probs) for s in steps]
        return [Reply(o.code, list(o.drafts), list(o.logprobs)) for o in self.proposer.step(inputs)]

    async def release(self, ids: list[str]) -> None:
        for sequence_id in ids:
            self.proposer.table.release(self.namespace, sequence_id)


async def run_lockstep(drafters: list, *, naive, width: int, vocab: int, seed: int, engine_steps: int,
                       num_seqs: int, max_model_len: int, max_k: int = 6, logprobs: bool = False,
                       prompts: tuple[int, ...] = (1, 2, 7, 16, 17, 40, 95), retire_len: int = 300) -> list[Record]:
    rng = random.Random(seed)
    counter = 0
    prompts = tuple(p for p in prompts if p < max_model_len - 2)

    def new_seq() -> FakeSequence:
        nonlocal counter
        counter += 1
        return FakeSequence(f"s{seed}-{counter}", rng.choice(prompts), width, vocab, rng,
                            rng.choice([None, None, 5, 16, 33]))

    seqs = [new_seq() for _ in range(num_seqs)]
    records: list[Record] = []
    for _ in range(engine_steps):
        steps = [s.next_step(rng.randint(1, max_k)) for s in seqs]
        for step in steps:
            step.return_logprobs = logprobs
        replies = [await d.propose(steps) for d in drafters]
        retire = set()
        for i, (s, step) in enumerate(zip(seqs, steps)):
            answers = [r[i] for r in replies]
            end = step.start_position + len(step.token_ids)
            if end >= max_model_len:  # no room for next_token: every drafter refuses, nothing changes
                assert [a.code for a in answers] == [OUT_OF_RANGE] * len(drafters), s.seq_id
                retire.add(i)
                continue
            assert [a.code for a in answers] == [0] * len(drafters), (s.seq_id, answers)
            if step.num_drafts == 0:
                assert all(a.drafts == [] for a in answers)
                continue
            k = min(step.num_drafts, max_model_len - 1 - end)
            expected = naive.drafts(s.tokens, s.hidden, k) if naive is not None else None
            records.append(Record(s.seq_id, step.start_position, step.num_drafts, expected, answers))
            s.last_drafts = answers[0].drafts
        for i, s in enumerate(seqs):
            if i in retire or (not s.in_prefill and (len(s.tokens) > retire_len or rng.random() < 0.03)):
                for d in drafters:
                    await d.release([s.seq_id])
                seqs[i] = new_seq()
    for d in drafters:
        await d.release([s.seq_id for s in seqs])
    return records
