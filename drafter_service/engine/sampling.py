"""Draft sampling: greedy at temperature 0, otherwise Gumbel-max seeded per (seed, position).

The noise is the kernels' ``gumbel_sample`` (drafter_kernels/sampling.py, through ops: the Triton kernel on CUDA,
the torch reference elsewhere, the same uniforms bit for bit): the uniform of (seed, position, column v) is one
Philox-4x32-10 block keyed by the seed, so a draft is a pure function of (logits, temperature, seed, position):
a replayed step gives the same drafts, on any device, in any batch. Gumbel-max, ``argmax_v(logits[v] / T + g_v)``
with ``g_v = -log(-log(u_v))``, is an exact sample of ``softmax(logits / T)``.

``sample_drafts`` adds what the reply can carry: log q(draft) and the top-N of q (docs/sampling.md says exactly
which q the engine's rejection sampler must use).
"""
from dataclasses import dataclass

import torch

from drafter_kernels import ops

gumbel_sample = ops.gumbel_sample  # (logits [B, V], temperature [B] f32, seed [B] i64, position [B] i64) -> [B] i64


def seed_to_int64(seed: int) -> int:
    """A uint64 seed from the wire as the int64 with the same bits (tensors have no uint64 arithmetic)."""
    return seed - 2**64 if seed >= 2**63 else seed


def int64_to_seed(bits: int) -> int:
    """The uint64 seed whose bits an int64 holds (seed_to_int64's inverse)."""
    return bits + 2**64 if bits < 0 else bits


@dataclass
class DraftSample:
    tokens: torch.Tensor  # [n] int64 column ids of the logits (draft-vocabulary ids for draft-vocab heads)
    logprobs: torch.Tensor | None  # [n] float32 log q(token)
    top_ids: torch.Tensor | None  # [n, N] int64 column ids, by decreasing q; -1 past a row's own N
    top_probs: torch.Tensor | None  # [n, N] float32 q of those; 0 past a row's own N


@dataclass
class SamplingSettings:
    """A batch's sampling settings, one entry per sequence (on the device)."""

    temperature: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    top_k: torch.Tensor  # [B] int64
    want_logprobs: bool
    greedy_only: bool  # every sequence greedy, no log-probs, no top-k: a plain argmax does
    # max(top_k) and whether some temperature is above 0, as the host knows them (None: sample_drafts reads them
    # from the device, a synchronization per draft step)
    width: int | None = None
    any_hot: bool | None = None


def sample_drafts(
    logits: torch.Tensor,  # [n, V] float
    temperature: torch.Tensor,  # [n] float32
    seed: torch.Tensor,  # [n] int64
    position: torch.Tensor,  # [n] int64: the Gumbel position (the drafted token's position - 1)
    top_k: torch.Tensor,  # [n] int64: N per row, 0 = no top-N (and no truncation)
    want_logprobs: bool,
    width: int | None = None,  # max(top_k) where the host knows it (else read from the device: a synchronization)
    any_hot: bool | None = None,  # whether some temperature is above 0, where the host knows it (likewise)
) -> DraftSample:
    """Draw one draft per row from q and describe q.

    q is softmax(logits / T) (T > 0), restricted to the row's N most likely columns and renormalized when N > 0;
    at T = 0 it is the point mass on argmax(logits). The returned log-probabilities and top-N are those of q.
    """
    if width is None:
        width = int(top_k.max()) if top_k.numel() else 0
    if any_hot is None:
        any_hot = bool((temperature > 0).any())
    if not want_logprobs and width == 0 and not any_hot:
        return DraftSample(logits.argmax(dim=-1), None, None, None)
    return sample_from_q(logits, temperature, seed, position, top_k, width, want_logprobs)


def sample_from_q(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                  top_k: torch.Tensor, width: int, want_logprobs: bool) -> DraftSample:
    """sample_drafts' draw (same arguments), with the top-N taken over ``width`` >= max(top_k) columns: no host
    synchronization and shapes from (logits, width) alone, so that a CUDA graph can hold it (cuda_graphs.py's
    sampled decode steps). A row's top-N is the first N of the top ``width``: the same ids and probabilities as with
    width = N, except between logits that tie exactly at the N-th place."""
    hot = temperature > 0
    logits = logits.float()
    top_ids = None
    if width > 0:
        top_ids = logits.topk(width, dim=-1).indices  # [n, width]
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
