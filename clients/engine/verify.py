"""Verification of one sequence's drafts against the target's logits (one engine step).

The target ran over [x_n, d_1 .. d_k] (the pending token and k drafts), so ``logits[i]`` is its distribution for
the token after d_i (logits[0]: after x_n, which d_1 guesses; logits[k]: the bonus position).

- Greedy: accept the longest prefix of drafts equal to the target's argmax, then append the target's argmax at the
  first mismatch (or the bonus after all k): the output is exactly the target's greedy continuation.
- Temperature > 0, speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept d_i with probability
  min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from norm(max(0, p_i - q_i)); after k acceptances
  sample the bonus from p_k. Every committed token is then distributed exactly as plain sampling from p.

``draft_probs`` q [k, V] is the drafter's distribution per draft. A greedy drafter (this server version) is a point
mass on its token: q = one_hot(d), which makes the rule "accept with p(d); on rejection sample from p with d
zeroed". When the drafter returns its distributions (logprobs / top-k, branch eagle3), pass them as q.
"""
import torch


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> int:
    """One token from logits [V]: argmax at temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, list[int]]:
    """logits [k+1, V], drafts [k] -> (accepted a, committed tokens: d_1..d_a and the target's next token)."""
    k = drafts.numel()
    target = logits[: k + 1].argmax(dim=-1)
    mismatch = (drafts != target[:k]).nonzero()
    a = int(mismatch[0]) if mismatch.numel() else k
    return a, drafts[:a].tolist() + [int(target[a])]


def point_mass(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q of a greedy drafter: [k, V] one-hot on each draft."""
    return torch.nn.functional.one_hot(drafts, vocab_size).float()


def verify_sampling(logits: torch.Tensor, drafts: torch.Tensor, temperature: float,
                    generator: torch.Generator | None = None,
                    draft_probs: torch.Tensor | None = None) -> tuple[int, list[int]]:
    """Speculative sampling. logits [k+1, V] (target), drafts [k], draft_probs q [k, V] (None: greedy drafter,
    a point mass on each draft) -> (accepted a, committed tokens: d_1..d_a and the corrected / bonus token)."""
    if temperature <= 0:
        raise ValueError("verify_sampling needs temperature > 0 (use verify_greedy for 0)")
    k = drafts.numel()
    p = torch.softmax(logits[: k + 1].float() / temperature, dim=-1)  # [k+1, V]
    q = point_mass(drafts, p.size(-1)) if draft_probs is None else draft_probs.float()
    rows = torch.arange(k)
    q_d = q[rows, drafts]
    if (q_d <= 0).any():
        raise ValueError("a draft token has probability 0 under the drafter's own distribution")
    accept_prob = (p[rows, drafts] / q_d).clamp(max=1.0)
    u = torch.rand(k, generator=generator)
    rejected = (u >= accept_prob).nonzero()
    if rejected.numel() == 0:
        bonus = int(torch.multinomial(p[k], 1, generator=generator))
        return k, drafts.tolist() + [bonus]
    a = int(rejected[0])
    residual = (p[a] - q[a]).clamp(min=0)
    if residual.sum() <= 0:  # p == q up to rounding: then d is accepted with probability 1, unless rounding
        residual = p[a]
    token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return a, drafts[:a].tolist() + [token]
