"""Training tool for the demo model pair: a small Llama target LM and its EAGLE-1 / EAGLE-3 draft heads.

Entry point: ``python -m drafter_service.training.train_demo --out models/ --device cuda``.
One concept per module: presets, corpus, tokenizer, data, layers, target, features, eagle1, eagle3, loop,
evaluate, export, report, progress.

Needs the ``training`` extra (transformers, tokenizers). May import the models and drafter_kernels; never the
engine or the transport, and nothing in the server imports it.
"""
