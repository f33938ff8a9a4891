"""The draft head's paged KV cache: one tensor pool plus a free list of blocks.

Layout: ``kv[layer, 0 or 1 (K or V), block, offset_in_block, kv_head, head_dim]``. A sequence owns a list of
block ids (its block table); position ``t`` lives in block ``table[t // block_size]`` at offset
``t % block_size``, i.e. in slot ``table[t // block_size] * block_size + t % block_size``.
"""
from collections import deque

import torch


class BlockPool:
    """Free list of KV blocks. Not thread-safe: only the step worker thread touches it."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def reset(self) -> None:
        """Every block free, in the order of a new pool (the warm-up's allocations leave no trace in later ones)."""
        if len(self._free) != self.num_blocks:
            raise RuntimeError(f"{self.num_blocks - len(self._free)} KV blocks are still in use")
        self._free = deque(range(self.num_blocks))


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                              device=device)
        self.pool = BlockPool(num_blocks)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_blocks, block_size, Hkv, D]."""
        return self.kv[i, 0], self.kv[i, 1]

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_tokens(self) -> int:
        return self.pool.num_free * self.block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * head_dim * dtype.itemsize
