"""EAGLE-1 head (layout of yuhuili/EAGLE-llama2-chat-7B, vLLM ``llama_eagle.py``) and its training loss.

Per position t: f_t = fc(cat(embed(x[t+1]), h[t])), h = the target's final (post-norm) hidden state; then one
Llama decoder layer without input_layernorm and without a final norm; the output predicts h[t+1] and
logits = target lm_head(output). While drafting, step j feeds (embed(draft_j), output of step j-1).
State-dict keys: fc.weight [H, 2H], layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
layers.0.post_attention_layernorm.weight. No fc.bias (vLLM's loader has none and skips one silently), no
embed_tokens (read from the target).
"""
import torch
import torch.nn.functional as F
from torch import nn

from drafter_service.training.layers import MLP, Attention, RMSNorm, rope_cos_sin

P_WEIGHT = 0.1  # EAGLE-1: loss = smooth_l1(features) + 0.1 * cross-entropy(tokens)
INPUT_NOISE = 0.2  # EAGLE-1: uniform noise of width 0.2 on the input features during training


class Eagle1Layer(nn.Module):
    """A Llama decoder layer whose input_layernorm is absent (EAGLE removes it from layer 0)."""

    def __init__(self, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.self_attn = Attention(hidden, hidden, num_heads, num_kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x, cos, sin, past=(), mask=None, causal=False):
        attn, kv = self.self_attn(x, cos, sin, past=past, mask=mask, causal=causal)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


class Eagle1Head(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, eps: float, rope_theta: float):
        super().__init__()
        self.head_dim = hidden // num_heads
        self.rope_theta = rope_theta
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle1Layer(hidden, intermediate, num_heads, num_kv_heads, self.head_dim, eps)])

    def step(self, embeds, hidden, positions, past=(), mask=None, causal=False):
        """embeds, hidden [B, T, H]; positions [T] -> (output [B, T, H], this step's (k, v))."""
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        return self.layers[0](x, cos, sin, past=past, mask=mask, causal=causal)


def eagle1_loss(head: Eagle1Head, embed: nn.Embedding, lm_head: nn.Linear, ids: torch.Tensor, final: torch.Tensor, noise: bool = True):
    """EAGLE-1 objective on a [B, T] batch with the target's final hidden states ``final`` [B, T, H].

    Inputs at t = 0..T-2: (x[t+1], h[t] + noise); targets: h[t+1] and the target's distribution softmax(lm_head(h[t+1])).
    Returns (loss, metrics): metrics are detached tensors (feature loss, token loss, top-1 agreement with the target).
    """
    n = ids.size(1) - 1
    h_in = final[:, :n]
    if noise:
        h_in = h_in + (torch.rand_like(h_in) - 0.5) * INPUT_NOISE
    positions = torch.arange(n, device=ids.device)
    out, _ = head.step(embed(ids[:, 1:]), h_in, positions, causal=True)
    h_next = final[:, 1:]
    v_loss = F.smooth_l1_loss(out.float(), h_next)
    with torch.no_grad():
        target_p = torch.softmax(lm_head(h_next).float(), dim=-1)
    logp = torch.log_softmax(lm_head(out).float(), dim=-1)
    p_loss = -(target_p * logp).sum(-1).mean()
    acc = (logp.argmax(-1) == target_p.argmax(-1)).float().mean()
    loss = v_loss + P_WEIGHT * p_loss
    return loss, {"vloss": v_loss.detach(), "ploss": p_loss.detach(), "acc": acc}
