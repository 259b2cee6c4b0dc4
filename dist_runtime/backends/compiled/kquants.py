"""Kernels for the K-quants (Q4_K, Q5_K, Q6_K): 256-element super-blocks read in place.

Each super-block of a weight row is decoded once per call into 256 f32 values, bit for bit
``kernels.quant.dequantize``'s (same products in the same order), and every row of ``x`` then
takes its dot product with them in 32 fixed lanes (lane ``l`` sums the elements ``k = l mod 32``
in order of ``k``); the lanes are added in one fixed tree at the end of the row.  So ``(m, n)`` is
the same sequence of operations whatever ``M``, the row's position and the thread count.

On AVX2 the lanes are four ``fma`` on ``<8 x float>`` (LLVM vector IR, :mod:`.simd_k`); the
portable path multiplies and adds in plain numba.  The two paths round differently (fused or
not), each is batch-invariant on its own.

``q8=True`` (Q8_0-quantized activations) is not implemented for K-quants: they always take the f32
activations path.
"""

from __future__ import annotations

import numba
import numpy as np

from ...dtypes import DType
from . import cpu, kernel
from .simd_k import decode_q4_k_avx2, fma_lanes_avx2

QK_K = 256
LANES = 32
#: Output rows per work item: enough items to balance two threads, few enough to keep each one's
#: scratch allocation negligible.
ROWS = 16


@numba.njit(nogil=True, cache=True, inline="always")
def _f16(lo, hi):
    """The little-endian f16 in bytes ``lo``, ``hi`` as f32 (exact: every f16 is an f32)."""
    bits = np.int32(lo) | (np.int32(hi) << np.int32(8))
    sign = -1.0 if bits & 0x8000 else 1.0
    e = (bits >> 10) & 0x1F
    mant = bits & 0x3FF
    if e == 0x1F:
        return np.float32(sign * (np.inf if mant == 0 else np.nan))
    if e == 0:
        return np.float32(sign * np.ldexp(float(mant), -24))
    return np.float32(sign * np.ldexp(float(mant | 0x400), e - 25))


@numba.njit(nogil=True, cache=True, inline="always")
def _fma_lanes_portable(acc, a, x, at, n):
    """``acc[l] += a[i + l] * x[at + i + l]`` for ``i`` in steps of 32 below ``n``."""
    lanes = acc.shape[0]
    for i in range(0, n, lanes):
        for l in range(lanes):
            acc[l] += a[i + l] * x[at + i + l]


@numba.njit(nogil=True, cache=True, inline="always")
def _lanes_sum(acc):
    """The 32 lanes added in one fixed tree."""
    width = LANES
    while width > 1:
        width //= 2
        for l in range(width):
            acc[l] += acc[l + width]
    return acc[0]


@numba.njit(nogil=True, cache=True, inline="always")
def _scales_q4_k(w, at, ds, dm):
    """``d * scale`` and ``dmin * min`` of the 8 sub-blocks (``get_scale_min_k4``), as f32."""
    d = _f16(w[at], w[at + 1])
    dmin = _f16(w[at + 2], w[at + 3])
    s = at + 4
    for j in range(4):
        ds[j] = d * np.float32(w[s + j] & 63)
        dm[j] = dmin * np.float32(w[s + 4 + j] & 63)
        ds[j + 4] = d * np.float32((w[s + 8 + j] & 15) | ((w[s + j] >> 6) << 4))
        dm[j + 4] = dmin * np.float32((w[s + 8 + j] >> 4) | ((w[s + 4 + j] >> 6) << 4))


@numba.njit(nogil=True, cache=True, inline="always")
def _decode_q45_k_portable(w, qs, qh, ds, dm, buf, n32):
    """256 values of a Q4_K (``qh`` < 0) or Q5_K super-block: ``ds[j] * q - dm[j]``."""
    for c in range(4):
        for s in range(2):
            j = 2 * c + s
            for l in range(n32):
                q = (np.int32(w[qs + 32 * c + l]) >> np.int32(4 * s)) & np.int32(15)
                if qh >= 0:
                    q |= ((np.int32(w[qh + l]) >> np.int32(j)) & np.int32(1)) << np.int32(4)
                buf[64 * c + 32 * s + l] = ds[j] * np.float32(q) - dm[j]


@numba.njit(nogil=True, cache=True, inline="always")
def _decode_q6_k(w, at, buf, n32):
    """256 values of a Q6_K super-block: ``(d * scale[e // 16]) * (q - 32)``."""
    d = _f16(w[at + 208], w[at + 209])
    for h in range(2):
        ql = at + 64 * h
        qh = at + 128 + 32 * h
        for g in range(4):
            for half in range(2):
                sc = np.int32(w[at + 192 + 8 * h + 2 * g + half])
                dl = d * np.float32(sc - 256 if sc > 127 else sc)
                for l in range(16 * half, 16 * half + n32 // 2):
                    lo = (np.int32(w[ql + 32 * (g % 2) + l]) >> np.int32(4 * (g // 2))) & np.int32(15)
                    hi = (np.int32(w[qh + l]) >> np.int32(2 * g)) & np.int32(3)
                    buf[128 * h + 32 * g + l] = dl * np.float32((lo | (hi << np.int32(4))) - np.int32(32))


@numba.njit(nogil=True, cache=True, parallel=True)
def _linear_k(x, w, out, kind, vec):
    """``out = x @ W^T`` for ``kind`` 4, 5 or 6 (Q4_K, Q5_K, Q6_K); ``vec``: the AVX2 path."""
    m_rows, k = x.shape
    n = w.shape[0]
    blocks = k // QK_K
    size = w.shape[1] // blocks
    xf = x.reshape(-1)
    n32 = np.int64(32) + np.int64(0) * n  # a run-time 32: a constant trip count is unrolled, not vectorised
    for c in numba.prange((n + ROWS - 1) // ROWS):
        buf = np.empty(QK_K, np.float32)
        ds = np.empty(8, np.float32)
        dm = np.empty(8, np.float32)
        acc = np.empty((m_rows, LANES), np.float32)
        for r in range(c * ROWS, min(n, (c + 1) * ROWS)):
            row = w[r]
            acc[:] = 0.0
            for b in range(blocks):
                at = b * size
                if kind == 6:
                    _decode_q6_k(row, at, buf, n32)
                else:
                    _scales_q4_k(row, at, ds, dm)
                    qh = at + 16 if kind == 5 else -1
                    qs = at + 48 if kind == 5 else at + 16
                    if vec and kind == 4:
                        decode_q4_k_avx2(row, qs, ds, dm, buf)
                    else:
                        _decode_q45_k_portable(row, qs, qh, ds, dm, buf, n32)
                for m in range(m_rows):
                    if vec:
                        fma_lanes_avx2(acc[m], buf, xf, m * k + b * QK_K, QK_K)
                    else:
                        _fma_lanes_portable(acc[m], buf, xf, m * k + b * QK_K, QK_K)
            for m in range(m_rows):
                out[m, r] = _lanes_sum(acc[m])


def _register(dtype: DType, kind: int) -> None:
    @kernel(dtype)
    def linear_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, q8: bool) -> None:
        """A K-quant kernel (``q8`` ignored: f32 activations, see the module docstring)."""
        _linear_k(x, w, out, kind, cpu.AVX2)


for _dtype, _kind in ((DType.Q4_K, 4), (DType.Q5_K, 5), (DType.Q6_K, 6)):
    _register(_dtype, _kind)
