"""The Graph IR data model: ``Graph``, ``Node``, ``TensorSpec`` and ``AttrValue``.

A graph is a list of nodes in topological order (running them in order is a valid schedule).
Tensor names connect nodes: a node's inputs are names of weights, graph inputs, the injected
``pos`` tensor, or outputs of earlier nodes.  Op parameters live in the node's op payload (see
``ops.py``); ``Node.attrs`` is a free-form map of hints that the TOML form keeps and the canonical
binary form does not carry.

Derived indexes (producer of each name, input names, last use) are computed in one place,
:meth:`Graph.index`, and cached until the graph is mutated through its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Union

from ..dtypes import DType
from ..errors import GraphValidationError

if TYPE_CHECKING:
    from .ops import OpPayload

#: The name the executor injects before each run: the position of the first new token, as f32[1].
POS = "pos"

#: A free-form hint value (the seed's ``AttrValue``): Int, Float, String, Ints, Floats or Bool.
AttrValue = Union[bool, int, float, str, tuple[int, ...], tuple[float, ...]]


def check_attr_value(key: str, value: object) -> AttrValue:
    """Return ``value`` normalised to an ``AttrValue`` (lists become tuples) or raise."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = tuple(value)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            return items
        if all(isinstance(v, float) for v in items):
            return items
    raise GraphValidationError(
        f"attr {key!r} = {value!r}: an attr value must be a bool, int, float, str, or a list of "
        "only ints or only floats"
    )


@dataclass(frozen=True)
class TensorSpec:
    """Shape (``-1`` for a dynamic dim), element type and, for weights, placement in the weights
    section (``offset`` relative to the section's start, ``size`` in bytes)."""

    shape: tuple[int, ...]
    dtype: DType
    offset: int | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", DType(self.dtype))
        if (self.offset is None) != (self.size is None):
            raise GraphValidationError("a TensorSpec has both offset and size, or neither")

    @property
    def is_static(self) -> bool:
        return all(d >= 0 for d in self.shape)

    def nbytes(self) -> int:
        """Bytes for the fully known shape (``ModelFormatError`` if a dim is dynamic)."""
        return self.dtype.nbytes(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.name.lower()}[{','.join(map(str, self.shape))}]"


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
    position: dict[int, int]  # node id -> position in graph.nodes


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
        position: dict[int, int] = {}
        for i, node in enumerate(self.nodes):
            position.setdefault(node.id, i)
            for name in node.inputs:
                last_use[name] = i
                if name in producer or name in self.weights or name == POS:
                    continue
                if name not in seen_external:
                    seen_external.add(name)
                    input_names.append(name)
            for name in node.outputs:
                producer.setdefault(name, i)
        return GraphIndex(producer, input_names, last_use, position)

    def invalidate(self) -> None:
        """Drop derived indexes; call after mutating ``nodes`` or ``weights`` in place."""
        self.__dict__.pop("index", None)

    def node_by_id(self, node_id: int) -> Node:
        return self.nodes[self.index.position[node_id]]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return (self.nodes, self.inputs, self.outputs, self.weights) == (
            other.nodes,
            other.inputs,
            other.outputs,
            other.weights,
        )
