"""Client library of the drafter sidecar (import name ``drafter_client``).

    from drafter_client import DrafterClient, SequenceStep

    async with DrafterClient("unix:/run/drafter/drafter.sock", namespace="engine-0") as client:
        info = await client.get_info()
        result = await client.propose([SequenceStep("req-1", 0, prompt_ids, prompt_hidden, next_token, 5)])
        drafts = result.sequences[0].drafts          # tensor [k] of target token ids

On the drafter's node, ``await client.enable_shared_memory(max_step_tokens=...)`` sends the hidden states by
reference through shared memory instead of inside the messages (docs/shared_memory.md).
``SyncDrafterClient`` offers the same calls for engines that do not run asyncio.
"""
from .client import DrafterClient, DrafterError, ProposeResult, ReleaseResult, SequenceDrafts, SequenceStep
from .session import ProposeSession
from .shm_ring import SharedTensorRef
from .sync import SyncDrafterClient

__all__ = ["DrafterClient", "DrafterError", "ProposeResult", "ProposeSession", "ReleaseResult", "SequenceDrafts",
           "SequenceStep", "SharedTensorRef", "SyncDrafterClient"]
