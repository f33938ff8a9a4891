"""Draft-token selection over the vocabulary: greedy argmax (ties -> lowest id, like torch.argmax)."""
import torch


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
    return logits.argmax(dim=-1)
