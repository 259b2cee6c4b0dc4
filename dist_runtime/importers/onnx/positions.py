"""ONNX RotaryEmbedding (our Rope)."""

from __future__ import annotations

import math

import numpy as np

from ...ir import ops
from .node import NodeBuilder
from .registry import converter


def _rope_table(n: int, rope_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """Our Rope's cos and sin table (docs/ops.md, Rope), positions 0..n-1, f32."""
    exponent = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    inv_freq = np.float32(1.0) / (np.float32(base) ** exponent)
    theta = np.arange(n, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(theta), np.sin(theta)


@converter("RotaryEmbedding", targets=("Rope",), constants=(1, 2, 3))
def convert_rotary_embedding(node, opset, inputs):
    """RotaryEmbedding with ``interleaved=0`` is our Rope when the caches are the rotary table of a
    frequency base (constants; the base is read off position 1 and the whole table checked) and the
    positions are ``p0 + t`` for every batch row (our Rope takes one start position)."""
    b = NodeBuilder(node, opset, inputs, ("interleaved", "num_heads", "rotary_embedding_dim"))
    b.floats(0, 1, 2)
    if b.attr("interleaved", 0):
        raise b.fail("interleaved=1 (GPT-J pairing): our Rope rotates halves (GPT-NeoX pairing)")
    shape = b.shape(0)
    if len(shape) == 4:
        head_dim, seq = shape[3], shape[2]
    elif len(shape) == 3:
        heads = b.attr("num_heads")
        if not heads:
            raise b.fail("a 3-D input needs num_heads")
        head_dim, seq = shape[2] // int(heads), shape[1]
    else:
        raise b.fail(f"input of rank {len(shape)}")
    cos, sin = b.const(1, "cos_cache"), b.const(2, "sin_cache")
    rope_dim = int(b.attr("rotary_embedding_dim", 0)) or 2 * cos.shape[-1]
    if rope_dim != 2 * cos.shape[-1] or rope_dim > head_dim:
        raise b.fail(f"rotary_embedding_dim={rope_dim} does not fit caches {list(cos.shape)} / head {head_dim}")
    if b.has(3):
        pos = b.const(3, "position_ids")
        start = int(pos.reshape(-1)[0]) if pos.size else 0
        if pos.ndim != 2 or not (pos == start + np.arange(pos.shape[1])[None, :]).all():
            raise b.fail("position_ids are not p0 + t, the same in every batch row: our Rope takes one "
                         "start position")
        if cos.ndim != 2 or start + seq > len(cos):
            raise b.fail(f"caches {list(cos.shape)} do not hold positions {start}..{start + seq - 1}")
        table_cos, table_sin = cos, sin  # rows = positions 0..max-1
    else:
        start = 0  # the caches are the rows of positions 0..S-1, per batch
        if cos.ndim != 3 or not (cos == cos[:1]).all() or not (sin == sin[:1]).all():
            raise b.fail("per-batch caches differ: our Rope has one table")
        table_cos, table_sin = cos[0], sin[0]
    half = rope_dim // 2
    base = 10000.0
    if half > 1 and len(table_cos) > 1:
        inv_freq_1 = math.atan2(float(table_sin[1, 1]), float(table_cos[1, 1]))
        if not 0 < inv_freq_1 < 1:
            raise b.fail("cos_cache/sin_cache are not a rotary table (the angle of position 1, frequency 1 "
                         "is not in (0, 1))")
        base = inv_freq_1 ** (-rope_dim / 2)
    if not (math.isfinite(base) and base > 0):
        raise b.fail("cos_cache/sin_cache are not a rotary table")
    for candidate in (float(f"{base:.3g}"), float(f"{base:.6g}"), base):  # the round base it was made with
        want_cos, want_sin = _rope_table(len(table_cos), rope_dim, candidate)
        if np.allclose(table_cos, want_cos, atol=1e-4) and np.allclose(table_sin, want_sin, atol=1e-4):
            base = candidate
            break
    else:
        raise b.fail("cos_cache/sin_cache are not cos/sin(p * base^(-2i/d)) for any base: our Rope computes "
                     "its own table")
    pos_name = b.constant("pos", np.asarray([start], np.float32))
    b.emit(ops.Rope(head_dim=head_dim, rope_dim=rope_dim, base=float(np.float32(base))), [b.name(0), pos_name],
           b.out(0))
    return b.done()
