"""A simulated target engine for the tests: random committed tokens and hidden states, random acceptance.

It keeps the ground truth of one sequence (every committed token and its hidden state) and produces the steps
an engine would send: a prompt (whole or in chunks), then per step the bonus token plus the accepted drafts,
sometimes re-sending already committed positions (p behind the drafter's committed length).
"""
import random

import torch

from drafter_client import SequenceStep


class FakeSequence:
    def __init__(self, seq_id: str, prompt_len: int, width: int, vocab: int, rng: random.Random, chunk: int | None):
        self.seq_id = seq_id
        self.rng = rng
        self.vocab = vocab
        self.width = width
        self.tokens = [rng.randrange(vocab) for _ in range(prompt_len + 1)]  # x[0..P]: prompt + first bonus
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        self._gen = g
        self.hidden = torch.randn(prompt_len, width, generator=g)  # h[0..P-1]
        self.prompt_len = prompt_len
        self.chunk = chunk
        self.prefill_done = 0  # positions of the prompt already sent
        self.committed = 0  # positions sent with their hidden states (what the drafter should hold)
        self.last_drafts: list[int] = []
        self.expected_accepted = 0

    @property
    def in_prefill(self) -> bool:
        return self.prefill_done < self.prompt_len

    def next_step(self, k: int) -> SequenceStep:
        if self.in_prefill:
            p = self.prefill_done
            m = self.prompt_len - p if self.chunk is None else min(self.chunk, self.prompt_len - p)
            self.prefill_done += m
            kk = k if not self.in_prefill else 0
            step = SequenceStep(self.seq_id, p, self.tokens[p : p + m], self.hidden[p : p + m],
                                self.tokens[p + m], kk)
            self.committed = p + m
            return step
        # Decode: the engine verified last_drafts; accept a random prefix, sample a bonus that differs.
        drafts = self.last_drafts
        a = self.rng.randint(0, len(drafts))
        base = len(self.tokens) - 1  # position of the last bonus token (sent as next_token last time)
        self.tokens += drafts[:a]
        bonus = self.rng.randrange(self.vocab)
        while a < len(drafts) and bonus == drafts[a]:
            bonus = self.rng.randrange(self.vocab)
        self.tokens.append(bonus)
        new_h = torch.randn(a + 1, self.width, generator=self._gen)  # states of x[base .. base+a]
        self.hidden = torch.cat([self.hidden, new_h])
        self.expected_accepted = a
        p = base
        if self.rng.random() < 0.15 and p > 0:  # re-send some already committed positions
            p = max(0, p - self.rng.randint(1, 5))
        end = len(self.tokens) - 1  # exclusive end of committed-with-hidden positions
        self.committed = end
        return SequenceStep(self.seq_id, p, self.tokens[p:end], self.hidden[p:end], self.tokens[end], k)


async def drive_engine(target: str, use_stream: bool, name: str, new_seq, expected_drafts, *, steps: int,
                       max_k: int, retire_len: int, retire_p: float, rng: random.Random) -> dict:
    """One simulated engine against a drafter: three sequences at a time, `steps` engine steps, each sequence's
    drafts checked against ``expected_drafts(seq, step)`` (a naive reference), acceptance counted by the drafter
    checked against the simulation, sequences retired (released) past `retire_len` tokens or at random and
    replaced by ``new_seq()``. Sequences may carry ``temperature`` / ``seed`` attributes (sampling settings).
    Over TCP or a Unix socket, with the unary RPC or the stream."""
    from drafter_client import DrafterClient

    seqs = [new_seq() for _ in range(3)]
    checked = engine_steps = 0
    async with DrafterClient(target, namespace=name) as client:
        session = client.stream() if use_stream else None
        try:
            for _ in range(steps):
                batch = []
                for s in seqs:
                    step = s.next_step(rng.randint(1, max_k))
                    step.temperature, step.seed = getattr(s, "temperature", 0.0), getattr(s, "seed", 0)
                    batch.append(step)
                result = await (session.propose(batch) if session else client.propose(batch))
                engine_steps += 1
                for s, step, res in zip(seqs, batch, result.sequences):
                    assert res.ok, f"{s.seq_id}: {res.code} {res.message}"
                    assert res.sequence_id == s.seq_id
                    assert res.committed_length == s.committed
                    if step.num_drafts == 0:
                        assert res.drafts.numel() == 0
                        continue
                    if s.last_drafts and step.start_position <= len(s.tokens) - 1 - s.expected_accepted:
                        assert res.accepted_drafts == s.expected_accepted, s.seq_id
                    expected = expected_drafts(s, step)
                    got = res.drafts.tolist()
                    assert got == expected, (f"{s.seq_id} (T={step.temperature}) step at p={step.start_position}: "
                                             f"{got} != {expected}")
                    s.last_drafts = got
                    checked += 1
                for i, s in enumerate(seqs):
                    if not s.in_prefill and (len(s.tokens) > retire_len or rng.random() < retire_p):
                        assert (await client.release([s.seq_id])).released == 1
                        seqs[i] = new_seq()
        finally:
            if session:
                await session.close()
        await client.release([s.seq_id for s in seqs])
    return {"engine_steps": engine_steps, "sequence_steps_checked": checked}
