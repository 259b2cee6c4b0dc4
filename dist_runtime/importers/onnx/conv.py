"""ONNX convolutions and pooling: Conv, ConvTranspose, CausalConvWithState, Max/Average and
global pooling."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...ir import ops
from .node import NodeBuilder
from .registry import converter


def _same_pads(b: NodeBuilder, auto_pad: str, lengths, kernel, strides, dilations) -> list[tuple[int, int]]:
    """(begin, end) padding per spatial axis for ``auto_pad`` SAME_UPPER / SAME_LOWER."""
    pads = []
    for n, k, s, d in zip(lengths, kernel, strides, dilations):
        out = -(-n // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - n)
        small, big = total // 2, total - total // 2
        pads.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    return pads


def _window_pads(b: NodeBuilder, x: int, kernel, strides, dilations) -> list[tuple[int, int]]:
    """(begin, end) padding per spatial axis from ``auto_pad`` / ``pads``."""
    s = len(kernel)
    auto_pad = b.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return _same_pads(b, auto_pad, b.shape(x, " to resolve SAME padding")[2:], kernel, strides, dilations)
    if auto_pad == "VALID":
        return [(0, 0)] * s
    if auto_pad != "NOTSET":
        raise b.fail(f"auto_pad={auto_pad!r}")
    pads = list(b.attr("pads", [0] * (2 * s)))
    if len(pads) != 2 * s:
        raise b.fail(f"pads {pads} do not have 2 entries per spatial axis")
    return list(zip(pads[:s], pads[s:]))


def _symmetric(b: NodeBuilder, pads: list[tuple[int, int]]) -> tuple[int, ...]:
    if any(lo != hi for lo, hi in pads):
        raise b.fail(f"asymmetric padding (begin, end) = {pads}: our payload pads both sides equally "
                     f"(an importer would need an explicit Pad op, which we do not have)")
    return tuple(lo for lo, _ in pads)


def _per_axis(names: Sequence[str], values: Sequence[int]) -> dict[str, int]:
    return dict(zip(names, values))


_AXES = {1: ("",), 2: ("_h", "_w"), 3: ("_d", "_h", "_w")}


@converter("Conv", targets=("Conv1d", "Conv2d", "Conv3d", "DepthwiseConv"))
def convert_conv(node, opset, inputs):
    """Conv1d / Conv2d / Conv3d by the spatial rank; a 2-D conv with one input channel per group
    (group = C) is our DepthwiseConv."""
    b = NodeBuilder(node, opset, inputs, ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
    b.floats(0, 1, 2)
    w_shape = b.shape(1)
    s = len(w_shape) - 2
    if s not in _AXES or b.rank(0) != s + 2:
        raise b.fail(f"{s}-D convolution")
    kernel, strides, dilations = _conv_geometry(b, w_shape)
    pads = _symmetric(b, _window_pads(b, 0, kernel, strides, dilations))
    group = int(b.attr("group", 1))
    names = [b.name(i) for i in range(3) if b.has(i)]
    channels = b.info(0).shape[1]
    if s == 2 and group > 1 and channels == group and w_shape[1] == 1:
        op = ops.DepthwiseConv(kernel_h=kernel[0], kernel_w=kernel[1], stride_h=strides[0], stride_w=strides[1],
                               padding_h=pads[0], padding_w=pads[1], dilation_h=dilations[0],
                               dilation_w=dilations[1])
    else:
        suffixes = _AXES[s]
        fields = {}
        for prefix, values in (("kernel", kernel), ("stride", strides), ("padding", pads),
                               ("dilation", dilations)):
            fields.update(_per_axis([prefix + x for x in suffixes], values))
        op = {1: ops.Conv1d, 2: ops.Conv2d, 3: ops.Conv3d}[s](**fields, groups=group)
    b.emit(op, names, b.out(0))
    return b.done()


def _conv_geometry(b: NodeBuilder, w_shape) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(kernel, strides, dilations) of a Conv/ConvTranspose; ``kernel_shape``, when given, must be
    the weight's spatial shape."""
    s = len(w_shape) - 2
    kernel = tuple(b.attr("kernel_shape", w_shape[2:]))
    if kernel != tuple(w_shape[2:]):
        raise b.fail(f"kernel_shape {list(kernel)} differs from the weight's {list(w_shape[2:])}")
    return kernel, tuple(b.attr("strides", [1] * s)), tuple(b.attr("dilations", [1] * s))


@converter("ConvTranspose", targets=("ConvTranspose2d",))
def convert_conv_transpose(node, opset, inputs):
    """ConvTranspose2d; a 1-D one runs as 2-D with a unit height (Reshape around it).

    ONNX crops ``begin`` rows at the start and produces ``out`` rows; ours crops ``padding`` at both
    ends of the full output and appends ``output_padding`` rows (bias only) at the end, so it
    matches when ``padding = begin`` and ``0 <= output_padding = out - (full - 2 begin) < max(stride,
    dilation)``.
    """
    b = NodeBuilder(node, opset, inputs, ("auto_pad", "dilations", "group", "kernel_shape", "output_padding",
                                     "output_shape", "pads", "strides"))
    b.floats(0, 1, 2)
    x_shape, w_shape = b.shape(0), b.shape(1)
    s = len(w_shape) - 2
    if s not in (1, 2) or len(x_shape) != s + 2:
        raise b.fail(f"{s}-D transposed convolution: we have ConvTranspose2d only")
    kernel, strides, dilations = _conv_geometry(b, w_shape)
    extra = tuple(b.attr("output_padding", [0] * s))
    output_shape = b.attr("output_shape")
    auto_pad = b.attr("auto_pad", "NOTSET")
    lengths = x_shape[2:]
    full = [st * (n - 1) + (k - 1) * d + 1 for n, k, st, d in zip(lengths, kernel, strides, dilations)]
    if b.attr("pads") is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = output_shape or [n * st for n, st in zip(lengths, strides)]
        begins = []
        for f, e, t in zip(full, extra, target):
            total = f + e - t
            begins.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
        outs = list(target)
    else:
        if auto_pad not in ("NOTSET", "VALID"):
            raise b.fail(f"auto_pad={auto_pad!r}")
        pads = list(b.attr("pads", [0] * (2 * s)))
        begins, ends = pads[:s], pads[s:]
        outs = list(output_shape) if output_shape else [f + e - lo - hi for f, e, lo, hi in
                                                         zip(full, extra, begins, ends)]
    if len(outs) != s:
        raise b.fail(f"output_shape {list(outs)} does not give one length per spatial axis")
    fields = {} if s == 2 else dict(kernel_h=1, stride_h=1, dilation_h=1, padding_h=0, output_padding_h=0)
    for i, ax in enumerate(("h", "w")[2 - s:]):
        begin, out, f, st, d = begins[i], outs[i], full[i], strides[i], dilations[i]
        tail = out - (f - 2 * begin)
        if begin < 0 or not 0 <= tail < max(st, d):
            raise b.fail(f"the output window (crop {begin} at the start, {out} long, of a full output "
                         f"of {f}) is not a symmetric crop plus output_padding < max(stride, dilation)")
        fields.update({f"padding_{ax}": begin, f"output_padding_{ax}": tail, f"kernel_{ax}": kernel[i],
                       f"stride_{ax}": st, f"dilation_{ax}": d})
    group = int(b.attr("group", 1))
    if s == 2:
        b.emit(ops.ConvTranspose2d(**fields, groups=group), [b.name(i) for i in range(3) if b.has(i)], b.out(0))
        return b.done()
    x = b.emit(ops.Reshape(shape=(0, 0, 1, -1)), [b.name(0)])
    w = b.emit(ops.Reshape(shape=(0, 0, 1, -1)), [b.name(1)])
    y = b.emit(ops.ConvTranspose2d(**fields, groups=group), [x, w] + ([b.name(2)] if b.has(2) else []))
    b.emit(ops.Reshape(shape=(0, 0, -1)), [y], b.out(0))
    return b.done()


@converter("CausalConvWithState", targets=("CausalConv1d", "Conv1d"))
def convert_causal_conv_with_state(node, opset, inputs):
    """Depthwise causal conv of [B, C, L] with weight [C, 1, k].  Without past_state: our
    CausalConv1d (zeros on the left); with it: Conv1d (no padding) over Concat(past_state, x).
    present_state is the last k-1 steps of that padded input (a Split).  activation silu/swish adds
    a Silu."""
    b = NodeBuilder(node, opset, inputs, ("activation",))
    b.floats(0, 1, 2, 3)
    activation = b.attr("activation", "none")
    if activation not in ("none", "silu", "swish"):
        raise b.fail(f"activation={activation!r}")
    x_shape, w_shape = b.shape(0), b.shape(1)
    if len(x_shape) != 3 or len(w_shape) != 3 or w_shape[1] != 1 or w_shape[0] != x_shape[1]:
        raise b.fail(f"input {list(x_shape)} and weight {list(w_shape)} are not [B, C, L] and [C, 1, k]")
    batch, channels, length = x_shape
    k = w_shape[2]
    bias = [b.name(2)] if b.has(2) else []
    final = b.out(0) if activation == "none" else None
    if b.has(3):
        padded = b.emit(ops.Concat(dim=-1), [b.name(3), b.name(0)])
        y = b.emit(ops.Conv1d(kernel=k, groups=channels), [padded, b.name(1), *bias], final)
    else:
        padded = None
        y = b.emit(ops.CausalConv1d(kernel=k, groups=channels), [b.name(0), b.name(1), *bias], final)
    if activation != "none":
        b.emit(ops.Silu(), [y], b.out(0))
    if b.out(1):
        if padded is None:
            if length >= k - 1:
                padded, total = b.name(0), length
            else:
                zeros = b.constant("zeros", np.zeros((batch, channels, k - 1), b.dtype(0)))
                padded, total = b.emit(ops.Concat(dim=-1), [zeros, b.name(0)]), length + k - 1
        else:
            total = length + k - 1
        b.emit(ops.Split(dim=-1, sizes=(total - (k - 1), k - 1)), [padded], [None, b.out(1)])
    return b.done()


def _pool_geometry(b: NodeBuilder, kernel, ceil_mode: bool, count_include_pad: bool):
    """Strides and symmetric paddings of an ONNX pooling node, or UnsupportedOnnxError."""
    s = len(kernel)
    strides = tuple(b.attr("strides", [1] * s))
    dilations = tuple(b.attr("dilations", [1] * s))
    if any(d != 1 for d in dilations):
        raise b.fail(f"dilations {list(dilations)}: our Pool has no dilation")
    pads = _window_pads(b, 0, kernel, strides, dilations)
    if ceil_mode:
        lengths = b.shape(0, " to resolve ceil_mode")[2:]
        for n, k, st, (lo, hi) in zip(lengths, kernel, strides, pads):
            floor = (n + lo + hi - k) // st + 1
            ceil = -(-(n + lo + hi - k) // st) + 1
            if (ceil - 1) * st >= n + lo:  # ONNX drops a last window that starts in the end padding
                ceil -= 1
            if ceil != floor:
                raise b.fail(f"ceil_mode=1 gives {ceil} windows where floor mode gives {floor}; our Pool "
                             f"uses floor mode")
    padding = _symmetric(b, pads)
    for k, p in zip(kernel, padding):
        if 2 * p > k:
            raise b.fail(f"padding {p} is more than half the kernel {k} (as torch, our Pool allows at "
                         f"most half)")
    if count_include_pad and any(padding):
        raise b.fail("count_include_pad=1 with padding: our average pooling excludes the padding")
    return strides, padding


def _emit_pool(b: NodeBuilder, mode: int, kernel, strides, padding) -> None:
    if len(kernel) == 1:
        op = ops.Pool(mode=mode, kernel_h=1, kernel_w=kernel[0], stride_w=strides[0], padding_w=padding[0])
    elif len(kernel) == 2:
        op = ops.Pool(mode=mode, kernel_h=kernel[0], kernel_w=kernel[1], stride_h=strides[0],
                      stride_w=strides[1], padding_h=padding[0], padding_w=padding[1])
    else:
        raise b.fail(f"{len(kernel)}-D pooling: our Pool pools 1-D ([N, C, L]) and 2-D ([N, C, H, W]) only")
    b.emit(op, [b.name(0)], b.out(0))


@converter("MaxPool", "AveragePool", targets=("Pool",))
def convert_pool(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("auto_pad", "ceil_mode", "count_include_pad", "dilations",
                                     "kernel_shape", "pads", "storage_order", "strides"))
    b.floats(0)
    b.only_outputs(1, "MaxPool's Indices output has no counterpart")
    kernel = tuple(b.attr("kernel_shape", ()))
    if not kernel or b.rank(0) != len(kernel) + 2:
        raise b.fail("kernel_shape must give one length per spatial axis")
    if len(kernel) > 2:
        raise b.fail(f"{len(kernel)}-D pooling: our Pool pools 1-D ([N, C, L]) and 2-D ([N, C, H, W]) only")
    strides, padding = _pool_geometry(b, kernel, bool(b.attr("ceil_mode", 0)),
                                      bool(b.attr("count_include_pad", 0)))
    _emit_pool(b, 0 if node.op_type == "MaxPool" else 1, kernel, strides, padding)
    return b.done()


@converter("GlobalMaxPool", "GlobalAveragePool", targets=("Pool",))
def convert_global_pool(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs)
    b.floats(0)
    kernel = b.shape(0, " (the window is the whole spatial extent)")[2:]
    if not 1 <= len(kernel) <= 2:
        raise b.fail(f"{len(kernel)}-D pooling: our Pool pools 1-D and 2-D only")
    _emit_pool(b, 0 if node.op_type == "GlobalMaxPool" else 1, kernel, (1,) * len(kernel), (0,) * len(kernel))
    return b.done()
