"""Held-out measurements: target perplexity, and greedy acceptance of a head at k = 1..K.

Acceptance, the simple way: for a held-out prefix x[0..P-1] the target greedily continues with y1..y(K+1).
y1 is the target's own token; the head then drafts K tokens greedily from (prefix, y1): step 0 reads
(x[t+1], feature[t]) for t < P-1 and (y1, feature[P-1]) for the last position, step j reads its previous draft
and output. Accepted at k = number of leading drafts equal to y2..y(k+1), capped at k.
"""
import math
from collections.abc import Callable

import torch
from transformers import LlamaForCausalLM

from drafter_service.training.eagle1 import Eagle1Head
from drafter_service.training.eagle3 import Eagle3Head
from drafter_service.training.features import target_features
from drafter_service.training.loop import autocast


@torch.no_grad()
def heldout_perplexity(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int, device: torch.device) -> dict:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, windows.size(0), batch_size):
        ids = windows[start : start + batch_size].to(device)
        with autocast(device):
            logits = model(input_ids=ids, use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
        total += nll.item()
        count += ids[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}


def eval_prefixes(heldout_ids: torch.Tensor, prefix_len: int, count: int, k: int) -> torch.Tensor:
    """``count`` prefixes evenly spaced over the held-out stream (deterministic, no RNG)."""
    span = prefix_len + k + 1
    last_start = heldout_ids.numel() - span
    if last_start < 0:
        raise ValueError(f"held-out stream ({heldout_ids.numel()} tokens) is shorter than one prefix span ({span})")
    count = min(count, last_start + 1)
    starts = torch.linspace(0, last_start, count).long()
    return torch.stack([heldout_ids[s : s + prefix_len] for s in starts.tolist()])


@torch.no_grad()
def target_greedy(model: LlamaForCausalLM, prefixes: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation [B, new_tokens], recomputing the full sequence each step (no cache: simple and exact)."""
    ids = prefixes
    for _ in range(new_tokens):
        nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, prefixes.size(1) :]


@torch.no_grad()
def draft_greedy(
    head: Eagle1Head | Eagle3Head,
    embed: torch.nn.Embedding,
    to_target_ids: Callable[[torch.Tensor], torch.Tensor],
    prefixes: torch.Tensor,  # [B, P]
    first_hidden: torch.Tensor,  # [B, P, H] step-0 hidden inputs (EAGLE-1: final states; EAGLE-3: fc(aux))
    y1: torch.Tensor,  # [B] the target's first greedy token
    k: int,
) -> torch.Tensor:
    """K greedy drafts [B, K] from a chain that caches each step's keys/values."""
    p = prefixes.size(1)
    device = prefixes.device
    tokens0 = torch.cat([prefixes[:, 1:], y1[:, None]], dim=1)
    out, kv = head.step(embed(tokens0), first_hidden, torch.arange(p, device=device), causal=True)
    past = [kv]
    hidden = out[:, -1:]
    token = to_target_ids(hidden)
    drafts = [token]
    for j in range(1, k):
        positions = torch.tensor([p - 1 + j], device=device)
        hidden, kv = head.step(embed(token), hidden, positions, past=past)
        past.append(kv)
        token = to_target_ids(hidden)
        drafts.append(token)
    return torch.cat(drafts, dim=1)


def acceptance_stats(drafts: torch.Tensor, continuation: torch.Tensor) -> dict:
    """drafts [B, K] vs continuation [B, K+1] (y1..y(K+1)) -> mean accepted tokens and rates for k = 1..K."""
    k = drafts.size(1)
    match = (drafts == continuation[:, 1 : k + 1]).long()
    accepted = match.cumprod(dim=1).sum(dim=1)  # leading matches
    by_k = {}
    for kk in range(1, k + 1):
        mean_acc = accepted.clamp(max=kk).float().mean().item()
        by_k[str(kk)] = {"mean_accepted": mean_acc, "acceptance_rate": mean_acc / kk, "tokens_per_target_step": 1 + mean_acc}
    reached = [(accepted >= j).float().sum().item() for j in range(k + 1)]
    alpha = [reached[j + 1] / reached[j] if reached[j] else 0.0 for j in range(k)]
    return {"prefixes": drafts.size(0), "by_k": by_k, "per_depth_conditional_acceptance": alpha}


@torch.no_grad()
def greedy_acceptance(
    target: LlamaForCausalLM,
    heads: dict[str, tuple[Eagle1Head | Eagle3Head, list[int] | None]],  # name -> (head, aux layer ids or None)
    prefixes: torch.Tensor,
    k: int,
    batch_size: int,
    device: torch.device,
) -> dict:
    """Acceptance of each head on the same prefixes and the same target continuations."""
    target.eval()
    for head, _ in heads.values():
        head.eval()
    embed = target.get_input_embeddings()
    drafts: dict[str, list[torch.Tensor]] = {name: [] for name in heads}
    conts = []
    for start in range(0, prefixes.size(0), batch_size):
        pre = prefixes[start : start + batch_size].to(device)
        with autocast(device):
            cont = target_greedy(target, pre, k + 1)
            conts.append(cont.cpu())
            for name, (head, aux_ids) in heads.items():
                feats = target_features(target, pre, aux_ids)
                if isinstance(head, Eagle3Head):
                    first = head.combine(feats.aux)
                    to_ids = lambda h, head=head: head.to_target_ids(head.logits(h).argmax(-1))
                else:
                    first = feats.final
                    to_ids = lambda h: target.lm_head(h).argmax(-1)
                drafts[name].append(draft_greedy(head, embed, to_ids, pre, first, cont[:, 0], k).cpu())
    cont = torch.cat(conts)
    return {name: acceptance_stats(torch.cat(d), cont) for name, d in drafts.items()}
