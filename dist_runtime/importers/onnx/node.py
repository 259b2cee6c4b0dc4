"""What every ONNX converter reads a node with: :class:`NodeBuilder` (the node's attributes and
inputs, and the nodes, constants and caches that replace it), the element types our ops take, and
small attribute checks."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import ml_dtypes
import numpy as np
from onnx import NodeProto, helper

from ...ir.builder import GraphBuilder
from .registry import Converted, KvPriming, OnnxValue, UnsupportedOnnxError


# -- dtypes --------------------------------------------------------------------------------------
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = frozenset({np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BF16})
#: Element types our layout ops move (docs/ops.md, "Element types"): floats, integers, BOOL.
PLAIN = FLOATS | {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_)}


# -- the per-node builder ------------------------------------------------------------------------
class NodeBuilder(GraphBuilder):
    """Reads one ONNX node and collects the nodes, constants and caches that replace it; their
    ids count from 0 (the caller renumbers) and temporary names are ``<node>::<what><n>``."""

    def __init__(self, node: NodeProto, opset: int, inputs: Sequence[OnnxValue | None],
                 known_attrs: Iterable[str] = ()):
        self.proto, self.op_type, self.opset = node, node.op_type, opset
        self.inputs = list(inputs)
        if len(self.inputs) != len(node.input):
            raise ValueError(f"{node.op_type}: {len(node.input)} node inputs but {len(self.inputs)} OnnxValues")
        self.attrs: dict[str, object] = {}
        for a in node.attribute:
            value = helper.get_attribute_value(a)
            if isinstance(value, bytes):
                value = value.decode()
            elif isinstance(value, list) and value and isinstance(value[0], bytes):
                value = [v.decode() for v in value]
            self.attrs[a.name] = value
        unknown = sorted(set(self.attrs) - set(known_attrs))
        if unknown:
            raise self.fail(f"attribute {', '.join(unknown)} is not understood by this converter")
        super().__init__(scope=(node.name or (node.output[0] if node.output else node.op_type)) + "::")
        self.kv: list[KvPriming] = []

    # -- reading the node
    def fail(self, reason: str) -> UnsupportedOnnxError:
        return UnsupportedOnnxError(self.op_type, reason, self.proto.name or None)

    def attr(self, name: str, default=None):
        return self.attrs.get(name, default)

    def has(self, i: int) -> bool:
        return i < len(self.inputs) and self.inputs[i] is not None

    def name(self, i: int) -> str:
        return self.info(i).name

    def info(self, i: int) -> OnnxValue:
        if not self.has(i):
            raise self.fail(f"input {i} is required")
        return self.inputs[i]

    def shape(self, i: int, what: str = "") -> tuple[int, ...]:
        shape = self.info(i).shape
        if shape is None or any(d is None for d in shape):
            raise self.fail(f"needs the static shape of input {i} ({self.name(i)}){what}")
        return tuple(int(d) for d in shape)

    def rank(self, i: int) -> int:
        shape = self.info(i).shape
        if shape is None:
            raise self.fail(f"needs the rank of input {i} ({self.name(i)})")
        return len(shape)

    def dtype(self, i: int) -> np.dtype:
        dtype = self.info(i).dtype
        if dtype is None:
            raise self.fail(f"needs the element type of input {i} ({self.name(i)})")
        return np.dtype(dtype)

    def const(self, i: int, what: str) -> np.ndarray:
        value = self.info(i).value
        if value is None:
            raise self.fail(f"{what} (input {i}, {self.name(i)}) must be a constant known at import time")
        return np.asarray(value)

    def floats(self, *indices: int) -> np.dtype:
        """The inputs at ``indices`` (those present) are floats of one type; return it."""
        seen = None
        for i in indices:
            if not self.has(i):
                continue
            dtype = self.dtype(i)
            if dtype not in FLOATS:
                raise self.fail(f"input {i} ({self.name(i)}) is {dtype}: our op computes on float "
                                f"types only (docs/ops.md, 'Element types')")
            if seen is not None and dtype != seen:
                raise self.fail(f"inputs mix {seen} and {dtype}")
            seen = dtype
        return seen

    def plain(self, i: int) -> np.dtype:
        dtype = self.dtype(i)
        if dtype not in PLAIN:
            raise self.fail(f"input {i} ({self.name(i)}) has element type {dtype}, which our tensors "
                            f"do not carry")
        return dtype

    def out(self, i: int) -> str | None:
        outs = self.proto.output
        return outs[i] if i < len(outs) and outs[i] else None

    def only_outputs(self, n: int, why: str) -> None:
        extra = [o for o in self.proto.output[n:] if o]
        if extra:
            raise self.fail(f"output(s) {', '.join(extra)} requested: {why}")

    # -- writing our nodes
    def scalar(self, what: str, value: float, dtype: np.dtype) -> str:
        return self.constant(what, np.asarray(value, dtype=dtype))

    def done(self) -> Converted:
        """The result; every output the ONNX node names must be produced (a safety net: an output a
        converter does not know about is refused, never left unset)."""
        produced = {o for n in self.nodes for o in n.outputs}
        missing = [o for o in self.proto.output if o and o not in produced]
        if missing:
            raise self.fail(f"output(s) {', '.join(missing)} have no counterpart")
        return Converted(self.nodes, self.constants, self.kv)


def ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(values).reshape(-1))


def checked_axis(b: NodeBuilder, axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise b.fail(f"{what}={axis} is out of range for rank {rank}")
    return axis % rank


def attr_f32(b: NodeBuilder, name: str, default: float) -> float:
    """A float attribute (ONNX stores f32; the spec's default rounded to f32 likewise)."""
    return float(np.float32(b.attr(name, default)))


def f32_exact(b: NodeBuilder, value: float, what: str) -> float:
    """A payload f32 field must hold ``value`` exactly (an f64 bound rounded to f32 would move)."""
    value = float(value)
    if math.isnan(value):
        raise b.fail(f"{what} is NaN")
    if not math.isinf(value) and float(np.float32(value)) != value:
        raise b.fail(f"{what}={value!r} is not representable in the op's f32 payload")
    return value
