"""ONNX layout operators: Transpose, Reshape, Flatten, Squeeze/Unsqueeze, Concat and Split."""

from __future__ import annotations

import math
from typing import Sequence

from ...ir import ops
from .node import NodeBuilder, checked_axis, ints
from .registry import converter


@converter("Transpose", targets=("Permute", "Transpose"))
def convert_transpose(node, opset, inputs):
    """A swap of two axes is our Transpose, any other permutation our Permute."""
    b = NodeBuilder(node, opset, inputs, ("perm",))
    b.plain(0)
    rank = b.rank(0)
    perm = tuple(b.attr("perm", range(rank - 1, -1, -1)))
    if sorted(perm) != list(range(rank)):
        raise b.fail(f"perm {list(perm)} is not a permutation of {rank} axes")
    moved = [i for i, p in enumerate(perm) if p != i]
    if len(moved) == 2:
        b.emit(ops.Transpose(dim0=moved[0], dim1=moved[1]), [b.name(0)], b.out(0))
    else:
        b.emit(ops.Permute(perm=perm), [b.name(0)], b.out(0))
    return b.done()


@converter("Reshape", targets=("Reshape",), constants=(1,))
def convert_reshape(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("allowzero", "shape", "consumed_inputs"))
    b.plain(0)
    shape = ints(b.attr("shape") if opset < 5 else b.const(1, "the target shape"))
    if b.attr("allowzero", 0) and 0 in shape:
        raise b.fail("allowzero=1 with a 0 in the shape (a real zero-length dim); our Reshape copies "
                     "the input dim for a 0")
    b.emit(ops.Reshape(shape=shape), [b.name(0)], b.out(0))
    return b.done()


def _static_reshape(b: NodeBuilder, x: int, target: Sequence[int]) -> None:
    b.plain(x)
    b.emit(ops.Reshape(shape=tuple(int(d) for d in target)), [b.name(x)], b.out(0))


@converter("Flatten", targets=("Reshape",))
def convert_flatten(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("axis",))
    shape = b.shape(0)
    axis = b.attr("axis", 1)
    axis = axis % len(shape) if axis < 0 else axis
    if axis > len(shape):
        raise b.fail(f"axis={axis} exceeds the rank {len(shape)}")
    _static_reshape(b, 0, (math.prod(shape[:axis]), math.prod(shape[axis:])))
    return b.done()


@converter("Squeeze", "Unsqueeze", targets=("Reshape",), constants=(1,))
def convert_squeeze(node, opset, inputs):
    """Squeeze / Unsqueeze of a static shape: a Reshape to the resulting shape."""
    b = NodeBuilder(node, opset, inputs, ("axes",))
    shape = b.shape(0)
    if opset >= 13:
        axes = ints(b.const(1, "axes")) if b.has(1) else None
    else:
        axes = b.attr("axes")
    if node.op_type == "Squeeze":
        if axes is None:
            out = [d for d in shape if d != 1]
        else:
            drop = {checked_axis(b, a, len(shape)) for a in axes}
            if any(shape[a] != 1 for a in drop):
                raise b.fail(f"axes {list(axes)} of {list(shape)} are not all 1")
            out = [d for i, d in enumerate(shape) if i not in drop]
    else:
        if axes is None:
            raise b.fail("axes are required")
        rank = len(shape) + len(axes)
        where = sorted(checked_axis(b, a, rank) for a in axes)
        dims = iter(shape)
        out = [1 if i in where else next(dims) for i in range(rank)]
    _static_reshape(b, 0, out)
    return b.done()


@converter("Concat", targets=("Concat",))
def convert_concat(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("axis",))
    for i in range(len(inputs)):
        b.plain(i)
    if b.attr("axis") is None:
        raise b.fail("axis is required")
    b.emit(ops.Concat(dim=int(b.attr("axis"))), [b.name(i) for i in range(len(inputs))], b.out(0))
    return b.done()


@converter("Split", targets=("Split", "Chunk"), constants=(1,))
def convert_split(node, opset, inputs):
    """Explicit sizes are our Split; an equal split our Chunk (a Split when the last piece is
    smaller, opset 18's num_outputs)."""
    b = NodeBuilder(node, opset, inputs, ("axis", "split", "num_outputs"))
    b.plain(0)
    axis = int(b.attr("axis", 0))
    n_out = len(node.output)
    if any(not o for o in node.output):
        raise b.fail("an omitted output of Split")
    sizes = None
    if opset < 13 and b.attr("split") is not None:
        sizes = tuple(b.attr("split"))
    elif opset >= 13 and b.has(1):
        sizes = ints(b.const(1, "split"))
    if sizes is not None:
        if len(sizes) != n_out:
            raise b.fail(f"{len(sizes)} split sizes for {n_out} outputs")
        b.emit(ops.Split(dim=axis, sizes=sizes), [b.name(0)], list(node.output))
        return b.done()
    n = int(b.attr("num_outputs", n_out))
    if n != n_out:
        raise b.fail(f"num_outputs={n} but {n_out} outputs")
    shape = b.info(0).shape
    length = shape[checked_axis(b, axis, len(shape))] if shape is not None else None
    if length is None or length % n == 0:
        b.emit(ops.Chunk(dim=axis, chunks=n), [b.name(0)], list(node.output))
    else:
        if opset < 18:
            raise b.fail(f"an equal split of length {length} into {n} pieces")
        piece = -(-length // n)
        sizes = tuple(min(piece, max(0, length - i * piece)) for i in range(n))
        b.emit(ops.Split(dim=axis, sizes=sizes), [b.name(0)], list(node.output))
    return b.done()
