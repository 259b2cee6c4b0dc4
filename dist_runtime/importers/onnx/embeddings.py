"""ONNX Gather as a row lookup (our TokenEmbed)."""

from __future__ import annotations

import math

import numpy as np

from ...ir import ops
from .node import NodeBuilder, checked_axis
from .registry import converter


@converter("Gather", targets=("TokenEmbed",), constants=(1,))
def convert_gather(node, opset, inputs):
    """Gather is a row lookup: our TokenEmbed on ``data`` viewed as a [dim(axis), rest] table
    (Permute and Reshape around it for another axis or rank).  Negative indices wrap in ONNX; our
    TokenEmbed rejects them at run time, so constant indices are normalised here."""
    b = NodeBuilder(node, opset, inputs, ("axis",))
    b.floats(0)
    if b.dtype(1) not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise b.fail(f"indices of type {b.dtype(1)}")
    shape = b.shape(0)
    rank = len(shape)
    axis = checked_axis(b, int(b.attr("axis", 0)), rank)
    rest = shape[:axis] + shape[axis + 1:]
    idx_rank = b.rank(1)
    ids = b.name(1)
    value = b.info(1).value
    if value is not None and (np.asarray(value) < 0).any():
        ids = b.constant("indices", np.where(value < 0, value + shape[axis], value))
    table = b.name(0)
    if axis != 0:
        table = b.emit(ops.Permute(perm=(axis,) + tuple(i for i in range(rank) if i != axis)), [table])
    if len(rest) != 1:
        table = b.emit(ops.Reshape(shape=(shape[axis], math.prod(rest))), [table])
    final = b.out(0) if (len(rest) == 1 and axis == 0) else None
    y = b.emit(ops.TokenEmbed(), [ids, table], final)
    if final:
        return b.done()
    # y is [*I, prod(rest)]: restore the trailing dims, then put the index dims at ``axis``.
    last = axis == 0 or idx_rank == 0
    y = b.emit(ops.Reshape(shape=(0,) * idx_rank + tuple(rest)), [y], b.out(0) if last else None)
    if not last:
        perm = tuple(idx_rank + j for j in range(axis)) + tuple(range(idx_rank)) + tuple(
            idx_rank + j for j in range(axis, len(rest)))
        b.emit(ops.Permute(perm=perm), [y], b.out(0))
    return b.done()
