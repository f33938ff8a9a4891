"""One engine step on the device, on whole batches as tensors.

Path of a step: scheduler.py (continuous batching on the step thread; merge_window.py: the short wait for engines
that step together) -> proposer.py (admit, prepare inputs,
first draft step, k-1 decode steps, sampling) -> the head in drafter_service.models. Around them: step_io.py (the
step's input/output records), step_metadata.py, cuda_graphs.py, kv_cache.py (block pool), sequence.py (sequence
table and block tables), sampling.py, parallel_inputs.py (P-EAGLE) and multi_layer_inputs.py (multi-layer heads).

May import: torch, drafter_kernels, drafter_service.models, drafter_service.metrics and
drafter_client.protocol.timer_slack and .gil_yield (OS and interpreter helpers for the polling step thread). Never the transport, never grpc.
"""
