"""The kernel of each stored element type (:func:`dist_runtime.backends.compiled.linear` looks
them up here; each family module registers its own)."""

from __future__ import annotations

from typing import Callable

from ...dtypes import DType

#: element type -> ``kernel(x, w, out, q8)``: ``x`` f32 [M, K] C-contiguous, ``w`` the stored
#: weight as a 2-D array (f32/u16 [N, K] for floats, u8 [N, K / block * block_bytes] for blocks),
#: ``out`` f32 [M, N] to fill, ``q8`` True for Q8_0-quantized activations (ignored by floats).
KERNELS: dict[DType, Callable] = {}


def kernel(*dtypes: DType):
    """Register the decorated function as the kernel of ``dtypes``."""
    def register(fn):
        for d in dtypes:
            KERNELS[d] = fn
        return fn
    return register
