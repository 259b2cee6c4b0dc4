"""Position kernels: Rope, SinusoidalEmbed, RelativePosEmbedding, PosEmbed (docs/ops.md).

Angles and frequencies are computed in f32 the way the references compute them (Hugging Face's
``LlamaRotaryEmbedding``, diffusers' ``get_timestep_embedding``, T5's bucket), so that large
positions round the same way; the data is then combined in the compute dtype.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dist_runtime.ir.ops import PosEmbed, RelativePosEmbedding, Rope, SinusoidalEmbed

from ._common import F32, as_compute, cast_back, compute_dtype, fail
from .registry import register


# -- scalar inputs -----------------------------------------------------------------------------
def scalar(op_name: str, what: str, x) -> float:
    """The value of a one-element ``[]`` / ``[1]`` input (docs/ops.md, "The pos input")."""
    x = np.asarray(x)
    if x.size != 1:
        raise fail(op_name, f"{what} must hold one element, got shape {list(x.shape)}")
    return x.reshape(()).item()


def position(op_name: str, x) -> int:
    """The injected ``pos`` (an f32 holding an integer, exact up to 2^24) as a Python int."""
    value = scalar(op_name, "pos", x)
    if not (math.isfinite(value) and value == int(value) and value >= 0):
        raise fail(op_name, f"pos must be a whole number >= 0, got {value}")
    return int(value)


# -- Rope --------------------------------------------------------------------------------------
def rope_cos_sin(start: int, length: int, rope_dim: int,
                 base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``theta[t, i] = (start + t) * inv_freq[i]``, ``[length, rope_dim/2]``, f32.

    As Hugging Face: ``inv_freq = 1 / base^(arange(0, r, 2) / r)`` and the product with the
    position in f32.
    """
    exponent = np.arange(0, rope_dim, 2, dtype=F32) / F32.type(rope_dim)
    inv_freq = F32.type(1.0) / (F32.type(base) ** exponent)
    positions = np.arange(start, start + length, dtype=F32)
    theta = positions[:, None] * inv_freq[None, :]
    return np.cos(theta), np.sin(theta)


#: Positions per block of :func:`cos_sin_rows`' cache.
ROPE_BLOCK = 256


@functools.lru_cache(maxsize=64)
def _cos_sin_block(block: int, rope_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    cos, sin = rope_cos_sin(block * ROPE_BLOCK, ROPE_BLOCK, rope_dim, base)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def cos_sin_rows(start: int, length: int, rope_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`rope_cos_sin`'s rows, the same bits (elementwise f32 maths: a row does not depend on
    the rows computed beside it), read-only, cut from blocks of :data:`ROPE_BLOCK` positions
    computed once.  A decode step's first Rope spent 55 us on the four small numpy calls of
    :func:`rope_cos_sin` (each ~1 us alone, but there its code and data come back cold after the
    layer's weights streamed through the caches); a slice of a cached block costs ~1 us."""
    first, last = start // ROPE_BLOCK, (start + max(length, 1) - 1) // ROPE_BLOCK
    if length <= 0 or last - first > 1:  # prefill of more than a block: computed directly
        return rope_cos_sin(start, length, rope_dim, base)
    blocks = [_cos_sin_block(b, rope_dim, base) for b in range(first, last + 1)]
    lo = start - first * ROPE_BLOCK
    if len(blocks) == 1:
        cos, sin = blocks[0]
        return cos[lo:lo + length], sin[lo:lo + length]
    cos, sin = (np.concatenate([blk[i] for blk in blocks])[lo:lo + length] for i in (0, 1))
    return cos, sin


@functools.lru_cache(maxsize=32)
def _rotation(start: int, length: int, rope_dim: int, base: float, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(C, S)``, ``[length, 1, rope_dim]`` in ``dtype``, read-only: the rotation as
    ``x * C + concat(x2, x1) * S`` with ``C = [cos, cos]`` and ``S = [-sin, sin]``.  Every Rope
    node of a step (q and k of every layer) rotates by the same positions: computed once, cached."""
    cos, sin = cos_sin_rows(start, length, rope_dim, base)
    c = np.concatenate([cos, cos], axis=-1)[:, None, :].astype(dtype)
    s = np.concatenate([-sin, sin], axis=-1)[:, None, :].astype(dtype)
    c.flags.writeable = s.flags.writeable = False
    return c, s


def rope(x, pos, *, head_dim: int, rope_dim: int, base: float) -> np.ndarray:
    """Rotate-half rotary embedding of the first ``rope_dim`` dims of every head of ``x``."""
    dtype = compute_dtype(x)
    heads = x.shape[-1] // head_dim
    xs = as_compute(x, dtype).reshape(*x.shape[:-1], heads, head_dim)
    c, s = _rotation(position("Rope", pos), x.shape[-2], rope_dim, float(base), np.dtype(dtype))
    half = rope_dim // 2
    rot = xs[..., :rope_dim]
    y = rot * c
    y += np.concatenate([rot[..., half:], rot[..., :half]], axis=-1) * s
    if rope_dim < head_dim:  # partial rotary: the rest passes through
        y = np.concatenate([y, xs[..., rope_dim:]], axis=-1)
    return cast_back(y.reshape(x.shape), x)


@register(Rope)
def _rope(op, inputs, ctx):
    x, pos = inputs
    return (rope(x, pos, head_dim=op.head_dim, rope_dim=op.rope_dim, base=op.base),)


# -- SinusoidalEmbed ---------------------------------------------------------------------------
def sinusoidal_embed(timesteps, *, dim: int, max_period: float = 10000.0,
                     flip_sin_to_cos: bool = True, downscale_freq_shift: float = 1.0) -> np.ndarray:
    """diffusers ``get_timestep_embedding`` (scale 1), in f32: ``[N, dim]`` or ``[dim]``."""
    t = np.asarray(timesteps)
    half = dim // 2
    # Python floats stay weak (NEP 50): every step below is f32, as in diffusers' torch code.
    exponent = np.arange(half, dtype=F32) * -math.log(max_period)
    exponent = exponent / (half - downscale_freq_shift)
    args = t.astype(F32).reshape(-1, 1) * np.exp(exponent)[None, :]
    parts = (np.cos(args), np.sin(args)) if flip_sin_to_cos else (np.sin(args), np.cos(args))
    emb = np.zeros((args.shape[0], dim), F32)  # an odd dim keeps a last column of zeros
    emb[:, :half], emb[:, half:2 * half] = parts
    return emb.reshape(*t.shape, dim)


@register(SinusoidalEmbed)
def _sinusoidal_embed(op, inputs, ctx):
    (t,) = inputs
    return (sinusoidal_embed(t, dim=op.dim, max_period=op.max_period,
                             flip_sin_to_cos=op.flip_sin_to_cos,
                             downscale_freq_shift=op.downscale_freq_shift),)


# -- RelativePosEmbedding ----------------------------------------------------------------------
def relative_position_bucket(rel: np.ndarray, *, num_buckets: int, max_distance: int,
                             bidirectional: bool) -> np.ndarray:
    """T5's bucket of each relative position ``key - query`` (int64, same shape)."""
    rel = np.asarray(rel, np.int64)
    buckets = np.zeros(rel.shape, np.int64)
    nb = num_buckets
    if bidirectional:
        nb //= 2
        buckets += (rel > 0) * nb
        n = np.abs(rel)
    else:
        n = np.maximum(-rel, 0)
    exact = nb // 2
    # The log bucket in f32 as T5 computes it, truncated toward zero like torch's .to(long).
    # Clamping n to exact only avoids log(0) where the exact bucket is used anyway.
    ratio = np.maximum(n, exact).astype(F32) / F32.type(exact)
    log_bucket = np.log(ratio) / F32.type(math.log(max_distance / exact)) * F32.type(nb - exact)
    large = np.minimum(exact + log_bucket.astype(np.int64), nb - 1)
    return buckets + np.where(n < exact, n, large)


def relative_pos_embedding(tq: int, tk: int, table, pos=None, *, num_buckets: int = 32,
                           max_distance: int = 128, bidirectional: bool = True) -> np.ndarray:
    """``bias[h, i, j] = table[bucket(j - (pos + i)), h]``: ``[H, Tq, Tk]``, the table's dtype."""
    start = 0 if pos is None else position("RelativePosEmbedding", pos)
    # rel depends only on j - i: bucket the Tq + Tk - 1 distinct values once, then gather.
    rel = np.arange(-(start + tq - 1), tk - start)
    bucket = relative_position_bucket(rel, num_buckets=num_buckets, max_distance=max_distance,
                                      bidirectional=bidirectional)
    index = np.arange(tk)[None, :] - np.arange(tq)[:, None] + (tq - 1)  # into rel
    lookup = table[bucket]  # [Tq + Tk - 1, H]
    return np.ascontiguousarray(np.moveaxis(lookup[index], -1, 0))


@register(RelativePosEmbedding)
def _relative_pos_embedding(op, inputs, ctx):
    q, k, table, *pos = inputs
    return (relative_pos_embedding(q.shape[-2], k.shape[-2], table, *pos,
                                   num_buckets=op.num_buckets, max_distance=op.max_distance,
                                   bidirectional=op.bidirectional),)


# -- PosEmbed ----------------------------------------------------------------------------------
def pos_embed(t: int, table, pos=None, *, offset: int = 0) -> np.ndarray:
    """Rows ``offset + pos .. offset + pos + t - 1`` of the learned position table: ``[t, D]``."""
    start = offset + (0 if pos is None else position("PosEmbed", pos))
    rows = table.shape[0]
    if start + t > rows:
        raise fail("PosEmbed", f"position {start + t - 1} (offset {offset} + pos + {t - 1}) is "
                               f"past the end of the position table, which has {rows} rows "
                               f"(positions 0..{rows - 1})")
    # A copy, not a view: the table may be a memory-mapped weight that nothing should alias.
    return np.array(table[start:start + t])


@register(PosEmbed)
def _pos_embed(op, inputs, ctx):
    x, table, *pos = inputs
    return (pos_embed(x.shape[-2], table, *pos, offset=op.offset),)
