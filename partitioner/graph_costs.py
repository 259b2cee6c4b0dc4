"""The cost model of a Graph IR graph, from the graph alone (no weights are read).

Shapes come from the op table's shape rules at the requested maximum shapes: every ``-1`` dim of
a graph input is the number of tokens per call (``tokens``: by default :func:`pass_rows`, the rows
of the largest pass the runtime makes), and every ``-1`` dim left after inference (a KV cache's
past + new rows) is the maximum context.  From the shapes:

* weights: each node's weight inputs, sized by their index entry (``size``, else dtype x shape);
* KV: the outputs of each ``KvCache`` node at the maximum context, times the sessions in flight;
* activations: every intermediate and graph input at its resolved size, plus the scratch an op
  holds while it runs (attention's scores and probabilities), times the micro-batches in flight;
  a ``KvCache`` output is a view into its cache, so it costs no extra memory but still costs
  bytes if it crosses a cut;
* compute: FLOPs per node (``flops.py``).

Shape inference is memoised on (op payload, input specs): a model repeats the same layer many
times, so a 100k-node graph costs a few thousand rule calls instead of 100k.  A rule's error is
re-raised through ``dist_runtime.ir.validate.infer_shapes`` so that it names the node.
"""

from __future__ import annotations

from itertools import chain, compress, repeat
from typing import Mapping, Sequence

import numpy as np

from dist_runtime.dtypes import DType
from dist_runtime.dtypes import kv_dtype as kv_dtype_of
from dist_runtime.errors import DistRuntimeError, GraphValidationError, InfeasiblePlanError, ModelFormatError
from dist_runtime.ir.graph import POS, Graph, TensorSpec
from dist_runtime.ir.shape_rules import ShapeError
from dist_runtime.ir.validate import POS_SPEC, infer_shapes
from dist_runtime.scheduling_defaults import DEFAULT_BATCH_TOKENS

from .costs import CostModel, TensorTable, live_and_cut
from .flops import flops, workspace
from .order import execution_order


class _Sizer:
    """Bytes and resolved shapes of specs, with ``-1`` read as the maximum context."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context
        self._cache: dict[TensorSpec, tuple[tuple[int, ...], int]] = {}

    def __call__(self, spec: TensorSpec) -> tuple[tuple[int, ...], int]:
        hit = self._cache.get(spec)
        if hit is None:
            shape = tuple(self.max_context if d == -1 else d for d in spec.shape)
            try:
                size = spec.dtype.nbytes(shape)
            except ModelFormatError as e:
                raise GraphValidationError(f"cannot size {spec} at context {self.max_context}: {e}") from None
            hit = self._cache[spec] = (shape, size)
        return hit


def _resolve_input(spec: TensorSpec, tokens: int) -> TensorSpec:
    return TensorSpec(tuple(tokens if d == -1 else d for d in spec.shape), spec.dtype)


def _too_many_inputs(graph: Graph, names: list[str]) -> GraphValidationError:
    return GraphValidationError(
        f"the graph consumes {len(names)} names that are neither produced, weights nor 'pos' "
        f"({names[:6]}{'...' if len(names) > 6 else ''}) but declares {len(graph.inputs)} "
        "input specs: are its weights missing? (load the graph from a .model file, or pass "
        "weights=model.index)"
    )


def _input_specs(graph: Graph, tokens: int) -> dict[str, TensorSpec]:
    """Graph input name -> resolved spec: the names consumed that no node produces and that are
    neither weights nor ``pos``, in order of first use in the *listed* order (what
    ``Graph.input_names`` means for a graph in topological order; it works for any order)."""
    produced = {out for node in graph.nodes for out in node.outputs}
    names = list(dict.fromkeys(
        name for node in graph.nodes for name in node.inputs
        if name not in produced and name not in graph.weights and name != POS
    ))
    if len(names) != len(graph.inputs):
        raise _too_many_inputs(graph, names)
    return {name: _resolve_input(spec, tokens) for name, spec in zip(names, graph.inputs)}


def pass_rows(graph: Graph, max_context: int, batch_tokens: int = DEFAULT_BATCH_TOKENS) -> int:
    """The rows of the largest call the runtime makes of ``graph``: a graph with KV caches (a
    decoder) is run in passes of at most ``batch_tokens`` rows, a long prompt in chunks of them
    (the scheduler's ``--max-batch-tokens``); any other graph (an encoder) takes a whole
    sequence, up to ``max_context`` rows, in one call."""
    if any(node.op_name == "KvCache" for node in graph.nodes):
        return min(batch_tokens, max_context)
    return max_context


def graph_costs(
    graph: Graph,
    *,
    max_context: int,
    sessions: int = 1,
    microbatches: int = 1,
    tokens: int | None = None,
    weights: Mapping[str, TensorSpec] | None = None,
    order: Sequence[int] | None = None,
    kv_dtype: str | None = None,
) -> CostModel:
    """The cost model of ``graph`` in execution ``order`` (default: the listed order when it is
    topological, else :func:`~partitioner.order.execution_order`), its KV caches' F32 rows kept
    in ``kv_dtype`` (``--kv-dtype``; None: the default, f16)."""
    for what, value in (("max_context", max_context), ("sessions", sessions), ("microbatches", microbatches)):
        if value < 1:
            raise DistRuntimeError(f"{what} must be at least 1, got {value}")
    tokens = pass_rows(graph, max_context) if tokens is None else tokens
    if not 1 <= tokens <= max_context:
        raise DistRuntimeError(f"tokens per call must be in 1..max_context ({max_context}), got {tokens}")
    kept = kv_dtype_of(kv_dtype)  # an element of a cache's F32 rows, as kept: bytes per 32 elements
    kv_bytes = kept.block_bytes * 32 // kept.block_size  # f32 128, f16 64, q8_0 34
    if weights is not None:
        graph = Graph(graph.nodes, graph.inputs, graph.outputs, dict(weights))
    if order is None:
        try:  # the listed order is checked on the way: a name consumed before it is produced
            return _costs(graph, None, max_context, sessions, microbatches, tokens, kv_bytes)
        except _OutOfOrder:
            order = execution_order(graph)  # networkx: a cycle, or the closest valid order
    return _costs(graph, list(order), max_context, sessions, microbatches, tokens, kv_bytes)


#: The solver sums costs in int64 prefix sums: totals at or above this would wrap silently.
INT64_BOUND = 2**62


def _fits_int64(values: list[int], what: str, request: str) -> np.ndarray:
    """``values`` as int64, refused when their total would not fit (a context no machine holds)."""
    total = sum(values)
    if total >= INT64_BOUND:
        raise InfeasiblePlanError(f"the {what} of this graph at {request} add up to {total:.3e}, beyond what "
                                  f"any machine holds (2**62): lower --max-context or --sessions",
                                  "too_large", {"what": what, "total": total})
    return np.array(values, dtype=np.int64)


class _OutOfOrder(Exception):
    """A node consumes a name that a later node produces."""


def _costs(graph, order, max_context, sessions, microbatches, tokens, kv_bytes=128) -> CostModel:
    nodes = graph.nodes if order is None else [graph.nodes[i] for i in order]
    n = len(nodes)
    size_of = _Sizer(max_context)
    facts, inputs = _infer(graph, nodes, order, tokens, size_of)
    names, use_pos, use_weight, last = _uses(nodes, graph.weights)
    request = f"max_context {max_context}, {sessions} session(s), {microbatches} micro-batch(es)"
    table = _tensor_table(nodes, facts, inputs, last, graph.outputs, size_of, microbatches, request)
    scratch = _fits_int64([f[4] * microbatches for f in facts], "scratch bytes", request)
    live, cut = live_and_cut(n, table)
    live += scratch  # scratch inside a node
    return CostModel(
        compute=_fits_int64([f[2] for f in facts], "FLOPs", request),
        kv=_fits_int64([_kept(f[0], f[1], kv_bytes) * sessions if f[3] else 0 for f in facts], "KV cache bytes",
                       request),
        live=live, cut=cut, weight_names=names,
        weight_bytes=_weight_bytes([graph.weights[w] for w in names]), use_pos=use_pos, use_weight=use_weight,
        node_ids=np.array([node.id for node in nodes], dtype=np.int64),
        ops=[type(node.op).__name__ for node in nodes], tensors=table,
        meta={"max_context": max_context, "sessions": sessions, "microbatches": microbatches,
              "tokens": tokens, "order": list(range(n)) if order is None else order},
    )


def _kept(specs, sizes, kv_bytes: int) -> int:
    """A KvCache's bytes at the maximum context as kept: F32 outputs at ``kv_bytes`` per 32
    elements (Q8_0: 34, a block)."""
    return sum(size * kv_bytes // 128 if spec.dtype == DType.F32 else size for spec, size in zip(specs, sizes))


def _infer(graph, nodes, order, tokens, size_of) -> tuple[list[tuple], dict[str, TensorSpec]]:
    """Per node ``(output specs, output bytes, FLOPs, owns a KV cache, scratch bytes)``, and the
    graph inputs' resolved specs.

    Memoised on (op payload, identities of the input specs): specs are interned, so equal layers
    hit the same entries, and every spec is kept alive, so identities are never reused.  In the
    listed order, graph inputs are discovered in order of first use as the walk meets them (what
    ``Graph.input_names`` means), which spares building the graph's whole index."""
    inputs: dict[str, TensorSpec] = {} if order is None else _input_specs(graph, tokens)
    bare: dict[tuple, TensorSpec] = {}  # weight specs without their placement in the file
    specs: dict[str, TensorSpec] = {}
    for name, spec in graph.weights.items():
        key = (spec.shape, spec.dtype)
        specs[name] = bare.get(key) or bare.setdefault(key, TensorSpec(spec.shape, spec.dtype))
    specs.update(inputs)
    specs[POS] = POS_SPEC
    interned = {spec: spec for spec in [*bare.values(), *inputs.values(), POS_SPEC]}
    produced: set[str] | None = None

    def discover(node, name: str) -> None:
        """``name`` is not known yet: a graph input met for the first time, or an error."""
        nonlocal produced
        if order is not None:
            raise _missing(node, name)
        if produced is None:
            produced = {out for other in nodes for out in other.outputs}
        if name in produced:
            raise _OutOfOrder(name)
        if len(inputs) == len(graph.inputs):
            raise _too_many_inputs(graph, [*inputs, name])
        spec = inputs[name] = _resolve_input(graph.inputs[len(inputs)], tokens)
        specs[name] = interned.setdefault(spec, spec)

    cache: dict[tuple, tuple] = {}
    facts: list[tuple] = [()] * len(nodes)
    spec_of = specs.__getitem__
    for i, node in enumerate(nodes):
        try:
            ins = list(map(spec_of, node.inputs))
        except KeyError:
            for name in node.inputs:
                if name not in specs:
                    discover(node, name)
            ins = [specs[name] for name in node.inputs]
        key = (node.op, *map(id, ins))
        hit = cache.get(key)
        if hit is None:
            hit = _node_facts(graph, node, ins, inputs, size_of)
            outs = tuple(interned.setdefault(spec, spec) for spec in hit[0])  # equal specs, one object
            hit = cache[key] = (outs, *hit[1:])
        facts[i] = hit
        specs.update(zip(node.outputs, hit[0]))
    if len(inputs) != len(graph.inputs):
        raise GraphValidationError(
            f"the graph declares {len(graph.inputs)} input specs but its nodes consume "
            f"{len(inputs)} graph inputs ({list(inputs)})"
        )
    return facts, inputs


def _uses(nodes, weights) -> tuple[list[str], np.ndarray, np.ndarray, dict[str, int]]:
    """Weight names in order of first use, each (position, weight) use once sorted by position,
    and the last position that consumes each name.  The per-item work runs in C (map, zip, dict)."""
    flat = list(chain.from_iterable(node.inputs for node in nodes))
    flat_pos = np.repeat(np.arange(len(nodes), dtype=np.int64), [len(node.inputs) for node in nodes])
    last = dict(zip(flat, flat_pos.tolist()))  # later positions overwrite: the last use
    is_weight = np.fromiter(map(weights.__contains__, flat), dtype=bool, count=len(flat))
    used = list(compress(flat, is_weight))
    ids = {name: k for k, name in enumerate(dict.fromkeys(used))}
    width = max(len(ids), 1)
    use_weight = np.fromiter(map(ids.__getitem__, used), dtype=np.int64, count=len(used))
    # Each (position, weight) once: a node that uses a weight twice holds it once.
    use_pos, use_weight = np.divmod(np.unique(flat_pos[is_weight] * width + use_weight), width)
    return list(ids), use_pos, use_weight, last


def _missing(node, name: str) -> GraphValidationError:
    return GraphValidationError(
        f"node {node.id} ({node.op_name}) consumes {name!r}, which no earlier node produces and "
        "which is neither a weight nor a graph input"
    )


def _tensor_table(nodes, facts, inputs, last, outputs, size_of, microbatches, request) -> TensorTable:
    """Graph inputs (produced at -1) and every node output, with sizes and lifetimes."""
    n = len(nodes)
    names = [*inputs, *chain.from_iterable(node.outputs for node in nodes)]
    sizes = [*(size_of(s)[1] for s in inputs.values()), *chain.from_iterable(f[1] for f in facts)]
    size = _fits_int64([b * microbatches for b in sizes], "activation bytes", request) // microbatches
    count = np.array([len(f[1]) for f in facts], dtype=np.int64)
    producer = np.concatenate([np.full(len(inputs), -1, dtype=np.int64), np.repeat(np.arange(n), count)])
    view = np.concatenate([np.zeros(len(inputs), dtype=bool), np.repeat([f[3] for f in facts], count)])
    act = np.where(view, 0, size * microbatches)  # a KV cache's outputs are views into the cache
    final = np.fromiter(map(last.get, names, repeat(-2)), dtype=np.int64, count=len(names))
    final = np.where(final == -2, producer, final)  # never consumed: live only where produced
    for name in outputs:  # few: a linear search each is cheaper than indexing every name
        if name in names:
            final[names.index(name)] = n  # leaves after the last node
    return TensorTable(names, size, act, producer, final)


def _node_facts(graph, node, ins, inputs, size_of):
    """(output specs, output bytes, FLOPs, owns a KV cache, scratch bytes) of one node: the
    memoised part."""
    try:
        outs = node.op.spec.shape(node.op, ins)
    except ShapeError as err:
        try:  # the validator raises the same error, naming the node and its neighbours
            infer_shapes(graph, inputs)
        except GraphValidationError as named:
            raise named from None
        except Exception:  # noqa: BLE001 -- e.g. a reordered graph it cannot walk: keep ours
            pass
        raise GraphValidationError(f"node {node.id} ({node.op_name}): {err}") from None
    in_shapes = [size_of(s)[0] for s in ins]
    resolved = [size_of(s) for s in outs]
    out_shapes = [shape for shape, _ in resolved]
    out_sizes = [size for _, size in resolved]
    is_cache = node.op_name == "KvCache"
    scratch = workspace(node.op, in_shapes, ins[0].dtype.block_bytes if ins else 4)
    return outs, out_sizes, flops(node.op, in_shapes, out_shapes), is_cache, scratch


def _weight_bytes(specs: list[TensorSpec]) -> np.ndarray:
    """Bytes of each weight: its index entry's size, else dtype x shape (computed once per layout)."""
    layouts: dict[tuple, int] = {}
    out = np.empty(len(specs), dtype=np.int64)
    for k, spec in enumerate(specs):
        if spec.size is not None:
            out[k] = spec.size
        else:
            key = (spec.shape, spec.dtype)
            size = layouts.get(key)
            out[k] = size if size is not None else layouts.setdefault(key, spec.nbytes())
    return out
