"""ONNX QuantizeLinear and DequantizeLinear."""

from __future__ import annotations

import math

import numpy as np
from onnx import helper

from ...dtypes import DType
from ...ir import ops
from .node import FLOATS, NodeBuilder, checked_axis
from .registry import converter


_LINEAR_TYPES = {np.dtype(np.int8): DType.I8, np.dtype(np.uint8): DType.U8}


def _linear_axis(b: NodeBuilder, x_rank: int, scale_i: int) -> int:
    """Our payload axis: -1 for a per-tensor scale ([] or [1]), else ONNX's ``axis``."""
    if b.attr("block_size", 0):
        raise b.fail(f"blocked quantization (block_size={b.attr('block_size')}): ours is per tensor or "
                     f"per axis")
    scale_shape = b.info(scale_i).shape
    if scale_shape is None or len(scale_shape) > 1:
        raise b.fail(f"scale of shape {scale_shape}: per tensor or per axis only")
    if math.prod(scale_shape) == 1:
        return -1
    return checked_axis(b, int(b.attr("axis", 1)), x_rank)


@converter("QuantizeLinear", targets=("Quantize",))
def convert_quantize_linear(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("axis", "block_size", "output_dtype", "saturate", "precision"))
    b.floats(0)
    b.floats(1)
    if b.attr("precision", 0):
        raise b.fail("precision attribute")
    if b.has(2):
        out = b.dtype(2)
    elif b.attr("output_dtype", 0):
        out = np.dtype(helper.tensor_dtype_to_np_dtype(int(b.attr("output_dtype"))))
    else:
        out = np.dtype(np.uint8)
    if out not in _LINEAR_TYPES:
        raise b.fail(f"output type {out}: our linear quantization produces int8 and uint8")
    axis = _linear_axis(b, b.rank(0), 1)
    b.emit(ops.Quantize(dtype=_LINEAR_TYPES[out], axis=axis), [b.name(i) for i in range(3) if b.has(i)],
           b.out(0))
    return b.done()


@converter("DequantizeLinear", targets=("Dequantize",))
def convert_dequantize_linear(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("axis", "block_size", "output_dtype"))
    if b.dtype(0) not in _LINEAR_TYPES:
        raise b.fail(f"input type {b.dtype(0)}: our linear dequantization reads int8 and uint8")
    scale = b.floats(1)
    out = scale
    if b.attr("output_dtype", 0):
        out = np.dtype(helper.tensor_dtype_to_np_dtype(int(b.attr("output_dtype"))))
    if out not in FLOATS:
        raise b.fail(f"output type {out}")
    axis = _linear_axis(b, b.rank(0), 1)
    b.emit(ops.Dequantize(dtype=DType.from_numpy(out), axis=axis), [b.name(i) for i in range(3) if b.has(i)],
           b.out(0))
    return b.done()
