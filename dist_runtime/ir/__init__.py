"""The Graph IR: data model, op table, binary and TOML forms, validation and shape inference."""

from ..dtypes import DType
from .codec import decode_graph, encode_graph
from .graph import POS, AttrValue, Graph, Node, TensorSpec
from .text_form import format_graph, format_node
from .toml_form import graph_from_toml, graph_to_toml
from .ops import OPS_BY_NAME, OPS_BY_TAG, OpPayload, OpSpec
from . import shape_rules  # noqa: F401  (enters every op's shape rule in the table)
from .validate import estimate_memory, infer_shapes, validate_graph

# One payload class per op of the tag table (Matmul, Rope, Sdpa, ...), exported by name.
globals().update({name: spec.cls for name, spec in OPS_BY_NAME.items()})

__all__ = [
    "DType", "Graph", "Node", "TensorSpec", "AttrValue", "POS", "OpPayload", "OpSpec",
    "OPS_BY_NAME", "OPS_BY_TAG", "encode_graph", "decode_graph", "validate_graph",
    "infer_shapes", "estimate_memory", "graph_to_toml", "graph_from_toml",
    "format_graph", "format_node", *OPS_BY_NAME,
]
