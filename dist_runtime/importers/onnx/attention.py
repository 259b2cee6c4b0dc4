"""ONNX Attention: our Sdpa / SdpaWindow, with a KvCache for an explicit past."""

from __future__ import annotations

import math

import numpy as np

from ...ir import ops
from .node import BF16, NodeBuilder
from .registry import KvPriming, converter


_ONNX_FLOAT_TYPES = {1: np.float32, 10: np.float16, 11: np.float64, 16: BF16}


def _structural_allowed(tq: int, tk: int, offset, causal: bool, left: int, right: int,
                        nonpad: np.ndarray | None) -> np.ndarray | None:
    """ONNX Attention's structural mask (causal, window, padding) as booleans [Tq, Tk] or
    [B, 1, Tq, Tk] (per-batch offsets); None when nothing is masked."""
    if not causal and left < 0 and right < 0 and nonpad is None:
        return None
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    offsets = np.asarray(offset).reshape(-1, 1, 1)  # [B or 1, 1, 1]
    diff = (i + offsets) - j  # query position - key position
    allowed = np.ones(diff.shape, bool)
    if causal:
        allowed = allowed & (diff >= 0)
    if left >= 0:
        allowed = allowed & (diff <= left)
    if right >= 0:
        allowed = allowed & (-diff <= right)
    if nonpad is not None:
        allowed = allowed & (j[None] < nonpad.reshape(-1, 1, 1))
        return allowed[:, None]
    return allowed[0]


def _our_structural(tq: int, tk: int, allowed: np.ndarray) -> tuple[str, int] | None:
    """Which of our attention ops masks exactly ``allowed`` [Tq, Tk]: ("causal", 0),
    ("window", w) or ("band", w); None if none does."""
    i = np.arange(tq)[:, None] + (tk - tq)  # our end-aligned query positions
    j = np.arange(tk)[None, :]
    if tq <= tk and np.array_equal(allowed, j <= i):
        return ("causal", 0)
    for w in range(1, tk + 1):
        if tq <= tk and np.array_equal(allowed, (j <= i) & (j > i - w)):
            return ("window", w)
        if np.array_equal(allowed, np.abs(j - i) < w):
            return ("band", w)
    return None


@converter("Attention", targets=("Sdpa", "SdpaWindow", "KvCache"), constants=(3, 6))
def convert_attention(node, opset, inputs):
    """Attention (opset 23+) as our Sdpa / SdpaWindow, with KvCache for past_key/past_value.

    Heads are contiguous along our last dim: 4-D [B, H, S, hd] inputs are permuted to
    [B, S, H*hd] and back.  A scale other than 1/sqrt(head_dim) multiplies Q first.  The causal
    and window masks of ONNX are aligned to the cache offset (top-left without a cache), ours to
    the end: when they differ, the structural mask becomes an explicit additive mask.  Boolean and
    short masks must be constants (we have no Where/Pad op).  softcap, qk_matmul_output and
    different value head sizes have no counterpart.
    """
    b = NodeBuilder(node, opset, inputs, ("is_causal", "kv_num_heads", "q_num_heads", "qk_matmul_output_mode",
                                     "scale", "softcap", "softmax_precision", "left_window_size",
                                     "right_window_size"))
    dtype = b.floats(0, 1, 2)
    if b.attr("softcap", 0.0):
        raise b.fail(f"softcap={b.attr('softcap')}: our attention has no tanh soft-capping of scores")
    b.only_outputs(3, "qk_matmul_output (the scores) is not an output of our attention ops")
    precision = b.attr("softmax_precision")
    if precision is not None and int(precision) not in _ONNX_FLOAT_TYPES:
        raise b.fail(f"softmax_precision={precision}")
    q, k, v = b.shape(0), b.shape(1), b.shape(2)
    rank = len(q)
    if rank not in (3, 4) or len(k) != rank or len(v) != rank:
        raise b.fail(f"Q, K, V of ranks {len(q)}, {len(k)}, {len(v)}")
    if rank == 4:
        if b.attr("q_num_heads") is not None or b.attr("kv_num_heads") is not None:
            raise b.fail("q_num_heads/kv_num_heads with 4-D inputs")
        batch, hq, sq, hd = q
        hkv, sk, hdk, hdv = k[1], k[2], k[3], v[3]
    else:
        hq, hkv = b.attr("q_num_heads"), b.attr("kv_num_heads")
        if not hq or not hkv:
            raise b.fail("3-D inputs need q_num_heads and kv_num_heads")
        batch, sq, sk = q[0], q[1], k[1]
        if q[2] % hq or k[2] % hkv or v[2] % hkv:
            raise b.fail("hidden sizes are not multiples of the head counts")
        hd, hdk, hdv = q[2] // hq, k[2] // hkv, v[2] // hkv
    if hdk != hd or hdv != hd:
        raise b.fail(f"head sizes q {hd}, k {hdk}, v {hdv}: our attention has one head_dim for Q, K and V")
    if hq % hkv:
        raise b.fail(f"{hq} query heads are not a multiple of {hkv} KV heads")
    past = b.has(4) or b.has(5)
    if past and not (b.has(4) and b.has(5)):
        raise b.fail("past_key and past_value go together")
    nonpad = b.const(6, "nonpad_kv_seqlen") if b.has(6) else None
    p_len = b.shape(4)[2] if past else 0
    if past and (b.shape(4) != (batch, hkv, p_len, hd) or b.shape(5) != (batch, hkv, p_len, hd)):
        raise b.fail(f"past_key/past_value {b.shape(4)} / {b.shape(5)} are not [B, KV, P, head_size]")
    tk = p_len + sk
    causal = bool(b.attr("is_causal", 0))
    left, right = int(b.attr("left_window_size", -1)), int(b.attr("right_window_size", -1))

    # The masks: ONNX's structural mask, matched by one of our ops or made explicit.
    if nonpad is not None:
        offset = nonpad.reshape(-1) - sq if causal or left >= 0 or right >= 0 else 0
    else:
        offset = p_len
    allowed = _structural_allowed(sq, tk, offset, causal, left, right, nonpad)
    ours = None if allowed is None or allowed.ndim != 2 else _our_structural(sq, tk, allowed)
    extra = None
    if allowed is not None and ours is None:
        extra = np.where(allowed, 0.0, -np.inf).astype(dtype)
    mask = None
    if b.has(3):
        m_dtype, m_shape, value = b.dtype(3), b.info(3).shape, b.info(3).value
        if m_dtype != np.bool_ and m_dtype != dtype:
            raise b.fail(f"attn_mask of type {m_dtype} with inputs of type {dtype}")
        if m_dtype == np.bool_ or m_shape is None or m_shape[-1] != tk:
            if value is None:
                raise b.fail("a boolean attn_mask, or one shorter than the keys, must be a constant (we have "
                             "no Where or Pad op)")
            if m_dtype == np.bool_:
                value = np.where(value, 0.0, -np.inf)
            if value.shape[-1] != tk:
                value = np.pad(value, [(0, 0)] * (value.ndim - 1) + [(0, tk - value.shape[-1])],
                               constant_values=-np.inf)
            mask = b.constant("mask", (value if extra is None else value + extra).astype(dtype))
        else:
            mask = b.name(3)
            if extra is not None:
                mask = b.emit(ops.Add(), [mask, b.constant("mask", extra)])
    elif extra is not None:
        mask = b.constant("mask", extra)

    # Q in our layout [B, S, H*hd], scaled when the scale is not 1/sqrt(hd).
    def to_ours(name: str) -> str:
        y = b.emit(ops.Permute(perm=(0, 2, 1, 3)), [name])
        return b.emit(ops.Reshape(shape=(0, 0, -1)), [y])

    qn = to_ours(b.name(0)) if rank == 4 else b.name(0)
    scale = b.attr("scale")
    if scale is not None:
        factor = float(scale) * math.sqrt(hd)
        if abs(factor - 1.0) > 1e-7:
            qn = b.emit(ops.Mul(), [qn, b.scalar("scale", factor, dtype)])
    if b.has(4) or b.out(1) or b.out(2):
        heads4 = []
        for i in (1, 2):
            name = b.name(i)
            if rank == 3:
                name = b.emit(ops.Reshape(shape=(0, 0, hkv, hd)), [name])
                name = b.emit(ops.Permute(perm=(0, 2, 1, 3)), [name])
            heads4.append(name)
        present = b.emit(ops.KvCache(), heads4, [b.out(1), b.out(2)])
        if past:
            b.kv.append(KvPriming(len(b.nodes) - 1, b.name(4), b.name(5)))
        kn, vn = to_ours(present[0]), to_ours(present[1])
    else:
        kn, vn = (to_ours(b.name(1)), to_ours(b.name(2))) if rank == 4 else (b.name(1), b.name(2))
    heads = dict(num_heads=int(hq), kv_heads=int(hkv), head_dim=int(hd))
    if ours is None or ours[0] == "causal":
        op = ops.Sdpa(**heads, causal=ours is not None)
    else:
        op = ops.SdpaWindow(**heads, window=ours[1], causal=ours[0] == "window")
    y = b.emit(op, [qn, kn, vn] + ([mask] if mask is not None else []), b.out(0) if rank == 3 else None)
    if rank == 4:
        y = b.emit(ops.Reshape(shape=(0, 0, int(hq), int(hd))), [y])
        b.emit(ops.Permute(perm=(0, 2, 1, 3)), [y], b.out(0))
    return b.done()
