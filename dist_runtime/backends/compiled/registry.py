"""What the product families share: the route record of the product table, and the helpers of
their threaded drivers (the threshold for threads, the chunks of a joint launch).  Apart from the
package so that the family modules import it without importing the package back."""

from __future__ import annotations

from typing import Callable, NamedTuple

import numba
import numpy as np

from .cache import jit

#: The families of product kernels: the module whose kernels run a route, and the compiled
#: program's instruction that takes its weights (``program/instructions.py``).
FLOATS, LEGACY, KQUANTS = "floats", "legacy", "kquants"


class Route(NamedTuple):
    """How the products of one weight type run with one kind of activations: a row of the product
    table (:data:`.products.PRODUCTS`), as ggml's type traits are for its types.

    ``rows(x, w, out)`` fills ``out`` f32 ``[M, N]`` with ``x`` f32 ``[M, K]`` (C-contiguous) times
    ``W^T``, ``w`` the stored weight as a 2-D array (f32 / u16 ``[N, K]`` for floats, u8 ``[N, K /
    block * block_bytes]`` for blocks).  ``joint(x, ws, outs, codes)`` does two or three such
    products with one ``x`` in one threaded launch, for weights whose routes share this same
    ``joint`` (``codes``: theirs); each row's bits as alone."""

    family: str  # FLOATS, LEGACY or KQUANTS
    code: int  # the weight's format code in its family's kernels (and the program's weight table)
    activations: str  # what the kernel multiplies the weight with: "f32" or "q8_0" (quantized per block)
    rows: Callable
    joint: Callable
    tile: str  # how the kernel reads the weight, for ``inspect --plan``


#: Below this many weight bytes times rows a product runs on the calling thread: waking the pool
#: (TBB, ~2 us a launch: threads.py) pays from about there.  With 512 KB the 125M model's decode
#: step (bench_decode.py, F32 / Q8_0 / Q8_0 with Q8_0 activations) ran 16.6-16.9 / 7.2-7.6 / 5.2-5.9
#: ms a token against 17.4-17.7 / 7.9-8.7 / 5.5-6.5 with 1 MB and 20.6 / 10.5 (F32 / Q8_0) with 64
#: KB.  Same bits either way: threads never split a row's sum.
SERIAL_BYTES = 1 << 19
#: Rows of ``x`` a thread runs its K-quant weight rows against at a time (products of many rows: a
#: prefill chunk's).  Each weight row streams the whole of its tile's quantized ``x``; 512 rows of
#: K = 3072 (4.5 MB as Q8_K activations with their scales) leave the L2 cache and every weight row
#: then waits on them: 8192 x 3072, two threads, at M = 512 (Zen 3), Q4_K 143 GFLOP/s in one tile
#: against 192 in tiles of 32, Q6_K 108 against 131.  Walking the weight rows in spans instead (as
#: the legacy blocks do, :data:`WEIGHT_SPAN_BYTES`) gained them nothing: each of their tiles decodes
#: its super-blocks again, so they want the larger tiles of ``x`` that stay in L2 rather than L1.
X_ROWS = 32
#: Bytes of a thread's weight rows that the legacy blocks' products of more than
#: :data:`SPAN_MIN_ROWS` rows run every tile of ``x`` against in turn: the tile's quantized rows
#: (4 of them: 18 KB at K = 3072) stay in L1 while the span's rows come from L2, where each weight
#: row streaming tiles of 32 rows from L2 has every tile's loads wait there.  Q8_0, two threads,
#: medians of interleaved runs (Zen 3): 8192 x 3072 at M = 512 0.81-0.84x the time of tiles of
#: 128 rows a weight row, 0.92x of tiles of 32; 3072 x 8192 0.86-0.89x; at M = 64 0.87x, M = 32
#: 0.95x; spans of 16-64 rows of K = 3072 no different from each other, of 128 0.92x.
WEIGHT_SPAN_BYTES = 128 << 10
#: Bytes of the weight rows of a span as the 256-bit path decodes them once for every tile of ``x``
#: (:func:`.simd_int8.decode_pairs`: 384 bytes a group of 4 blocks, 2.8x Q8_0's own).  Q8_0, two
#: threads, medians of interleaved runs (Zen 3), against spans decoded again by every tile: 8192 x
#: 3072 at M = 512 0.80-0.87x the time, 3072 x 8192 0.87-0.94x, M = 64 0.90x, M = 32 0.92x; with
#: 256 KB 3072 x 8192 took 0.98x (spans of 10 rows: every tile of ``x``, 48 KB there, comes back
#: from L2 every few rows).
DECODED_SPAN_BYTES = 384 << 10
#: Rows of ``x`` up to which a legacy product runs each weight row against all of them at once: at
#: M = 16 the weight's own bytes come from memory and the spans' extra passes cost (1.03x the time).
SPAN_MIN_ROWS = 16
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


@jit(nogil=True, inline="always")
def joint_chunks(n0, n1, n2):
    """The chunks of a joint launch's three weights (``n0``, ``n1``, ``n2`` rows; 0 for none):
    about :data:`CHUNKS` in all, in proportion to their rows, so that numba's even split of the
    chunks between threads splits the rows evenly too.  With :data:`CHUNKS` each, a 125M model's
    q, k and v (768, 256 and 256 rows) put 896 rows on one thread and 384 on the other: the
    joint Q8_0 product took 1.42x the time of one weight of 1280 rows, the Q4_K one 1.53x (and
    more than the three products apart)."""
    total = n0 + n1 + n2
    return _share(n0, total), _share(n1, total), _share(n2, total)


@jit(nogil=True, inline="always")
def _share(n, total):
    return 0 if n == 0 else min(n, max(1, (CHUNKS * n + total - 1) // total))


@jit(nogil=True, inline="always")
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


@jit(nogil=True)
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
