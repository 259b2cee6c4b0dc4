"""ONNX normalisations: Layer, RMS, Group, Instance and Batch."""

from __future__ import annotations

from typing import Sequence

from ...ir import ops
from ...ir.ops import OpPayload
from .node import NodeBuilder, attr_f32, checked_axis
from .registry import converter


def _norm_over_trailing(b: NodeBuilder, op: OpPayload, params: Sequence[int], axis_default: int = -1) -> None:
    """LayerNormalization / RMSNormalization over ``x.shape[axis:]``: ours normalises the last dim,
    so several trailing dims are flattened into one (and the parameters with them) and restored."""
    rank = b.rank(0)
    axis = checked_axis(b, int(b.attr("axis", axis_default)), rank)
    shape = b.shape(0) if axis != rank - 1 else None
    names = []
    for i in params:
        if not b.has(i):
            continue
        want = b.info(0).shape[axis:]
        if b.info(i).shape != want:
            raise b.fail(f"input {i} ({b.name(i)}) has shape {b.info(i).shape}; only a parameter of "
                         f"the normalised shape {want} maps to ours")
        names.append(b.name(i) if shape is None else b.emit(ops.Reshape(shape=(-1,)), [b.name(i)]))
    if shape is None:
        b.emit(op, [b.name(0), *names], b.out(0))
        return
    flat = b.emit(ops.Reshape(shape=(0,) * axis + (-1,)), [b.name(0)])
    y = b.emit(op, [flat, *names])
    b.emit(ops.Reshape(shape=(0,) * axis + shape[axis:]), [y], b.out(0))


@converter("LayerNormalization", targets=("LayerNorm",))
def convert_layer_norm(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("axis", "epsilon", "stash_type"))
    b.floats(0, 1, 2)
    b.only_outputs(1, "the Mean and InvStdDev outputs have no counterpart in our LayerNorm")
    eps = attr_f32(b, "epsilon", 1e-5)
    _norm_over_trailing(b, ops.LayerNorm(eps=eps), (1, 2))
    return b.done()


@converter("RMSNormalization", targets=("RmsNorm",))
def convert_rms_norm(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("axis", "epsilon", "stash_type"))
    b.floats(0, 1)
    eps = attr_f32(b, "epsilon", 1e-5)
    _norm_over_trailing(b, ops.RmsNorm(eps=eps), (1,))
    return b.done()


@converter("GroupNormalization", targets=("GroupNorm",))
def convert_group_norm(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("epsilon", "num_groups", "stash_type"))
    b.floats(0, 1, 2)
    if opset < 21:
        raise b.fail("opset 18 GroupNormalization has per-group scale and bias; ours are per channel "
                     "(opset 21)")
    groups = b.attr("num_groups")
    if groups is None:
        raise b.fail("num_groups is required")
    eps = attr_f32(b, "epsilon", 1e-5)
    b.emit(ops.GroupNorm(eps=eps, num_groups=int(groups)), [b.name(i) for i in range(3) if b.has(i)], b.out(0))
    return b.done()


@converter("InstanceNormalization", targets=("InstanceNorm",))
def convert_instance_norm(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("epsilon", "consumed_inputs"))
    b.floats(0, 1, 2)
    eps = attr_f32(b, "epsilon", 1e-5)
    b.emit(ops.InstanceNorm(eps=eps), [b.name(i) for i in range(3)], b.out(0))
    return b.done()


@converter("BatchNormalization", targets=("BatchNorm",))
def convert_batch_norm(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs, ("epsilon", "momentum", "training_mode", "is_test", "spatial",
                                     "consumed_inputs"))
    b.floats(0, 1, 2, 3, 4)
    if b.attr("training_mode", 0):
        raise b.fail("training_mode=1 normalises with the batch's statistics; ours is inference only")
    if opset < 7 and not b.attr("is_test", 0):
        raise b.fail("is_test=0 (training) before opset 7")
    if not b.attr("spatial", 1):
        raise b.fail("spatial=0 (per-activation statistics)")
    b.only_outputs(1, "running statistics are outputs of training mode only")
    eps = attr_f32(b, "epsilon", 1e-5)
    b.emit(ops.BatchNorm(eps=eps, momentum=attr_f32(b, "momentum", 0.9)),
           [b.name(i) for i in range(5)], b.out(0))
    return b.done()
