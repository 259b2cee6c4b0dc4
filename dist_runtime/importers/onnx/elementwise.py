"""Elementwise ONNX operators: arithmetic, Clip, activations, Softmax and ArgMax."""

from __future__ import annotations

import math

from ...ir import ops
from .node import NodeBuilder, attr_f32, checked_axis, f32_exact
from .registry import TARGETS, converter


_BINARY = {"Add": ops.Add, "Sub": ops.Sub, "Mul": ops.Mul, "Div": ops.Div}


@converter("Add", "Sub", "Mul", "Div", targets=("Add", "Sub", "Mul", "Div"))
def convert_binary(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("broadcast", "axis", "consumed_inputs"))
    if b.attr("axis") is not None and b.attr("broadcast", 0):
        raise b.fail("legacy broadcasting along an axis (opset < 7 'axis') is not numpy broadcasting")
    b.floats(0, 1)
    b.emit(_BINARY[node.op_type](), [b.name(0), b.name(1)], b.out(0))
    return b.done()


TARGETS["Add"], TARGETS["Sub"], TARGETS["Mul"], TARGETS["Div"] = ("Add",), ("Sub",), ("Mul",), ("Div",)


@converter("Clip", targets=("Clamp",), constants=(1, 2))
def convert_clip(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("min", "max"))
    b.floats(0)
    if opset < 11:
        lo, hi = b.attr("min", -math.inf), b.attr("max", math.inf)
    else:
        lo = b.const(1, "min").item() if b.has(1) else -math.inf
        hi = b.const(2, "max").item() if b.has(2) else math.inf
    b.emit(ops.Clamp(min=f32_exact(b, lo, "min"), max=f32_exact(b, hi, "max")), [b.name(0)], b.out(0))
    return b.done()


_UNARY = {"Relu": ops.Relu, "Sigmoid": ops.Sigmoid, "Tanh": ops.Tanh}


@converter("Relu", "Sigmoid", "Tanh", targets=())
def convert_unary(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("consumed_inputs",))
    b.floats(0)
    b.emit(_UNARY[node.op_type](), [b.name(0)], b.out(0))
    return b.done()


for _t in _UNARY:
    TARGETS[_t] = (_t,)


@converter("LeakyRelu", targets=("LeakyRelu",))
def convert_leaky_relu(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("alpha", "consumed_inputs"))
    b.floats(0)
    b.emit(ops.LeakyRelu(alpha=attr_f32(b, "alpha", 0.01)), [b.name(0)], b.out(0))
    return b.done()


@converter("PRelu", targets=("PRelu",))
def convert_prelu(node, opset, inputs):
    """Since opset 7 the slope broadcasts unidirectionally, as ours; before, a slope of C values
    applies along the channel dim 1 (reshaped to [C, 1, ..., 1] here)."""
    b = NodeBuilder(node, opset, inputs, ("consumed_inputs",))
    b.floats(0, 1)
    slope = b.name(1)
    if opset < 7:
        x_rank, s_shape = b.rank(0), b.shape(1)
        if len(s_shape) == 1 and s_shape[0] > 1 and x_rank > 2:
            slope = b.emit(ops.Reshape(shape=(s_shape[0],) + (1,) * (x_rank - 2)), [slope])
    b.emit(ops.PRelu(), [b.name(0), slope], b.out(0))
    return b.done()


@converter("Gelu", targets=("Gelu",))
def convert_gelu(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("approximate",))
    b.floats(0)
    approximate = b.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise b.fail(f"approximate={approximate!r}")
    b.emit(ops.Gelu(approximate=approximate == "tanh"), [b.name(0)], b.out(0))
    return b.done()


def _swish(b: NodeBuilder, x: str, alpha: float, dtype, out: str | None) -> str:
    """x * sigmoid(alpha * x): our Silu when alpha = 1, else Mul, Sigmoid, Mul."""
    if alpha == 1.0:
        return b.emit(ops.Silu(), [x], out)
    scaled = b.emit(ops.Mul(), [x, b.scalar("alpha", alpha, dtype)])
    return b.emit(ops.Mul(), [x, b.emit(ops.Sigmoid(), [scaled])], out)


@converter("Swish", targets=("Silu",))
def convert_swish(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("alpha",))
    dtype = b.floats(0)
    _swish(b, b.name(0), float(b.attr("alpha", 1.0)), dtype, b.out(0))
    return b.done()


@converter("SwiGLU", targets=("SwiGlu",))
def convert_swiglu(node, opset, inputs):
    """Y = A * sigmoid(alpha * A) * B: our two-input SwiGlu (gate = A, up = B) when alpha = 1."""
    b = NodeBuilder(node, opset, inputs, ("alpha",))
    dtype = b.floats(0, 1)
    if b.info(0).shape != b.info(1).shape:
        raise b.fail("A and B must have the same shape (ONNX does not broadcast)")
    alpha = float(b.attr("alpha", 1.0))
    if alpha == 1.0:
        b.emit(ops.SwiGlu(), [b.name(0), b.name(1)], b.out(0))
    else:
        b.emit(ops.Mul(), [_swish(b, b.name(0), alpha, dtype, None), b.name(1)], b.out(0))
    return b.done()


@converter("Softmax", targets=("Softmax",))
def convert_softmax(node, opset, inputs):
    """Opset >= 13: softmax along ``axis``.  Before 13 the input is flattened to 2-D at ``axis``
    and normalised over everything after it: Reshape, Softmax(-1), Reshape back."""
    b = NodeBuilder(node, opset, inputs, ("axis",))
    b.floats(0)
    rank = b.rank(0)
    if opset >= 13:
        b.emit(ops.Softmax(dim=int(b.attr("axis", -1))), [b.name(0)], b.out(0))
        return b.done()
    axis = checked_axis(b, int(b.attr("axis", 1)), rank)
    if axis == rank - 1:
        b.emit(ops.Softmax(dim=-1), [b.name(0)], b.out(0))
        return b.done()
    shape = b.shape(0)
    flat = b.emit(ops.Reshape(shape=(0,) * axis + (-1,)), [b.name(0)])
    y = b.emit(ops.Softmax(dim=-1), [flat])
    b.emit(ops.Reshape(shape=(0,) * axis + shape[axis:]), [y], b.out(0))
    return b.done()


@converter("ArgMax", targets=("Argmax",))
def convert_argmax(node, opset, inputs):
    """Our Argmax reduces the last dim: a Permute moves ``axis`` there, a Reshape restores it as
    1 for ``keepdims``.  ``select_last_index=1`` has no counterpart (ours picks the first)."""
    b = NodeBuilder(node, opset, inputs, ("axis", "keepdims", "select_last_index"))
    b.floats(0)
    if b.attr("select_last_index", 0):
        raise b.fail("select_last_index=1: our Argmax returns the first index of the maximum")
    rank = b.rank(0)
    axis = checked_axis(b, int(b.attr("axis", 0)), rank)
    keep = bool(b.attr("keepdims", 1))
    x = b.name(0)
    if axis != rank - 1:
        x = b.emit(ops.Permute(perm=tuple(i for i in range(rank) if i != axis) + (axis,)), [x])
    if not keep:
        b.emit(ops.Argmax(), [x], b.out(0))
        return b.done()
    y = b.emit(ops.Argmax(), [x])
    shape = list(b.shape(0))
    shape[axis] = 1
    b.emit(ops.Reshape(shape=tuple(shape)), [y], b.out(0))
    return b.done()
