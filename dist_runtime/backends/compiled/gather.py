"""Rows of a block-quantized table decoded in compiled code: TokenEmbed's gather (``ggml_get_rows``)
on a GGUF's quantized token embeddings.

:func:`rows` gives the same bits as the CPU library's ``dequantize(table, ids)``
(``dist_runtime.kernels.quant``, GGML's ``dequantize_row_*``): the f16 scales are widened by the
same numpy cast, and each element is the same f32 operations in the same order -- ``d * q`` (+ ``m``)
for the legacy blocks, ``(d * scale) * q - dmin * min`` for Q4_K/Q5_K, ``(d * scale) * q`` for Q6_K
(numba adds no fast-math flags: no contraction into an ``fma``).  numpy's decoders spend their
time dispatching a dozen operations on a few hundred bytes: one Q4_K row of 768 took 76 us, and
~250 us inside a decode step, whose weight streams had evicted what those operations touch; a
Q4_K_M file's token embeddings are Q4_K.
"""

from __future__ import annotations

import numpy as np

from ...dtypes import DType
from ...kernels.quant import QK, QK_K, _LEGACY, _half
from ...tensor import QuantizedArray
from .cache import jit

F32 = np.float32
_jit = jit(nogil=True, boundscheck=False)


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte ``at`` of each block as f32 ``[rows, nb]``: the CPU library's own cast."""
    return _half(blocks, at)[..., 0]


@_jit
def _legacy(blocks, d, m, bits, affine, out):
    """Q4_0/Q4_1/Q5_0/Q5_1/Q8_0: element ``j`` of a block is ``q_j * d`` (+ ``m``), ``q_j`` centred
    (``- 2^(bits - 1)``) unless affine; 4/5-bit codes: nibble ``j // 16`` of byte ``j % 16``, the
    fifth bit bit ``j`` of the 32-bit ``qh``."""
    head = (4 if affine else 2) + (4 if bits == 5 else 0)
    offset = 0 if affine or bits == 8 else 1 << (bits - 1)
    for r in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            blk = blocks[r, b]
            for j in range(QK):
                if bits == 8:
                    q = np.int32(np.int8(blk[head + j]))
                else:
                    q = np.int32((blk[head + j % 16] >> (4 * (j // 16))) & 15)
                    if bits == 5:
                        q |= np.int32((blk[head - 4 + j // 8] >> (j % 8)) & 1) << 4
                    q -= offset
                y = F32(q) * d[r, b]
                if affine:
                    y = y + m[r, b]
                out[r, b * QK + j] = y


@_jit
def _scale_min_k4(blk, j):
    """Q4_K/Q5_K ``get_scale_min_k4``: sub-block ``j``'s 6-bit scale and min from bytes 4-15."""
    if j < 4:
        return blk[4 + j] & 63, blk[8 + j] & 63
    return (blk[8 + j] & 15) | ((blk[j] >> 6) << 4), (blk[8 + j] >> 4) | ((blk[4 + j] >> 6) << 4)


@_jit
def _q45_k(blocks, d, dmin, high, out):
    """Q4_K (``high`` False) / Q5_K: element ``64 c + 32 s + l`` is nibble ``s`` of
    ``qs[32 c + l]`` (and bit ``2 c + s`` of ``qh[l]`` as the fifth), in sub-block ``2 c + s``."""
    qs = 48 if high else 16
    for r in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            blk = blocks[r, b]
            for e in range(8):
                sc, mn = _scale_min_k4(blk, e)
                scale = d[r, b] * F32(sc)
                low = dmin[r, b] * F32(mn)
                c, s = e // 2, e % 2
                for l in range(32):
                    q = (blk[qs + 32 * c + l] >> (4 * s)) & 15
                    if high:
                        q |= ((blk[16 + l] >> e) & 1) << 4
                    out[r, b * QK_K + 32 * e + l] = scale * F32(q) - low


@_jit
def _q6_k(blocks, d, out):
    """Q6_K: element ``128 h + 32 g + l`` is nibble ``g // 2`` of ``ql[64 h + 32 (g % 2) + l]`` with
    bits ``2 g`` of ``qh[32 h + l]`` above it, minus 32, times ``d * scales[e // 16]`` (int8)."""
    for r in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            blk = blocks[r, b]
            for h in range(2):
                for g in range(4):
                    for l in range(32):
                        low = (blk[64 * h + 32 * (g % 2) + l] >> (4 * (g // 2))) & 15
                        top = (blk[128 + 32 * h + l] >> (2 * g)) & 3
                        e = 128 * h + 32 * g + l
                        scale = d[r, b] * F32(np.int8(blk[192 + e // 16]))
                        out[r, b * QK_K + e] = scale * F32(np.int32(low | (top << 4)) - 32)


#: The block types :func:`rows` decodes.
DECODERS = frozenset({*_LEGACY, DType.Q4_K, DType.Q5_K, DType.Q6_K})


def rows(table: QuantizedArray, ids: np.ndarray) -> np.ndarray:
    """f32 ``[len(ids), K]``: rows ``ids`` of the 2-D block table, decoded (ids already checked)."""
    dtype = table.dtype
    if dtype not in DECODERS or len(table.shape) != 2:
        raise ValueError(f"gather.rows decodes 2-D {sorted(d.name for d in DECODERS)} tables, not {dtype.name} "
                         f"{list(table.shape)}")
    n, k = table.shape
    blocks = table.data.reshape(n, k // dtype.block_size, dtype.block_bytes)[ids]
    out = np.empty((len(ids), k), F32)
    if dtype in _LEGACY:
        fmt = _LEGACY[dtype]
        d = _scale(blocks, 0)
        _legacy(blocks, d, _scale(blocks, 2) if fmt.affine else d, fmt.bits, fmt.affine, out)  # m read if affine
    elif dtype == DType.Q6_K:
        _q6_k(blocks, _scale(blocks, 208), out)
    else:
        _q45_k(blocks, _scale(blocks, 0), _scale(blocks, 2), dtype == DType.Q5_K, out)
    return out
