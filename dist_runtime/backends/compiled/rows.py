"""The compiled row kernels of a decode step's small ops: norms, rotations, the attention chain's
call, SwiGLU's gate.  The numba backend binds its nodes to them and the compiled program
(:mod:`..program`) calls the same functions, so a node's bits are the same either way.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from . import attention as compiled_attention
from . import launch, spin
from .cache import jit
from .kv_q8 import row_elements, stored_rows

# Reassociation lets the reductions vectorise; no "nnan"/"ninf", so NaN and inf propagate as in
# numpy.  The numpy error model makes x / 0 an inf, not a ZeroDivisionError.
_jit = jit(nogil=True, boundscheck=False, error_model="numpy",
                  fastmath={"reassoc", "contract", "nsz", "arcp"})


@_jit
def rms_rows(x, weight, eps, out):
    """``out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * weight`` for each row ``i`` of a 2-D ``x``."""
    n = x.shape[1]
    for i in range(x.shape[0]):
        ss = 0.0  # f64: the sum of squares of a wide row loses nothing
        for j in range(n):
            ss += np.float64(x[i, j]) * x[i, j]
        inv = np.float32(1.0 / math.sqrt(ss / max(n, 1) + eps))
        for j in range(n):
            out[i, j] = x[i, j] * inv * weight[j]


@_jit
def skip_rms_rows(x, residual, weight, eps, total, out):
    """``total = x + residual`` and ``out = RmsNorm(total)``."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            total[i, j] = x[i, j] + residual[i, j]
    rms_rows(total, weight, eps, out)


@_jit
def rope_rows(x, cos, sin, head_dim, rope_dim, out):
    """Rotate-half rotary embedding of row ``t`` by ``cos[t]``, ``sin[t]`` (``[T, rope_dim/2]``)."""
    half = rope_dim // 2
    for t in range(x.shape[0]):
        for base in range(0, x.shape[1], head_dim):
            for i in range(half):
                x1, x2 = x[t, base + i], x[t, base + half + i]
                out[t, base + i] = x1 * cos[t, i] - x2 * sin[t, i]
                out[t, base + half + i] = x2 * cos[t, i] + x1 * sin[t, i]
            for i in range(base + rope_dim, base + head_dim):
                out[t, i] = x[t, i]


@_jit
def rope_append_attend(spec, q, k, v, cos, sin, rope_head_dim, rope_dim, k_buf, v_buf, pos,
                       num_heads, kv_heads, head_dim, causal, window, attend, q_rot, k_rot, out):
    """A layer's attention chain in one call: ``q`` and ``k`` rotated (:func:`rope_rows`), the
    rotated keys and ``v`` stored as rows ``pos..`` of the KV cache's buffers as they keep them
    (F32; uint16 for F16, uint8 blocks for Q8_0: :func:`.kv_q8.stored_rows`), and (``attend``)
    the rotated queries attending over every row held (:func:`compiled_attention.attention_serial`)."""
    rope_rows(q, cos, sin, rope_head_dim, rope_dim, q_rot)
    rope_rows(k, cos, sin, rope_head_dim, rope_dim, k_rot)
    stop = pos + k.shape[0]
    stored_rows(k_rot, k_buf, pos)
    stored_rows(v, v_buf, pos)
    if attend:
        compiled_attention.attention_serial(spec, q_rot, k_buf[:stop], v_buf[:stop], num_heads, kv_heads,
                                            head_dim, causal, window, out)


@intrinsic
def element_at(typingctx, like, address):
    """The pointer at ``address`` (an integer) to elements of ``like``'s type (an array's)."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[1], context.get_value_type(sig.return_type))
    return types.CPointer(like.dtype)(like, types.int64), codegen


@intrinsic
def f32_at(typingctx, address):
    """The f32 pointer at ``address`` (an integer: a buffer's address, taken in Python)."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
    return types.CPointer(types.float32)(types.int64), codegen


@_jit
def _segment_append_attend(spec, q, k, v, cos, sin, rope_head_dim, rope_dim, starts, buffers, kv_like, rows, pos,
                           num_heads, kv_heads, head_dim, causal, window, attend, q_rot, k_rot, out, s):
    """:func:`rope_append_attend` for segment ``s`` of a batched pass: rows ``starts[s]:starts[s +
    1]`` of ``q``, ``k``, ``v`` (and of ``cos``, ``sin``: its positions'), its KV cache the buffers
    at addresses ``buffers[s]`` (K, V) of ``rows[s]`` rows, of ``kv_like``'s element type (F32,
    uint16 for F16, uint8 for Q8_0)."""
    lo, hi, width = starts[s], starts[s + 1], row_elements(kv_like, k.shape[1])
    k_buf = numba.carray(element_at(kv_like, buffers[s, 0]), (rows[s], width))
    v_buf = numba.carray(element_at(kv_like, buffers[s, 1]), (rows[s], width))
    rope_append_attend(spec, q[lo:hi], k[lo:hi], v[lo:hi], cos[lo:hi], sin[lo:hi], rope_head_dim, rope_dim,
                       k_buf, v_buf, pos[s], num_heads, kv_heads, head_dim, causal, window, attend[s],
                       q_rot[lo:hi], k_rot[lo:hi], out[lo:hi])


@_jit
def _segments_work(spec, q, k, v, cos, sin, rope_head_dim, rope_dim, starts, buffers, kv_like, rows, pos, num_heads,
                   kv_heads, head_dim, causal, window, attend, q_rot, k_rot, out, counter):
    """One thread's share of :func:`segments_append_attend`: the next segment from ``counter[0]``
    until none is left (each its own rows and cache: the same bits on any thread)."""
    while True:
        s = spin.fetch_add(counter, 0)
        if s >= starts.shape[0] - 1:
            return
        _segment_append_attend(spec, q, k, v, cos, sin, rope_head_dim, rope_dim, starts, buffers, kv_like, rows, pos,
                               num_heads, kv_heads, head_dim, causal, window, attend, q_rot, k_rot, out, s)


def segments_append_attend(spec, q, k, v, cos, sin, rope_head_dim, rope_dim, starts, buffers, kv_like, rows, pos,
                           num_heads, kv_heads, head_dim, causal, window, attend, q_rot, k_rot, out):
    """:func:`_segment_append_attend` for every segment, the threads taking segments
    (:func:`_segments_work` on each, called by its address: :mod:`.launch`)."""
    threads = max(1, min(numba.get_num_threads(), starts.shape[0] - 1))
    launch.run(_segments_work, (spec, q, k, v, cos, sin, rope_head_dim, rope_dim, starts, buffers, kv_like, rows, pos,
                                num_heads, kv_heads, head_dim, causal, window, attend, q_rot, k_rot, out,
                                np.zeros(1, np.int64)), threads)


@_jit
def silu_mul(gate, up):
    """``gate = silu(gate) * up``, in place (both fresh, contiguous 1-D products)."""
    for i in range(gate.shape[0]):
        g = gate[i]
        gate[i] = g / (np.float32(1.0) + np.exp(-g)) * up[i]
