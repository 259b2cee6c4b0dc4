"""Attention kernels (Sdpa, SdpaCross, SdpaWindow, FlashAttention) and the KV cache (KvCache).

docs/ops.md, "Attention and positions": ``q`` is ``[..., Tq, H*hd]``, ``k`` and ``v`` are
``[..., Tk, KV*hd]``; query head ``h`` reads kv head ``h // (H / KV)``.  Causal and window masks
are aligned to the *end* of the keys: query ``i`` sits at key position ``i + Tk - Tq``.

Grouped-query attention is computed without repeating K and V: the ``G = H / KV`` query heads of
one kv head are stacked as ``G * Tq`` rows, so each kv head is one ``[G*Tq, hd] @ [hd, Tk]``
product (a decode step is KV matrix-vector-like products, not H of them).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from dist_runtime import arena
from dist_runtime.dtypes import DType
from dist_runtime.scheduling_defaults import KV_BLOCK
from dist_runtime.ir.ops import FlashAttention, KvCache, Sdpa, SdpaCross, SdpaWindow
from dist_runtime.tensor import Array, QuantizedArray, dtype_of

from ._common import as_compute, cast_back, check_broadcastable_to, compute_dtype, fail
from .quant import QK, dequantize, quantize
from .registry import register


# -- the shared layout -------------------------------------------------------------------------
def _check(name: str, q, k, v, mask, num_heads: int) -> tuple[int, int]:
    """Run-time facts the shape rule could not see when Tq, Tk or batch dims were unknown."""
    tq, tk = q.shape[-2], k.shape[-2]
    if v.shape[-2] != tk:
        raise fail(name, f"k has Tk={tk} rows but v has {v.shape[-2]}")
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise fail(name, f"batch dims of q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                         f"do not broadcast") from None
    if mask is not None:
        check_broadcastable_to(name, mask, (*batch, num_heads, tq, tk),
                               "mask (to the scores [..., num_heads, Tq, Tk])")
    return tq, tk


def _query_groups(q: np.ndarray, kv_heads: int, groups: int, hd: int) -> np.ndarray:
    """``[..., Tq, H*hd]`` -> ``[..., KV, G*Tq, hd]``: the query heads of each kv head stacked."""
    tq = q.shape[-2]
    x = q.reshape(*q.shape[:-1], kv_heads, groups, hd)
    x = np.moveaxis(x, -4, -2)  # [..., KV, G, Tq, hd]
    return x.reshape(*x.shape[:-3], groups * tq, hd)


def _kv_heads(x: np.ndarray, kv_heads: int, hd: int) -> np.ndarray:
    """``[..., Tk, KV*hd]`` -> ``[..., KV, Tk, hd]`` (a view)."""
    return np.swapaxes(x.reshape(*x.shape[:-1], kv_heads, hd), -2, -3)


def _merge_heads(o: np.ndarray, groups: int, tq: int) -> np.ndarray:
    """``[..., KV, G*Tq, hd]`` -> ``[..., Tq, H*hd]``."""
    kv, hd = o.shape[-3], o.shape[-1]
    o = o.reshape(*o.shape[:-3], kv, groups, tq, hd)
    o = np.moveaxis(o, -2, -4)  # [..., Tq, KV, G, hd]
    return o.reshape(*o.shape[:-3], kv * groups * hd)


def _grouped_mask(mask: np.ndarray, kv_heads: int, groups: int) -> np.ndarray:
    """A mask broadcastable to ``[..., H, Tq, Tk]``, made so to ``[..., KV, G, Tq, Tk]``."""
    if mask.ndim < 3:
        return mask
    heads = (kv_heads, groups) if mask.shape[-3] != 1 else (1, 1)
    return mask.reshape(*mask.shape[:-3], *heads, *mask.shape[-2:])


def _position_bias(tq: int, tk: int, keys: slice, *, causal: bool, window: int | None,
                   dtype) -> np.ndarray | None:
    """0 where query i may see key j, -inf elsewhere, for the keys in ``keys``; None = all visible.

    Query i sits at key position ``i + Tk - Tq`` (end-aligned, as with a KV cache).
    """
    if not causal and window is None:
        return None
    if window is None and tq <= 1:  # one end-aligned query (a decode step) sees every key
        return None
    behind = (np.arange(tq)[:, None] + (tk - tq)) - np.arange(tk)[keys][None, :]  # i' - j
    if window is None:
        visible = behind >= 0
    elif causal:
        visible = (behind >= 0) & (behind < window)
    else:
        visible = np.abs(behind) < window
    return np.where(visible, 0.0, -np.inf).astype(dtype)


class _Problem:
    """One attention call in the grouped layout: what every key block needs."""

    def __init__(self, name, q, k, v, mask, *, num_heads, kv_heads, head_dim, causal, window):
        self.tq, self.tk = _check(name, q, k, v, mask, num_heads)
        if causal and self.tq > self.tk:  # the shape rule's check, for a Tk unknown at load time
            raise fail(name, f"causal attention needs Tq <= Tk, but q has Tq={self.tq} rows and "
                             f"k has Tk={self.tk} (the first query rows would see no key)")
        widths = {"q": (q, num_heads), "k": (k, kv_heads), "v": (v, kv_heads)}
        for what, (x, heads) in widths.items():  # the shape rule's check, for dims unknown at load
            if x.shape[-1] != heads * head_dim:
                raise fail(name, f"{what} has rows of width {x.shape[-1]}, but {heads} heads x "
                                 f"head_dim {head_dim} need {heads * head_dim}")
        k, v = _floats(k), _floats(v)  # a KV cache kept in Q8_0 hands out its blocks
        self.dtype = compute_dtype(q, k, v, mask)
        self.groups = num_heads // kv_heads
        # Scaling q once is cheaper than scaling every score; a Python float keeps the dtype.
        scale = 1.0 / math.sqrt(head_dim)
        self.q = _query_groups(as_compute(q, self.dtype), kv_heads, self.groups, head_dim) * scale
        self.k = _kv_heads(as_compute(k, self.dtype), kv_heads, head_dim)
        self.v = _kv_heads(as_compute(v, self.dtype), kv_heads, head_dim)
        self.mask = None if mask is None else _grouped_mask(as_compute(mask, self.dtype), kv_heads,
                                                            self.groups)
        self.causal, self.window = causal, window
        self.out_like = q
        # Few query rows per kv head (decode steps): BLAS streams the long, strided K and V
        # faster as the row-major operand of a tall product than as the transposed one of a
        # wide one (measured: 1.4x at Tk = 1024), so the products are taken the other way round.
        self.tall = self.groups * self.tq <= 8

    def scores(self, keys: slice = slice(None)) -> np.ndarray:
        """Scaled, masked scores of the keys in ``keys``: ``[..., KV, G, Tq, n]``."""
        k = self.k[..., keys, :]
        if self.tall:
            s = np.swapaxes(k @ np.swapaxes(self.q, -1, -2), -1, -2).copy()
        else:
            s = self.q @ np.swapaxes(k, -1, -2)
        s = s.reshape(*s.shape[:-2], self.groups, self.tq, s.shape[-1])
        if self.mask is not None:  # not in place: the mask may carry v's broader batch dims
            s = s + (self.mask if self.mask.shape[-1] == 1 else self.mask[..., keys])
        bias = _position_bias(self.tq, self.tk, keys, causal=self.causal, window=self.window,
                              dtype=self.dtype)
        if bias is not None:
            s += bias
        return s

    def weighted_values(self, p: np.ndarray, keys: slice = slice(None)) -> np.ndarray:
        """``p @ v`` for probabilities ``p`` ``[..., KV, G, Tq, n]``: ``[..., KV, G*Tq, hd]``."""
        p = p.reshape(*p.shape[:-3], self.groups * self.tq, p.shape[-1])
        v = self.v[..., keys, :]
        if self.tall:
            return np.swapaxes(np.swapaxes(v, -1, -2) @ np.swapaxes(p, -1, -2), -1, -2)
        return p @ v

    def output(self, o: np.ndarray) -> np.ndarray:
        return cast_back(_merge_heads(o, self.groups, self.tq), self.out_like)


def _floats(x):
    """``x`` as floats: a block-quantized input (a KV cache kept in Q8_0) decoded, exactly."""
    return dequantize(x) if isinstance(x, QuantizedArray) else x


# A query row that may see no key (its mask all -inf, or Tk = 0) gets zero probabilities and a
# zero output, as torch's scaled_dot_product_attention and ONNX Attention give (not the NaN of a
# plain softmax): the row max is then shifted by 0 and the zero sum divided by 1.
def _finite(m: np.ndarray) -> np.ndarray:
    return np.where(np.isneginf(m), 0.0, m).astype(m.dtype)


def _nonzero(l: np.ndarray) -> np.ndarray:
    return np.where(l == 0, 1.0, l).astype(l.dtype)


def _softmax_attention(problem: _Problem) -> np.ndarray:
    s = problem.scores()
    s -= _finite(s.max(axis=-1, keepdims=True, initial=-np.inf))
    np.exp(s, out=s)
    s /= _nonzero(s.sum(axis=-1, keepdims=True))
    return problem.output(problem.weighted_values(s))


def _flash_attention(problem: _Problem, block: int) -> np.ndarray:
    """Online softmax over key blocks (Dao et al.): a running max ``m``, running sum ``l`` and an
    accumulator rescaled by ``exp(m_old - m_new)`` whenever the max grows."""
    if problem.tk == 0:
        return _softmax_attention(problem)
    acc = l = m = None
    for start in range(0, problem.tk, block):
        keys = slice(start, min(start + block, problem.tk))
        s = problem.scores(keys)
        m_new = s.max(axis=-1, keepdims=True)
        if m is not None:
            m_new = np.maximum(m_new, m)
        shift = _finite(m_new)  # rows with every key so far masked: exp gives 0, not NaN
        s -= shift
        p = np.exp(s, out=s)
        pv = problem.weighted_values(p, keys)
        if acc is None:
            acc, l = pv, p.sum(axis=-1, keepdims=True)
        else:
            alpha = np.exp(m - shift)
            l = l * alpha + p.sum(axis=-1, keepdims=True)
            acc = acc * _rows(alpha) + pv
        m = m_new
    return problem.output(acc / _rows(_nonzero(l)))


def _rows(x: np.ndarray) -> np.ndarray:
    """A per-row factor ``[..., KV, G, Tq, 1]`` as ``[..., KV, G*Tq, 1]`` (the accumulator's)."""
    return x.reshape(*x.shape[:-3], -1, 1)


# -- the maths, usable on their own ------------------------------------------------------------
def sdpa(q, k, v, mask=None, *, num_heads, kv_heads, head_dim, causal=False):
    p = _Problem("Sdpa", q, k, v, mask, num_heads=num_heads, kv_heads=kv_heads,
                 head_dim=head_dim, causal=causal, window=None)
    return _softmax_attention(p)


def sdpa_cross(q, k, v, mask=None, *, num_heads, kv_heads, head_dim):
    p = _Problem("SdpaCross", q, k, v, mask, num_heads=num_heads, kv_heads=kv_heads,
                 head_dim=head_dim, causal=False, window=None)
    return _softmax_attention(p)


def sdpa_window(q, k, v, mask=None, *, num_heads, kv_heads, head_dim, window, causal=True):
    p = _Problem("SdpaWindow", q, k, v, mask, num_heads=num_heads, kv_heads=kv_heads,
                 head_dim=head_dim, causal=causal, window=window)
    return _softmax_attention(p)


def flash_attention(q, k, v, mask=None, *, num_heads, kv_heads, head_dim, causal=False, block=256):
    p = _Problem("FlashAttention", q, k, v, mask, num_heads=num_heads, kv_heads=kv_heads,
                 head_dim=head_dim, causal=causal, window=None)
    return _flash_attention(p, block)


def _heads(op) -> dict:
    return {"num_heads": op.num_heads, "kv_heads": op.kv_heads, "head_dim": op.head_dim}


@register(Sdpa)
def _sdpa(op, inputs, ctx):
    return (sdpa(*inputs, **_heads(op), causal=op.causal),)


@register(SdpaCross)
def _sdpa_cross(op, inputs, ctx):
    return (sdpa_cross(*inputs, **_heads(op)),)


@register(SdpaWindow)
def _sdpa_window(op, inputs, ctx):
    return (sdpa_window(*inputs, **_heads(op), window=op.window, causal=op.causal),)


@register(FlashAttention)
def _flash(op, inputs, ctx):
    return (flash_attention(*inputs, **_heads(op), causal=op.causal, block=op.block),)


# -- KV cache ----------------------------------------------------------------------------------
class _Rows:
    """One accumulator: a buffer ``[..., capacity, row_bytes]`` of the stored element type.

    A block-quantized input (Q8_0, Q4_0) is stored as its raw GGML block rows, unchanged.  F32
    rows are kept as ``store`` says: F16 (rounded to nearest even), Q8_0 (GGML blocks of 32, as
    :func:`kernels.quant.quantize` makes them), or as given (None, F32).
    """

    def __init__(self, store: DType | None = None) -> None:
        self.buf: np.ndarray | None = None
        self.address = 0  # of buf's first element
        self.layout: tuple | None = None  # (leading dims, width, element type) of the rows held
        self.store = store  # F16, Q8_0: F32 rows are kept so; None, F32: as given

    @staticmethod
    def _raw(new: Array) -> tuple[np.ndarray, tuple]:
        """The given rows' array and their layout: (leading dims, logical width, DType)."""
        raw = new.data if isinstance(new, QuantizedArray) else new
        return raw, (new.shape[:-2], new.shape[-1], dtype_of(new))

    def _quantizes(self, new: Array) -> bool:
        """Whether ``new``'s rows are kept as Q8_0 blocks (F32 rows into a Q8_0 cache)."""
        return self.store == DType.Q8_0 and type(new) is np.ndarray and new.dtype == np.float32

    def kept(self, new: Array) -> tuple[np.dtype, int]:
        """The buffer's element type and row length for ``new``'s rows."""
        raw, _ = self._raw(new)
        if self._quantizes(new):
            return np.dtype(np.uint8), raw.shape[-1] // QK * DType.Q8_0.block_bytes
        if self.store == DType.F16 and raw.dtype == np.float32:
            return np.dtype(np.float16), raw.shape[-1]
        return raw.dtype, raw.shape[-1]

    def stored(self, new: Array) -> np.ndarray:
        """``new``'s rows as the buffer keeps them (F16 ones: rounded by the assignment)."""
        if self._quantizes(new):
            return quantize(new, DType.Q8_0).data
        return self._raw(new)[0]

    def check(self, new: Array, held: int, what: str) -> None:
        _, layout = self._raw(new)
        if self._quantizes(new) and new.shape[-1] % QK:
            raise fail("KvCache", f"a KV cache kept in Q8_0 (--kv-dtype q8_0) holds rows in blocks of {QK} "
                                  f"values, but {what} has rows of width {new.shape[-1]} (kv_heads x head_dim), "
                                  f"not a multiple of {QK}: keep this model's caches in f16 or f32")
        if held and layout != self.layout:
            lead, width, dtype = self.layout
            raise fail("KvCache", f"{what} changed from {_describe(lead, width, dtype)} to "
                                  f"{_describe(*layout)} while the cache holds {held} rows "
                                  f"(leading dims, width and dtype must stay; reset() first)")

    def reserve(self, pos: int, new: Array, held: int, grown: Callable[[int, int], int]) -> np.ndarray:
        """The buffer, grown as needed to ``grown(stop, rows it holds now)`` rows (its first
        ``min(pos, held)`` rows kept), with room for ``new``'s rows at ``[pos, pos + T)``, which
        the caller fills."""
        raw, layout = self._raw(new)
        stop = pos + raw.shape[-2]
        if self.buf is None or layout != self.layout:  # first write, or a new layout after reset
            self.buf, self.layout = None, layout
            self._grow(new, grown(stop, 0), keep=0)
        elif stop > self.buf.shape[-2]:
            self._grow(new, grown(stop, self.buf.shape[-2]), keep=min(pos, held))
        return self.buf

    def view(self, stop: int, new: Array) -> Array:
        """Rows ``[0, stop)``, a zero-copy read-only view (consumers must not write into the
        cache), typed as ``new`` (as Q8_0 blocks where F32 rows are kept so)."""
        view = self.buf[..., :stop, :]
        view.flags.writeable = False
        if isinstance(new, QuantizedArray):
            return QuantizedArray(view, new.dtype, (*view.shape[:-1], new.shape[-1]))
        if self._quantizes(new):
            return QuantizedArray(view, DType.Q8_0, (*view.shape[:-1], new.shape[-1]))
        return view

    def _grow(self, new: Array, capacity: int, keep: int) -> None:
        raw, _ = self._raw(new)
        kept, row = self.kept(new)
        buf = arena.empty((*raw.shape[:-2], capacity, row), kept)
        if keep:
            buf[..., :keep, :] = self.buf[..., :keep, :]
        self.buf, self.address = buf, buf.ctypes.data


def _describe(lead, width, dtype) -> str:
    return f"{dtype.name}[{', '.join(map(str, (*lead, 'T', width)))}]"


#: What a KV cache may keep F32 rows as: None (as given, F32), F16, Q8_0.
KV_DTYPES = (None, DType.F32, DType.F16, DType.Q8_0)


class KvStates(dict):
    """A session's KV states, by node, the element type they keep F32 rows in (``dtype``:
    :data:`KV_DTYPES`) and the rows they grow to at most (``ceiling``: :class:`KvState`)."""

    def __init__(self, dtype: DType | None = None, ceiling: int = 0) -> None:
        super().__init__()
        self.dtype, self.ceiling = dtype, ceiling

    def set_ceiling(self, rows: int) -> None:
        """The session's caches grow to at most ``rows`` rows from now on (0: no ceiling)."""
        if rows == self.ceiling:
            return
        self.ceiling = rows
        for state in self.values():
            state.ceiling = rows


class KvState:
    """The K and V accumulators of one KvCache node in one session (the executor owns it).

    ``write(pos, k_new, v_new)`` stores the new rows at ``[pos, pos + T)`` and returns zero-copy,
    read-only views of rows ``[0, pos + T)``.  Rows are keyed by position, so a retried step
    (the same ``pos`` again) overwrites what it wrote before and returns the same result; a
    ``pos`` before the end rewinds the cache to ``pos + T`` rows.  A ``pos`` past the rows held
    would leave a gap and is an error.  ``dtype`` F16 keeps F32 rows as f16 (half the memory;
    numpy's rounding to nearest even, the same bits whoever writes them), read back as f16 views;
    Q8_0 as GGML's blocks of 32 (34 bytes: an f16 scale and 32 int8 codes, 17/32 of F16's memory;
    :func:`kernels.quant.quantize`'s bits, whoever writes them), read back as Q8_0
    :class:`QuantizedArray` views (rows of a width that is not a multiple of 32 are refused);
    None keeps rows as given.

    Memory: the buffers take whole blocks of :data:`KV_BLOCK` rows as the rows written grow, at
    least an eighth more each time (appends stay amortised O(1), at most ~1/8 of a buffer unused),
    and never more than ``ceiling`` rows (the rows the session's request may reach, which the
    scheduler admitted it for; 0: none) unless a write itself goes past it.  ``capacity`` (the
    payload's ``max_seq``) is the first allocation's size; it never limits.
    """

    def __init__(self, capacity: int = 0, dtype: DType | None = None, ceiling: int = 0) -> None:
        if dtype not in KV_DTYPES:
            raise ValueError(f"KV caches store {', '.join(d.name.lower() for d in KV_DTYPES if d)}, not {dtype!r}")
        self.capacity, self.ceiling = capacity, ceiling
        self.dtype = dtype
        self.length = 0  # rows held
        self._k, self._v = _Rows(dtype), _Rows(dtype)

    @classmethod
    def for_op(cls, op: KvCache, dtype: DType | None = None, ceiling: int = 0) -> KvState:
        return cls(op.max_seq, dtype, ceiling)

    def _grown(self, stop: int, now: int) -> int:
        """Rows a buffer holding ``now`` rows grows to for a write reaching row ``stop``."""
        if now == 0 and self.capacity >= stop:
            rows = self.capacity  # the payload's hint, as given
        else:
            rows = -(-max(stop, now + now // 8) // KV_BLOCK) * KV_BLOCK
        return min(rows, max(stop, self.ceiling)) if self.ceiling else rows

    @classmethod
    def held_in(cls, states: dict, key, op: KvCache) -> KvState:
        """``states[key]`` (a session's KV states, by node), made for ``op`` on first use, in the
        element type ``states`` keeps them in (a :class:`KvStates`; a plain dict: as given)."""
        state = states.get(key)
        if state is None:
            state = states[key] = cls.for_op(op, getattr(states, "dtype", None), getattr(states, "ceiling", 0))
        return state

    def write(self, pos: int, k_new: Array, v_new: Array) -> tuple[Array, Array]:
        pos = int(pos)
        k_buf, v_buf = self.reserve(pos, k_new, v_new)
        stop = pos + k_new.shape[-2]
        with np.errstate(over="ignore"):  # kept as F16: beyond +-65504 is +-inf, as in llama.cpp's caches
            k_buf[..., pos:stop, :] = self._k.stored(k_new)
            v_buf[..., pos:stop, :] = self._v.stored(v_new)
        return self.commit(pos, k_new, v_new)

    def reserve(self, pos: int, k_new: Array, v_new: Array) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`write` in two halves, for a caller that stores the rows itself (the numba
        backend's attention chain): check a write of ``k_new`` and ``v_new`` at ``pos`` and make
        room for it (every error :meth:`write` raises, raised here, before anything changes);
        returns the K and V buffers, whose rows ``[pos, pos + T)`` the caller fills before
        :meth:`commit`."""
        if not 0 <= pos <= self.length:
            raise fail("KvCache", f"cannot write rows from position {pos}: the cache holds "
                                  f"{self.length} rows (positions must be contiguous: a write "
                                  f"starts at or before row {self.length})")
        if k_new.shape[:-1] != v_new.shape[:-1]:
            raise fail("KvCache", f"k_new {list(k_new.shape)} and v_new {list(v_new.shape)} must "
                                  f"agree on every dim but the last")
        self._k.check(k_new, self.length, "k_new")
        self._v.check(v_new, self.length, "v_new")
        return (self._k.reserve(pos, k_new, self.length, self._grown),
                self._v.reserve(pos, v_new, self.length, self._grown))

    def room(self, pos: int, rows: int, width: int, kept: DType = DType.F32) -> tuple[int, int, int] | None:
        """(K address, V address, rows each buffer holds) where F32 rows ``[pos, pos + rows)`` of
        ``width`` fit as the buffers are (:meth:`reserve` would change nothing) and the buffers
        keep them as ``kept`` (F32, F16 or Q8_0), else None: a compiled caller's fast check (the
        executor's program), before it writes them itself and :meth:`hold` s them."""
        k, v = self._k, self._v
        if not 0 <= pos <= self.length or k.buf is None or v.buf is None:
            return None
        element = {DType.F16: np.float16, DType.Q8_0: np.uint8}.get(kept, np.float32)
        if k.buf.dtype != element or v.buf.dtype != element:
            return None
        layout = ((), width, DType.F32)
        capacity = min(k.buf.shape[-2], v.buf.shape[-2])
        if k.layout != layout or v.layout != layout or pos + rows > capacity:
            return None
        return k.address, v.address, capacity

    def hold(self, stop: int) -> None:
        """The cache now holds rows up to ``stop`` (written after :meth:`room`)."""
        self.length = stop

    def addresses(self) -> tuple[int, int]:
        """Where the K and V buffers start (after :meth:`reserve`): for a compiled caller taking
        many sessions' caches in one call (the numba backend's attention chain)."""
        return self._k.address, self._v.address

    def commit(self, pos: int, k_new: Array, v_new: Array) -> tuple[Array, Array]:
        """The cache now holds rows up to ``pos + T`` (filled after :meth:`reserve`): their
        zero-copy, read-only views, as :meth:`write` returns them."""
        self.length = stop = pos + k_new.shape[-2]
        return self._k.view(stop, k_new), self._v.view(stop, v_new)

    @property
    def allocated(self) -> int:
        """Rows the buffers can hold before they grow again."""
        return 0 if self._k.buf is None else self._k.buf.shape[-2]

    def nbytes(self) -> tuple[int, int]:
        """Bytes of K and V (rows held, rows the buffers can hold)."""
        held = reserved = 0
        for rows in (self._k, self._v):
            if rows.buf is not None:
                per_row = rows.buf.nbytes // max(rows.buf.shape[-2], 1)
                held, reserved = held + per_row * self.length, reserved + rows.buf.nbytes
        return held, reserved

    def reset(self) -> None:
        """Forget every row; the buffers are kept for the next sequence."""
        self.length = 0

    def copy_prefix(self, src: KvState, rows: int) -> None:
        """Hold the first ``rows`` rows of ``src`` (a cached prompt prefix:
        :mod:`dist_runtime.prefix_cache`), their bytes copied into buffers of this state's own,
        sized as a write of them would size them."""
        if not 0 < rows <= src.length:
            raise ValueError(f"copy_prefix: {rows} rows of a cache holding {src.length}")
        self.dtype = src.dtype
        for mine, theirs in ((self._k, src._k), (self._v, src._v)):
            shape = theirs.buf.shape
            buf = arena.empty((*shape[:-2], self._grown(rows, 0), shape[-1]), theirs.buf.dtype)
            buf[..., :rows, :] = theirs.buf[..., :rows, :]
            mine.buf, mine.address, mine.layout, mine.store = buf, buf.ctypes.data, theirs.layout, theirs.store
        self.length = rows


@register(KvCache)
def _kv_cache(op, inputs, ctx):
    if not isinstance(ctx.state, KvState):
        raise fail("KvCache", f"needs its per-session state in ctx.state (a KvState, made by "
                              f"KvState.for_op(op) once per node and session), got {ctx.state!r}")
    k_new, v_new = inputs
    return ctx.state.write(ctx.pos, k_new, v_new)
