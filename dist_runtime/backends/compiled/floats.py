"""The F32, F16 and BF16 kernels: ``x [M, K] @ W[N, K]^T`` read from the stored weight in place.

The work is cut into tiles of ``rows`` rows of ``x`` by ``cols`` rows of ``W``: a tile loads each
8-element piece of its weight rows once, widens it to f32 in registers (F16, BF16) and multiplies
it into the ``rows x cols`` accumulators.  Threads take chunks of :data:`CHUNK` weight rows, and a
chunk runs its rows of ``x`` :data:`ROWS` at a time while the weight rows stay in cache, so the
weight comes from memory once per call whatever ``M``.

Batch invariance: every output ``(m, n)`` is the same sequence of operations in every tile shape,
thread and position: 8 lanes, lane ``j`` a chain of multiply-adds over ``k = j, j + 8, ...`` in
order, the lanes summed pairwise (:func:`simd.hsum`), then the last ``K mod 8`` products in order.
Tiles differ only in how many independent chains run side by side.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...dtypes import DType
from . import cpu, kernel, simd

#: Lanes of one multiply-add (8 f32 = one AVX2 register).
LANES = 8
#: Rows of ``x`` and of ``W`` per tile: 4 x 2 accumulators keep 8 chains in flight, enough to
#: hide the multiply-add latency, and leave registers for the loaded pieces.
ROWS, COLS = 4, 2
#: Weight rows per thread task: enough for a few tiles, small enough to stay in L2 for all of ``x``.
CHUNK = 16
#: Below this many weight bytes times rows, the calling thread works alone: waking the pool's
#: workers cost 40-50 us a call here on a busy machine, more than a 125M model's 768 x 2048 f32
#: product takes alone (same bits either way: threads never split a row's sum).
SERIAL_BYTES = 8 << 20


def _tile(rows: int, cols: int):
    """The intrinsic ``tile(spec, x, w, out, m0, n0, n, k)``: ``out[m0 + r, n0 + c] = x[m0 + r] .
    W[n0 + c]`` for ``r < rows``, ``c < cols`` (arrays flat, ``spec`` a :class:`simd.Static` of
    (weight format, :data:`cpu.PATH`)).  One intrinsic per shape: numba keys an intrinsic's code
    by its argument types, which a shape passed as an argument would not change."""
    @intrinsic
    def tile(typingctx, spec, x, w, out, m0, n0, n, k):
        return types.void(spec, x, w, out, *[types.intp] * 4), functools.partial(_codegen, *spec.value, rows, cols)
    return tile


def _codegen(fmt, path, rows, cols, context, builder, sig, args):
    """The IR of one tile (see :func:`_tile`)."""
    x, w, out = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args[1:4], args[1:4]))
    m0, n0, n, k = args[4:8]
    i64 = ir.IntType(64)

    def at(ptr, row, col):
        return builder.gep(ptr, [builder.add(builder.mul(row, k), col)])

    xrows = [builder.add(m0, i64(r)) for r in range(rows)]
    wrows = [builder.add(n0, i64(c)) for c in range(cols)]
    zero = simd.splat(simd.F32, 0.0, LANES)
    acc = [[cgutils.alloca_once_value(builder, zero) for _ in wrows] for _ in xrows]
    whole = builder.and_(k, i64(-LANES))
    with cgutils.for_range_slice(builder, i64(0), whole, i64(LANES)) as (i, _):
        ws = [simd.load(builder, at(w, row, i), fmt, LANES, path) for row in wrows]
        for r, row in enumerate(xrows):
            xs = simd.load(builder, at(x, row, i), "f32", LANES, path)
            for c, wv in enumerate(ws):
                builder.store(simd.fma(builder, wv, xs, builder.load(acc[r][c]), path), acc[r][c])
    sums = [[cgutils.alloca_once_value(builder, simd.hsum(builder, builder.load(a))) for a in line]
            for line in acc]
    with cgutils.for_range_slice(builder, whole, k, i64(1)) as (i, _):
        ws = [builder.extract_element(simd.load(builder, at(w, row, i), fmt, 1, path), i64(0))
              for row in wrows]
        for r, row in enumerate(xrows):
            xv = builder.load(at(x, row, i))
            for c, wv in enumerate(ws):
                builder.store(simd.fma(builder, wv, xv, builder.load(sums[r][c]), path), sums[r][c])
    for r, row in enumerate(xrows):
        for c, col in enumerate(wrows):
            builder.store(builder.load(sums[r][c]), builder.gep(out, [builder.add(builder.mul(row, n), col)]))
    return context.get_dummy_value()


#: A full tile, one row of ``x`` (the last ``M mod ROWS``), one weight row (the last of a chunk),
#: one of each.
_TILE, _ROW, _COLUMN, _ONE = _tile(ROWS, COLS), _tile(1, COLS), _tile(ROWS, 1), _tile(1, 1)


@numba.njit(nogil=True, cache=True)
def _chunk(spec, x, w, out, m, n, k, task):
    """Weight rows ``task * CHUNK`` up to the next chunk: whole tiles, then the odd row."""
    end = min(n, (task + 1) * CHUNK)
    j = task * CHUNK
    while j < end:
        if j + COLS <= end:
            i = 0
            while i + ROWS <= m:
                _TILE(spec, x, w, out, i, j, n, k)
                i += ROWS
            while i < m:
                _ROW(spec, x, w, out, i, j, n, k)
                i += 1
            j += COLS
        else:
            i = 0
            while i + ROWS <= m:
                _COLUMN(spec, x, w, out, i, j, n, k)
                i += ROWS
            while i < m:
                _ONE(spec, x, w, out, i, j, n, k)
                i += 1
            j += 1


@numba.njit(nogil=True, cache=True, parallel=True)
def _threaded(spec, x, w, out, m, n, k):
    for task in prange((n + CHUNK - 1) // CHUNK):
        _chunk(spec, x, w, out, m, n, k, task)


@numba.njit(nogil=True, cache=True)
def _serial(spec, x, w, out, m, n, k):
    for task in range((n + CHUNK - 1) // CHUNK):
        _chunk(spec, x, w, out, m, n, k, task)


def _run(spec: simd.Static, x: np.ndarray, w: np.ndarray, out: np.ndarray, q8: bool) -> None:
    m, n = out.shape
    run = _serial if w.nbytes * m < SERIAL_BYTES or numba.get_num_threads() == 1 else _threaded
    run(spec, x.reshape(-1), w.reshape(-1), out.reshape(-1), m, n, x.shape[1])


for _dtype, _fmt in ((DType.F32, "f32"), (DType.F16, "f16"), (DType.BF16, "bf16")):
    kernel(_dtype)(functools.partial(_run, simd.Static((_fmt, cpu.PATH))))
