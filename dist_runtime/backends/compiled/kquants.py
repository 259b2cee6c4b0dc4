"""Kernels for the K-quants (Q4_K, Q5_K, Q6_K): 256-element super-blocks read in place.

f32 activations (the default): a weight row's sub-block scales are decoded once, then every row of
``x`` takes, per sub-block, the sum of (integer code x element) in 8 fixed lanes, times the
sub-block's scale, minus (Q4_K/Q5_K) the sub-block's min times the sum of its 32 elements of ``x``
(computed once per call).  Lane ``l`` of row ``m`` is one fixed sequence of operations over the
whole of ``K``; the 8 lanes are added in one fixed tree at the end.  So ``(m, n)`` does not depend
on ``M``, the row's position or the thread count.  On AVX2 this is LLVM vector IR
(:mod:`.simd_k`, ``fma`` on ``<8 x float>``, 4 rows of ``x`` sharing each decoded sub-block); the
portable path does the same arithmetic in plain numba with multiplies and adds unfused.

``q8=True``: llama.cpp's numerics (``vec_dot_q4_K_q8_K``): each row of ``x`` is
quantized to Q8_K (``quantize_row_q8_K_ref``), each super-block's integer sums are exact
(``pmaddubsw``/``pmaddwd`` on AVX2) and kept in 8 lanes, as llama.cpp's AVX2 kernels keep them;
per lane ``acc += (dx * d) * isum`` then ``acc -= (dx * dmin) * imin`` in f32, block after block,
and the 8 lanes added in one fixed tree at the end: both paths give the same bits.  Q6_K likewise
(``vec_dot_q6_K_q8_K``: codes 0..63 times ``q8``, less 32 times the sums of 16 codes; no min
term).
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from ...dtypes import DType
from . import cpu
from .cache import jit
from .registry import CHUNKS, KQUANTS, X_ROWS, Drivers, Route, block_sums, joint_chunks, joint_part, joint_slots, run, serial
from .simd_k import q4_k_avx2, q4_k_q8, q5_k_avx2, q5_k_q8, q6_k_avx2, q6_k_q8

QK_K = 256
#: Lanes per row of ``x``: one ``<8 x float>``.
LANES = 8
#: ``2 ** (e - 25)`` for an f16 exponent field ``e`` (1 for subnormals: ``mant * 2 ** -24``).
_POW2 = np.ldexp(np.float32(1), np.maximum(np.arange(32), 1) - 25).astype(np.float32)


@jit(nogil=True, inline="always")
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


@jit(nogil=True, inline="always")
def _i8(byte):
    """A stored byte as the int8 it holds."""
    code = np.int32(byte)
    return code - np.int32(256) if code > 127 else code


@jit(nogil=True, inline="always")
def _scale_codes_q45_k(w, at, sc, mn):
    """A Q4_K/Q5_K super-block's 8 six-bit scales and mins (``get_scale_min_k4``)."""
    s = at + 4
    for j in range(4):
        sc[j] = w[s + j] & 63
        mn[j] = w[s + 4 + j] & 63
        sc[j + 4] = (w[s + 8 + j] & 15) | ((w[s + j] >> 6) << 4)
        mn[j + 4] = (w[s + 8 + j] >> 4) | ((w[s + 4 + j] >> 6) << 4)


@jit(nogil=True)
def _row_scales(w, kind, size, ds, dm):
    """Each super-block's ``d * scale`` (16 a block; 8 used by Q4_K/Q5_K) and ``dmin * min``
    (8 a block) of one weight row, as f32."""
    sc = np.empty(8, np.int32)
    mn = np.empty(8, np.int32)
    for b in range(w.shape[0] // size):
        at = b * size
        if kind == 6:
            d = _f16(w[at + 208], w[at + 209])
            for j in range(16):
                ds[16 * b + j] = d * np.float32(_i8(w[at + 192 + j]))
            continue
        d = _f16(w[at], w[at + 1])
        dmin = _f16(w[at + 2], w[at + 3])
        _scale_codes_q45_k(w, at, sc, mn)
        for j in range(8):
            ds[16 * b + j] = d * np.float32(sc[j])
            dm[8 * b + j] = dmin * np.float32(mn[j])


@jit(nogil=True, inline="always")
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


@jit(nogil=True, inline="always")
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


@jit(nogil=True, inline="always")
def _lanes_sum(acc, at):
    """The 8 lanes at ``acc[at]`` added in one fixed tree."""
    return ((acc[at] + acc[at + 4]) + (acc[at + 2] + acc[at + 6])) + ((acc[at + 1] + acc[at + 5]) + (acc[at + 3] + acc[at + 7]))


@jit(nogil=True)
def _quantize_q8_k(x):
    """Each row of ``x`` as Q8_K (llama.cpp's ``quantize_row_q8_K_ref``): per 256 elements an f32
    ``d`` and int8 codes ``rint(x * -127 / max)`` (``max`` the element of largest magnitude, with
    its sign; the first of them when both signs reach it), flat; and the sums (int32) of each 32 and
    each 16 codes.  A block holding a NaN or an inf gets codes 0 and ``d`` NaN.

    The search for ``max`` runs on the f32 bit patterns as integers (the order of non-negative
    floats), so that LLVM vectorizes it: with a float compare-and-branch, 4096 elements took 17 us."""
    m_rows, k = x.shape
    q = np.zeros(m_rows * k, np.int8)
    d = np.zeros(m_rows * (k // QK_K), np.float32)
    sums = np.zeros(m_rows * (k // 32), np.int32)
    sums16 = np.zeros(m_rows * (k // 16), np.int32)
    bits, word = np.ascontiguousarray(x).view(np.int32), np.empty(1, np.int32)
    n16 = np.int64(16) + np.int64(0) * k  # a run-time 16: a constant trip count is unrolled, not vectorised
    for m in range(m_rows):
        for b in range(k // QK_K):
            lo = b * QK_K
            top_pos, top_neg = np.int32(0), np.int32(0)  # the largest |x| bits among x >= +0, x <= -0
            for i in range(lo, lo + QK_K):
                v = bits[m, i]
                mag = v & np.int32(0x7FFFFFFF)
                top_pos = max(top_pos, mag if v >= 0 else np.int32(0))
                top_neg = max(top_neg, mag if v < 0 else np.int32(0))
            top = max(top_pos, top_neg)
            if top >= np.int32(0x7F800000):  # an inf or NaN: codes 0, d NaN (the row's results NaN)
                d[m * (k // QK_K) + b] = np.nan
                continue
            if top == 0:
                continue
            if top_pos != top_neg:  # one sign reaches it: the float of those bits, that sign
                word[0] = top if top_pos > top_neg else top | np.int32(-0x80000000)
                big = word.view(np.float32)[0]
            else:  # both do: the first of them, as the reference's strict > keeps it
                i = lo
                while bits[m, i] & np.int32(0x7FFFFFFF) != top:
                    i += 1
                big = x[m, i]
            iscale = np.float32(-127.0) / big
            for g in range(QK_K // 16):
                total = np.int32(0)
                at = m * k + lo + 16 * g
                for i in range(n16):
                    v = min(np.int32(np.rint(iscale * x[m, lo + 16 * g + i])), np.int32(127))
                    q[at + i] = v
                    total += v
                sums16[at // 16] = total
                sums[at // 32] += total
            d[m * (k // QK_K) + b] = np.float32(1.0) / iscale
    return q, d, sums, sums16


@jit(nogil=True)
def _k_rows(x, w, out, kind, vec, xsum, lo, hi):
    """Weight rows ``lo..hi`` of ``out = x @ W^T`` for ``kind`` 4, 5 or 6 (Q4_K, Q5_K, Q6_K);
    ``vec``: the AVX2 path; ``xsum``: the sums of ``x`` per 32-element sub-block."""
    m_rows, k = x.shape
    n = w.shape[0]
    blocks = k // QK_K
    size = w.shape[1] // blocks
    nsub = k // 32
    xf = x.reshape(-1)
    n32 = np.int64(32) + np.int64(0) * n  # a run-time 32: a constant trip count is unrolled, not vectorised
    ds = np.empty(16 * blocks, np.float32)
    dm = np.empty(8 * blocks, np.float32)
    codes = np.empty(QK_K, np.float32)
    acc = np.empty(m_rows * LANES, np.float32)
    # One loop over the rows per kernel, the choice outside it: chosen inside, per row, it cost
    # the Q4_K f32 products of a 125M model 1.2-1.3x their time (K = 768, one thread, in cache).
    if not vec:
        for r in range(lo, hi):
            row = w[r]
            _row_scales(row, kind, size, ds, dm)
            acc[:] = 0.0
            for b in range(blocks):
                _codes_portable(row, b * size, kind, codes, n32)
                _block_portable(codes, ds, 16 if kind == 6 else 32, dm, xf, b * QK_K, k, xsum, b * 8, nsub,
                                acc, m_rows, kind != 6)
            _lanes_out(acc, out, r, m_rows)
    elif kind == 4:
        for r in range(lo, hi):
            q4_k_avx2(w[r], size, blocks, ds, dm, xf, k, xsum, nsub, acc, m_rows)
            _lanes_out(acc, out, r, m_rows)
    elif kind == 5:
        for r in range(lo, hi):
            q5_k_avx2(w[r], size, blocks, ds, dm, xf, k, xsum, nsub, acc, m_rows)
            _lanes_out(acc, out, r, m_rows)
    else:
        for r in range(lo, hi):
            q6_k_avx2(w[r], size, blocks, ds, dm, xf, k, xsum, nsub, acc, m_rows)
            _lanes_out(acc, out, r, m_rows)


@jit(nogil=True, inline="always")
def _lanes_out(acc, out, r, m_rows):
    """Each row's 8 lanes summed (:func:`_lanes_sum`) into column ``r`` of ``out``."""
    for m in range(m_rows):
        out[m, r] = _lanes_sum(acc, LANES * m)


@jit(nogil=True)
def _k_serial(x, w, out, kind, vec, lo, hi):
    _k_rows(x, w, out, kind, vec, block_sums(x, x.shape[1] // 32), lo, hi)


@jit(nogil=True, parallel=True)
def _k_threaded(x, w, out, kind, vec):
    xsum = block_sums(x, x.shape[1] // 32)
    n, chunks = w.shape[0], min(w.shape[0], CHUNKS)
    for c in numba.prange(chunks):
        _k_rows(x, w, out, kind, vec, xsum, c * n // chunks, (c + 1) * n // chunks)


@jit(nogil=True, inline="always")
def _k_q8_lanes(w, at, kind, q8, q8at, sums, sat, codes, sc, mn, isum, imin):
    """:data:`.simd_k.q4_k_q8`'s (and ``q5_k_q8``'s, ``q6_k_q8``'s) lanes of one super-block in
    plain numba: the exact integers into ``isum`` and ``imin``; returns ``d``, ``dmin``."""
    _codes_portable(w, at, kind, codes, np.int64(32))
    for l in range(LANES):
        isum[l] = 0
        imin[l] = 0
    if kind == 6:
        for p in range(8):
            for l in range(LANES):
                e = 32 * p + 4 * l
                part = 0
                for i in range(e, e + 4):  # the stored codes 0..63, as the AVX2 path multiplies them
                    part += (np.int32(codes[i]) + np.int32(32)) * np.int32(q8[q8at + i])
                isum[l] += _i8(w[at + 192 + e // 16]) * part
        for l in range(LANES):
            isum[l] -= 32 * (_i8(w[at + 192 + 2 * l]) * sums[sat + 2 * l] + _i8(w[at + 193 + 2 * l]) * sums[sat + 2 * l + 1])
        return _f16(w[at + 208], w[at + 209]), np.float32(0.0)
    _scale_codes_q45_k(w, at, sc, mn)
    for j in range(8):
        for l in range(LANES):
            e = 32 * j + 4 * l
            part = 0
            for i in range(e, e + 4):
                part += np.int32(codes[i]) * np.int32(q8[q8at + i])
            isum[l] += sc[j] * part
    for l in range(LANES):
        imin[l] = mn[l] * sums[sat + l]
    return _f16(w[at], w[at + 1]), _f16(w[at + 2], w[at + 3])


@jit(nogil=True)
def _k_q8_rows(x, w, out, kind, vec, q8, dx, sums, lo, hi):
    """Weight rows ``lo..hi`` with ``x`` quantized to Q8_K (``q8``, ``dx``, ``sums``): per
    super-block, integer dot products in 8 lanes (exact), then per lane
    ``acc += (d * dx) * isum``, ``acc -= (dmin * dx) * imin`` in f32, block after block, the 8 lanes
    added in one fixed tree at the end (:mod:`.simd_k`'s ``q4_k_q8``; the portable path the same
    operations), for each row of ``x``: the same operations whatever the rows beside it."""
    m_rows, k = x.shape
    blocks = k // QK_K
    size = w.shape[1] // blocks
    per_block = 16 if kind == 6 else 8
    bstep = blocks * per_block
    codes = np.empty(QK_K, np.float32)
    sc = np.empty(8, np.int32)
    mn = np.empty(8, np.int32)
    isum = np.empty(LANES, np.int32)
    imin = np.empty(LANES, np.int32)
    acc = np.empty(m_rows * LANES, np.float32)
    if not vec:  # the choice outside the loops over rows, as in :func:`_k_rows`
        for r in range(lo, hi):
            row = w[r]
            for m in range(m_rows):
                for l in range(LANES):
                    acc[LANES * m + l] = 0.0
                for b in range(blocks):
                    d, dmin = _k_q8_lanes(row, b * size, kind, q8, m * k + b * QK_K, sums, m * bstep + b * per_block,
                                          codes, sc, mn, isum, imin)
                    scale = dx[m * blocks + b]
                    for l in range(LANES):
                        lane = acc[LANES * m + l] + (d * scale) * np.float32(isum[l])
                        if kind != 6:
                            lane = lane - (dmin * scale) * np.float32(imin[l])
                        acc[LANES * m + l] = lane
            _lanes_out(acc, out, r, m_rows)
        return
    for m0 in range(0, m_rows, X_ROWS):  # rows of x that stay in the cache while every weight row passes
        m1 = min(m_rows, m0 + X_ROWS)
        q8m, dxm, sumsm = q8[m0 * k:m1 * k], dx[m0 * blocks:m1 * blocks], sums[m0 * bstep:m1 * bstep]
        if kind == 4:
            for r in range(lo, hi):
                q4_k_q8(w[r], size, blocks, q8m, k, dxm, sumsm, bstep, acc, m1 - m0)
                _lanes_out(acc, out[m0:m1], r, m1 - m0)
        elif kind == 5:
            for r in range(lo, hi):
                q5_k_q8(w[r], size, blocks, q8m, k, dxm, sumsm, bstep, acc, m1 - m0)
                _lanes_out(acc, out[m0:m1], r, m1 - m0)
        else:
            for r in range(lo, hi):
                q6_k_q8(w[r], size, blocks, q8m, k, dxm, sumsm, bstep, acc, m1 - m0)
                _lanes_out(acc, out[m0:m1], r, m1 - m0)


@jit(nogil=True)
def _q8_k(x, kind):
    """``x`` as Q8_K: codes, scales and the code sums ``kind``'s kernels take (of 16 for Q6_K)."""
    q, dx, sums32, sums16 = _quantize_q8_k(x)
    return q, dx, sums16 if kind == 6 else sums32


@jit(nogil=True)
def _k_q8_serial(x, w, out, kind, vec, lo, hi):
    q8, dx, sums = _q8_k(x, kind)
    _k_q8_rows(x, w, out, kind, vec, q8, dx, sums, lo, hi)


@jit(nogil=True, parallel=True)
def _k_q8_threaded(x, w, out, kind, vec):
    q8, dx, sums = _q8_k(x, kind)
    n, chunks = w.shape[0], min(w.shape[0], CHUNKS)
    for c in numba.prange(chunks):
        _k_q8_rows(x, w, out, kind, vec, q8, dx, sums, c * n // chunks, (c + 1) * n // chunks)


@jit(nogil=True, parallel=True)
def _k_threaded_joint(x, vec, w0, out0, kind0, w1, out1, kind1, w2, out2, kind2):
    """Up to three weights' products with one ``x`` in one launch (registry.JOINT), ``x``'s sums once."""
    xsum = block_sums(x, x.shape[1] // 32)
    n0, n1, n2 = w0.shape[0], w1.shape[0], w2.shape[0]
    c0, c1, c2 = joint_chunks(n0, n1, n2)
    for c in numba.prange(c0 + c1 + c2):
        slot, lo, hi = joint_part(c, c0, c1, c2, n0, n1, n2)
        if slot == 0:
            _k_rows(x, w0, out0, kind0, vec, xsum, lo, hi)
        elif slot == 1:
            _k_rows(x, w1, out1, kind1, vec, xsum, lo, hi)
        else:
            _k_rows(x, w2, out2, kind2, vec, xsum, lo, hi)


@jit(nogil=True, parallel=True)
def _k_q8_threaded_joint(x, vec, w0, out0, kind0, w1, out1, kind1, w2, out2, kind2):
    """As :func:`_k_threaded_joint`, ``x`` quantized to Q8_K once."""
    q8, dx, sums32, sums16 = _quantize_q8_k(x)
    n0, n1, n2 = w0.shape[0], w1.shape[0], w2.shape[0]
    c0, c1, c2 = joint_chunks(n0, n1, n2)
    for c in numba.prange(c0 + c1 + c2):
        slot, lo, hi = joint_part(c, c0, c1, c2, n0, n1, n2)
        if slot == 0:
            _k_q8_rows(x, w0, out0, kind0, vec, q8, dx, sums16 if kind0 == 6 else sums32, lo, hi)
        elif slot == 1:
            _k_q8_rows(x, w1, out1, kind1, vec, q8, dx, sums16 if kind1 == 6 else sums32, lo, hi)
        else:
            _k_q8_rows(x, w2, out2, kind2, vec, q8, dx, sums16 if kind2 == 6 else sums32, lo, hi)


#: Each driver prepares ``x`` (its sub-block sums, or its Q8_K quantization) in its own compiled
#: call: a separate call returning the arrays to Python cost ~2 us a product.
_F32, _Q8 = Drivers(_k_serial, _k_threaded), Drivers(_k_q8_serial, _k_q8_threaded)


#: A K-quant weight byte costs the threading threshold (registry.SERIAL_BYTES) this many F32 bytes:
#: these kernels are compute-bound (one thread in cache: Q4_K 6.5 GB/s with f32 activations, 10.9
#: with Q8_K, against 24.5 for F32), so a 768 x 768 Q4_K product (0.33 MB) pays for two threads:
#: in a Q4_K_M decode step 52 us against 88 on one thread (Q8_K activations), 65 against 110 (f32).
COST = 4


def linear_k(x: np.ndarray, w: np.ndarray, out: np.ndarray, kind: int, vec: bool, q8: bool = False) -> None:
    """``out = x @ W^T`` for ``kind`` 4, 5 or 6 (Q4_K, Q5_K, Q6_K), on the AVX2 path (``vec``) or
    the portable one, with f32 or (``q8``) Q8_K activations."""
    run(_Q8 if q8 else _F32, w.nbytes * x.shape[0] * COST, (x, w, out, kind, vec), w.shape[0])


_KINDS = {DType.Q4_K: 4, DType.Q5_K: 5, DType.Q6_K: 6}


def _joint(q8: bool, x: np.ndarray, ws: list, outs: list, kinds: list) -> None:
    """Two or three K-quant products with one ``x`` in one launch; alone when small."""
    if serial(sum(w.nbytes for w in ws) * x.shape[0] * COST) or len(ws) > 3:
        for w, out, kind in zip(ws, outs, kinds):
            linear_k(x, w, out, kind, cpu.AVX2, q8)
        return
    driver = _k_q8_threaded_joint if q8 else _k_threaded_joint
    driver(x, cpu.AVX2, *joint_slots(ws, outs, kinds, 4))


_JOINTS = {q8: functools.partial(_joint, q8) for q8 in (False, True)}


def route(dtype: DType, q8: bool) -> Route:
    """The product table's route of a K-quant with f32 or (``q8``) Q8_K activations."""
    kind = _KINDS[dtype]
    path = "vector" if cpu.AVX2 else "portable"
    return Route(KQUANTS, kind, "q8_0" if q8 else "f32",
                 lambda x, w, out: linear_k(x, w, out, kind, cpu.AVX2, q8), _JOINTS[q8],
                 f"{dtype.name} super-blocks, {'integer dots of Q8_K activations' if q8 else 'f32 lanes'} ({path} path)")
