"""The drafter sidecar's server: a gRPC process holding an EAGLE draft head and its own paged KV cache.

Rooms (each package's ``__init__`` says what it may import):
  engine/     one engine step on the device: scheduler, proposer, step metadata, CUDA graphs, KV cache, sequences,
              sampling, the input builders of the parallel and multi-layer heads. Never imports the transport.
  transport/  how requests and tensors arrive and leave: gRPC servicer, request validation, step channels,
              shared-memory regions and mappings. The wire format, the mailbox layout, the CUDA IPC driver calls
              and the generated protocol code are shared with the client and live in ``drafter_client.protocol``.
  models/     the draft heads.            training/   the demo-model trainer (needs the ``training`` extra).
At the top, only what wires them together: config, cli, server (start-up, listeners, health, signals), runtime
(device, dtype, KV sizing, building the engine), loader (checkpoints), metrics.
"""
__version__ = "0.1.0"
