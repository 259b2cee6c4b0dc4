"""The ONNX importer: an ``.onnx`` graph in, our Graph IR and weights out.

``load`` parses the file with the ``onnx`` package, runs ONNX shape inference (with data
propagation, so shapes computed from shapes are known), then walks the nodes in order:

* initializers and ``Constant`` outputs are constants; a node whose inputs are all constants is
  evaluated now, with ONNX's reference implementation, and its outputs are constants too
  ("folding"); ``Shape`` and ``Size`` of a value whose shape is static are constants as well, so
  the Shape -> Gather -> Concat -> Reshape chains exporters write for reshape targets disappear;
* initializers in external data (``external``) over ``EAGER_BYTES`` are :class:`~.external.Lazy`:
  read when written, and a fold on one of them is deferred to then as well (its outputs are Lazy);
* every other node goes through its converter (``registry.CONVERTERS``; it sees the constants'
  values, a Lazy one's only at the input positions of ``CONSTANT_INPUTS``);
* the constants our nodes read become weights (optionally stored as ``dtype``), Lazy ones as
  :class:`~dist_runtime.tensor.Deferred`: a conversion holds one large tensor at a time.

Before anything is converted the whole graph is checked, so one error lists every operator that
has no converter (with every node where it occurs) rather than the first one.  ``convert_onnx``
(``dist-runtime convert FILE.onnx``) writes the result with ``common.write_imported``.
See docs/import_onnx.md.
"""

from __future__ import annotations

import functools
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from ...dtypes import DType
from ...errors import DistRuntimeError
from ...ir import ops
from ...ir.builder import GraphBuilder
from ...ir.graph import POS, Graph, TensorSpec
from ...tensor import Deferred, QuantizedArray
from ..common import (DTYPES, ConvertReport, Imported, Progress, quantize_rows, storage_targets, with_weight_specs,
                      write_imported)
from .errors import OnnxImportError
from .external import EAGER_BYTES, Lazy, Pages, split_external
from .registry import CONSTANT_INPUTS, CONVERTERS, OnnxValue, UnsupportedOnnxError, convert_node

__all__ = ["MAX_FILE_BYTES", "OnnxImport", "OnnxImportError", "UnsupportedOperatorsError", "convert_onnx",
           "load"]

#: Protobuf cannot serialize a message of 2 GiB or more: a larger model keeps its weights in
#: external data (read from their own files, ``external``; this cap is the ``.onnx`` file's).
MAX_FILE_BYTES = 2**31 - 1

#: Never folded, even with constant inputs: their value is not a function of their inputs.
_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                               "Multinomial", "Bernoulli"})
#: Not folded when they could be: folding would store a quantized weight widened to floats.
_KEEP_UNFOLDED = frozenset({"DequantizeLinear"})
_DEFAULT_DOMAINS = ("", "ai.onnx")


class UnsupportedOperatorsError(OnnxImportError, UnsupportedOnnxError):
    """Operators of the graph that have no converter, each with the nodes where it occurs."""

    def __init__(self, source: str, where: dict[str, list[str]]):
        self.operators = where
        listing = "; ".join(f"{op} at {', '.join(nodes)}" for op, nodes in sorted(where.items()))
        DistRuntimeError.__init__(
            self, f"{source}: {len(where)} operator(s) cannot be imported (docs/import_onnx.md lists what "
                  f"can): {listing}")
        self.op_type, self.reason, self.node = ", ".join(sorted(where)), "no converter", None


@dataclass(frozen=True)
class KvPrimed:
    """A KvCache node of the graph (by position) that stands for ONNX ``past_key``/``past_value``
    inputs: those are not graph inputs of ours; a caller that has them writes them into the
    node's session state before the first run (see ``registry.KvPriming``)."""

    node: int
    past_key: str
    past_value: str


@dataclass
class OnnxImport:
    """What the importer learned besides the graph (``Imported.config``)."""

    opset: int
    inputs: dict[str, TensorSpec]  # ONNX graph inputs (initializers excluded), as declared
    outputs: list[str]
    folded: int = 0  # nodes evaluated at import time
    kv_caches: list[KvPrimed] = field(default_factory=list)
    unused_inputs: list[str] = field(default_factory=list)  # ONNX inputs our graph never reads


# -- reading ---------------------------------------------------------------------------------------
def _read(source, max_bytes: int) -> tuple[onnx.ModelProto, str]:
    if isinstance(source, onnx.ModelProto):
        return source, source.graph.name or "<model>"
    path = Path(source)
    label = str(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise OnnxImportError(f"cannot read {label}: {e.strerror or e}") from None
    if size > max_bytes:
        raise OnnxImportError(f"{label} is {size:,} bytes, over the importer's limit of {max_bytes:,}")
    try:
        # load_external_data=False: external tensors are checked and read by ``external``.
        model = onnx.load_model(label, load_external_data=False)
    except Exception as e:  # noqa: BLE001  (protobuf's DecodeError, onnx's own errors, OSError)
        raise OnnxImportError(f"{label} is not a readable ONNX model: {type(e).__name__}: {e}") from None
    return model, label


def _check_model(model: onnx.ModelProto, label: str) -> int:
    """Refuse what no walk could import; return the default-domain opset."""
    opsets = {o.domain: o.version for o in model.opset_import}
    opset = opsets.get("", opsets.get("ai.onnx"))
    if not model.HasField("graph") or opset is None:
        raise OnnxImportError(f"{label} is not an ONNX model: no graph or no ai.onnx opset import "
                              f"(a truncated or foreign file?)")
    if not model.graph.output:
        raise OnnxImportError(f"{label}: the graph has no outputs")
    external = [t.name for t in _attribute_tensors(model.graph) if external_data_helper.uses_external_data(t)]
    if external:
        raise OnnxImportError(
            f"{label}: node attribute tensor(s) {', '.join(external[:8])} are stored as external data, which "
            f"this importer reads for initializers only; save the model with onnx.save_model(model, path, "
            f"save_as_external_data=True, convert_attribute=False)")
    if model.graph.sparse_initializer:
        names = ", ".join(s.values.name for s in model.graph.sparse_initializer)
        raise OnnxImportError(f"{label}: sparse initializers ({names}) are not supported")
    return opset


def _attribute_tensors(graph: onnx.GraphProto):
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t


def _infer(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as e:  # noqa: BLE001  (onnx raises InferenceError, ValidationError, RuntimeError)
        raise OnnxImportError(f"{label}: ONNX shape inference failed: {e}") from None


# -- what is known about each value before the walk ------------------------------------------------
@dataclass(frozen=True)
class _Type:
    shape: tuple[int | None, ...] | None  # None: unknown rank; a None dim: unknown length
    dtype: np.dtype | None


def _type_of(value: onnx.ValueInfoProto) -> _Type:
    if not value.type.HasField("tensor_type"):
        return _Type(None, None)
    t = value.type.tensor_type
    dtype = None
    if t.elem_type:
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))
        except (KeyError, TypeError, ValueError):
            dtype = None
    shape = None
    if t.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
    return _Type(shape, dtype)


def _types(graph: onnx.GraphProto) -> dict[str, _Type]:
    found = {}
    for v in (*graph.input, *graph.value_info, *graph.output):
        found[v.name] = _type_of(v)
    return found


def _location(i: int, node: onnx.NodeProto) -> str:
    return f"node #{i} {node.name!r}" if node.name else f"node #{i}"


def _subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def _static_shape(types: dict[str, _Type], name: str) -> tuple[int, ...] | None:
    t = types.get(name)
    if t is None or t.shape is None or any(d is None for d in t.shape):
        return None
    return t.shape


def _shape_value(node: onnx.NodeProto, types: dict[str, _Type]) -> np.ndarray | None:
    """The value of a ``Shape``/``Size`` node whose input has a static shape, else None."""
    shape = _static_shape(types, node.input[0]) if node.input else None
    if shape is None:
        return None
    if node.op_type == "Size":
        return np.array(math.prod(shape), np.int64)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return np.array(shape[slice(attrs.get("start", 0), attrs.get("end"))], np.int64)


def _check_defined(graph: onnx.GraphProto, label: str) -> None:
    """Every name a node reads is a graph input, an initializer or an earlier node's output."""
    defined = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    for i, node in enumerate(graph.node):
        undefined = [n for n in node.input if n and n not in defined]
        if undefined:
            raise OnnxImportError(
                f"{label}: {_location(i, node)} ({node.op_type}) reads {', '.join(map(repr, undefined))}, which "
                f"is not a graph input, an initializer or an output of an earlier node (a missing "
                f"initializer, or nodes out of order)")
        defined.update(o for o in node.output if o)


def _foldable(node: onnx.NodeProto, types: dict[str, _Type], constants: dict) -> bool:
    if node.domain not in _DEFAULT_DOMAINS or _subgraph(node):
        return False
    if node.op_type in ("Shape", "Size"):
        return _shape_value(node, types) is not None or all(n in constants for n in node.input if n)
    return (node.op_type not in _NONDETERMINISTIC and node.op_type not in _KEEP_UNFOLDED
            and all(n in constants for n in node.input if n))


def _check_supported(nodes: list[tuple[int, onnx.NodeProto]], label: str) -> None:
    """One error listing every operator left (after folding) that has no converter."""
    unsupported: dict[str, list[str]] = defaultdict(list)
    for i, node in nodes:
        if node.domain not in _DEFAULT_DOMAINS:
            unsupported[f"{node.domain}.{node.op_type} (domain {node.domain})"].append(_location(i, node))
        elif _subgraph(node):
            unsupported[f"{node.op_type} (control flow with a subgraph)"].append(_location(i, node))
        elif node.op_type not in CONVERTERS:
            unsupported[node.op_type].append(_location(i, node))
    if unsupported:
        raise UnsupportedOperatorsError(label, dict(unsupported))


# -- folding ---------------------------------------------------------------------------------------
def _large(constant: np.ndarray | Lazy) -> bool:
    """A Lazy constant over ``EAGER_BYTES``: read only when it is written."""
    return isinstance(constant, Lazy) and constant.nbytes > EAGER_BYTES


class _Folder:
    """Evaluates constant nodes until none is left: a fold can make shapes static that make
    another ``Shape`` foldable, so each round ends with ONNX shape inference on what remains.

    A node reading one large :class:`Lazy` constant (over ``EAGER_BYTES``) is folded when it is
    written: its outputs are Lazy too, of the types shape inference gives them.  A node reading
    two or more, or whose output types are not static, is left to its converter."""

    def __init__(self, raw: onnx.ModelProto, label: str, lazy: dict[str, Lazy]):
        self.raw, self.label = raw, label
        self.opsets = {o.domain: o.version for o in raw.opset_import}
        self.constants: dict[str, np.ndarray | Lazy] = {
            init.name: lazy[init.name] if init.name in lazy else numpy_helper.to_array(init)
            for init in raw.graph.initializer}
        self.folded: dict[str, np.ndarray | Lazy] = {}  # node outputs evaluated here
        self.count = 0

    def run(self) -> tuple[list[tuple[int, onnx.NodeProto]], dict[str, _Type]]:
        """The nodes left to convert (with their positions in the file) and the value types."""
        nodes = list(enumerate(self.raw.graph.node))
        model = _infer(self.raw, self.label)
        while True:
            types = _types(model.graph) | {n: _Type(c.shape, c.dtype) for n, c in self.constants.items()
                                           if isinstance(c, Lazy)}
            left = [(i, n) for i, n in nodes if not self._fold(i, n, types)]
            if len(left) == len(nodes):
                return nodes, types
            nodes = left
            model = _infer(self._remaining(nodes), self.label)

    def _fold(self, i: int, node: onnx.NodeProto, types: dict[str, _Type]) -> bool:
        if not _foldable(node, types, self.constants):
            return False
        value = _shape_value(node, types) if node.op_type in ("Shape", "Size") else None
        if value is not None:
            outs = [value]
        else:
            names = [n for n in dict.fromkeys(node.input) if n]
            large = [n for n in names if _large(self.constants[n])]
            if large:
                return len(large) == 1 and self._defer(i, node, names, types)
            outs = self._evaluate(i, node, {n: self._array(n) for n in names})
        for name, array in zip(node.output, outs):
            if name:
                self.constants[name] = self.folded[name] = np.asarray(array)
        self.count += 1
        return True

    def _array(self, name: str) -> np.ndarray:
        """Constant ``name``'s value (a small Lazy one is read, and kept)."""
        if isinstance(self.constants[name], Lazy):
            self.constants[name] = self.constants[name].value()
        return self.constants[name]

    def _defer(self, i: int, node: onnx.NodeProto, names: list[str], types: dict[str, _Type]) -> bool:
        """Fold ``node`` when its outputs are written: each output a Lazy that evaluates the node."""
        outs = {k: o for k, o in enumerate(node.output) if o}
        shapes = {k: _static_shape(types, o) for k, o in outs.items()}
        if any(shapes[k] is None or types[o].dtype is None for k, o in outs.items()):
            return False
        inputs = {n: self.constants[n] if _large(self.constants[n]) else self._array(n) for n in names}
        for k, name in outs.items():
            pages, dtype = Pages(), types[name].dtype
            make = functools.partial(self._deferred_output, i, node, inputs, k, dtype, shapes[k], pages)
            self.constants[name] = self.folded[name] = Lazy(dtype, shapes[k], make, pages.release)
        self.count += 1
        return True

    def _deferred_output(self, i: int, node: onnx.NodeProto, inputs: dict, k: int, dtype: np.dtype,
                         shape: tuple[int, ...], pages: Pages) -> np.ndarray:
        """Output ``k`` of ``node``, evaluated now, in ``pages`` (its Lazy inputs given back)."""
        lazy = [v for v in inputs.values() if isinstance(v, Lazy)]
        out = np.asarray(self._evaluate(i, node, {n: v.make() if isinstance(v, Lazy) else v
                                                  for n, v in inputs.items()})[k])
        if out.shape != shape or out.dtype != dtype:
            raise OnnxImportError(f"{self.label}: {_location(i, node)} ({node.op_type}) made output "
                                  f"{node.output[k]!r} as {out.dtype}{list(out.shape)}, where shape inference "
                                  f"gave {dtype}{list(shape)}")
        kept = pages.empty(shape, dtype)
        np.copyto(kept, out)
        del out
        for v in lazy:
            if v.done is not None:
                v.done()
        return kept

    def _evaluate(self, i: int, node: onnx.NodeProto, values: dict[str, np.ndarray]) -> list:
        from onnx.reference import ReferenceEvaluator

        graph = helper.make_graph([node], "fold", [onnx.ValueInfoProto(name=n) for n in values],
                                  [onnx.ValueInfoProto(name=o) for o in node.output if o])
        try:
            evaluator = ReferenceEvaluator(graph, opsets=self.opsets)
            with np.errstate(all="ignore"):
                return evaluator.run(None, values)
        except Exception as e:  # noqa: BLE001  (the reference raises what its numpy code raises)
            raise OnnxImportError(f"{self.label}: cannot evaluate {_location(i, node)} ({node.op_type}) on its "
                                  f"constant inputs: {type(e).__name__}: {e}") from None

    def _remaining(self, nodes: list[tuple[int, onnx.NodeProto]]) -> onnx.ModelProto:
        """The model with the folded nodes replaced by initializers holding their values (a Lazy
        one by a graph input of its type: shape inference needs no values of large tensors)."""
        model = onnx.ModelProto()
        model.CopyFrom(self.raw)
        del model.graph.node[:]
        model.graph.node.extend(n for _, n in nodes)
        del model.graph.value_info[:]
        for n, a in self.folded.items():
            if isinstance(a, Lazy):
                model.graph.input.append(helper.make_tensor_value_info(
                    n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape))
            else:
                model.graph.initializer.append(numpy_helper.from_array(a, n))
        return model


# -- converting ------------------------------------------------------------------------------------
class _Walk(GraphBuilder):
    """Converts the nodes left after folding, in order, collecting our nodes."""

    def __init__(self, opset: int, label: str, constants: dict[str, np.ndarray | Lazy], types: dict[str, _Type]):
        super().__init__()
        self.opset, self.label, self.constants, self.types = opset, label, constants, types
        self.kv: list[KvPrimed] = []

    def value(self, name: str, needed: bool = False) -> OnnxValue:
        """What the converter knows of ``name``; a Lazy constant's value only when ``needed`` (read
        then, and kept: the converter composes its value into its nodes)."""
        constant = self.constants.get(name)
        if isinstance(constant, Lazy):
            if not needed:
                return OnnxValue(name, constant.shape, constant.dtype)
            constant = self.constants[name] = constant.value()
        if constant is not None:
            return OnnxValue.of(name, constant, constant=True)
        t = self.types.get(name, _Type(None, None))
        return OnnxValue(name, t.shape, t.dtype)

    def convert(self, i: int, node: onnx.NodeProto) -> None:
        needed = CONSTANT_INPUTS.get(node.op_type, ())
        inputs = [self.value(n, k in needed) if n else None for k, n in enumerate(node.input)]
        try:
            converted = convert_node(node, self.opset, inputs)
        except UnsupportedOnnxError as e:
            raise UnsupportedOnnxError(e.op_type, e.reason, _location(i, node).removeprefix("node ")) from None
        except DistRuntimeError:
            raise
        except Exception as e:  # noqa: BLE001  (a malformed node: wrong arity, attribute types...)
            raise OnnxImportError(f"{self.label}: cannot convert {_location(i, node)} ({node.op_type}): "
                                  f"{type(e).__name__}: {e}") from None
        self.constants.update(converted.constants)
        start = len(self.nodes)
        for n in converted.nodes:
            self.emit(n.op, n.inputs, n.outputs)
        self.kv.extend(KvPrimed(start + p.node, p.past_key, p.past_value) for p in converted.kv_caches)

    def output(self, name: str) -> None:
        """An ONNX output that is a constant is produced by an identity Reshape of it, as our
        graph outputs must be produced by a node."""
        if any(name in n.outputs for n in self.nodes):
            return
        if name not in self.constants:
            raise OnnxImportError(f"{self.label}: graph output {name!r} is a graph input passed through "
                                  f"unchanged; our graphs cannot name one tensor both input and output")
        source = f"{name}::value"
        self.constants[source] = self.constants[name]
        self.emit(ops.Reshape(shape=(0,) * self.constants[name].ndim), [source], name)


def _input_spec(label: str, value: onnx.ValueInfoProto) -> TensorSpec:
    t = _type_of(value)
    if t.shape is None or t.dtype is None:
        raise OnnxImportError(f"{label}: graph input {value.name!r} has no tensor type with a rank")
    try:
        return TensorSpec(tuple(-1 if d is None else d for d in t.shape), DType.from_numpy(t.dtype))
    except TypeError:
        raise OnnxImportError(f"{label}: graph input {value.name!r} has element type {t.dtype}, "
                              f"which our tensors do not carry") from None


def _weights(walk: _Walk, graph: Graph) -> dict[str, np.ndarray | Deferred]:
    """The constants our nodes read, in order of first use (a Lazy one as a Deferred weight)."""
    read = dict.fromkeys(n for node in graph.nodes for n in node.inputs if n in walk.constants)
    weights = {}
    for name in read:
        constant = walk.constants[name]
        if not isinstance(constant, Lazy):
            constant = np.ascontiguousarray(constant)
        try:
            ours = DType.from_numpy(constant.dtype)
        except TypeError:
            raise OnnxImportError(f"{walk.label}: constant {name!r} has element type {constant.dtype}, which "
                                  f"our tensors do not carry") from None
        weights[name] = Deferred(ours, constant.shape, constant.make, constant.done) if isinstance(
            constant, Lazy) else constant
    return weights


def _store(graph: Graph, weights: dict[str, np.ndarray | Deferred], dtype: str | None) -> dict:
    """Matmul weights stored as ``dtype`` (``common.storage_targets``); float ones only (a
    Deferred one is converted when it is made)."""
    if dtype in (None, "f32"):
        return weights
    targets = storage_targets(graph, DType[dtype.upper()])
    return {n: _stored(w, targets[n]) for n, w in weights.items()}


def _stored(w: np.ndarray | Deferred, target: DType) -> np.ndarray | Deferred:
    """``w`` stored as ``target`` (float weights only; a Deferred one when it is made)."""
    kind = w.dtype.numpy.kind if isinstance(w, Deferred) else w.dtype.kind
    if target == DType.F32 or kind != "f":
        return w
    if isinstance(w, Deferred):
        return Deferred(target, w.shape, lambda make=w.make: quantize_rows(make(), target), w.done)
    return quantize_rows(w, target)


def load(source, dtype: str | None = None, *, progress: bool = False,
         max_bytes: int = MAX_FILE_BYTES) -> Imported:
    """Import an ONNX model (a path or an ``onnx.ModelProto``): graph, weights, metadata.

    ``dtype`` (one of ``common.DTYPES``) stores the matmul weights in that type; the others keep
    the initializers' types.  Initializers in external data over ``EAGER_BYTES`` (read from the
    files beside a path; a ModelProto's cannot be) are :class:`~dist_runtime.tensor.Deferred`
    weights, read when written.  Raises :class:`OnnxImportError` (a subclass for unsupported
    operators) or ``UnsupportedOnnxError`` (a converter refusing a node), naming where.
    """
    if dtype is not None and dtype not in DTYPES:
        raise OnnxImportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    raw, label = _read(source, max_bytes)
    opset = _check_model(raw, label)
    _check_reserved(raw.graph, label)
    _check_defined(raw.graph, label)
    base = None if isinstance(source, onnx.ModelProto) else Path(source).parent
    folder = _Folder(raw, label, split_external(raw, base, label))
    nodes, types = folder.run()
    _check_supported(nodes, label)
    walk = _Walk(opset, label, folder.constants, types)
    bar = Progress(len(nodes), "importing", progress, unit="node")
    try:
        for i, node in nodes:
            walk.convert(i, node)
            bar.update()
    finally:
        bar.close()
    outputs = [v.name for v in raw.graph.output]
    for name in outputs:
        walk.output(name)
    initializers = {i.name for i in raw.graph.initializer}
    declared = {v.name: _input_spec(label, v) for v in raw.graph.input if v.name not in initializers}
    ours = Graph(walk.nodes, [], outputs, {})
    weights = _weights(walk, ours)
    weights = _store(with_weight_specs(ours, weights), weights, dtype)
    ours = with_weight_specs(ours, weights)
    ours.inputs = [declared[n] for n in ours.input_names]
    primed = {p for k in walk.kv for p in (k.past_key, k.past_value)}
    info = OnnxImport(opset, declared, outputs, folder.count, walk.kv,
                      [n for n in declared if n not in ours.input_names and n not in primed])
    return Imported(ours, weights, _metadata(raw, label, opset, dtype, info), "onnx",
                    _source_dtypes(raw.graph), _ignored(raw.graph, weights), None, info)


def _check_reserved(graph: onnx.GraphProto, label: str) -> None:
    """Our executor injects a tensor named ``pos``; an ONNX tensor of that name would shadow it."""
    names = {v.name for v in graph.input} | {o for n in graph.node for o in n.output} | {
        i.name for i in graph.initializer}
    if POS in names:
        raise OnnxImportError(f"{label}: a tensor is named {POS!r}, the name our executor gives the run "
                              f"position; rename it in the ONNX graph")


def _source_dtypes(graph: onnx.GraphProto) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for init in graph.initializer:
        counts[onnx.TensorProto.DataType.Name(init.data_type).lower()] += 1
    return dict(counts)


def _ignored(graph: onnx.GraphProto, weights: dict) -> list[str]:
    """Initializers no node reads at all (those consumed at import time are not ignored)."""
    read = {n for node in graph.node for n in node.input}
    return sorted(i.name for i in graph.initializer if i.name not in read and i.name not in weights)


def _metadata(model: onnx.ModelProto, label: str, opset: int, dtype: str | None, info: OnnxImport) -> dict:
    name = Path(label).stem if label.endswith(".onnx") else (model.graph.name or "onnx")
    source = {"format": "onnx", "opset": opset, "ir_version": int(model.ir_version),
              "graph": model.graph.name, "folded_nodes": info.folded}
    if model.producer_name:
        source["producer"] = f"{model.producer_name} {model.producer_version}".strip()
    return {"name": name, "architecture": "onnx", "created_by": "dist-runtime convert", "source": source,
            "dtype": dtype or "as stored", "inputs": list(info.inputs), "outputs": list(info.outputs)}


def convert_onnx(source, out, dtype: str | None = None, *, progress: bool = False) -> ConvertReport:
    """``dist-runtime convert FILE.onnx -o OUT``: import and write ``OUT`` (atomically: nothing is
    left behind when the import fails)."""
    start = time.perf_counter()
    return write_imported(load(source, dtype, progress=progress), out, "onnx", start, progress=progress)

