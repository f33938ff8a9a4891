"""Compute kernels of the drafter, installed as ``drafter_kernels``.

Each file holds one function in two forms: a plain-torch reference (``*_ref``), which is the CPU path and the
test oracle, and, where it pays, a Triton kernel of the same function for CUDA tensors. ``ops.py`` picks one.
"""
