"""Client library of the drafter sidecar (import name ``drafter_client``).

    from drafter_client import DrafterClient, SequenceStep

    async with DrafterClient("unix:/run/drafter/drafter.sock", namespace="engine-0") as client:
        info = await client.get_info()
        result = await client.propose([SequenceStep("req-1", 0, prompt_ids, prompt_hidden, next_token, 5)])
        drafts = result.sequences[0].drafts          # tensor [k] of target token ids

On the drafter's node, ``await client.enable_shared_memory(max_step_tokens=...)`` sends the hidden states by
reference through shared memory instead of inside the messages (docs/shared_memory.md).
``SyncDrafterClient`` offers the same calls for engines that do not run asyncio.
A sick drafter never stops the engine: propose() has a deadline (``step_timeout_s``) and answers "no drafts"
(``result.fallback``) when the drafter does not answer in time or fails; a circuit breaker (breaker.py) then skips
it for a backoff (docs/protocol.md, "When the drafter is sick").

What lives here: client.py (DrafterClient), batch.py (StepBatch, BatchDrafts: the batch API), breaker.py
(CircuitBreaker), messages.py (SequenceStep, ProposeResult and their packing), session.py (ProposeStream),
sync.py, shm_ring.py (shared-memory slots), step_channel.py, engine_fc.py (EngineFc: an EAGLE-3 head's fc applied
by the engine, for a drafter served with --engine-applies-fc);
protocol/ (generated code and wire format, shared with the server); engine/ (reference engine, demo; needs the
``demo`` extra); benchmarks/. This package may import grpc, protobuf, torch, numpy and drafter_client.protocol: never
drafter_service, transformers, matplotlib, tokenizers or uvloop (tests/test_layout.py checks it).
"""
from drafter_client.batch import BatchDrafts, StepBatch
from drafter_client.breaker import CircuitBreaker
from drafter_client.client import DrafterClient
from drafter_client.engine_fc import EngineFc
from drafter_client.messages import DrafterError, ProposeResult, ReleaseResult, SequenceDrafts, SequenceStep
from drafter_client.session import ProposeSession
from drafter_client.shm_ring import SharedTensorRef
from drafter_client.sync import SyncDrafterClient

__all__ = ["BatchDrafts", "CircuitBreaker", "DrafterClient", "DrafterError", "EngineFc", "ProposeResult", "ProposeSession", "ReleaseResult",
           "SequenceDrafts", "SequenceStep", "SharedTensorRef", "StepBatch", "SyncDrafterClient"]
