"""Weight formats: float conversions, GGML block codecs, and ``x @ w^T`` on a weight of any format.

A weight is an ``np.ndarray`` (F32, F16, BF16, F64) or a :class:`QuantizedArray` of raw GGML blocks
(docs/ops.md, "Element types").  The GGML legacy block formats share one layout, along the last dim,
32 elements per block::

    Q4_0  f16 d,           16 B nibbles        x = d * (q - 8)
    Q4_1  f16 d, f16 m,    16 B nibbles        x = d * q + m
    Q5_0  f16 d,  4 B qh,  16 B nibbles        x = d * (q - 16)
    Q5_1  f16 d, f16 m, 4 B qh, 16 B nibbles   x = d * q + m
    Q8_0  f16 d,           32 B int8           x = d * q

Byte j of the nibbles holds element j in its low nibble and element j + 16 in its high nibble;
bit j of the little-endian u32 ``qh`` is the fifth bit of element j.  The K-quants Q2_K..Q8_K
(256 elements per block, in sub-blocks with their own small scales) are decoded too.

Decoding is bit-exact with GGML's ``dequantize_row_*`` (as ``gguf.quants.dequantize``), encoding
with ``quantize_row_*_ref`` (as ``gguf.quants.quantize``): the tests hold both against the ``gguf``
package, which this module does not import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes

import numpy as np

from dist_runtime.dtypes import DType
from dist_runtime.ir.ops import Dequantize, KvCompress, KvDecompress, Quantize, TokenEmbed
from dist_runtime.tensor import Array, QuantizedArray

from ._common import F32, F64, as_compute, axis, cast_back, compute_dtype, fail
from .registry import register

QK = 32  # elements per block of the legacy formats


# -- the legacy block formats -------------------------------------------------------------------
@dataclass(frozen=True)
class _Legacy:
    """How one legacy format packs a block: code width and whether it carries a min (``_1``)."""

    bits: int  # 4, 5 or 8
    affine: bool  # True: x = d * q + m (q unsigned); False: x = d * (q - offset) (q centred)

    @property
    def scales(self) -> int:
        """Bytes of f16 header: d, and m for the affine formats."""
        return 4 if self.affine else 2

    @property
    def high_bits(self) -> int:
        """Bytes of ``qh`` (the fifth bits of a 5-bit format)."""
        return 4 if self.bits == 5 else 0

    @property
    def offset(self) -> int:
        """What a symmetric format subtracts from its unsigned code (Q8_0 stores signed codes)."""
        return 0 if self.bits == 8 else 1 << (self.bits - 1)


_LEGACY = {
    DType.Q4_0: _Legacy(4, False),
    DType.Q4_1: _Legacy(4, True),
    DType.Q5_0: _Legacy(5, False),
    DType.Q5_1: _Legacy(5, True),
    DType.Q8_0: _Legacy(8, False),
}
#: Block types ``quantize`` produces (Quantize and KvCompress use Q8_0 and Q4_0).
QUANTIZABLE = tuple(_LEGACY)


_F16_SCALE = np.float32(2.0**112)  # 2^(127 - 15): f32 exponent bias minus f16's
_F16_MAX = 65504.0


def f16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    """Exact f32 values of f16 bit patterns ``h`` (uint16).

    numpy's own f16 -> f32 cast is a scalar loop on this build, ~2.5 ns an element; this takes
    ~1.  Sign-extended to int32 and shifted, the f16 sign lands on the f32 sign bit and the
    exponent and mantissa in f32 position; scaling by 2^112 then rebiases the exponent, exactly
    for normal and subnormal halves alike.  Infinities and NaNs (exponent all ones) come out of
    that as |y| >= 2^16 > the largest finite f16, and are rebuilt (rare in weights).
    """
    u = h.view(np.int16).astype(np.int32).view(np.uint32)
    u <<= np.uint32(13)
    u &= np.uint32(0x8FFFE000)  # sign, exponent, mantissa; the sign extension cleared
    y = u.view(F32)
    y *= _F16_SCALE
    if y.size and max(y.max(), -y.min()) > _F16_MAX:
        special = np.abs(y) > _F16_MAX
        bits = h[special].astype(np.uint32)
        u[special] = (bits & 0x8000) << 16 | np.uint32(0x7F800000) | (bits & 0x3FF) << 13
    return y


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian f16 at byte ``at`` of each block, as f32 ``[..., nb, 1]``: read in place
    through a 2-byte view with the blocks' stride (no gather of 2-byte runs) and numpy's cast,
    which on these short arrays beats ``f16_bits_to_f32``'s several calls."""
    return blocks[..., at : at + 2].view("<f2").astype(F32)


def _codes(blocks: np.ndarray, fmt: _Legacy) -> np.ndarray:
    """The 32 codes of each block: int8 centred (``q - offset``) or uint8 for affine formats."""
    body = blocks[..., fmt.scales + fmt.high_bits :]
    if fmt.bits == 8:
        return body.view(np.int8)
    q = np.empty(body.shape[:-1] + (QK,), np.uint8)
    np.bitwise_and(body, 0x0F, out=q[..., : QK // 2])
    np.right_shift(body, 4, out=q[..., QK // 2 :])
    if fmt.bits == 5:
        qh = blocks[..., fmt.scales : fmt.scales + 4]
        q |= np.unpackbits(qh, axis=-1, bitorder="little") << np.uint8(4)
    if fmt.affine:
        return q
    q -= np.uint8(fmt.offset)  # wraps mod 256 ...
    return q.view(np.int8)  # ... so as int8 it is exactly q - offset


def _decode_legacy(blocks: np.ndarray, fmt: _Legacy) -> np.ndarray:
    """f32 ``[..., nb, 32]`` from uint8 blocks ``[..., nb, block_bytes]`` (GGML ``dequantize_row_*``)."""
    d = _half(blocks, 0)
    y = np.multiply(_codes(blocks, fmt), d, dtype=F32)  # one rounding, as GGML's d * q
    if fmt.affine:
        y += _half(blocks, 2)
    return y


def _roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: half away from zero.  ``floor(|v| + 0.5)`` would round 0.49999997 up; the
    fractional part ``|v| - floor(|v|)`` is exact, so compare it instead."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.copysign(whole + (a - whole >= 0.5), v)


def _encode_legacy(x: np.ndarray, fmt: _Legacy) -> np.ndarray:
    """uint8 blocks ``[..., nb, block_bytes]`` from f32 ``[..., nb, 32]`` (GGML ``quantize_row_*_ref``).

    As GGML, codes use the f32 scale ``d`` through its reciprocal ``id = 1/d`` (0 when d = 0),
    and the block stores ``d`` rounded to f16.
    """
    levels = (1 << fmt.bits) - 1
    if fmt.bits == 8:
        d = np.abs(x).max(axis=-1, keepdims=True) / 127.0
    elif fmt.affine:
        lo = x.min(axis=-1, keepdims=True)
        d = (x.max(axis=-1, keepdims=True) - lo) / float(levels)
    else:  # the element of largest magnitude, sign kept (the first one on a tie, as GGML's loop)
        big = np.take_along_axis(x, np.abs(x).argmax(axis=-1, keepdims=True), axis=-1)
        d = big / float(-fmt.offset)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = np.where(d == 0.0, np.float32(0.0), np.float32(1.0) / d)
        if fmt.bits == 8:
            body = _roundf(x * inv).astype(np.int8).view(np.uint8)
        else:
            shifted = (x - lo) * inv + 0.5 if fmt.affine else x * inv + (fmt.offset + 0.5)
            q = np.minimum(np.trunc(shifted), float(levels)).astype(np.uint8)  # >= 0 by construction
            body = q[..., : QK // 2] & np.uint8(0x0F) | q[..., QK // 2 :] << np.uint8(4)
    parts = [d.astype(np.float16).view(np.uint8)]
    if fmt.affine:
        parts.append(lo.astype(np.float16).view(np.uint8))
    if fmt.bits == 5:
        parts.append(np.packbits(q >> np.uint8(4), axis=-1, bitorder="little"))
    parts.append(body)
    return np.concatenate(parts, axis=-1)


# -- the K-quants (decode only) -----------------------------------------------------------------
# Layouts of GGML's block_q*_K (ggml-common.h), 256 elements per block; the comments give the
# element order of dequantize_row_q*_K in ggml-quants.c.  Blocks arrive as [..., nb, bytes].
QK_K = 256


def _split(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    """Consecutive byte fields of each block."""
    return np.split(blocks, np.cumsum(sizes)[:-1], axis=-1)


def _crumbs(b: np.ndarray, width: int) -> np.ndarray:
    """Each byte's fields of ``width`` bits, lowest first, as a new axis before the last:
    ``[..., n] -> [..., 8 // width, n]``."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    return (b[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K ``get_scale_min_k4``: 8 six-bit scales and mins from 12 bytes, as f32 [..., 8, 1].

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low nibbles of scales 4-7 and (high nibbles) of mins 4-7.
    """
    lo, hi, mix = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | (lo >> 6) << 4], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | (hi >> 6) << 4], axis=-1)
    return sc[..., None].astype(F32), mn[..., None].astype(F32)


def _decode_q2_k(blocks: np.ndarray) -> np.ndarray:
    """scales[16] (4-bit scale | 4-bit min), qs[64] (2-bit), f16 d, f16 dmin.  Element
    128 h + 32 j + l is bits 2j..2j+1 of qs[32 h + l]; sub-block of 16 e has scales[e // 16]."""
    scales, qs, d, dmin = _split(blocks, 16, 64, 2, 2)
    lead = blocks.shape[:-1]
    q = _crumbs(qs.reshape(*lead, 2, 32), 2).reshape(*lead, 16, 16)
    dl = _half(d, 0)[..., None] * (scales & 0x0F)[..., None]
    ml = _half(dmin, 0)[..., None] * (scales >> 4)[..., None]
    return (dl * q - ml).reshape(*lead, QK_K)


def _decode_q3_k(blocks: np.ndarray) -> np.ndarray:
    """hmask[32], qs[64] (2-bit), scales[12] (16 six-bit, offset 32), f16 d.  Element
    128 h + 32 j + l: low bits 2j.. of qs[32 h + l], high bit 4h + j of hmask[l] (set: +0, clear:
    -4); sub-scale e // 16 has its low nibble in byte i % 8 (high nibble when i >= 8) and its top
    2 bits at 2 (i // 4) of byte 8 + i % 4."""
    hmask, qs, scales, d = _split(blocks, 32, 64, 12, 2)
    lead = blocks.shape[:-1]
    low = _crumbs(qs.reshape(*lead, 2, 32), 2).reshape(*lead, 16, 16).view(np.int8)
    high = _crumbs(hmask, 1).reshape(*lead, 16, 16).view(np.int8)
    q = low - ((1 - high) << 2)
    nib = _crumbs(scales[..., :8], 4).reshape(*lead, 16)
    top = _crumbs(scales[..., 8:], 2).reshape(*lead, 16)
    sc = ((nib | top << 4).view(np.int8) - np.int8(32)).astype(F32)
    dl = (_half(d, 0) * sc)[..., None]
    return (dl * q).reshape(*lead, QK_K)


def _decode_q4_k(blocks: np.ndarray) -> np.ndarray:
    """f16 d, f16 dmin, scales[12], qs[128] (4-bit).  Element 64 c + 32 s + l is nibble s of
    qs[32 c + l]; sub-block of 32 e: d * scale[e // 32] * q - dmin * min[e // 32]."""
    d, dmin, scales, qs = _split(blocks, 2, 2, 12, 128)
    lead = blocks.shape[:-1]
    q = _crumbs(qs.reshape(*lead, 4, 32), 4).reshape(*lead, 8, 32)
    sc, mn = _k_scale_min(scales)
    return (_half(d, 0)[..., None] * sc * q - _half(dmin, 0)[..., None] * mn).reshape(*lead, QK_K)


def _decode_q5_k(blocks: np.ndarray) -> np.ndarray:
    """As Q4_K with qh[32] before qs: bit s of qh[l] is the fifth bit of element 32 s + l."""
    d, dmin, scales, qh, qs = _split(blocks, 2, 2, 12, 32, 128)
    lead = blocks.shape[:-1]
    q = _crumbs(qs.reshape(*lead, 4, 32), 4).reshape(*lead, 8, 32) | _crumbs(qh, 1) << np.uint8(4)
    sc, mn = _k_scale_min(scales)
    return (_half(d, 0)[..., None] * sc * q - _half(dmin, 0)[..., None] * mn).reshape(*lead, QK_K)


def _decode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], f16 d.  Element
    128 h + 32 g + l: nibble g // 2 of ql[64 h + 32 (g % 2) + l], bits 2g.. of qh[32 h + l],
    minus 32; times d * scales[e // 16]."""
    ql, qh, scales, d = _split(blocks, 128, 64, 16, 2)
    lead = blocks.shape[:-1]
    low = _crumbs(ql.reshape(*lead, 2, 64), 4).reshape(*lead, 2, 4, 32)
    high = _crumbs(qh.reshape(*lead, 2, 32), 2)
    q = (low | high << np.uint8(4)).view(np.int8) - np.int8(32)
    dl = (_half(d, 0) * scales.view(np.int8))[..., None]
    return (dl * q.reshape(*lead, 16, 16)).reshape(*lead, QK_K)


def _decode_q8_k(blocks: np.ndarray) -> np.ndarray:
    """f32 d, int8 qs[256], int16 bsums[16] (sums of 16 codes, for GGML's dot products): d * q."""
    d, qs, _ = _split(blocks, 4, 256, 32)
    return np.multiply(qs.view(np.int8), d.view("<f4"), dtype=F32)


_KQUANTS = {
    DType.Q2_K: _decode_q2_k,
    DType.Q3_K: _decode_q3_k,
    DType.Q4_K: _decode_q4_k,
    DType.Q5_K: _decode_q5_k,
    DType.Q6_K: _decode_q6_k,
    DType.Q8_K: _decode_q8_k,
}


# -- public conversions -------------------------------------------------------------------------
def _blocks(q: QuantizedArray) -> np.ndarray:
    """``q``'s bytes as ``[rows, nb, block_bytes]``: one row of blocks per row of the matrix."""
    k = q.shape[-1] if q.shape else 1
    rows = math.prod(q.shape[:-1])
    return q.data.reshape(rows, k // q.dtype.block_size, q.dtype.block_bytes)


def _decoder(dtype: DType):
    if dtype in _LEGACY:
        fmt = _LEGACY[dtype]
        return lambda blocks: _decode_legacy(blocks, fmt)
    if dtype in _KQUANTS:
        return _KQUANTS[dtype]
    known = ", ".join(d.name for d in (*_LEGACY, *_KQUANTS))
    raise fail("Dequantize", f"no decoder for {dtype.name}; this kernel decodes {known}")


def dequantize(q: QuantizedArray, rows: slice | np.ndarray | None = None) -> np.ndarray:
    """f32 values of ``q`` (GGML ``dequantize_row_*``).

    ``rows`` selects rows of ``q`` seen as a matrix ``[prod(shape[:-1]), K]`` (a slice for a band,
    an integer array for a gather) and then the result is ``[rows, K]``; without it, ``q.shape``.
    Only the selected blocks are decoded.
    """
    blocks = _blocks(q)
    k = q.shape[-1] if q.shape else 1
    if rows is None:
        return _decoder(q.dtype)(blocks).reshape(q.shape)
    picked = blocks[rows]
    return _decoder(q.dtype)(picked).reshape(picked.shape[0], k)


def quantize(x: np.ndarray, dtype: DType) -> Array:
    """``x`` stored as ``dtype``: GGML blocks along the last dim (``quantize_row_*_ref``) as a
    :class:`QuantizedArray`, or a float type rounded to nearest even as an ``np.ndarray``."""
    if dtype.is_float:
        return _round_float(x, dtype.numpy)
    if dtype not in _LEGACY:
        known = ", ".join(d.name for d in QUANTIZABLE)
        raise fail("Quantize", f"cannot encode {dtype.name}; encoders: {known} and the float types")
    k = x.shape[-1] if x.ndim else 1
    if x.ndim == 0 or k % QK:
        raise fail("Quantize", f"{dtype.name} packs {QK} elements per block; last dim of {list(x.shape)}")
    blocks = as_compute(x, F32).reshape(math.prod(x.shape[:-1]), k // QK, QK)
    data = _encode_legacy(blocks, _LEGACY[dtype])
    return QuantizedArray(data.reshape(*x.shape[:-1], k // QK * dtype.block_bytes), dtype, tuple(x.shape))


def _round_float(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` rounded once, to nearest even, to the float ``dtype``.

    numpy and ml_dtypes cast directly, except ml_dtypes' f64 -> bf16, which goes through f32 and
    so can round twice (1 + 2^-8 + 2^-30 becomes 1, not 1 + 2^-7).  Rounding to f32 *to odd*
    first (truncate, then set the last bit if inexact) keeps the information the second rounding
    needs: f32 has more than 8 + 2 significant bits, so the result is the correctly rounded one.
    """
    with np.errstate(over="ignore"):  # overflow to inf is the defined result
        if x.dtype != F64 or dtype != np.dtype(ml_dtypes.bfloat16):
            return x.astype(dtype)
        narrow = x.astype(F32)
    wide = narrow.astype(F64)
    bits = narrow.view(np.uint32)
    bits -= (np.abs(wide) > np.abs(x)).astype(np.uint32)  # rounded away from zero: truncate
    bits |= (wide != x).astype(np.uint32)  # inexact (or NaN): an odd last bit
    return narrow.astype(dtype)


def to_float(w: Array, dtype: np.dtype = F32) -> np.ndarray:
    """A whole weight as floats of ``dtype`` (f32 by default; no copy when it already is)."""
    if isinstance(w, QuantizedArray):
        return dequantize(w).astype(dtype, copy=False)
    return as_compute(w, dtype)


def _rows_as(w: Array, rows: slice, dtype: np.dtype) -> np.ndarray:
    """Rows ``rows`` of the 2-D weight ``w`` as ``dtype`` (the band a banded product needs)."""
    if isinstance(w, QuantizedArray):
        band = dequantize(w, rows)
    elif w.dtype == np.float16:
        band = f16_bits_to_f32(w[rows].view(np.uint16))
    else:
        return w[rows].astype(dtype)
    return band.astype(dtype, copy=False)


# -- products -----------------------------------------------------------------------------------
#: f32 bytes of one converted band: a core's L2 here is 512 KiB and L3 8 MiB; bands of about 1 MiB
#: measured best for a 4096-wide weight (benchmarks/bench_matvec.py), large enough to amortise
#: the ~10 numpy calls per band and still read back from cache by BLAS.
BAND_BYTES = 1 << 20
#: ... but a band holds up to this many rows when x has many rows (prefill): a band is read once
#: by BLAS for all M rows of x, while x is re-read once per band.
MAX_BAND_ROWS = 512
#: Up to this many rows of x, Q8_0/Q4_0 products sum each block's codes against x before scaling
#: (as GGML's vec_dot does): the scaling then touches nb values per row of x instead of the whole
#: band.  With more rows, scaling the band once and one BLAS product wins (measured: the two
#: cross between 16 and 32 rows on a 4096 x 4096 weight).
BLOCK_DOT_MAX_ROWS = 16


def _band_rows(m: int, row_bytes: int) -> int:
    return max(1, BAND_BYTES // max(1, row_bytes), min(m, MAX_BAND_ROWS))


def _bands(n: int, m: int, row_bytes: int):
    step = _band_rows(m, row_bytes)
    return (slice(start, min(n, start + step)) for start in range(0, n, step))


# Q8_0 and Q4_0 (what Quantize and KvCompress make) get a faster product than ``dequantize``.  In
# the block layout the codes come in runs of 16 or 32 bytes between headers, and numpy's per-run
# overhead dominates any op on them.  Instead a band's bytes are widened whole, headers included,
# into contiguous int8 codes (one column per code, two per byte for Q4_0, junk in the header
# columns); x is laid out to match, with zeros against the header columns.  Codes times d equal
# the dequantized weights exactly; only the summation order differs from a dequantized product.
def _wide_codes(band: np.ndarray, dtype: DType) -> np.ndarray:
    """int8 codes ``[rows, nb, width]`` of a band of raw block rows ``[rows, nb * block_bytes]``."""
    rows = band.shape[0]
    if dtype is DType.Q8_0:
        return band.view(np.int8).reshape(rows, -1, dtype.block_bytes)
    pairs = band.astype("<u2")  # byte j -> (low nibble, high nibble) in the two bytes of a u16
    pairs |= pairs << np.uint16(4)
    pairs &= np.uint16(0x0F0F)
    codes = pairs.view(np.uint8)
    codes -= np.uint8(8)  # mod 256: as int8, exactly q - 8
    return codes.view(np.int8).reshape(rows, -1, 2 * dtype.block_bytes)


def _wide_x(x2: np.ndarray, dtype: DType) -> np.ndarray:
    """``x2 [m, K]`` laid out as the columns of ``_wide_codes``: ``[m, nb, width]``."""
    m, k = x2.shape
    nb, head = k // QK, _LEGACY[dtype].scales
    if dtype is DType.Q8_0:
        wide = np.zeros((m, nb, dtype.block_bytes), x2.dtype)
        wide[:, :, head:] = x2.reshape(m, nb, QK)
        return wide
    # column 2 j + h holds element 16 h + j - head of the block
    wide = np.zeros((m, nb, dtype.block_bytes, 2), x2.dtype)
    wide[:, :, head:, :] = x2.reshape(m, nb, 2, QK // 2).transpose(0, 1, 3, 2)
    return wide.reshape(m, nb, 2 * dtype.block_bytes)


def _wide_product(x2: np.ndarray, w: QuantizedArray) -> np.ndarray:
    """``x2 @ w^T`` for a Q8_0 or Q4_0 ``w`` and f32 ``x2 [m, K]``."""
    (m, _), n = x2.shape, w.shape[0]
    xw = _wide_x(x2, w.dtype)
    blocks = _blocks(w)
    y = np.empty((m, n), F32)
    row_bytes = xw.shape[1] * xw.shape[2] * F32.itemsize  # of a band's codes, as f32
    block_dot = m <= BLOCK_DOT_MAX_ROWS
    if block_dot:
        x_blocks = xw.transpose(1, 2, 0)  # [nb, width, m]: one small matrix per block column
    else:
        xw = xw.reshape(m, xw.shape[1] * xw.shape[2])
    for rows in _bands(n, m, row_bytes):
        codes = _wide_codes(w.data[rows], w.dtype)
        d = _half(blocks[rows], 0)  # [rows, nb, 1]
        if block_dot:  # per-block dots [nb, rows, m] by BLAS, then scaled and summed over blocks
            dots = np.matmul(codes.astype(F32).transpose(1, 0, 2), x_blocks)
            y[:, rows] = np.einsum("brm,rb->mr", dots, d[..., 0])
        else:
            scaled = np.multiply(codes, d, dtype=F32)
            np.matmul(xw, scaled.reshape(scaled.shape[0], -1).T, out=y[:, rows])
    return y


def quant_matmul(x: np.ndarray, w: Array) -> np.ndarray:
    """``y = x @ w^T`` for ``x [..., K]`` (f32 or f64, the compute dtype) and a 2-D weight
    ``w [N, K]`` of any format; ``y [..., N]`` in ``x``'s dtype.

    A weight of ``x``'s dtype goes to BLAS as it is stored (``w.T`` is a transposed view, no
    copy).  Any other weight is converted in bands of rows that stay in cache, each multiplied
    at once: never a full float copy of the weight.
    """
    n, k = w.shape
    m = math.prod(x.shape[:-1])
    x2 = x.reshape(m, k)  # leading dims flattened: one BLAS call, not one per batch index
    if isinstance(w, np.ndarray) and w.dtype == x.dtype:
        return (x2 @ w.T).reshape(*x.shape[:-1], n)
    if isinstance(w, QuantizedArray) and w.dtype in (DType.Q8_0, DType.Q4_0) and x.dtype == F32:
        y = _wide_product(x2, w)
    else:
        y = np.empty((m, n), x.dtype)
        for rows in _bands(n, m, k * x.dtype.itemsize):
            np.matmul(x2, _rows_as(w, rows, x.dtype).T, out=y[:, rows])
    return y.reshape(*x.shape[:-1], n)


def quant_matmul_kn(x: np.ndarray, w: Array) -> np.ndarray:
    """``y = x @ w`` for a 2-D weight stored ``[K, N]`` (Matmul with ``transpose_b`` false): the
    K rows are converted in bands and their partial products summed."""
    k, n = w.shape
    m = math.prod(x.shape[:-1])
    x2 = x.reshape(m, k)
    if isinstance(w, np.ndarray) and w.dtype == x.dtype:
        return (x2 @ w).reshape(*x.shape[:-1], n)
    y = np.zeros((m, n), x.dtype)
    for rows in _bands(k, m, n * x.dtype.itemsize):
        y += x2[:, rows] @ _rows_as(w, rows, x.dtype)
    return y.reshape(*x.shape[:-1], n)


# -- linear (ONNX) quantization -----------------------------------------------------------------
_LINEAR_RANGE = {DType.I8: (-128.0, 127.0), DType.U8: (0.0, 255.0)}


def _per_axis(v: np.ndarray, rank: int, ax: int) -> np.ndarray:
    """A scale or zero point ready to broadcast against ``x``: per tensor (one element) as a
    0-d array, so a rank-0 ``x`` keeps its shape; per axis as a vector along ``ax``."""
    if v.size == 1:
        return v.reshape(())
    shape = [1] * rank
    shape[ax] = -1
    return v.reshape(shape)


def quantize_linear(x, scale, zero_point=None, *, dtype: DType, axis_: int = -1) -> np.ndarray:
    """ONNX ``QuantizeLinear``: ``saturate(round_half_even(x / scale) + zero_point)``."""
    lo, hi = _LINEAR_RANGE[dtype]
    ax = axis("Quantize", axis_, x.ndim) if np.size(scale) > 1 else 0
    ct = compute_dtype(x, scale)
    y = np.rint(as_compute(x, ct) / _per_axis(as_compute(scale, ct), x.ndim, ax))
    if zero_point is not None:
        y += _per_axis(zero_point, x.ndim, ax).astype(ct)
    return np.clip(y, lo, hi).astype(dtype.numpy)


def dequantize_linear(x, scale, zero_point=None, *, axis_: int = -1) -> np.ndarray:
    """ONNX ``DequantizeLinear``: ``(x - zero_point) * scale`` in f32."""
    ax = axis("Dequantize", axis_, x.ndim) if np.size(scale) > 1 else 0
    y = x.astype(F32)
    if zero_point is not None:
        y -= _per_axis(zero_point, x.ndim, ax).astype(F32)
    return y * _per_axis(as_compute(scale), x.ndim, ax)


# -- embedding lookup ---------------------------------------------------------------------------
def token_embed(ids: np.ndarray, table: Array, decode=dequantize) -> np.ndarray:
    """``table[ids]`` (``ggml_get_rows``): only the gathered rows of a block table are decoded,
    by ``decode(table, flat_ids)`` (a backend passes its compiled decoder, the same bits)."""
    vocab, width = table.shape
    flat = ids.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= vocab):
        bad = flat[(flat < 0) | (flat >= vocab)][0]
        where = tuple(int(i) for i in np.argwhere(ids == bad)[0])
        raise fail("TokenEmbed", f"token id {int(bad)} at index {where} of ids {list(ids.shape)} is "
                                 f"outside [0, {vocab}): the table has a vocab size of {vocab}")
    if isinstance(table, QuantizedArray):
        rows = decode(table, flat)
    else:
        rows = np.take(table, flat, axis=0)
    return rows.reshape(*ids.shape, width)


# -- kernels ------------------------------------------------------------------------------------
@register(Quantize)
def _quantize(op, inputs, ctx):
    x, *params = inputs
    if op.dtype in _LINEAR_RANGE:
        return (quantize_linear(x, *params, dtype=op.dtype, axis_=op.axis),)
    return (quantize(x, op.dtype),)


@register(Dequantize)
def _dequantize(op, inputs, ctx):
    x, *params = inputs
    if isinstance(x, QuantizedArray):
        y = dequantize(x)
    else:
        y = dequantize_linear(x, *params, axis_=op.axis)
    return (cast_back(y, op.dtype.numpy),)


@register(KvCompress)
def _kv_compress(op, inputs, ctx):
    (x,) = inputs
    return (quantize(x, op.dtype),)


@register(KvDecompress)
def _kv_decompress(op, inputs, ctx):
    (x,) = inputs
    if isinstance(x, QuantizedArray):
        return (cast_back(dequantize(x), op.dtype.numpy),)
    return (_round_float(x, op.dtype.numpy),)


@register(TokenEmbed)
def _token_embed(op, inputs, ctx):
    ids, table = inputs
    return (token_embed(ids, table),)
