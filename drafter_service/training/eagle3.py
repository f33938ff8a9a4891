"""EAGLE-3 head (layout of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, vLLM ``llama_eagle3.py``) and its training-time-test loss.

g = fc(cat(a_1, a_2, a_3)), a_i = target state entering layer aux_layer_ids[i]. One "midlayer" step:
  x = cat(input_layernorm(embed(token)), hidden_norm(hidden)) -> self_attn (q/k/v take 2H) -> + hidden (residual)
  -> post_attention_layernorm -> mlp -> + residual = out (pre-norm); logits = lm_head(norm(out)) over the draft vocab.
Step 0 takes hidden = g; step j takes the previous step's pre-norm output. Draft id d maps to target id d + d2t[d];
t2d[target id] says whether the id is in the draft vocab. embed_tokens comes from the target.
"""
import torch
import torch.nn.functional as F
from torch import nn

from drafter_service.training.layers import MLP, Attention, RMSNorm, rope_cos_sin

STEP_DECAY = 0.8  # EAGLE-3: weight of the unroll step j is 0.8 ** j


class Eagle3MidLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Attention(2 * hidden, hidden, num_heads, num_kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, embeds, hidden, cos, sin, past=(), mask=None, causal=False):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, kv = self.self_attn(x, cos, sin, past=past, mask=mask, causal=causal)
        h = hidden + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


class Eagle3Head(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, eps: float, rope_theta: float,
                 draft_to_target: torch.Tensor, target_vocab: int):
        super().__init__()
        self.head_dim = hidden // num_heads
        self.rope_theta = rope_theta
        draft_vocab = draft_to_target.numel()
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = Eagle3MidLayer(hidden, intermediate, num_heads, num_kv_heads, self.head_dim, eps)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        d2t = draft_to_target - torch.arange(draft_vocab)
        t2d = torch.zeros(target_vocab, dtype=torch.bool)
        t2d[draft_to_target] = True
        self.register_buffer("d2t", d2t.long())
        self.register_buffer("t2d", t2d)
        self.register_buffer("draft_ids", draft_to_target.long(), persistent=False)  # target id of each draft id

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)

    def step(self, embeds, hidden, positions, past=(), mask=None, causal=False):
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        return self.midlayer(embeds, hidden, cos, sin, past=past, mask=mask, causal=causal)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft: torch.Tensor) -> torch.Tensor:
        return draft + self.d2t[draft]


def draft_vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The draft_vocab_size most frequent target ids (ties by lower id), sorted ascending as EAGLE-3 does."""
    order = torch.sort(counts, descending=True, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def ttt_mask(n: int, step: int, device) -> torch.Tensor:
    """Attention mask of unroll step ``step`` over the keys of steps 0..step ([n, (step+1)*n], True = attend).

    Query t attends to step-0 keys s <= t (the verified context) and, for every later step i <= step, only to its own
    key at the same t: exactly the keys its draft chain would see at inference.
    """
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def ttt_unroll(head: Eagle3Head, embed: nn.Embedding, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test: run the head ``steps`` times, each step on the previous step's outputs.

    Step j, pair t (t = 0..T-2): input token x[t+1+j] (0 past the window) at position t+j, hidden = fc(aux[t]) for
    j = 0, else the step j-1 output at t. Returns the pre-norm outputs of every step, each [B, T-1, H].
    """
    n = ids.size(1) - 1
    device = ids.device
    hidden = head.combine(aux[:, :n])
    past: list = []
    outs = []
    for j in range(steps):
        tok = F.pad(ids[:, 1 + j :], (0, j), value=0)
        positions = torch.arange(n, device=device) + j
        mask = None if j == 0 else ttt_mask(n, j, device)
        hidden, kv = head.step(embed(tok), hidden, positions, past=past, mask=mask, causal=(j == 0))
        past.append(kv)
        outs.append(hidden)
    return outs


def eagle3_loss(head: Eagle3Head, embed: nn.Embedding, ids: torch.Tensor, aux: torch.Tensor, target_logits: torch.Tensor,
                steps: int):
    """EAGLE-3 objective: sum_j 0.8^j * soft cross-entropy of unroll step j against the target's distribution after
    x[t+1+j], restricted to the draft vocab. Pairs whose target argmax is outside the draft vocab, or that run past
    the window, are masked. Metrics (detached): per-step top-1 agreement with the target."""
    n = ids.size(1) - 1
    restricted = target_logits[..., head.draft_ids]  # [B, T, Vd]
    in_draft = head.t2d[target_logits.argmax(-1)]  # [B, T]
    loss = torch.zeros((), device=ids.device)
    metrics = {}
    for j, out in enumerate(ttt_unroll(head, embed, ids, aux, steps)):
        valid = n - j
        logp = torch.log_softmax(head.logits(out[:, :valid]).float(), dim=-1)
        target_p = torch.softmax(restricted[:, 1 + j : 1 + j + valid], dim=-1)
        keep = in_draft[:, 1 + j : 1 + j + valid].float()
        ce = -(target_p * logp).sum(-1)
        loss = loss + STEP_DECAY**j * (ce * keep).sum() / keep.sum().clamp_min(1.0)
        agree = (logp.argmax(-1) == target_p.argmax(-1)).float()
        metrics[f"acc{j}"] = ((agree * keep).sum() / keep.sum().clamp_min(1.0)).detach()
    return loss, metrics
