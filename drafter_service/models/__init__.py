"""The draft heads, each in one file: eagle1.py (EAGLE-1 Llama head), eagle3.py (EAGLE-3, also P-EAGLE),
multi_layer_eagle.py; their shared Llama layer (llama_layer.py) and attention metadata (attention_metadata.py).

May import: torch, drafter_kernels. Never the engine or the transport: the engine calls a head with tensors.
"""
