"""EAGLE drafter sidecar: a gRPC server holding an EAGLE draft head and its own paged KV cache."""
__version__ = "0.1.0"
