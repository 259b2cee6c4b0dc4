"""The kernel registry, apart from the package so that the family modules the package imports can
register into it without importing the package back (tests/test_imports.py: no import cycle)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import numba
import numpy as np

from ...dtypes import DType

#: element type -> ``kernel(x, w, out, q8)``: ``x`` f32 [M, K] C-contiguous, ``w`` the stored
#: weight as a 2-D array (f32/u16 [N, K] for floats, u8 [N, K / block * block_bytes] for blocks),
#: ``out`` f32 [M, N] to fill, ``q8`` True for Q8_0-quantized activations (ignored by floats).
KERNELS: dict[DType, Callable] = {}


#: element type -> ``joint(x, ws, outs, q8, dtypes)``: the products of one ``x`` with two or three
#: weights (``ws``, ``outs``: lists of :data:`KERNELS`' ``w`` and ``out``; ``dtypes`` theirs) in one
#: threaded launch, for weights whose types all map to this same function (a family's module:
#: Q4_K_M's q, k and v are Q4_K, Q4_K and Q6_K); other groups run one :data:`KERNELS` call each.
JOINT: dict[DType, Callable] = {}


def _registrar(table: dict[DType, Callable], what: str):
    def register_as(*dtypes: DType):
        def register(fn):
            for d in dtypes:
                table[d] = fn
            return fn
        return register
    register_as.__doc__ = f"Register the decorated function as the {what} of ``dtypes``."
    return register_as


kernel = _registrar(KERNELS, "kernel (:data:`KERNELS`)")
joint_kernel = _registrar(JOINT, "joint kernel (:data:`JOINT`)")


#: Below this many weight bytes times rows a product runs on the calling thread.  With TBB's
#: threads (a launch ~2 us; threads.py) the 125M model's decode step, median of 3 rounds, F32 /
#: Q8_0 at M = 1: 21.8 / 10.0 ms with 8 MB, 16.1 / 8.3 with 1 MB, 16.6 / 9.7 with 256 KB, 20.6 /
#: 10.5 with 64 KB; at M = 8: 32.0 / 26.0, 30.5 / 23.0, 31.1 / 35.3, 52.7 / 39.6.  (numba's
#: workqueue pool, ~50 us a launch, wanted 8 MB.)  Later, with the F32 8-row tiles and every
#: kernel prefetching its rows (bench_decode --no-llama-cpp, two alternating rounds, ms a token,
#: F32 / Q8_0 / Q8_0 with Q8_0 activations): 1 MB 17.66 / 8.65 / 6.51 and 17.41 / 7.94 / 5.51;
#: 512 KB 16.61 / 7.63 / 5.93 and 16.93 / 7.24 / 5.18 (256 KB like 512 in a third round), M = 8
#: alike: the 0.8 MB k and v products of the 125M model took 63 us on one thread, 44 on two.
#: Same bits either way: threads never split a row's sum.
SERIAL_BYTES = 1 << 19
#: Chunks of weight rows a threaded product hands out (a multiple of any thread count here).
CHUNKS = 64


class Drivers(NamedTuple):
    """A product's two compiled drivers: ``rows(*args, lo, hi)`` computes weight rows lo..hi on the
    calling thread; ``threaded(*args)`` hands chunks of rows to numba's pool."""

    rows: Callable
    threaded: Callable


def joint_slots(ws: list, outs: list, extras: list, empty_extra) -> list:
    """The arguments of a three-weight joint driver, ``w, out, extra`` per weight (two or three of
    them), a missing third as empty arrays (no rows: no chunks) with ``empty_extra``."""
    slots = list(zip(ws, outs, extras)) + [(ws[0][:0], outs[0][..., :0], empty_extra)] * (3 - len(ws))
    return [v for slot in slots for v in slot]


@numba.njit(nogil=True, cache=True, inline="always")
def joint_chunks(n0, n1, n2):
    """The chunks of a joint launch's three weights (``n0``, ``n1``, ``n2`` rows; 0 for none):
    about :data:`CHUNKS` in all, in proportion to their rows, so that numba's even split of the
    chunks between threads splits the rows evenly too.  With :data:`CHUNKS` each, a 125M model's
    q, k and v (768, 256 and 256 rows) put 896 rows on one thread and 384 on the other: the
    joint Q8_0 product took 1.42x the time of one weight of 1280 rows, the Q4_K one 1.53x (and
    more than the three products apart)."""
    total = n0 + n1 + n2
    return _share(n0, total), _share(n1, total), _share(n2, total)


@numba.njit(nogil=True, cache=True, inline="always")
def _share(n, total):
    return 0 if n == 0 else min(n, max(1, (CHUNKS * n + total - 1) // total))


@numba.njit(nogil=True, cache=True, inline="always")
def joint_part(c, c0, c1, c2, n0, n1, n2):
    """Chunk ``c`` of a joint launch whose three weights (``n0``, ``n1``, ``n2`` rows) take
    ``c0``, ``c1``, ``c2`` chunks: ``(weight, first row, end row)``."""
    if c < c0:
        return 0, c * n0 // c0, (c + 1) * n0 // c0
    if c < c0 + c1:
        i = c - c0
        return 1, i * n1 // c1, (i + 1) * n1 // c1
    i = c - c0 - c1
    return 2, i * n2 // c2, (i + 1) * n2 // c2


@numba.njit(nogil=True, cache=True)
def block_sums(x, nsub):
    """Each 32-element block's sum of each row of ``x``, added in order, flat (``nsub`` a row): what
    a block's offset (a K-quant's or Q4_1's min) multiplies, once per call."""
    m_rows, k = x.shape
    sums = np.empty(m_rows * nsub, np.float32)
    for m in range(m_rows):
        for j in range(nsub):
            t = np.float32(0.0)
            for i in range(32 * j, 32 * j + 32):
                t += x[m, i]
            sums[m * nsub + j] = t
    return sums


def serial(work_bytes: int) -> bool:
    """Whether a product of this much work runs on the calling thread (see :data:`SERIAL_BYTES`)."""
    return work_bytes < SERIAL_BYTES or numba.get_num_threads() == 1


def run(drivers: Drivers, work_bytes: int, args: tuple, n: int) -> None:
    """One product, threaded only when it is large enough to pay for waking the pool."""
    if serial(work_bytes):
        drivers.rows(*args, 0, n)
    else:
        drivers.threaded(*args)
