"""Convolution and pooling: Conv1d, Conv2d, Conv3d, ConvTranspose2d, CausalConv1d, DepthwiseConv, Pool.

docs/ops.md, "Convolution and pooling".  Every convolution (and PatchEmbed, in kernels.resample)
goes through one N-d grouped core, :func:`conv_nd`: the padded input is viewed as sliding windows
(no copy); each chunk of output rows is gathered into an im2col matrix per group and multiplied by
the weight in one batched matmul, so the sums run in f32 (f64) BLAS.  Depthwise convolutions
(one input channel per group) instead multiply-add one tap at a time.  The transposed
convolution is the adjoint: one matmul gives every input pixel's contribution to its output taps,
scattered with one strided add per tap.  Pooling folds max / add over the same window view.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from dist_runtime.ir.ops import (CausalConv1d, Conv1d, Conv2d, Conv3d, ConvTranspose2d, DepthwiseConv,
                                 Pool)

from ._common import as_compute, cast_back, check_vector, compute_dtype, fail
from .registry import register

Pads = Sequence[tuple[int, int]]  # (before, after) per spatial dim


# -- shared helpers ----------------------------------------------------------------------------
def _per_axis(op, name: str) -> tuple[int, ...]:
    """A payload parameter per spatial dim: ``name`` (1-D ops) or ``name_d``, ``name_h``, ``name_w``."""
    if hasattr(op, name):
        return (getattr(op, name),)
    return tuple(getattr(op, f"{name}_{ax}") for ax in "dhw" if hasattr(op, f"{name}_{ax}"))


def _windows(xp: np.ndarray, kernel, stride, dilation) -> np.ndarray:
    """View ``[N, C, *L_out, *kernel]`` of the padded ``xp``: tap u of output l reads ``l*st + u*d``."""
    s = len(kernel)
    span = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))
    view = sliding_window_view(xp, span, axis=tuple(range(2, 2 + s)))
    steps = tuple(slice(None, None, st) for st in stride) + tuple(slice(None, None, d) for d in dilation)
    return view[(slice(None), slice(None)) + steps]


def _out_lengths(name: str, x: np.ndarray, kernel, stride, pads: Pads, dilation) -> tuple[int, ...]:
    """``(L + before + after - d*(k-1) - 1) // st + 1`` per spatial dim, each >= 1."""
    out = []
    for i, (k, st, (p0, p1), d) in enumerate(zip(kernel, stride, pads, dilation)):
        n = (x.shape[2 + i] + p0 + p1 - d * (k - 1) - 1) // st + 1
        if n < 1:
            raise fail(name, f"input {list(x.shape)}: spatial dim {2 + i} of length {x.shape[2 + i]} "
                             f"gives an output length {n} < 1 (kernel {k}, stride {st}, padding "
                             f"{p0}+{p1}, dilation {d})")
        out.append(n)
    return tuple(out)


def _check_groups(name: str, x: np.ndarray, w: np.ndarray, groups: int, transposed: bool) -> None:
    """The channel facts a load-time shape rule may not have seen (an unknown C)."""
    c = x.shape[1]
    if groups < 1 or c % groups:
        raise fail(name, f"groups={groups} does not divide the {c} input channels of {list(x.shape)}")
    if transposed:
        ok, expect = w.shape[0] == c, f"dim 0 == C = {c}"
    else:
        ok = w.shape[1] * groups == c and w.shape[0] % groups == 0
        expect = f"dim 1 == C/groups = {c // groups} and dim 0 a multiple of groups={groups}"
    if not ok:
        raise fail(name, f"weight {list(w.shape)} does not fit input {list(x.shape)}: expected {expect}")


def _prepare(name: str, x: np.ndarray, w: np.ndarray, bias, n_out: int):
    """Inputs in the compute dtype (f64 if any is F64, else f32); the bias checked to be [n_out]."""
    check_vector(name, bias, n_out, "bias")
    dt = compute_dtype(x, w, bias)
    return as_compute(x, dt), as_compute(w, dt), None if bias is None else as_compute(bias, dt)


# -- convolution -------------------------------------------------------------------------------
# im2col elements per matmul: bounds the extra memory of a large image (a VAE decoder's 3x3 conv
# over 128 channels at 512x512 would need a 1.2 GB column matrix at once) to 64 MiB of f32.
_COLS_BUDGET = 1 << 24
# Elements of a partial sum that stays in a core's L2 cache (256 KiB of f32).
_CACHE_ELEMENTS = 1 << 16


def conv_nd(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, *, stride, pads: Pads, dilation,
            groups: int, name: str = "Conv") -> np.ndarray:
    """Grouped N-d convolution (docs/ops.md, the section's formula): ``[N, O, *L_out]``.

    ``x`` is ``[N, C, *L]``, ``w`` ``[O, C/groups, *kernel]``; ``pads`` gives the zeros added
    before and after each spatial dim (CausalConv1d pads one side only).  The result is in the
    compute dtype (f64 if an input is F64, else f32); callers round it to ``x``'s dtype.
    """
    _check_groups(name, x, w, groups, transposed=False)
    x, w, bias = _prepare(name, x, w, bias, w.shape[0])
    kernel = w.shape[2:]
    lengths = _out_lengths(name, x, kernel, stride, pads, dilation)
    xp = np.pad(x, [(0, 0), (0, 0), *pads]) if any(p for pair in pads for p in pair) else x
    win = _windows(xp, kernel, stride, dilation)
    if w.shape[1] == 1 and groups > 1:
        y = _depthwise_taps(win, w, lengths)
    else:
        y = _im2col_matmul(win, w, groups, lengths)
    if bias is not None:
        y += bias.reshape(-1, *(1,) * len(kernel))
    return y


def _im2col_matmul(win: np.ndarray, w: np.ndarray, groups: int, lengths) -> np.ndarray:
    """The window view times the weight, as one batched matmul over groups per chunk of output rows.

    Columns are ordered (c, *u), the weight's own (C/groups, *kernel) order, so the weight needs
    only a reshape.
    """
    n, c = win.shape[:2]
    o, cg, *kernel = w.shape
    s, og, k = len(kernel), o // groups, math.prod(kernel)
    wm = w.reshape(groups, og, cg * k).transpose(0, 2, 1)  # [G, C/g * K, O/g]
    y = np.empty((n, groups, og, *lengths), w.dtype)
    per_row = n * math.prod(lengths[1:]) * c * k  # im2col elements per row of the first spatial dim
    step = max(1, _COLS_BUDGET // max(per_row, 1))
    for r0 in range(0, lengths[0], step):
        part = win[:, :, r0:r0 + step]
        rows = part.shape[2:2 + s]
        cols = part.reshape(n, groups, cg, *rows, *kernel)
        cols = cols.transpose(1, 0, *range(3, 3 + s), 2, *range(3 + s, 3 + 2 * s))
        out = np.matmul(cols.reshape(groups, n * math.prod(rows), cg * k), wm)  # [G, N*P, O/g]
        y[:, :, :, r0:r0 + step] = out.reshape(groups, n, *rows, og).transpose(1, 0, 2 + s, *range(2, 2 + s))
    return y.reshape(n, o, *lengths)


def _depthwise_taps(win: np.ndarray, w: np.ndarray, lengths) -> np.ndarray:
    """groups = C (one input channel per group): a broadcast multiply-add per kernel tap.

    An im2col would copy the input once per tap for matmuls with an inner dim of 1.  The taps are
    summed over blocks of channels whose partial sums stay in cache (~2x faster than whole planes
    on a 7x7 depthwise conv over 256 channels at 56x56).
    """
    n, c = win.shape[:2]
    o, _, *kernel = w.shape
    m = o // c
    wt = w.reshape(c, m, *kernel)
    y = np.empty((n, c, m, *lengths), w.dtype)
    block = max(1, _CACHE_ELEMENTS // max(1, n * m * math.prod(lengths)))
    tap_w = (slice(None), slice(None)) + (None,) * len(kernel)  # [c, m] -> [c, m, 1, ...]
    for c0 in range(0, c, block):
        acc = y[:, c0:c0 + block]
        acc[...] = 0.0
        term = np.empty_like(acc)
        for taps in itertools.product(*map(range, kernel)):
            x_tap = win[(slice(None), slice(c0, c0 + block), Ellipsis, *taps)][:, :, None]
            np.multiply(x_tap, wt[(slice(c0, c0 + block), Ellipsis, *taps)][tap_w], out=term)
            acc += term
    return y.reshape(n, o, *lengths)


def conv(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, *, stride, padding, dilation,
         groups: int = 1, name: str = "Conv") -> np.ndarray:
    """Conv1d/2d/3d (the rank comes from ``x``): ``padding`` zeros on both sides of each spatial dim.

    ``stride``, ``padding`` and ``dilation`` are per spatial dim.  Returns ``[N, O, *L_out]`` in
    ``x``'s dtype.
    """
    y = conv_nd(x, w, bias, stride=stride, pads=[(p, p) for p in padding], dilation=dilation,
                groups=groups, name=name)
    return cast_back(y, x)


def causal_conv1d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, *, dilation: int = 1,
                  groups: int = 1) -> np.ndarray:
    """Stride-1 Conv1d after ``(kernel-1)*dilation`` zeros on the left only: ``[N, O, L]``."""
    left = (w.shape[2] - 1) * dilation
    y = conv_nd(x, w, bias, stride=(1,), pads=[(left, 0)], dilation=(dilation,), groups=groups,
                name="CausalConv1d")
    return cast_back(y, x)


def depthwise_conv(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, *, stride, padding,
                   dilation) -> np.ndarray:
    """Conv2d with ``groups = C``: weight ``[C*m, 1, kh, kw]``, output channel o reads ``o // m``."""
    c = x.shape[1]
    if w.shape[1] != 1 or c == 0 or w.shape[0] % c:
        raise fail("DepthwiseConv", f"weight {list(w.shape)} must be [C*m, 1, kh, kw] for C = {c} "
                                    f"(input {list(x.shape)})")
    return conv(x, w, bias, stride=stride, padding=padding, dilation=dilation, groups=c,
                name="DepthwiseConv")


def conv_transpose(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, *, stride, padding,
                   output_padding, dilation, groups: int = 1,
                   name: str = "ConvTranspose") -> np.ndarray:
    """The adjoint of the N-d convolution: ``x`` ``[N, C, *L]``, ``w`` ``[C, O/groups, *kernel]``.

    Input element (c, i) adds ``x * w[c, o', u]`` to output ``i*stride - padding + u*dilation`` of
    channel ``g*O/groups + o'``; positions outside the output are dropped.  Returns
    ``[N, O, *L_out]`` with ``L_out = (L-1)*stride - 2*padding + dilation*(k-1) + output_padding + 1``.
    """
    _check_groups(name, x, w, groups, transposed=True)
    n, c, *lin = x.shape
    _, og, *kernel = w.shape
    o = og * groups
    xc, wc, bc = _prepare(name, x, w, bias, o)
    lout = []
    for i, (length, k, st, p, e, d) in enumerate(zip(lin, kernel, stride, padding, output_padding, dilation)):
        m = (length - 1) * st - 2 * p + d * (k - 1) + e + 1
        if m < 1:
            raise fail(name, f"input {list(x.shape)}: spatial dim {2 + i} of length {length} gives an "
                             f"output length {m} < 1")
        lout.append(m)
    s, cg, k = len(kernel), c // groups, math.prod(kernel)
    # Scatter onto a canvas indexed by "full" output position (before cropping `padding`); it must
    # also reach padding + L_out, past the taps, where output_padding adds bias-only rows.
    canvas_len = [max((length - 1) * st + d * (kk - 1) + 1, p + m)
                  for length, kk, st, d, p, m in zip(lin, kernel, stride, dilation, padding, lout)]
    canvas = np.zeros((groups, n, *canvas_len, og), xc.dtype)
    xg = xc.reshape(n, groups, cg, *lin).transpose(1, 0, *range(3, 3 + s), 2)  # [G, N, *L, C/g]
    wg = wc.reshape(groups, cg, og * k)
    # Chunks of input rows bound the contributions' memory (input pixels x O x taps).
    step = max(1, _COLS_BUDGET // max(1, n * math.prod(lin[1:]) * o * k))
    for r0 in range(0, lin[0], step):
        part = xg[:, :, r0:r0 + step]
        rows = part.shape[2:2 + s]
        # Each input pixel's contribution to each of its taps: [G, N, *rows, O/g, *kernel].
        contrib = np.matmul(part.reshape(groups, n * math.prod(rows), cg), wg)
        contrib = contrib.reshape(groups, n, *rows, og, *kernel)
        starts = (r0 * stride[0],) + (0,) * (s - 1)
        for taps in itertools.product(*map(range, kernel)):
            dst = tuple(slice(b + u * d, b + u * d + (r - 1) * st + 1, st)
                        for b, u, d, r, st in zip(starts, taps, dilation, rows, stride))
            canvas[(slice(None), slice(None), *dst)] += contrib[(Ellipsis, *taps)]
    crop = tuple(slice(p, p + m) for p, m in zip(padding, lout))
    y = canvas[(slice(None), slice(None), *crop)]  # [G, N, *L_out, O/g]
    y = np.ascontiguousarray(y.transpose(1, 0, 2 + s, *range(2, 2 + s))).reshape(n, o, *lout)
    if bc is not None:
        y += bc.reshape(o, *(1,) * s)
    return cast_back(y, x)


# -- pooling -----------------------------------------------------------------------------------
def pool(x: np.ndarray, *, mode: str, kernel, stride, padding) -> np.ndarray:
    """Max or average pooling over the last ``len(kernel)`` dims of ``x`` ``[N, C, *L]`` (floor mode).

    max: padding counts as -inf (NaN propagates); avg: the in-bounds elements' mean (padding is
    excluded from the count, ONNX ``count_include_pad=0``).
    """
    xc = as_compute(x, compute_dtype(x))
    pads = [(p, p) for p in padding]
    lengths = _out_lengths("Pool", xc, kernel, stride, pads, [1] * len(kernel))
    if mode == "max":
        xp = np.pad(xc, [(0, 0), (0, 0), *pads], constant_values=-np.inf)
        y = _reduce_taps(np.maximum, _windows(xp, kernel, stride, [1] * len(kernel)))
    elif mode == "avg":
        xp = np.pad(xc, [(0, 0), (0, 0), *pads])
        y = _reduce_taps(np.add, _windows(xp, kernel, stride, [1] * len(kernel)))
        y /= _window_counts(xc.shape[2:], lengths, kernel, stride, padding).astype(xc.dtype)
    else:
        raise fail("Pool", f"mode {mode!r} is not 'max' or 'avg'")
    return cast_back(y, x)


def _reduce_taps(ufunc, win: np.ndarray) -> np.ndarray:
    """``ufunc`` folded over the taps of each window, one strided ``[N, C, *L_out]`` view per tap
    (a few times faster than reducing the window axes of the view; np.maximum keeps NaN)."""
    s = (win.ndim - 2) // 2
    taps = itertools.product(*map(range, win.shape[-s:]))
    y = win[(Ellipsis, *next(taps))].copy()
    for t in taps:
        ufunc(y, win[(Ellipsis, *t)], out=y)
    return y


def _window_counts(shape, lengths, kernel, stride, padding) -> np.ndarray:
    """In-bounds elements per window: a product of per-axis counts (the window is a box)."""
    counts = np.ones((), np.int64)
    for length, m, k, st, p in zip(shape, lengths, kernel, stride, padding):
        start = np.arange(m) * st - p
        per_axis = np.minimum(start + k, length) - np.maximum(start, 0)
        counts = np.multiply.outer(counts, per_axis)
    return counts


# -- registered kernels ------------------------------------------------------------------------
def _conv_inputs(op, inputs):
    """(x, weight, bias or None) of a convolution node; the weight's trailing dims must be the
    payload's kernel (checked at load time, unless the weight is computed at run time)."""
    x, w, *bias = inputs
    kernel = _per_axis(op, "kernel")
    if tuple(w.shape[2:]) != kernel:
        raise fail(type(op).__name__, f"weight {list(w.shape)} does not end in the kernel {list(kernel)}")
    return x, w, bias[0] if bias else None


def _window_fields(op) -> dict:
    return {f: _per_axis(op, f) for f in ("stride", "padding", "dilation")}


@register(Conv1d)
@register(Conv2d)
@register(Conv3d)
def _conv(op, inputs, ctx):
    return (conv(*_conv_inputs(op, inputs), **_window_fields(op), groups=op.groups, name=type(op).__name__),)


@register(DepthwiseConv)
def _depthwise_conv(op, inputs, ctx):
    return (depthwise_conv(*_conv_inputs(op, inputs), **_window_fields(op)),)


@register(CausalConv1d)
def _causal_conv1d(op, inputs, ctx):
    return (causal_conv1d(*_conv_inputs(op, inputs), dilation=op.dilation, groups=op.groups),)


@register(ConvTranspose2d)
def _conv_transpose2d(op, inputs, ctx):
    return (conv_transpose(*_conv_inputs(op, inputs), **_window_fields(op),
                           output_padding=_per_axis(op, "output_padding"), groups=op.groups,
                           name="ConvTranspose2d"),)


_POOL_MODES = {0: "max", 1: "avg"}


@register(Pool)
def _pool(op, inputs, ctx):
    (x,) = inputs
    fields = [_per_axis(op, f) for f in ("kernel", "stride", "padding")]
    if x.ndim == 3:  # 1-D pooling along L: the *_w fields (the *_h ones are trivial, checked at load)
        fields = [f[1:] for f in fields]
    kernel, stride, padding = fields
    return (pool(x, mode=_POOL_MODES.get(op.mode, op.mode), kernel=kernel, stride=stride,
                 padding=padding),)
