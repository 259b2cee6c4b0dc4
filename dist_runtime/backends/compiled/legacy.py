"""Kernels of the GGML legacy block types Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (layouts: kernels/quant.py).

Threads take output rows ``n`` (``prange``); each weight row is read once, block by block, for all
rows of ``x`` (q8_0 activations of more than a few rows: once per tile of ``x``, from L2, a span
of weight rows at a time: :data:`.registry.WEIGHT_SPAN_BYTES`).  On the vector path
(``cpu.AVX2``) a :mod:`.simd_int8` intrinsic runs a whole weight row against a tile of rows of
``x`` (f32: 8 rows where the CPU has 32 vector registers, then 4, then one at a time; q8_0: 4,
then one, one call taking a span of weight rows), each block decoded once per tile (a span of
many rows on the 256-bit path: once for all tiles, :data:`.registry.DECODED_SPAN_BYTES`); the
portable path decodes each block once for all rows into a small scratch and runs plain loops
(block length passed at run time so that numba does not unroll them): a fallback, measured 10-20x
slower than the vector path here.  Both keep, for every ``(m, n)``, one fixed sequence of
operations whatever ``M``: bitwise batch-invariant.

Activations (``q8``):

- f32 (default): per block, its centred codes times ``x`` summed in 8 fixed lanes, then scaled
  by the block's ``d`` into the row's lanes (Q4_1 / Q5_1: plus ``m`` times the block's sum of
  ``x``, :func:`.registry.block_sums`, into one more sum).  Except Q8_0, whose element
  ``code * d`` is exact in f32: it runs F32's tiles (:mod:`.floats`), which share each decoded
  piece among 8 rows of ``x`` and 3 weight rows where this per-block formula takes one weight row
  at a time (the 125M model's products at M = 8: 0.67x the time; at M = 1 0.91x).
- q8_0: each 32-block of each row of ``x`` is quantized once per call, in compiled code, as
  llama.cpp's ``quantize_row_q8_0`` (and ``kernels.quant.quantize``): ``d = max|x| / 127``,
  codes ``roundf(x * (1 / d))``, ``d`` kept as f16; Q4_1 and Q5_1 also take Q8_1's block sum
  ``s = f16(d * sum(codes))``; a block holding a NaN gets ``d`` NaN (its row's results NaN).  The
  exact integer dots of ggml's ``vec_dot_*_q8_0`` / ``_q8_1`` stay in 16 lanes of 8 elements
  (block ``b`` in lanes ``4 (b % 4) ..``), scaled into f32 lanes block by block,
  ``lane += (d_w * d_x) * sumi``, the lanes folded in halves at the end; the affine formats add
  ``m_w * s_x`` into four sums (by ``b % 4``) folded likewise and added after
  (:func:`.simd_int8.q8_rows`; the portable path the same operations;
  tests/test_compiled_legacy.py holds the formula bit for bit).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np

from ...dtypes import DType
from ...kernels.quant import QK, _LEGACY
from . import cpu
from .cache import jit
from .registry import (CHUNKS, DECODED_SPAN_BYTES, LEGACY, SPAN_MIN_ROWS, WEIGHT_SPAN_BYTES, Drivers, Route,
                       block_sums, joint_chunks, joint_part, joint_slots, run, serial)
from .simd_int8 import FORMATS, GROUP, GROUP_BYTES, LANES, centre, unsigned_centre

#: per format code: bits, centre, byte offset of the codes, affine (0/1), block bytes.
_SPEC = np.array([[_LEGACY[d].bits, centre(_LEGACY[d]), _LEGACY[d].scales + _LEGACY[d].high_bits,
                   _LEGACY[d].affine, d.block_bytes] for d in FORMATS.values()], np.int64)
#: per format code: what the vector path's unsigned codes carry (the quantizer folds it into ``xn``).
_XCENTRE = np.array([unsigned_centre(_LEGACY[d]) for d in FORMATS.values()], np.int64)
#: f16 exponent e (1..30) -> 2^(e - 25): a normal half is (1024 + mantissa) * that, exactly.
_POW2 = np.array([2.0 ** (e - 25) for e in range(32)], np.float32)


@jit(nogil=True)
def _f16(lo, hi):
    h = np.int32(lo) | np.int32(hi) << np.int32(8)
    e, f = h >> np.int32(10) & np.int32(31), h & np.int32(1023)
    if e == 0:
        v = np.float32(f) * np.float32(2.0 ** -24)
    elif e == 31:
        v = np.float32(np.inf) if f == 0 else np.float32(np.nan)
    else:
        v = np.float32(f + np.int32(1024)) * _POW2[e]
    return -v if h & np.int32(0x8000) else v


@jit(nogil=True)
def _codes(row, at, fmt, qk, q):
    """Block ``row[at:]``'s codes into int32 ``q``: signed for Q8_0, unsigned otherwise."""
    bits, head = _SPEC[fmt, 0], _SPEC[fmt, 2]
    if bits == 8:
        for j in range(qk):
            q[j] = np.int32(np.int8(row[at + head + j]))
        return
    half = qk // 2
    for j in range(half):
        byte = np.int32(row[at + head + j])
        q[j], q[j + half] = byte & np.int32(15), byte >> np.int32(4)
    if bits == 5:  # the little-endian u32 qh just before the nibbles: bit j = fifth bit of element j
        qh = np.int64(0)
        for i in range(4):
            qh |= np.int64(row[at + head - 4 + i]) << np.int64(8 * i)
        for j in range(qk):
            q[j] |= np.int32(qh >> np.int64(j) & np.int64(1)) << np.int32(4)


@jit(nogil=True)
def _lanes_sum(a):
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))


@jit(nogil=True)
def _f32_portable(x, xsum, w, out, fmt, qk, lo, hi):
    """:func:`.simd_int8.f32_rows`' arithmetic in plain loops, multiplies and adds unfused: per
    block and row each lane's centred codes times ``x``, then ``lane += d * part``; the affine
    formats' ``m * sum(x block)`` (``xsum``) into one more sum, added after the lanes."""
    m_rows, nb = x.shape[0], x.shape[1] // qk
    step, shift, affine = _SPEC[fmt, 4], np.float32(_SPEC[fmt, 1]), _SPEC[fmt, 3]
    q, v = np.empty(qk, np.int32), np.empty(qk, np.float32)
    acc, mins = np.empty((m_rows, 8), np.float32), np.empty(m_rows, np.float32)
    for n in range(lo, hi):
        row = w[n]
        acc[:] = 0
        mins[:] = 0
        for b in range(nb):
            at = b * step
            _codes(row, at, fmt, qk, q)
            d = _f16(row[at], row[at + 1])
            low = _f16(row[at + 2], row[at + 3]) if affine else np.float32(0)
            for j in range(qk):
                v[j] = np.float32(q[j]) - shift
            for m in range(m_rows):
                lanes, xb = acc[m], x[m, b * qk:(b + 1) * qk]
                for lane in range(8):
                    part = v[lane] * xb[lane]
                    for j in range(8, qk, 8):
                        part += v[j + lane] * xb[j + lane]
                    lanes[lane] += d * part
                if affine:
                    mins[m] += low * xsum[m * nb + b]
        for m in range(m_rows):
            out[m, n] = _lanes_sum(acc[m]) + mins[m] if affine else _lanes_sum(acc[m])


@jit(nogil=True, inline="always")
def _grouped(b, j):
    """Where element ``j`` of block ``b`` sits in a row of the grouped codes (``xp``, 4 * 32 a
    group of 4 blocks: elements 0-15 of each, then 16-31 of each)."""
    return b // GROUP * GROUP_BYTES + j // 16 * (GROUP_BYTES // 2) + b % GROUP * 16 + j % 16


@jit(nogil=True)
def _fold(a):
    """The lanes of ``a`` (a power of two of them) summed as :func:`.simd.hsum` sums them: lane i
    plus lane i + n/2, halving down to one.  In place: ``a`` is left holding partial sums."""
    n = a.shape[0]
    while n > 1:
        n //= 2
        for i in range(n):
            a[i] = a[i] + a[i + n]
    return a[0]


@jit(nogil=True)
def _q8_portable(xp, xn, xd, xs, w, out, fmt, qk, lo, hi):
    """:func:`.simd_int8.q8_rows`' lanes in plain loops: the same operations, the same bits."""
    m_rows, step, affine = xp.shape[0], _SPEC[fmt, 4], _SPEC[fmt, 3]
    nb, shift = w.shape[1] // step, np.int32(_SPEC[fmt, 1])
    q, acc, mins = np.empty(qk, np.int32), np.empty((m_rows, LANES), np.float32), np.empty((m_rows, GROUP), np.float32)
    for n in range(lo, hi):
        row = w[n]
        acc[:] = 0
        mins[:] = 0
        for b in range(nb):
            at, g, h = b * step, b // GROUP, b % GROUP
            _codes(row, at, fmt, qk, q)
            dw = _f16(row[at], row[at + 1])
            mw = _f16(row[at + 2], row[at + 3]) if affine else np.float32(0)
            for m in range(m_rows):
                for lane in range(4):  # elements 4 lane .. + 3 of each half of the block
                    sumi = np.int32(0)
                    for half in range(0, qk, 16):
                        for j in range(half + 4 * lane, half + 4 * lane + 4):
                            sumi += (q[j] - shift) * np.int32(xp[m, _grouped(b, j)])
                    acc[m, 4 * h + lane] += (dw * xd[m, g * LANES + 4 * h + lane]) * np.float32(sumi)
                if affine:
                    mins[m, h] += mw * xs[m, GROUP * g + h]
        for m in range(m_rows):
            out[m, n] = _fold(acc[m]) + _fold(mins[m]) if affine else _fold(acc[m])


@jit(nogil=True)
def _to_f16(v):
    """``v`` (f32) rounded to the nearest f16, ties to even, as ``GGML_FP32_TO_FP16`` (f64 holds
    every step exactly)."""
    a = abs(np.float64(v))
    if not a < np.inf or a == 0.0:
        return v
    if a < 2.0 ** -14:  # subnormal halves: multiples of 2^-24
        r = np.rint(a * 2.0 ** 24) * 2.0 ** -24
    else:
        mant, e = math.frexp(a)
        r = math.ldexp(np.rint(math.ldexp(mant, 11)), e - 11)
    r = np.inf if r > 65504.0 else r
    return np.float32(r if v > 0 else -r)


@jit(nogil=True)  # one thread: a parallel launch costs more than it saves
def _quantize_rows(x, qk, c, xp, xn, xd, xs):
    """:func:`_quantized`'s arrays in scalar code: the portable path's, and the definition that
    the vector path's :func:`.simd_int8.quantize_row` is tested against."""
    for m in range(x.shape[0]):
        for b in range(x.shape[1] // qk):
            amax = np.float32(0)
            for j in range(b * qk, (b + 1) * qk):
                a = abs(x[m, j])
                if amax == amax and not a <= amax:  # a NaN stays: the block's d, and its row's results, NaN
                    amax = a
            d = amax / np.float32(127)
            inv = np.float32(1) / d if d != 0 else np.float32(0)
            total, g, h = np.int32(0), b // GROUP, b % GROUP
            finite = abs(d) < np.inf  # else codes 0 (not whatever a NaN converts to): the results are NaN anyway
            for j in range(qk):
                v = np.float64(x[m, b * qk + j] * inv)  # roundf: half away from zero, exact in f64
                q = np.int32(np.trunc(v + np.copysign(0.5, v))) if finite else np.int32(0)
                xp[m, _grouped(b, j)] = q
                total += q
            for lane in range(4):  # as :func:`_q8_portable`'s lanes: 4 lane .. + 3 of each half
                part = np.int32(0)
                for half in range(0, qk, 16):
                    for j in range(half + 4 * lane, half + 4 * lane + 4):
                        part += np.int32(xp[m, _grouped(b, j)])
                xn[m, g * LANES + 4 * h + lane] = -np.int32(c) * part
                xd[m, g * LANES + 4 * h + lane] = _to_f16(d)
            xs[m, GROUP * g + h] = _to_f16(np.float32(total) * d)


@jit(nogil=True)
def _quantized(x, qk, c):
    """``x`` f32 [M, K] quantized per 32-block as llama.cpp's ``quantize_row_q8_1_ref`` makes it
    (Q8_0 is the same without ``s``): ``d = max|x| / 127``, codes ``roundf(x * (1 / d))``, ``d``
    as f16, ``s = f16(d * sum(codes))`` with the f32 ``d``; laid out by groups of 4 blocks
    for :func:`.simd_int8.q8_rows` (its docstring: ``xp``, ``xn``, ``xd``, ``xs``; ``xn`` for a
    weight whose unsigned codes carry ``c``, :data:`_XCENTRE`), a last group's missing blocks all
    zeros.  In the product's own compiled call: a separate one, and its arrays made in
    Python, cost 3-4 us a product (85 a 125M model's token)."""
    m, k = x.shape
    groups = (k // qk + GROUP - 1) // GROUP
    xp, xn = np.zeros((m, groups * GROUP_BYTES), np.int8), np.zeros((m, groups * LANES), np.int32)
    xd, xs = np.zeros((m, groups * LANES), np.float32), np.zeros((m, groups * GROUP), np.float32)
    _quantize_all(x, qk, c, xp, xn, xd, xs)  # the path's own: below
    return xp, xn, xd, xs


if cpu.AVX2:
    from .simd_int8 import DECODED_GROUP, TILES, decode_pairs, f32_rows, q8_rows, quantize_row

    _F32_EIGHT, _F32_FOUR, _F32_ONE = f32_rows(8), f32_rows(4), f32_rows(1)
    #: Tiles of 8 rows of ``x`` where 32 vector registers hold their accumulators: the 125M
    #: model's shapes (K = 768, M = 8 and 16), one thread, in cache, 0.87-0.93x the time of tiles
    #: of 4 on Q8_0 / Q4_0, no different on Q4_1 or at K = 4096.
    _EIGHTS = cpu.REGISTERS >= 32
    _Q8_ROWS = q8_rows(cpu.WIDE)
    _Q8_DECODED = q8_rows(False, decoded=True)

    @jit(nogil=True)
    def _quantize_all(x, _qk, c, xp, xn, xd, xs):
        """:func:`_quantize_rows`' arrays, a block at a time in vectors (4096 elements: ~5 us with
        the arrays' allocation, 33 in scalar code)."""
        for r in range(x.shape[0]):
            quantize_row(x, r, c, xp, xn, xd, xs)

    @jit(nogil=True)
    def _f32_avx2(x, xsum, w, out, fmt, qk, lo, hi):
        m_rows, nb = x.shape[0], x.shape[1] // qk
        for n in range(lo, hi):
            m = 0
            if _EIGHTS:
                while m + 8 <= m_rows:
                    _F32_EIGHT(w, x, xsum, out, n, m, nb, fmt)
                    m += 8
            while m + 4 <= m_rows:
                _F32_FOUR(w, x, xsum, out, n, m, nb, fmt)
                m += 4
            while m < m_rows:
                _F32_ONE(w, x, xsum, out, n, m, nb, fmt)
                m += 1

    #: Rows of ``x`` in a tile of a product of many rows: :func:`q8_rows`' largest.
    _X_TILE = TILES[0]

    @jit(nogil=True)
    def _q8_avx2(xp, xn, xd, xs, w, out, fmt, _qk, lo, hi):  # _qk: the portable signature
        """Weight rows ``lo..hi`` against every row of ``x``; more than :data:`SPAN_MIN_ROWS` rows
        in spans of weight rows (:data:`WEIGHT_SPAN_BYTES`; on the 256-bit path
        :data:`DECODED_SPAN_BYTES` of them decoded by :func:`.simd_int8.decode_pairs`, which each
        tile then loads), each span against one tile of ``x`` after another.
        Every (m, n) is the same operations on the same values whatever the order."""
        m = xp.shape[0]
        if m <= SPAN_MIN_ROWS:
            _Q8_ROWS(w, xp, xn, xd, xs, out, lo, hi, fmt)
            return
        if cpu.WIDE:
            span = max(_X_TILE, WEIGHT_SPAN_BYTES // w.shape[1])
            for n0 in range(lo, hi, span):
                n1 = min(hi, n0 + span)
                for m0 in range(0, m, _X_TILE):
                    m1 = min(m, m0 + _X_TILE)
                    _Q8_ROWS(w, xp[m0:m1], xn[m0:m1], xd[m0:m1], xs[m0:m1], out[m0:m1], n0, n1, fmt)
            return
        row_bytes = xp.shape[1] // GROUP_BYTES * DECODED_GROUP
        span = max(_X_TILE, DECODED_SPAN_BYTES // row_bytes)
        decoded = np.empty((min(span, hi - lo), row_bytes), np.uint8)
        for n0 in range(lo, hi, span):
            n1 = min(hi, n0 + span)
            decode_pairs(w, decoded, n0, n1, fmt)
            for m0 in range(0, m, _X_TILE):
                m1 = min(m, m0 + _X_TILE)
                _Q8_DECODED(decoded, xp[m0:m1], xn[m0:m1], xd[m0:m1], xs[m0:m1], out[m0:m1], n0, n1, fmt)


    @jit(nogil=True)
    def _q8_avx2_serial(x, w, out, fmt, qk, lo, hi):
        xp, xn, xd, xs = _quantized(x, qk, _XCENTRE[fmt])
        _q8_avx2(xp, xn, xd, xs, w, out, fmt, qk, lo, hi)

    @jit(nogil=True, parallel=True)
    def _q8_avx2_threaded(x, w, out, fmt, qk):
        xp, xn, xd, xs = _quantized(x, qk, _XCENTRE[fmt])
        n, chunks = w.shape[0], min(w.shape[0], CHUNKS)
        for c in numba.prange(chunks):
            _q8_avx2(xp, xn, xd, xs, w, out, fmt, qk, c * n // chunks, (c + 1) * n // chunks)

    _Q8 = Drivers(_q8_avx2_serial, _q8_avx2_threaded)
    _f32_rows, _q8_rows = _f32_avx2, _q8_avx2
else:
    _quantize_all = _quantize_rows

    @jit(nogil=True)
    def _q8_portable_serial(x, w, out, fmt, qk, lo, hi):
        xp, xn, xd, xs = _quantized(x, qk, _XCENTRE[fmt])
        _q8_portable(xp, xn, xd, xs, w, out, fmt, qk, lo, hi)

    @jit(nogil=True, parallel=True)
    def _q8_portable_threaded(x, w, out, fmt, qk):
        xp, xn, xd, xs = _quantized(x, qk, _XCENTRE[fmt])
        n, chunks = w.shape[0], min(w.shape[0], CHUNKS)
        for c in numba.prange(chunks):
            _q8_portable(xp, xn, xd, xs, w, out, fmt, qk, c * n // chunks, (c + 1) * n // chunks)

    _Q8 = Drivers(_q8_portable_serial, _q8_portable_threaded)
    _f32_rows, _q8_rows = _f32_portable, _q8_portable


@jit(nogil=True)
def _f32_serial(x, w, out, fmt, qk, lo, hi):
    _f32_rows(x, block_sums(x, x.shape[1] // qk), w, out, fmt, qk, lo, hi)


@jit(nogil=True, parallel=True)
def _f32_threaded(x, w, out, fmt, qk):
    xsum = block_sums(x, x.shape[1] // qk)
    n, chunks = w.shape[0], min(w.shape[0], CHUNKS)
    for c in numba.prange(chunks):
        _f32_rows(x, xsum, w, out, fmt, qk, c * n // chunks, (c + 1) * n // chunks)


_F32 = Drivers(_f32_serial, _f32_threaded)


@jit(nogil=True, parallel=True)
def _f32_joint(x, qk, w0, out0, fmt0, w1, out1, fmt1, w2, out2, fmt2):
    """Up to three weights' products with one ``x`` in one launch (registry.JOINT)."""
    xsum = block_sums(x, x.shape[1] // qk)
    n0, n1, n2 = w0.shape[0], w1.shape[0], w2.shape[0]
    c0, c1, c2 = joint_chunks(n0, n1, n2)
    for c in numba.prange(c0 + c1 + c2):
        slot, lo, hi = joint_part(c, c0, c1, c2, n0, n1, n2)
        if slot == 0:
            _f32_rows(x, xsum, w0, out0, fmt0, qk, lo, hi)
        elif slot == 1:
            _f32_rows(x, xsum, w1, out1, fmt1, qk, lo, hi)
        else:
            _f32_rows(x, xsum, w2, out2, fmt2, qk, lo, hi)


@jit(nogil=True)
def _quantized_for(x, qk, fmt0, fmt1, fmt2):
    """``x`` quantized once for up to three weights of formats ``fmt0..2``: :func:`_quantized`'s
    ``xp, xd, xs`` and each weight's ``xn`` (the lane sums scaled by its centre)."""
    xp, xn, xd, xs = _quantized(x, qk, 1)
    xn0 = (xn * np.int32(_XCENTRE[fmt0])).astype(np.int32)
    xn1 = (xn * np.int32(_XCENTRE[fmt1])).astype(np.int32)
    xn2 = (xn * np.int32(_XCENTRE[fmt2])).astype(np.int32)
    return xp, xn0, xn1, xn2, xd, xs


@jit(nogil=True, parallel=True)
def _q8_joint(x, qk, w0, out0, fmt0, w1, out1, fmt1, w2, out2, fmt2):
    """As :func:`_f32_joint`, ``x`` quantized once (:func:`_quantized_for`)."""
    xp, xn0, xn1, xn2, xd, xs = _quantized_for(x, qk, fmt0, fmt1, fmt2)
    n0, n1, n2 = w0.shape[0], w1.shape[0], w2.shape[0]
    c0, c1, c2 = joint_chunks(n0, n1, n2)
    for c in numba.prange(c0 + c1 + c2):
        slot, lo, hi = joint_part(c, c0, c1, c2, n0, n1, n2)
        if slot == 0:
            _q8_rows(xp, xn0, xd, xs, w0, out0, fmt0, qk, lo, hi)
        elif slot == 1:
            _q8_rows(xp, xn1, xd, xs, w1, out1, fmt1, qk, lo, hi)
        else:
            _q8_rows(xp, xn2, xd, xs, w2, out2, fmt2, qk, lo, hi)


_CODES = {dtype: code for code, dtype in FORMATS.items()}


def _product(q8: bool, x: np.ndarray, w: np.ndarray, out: np.ndarray, code: int) -> None:
    run(_Q8 if q8 else _F32, w.nbytes * x.shape[0], (x, w, out, code, QK), w.shape[0])


def _joint(q8: bool, x: np.ndarray, ws: list, outs: list, codes: list) -> None:
    """Two or three legacy-block products with one ``x`` in one launch; alone when small."""
    if serial(sum(w.nbytes for w in ws) * x.shape[0]) or len(ws) > 3:
        for w, out, code in zip(ws, outs, codes):
            _product(q8, x, w, out, code)
        return
    (_q8_joint if q8 else _f32_joint)(x, QK, *joint_slots(ws, outs, codes, 0))


_JOINTS = {q8: functools.partial(_joint, q8) for q8 in (False, True)}


def route(dtype: DType, q8: bool) -> Route:
    """The product table's route of a legacy block type with f32 or (``q8``) Q8_0 activations."""
    code = _CODES[dtype]
    path = "vector" if cpu.AVX2 else "portable"
    return Route(LEGACY, code, "q8_0" if q8 else "f32",
                 lambda x, w, out: _product(q8, x, w, out, code), _JOINTS[q8],
                 f"{dtype.name} blocks, {'integer dots of q8_0 activations' if q8 else 'f32 lanes'} ({path} path)")
