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
