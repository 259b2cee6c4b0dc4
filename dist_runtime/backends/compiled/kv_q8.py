"""F32 rows stored as Q8_0 in compiled code, bit for bit as ``kernels.quant.quantize`` stores them:
a KV cache kept in Q8_0 (``--kv-dtype q8_0``) holds the same bytes whether numpy, the attention
chain or the compiled program wrote a row, so a session's tokens do not depend on which did.

A row of ``W`` values (``W`` a multiple of 32; :class:`kernels.attention.KvState` refuses others)
is ``W / 32`` GGML blocks of 34 bytes: the f16 scale ``d`` and 32 int8 codes.  :func:`q8_row` is
the formula of the products' activations (:func:`.legacy._quantize_rows`: ``d = max|x| / 127``,
codes ``roundf(x * (1 / d))``, half away from zero, 0 where ``d`` is 0) written in GGML's block
layout rather than the products' grouped one, ``d`` stored with :func:`.halves.f16_bits` (numpy's
rounding); no fast-math, so the divisions are numpy's.  A block holding a NaN or an infinity gets
codes 0, as numpy's cast of the NaN codes gives on x86 (its results are NaN either way).

The attention cores read the blocks in place (:mod:`.attention`: a code times its block's ``d``
is exact in f32), so attention over Q8_0 rows has the bits of the F32 cores over the same rows
decoded.  :func:`stored_rows` is how the attention chain (:func:`.rows.rope_append_attend`, which
the compiled program calls too) writes a cache of any kept type, chosen by the buffers' type when
the caller compiles.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .cache import jit
from .halves import f16_bits, kept

#: Values per block and bytes per block (f16 d, 32 int8 codes).
QK, BLOCK_BYTES = 32, 34

_jit = jit(nogil=True)  # no fast-math: d = max / 127 and 1 / d divide as numpy's do


@_jit
def q8_row(x, out):
    """The 1-D f32 row ``x`` (a multiple of 32 values) as Q8_0 blocks into the 1-D uint8 ``out``
    (``len(x) / 32 * 34`` bytes), as ``kernels.quant.quantize(x, DType.Q8_0)`` encodes it."""
    for b in range(x.shape[0] // QK):
        amax = np.float32(0.0)
        for j in range(b * QK, (b + 1) * QK):
            a = abs(x[j])
            if amax == amax and not a <= amax:  # a NaN stays (numpy's max)
                amax = a
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        finite = abs(d) < np.inf
        at = b * BLOCK_BYTES
        h = f16_bits(d)
        out[at] = np.uint8(h & np.uint16(0xFF))
        out[at + 1] = np.uint8(h >> np.uint16(8))
        for j in range(QK):
            v = np.float64(x[b * QK + j] * inv)  # the f32 product; roundf (half away) exact in f64
            q = np.int64(np.trunc(v + np.copysign(0.5, v))) if finite else np.int64(0)
            out[at + 2 + j] = np.uint8(q & 0xFF)


@_jit
def q8_rows(x, out, pos):
    """Rows of the 2-D f32 ``x`` into rows ``pos..`` of the 2-D uint8 ``out`` (:func:`q8_row`)."""
    for t in range(x.shape[0]):
        q8_row(x[t], out[pos + t])


def stored_rows(src, buf, pos):
    """The 2-D f32 ``src`` into rows ``pos..`` of a KV buffer as it keeps them (compiled callers
    only, the choice made by ``buf``'s type when the caller compiles): Q8_0 blocks
    (:func:`q8_rows`) in a uint8 buffer, :func:`.halves.kept` values in an F32 or uint16 one."""
    raise NotImplementedError("stored_rows() is for compiled code")


@overload(stored_rows, jit_options={"nogil": True})
def _stored_rows(src, buf, pos):
    if isinstance(buf, types.Array) and buf.dtype == types.uint8:
        return lambda src, buf, pos: q8_rows(src, buf, pos)

    def elements(src, buf, pos):
        for t in range(src.shape[0]):  # by element: an array's slice assignment compiles numba's error message (~5 s)
            for j in range(src.shape[1]):
                buf[pos + t, j] = kept(src[t, j], buf)
    return elements


def row_elements(like, width):
    """Elements of ``like``'s type in a KV buffer's row of ``width`` values (compiled callers
    only): ``width / 32 * 34`` bytes for Q8_0 (uint8), else ``width``."""
    raise NotImplementedError("row_elements() is for compiled code")


@overload(row_elements, jit_options={"nogil": True})
def _row_elements(like, width):
    if isinstance(like, types.Array) and like.dtype == types.uint8:
        return lambda like, width: width // QK * BLOCK_BYTES
    return lambda like, width: width
