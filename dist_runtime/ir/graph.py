"""The Graph IR data model: ``Graph``, ``Node``, ``TensorSpec`` and ``AttrValue``.

A graph is a list of nodes in topological order (running them in order is a valid schedule).
Tensor names connect nodes: a node's inputs are names of weights, graph inputs, the injected
``pos`` tensor, or outputs of earlier nodes.  Op parameters live in the node's op payload (see
``ops.py``); ``Node.attrs`` is a free-form map of hints that the TOML form keeps and the canonical
binary form does not carry.

``TensorSpec``, ``AttrValue`` and ``POS`` live in the leaf module ``tensor_spec.py`` and the payload
machinery in ``payload.py``; they are re-exported here for callers.

Derived indexes (producer of each name, input names, last use, consumers, and the names to free
after each node) are computed in one place, :meth:`Graph.index`, and cached until
:meth:`Graph.invalidate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from .payload import OpPayload
from .tensor_spec import POS, AttrValue, TensorSpec

__all__ = ["POS", "AttrValue", "Graph", "GraphIndex", "Node", "TensorSpec"]

@dataclass
class Node:
    """One operation: ``outputs = op(inputs)``."""

    id: int
    op: OpPayload
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, AttrValue] = field(default_factory=dict)
    backend_hint: int | None = None

    @property
    def op_name(self) -> str:
        return type(self.op).__name__


@dataclass
class GraphIndex:
    """Facts derived from a graph's nodes; rebuilt whenever the graph changes."""

    producer: dict[str, int]  # tensor name -> position of the node that produces it
    input_names: list[str]  # external names in order of first use (see Graph.input_names)
    last_use: dict[str, int]  # tensor name -> position of the last node that consumes it
    consumers: dict[str, list[int]]  # tensor name -> positions of the nodes reading it, ascending
    # Per node position, the intermediates dead after it (free-after-last-use): its inputs and
    # outputs that no later node reads, except graph outputs and names no node produces.
    frees: list[tuple[str, ...]]


@dataclass
class Graph:
    """A computation graph (the seed's ``Graph``)."""

    nodes: list[Node] = field(default_factory=list)
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    weights: dict[str, TensorSpec] = field(default_factory=dict)

    # ``input_names`` are not stored: the canonical binary layout carries a TensorSpec per input
    # but no name.  A graph input is a name that some node consumes, that no earlier node
    # produces, and that is neither a weight nor the injected ``pos``; inputs are listed in order
    # of first use, and ``inputs[i]`` describes ``input_names[i]``.
    @property
    def input_names(self) -> list[str]:
        return self.index.input_names

    @cached_property
    def index(self) -> GraphIndex:
        producer: dict[str, int] = {}
        input_names: list[str] = []
        seen_external: set[str] = set()
        last_use: dict[str, int] = {}
        consumers: dict[str, list[int]] = {}
        for i, node in enumerate(self.nodes):
            for name in node.inputs:
                last_use[name] = i
                readers = consumers.setdefault(name, [])
                if not readers or readers[-1] != i:
                    readers.append(i)
                if name in producer or name in self.weights or name == POS:
                    continue
                if name not in seen_external:
                    seen_external.add(name)
                    input_names.append(name)
            for name in node.outputs:
                producer.setdefault(name, i)
        keep = set(self.outputs)
        frees = [tuple(n for n in dict.fromkeys([*node.inputs, *node.outputs])
                       if last_use.get(n, -1) <= i and n not in keep and n in producer)
                 for i, node in enumerate(self.nodes)]
        return GraphIndex(producer, input_names, last_use, consumers, frees)

    def invalidate(self) -> None:
        """Drop derived indexes; call after mutating ``nodes``, ``outputs`` or ``weights`` in place."""
        self.__dict__.pop("index", None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return (self.nodes, self.inputs, self.outputs, self.weights) == (
            other.nodes,
            other.inputs,
            other.outputs,
            other.weights,
        )
