"""What one forward of the draft head needs to know about the batch's layout in the paged KV cache."""
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64: position of each input row
    slot_mapping: torch.Tensor  # [T] int64: KV slot each row writes (-1: write nothing)
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence i owns rows [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] int32: context length of sequence i, its new rows included
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int  # host-side max of the query lengths (1 for decode steps)
    # CPU: the forwards of one engine step share one dict, in which the batched attention keeps each layer's gathered
    # context between them (kernels/paged_attention.py, GatheredContext); None: gather every time
    context_cache: dict | None = None
