"""How requests and tensors reach the engine and how drafts leave it.

servicer.py (the drafter.v1 gRPC service), validation.py (untrusted request -> engine StepInputs, or an
INVALID_ARGUMENT naming the field), chunked.py (ProposeChunked: a large step's hidden states in chunks on a
client stream, checked and staged), step_channels.py (same-node steps through a shared-memory mailbox),
shm_regions.py / shm_mapping.py (registered host shared memory and CUDA IPC regions).

May import: grpc, the engine's step records and scheduler (drafter_service.engine), drafter_client.protocol
(generated code, wire format, mailbox layout, CUDA driver calls: shared with the client). Never a model.
"""
