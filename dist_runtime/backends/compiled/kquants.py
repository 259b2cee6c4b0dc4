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
from .simd_k import q4_k_avx2, q5_k_avx2, q6_k_avx2

QK_K = 256
#: Lanes per row of ``x``: one ``<8 x float>``.
LANES = 8
#: Output rows per work item: enough items to balance two threads, few enough to keep each one's
#: scratch allocation negligible.
ROWS = 16
#: ``2 ** (e - 25)`` for an f16 exponent field ``e`` (1 for subnormals: ``mant * 2 ** -24``).
_POW2 = np.ldexp(np.float32(1), np.maximum(np.arange(32), 1) - 25).astype(np.float32)


@numba.njit(nogil=True, cache=True, inline="always")
def _f16(lo, hi):
    """The little-endian f16 in bytes ``lo``, ``hi`` as f32 (exact: every f16 is an f32)."""
    bits = np.int32(lo) | (np.int32(hi) << np.int32(8))
    e = (bits >> np.int32(10)) & np.int32(0x1F)
    mant = bits & np.int32(0x3FF)
    if e == 0x1F:
        value = np.float32(np.inf) if mant == 0 else np.float32(np.nan)
    else:
        value = np.float32(mant | (np.int32(0x400) if e else np.int32(0))) * _POW2[e]
    return -value if bits & np.int32(0x8000) else value


@numba.njit(nogil=True, cache=True)
def _row_scales(w, kind, size, ds, dm):
    """Each super-block's ``d * scale`` (16 a block; 8 used by Q4_K/Q5_K, from
    ``get_scale_min_k4``) and ``dmin * min`` (8 a block) of one weight row, as f32."""
    for b in range(w.shape[0] // size):
        at = b * size
        if kind == 6:
            d = _f16(w[at + 208], w[at + 209])
            for j in range(16):
                sc = np.int32(w[at + 192 + j])
                ds[16 * b + j] = d * np.float32(sc - np.int32(256) if sc > 127 else sc)
            continue
        d = _f16(w[at], w[at + 1])
        dmin = _f16(w[at + 2], w[at + 3])
        s = at + 4
        for j in range(4):
            ds[16 * b + j] = d * np.float32(w[s + j] & 63)
            dm[8 * b + j] = dmin * np.float32(w[s + 4 + j] & 63)
            ds[16 * b + j + 4] = d * np.float32((w[s + 8 + j] & 15) | ((w[s + j] >> 6) << 4))
            dm[8 * b + j + 4] = dmin * np.float32((w[s + 8 + j] >> 4) | ((w[s + 4 + j] >> 6) << 4))


@numba.njit(nogil=True, cache=True)
def _x_sums(x, nsub):
    """Each 32-element sub-block's sum of each row of ``x``, in order (for the mins), flat."""
    m_rows, k = x.shape
    sums = np.empty(m_rows * nsub, np.float32)
    for m in range(m_rows):
        for j in range(nsub):
            t = np.float32(0.0)
            for i in range(32 * j, 32 * j + 32):
                t += x[m, i]
            sums[m * nsub + j] = t
    return sums


@numba.njit(nogil=True, cache=True, inline="always")
def _codes_portable(w, at, kind, codes, n32):
    """The 256 codes of a super-block as f32, in element order: Q4_K/Q5_K unsigned (0..15/31),
    Q6_K centred (-32..31)."""
    if kind == 6:
        for h in range(2):
            for g in range(4):
                for l in range(n32):
                    lo = (np.int32(w[at + 64 * h + 32 * (g % 2) + l]) >> np.int32(4 * (g // 2))) & np.int32(15)
                    hi = (np.int32(w[at + 128 + 32 * h + l]) >> np.int32(2 * g)) & np.int32(3)
                    codes[128 * h + 32 * g + l] = np.float32((lo | (hi << np.int32(4))) - np.int32(32))
        return
    qs = at + (48 if kind == 5 else 16)
    for c in range(4):
        for s in range(2):
            j = 2 * c + s
            for l in range(n32):
                q = (np.int32(w[qs + 32 * c + l]) >> np.int32(4 * s)) & np.int32(15)
                if kind == 5:
                    q |= ((np.int32(w[at + 16 + l]) >> np.int32(j)) & np.int32(1)) << np.int32(4)
                codes[32 * j + l] = np.float32(q)


@numba.njit(nogil=True, cache=True, inline="always")
def _block_portable(codes, ds, unit, dm, x, xoff, k, xsum, soff, nsub, acc, m_rows, mins):
    """Super-block ``soff // 8``: the AVX2 path's arithmetic (:mod:`.simd_k`), multiplies and adds
    unfused."""
    for j in range(QK_K // unit):
        for m in range(m_rows):
            xat = m * k + xoff + unit * j
            for l in range(LANES):
                part = codes[unit * j + l] * x[xat + l]
                for g in range(1, unit // LANES):
                    part += codes[unit * j + LANES * g + l] * x[xat + LANES * g + l]
                acc[LANES * m + l] += ds[2 * soff + j] * part
    if mins:
        for m in range(m_rows):
            for l in range(LANES):
                acc[LANES * m + l] += -dm[soff + l] * xsum[m * nsub + soff + l]


@numba.njit(nogil=True, cache=True, inline="always")
def _lanes_sum(acc, at):
    """The 8 lanes at ``acc[at]`` added in one fixed tree."""
    return ((acc[at] + acc[at + 4]) + (acc[at + 2] + acc[at + 6])) + ((acc[at + 1] + acc[at + 5]) + (acc[at + 3] + acc[at + 7]))


@numba.njit(nogil=True, cache=True, parallel=True)
def _linear_k(x, w, out, kind, vec):
    """``out = x @ W^T`` for ``kind`` 4, 5 or 6 (Q4_K, Q5_K, Q6_K); ``vec``: the AVX2 path."""
    m_rows, k = x.shape
    n = w.shape[0]
    blocks = k // QK_K
    size = w.shape[1] // blocks
    nsub = k // 32
    xf = x.reshape(-1)
    xsum = _x_sums(x, nsub)
    n32 = np.int64(32) + np.int64(0) * n  # a run-time 32: a constant trip count is unrolled, not vectorised
    for c in numba.prange((n + ROWS - 1) // ROWS):
        ds = np.empty(16 * blocks, np.float32)
        dm = np.empty(8 * blocks, np.float32)
        codes = np.empty(QK_K, np.float32)
        acc = np.empty(m_rows * LANES, np.float32)
        for r in range(c * ROWS, min(n, (c + 1) * ROWS)):
            row = w[r]
            if not vec:
                _row_scales(row, kind, size, ds, dm)
                acc[:] = 0.0
                for b in range(blocks):
                    _codes_portable(row, b * size, kind, codes, n32)
                    _block_portable(codes, ds, 16 if kind == 6 else 32, dm, xf, b * QK_K, k, xsum, b * 8, nsub,
                                    acc, m_rows, kind != 6)
            elif kind == 4:
                q4_k_avx2(row, size, blocks, ds, dm, xf, k, xsum, nsub, acc, m_rows)
            elif kind == 5:
                q5_k_avx2(row, size, blocks, ds, dm, xf, k, xsum, nsub, acc, m_rows)
            else:
                q6_k_avx2(row, size, blocks, ds, dm, xf, k, xsum, nsub, acc, m_rows)
            for m in range(m_rows):
                out[m, r] = _lanes_sum(acc, LANES * m)


def _register(dtype: DType, kind: int) -> None:
    @kernel(dtype)
    def linear_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, q8: bool) -> None:
        """A K-quant kernel (``q8`` ignored: f32 activations, see the module docstring)."""
        _linear_k(x, w, out, kind, cpu.AVX2)


for _dtype, _kind in ((DType.Q4_K, 4), (DType.Q5_K, 5), (DType.Q6_K, 6)):
    _register(_dtype, _kind)
