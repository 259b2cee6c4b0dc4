"""Validation of a graph at load time, shape inference, and the memory estimate.

``validate_graph`` checks the seed's invariants in one pass over the nodes (they are already in
topological order, so "produced by an earlier node" is the whole acyclicity check), then infers
every tensor's shape from the op table's shape rules, then checks the memory estimate against a
declared maximum (:func:`check_memory`, the one wording of that error).  It returns the warnings
(dead code is only a warning) and the inferred specs, so that callers need not infer again.
Problems are ``GraphValidationError``s that name the node and show its neighbourhood in text form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..dtypes import DType
from ..errors import GraphValidationError
from .graph import POS, Graph, TensorSpec
from .hints import BackendHint
from .shape_rules import ShapeError

#: The spec of the ``pos`` tensor the executor injects before each run.
POS_SPEC = TensorSpec((1,), DType.F32)


def _describe(graph: Graph, index: int, specs: Mapping[str, TensorSpec] | None = None) -> str:
    from .text_form import format_neighbourhood

    return format_neighbourhood(graph, index, radius=2, specs=specs)


def _fail(graph: Graph, index: int, message: str, specs=None) -> GraphValidationError:
    node = graph.nodes[index]
    return GraphValidationError(
        f"node {node.id} ({node.op_name}, position {index}): {message}\n"
        f"{_describe(graph, index, specs)}"
    )


def check_structure(graph: Graph) -> list[str]:
    """Ids, arities, names, order, outputs and hints.  Returns warnings (dead code)."""
    index = graph.index
    seen_ids: dict[int, int] = {}
    produced: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        if node.id in seen_ids:
            raise _fail(graph, i, f"id {node.id} is also used by the node at position {seen_ids[node.id]}")
        seen_ids[node.id] = i
        spec = node.op.spec
        lo, hi = spec.inputs
        if not lo <= len(node.inputs) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise _fail(graph, i, f"{spec.name} takes {want} inputs, got {len(node.inputs)}")
        if len(node.outputs) != spec.num_outputs(node.op):
            raise _fail(
                graph, i, f"{spec.name} produces {spec.num_outputs(node.op)} outputs, "
                f"{len(node.outputs)} are named"
            )
        if node.backend_hint is not None and node.backend_hint not in BackendHint._value2member_map_:
            known = ", ".join(f"{h.value}={h.name.lower()}" for h in BackendHint)
            raise _fail(graph, i, f"unknown backend hint {node.backend_hint} (known: {known})")
        for name in node.inputs:
            later = index.producer.get(name)
            if name in index.input_names and later is not None:
                raise _fail(
                    graph, i, f"consumes {name!r} before node {graph.nodes[later].id} (position "
                    f"{later}) produces it: nodes are not in topological order, or there is a cycle"
                )
        for name in node.outputs:
            if not name:
                raise _fail(graph, i, "an output name is empty")
            if name in produced:
                raise _fail(graph, i, f"{name!r} is already produced by node {graph.nodes[produced[name]].id}")
            if name in graph.weights or name == POS:
                what = "a weight" if name in graph.weights else "the injected position tensor"
                raise _fail(graph, i, f"output {name!r} is the name of {what}")
            produced[name] = i

    if len(graph.inputs) != len(index.input_names):
        raise GraphValidationError(
            f"the graph declares {len(graph.inputs)} input specs but its nodes consume "
            f"{len(index.input_names)} names that are neither produced, weights nor 'pos': "
            f"{index.input_names} (a missing weight, or a typo in a tensor name?)"
        )
    if len(set(graph.outputs)) != len(graph.outputs):
        raise GraphValidationError(f"graph outputs {graph.outputs} name a tensor twice")
    for name in graph.outputs:
        if name not in produced and name not in index.input_names:
            raise GraphValidationError(f"graph output {name!r} is produced by no node")

    warnings = []
    outputs = set(graph.outputs)
    for name, i in produced.items():
        if name not in index.last_use and name not in outputs:
            node = graph.nodes[i]
            warnings.append(f"dead intermediate: {name!r} from node {node.id} ({node.op_name}) is never used")
    used = set(index.last_use)
    for name in graph.weights:
        if name not in used:
            warnings.append(f"unused weight: {name!r} is consumed by no node")
    return warnings


def _input_specs(graph: Graph, given: Mapping[str, TensorSpec] | None) -> dict[str, TensorSpec]:
    """Declared input specs, with ``given`` (actual shapes at first invocation) filling -1 dims."""
    specs = dict(zip(graph.input_names, graph.inputs))
    for name, actual in (given or {}).items():
        declared = specs.get(name)
        if declared is None:
            raise GraphValidationError(f"{name!r} is not a graph input; inputs are {graph.input_names}")
        compatible = actual.dtype == declared.dtype and len(actual.shape) == len(declared.shape)
        compatible = compatible and all(d == -1 or d == a for d, a in zip(declared.shape, actual.shape))
        if not compatible:
            raise GraphValidationError(f"input {name!r} is declared {declared}, but {actual} was given")
        specs[name] = actual
    return specs


def infer_shapes(graph: Graph, input_specs: Mapping[str, TensorSpec] | None = None) -> dict[str, TensorSpec]:
    """The spec of every tensor (weights, inputs, ``pos``, intermediates), from the shape rules.

    ``input_specs`` are the actual inputs' specs at first invocation; they resolve -1 dims.
    Assumes :func:`check_structure` passed.
    """
    specs: dict[str, TensorSpec] = {**graph.weights, **_input_specs(graph, input_specs), POS: POS_SPEC}
    for i, node in enumerate(graph.nodes):
        in_specs = [specs[name] for name in node.inputs]
        try:
            out_specs = node.op.spec.shape(node.op, in_specs)
        except ShapeError as e:
            shapes = ", ".join(f"{n}: {s}" for n, s in zip(node.inputs, in_specs))
            raise _fail(graph, i, f"{e} (inputs {shapes})", specs) from None
        for name, spec in zip(node.outputs, out_specs):
            specs[name] = spec
    return specs


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a single-process run needs: graph inputs, weights, and the peak of live intermediates
    under the free-after-last-use plan.  Dynamic (-1) dims count as 1 unless resolved, in which
    case ``exact`` is False."""

    inputs: int
    weights: int
    peak_intermediates: int
    exact: bool

    @property
    def total(self) -> int:
        return self.inputs + self.weights + self.peak_intermediates


def _bytes(spec: TensorSpec) -> tuple[int, bool]:
    shape = tuple(max(d, 1) if d < 0 else d for d in spec.shape)
    return spec.dtype.nbytes(shape), spec.is_static


def estimate_memory(graph: Graph, specs: Mapping[str, TensorSpec]) -> MemoryEstimate:
    exact = True
    inputs = 0
    for name in graph.input_names:
        n, ok = _bytes(specs[name])
        inputs, exact = inputs + n, exact and ok
    weights = sum(spec.nbytes() for spec in graph.weights.values())
    live = peak = 0
    for node, frees in zip(graph.nodes, graph.index.frees):
        for name in node.outputs:
            n, ok = _bytes(specs[name])
            live, exact = live + n, exact and ok
        peak = max(peak, live)  # inputs of the node are still live while it writes its outputs
        live -= sum(_bytes(specs[name])[0] for name in frees)
    return MemoryEstimate(inputs, weights, peak, exact)


def check_memory(est: MemoryEstimate, max_memory: int | None, limit: str = "the declared maximum of",
                 inputs: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Raise ``GraphValidationError`` if ``est`` exceeds ``max_memory`` (None: no limit).

    ``limit`` names the maximum in the message; ``inputs`` are the actual input shapes, if known.
    """
    if max_memory is None or est.total <= max_memory:
        return
    shapes = "" if inputs is None else f" for inputs { {n: list(s) for n, s in inputs.items()} }"
    raise GraphValidationError(
        f"estimated memory {est.total:,} bytes{shapes} (inputs {est.inputs:,} + weights "
        f"{est.weights:,} + peak intermediates {est.peak_intermediates:,}"
        f"{'' if est.exact else ', dynamic dims counted as 1'}) exceeds {limit} {max_memory:,} bytes"
    )


@dataclass(frozen=True)
class Validation:
    """What :func:`validate_graph` found: warnings (dead code) and every tensor's inferred spec."""

    warnings: list[str]
    specs: dict[str, TensorSpec]


def validate_graph(
    graph: Graph,
    *,
    input_specs: Mapping[str, TensorSpec] | None = None,
    max_memory: int | None = None,
) -> Validation:
    """Check every invariant; return the warnings and the inferred specs.  Raises
    ``GraphValidationError``."""
    warnings = check_structure(graph)
    specs = infer_shapes(graph, input_specs)
    if max_memory is not None:
        check_memory(estimate_memory(graph, specs), max_memory)
    return Validation(warnings, specs)
