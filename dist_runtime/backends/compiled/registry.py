"""The kernel registry, apart from the package so that the family modules the package imports can
register into it without importing the package back (tests/test_imports.py: no import cycle)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import numba

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


#: Below this many weight bytes times rows a product runs on the calling thread: launching numba's
#: pool costs 40-100 us a call here, longer than a 125M model's 768 x 768 Q8_0 product takes
#: alone (13-36 us); in F32, 768 x 768 took 40 us alone and 113 threaded, 2048 x 768 96 and 165,
#: and the 125M model's compiled F32 decode step took 24.8 ms at this threshold, 28.9 at 1 MB and
#: 37.7 at 256 KB.  Same bits either way: threads never split a row's sum.
SERIAL_BYTES = 8 << 20
#: Chunks of weight rows a threaded product hands out (a multiple of any thread count here).
CHUNKS = 64


class Drivers(NamedTuple):
    """A product's two compiled drivers: ``rows(*args, lo, hi)`` computes weight rows lo..hi on the
    calling thread; ``threaded(*args)`` hands chunks of rows to numba's pool."""

    rows: Callable
    threaded: Callable


def run(drivers: Drivers, work_bytes: int, args: tuple, n: int) -> None:
    """One product, threaded only when it is large enough to pay for waking the pool."""
    if work_bytes < SERIAL_BYTES or numba.get_num_threads() == 1:
        drivers.rows(*args, 0, n)
    else:
        drivers.threaded(*args)
