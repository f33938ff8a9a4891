"""Draft sampling: greedy at temperature 0, otherwise Gumbel-max seeded per (seed, position).

``gumbel_sample_ref`` has the signature of the kernels branch's ``kernels/sampling.py`` function of the same name;
when that lands, ``gumbel_sample`` below points at ``drafter_kernels.ops`` instead (one line).

The noise is a counter-based hash, not a stateful generator: the uniform for (seed, position, column v) is
``fmix32`` (MurmurHash3's finalizer) chained over the 32-bit words of seed, position and v. So a draft is a pure
function of (logits, temperature, seed, position): a replayed step gives the same drafts, on any device, in any
batch. Gumbel-max: ``argmax_v(logits[v] / T + g_v)`` with ``g_v = -log(-log(u_v))`` is an exact sample of
``softmax(logits / T)`` (u has 32 bits, so probabilities are resolved to ~2^-32).

``sample_drafts`` adds what the reply can carry: log q(draft) and the top-N of q (docs/sampling.md says exactly
which q the engine's rejection sampler must use).
"""
from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF


def seed_to_int64(seed: int) -> int:
    """A uint64 seed from the wire as the int64 with the same bits (tensors have no uint64 arithmetic)."""
    return seed - 2**64 if seed >= 2**63 else seed


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding values in [0, 2^32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def gumbel_uniforms(seed: torch.Tensor, position: torch.Tensor, num_columns: int) -> torch.Tensor:
    """seed [B] int64 (a uint64 reinterpreted), position [B] int64 -> uniforms [B, V] float64 in (0, 1)."""
    seed_lo = seed & MASK32
    seed_hi = (seed >> 32) & MASK32  # arithmetic shift of a negative int64 is masked back to the high word
    key = _fmix32(seed_lo ^ 0x9E3779B9)
    key = _fmix32(key ^ seed_hi)
    key = _fmix32(key ^ (position & MASK32))  # [B]
    cols = _fmix32(torch.arange(num_columns, dtype=torch.int64, device=seed.device) ^ 0x7F4A7C15)  # [V]
    bits = _fmix32(key[:, None] ^ cols[None, :])  # [B, V] in [0, 2^32)
    return (bits.double() + 0.5) * 2.0**-32


def gumbel_sample_ref(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] float32; 0 = greedy
    seed: torch.Tensor,  # [B] int64
    position: torch.Tensor,  # [B] int64
) -> torch.Tensor:  # [B] int64
    greedy = logits.argmax(dim=-1)
    hot = temperature > 0
    if not bool(hot.any()):
        return greedy
    u = gumbel_uniforms(seed, position, logits.shape[1])
    gumbel = -torch.log(-torch.log(u))
    t = torch.where(hot, temperature, torch.ones_like(temperature)).double()
    sampled = (logits.double() / t[:, None] + gumbel).argmax(dim=-1)
    return torch.where(hot, sampled, greedy)


# Switch to drafter_kernels.ops.gumbel_sample when the kernels branch lands (same signature).
gumbel_sample = gumbel_sample_ref


@dataclass
class DraftSample:
    tokens: torch.Tensor  # [n] int64 column ids of the logits (draft-vocabulary ids for draft-vocab heads)
    logprobs: torch.Tensor | None  # [n] float32 log q(token)
    top_ids: torch.Tensor | None  # [n, N] int64 column ids, by decreasing q; -1 past a row's own N
    top_probs: torch.Tensor | None  # [n, N] float32 q of those; 0 past a row's own N


def sample_drafts(
    logits: torch.Tensor,  # [n, V] float
    temperature: torch.Tensor,  # [n] float32
    seed: torch.Tensor,  # [n] int64
    position: torch.Tensor,  # [n] int64: the Gumbel position (the drafted token's position - 1)
    top_k: torch.Tensor,  # [n] int64: N per row, 0 = no top-N (and no truncation)
    want_logprobs: bool,
) -> DraftSample:
    """Draw one draft per row from q and describe q.

    q is softmax(logits / T) (T > 0), restricted to the row's N most likely columns and renormalized when N > 0;
    at T = 0 it is the point mass on argmax(logits). The returned log-probabilities and top-N are those of q.
    """
    width = int(top_k.max()) if top_k.numel() else 0
    hot = temperature > 0
    if not want_logprobs and width == 0 and not bool(hot.any()):
        return DraftSample(logits.argmax(dim=-1), None, None, None)
    logits = logits.float()
    top_ids = None
    if width > 0:
        top_ids = logits.topk(width, dim=-1).indices  # [n, N]
        col = torch.arange(width, device=logits.device)
        outside = col[None, :] >= top_k[:, None]  # beyond the row's own N
        # truncate q to the row's own top-N columns (rows with N = 0 keep the full vocabulary)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top_ids, ~outside) | (top_k == 0)[:, None]
        logits = logits.masked_fill(~keep, float("-inf"))
    tokens = gumbel_sample(logits, temperature, seed, position)
    t = torch.where(hot, temperature, torch.ones_like(temperature))
    logq = torch.log_softmax(logits / t[:, None], dim=-1)  # [n, V]; rows at T = 0 are overwritten below
    logprobs = None
    if want_logprobs:
        logprobs = torch.where(hot, logq.gather(1, tokens[:, None]).squeeze(1), torch.zeros_like(temperature))
    top_probs = None
    if width > 0:
        probs = logq.gather(1, top_ids).exp()
        point = (top_ids == tokens[:, None]).float()  # T = 0: all mass on the greedy token
        probs = torch.where(hot[:, None], probs, point)
        top_probs = probs.masked_fill(outside, 0.0)
        top_ids = top_ids.masked_fill(outside, -1)
    return DraftSample(tokens, logprobs, top_ids, top_probs)
