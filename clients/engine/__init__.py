"""The reference engine over a Hugging Face target, verification, the demo and the sidecar child-process helper.

Import these modules by name (``from drafter_client.engine.reference_engine import ReferenceEngine``): they need
the ``demo`` extra (transformers, tokenizers; matplotlib for the chart) except sidecar_process.py and verify.py.
May import: drafter_client, transformers, tokenizers, matplotlib. Never drafter_service (the sidecar runs as a
child process).
"""
