"""Token windows and batches: the train stream is cut into non-overlapping windows, shuffled once per epoch."""
from collections.abc import Iterator

import torch


def to_windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N] token stream -> [N // seq_len, seq_len] windows (the ragged tail is dropped)."""
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"token stream of {ids.numel()} tokens is shorter than one window of {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


def steps_for_epochs(num_windows: int, batch_size: int, epochs: float) -> int:
    return max(1, round(epochs * num_windows / batch_size))


def batches(windows: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch_size, seq_len] batches; every epoch is a fresh permutation from a seeded generator."""
    if windows.size(0) < batch_size:
        raise ValueError(f"only {windows.size(0)} windows for a batch of {batch_size}: lower the batch or seq_len")
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(windows.size(0), generator=gen)
        for start in range(0, order.numel() - batch_size + 1, batch_size):
            yield windows[order[start : start + batch_size]]
