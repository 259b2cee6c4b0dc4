"""The table of ONNX converters (:data:`CONVERTERS`, filled by the family modules through
:func:`converter`), :func:`convert_node`, and the values a converter takes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
from onnx import NodeProto

from ...errors import DistRuntimeError
from ...ir.graph import Node


class UnsupportedOnnxError(DistRuntimeError):
    """An ONNX operator, attribute or input combination our ops cannot express exactly."""

    def __init__(self, op_type: str, reason: str, node: str | None = None):
        self.op_type, self.reason, self.node = op_type, reason, node
        where = f" (node {node!r})" if node else ""
        super().__init__(f"ONNX {op_type}{where}: {reason}")


@dataclass(frozen=True)
class OnnxValue:
    """What the converter knows about one tensor at conversion time."""

    name: str
    shape: tuple[int | None, ...] | None = None  # None: unknown rank; a None dim: unknown length
    dtype: np.dtype | None = None
    value: np.ndarray | None = None  # set for a constant known at conversion time

    @classmethod
    def of(cls, name: str, array: np.ndarray, *, constant: bool = False) -> OnnxValue:
        array = np.asarray(array)
        return cls(name, tuple(array.shape), array.dtype, array if constant else None)


@dataclass(frozen=True)
class KvPriming:
    """A KvCache node that stands for ONNX's explicit cache: before the node runs, its per-session
    accumulators hold the rows of ``past_key``/``past_value`` (run position = their length), and
    its outputs are ONNX's ``present_key``/``present_value``.  An importer of a decoder exported
    with past/present graph inputs and outputs drops those and lets the session keep the cache."""

    node: int  # index into Converted.nodes
    past_key: str
    past_value: str


@dataclass
class Converted:
    nodes: list[Node]
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    kv_caches: list[KvPriming] = field(default_factory=list)


Converter = Callable[[NodeProto, int, Sequence["OnnxValue | None"]], Converted]

#: ONNX op_type -> converter.
CONVERTERS: dict[str, Converter] = {}
#: ONNX op_type -> input positions whose constant values the converter uses.
CONSTANT_INPUTS: dict[str, tuple[int, ...]] = {}
#: ONNX op_type -> our ops the converter targets (for coverage accounting; glue ops excluded).
TARGETS: dict[str, tuple[str, ...]] = {}


def convert_node(node: NodeProto, opset: int, inputs: Sequence[OnnxValue | None]) -> Converted:
    """Convert one ONNX node (``UnsupportedOnnxError`` if its op_type has no converter)."""
    fn = CONVERTERS.get(node.op_type)
    if fn is None or (node.domain not in ("", "ai.onnx")):
        raise UnsupportedOnnxError(node.op_type, f"no converter for {node.domain or 'ai.onnx'}.{node.op_type}",
                                   node.name or None)
    return fn(node, opset, inputs)


def converter(*op_types: str, targets: tuple[str, ...], constants: tuple[int, ...] = ()):
    def register(fn: Converter) -> Converter:
        for op_type in op_types:
            CONVERTERS[op_type] = fn
            CONSTANT_INPUTS[op_type] = constants
            TARGETS[op_type] = targets
        return fn

    return register
