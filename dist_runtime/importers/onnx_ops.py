"""ONNX operators -> Graph IR nodes: one small converter per ONNX ``op_type``.

This module is the core of the ONNX importer (an ONNX graph in, our graph out; the graph walk,
initializers as weights and constant folding live in the importer) and the mapping the
conformance suite (``tests/test_onnx_conformance.py``) runs ONNX's own node test cases through.

A converter is looked up in :data:`CONVERTERS` by ``op_type`` and called as::

    converted = CONVERTERS["Softmax"](node, opset, inputs)

* ``node``: the ``onnx.NodeProto`` (attributes are read with ``onnx.helper.get_attribute_value``);
* ``opset``: the version of the default ONNX domain the model imports;
* ``inputs``: one :class:`OnnxValue` per entry of ``node.input`` (``None`` for an omitted optional
  input, ``""``): its static shape and element type when known, and ``value`` when the tensor is a
  constant known at conversion time (an initializer, a ``Constant``'s output, a folded subgraph).
  The input positions whose *values* a converter needs (Reshape's shape, Split's split, Clip's
  bounds, Resize's scales and sizes, a boolean attention mask...) are listed in
  :data:`CONSTANT_INPUTS`; every other input is consumed at run time by name.

It returns a :class:`Converted`: our nodes in execution order (``Node.id`` is 0; the caller
numbers them), whose outputs carry the ONNX output names, intermediates being named
``<node>::<what><n>``; the constants the composition introduced (new weights); and the KV caches
that hold an ONNX ``past_key``/``past_value`` pair (see :class:`KvPriming`).

What our payloads cannot express (asymmetric padding, a softcap, 3-D pooling, an attribute this
module does not know...) raises :class:`UnsupportedOnnxError` naming the operator and the reason:
a converter never returns nodes that compute something else. Where ONNX semantics differ from
ours by design (docs/ops.md), the converter composes: ``Gemm`` with ``alpha``/``beta``/``C`` is
Matmul, Mul and Add; ``SpaceToDepth`` is PixelUnshuffle followed by a channel permutation;
``Attention``'s top-left causal mask without a cache becomes an explicit additive mask.

:data:`TARGETS` names, per ONNX operator, the ops of ours it exists to exercise (glue such as the
Reshape/Permute around an attention is not counted); the conformance table is built from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import ml_dtypes
import numpy as np
from onnx import NodeProto, helper

from ..dtypes import DType
from ..errors import DistRuntimeError
from ..ir import ops
from ..ir.graph import Node
from ..ir.ops import OpPayload

__all__ = [
    "CONSTANT_INPUTS", "CONVERTERS", "TARGETS", "Converted", "KvPriming", "OnnxValue",
    "UnsupportedOnnxError", "convert_node",
]


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


def _converter(*op_types: str, targets: tuple[str, ...], constants: tuple[int, ...] = ()):
    def register(fn: Converter) -> Converter:
        for op_type in op_types:
            CONVERTERS[op_type] = fn
            CONSTANT_INPUTS[op_type] = constants
            TARGETS[op_type] = targets
        return fn

    return register


# -- dtypes --------------------------------------------------------------------------------------
BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = frozenset({np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BF16})
#: Element types our layout ops move (docs/ops.md, "Element types"): floats, integers, BOOL.
PLAIN = FLOATS | {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_)}
_ONNX_FLOAT_TYPES = {1: np.float32, 10: np.float16, 11: np.float64, 16: BF16}


# -- the per-node builder ------------------------------------------------------------------------
class _Build:
    """Reads one ONNX node and collects the nodes, constants and caches that replace it."""

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
        self.key = node.name or (node.output[0] if node.output else node.op_type)
        self.nodes: list[Node] = []
        self.constants: dict[str, np.ndarray] = {}
        self.kv: list[KvPriming] = []
        self._count = 0

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
    def tmp(self, what: str) -> str:
        self._count += 1
        return f"{self.key}::{what}{self._count}"

    def constant(self, what: str, array) -> str:
        name = self.tmp(what)
        self.constants[name] = np.asarray(array)
        return name

    def scalar(self, what: str, value: float, dtype: np.dtype) -> str:
        return self.constant(what, np.asarray(value, dtype=dtype))

    def emit(self, op: OpPayload, inputs: Sequence[str], outputs: Sequence[str | None] | str | None = None):
        """Append a node; ``outputs`` are names (``None`` entries get a temporary name).  Returns
        the output name, or the list of names for a multi-output op."""
        n = op.spec.num_outputs(op)
        if outputs is None or isinstance(outputs, str):
            outputs = [outputs] + [None] * (n - 1)
        names = [o or self.tmp(type(op).__name__.lower()) for o in outputs]
        if len(names) != n:
            raise AssertionError(f"{type(op).__name__} has {n} outputs, {len(names)} named")
        self.nodes.append(Node(0, op, list(inputs), names))
        return names[0] if n == 1 else names

    def done(self) -> Converted:
        """The result; every output the ONNX node names must be produced (a safety net: an output a
        converter does not know about is refused, never left unset)."""
        produced = {o for n in self.nodes for o in n.outputs}
        missing = [o for o in self.proto.output if o and o not in produced]
        if missing:
            raise self.fail(f"output(s) {', '.join(missing)} have no counterpart")
        return Converted(self.nodes, self.constants, self.kv)


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(values).reshape(-1))


def _axis(b: _Build, axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise b.fail(f"{what}={axis} is out of range for rank {rank}")
    return axis % rank


def _attr_f32(b: _Build, name: str, default: float) -> float:
    """A float attribute (ONNX stores f32; the spec's default rounded to f32 likewise)."""
    return float(np.float32(b.attr(name, default)))


def _f32_exact(b: _Build, value: float, what: str) -> float:
    """A payload f32 field must hold ``value`` exactly (an f64 bound rounded to f32 would move)."""
    value = float(value)
    if math.isnan(value):
        raise b.fail(f"{what} is NaN")
    if not math.isinf(value) and float(np.float32(value)) != value:
        raise b.fail(f"{what}={value!r} is not representable in the op's f32 payload")
    return value


# -- arithmetic and layout -----------------------------------------------------------------------
_BINARY = {"Add": ops.Add, "Sub": ops.Sub, "Mul": ops.Mul, "Div": ops.Div}


@_converter("Add", "Sub", "Mul", "Div", targets=("Add", "Sub", "Mul", "Div"))
def convert_binary(node, opset, inputs):
    b = _Build(node, opset, inputs, ("broadcast", "axis", "consumed_inputs"))
    if b.attr("axis") is not None and b.attr("broadcast", 0):
        raise b.fail("legacy broadcasting along an axis (opset < 7 'axis') is not numpy broadcasting")
    b.floats(0, 1)
    b.emit(_BINARY[node.op_type](), [b.name(0), b.name(1)], b.out(0))
    return b.done()


TARGETS["Add"], TARGETS["Sub"], TARGETS["Mul"], TARGETS["Div"] = ("Add",), ("Sub",), ("Mul",), ("Div",)


@_converter("MatMul", targets=("Matmul",))
def convert_matmul(node, opset, inputs):
    b = _Build(node, opset, inputs)
    b.floats(0, 1)
    b.emit(ops.Matmul(transpose_b=False), [b.name(0), b.name(1)], b.out(0))
    return b.done()


@_converter("Gemm", targets=("Matmul",))
def convert_gemm(node, opset, inputs):
    """Y = alpha * A' @ B' + beta * C: Transpose (transA), Matmul (transB), Mul, Add."""
    b = _Build(node, opset, inputs, ("alpha", "beta", "transA", "transB", "broadcast"))
    dtype = b.floats(0, 1, 2)
    if b.rank(0) != 2 or b.rank(1) != 2:
        raise b.fail("A and B must be matrices")
    alpha, beta = float(b.attr("alpha", 1.0)), float(b.attr("beta", 1.0))
    a = b.name(0)
    if b.attr("transA", 0):
        a = b.emit(ops.Transpose(dim0=0, dim1=1), [a])
    use_c = b.has(2) and beta != 0.0
    last = alpha == 1.0 and not use_c
    y = b.emit(ops.Matmul(transpose_b=bool(b.attr("transB", 0))), [a, b.name(1)], b.out(0) if last else None)
    if alpha != 1.0:
        y = b.emit(ops.Mul(), [y, b.scalar("alpha", alpha, dtype)], None if use_c else b.out(0))
    if use_c:
        c = b.name(2)
        if beta != 1.0:
            c = b.emit(ops.Mul(), [c, b.scalar("beta", beta, dtype)])
        b.emit(ops.Add(), [y, c], b.out(0))
    return b.done()


@_converter("Transpose", targets=("Permute", "Transpose"))
def convert_transpose(node, opset, inputs):
    """A swap of two axes is our Transpose, any other permutation our Permute."""
    b = _Build(node, opset, inputs, ("perm",))
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


@_converter("Reshape", targets=("Reshape",), constants=(1,))
def convert_reshape(node, opset, inputs):
    b = _Build(node, opset, inputs, ("allowzero", "shape", "consumed_inputs"))
    b.plain(0)
    shape = _ints(b.attr("shape") if opset < 5 else b.const(1, "the target shape"))
    if b.attr("allowzero", 0) and 0 in shape:
        raise b.fail("allowzero=1 with a 0 in the shape (a real zero-length dim); our Reshape copies "
                     "the input dim for a 0")
    b.emit(ops.Reshape(shape=shape), [b.name(0)], b.out(0))
    return b.done()


def _static_reshape(b: _Build, x: int, target: Sequence[int]) -> None:
    b.plain(x)
    b.emit(ops.Reshape(shape=tuple(int(d) for d in target)), [b.name(x)], b.out(0))


@_converter("Flatten", targets=("Reshape",))
def convert_flatten(node, opset, inputs):
    b = _Build(node, opset, inputs, ("axis",))
    shape = b.shape(0)
    axis = b.attr("axis", 1)
    axis = axis % len(shape) if axis < 0 else axis
    if axis > len(shape):
        raise b.fail(f"axis={axis} exceeds the rank {len(shape)}")
    _static_reshape(b, 0, (math.prod(shape[:axis]), math.prod(shape[axis:])))
    return b.done()


@_converter("Squeeze", "Unsqueeze", targets=("Reshape",), constants=(1,))
def convert_squeeze(node, opset, inputs):
    """Squeeze / Unsqueeze of a static shape: a Reshape to the resulting shape."""
    b = _Build(node, opset, inputs, ("axes",))
    shape = b.shape(0)
    if opset >= 13:
        axes = _ints(b.const(1, "axes")) if b.has(1) else None
    else:
        axes = b.attr("axes")
    if node.op_type == "Squeeze":
        if axes is None:
            out = [d for d in shape if d != 1]
        else:
            drop = {_axis(b, a, len(shape)) for a in axes}
            if any(shape[a] != 1 for a in drop):
                raise b.fail(f"axes {list(axes)} of {list(shape)} are not all 1")
            out = [d for i, d in enumerate(shape) if i not in drop]
    else:
        if axes is None:
            raise b.fail("axes are required")
        rank = len(shape) + len(axes)
        where = sorted(_axis(b, a, rank) for a in axes)
        dims = iter(shape)
        out = [1 if i in where else next(dims) for i in range(rank)]
    _static_reshape(b, 0, out)
    return b.done()


@_converter("Concat", targets=("Concat",))
def convert_concat(node, opset, inputs):
    b = _Build(node, opset, inputs, ("axis",))
    for i in range(len(inputs)):
        b.plain(i)
    if b.attr("axis") is None:
        raise b.fail("axis is required")
    b.emit(ops.Concat(dim=int(b.attr("axis"))), [b.name(i) for i in range(len(inputs))], b.out(0))
    return b.done()


@_converter("Split", targets=("Split", "Chunk"), constants=(1,))
def convert_split(node, opset, inputs):
    """Explicit sizes are our Split; an equal split our Chunk (a Split when the last piece is
    smaller, opset 18's num_outputs)."""
    b = _Build(node, opset, inputs, ("axis", "split", "num_outputs"))
    b.plain(0)
    axis = int(b.attr("axis", 0))
    n_out = len(node.output)
    if any(not o for o in node.output):
        raise b.fail("an omitted output of Split")
    sizes = None
    if opset < 13 and b.attr("split") is not None:
        sizes = tuple(b.attr("split"))
    elif opset >= 13 and b.has(1):
        sizes = _ints(b.const(1, "split"))
    if sizes is not None:
        if len(sizes) != n_out:
            raise b.fail(f"{len(sizes)} split sizes for {n_out} outputs")
        b.emit(ops.Split(dim=axis, sizes=sizes), [b.name(0)], list(node.output))
        return b.done()
    n = int(b.attr("num_outputs", n_out))
    if n != n_out:
        raise b.fail(f"num_outputs={n} but {n_out} outputs")
    shape = b.info(0).shape
    length = shape[_axis(b, axis, len(shape))] if shape is not None else None
    if length is None or length % n == 0:
        b.emit(ops.Chunk(dim=axis, chunks=n), [b.name(0)], list(node.output))
    else:
        if opset < 18:
            raise b.fail(f"an equal split of length {length} into {n} pieces")
        piece = -(-length // n)
        sizes = tuple(min(piece, max(0, length - i * piece)) for i in range(n))
        b.emit(ops.Split(dim=axis, sizes=sizes), [b.name(0)], list(node.output))
    return b.done()


@_converter("Clip", targets=("Clamp",), constants=(1, 2))
def convert_clip(node, opset, inputs):
    b = _Build(node, opset, inputs, ("min", "max"))
    b.floats(0)
    if opset < 11:
        lo, hi = b.attr("min", -math.inf), b.attr("max", math.inf)
    else:
        lo = b.const(1, "min").item() if b.has(1) else -math.inf
        hi = b.const(2, "max").item() if b.has(2) else math.inf
    b.emit(ops.Clamp(min=_f32_exact(b, lo, "min"), max=_f32_exact(b, hi, "max")), [b.name(0)], b.out(0))
    return b.done()


# -- activations and softmax ---------------------------------------------------------------------
_UNARY = {"Relu": ops.Relu, "Sigmoid": ops.Sigmoid, "Tanh": ops.Tanh}


@_converter("Relu", "Sigmoid", "Tanh", targets=())
def convert_unary(node, opset, inputs):
    b = _Build(node, opset, inputs, ("consumed_inputs",))
    b.floats(0)
    b.emit(_UNARY[node.op_type](), [b.name(0)], b.out(0))
    return b.done()


for _t in _UNARY:
    TARGETS[_t] = (_t,)


@_converter("LeakyRelu", targets=("LeakyRelu",))
def convert_leaky_relu(node, opset, inputs):
    b = _Build(node, opset, inputs, ("alpha", "consumed_inputs"))
    b.floats(0)
    b.emit(ops.LeakyRelu(alpha=_attr_f32(b, "alpha", 0.01)), [b.name(0)], b.out(0))
    return b.done()


@_converter("PRelu", targets=("PRelu",))
def convert_prelu(node, opset, inputs):
    """Since opset 7 the slope broadcasts unidirectionally, as ours; before, a slope of C values
    applies along the channel dim 1 (reshaped to [C, 1, ..., 1] here)."""
    b = _Build(node, opset, inputs, ("consumed_inputs",))
    b.floats(0, 1)
    slope = b.name(1)
    if opset < 7:
        x_rank, s_shape = b.rank(0), b.shape(1)
        if len(s_shape) == 1 and s_shape[0] > 1 and x_rank > 2:
            slope = b.emit(ops.Reshape(shape=(s_shape[0],) + (1,) * (x_rank - 2)), [slope])
    b.emit(ops.PRelu(), [b.name(0), slope], b.out(0))
    return b.done()


@_converter("Gelu", targets=("Gelu",))
def convert_gelu(node, opset, inputs):
    b = _Build(node, opset, inputs, ("approximate",))
    b.floats(0)
    approximate = b.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise b.fail(f"approximate={approximate!r}")
    b.emit(ops.Gelu(approximate=approximate == "tanh"), [b.name(0)], b.out(0))
    return b.done()


def _swish(b: _Build, x: str, alpha: float, dtype, out: str | None) -> str:
    """x * sigmoid(alpha * x): our Silu when alpha = 1, else Mul, Sigmoid, Mul."""
    if alpha == 1.0:
        return b.emit(ops.Silu(), [x], out)
    scaled = b.emit(ops.Mul(), [x, b.scalar("alpha", alpha, dtype)])
    return b.emit(ops.Mul(), [x, b.emit(ops.Sigmoid(), [scaled])], out)


@_converter("Swish", targets=("Silu",))
def convert_swish(node, opset, inputs):
    b = _Build(node, opset, inputs, ("alpha",))
    dtype = b.floats(0)
    _swish(b, b.name(0), float(b.attr("alpha", 1.0)), dtype, b.out(0))
    return b.done()


@_converter("SwiGLU", targets=("SwiGlu",))
def convert_swiglu(node, opset, inputs):
    """Y = A * sigmoid(alpha * A) * B: our two-input SwiGlu (gate = A, up = B) when alpha = 1."""
    b = _Build(node, opset, inputs, ("alpha",))
    dtype = b.floats(0, 1)
    if b.info(0).shape != b.info(1).shape:
        raise b.fail("A and B must have the same shape (ONNX does not broadcast)")
    alpha = float(b.attr("alpha", 1.0))
    if alpha == 1.0:
        b.emit(ops.SwiGlu(), [b.name(0), b.name(1)], b.out(0))
    else:
        b.emit(ops.Mul(), [_swish(b, b.name(0), alpha, dtype, None), b.name(1)], b.out(0))
    return b.done()


@_converter("Softmax", targets=("Softmax",))
def convert_softmax(node, opset, inputs):
    """Opset >= 13: softmax along ``axis``.  Before 13 the input is flattened to 2-D at ``axis``
    and normalised over everything after it: Reshape, Softmax(-1), Reshape back."""
    b = _Build(node, opset, inputs, ("axis",))
    b.floats(0)
    rank = b.rank(0)
    if opset >= 13:
        b.emit(ops.Softmax(dim=int(b.attr("axis", -1))), [b.name(0)], b.out(0))
        return b.done()
    axis = _axis(b, int(b.attr("axis", 1)), rank)
    if axis == rank - 1:
        b.emit(ops.Softmax(dim=-1), [b.name(0)], b.out(0))
        return b.done()
    shape = b.shape(0)
    flat = b.emit(ops.Reshape(shape=(0,) * axis + (-1,)), [b.name(0)])
    y = b.emit(ops.Softmax(dim=-1), [flat])
    b.emit(ops.Reshape(shape=(0,) * axis + shape[axis:]), [y], b.out(0))
    return b.done()


@_converter("ArgMax", targets=("Argmax",))
def convert_argmax(node, opset, inputs):
    """Our Argmax reduces the last dim: a Permute moves ``axis`` there, a Reshape restores it as
    1 for ``keepdims``.  ``select_last_index=1`` has no counterpart (ours picks the first)."""
    b = _Build(node, opset, inputs, ("axis", "keepdims", "select_last_index"))
    b.floats(0)
    if b.attr("select_last_index", 0):
        raise b.fail("select_last_index=1: our Argmax returns the first index of the maximum")
    rank = b.rank(0)
    axis = _axis(b, int(b.attr("axis", 0)), rank)
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


# -- normalisation -------------------------------------------------------------------------------
def _norm_over_trailing(b: _Build, op: OpPayload, params: Sequence[int], axis_default: int = -1) -> None:
    """LayerNormalization / RMSNormalization over ``x.shape[axis:]``: ours normalises the last dim,
    so several trailing dims are flattened into one (and the parameters with them) and restored."""
    rank = b.rank(0)
    axis = _axis(b, int(b.attr("axis", axis_default)), rank)
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


@_converter("LayerNormalization", targets=("LayerNorm",))
def convert_layer_norm(node, opset, inputs):
    b = _Build(node, opset, inputs, ("axis", "epsilon", "stash_type"))
    b.floats(0, 1, 2)
    b.only_outputs(1, "the Mean and InvStdDev outputs have no counterpart in our LayerNorm")
    eps = _attr_f32(b, "epsilon", 1e-5)
    _norm_over_trailing(b, ops.LayerNorm(eps=eps), (1, 2))
    return b.done()


@_converter("RMSNormalization", targets=("RmsNorm",))
def convert_rms_norm(node, opset, inputs):
    b = _Build(node, opset, inputs, ("axis", "epsilon", "stash_type"))
    b.floats(0, 1)
    eps = _attr_f32(b, "epsilon", 1e-5)
    _norm_over_trailing(b, ops.RmsNorm(eps=eps), (1,))
    return b.done()


@_converter("GroupNormalization", targets=("GroupNorm",))
def convert_group_norm(node, opset, inputs):
    b = _Build(node, opset, inputs, ("epsilon", "num_groups", "stash_type"))
    b.floats(0, 1, 2)
    if opset < 21:
        raise b.fail("opset 18 GroupNormalization has per-group scale and bias; ours are per channel "
                     "(opset 21)")
    groups = b.attr("num_groups")
    if groups is None:
        raise b.fail("num_groups is required")
    eps = _attr_f32(b, "epsilon", 1e-5)
    b.emit(ops.GroupNorm(eps=eps, num_groups=int(groups)), [b.name(i) for i in range(3) if b.has(i)], b.out(0))
    return b.done()


@_converter("InstanceNormalization", targets=("InstanceNorm",))
def convert_instance_norm(node, opset, inputs):
    b = _Build(node, opset, inputs, ("epsilon", "consumed_inputs"))
    b.floats(0, 1, 2)
    eps = _attr_f32(b, "epsilon", 1e-5)
    b.emit(ops.InstanceNorm(eps=eps), [b.name(i) for i in range(3)], b.out(0))
    return b.done()


@_converter("BatchNormalization", targets=("BatchNorm",))
def convert_batch_norm(node, opset, inputs):
    b = _Build(node, opset, inputs, ("epsilon", "momentum", "training_mode", "is_test", "spatial",
                                     "consumed_inputs"))
    b.floats(0, 1, 2, 3, 4)
    if b.attr("training_mode", 0):
        raise b.fail("training_mode=1 normalises with the batch's statistics; ours is inference only")
    if opset < 7 and not b.attr("is_test", 0):
        raise b.fail("is_test=0 (training) before opset 7")
    if not b.attr("spatial", 1):
        raise b.fail("spatial=0 (per-activation statistics)")
    b.only_outputs(1, "running statistics are outputs of training mode only")
    eps = _attr_f32(b, "epsilon", 1e-5)
    b.emit(ops.BatchNorm(eps=eps, momentum=_attr_f32(b, "momentum", 0.9)),
           [b.name(i) for i in range(5)], b.out(0))
    return b.done()


# -- convolution and pooling ---------------------------------------------------------------------
def _same_pads(b: _Build, auto_pad: str, lengths, kernel, strides, dilations) -> list[tuple[int, int]]:
    """(begin, end) padding per spatial axis for ``auto_pad`` SAME_UPPER / SAME_LOWER."""
    pads = []
    for n, k, s, d in zip(lengths, kernel, strides, dilations):
        out = -(-n // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - n)
        small, big = total // 2, total - total // 2
        pads.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    return pads


def _window_pads(b: _Build, x: int, kernel, strides, dilations) -> list[tuple[int, int]]:
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


def _symmetric(b: _Build, pads: list[tuple[int, int]]) -> tuple[int, ...]:
    if any(lo != hi for lo, hi in pads):
        raise b.fail(f"asymmetric padding (begin, end) = {pads}: our payload pads both sides equally "
                     f"(an importer would need an explicit Pad op, which we do not have)")
    return tuple(lo for lo, _ in pads)


def _per_axis(names: Sequence[str], values: Sequence[int]) -> dict[str, int]:
    return dict(zip(names, values))


_AXES = {1: ("",), 2: ("_h", "_w"), 3: ("_d", "_h", "_w")}


@_converter("Conv", targets=("Conv1d", "Conv2d", "Conv3d", "DepthwiseConv"))
def convert_conv(node, opset, inputs):
    """Conv1d / Conv2d / Conv3d by the spatial rank; a 2-D conv with one input channel per group
    (group = C) is our DepthwiseConv."""
    b = _Build(node, opset, inputs, ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
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


def _conv_geometry(b: _Build, w_shape) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(kernel, strides, dilations) of a Conv/ConvTranspose; ``kernel_shape``, when given, must be
    the weight's spatial shape."""
    s = len(w_shape) - 2
    kernel = tuple(b.attr("kernel_shape", w_shape[2:]))
    if kernel != tuple(w_shape[2:]):
        raise b.fail(f"kernel_shape {list(kernel)} differs from the weight's {list(w_shape[2:])}")
    return kernel, tuple(b.attr("strides", [1] * s)), tuple(b.attr("dilations", [1] * s))


@_converter("ConvTranspose", targets=("ConvTranspose2d",))
def convert_conv_transpose(node, opset, inputs):
    """ConvTranspose2d; a 1-D one runs as 2-D with a unit height (Reshape around it).

    ONNX crops ``begin`` rows at the start and produces ``out`` rows; ours crops ``padding`` at both
    ends of the full output and appends ``output_padding`` rows (bias only) at the end, so it
    matches when ``padding = begin`` and ``0 <= output_padding = out - (full - 2 begin) < max(stride,
    dilation)``.
    """
    b = _Build(node, opset, inputs, ("auto_pad", "dilations", "group", "kernel_shape", "output_padding",
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


@_converter("CausalConvWithState", targets=("CausalConv1d", "Conv1d"))
def convert_causal_conv_with_state(node, opset, inputs):
    """Depthwise causal conv of [B, C, L] with weight [C, 1, k].  Without past_state: our
    CausalConv1d (zeros on the left); with it: Conv1d (no padding) over Concat(past_state, x).
    present_state is the last k-1 steps of that padded input (a Split).  activation silu/swish adds
    a Silu."""
    b = _Build(node, opset, inputs, ("activation",))
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


def _pool_geometry(b: _Build, kernel, ceil_mode: bool, count_include_pad: bool):
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


def _emit_pool(b: _Build, mode: int, kernel, strides, padding) -> None:
    if len(kernel) == 1:
        op = ops.Pool(mode=mode, kernel_h=1, kernel_w=kernel[0], stride_w=strides[0], padding_w=padding[0])
    elif len(kernel) == 2:
        op = ops.Pool(mode=mode, kernel_h=kernel[0], kernel_w=kernel[1], stride_h=strides[0],
                      stride_w=strides[1], padding_h=padding[0], padding_w=padding[1])
    else:
        raise b.fail(f"{len(kernel)}-D pooling: our Pool pools 1-D ([N, C, L]) and 2-D ([N, C, H, W]) only")
    b.emit(op, [b.name(0)], b.out(0))


@_converter("MaxPool", "AveragePool", targets=("Pool",))
def convert_pool(node, opset, inputs):
    b = _Build(node, opset, inputs, ("auto_pad", "ceil_mode", "count_include_pad", "dilations",
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


@_converter("GlobalMaxPool", "GlobalAveragePool", targets=("Pool",))
def convert_global_pool(node, opset, inputs):
    b = _Build(node, opset, inputs)
    b.floats(0)
    kernel = b.shape(0, " (the window is the whole spatial extent)")[2:]
    if not 1 <= len(kernel) <= 2:
        raise b.fail(f"{len(kernel)}-D pooling: our Pool pools 1-D and 2-D only")
    _emit_pool(b, 0 if node.op_type == "GlobalMaxPool" else 1, kernel, (1,) * len(kernel), (0,) * len(kernel))
    return b.done()


# -- resampling ----------------------------------------------------------------------------------
def _onnx_source(mode: str, n_in: int, n_out: int, scale: float) -> np.ndarray:
    """ONNX Resize's source coordinate of every output index along one axis (float64)."""
    y = np.arange(n_out, dtype=np.float64)
    out_f = scale * n_in
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return np.full(n_out, -0.5) if out_f == 1 else (y + 0.5) / scale - 0.5
    if mode == "align_corners":
        return np.zeros(n_out) if out_f == 1 else y * (n_in - 1) / (out_f - 1)
    if mode == "asymmetric":
        return y / scale
    if mode == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / out_f)
        return offset + (y + 0.5) / scale - 0.5
    raise ValueError(mode)


def _onnx_nearest(x: np.ndarray, nearest_mode: str, n_in: int) -> np.ndarray:
    whole = x == np.floor(x)
    if nearest_mode == "round_prefer_floor":
        idx = np.ceil(x - 0.5)
    elif nearest_mode == "round_prefer_ceil":
        idx = np.floor(x + 0.5)
    elif nearest_mode == "floor":
        idx = np.floor(x)
    elif nearest_mode == "ceil":
        idx = np.ceil(x)
    else:
        raise ValueError(nearest_mode)
    idx = np.where(whole, x, idx)
    return np.clip(idx, 0, n_in - 1).astype(np.int64)


def _our_ratio(n_in: int, n_out: int, scale: float | None, align_corners: bool) -> float:
    """Interpolate's coordinate step (docs/ops.md) in f32: 1/scale when the size came from the
    scale, in/out when given, (in-1)/(out-1) with align_corners."""
    if align_corners:
        return float(np.float32(n_in - 1) / np.float32(n_out - 1)) if n_out > 1 else 0.0
    if scale is not None:
        return float(np.float32(1.0 / scale))
    return float(np.float32(n_in) / np.float32(n_out))


def _our_nearest(n_in: int, n_out: int, scale: float | None) -> np.ndarray:
    dst = np.arange(n_out)
    if n_out == n_in:
        return dst
    if n_out == 2 * n_in:
        return dst // 2
    ratio = np.float32(_our_ratio(n_in, n_out, scale, False))
    return np.minimum(np.floor(dst.astype(np.float32) * ratio).astype(np.int64), n_in - 1)


def _our_source(mode: int, align_corners: bool, n_in: int, n_out: int, scale: float | None) -> np.ndarray:
    """Interpolate's source coordinate (bilinear: clamped at 0; an unchanged length is copied)."""
    dst = np.arange(n_out, dtype=np.float64)
    if mode == 1 and n_out == n_in:
        return dst
    ratio = _our_ratio(n_in, n_out, scale, align_corners)
    src = ratio * dst if align_corners else ratio * (dst + 0.5) - 0.5
    return np.maximum(src, 0.0) if mode == 1 else src


def _resize_axis(b: _Build, mode: int, ctm: str, nearest_mode: str, n_in: int, n_out: int,
                 scale: float, exact_scale: bool, axis: str) -> tuple[dict[str, int | float], set[bool]]:
    """The payload fields (``out_<axis>`` or ``scale_<axis>``) and the ``align_corners`` values with
    which our Interpolate samples exactly ONNX's source positions along one axis."""
    candidates = [{f"out_{axis}": n_out}]
    s32 = float(np.float32(scale))
    if s32 > 0 and math.floor(n_in * s32) == n_out:
        candidates.insert(0 if exact_scale else 1, {f"scale_{axis}": s32})
    ref = _onnx_source(ctm, n_in, n_out, scale)
    for fields in candidates:
        from_scale = fields.get(f"scale_{axis}")
        if mode == 0:
            if np.array_equal(_onnx_nearest(ref, nearest_mode, n_in), _our_nearest(n_in, n_out, from_scale)):
                return fields, {False}
            continue
        theirs = np.clip(ref, 0, n_in - 1) if mode == 1 else ref
        aligns = set()
        for align in (False, True):
            ours = _our_source(mode, align, n_in, n_out, from_scale)
            if mode == 1:
                ours = np.clip(ours, 0, n_in - 1)
            if np.allclose(ours, theirs, rtol=0, atol=1e-5):
                aligns.add(align)
        if aligns:
            return fields, aligns
    what = f"nearest_mode={nearest_mode}" if mode == 0 else ("linear" if mode == 1 else "cubic")
    raise b.fail(f"coordinate_transformation_mode={ctm} ({what}) along an axis of {n_in} -> {n_out} "
                 f"(scale {scale:.7g}) samples positions our Interpolate does not")


@_converter("Resize", "Upsample", targets=("Interpolate",), constants=(1, 2, 3))
def convert_resize(node, opset, inputs):
    """Resize of the last two dims, when our Interpolate samples the same source positions.

    The converter computes ONNX's source coordinate of every output index (and, for nearest, the
    rounded index) and picks the Interpolate payload (size or scale, align_corners) whose positions
    are identical (nearest) or equal within 1e-5 pixel (linear, cubic); otherwise it refuses.
    Antialiased downsampling, tf_crop_and_resize, exclude_outside and a cubic coefficient other
    than -0.75 have no counterpart.
    """
    b = _Build(node, opset, inputs, ("antialias", "axes", "coordinate_transformation_mode", "cubic_coeff_a",
                                     "exclude_outside", "extrapolation_value", "keep_aspect_ratio_policy",
                                     "mode", "nearest_mode", "scales", "height_scale", "width_scale"))
    b.floats(0)
    shape = b.shape(0)
    rank = len(shape)
    mode_name = b.attr("mode", "nearest")
    modes = {"nearest": 0, "linear": 1, "bilinear": 1, "cubic": 2}
    if mode_name not in modes:
        raise b.fail(f"mode={mode_name!r}")
    mode = modes[mode_name]
    if node.op_type == "Upsample":
        if opset < 7:
            raise b.fail("Upsample before opset 7 (height_scale/width_scale attributes)")
        scales = b.attr("scales") if opset < 9 else _ints_or_floats(b.const(1, "scales"))
        ctm, nearest_mode, sizes, policy = "asymmetric", "floor", None, "stretch"
    else:
        if opset < 11:
            raise b.fail("Resize-10's coordinate mapping and rounding are unspecified")
        ctm = b.attr("coordinate_transformation_mode", "half_pixel")
        nearest_mode = b.attr("nearest_mode", "round_prefer_floor")
        policy = b.attr("keep_aspect_ratio_policy", "stretch")
        if ctm == "tf_crop_and_resize":
            raise b.fail("tf_crop_and_resize (a crop and extrapolation values)")
        if ctm not in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric",
                       "half_pixel_symmetric"):
            raise b.fail(f"coordinate_transformation_mode={ctm!r}")
        if mode == 2 and float(b.attr("cubic_coeff_a", -0.75)) != -0.75:
            raise b.fail(f"cubic_coeff_a={b.attr('cubic_coeff_a')}: our bicubic uses -0.75 (torch)")
        if mode == 2 and b.attr("exclude_outside", 0):
            raise b.fail("exclude_outside=1 renormalises the cubic weights at the border; ours replicates "
                         "the edge")
        scales = _ints_or_floats(b.const(2, "scales")) if b.has(2) and b.info(2).shape != (0,) else None
        sizes = _ints(b.const(3, "sizes")) if b.has(3) else None
        if (scales is None) == (sizes is None):
            raise b.fail("exactly one of scales and sizes must be given")
    axes = list(b.attr("axes", range(rank)))
    axes = [_axis(b, a, rank, "axes") for a in axes]
    given = scales if scales is not None else sizes
    if len(given) != len(axes):
        raise b.fail(f"{len(given)} scales/sizes for {len(axes)} axes")
    full_scale = [1.0] * rank
    out = list(shape)
    if scales is not None:
        for a, s in zip(axes, scales):
            full_scale[a] = float(s)
            out[a] = int(math.floor(float(s) * shape[a]))
        exact = True
    else:
        for a, n in zip(axes, sizes):
            full_scale[a], out[a] = n / shape[a], int(n)
        if policy in ("not_larger", "not_smaller"):
            pick = min if policy == "not_larger" else max
            common = pick(full_scale[a] for a in axes)
            for a in axes:
                full_scale[a], out[a] = common, int(common * shape[a] + 0.5)
        elif policy != "stretch":
            raise b.fail(f"keep_aspect_ratio_policy={policy!r}")
        exact = False
    if b.attr("antialias", 0) and any(s < 1 for s in full_scale):
        raise b.fail("antialias=1 when downsampling: our Interpolate has no antialiasing filter")
    if rank < 2:
        raise b.fail("our Interpolate resizes the last two dims of a tensor of rank >= 2")
    for a in range(rank - 2):
        if out[a] != shape[a] or full_scale[a] != 1.0:
            raise b.fail(f"axis {a} is resized: our Interpolate resizes the last two dims only")
    fields: dict[str, object] = {"mode": mode}
    aligns = {False, True}
    for a, ax in ((rank - 2, "h"), (rank - 1, "w")):
        got, ok = _resize_axis(b, mode, ctm, nearest_mode, shape[a], out[a], full_scale[a], exact, ax)
        fields.update(got)
        aligns &= ok
    if not aligns:
        raise b.fail("the two axes need different align_corners settings")
    fields["align_corners"] = min(aligns)  # False when both work
    b.emit(ops.Interpolate(**fields), [b.name(0)], b.out(0))
    return b.done()


def _ints_or_floats(values) -> list[float]:
    return [float(v) for v in np.asarray(values).reshape(-1)]


def _nhwc_channel_swap(b: _Build, x: str, first: int | None, second: int | None, out: str | None) -> str:
    """Reorder the channels of [N, A*B, H, W] from (a, b) to (b, a) order (A = first or inferred,
    B = second or inferred), through NHWC: Permute, Reshape, Permute, Reshape, Permute."""
    y = b.emit(ops.Permute(perm=(0, 2, 3, 1)), [x])
    split = (-1 if first is None else first, -1 if second is None else second)
    y = b.emit(ops.Reshape(shape=(0, 0, 0) + split), [y])
    y = b.emit(ops.Permute(perm=(0, 1, 2, 4, 3)), [y])
    y = b.emit(ops.Reshape(shape=(0, 0, 0, -1)), [y])
    return b.emit(ops.Permute(perm=(0, 3, 1, 2)), [y], out)


@_converter("DepthToSpace", targets=("PixelShuffle",))
def convert_depth_to_space(node, opset, inputs):
    """CRD is our PixelShuffle; DCR (the default) first reorders the channels to CRD."""
    b = _Build(node, opset, inputs, ("blocksize", "mode"))
    b.floats(0)
    if b.rank(0) != 4:
        raise b.fail("input must be [N, C, H, W]")
    r = int(b.attr("blocksize"))
    mode = b.attr("mode", "DCR")
    x = b.name(0)
    if mode == "DCR":
        x = _nhwc_channel_swap(b, x, r * r, None, None)
    elif mode != "CRD":
        raise b.fail(f"mode={mode!r}")
    b.emit(ops.PixelShuffle(upscale=r), [x], b.out(0))
    return b.done()


@_converter("SpaceToDepth", targets=("PixelUnshuffle",))
def convert_space_to_depth(node, opset, inputs):
    """Our PixelUnshuffle orders the output channels CRD (``c*r*r + i*r + j``); ONNX's default DCR
    order (``(i*r + j)*C + c``) follows with a channel permutation (docs/ops.md, PixelUnshuffle)."""
    b = _Build(node, opset, inputs, ("blocksize", "mode"))
    b.floats(0)
    if b.rank(0) != 4:
        raise b.fail("input must be [N, C, H, W]")
    r = int(b.attr("blocksize"))
    mode = b.attr("mode", "DCR")
    if mode == "CRD":
        b.emit(ops.PixelUnshuffle(downscale=r), [b.name(0)], b.out(0))
    elif mode == "DCR":
        y = b.emit(ops.PixelUnshuffle(downscale=r), [b.name(0)])
        _nhwc_channel_swap(b, y, None, r * r, b.out(0))
    else:
        raise b.fail(f"mode={mode!r}")
    return b.done()


# -- embeddings ----------------------------------------------------------------------------------
@_converter("Gather", targets=("TokenEmbed",), constants=(1,))
def convert_gather(node, opset, inputs):
    """Gather is a row lookup: our TokenEmbed on ``data`` viewed as a [dim(axis), rest] table
    (Permute and Reshape around it for another axis or rank).  Negative indices wrap in ONNX; our
    TokenEmbed rejects them at run time, so constant indices are normalised here."""
    b = _Build(node, opset, inputs, ("axis",))
    b.floats(0)
    if b.dtype(1) not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise b.fail(f"indices of type {b.dtype(1)}")
    shape = b.shape(0)
    rank = len(shape)
    axis = _axis(b, int(b.attr("axis", 0)), rank)
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


# -- quantization --------------------------------------------------------------------------------
_LINEAR_TYPES = {np.dtype(np.int8): DType.I8, np.dtype(np.uint8): DType.U8}


def _linear_axis(b: _Build, x_rank: int, scale_i: int) -> int:
    """Our payload axis: -1 for a per-tensor scale ([] or [1]), else ONNX's ``axis``."""
    if b.attr("block_size", 0):
        raise b.fail(f"blocked quantization (block_size={b.attr('block_size')}): ours is per tensor or "
                     f"per axis")
    scale_shape = b.info(scale_i).shape
    if scale_shape is None or len(scale_shape) > 1:
        raise b.fail(f"scale of shape {scale_shape}: per tensor or per axis only")
    if math.prod(scale_shape) == 1:
        return -1
    return _axis(b, int(b.attr("axis", 1)), x_rank)


@_converter("QuantizeLinear", targets=("Quantize",))
def convert_quantize_linear(node, opset, inputs):
    b = _Build(node, opset, inputs, ("axis", "block_size", "output_dtype", "saturate", "precision"))
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


@_converter("DequantizeLinear", targets=("Dequantize",))
def convert_dequantize_linear(node, opset, inputs):
    b = _Build(node, opset, inputs, ("axis", "block_size", "output_dtype"))
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


# -- positions -----------------------------------------------------------------------------------
def _rope_table(n: int, rope_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """Our Rope's cos and sin table (docs/ops.md, Rope), positions 0..n-1, f32."""
    exponent = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    inv_freq = np.float32(1.0) / (np.float32(base) ** exponent)
    theta = np.arange(n, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(theta), np.sin(theta)


@_converter("RotaryEmbedding", targets=("Rope",), constants=(1, 2, 3))
def convert_rotary_embedding(node, opset, inputs):
    """RotaryEmbedding with ``interleaved=0`` is our Rope when the caches are the rotary table of a
    frequency base (constants; the base is read off position 1 and the whole table checked) and the
    positions are ``p0 + t`` for every batch row (our Rope takes one start position)."""
    b = _Build(node, opset, inputs, ("interleaved", "num_heads", "rotary_embedding_dim"))
    b.floats(0, 1, 2)
    if b.attr("interleaved", 0):
        raise b.fail("interleaved=1 (GPT-J pairing): our Rope rotates halves (GPT-NeoX pairing)")
    shape = b.shape(0)
    if len(shape) == 4:
        head_dim, seq = shape[3], shape[2]
    elif len(shape) == 3:
        heads = b.attr("num_heads")
        if not heads:
            raise b.fail("a 3-D input needs num_heads")
        head_dim, seq = shape[2] // int(heads), shape[1]
    else:
        raise b.fail(f"input of rank {len(shape)}")
    cos, sin = b.const(1, "cos_cache"), b.const(2, "sin_cache")
    rope_dim = int(b.attr("rotary_embedding_dim", 0)) or 2 * cos.shape[-1]
    if rope_dim != 2 * cos.shape[-1] or rope_dim > head_dim:
        raise b.fail(f"rotary_embedding_dim={rope_dim} does not fit caches {list(cos.shape)} / head {head_dim}")
    if b.has(3):
        pos = b.const(3, "position_ids")
        start = int(pos.reshape(-1)[0]) if pos.size else 0
        if pos.ndim != 2 or not (pos == start + np.arange(pos.shape[1])[None, :]).all():
            raise b.fail("position_ids are not p0 + t, the same in every batch row: our Rope takes one "
                         "start position")
        if cos.ndim != 2 or start + seq > len(cos):
            raise b.fail(f"caches {list(cos.shape)} do not hold positions {start}..{start + seq - 1}")
        table_cos, table_sin = cos, sin  # rows = positions 0..max-1
    else:
        start = 0  # the caches are the rows of positions 0..S-1, per batch
        if cos.ndim != 3 or not (cos == cos[:1]).all() or not (sin == sin[:1]).all():
            raise b.fail("per-batch caches differ: our Rope has one table")
        table_cos, table_sin = cos[0], sin[0]
    half = rope_dim // 2
    base = 10000.0
    if half > 1 and len(table_cos) > 1:
        inv_freq_1 = math.atan2(float(table_sin[1, 1]), float(table_cos[1, 1]))
        if not 0 < inv_freq_1 < 1:
            raise b.fail("cos_cache/sin_cache are not a rotary table (the angle of position 1, frequency 1 "
                         "is not in (0, 1))")
        base = inv_freq_1 ** (-rope_dim / 2)
    if not (math.isfinite(base) and base > 0):
        raise b.fail("cos_cache/sin_cache are not a rotary table")
    for candidate in (float(f"{base:.3g}"), float(f"{base:.6g}"), base):  # the round base it was made with
        want_cos, want_sin = _rope_table(len(table_cos), rope_dim, candidate)
        if np.allclose(table_cos, want_cos, atol=1e-4) and np.allclose(table_sin, want_sin, atol=1e-4):
            base = candidate
            break
    else:
        raise b.fail("cos_cache/sin_cache are not cos/sin(p * base^(-2i/d)) for any base: our Rope computes "
                     "its own table")
    pos_name = b.constant("pos", np.asarray([start], np.float32))
    b.emit(ops.Rope(head_dim=head_dim, rope_dim=rope_dim, base=float(np.float32(base))), [b.name(0), pos_name],
           b.out(0))
    return b.done()


# -- attention -----------------------------------------------------------------------------------
def _structural_allowed(tq: int, tk: int, offset, causal: bool, left: int, right: int,
                        nonpad: np.ndarray | None) -> np.ndarray | None:
    """ONNX Attention's structural mask (causal, window, padding) as booleans [Tq, Tk] or
    [B, 1, Tq, Tk] (per-batch offsets); None when nothing is masked."""
    if not causal and left < 0 and right < 0 and nonpad is None:
        return None
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    offsets = np.asarray(offset).reshape(-1, 1, 1)  # [B or 1, 1, 1]
    diff = (i + offsets) - j  # query position - key position
    allowed = np.ones(diff.shape, bool)
    if causal:
        allowed = allowed & (diff >= 0)
    if left >= 0:
        allowed = allowed & (diff <= left)
    if right >= 0:
        allowed = allowed & (-diff <= right)
    if nonpad is not None:
        allowed = allowed & (j[None] < nonpad.reshape(-1, 1, 1))
        return allowed[:, None]
    return allowed[0]


def _our_structural(tq: int, tk: int, allowed: np.ndarray) -> tuple[str, int] | None:
    """Which of our attention ops masks exactly ``allowed`` [Tq, Tk]: ("causal", 0),
    ("window", w) or ("band", w); None if none does."""
    i = np.arange(tq)[:, None] + (tk - tq)  # our end-aligned query positions
    j = np.arange(tk)[None, :]
    if tq <= tk and np.array_equal(allowed, j <= i):
        return ("causal", 0)
    for w in range(1, tk + 1):
        if tq <= tk and np.array_equal(allowed, (j <= i) & (j > i - w)):
            return ("window", w)
        if np.array_equal(allowed, np.abs(j - i) < w):
            return ("band", w)
    return None


@_converter("Attention", targets=("Sdpa", "SdpaWindow", "KvCache"), constants=(3, 6))
def convert_attention(node, opset, inputs):
    """Attention (opset 23+) as our Sdpa / SdpaWindow, with KvCache for past_key/past_value.

    Heads are contiguous along our last dim: 4-D [B, H, S, hd] inputs are permuted to
    [B, S, H*hd] and back.  A scale other than 1/sqrt(head_dim) multiplies Q first.  The causal
    and window masks of ONNX are aligned to the cache offset (top-left without a cache), ours to
    the end: when they differ, the structural mask becomes an explicit additive mask.  Boolean and
    short masks must be constants (we have no Where/Pad op).  softcap, qk_matmul_output and
    different value head sizes have no counterpart.
    """
    b = _Build(node, opset, inputs, ("is_causal", "kv_num_heads", "q_num_heads", "qk_matmul_output_mode",
                                     "scale", "softcap", "softmax_precision", "left_window_size",
                                     "right_window_size"))
    dtype = b.floats(0, 1, 2)
    if b.attr("softcap", 0.0):
        raise b.fail(f"softcap={b.attr('softcap')}: our attention has no tanh soft-capping of scores")
    b.only_outputs(3, "qk_matmul_output (the scores) is not an output of our attention ops")
    precision = b.attr("softmax_precision")
    if precision is not None and int(precision) not in _ONNX_FLOAT_TYPES:
        raise b.fail(f"softmax_precision={precision}")
    q, k, v = b.shape(0), b.shape(1), b.shape(2)
    rank = len(q)
    if rank not in (3, 4) or len(k) != rank or len(v) != rank:
        raise b.fail(f"Q, K, V of ranks {len(q)}, {len(k)}, {len(v)}")
    if rank == 4:
        if b.attr("q_num_heads") is not None or b.attr("kv_num_heads") is not None:
            raise b.fail("q_num_heads/kv_num_heads with 4-D inputs")
        batch, hq, sq, hd = q
        hkv, sk, hdk, hdv = k[1], k[2], k[3], v[3]
    else:
        hq, hkv = b.attr("q_num_heads"), b.attr("kv_num_heads")
        if not hq or not hkv:
            raise b.fail("3-D inputs need q_num_heads and kv_num_heads")
        batch, sq, sk = q[0], q[1], k[1]
        if q[2] % hq or k[2] % hkv or v[2] % hkv:
            raise b.fail("hidden sizes are not multiples of the head counts")
        hd, hdk, hdv = q[2] // hq, k[2] // hkv, v[2] // hkv
    if hdk != hd or hdv != hd:
        raise b.fail(f"head sizes q {hd}, k {hdk}, v {hdv}: our attention has one head_dim for Q, K and V")
    if hq % hkv:
        raise b.fail(f"{hq} query heads are not a multiple of {hkv} KV heads")
    past = b.has(4) or b.has(5)
    if past and not (b.has(4) and b.has(5)):
        raise b.fail("past_key and past_value go together")
    nonpad = b.const(6, "nonpad_kv_seqlen") if b.has(6) else None
    p_len = b.shape(4)[2] if past else 0
    if past and (b.shape(4) != (batch, hkv, p_len, hd) or b.shape(5) != (batch, hkv, p_len, hd)):
        raise b.fail(f"past_key/past_value {b.shape(4)} / {b.shape(5)} are not [B, KV, P, head_size]")
    tk = p_len + sk
    causal = bool(b.attr("is_causal", 0))
    left, right = int(b.attr("left_window_size", -1)), int(b.attr("right_window_size", -1))

    # The masks: ONNX's structural mask, matched by one of our ops or made explicit.
    if nonpad is not None:
        offset = nonpad.reshape(-1) - sq if causal or left >= 0 or right >= 0 else 0
    else:
        offset = p_len
    allowed = _structural_allowed(sq, tk, offset, causal, left, right, nonpad)
    ours = None if allowed is None or allowed.ndim != 2 else _our_structural(sq, tk, allowed)
    extra = None
    if allowed is not None and ours is None:
        extra = np.where(allowed, 0.0, -np.inf).astype(dtype)
    mask = None
    if b.has(3):
        m_dtype, m_shape, value = b.dtype(3), b.info(3).shape, b.info(3).value
        if m_dtype != np.bool_ and m_dtype != dtype:
            raise b.fail(f"attn_mask of type {m_dtype} with inputs of type {dtype}")
        if m_dtype == np.bool_ or m_shape is None or m_shape[-1] != tk:
            if value is None:
                raise b.fail("a boolean attn_mask, or one shorter than the keys, must be a constant (we have "
                             "no Where or Pad op)")
            if m_dtype == np.bool_:
                value = np.where(value, 0.0, -np.inf)
            if value.shape[-1] != tk:
                value = np.pad(value, [(0, 0)] * (value.ndim - 1) + [(0, tk - value.shape[-1])],
                               constant_values=-np.inf)
            mask = b.constant("mask", (value if extra is None else value + extra).astype(dtype))
        else:
            mask = b.name(3)
            if extra is not None:
                mask = b.emit(ops.Add(), [mask, b.constant("mask", extra)])
    elif extra is not None:
        mask = b.constant("mask", extra)

    # Q in our layout [B, S, H*hd], scaled when the scale is not 1/sqrt(hd).
    def to_ours(name: str) -> str:
        y = b.emit(ops.Permute(perm=(0, 2, 1, 3)), [name])
        return b.emit(ops.Reshape(shape=(0, 0, -1)), [y])

    qn = to_ours(b.name(0)) if rank == 4 else b.name(0)
    scale = b.attr("scale")
    if scale is not None:
        factor = float(scale) * math.sqrt(hd)
        if abs(factor - 1.0) > 1e-7:
            qn = b.emit(ops.Mul(), [qn, b.scalar("scale", factor, dtype)])
    if b.has(4) or b.out(1) or b.out(2):
        heads4 = []
        for i in (1, 2):
            name = b.name(i)
            if rank == 3:
                name = b.emit(ops.Reshape(shape=(0, 0, hkv, hd)), [name])
                name = b.emit(ops.Permute(perm=(0, 2, 1, 3)), [name])
            heads4.append(name)
        present = b.emit(ops.KvCache(), heads4, [b.out(1), b.out(2)])
        if past:
            b.kv.append(KvPriming(len(b.nodes) - 1, b.name(4), b.name(5)))
        kn, vn = to_ours(present[0]), to_ours(present[1])
    else:
        kn, vn = (to_ours(b.name(1)), to_ours(b.name(2))) if rank == 4 else (b.name(1), b.name(2))
    heads = dict(num_heads=int(hq), kv_heads=int(hkv), head_dim=int(hd))
    if ours is None or ours[0] == "causal":
        op = ops.Sdpa(**heads, causal=ours is not None)
    else:
        op = ops.SdpaWindow(**heads, window=ours[1], causal=ours[0] == "window")
    y = b.emit(op, [qn, kn, vn] + ([mask] if mask is not None else []), b.out(0) if rank == 3 else None)
    if rank == 4:
        y = b.emit(ops.Reshape(shape=(0, 0, int(hq), int(hd))), [y])
        b.emit(ops.Permute(perm=(0, 2, 1, 3)), [y], b.out(0))
    return b.done()


# -- others --------------------------------------------------------------------------------------
@_converter("Einsum", targets=("Permute", "Matmul", "Reshape"))
def convert_einsum(node, opset, inputs):
    """The einsum forms that are one of our ops: a permutation (Permute), an identity (Reshape),
    and batched matrix or vector products (Matmul)."""
    b = _Build(node, opset, inputs, ("equation",))
    b.floats(*range(len(inputs)))
    eq = str(b.attr("equation", "")).replace(" ", "")
    if "..." in eq:
        raise b.fail(f"equation {eq!r}: equations with an ellipsis are not mapped")
    if "->" in eq:
        lhs, out = eq.split("->")
    else:  # implicit output: the indices that appear once, in alphabetical order
        lhs = eq
        letters = lhs.replace(",", "")
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    terms = lhs.split(",")
    if len(terms) != len(inputs) or any(len(set(t)) != len(t) for t in terms + [out]):
        raise b.fail(f"equation {eq!r}: repeated indices (diagonals) are not mapped")
    if len(terms) == 1:
        (t,) = terms
        if sorted(t) != sorted(out):
            raise b.fail(f"equation {eq!r} sums over an index: we have no reduction op")
        if t == out:
            b.emit(ops.Reshape(shape=(0,) * len(t)), [b.name(0)], b.out(0))
        else:
            b.emit(ops.Permute(perm=tuple(t.index(c) for c in out)), [b.name(0)], b.out(0))
        return b.done()
    if len(terms) == 2:
        a, c = terms
        shared = [x for x in a if x in c and x not in out]
        if len(shared) == 1:
            s = shared[0]
            batch_a, batch_c = a[:-2], c[:-2]
            if len(a) == 1 and len(c) == 1 and out == "":
                b.emit(ops.Matmul(transpose_b=False), [b.name(0), b.name(1)], b.out(0))
                return b.done()
            if len(a) >= 2 and len(c) >= 2 and batch_a == batch_c and a[-1] == s and s not in batch_a:
                m = a[-2]
                if c[-2] == s and out == batch_a + m + c[-1]:
                    b.emit(ops.Matmul(transpose_b=False), [b.name(0), b.name(1)], b.out(0))
                    return b.done()
                if c[-1] == s and out == batch_a + m + c[-2]:
                    b.emit(ops.Matmul(transpose_b=True), [b.name(0), b.name(1)], b.out(0))
                    return b.done()
    raise b.fail(f"equation {eq!r} is not a permutation or a (batched) matrix product")
