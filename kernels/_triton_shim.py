"""Optional Triton import.

The server runs on CPU machines where triton is not installed, yet every kernel file defines its ``@triton.jit``
kernel beside its torch reference. Kernel files therefore import ``triton``/``tl`` from here: the real modules when
triton imports, otherwise stand-ins that let the decorated definitions evaluate and refuse to launch.

Note: ``@triton.jit`` reads ``TRITON_INTERPRET`` when the kernel is *defined* (module import), not when launched.
"""

import functools

import torch

HAS_TRITON = False
try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: the torch references are used (see ops.py)

    class _MissingKernel:
        def __init__(self, fn):
            self.__name__ = getattr(fn, "__name__", "kernel")

        def _fail(self, *args, **kwargs):
            raise RuntimeError(f"{self.__name__}: triton is not installed; use the *_ref function")

        __call__ = _fail
        __getitem__ = _fail

    class _MissingTriton:
        @staticmethod
        def jit(fn=None, **options):  # (as triton.jit: bare, or with options such as do_not_specialize)
            return _MissingKernel(fn) if fn is not None else _MissingKernel

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (n - 1).bit_length())

    class _MissingLanguage:
        constexpr = object  # only evaluated in annotations of kernel signatures

    triton = _MissingTriton()
    tl = _MissingLanguage()

__all__ = ["HAS_TRITON", "triton", "tl"]


DEFAULT_SM_COUNT = 132  # H100 / H200: what launch heuristics assume when the tensors are not on CUDA


@functools.lru_cache(maxsize=None)
def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device (split / chunk heuristics size their grids with it)."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count
