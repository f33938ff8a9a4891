"""Self-distillation data for the heads: windows sampled from the trained target itself.

The target has partly memorised its training files, so on them its hidden states and predictions are not what
it produces on new text. Heads trained on the target's own samples (prompted with the first tokens of train
windows, temperature 1) see the target as it behaves while generating, which is what drafting faces.
"""
import torch
from transformers import LlamaForCausalLM

from .loop import autocast
from .progress import say


@torch.no_grad()
def sample_windows(model: LlamaForCausalLM, prompts: torch.Tensor, length: int, batch_size: int,
                   device: torch.device, seed: int, temperature: float = 1.0) -> torch.Tensor:
    """prompts [N, P] -> [N, length] windows: the prompt then ``length - P`` tokens sampled with a KV cache."""
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for start in range(0, prompts.size(0), batch_size):
        ids = prompts[start : start + batch_size].to(device)
        with autocast(device):
            step = model(input_ids=ids, use_cache=True)
            past = step.past_key_values
            for _ in range(length - prompts.size(1)):
                probs = torch.softmax(step.logits[:, -1].float() / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen)
                ids = torch.cat([ids, nxt], dim=1)
                step = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = step.past_key_values
        out.append(ids.cpu())
        say(f"[samples] {min(start + batch_size, prompts.size(0))}/{prompts.size(0)} windows")
    return torch.cat(out)
