"""A one-line-per-node text rendering of a graph, for people (in the spirit of JAX's jaxpr).

::

    graph(%tokens: i32[-1]) -> %logits
      %h0 = TokenEmbed %tokens, model.embed_tokens.weight
      %q = Matmul(transpose_b=false) %h0, model.layers.0.self_attn.q_proj.weight  # f32[-1,4096]
      %k, %v = KvCache %k_new, %v_new @backend=1 {fuse=true}

Rules:

* tensor names are prefixed ``%`` (intermediates, graph inputs, ``pos``) except weights (names in
  ``graph.weights``), which are bare; a name that is not made only of letters, digits and
  ``_ . - / :`` is double-quoted (``%"two words"``);
* several outputs are comma-separated on the left; a node with no outputs shows ``()``;
* the op is followed by its payload fields in parentheses: the fields without a default always,
  the others only where they differ from the default; no parentheses when nothing is shown;
  values print as in the TOML form (``true``, ``1e-06``, ``inf``, ``[1,-1]``, ``q8_0``);
* then the inputs, comma-separated; a backend hint as `` @backend=N``; attrs as
  `` {key=value, ...}``;
* with ``specs`` (tensor name -> TensorSpec, e.g. the validator's inferred shapes), a trailing
  comment gives each output's spec (``# f32[-1,4096]``, ``?`` for a name without a spec).

This is a display format only; nothing parses it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

from ..dtypes import DType
from .graph import AttrValue, Graph, Node, TensorSpec
from .payload import Field, round_f32
from .toml_form import shortest_f32

_NAME_CHARS = frozenset("_.-/:")


def _is_plain(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in _NAME_CHARS for c in name)


def _quote(name: str) -> str:
    return name if _is_plain(name) else json.dumps(name, ensure_ascii=False)


def format_name(name: str, graph: Graph) -> str:
    """A tensor name as shown: bare for a weight, else prefixed ``%``."""
    return _quote(name) if name in graph.weights else "%" + _quote(name)


def _float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(x)


def _field_value(f: Field, value: object) -> str:
    wire = f.wire.name
    if wire == "bool":
        return "true" if value else "false"
    if wire == "f32":
        return _float(shortest_f32(float(value)))
    if wire == "dtype":
        return DType(value).name.lower()
    if f.wire.fmt is None:
        return "[" + ",".join(str(int(v)) for v in value) + "]"
    return str(int(value))


def _attr_value(value: AttrValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_attr_value(v) for v in value) + "]"
    return str(value)


def _op_text(node: Node) -> str:
    spec = type(node.op).spec
    shown = []
    for f in spec.fields:
        value = getattr(node.op, f.name)
        if f.default is dataclasses.MISSING or not _same(value, f.default):
            shown.append(f"{f.name}={_field_value(f, value)}")
    return spec.name + (f"({', '.join(shown)})" if shown else "")


def _same(value: object, default: object) -> bool:
    if isinstance(value, float) and isinstance(default, float):
        # Defaults are declared as Python floats; the payload holds them rounded to f32.
        if math.isnan(value) or math.isnan(default):
            return math.isnan(value) and math.isnan(default)
        return value == round_f32(default)
    return value == default


def _spec_text(spec: TensorSpec | None) -> str:
    return "?" if spec is None else str(spec)


def format_node(node: Node, graph: Graph, specs: Mapping[str, TensorSpec] | None = None) -> str:
    """One line for ``node`` (see the module docstring for the rules)."""
    lhs = ", ".join(format_name(n, graph) for n in node.outputs) or "()"
    line = f"{lhs} = {_op_text(node)}"
    if node.inputs:
        line += " " + ", ".join(format_name(n, graph) for n in node.inputs)
    if node.backend_hint is not None:
        line += f" @backend={node.backend_hint}"
    if node.attrs:
        line += " {" + ", ".join(f"{_quote(k)}={_attr_value(v)}" for k, v in node.attrs.items())
        line += "}"
    if specs is not None and node.outputs:
        line += "  # " + ", ".join(_spec_text(specs.get(n)) for n in node.outputs)
    return line


def format_header(graph: Graph, specs: Mapping[str, TensorSpec] | None = None) -> str:
    """``graph(%tokens: i32[-1]) -> %logits`` (output specs too when ``specs`` is given)."""
    names = graph.input_names
    params = []
    for i in range(max(len(names), len(graph.inputs))):
        name = format_name(names[i], graph) if i < len(names) else "%?"
        spec = graph.inputs[i] if i < len(graph.inputs) else None
        params.append(f"{name}: {_spec_text(spec)}")
    outs = []
    for name in graph.outputs:
        text = format_name(name, graph)
        if specs is not None:
            text += f": {_spec_text(specs.get(name))}"
        outs.append(text)
    return f"graph({', '.join(params)}) -> {', '.join(outs) or '()'}"


def format_graph(graph: Graph, specs: Mapping[str, TensorSpec] | None = None) -> str:
    """A header line, then one indented line per node."""
    lines = [format_header(graph, specs)]
    lines += ["  " + format_node(node, graph, specs) for node in graph.nodes]
    return "\n".join(lines)


def _label(graph: Graph, index: int) -> str:
    node_id = graph.nodes[index].id
    return f"[{index}]" if node_id == index else f"[{index} id={node_id}]"


def format_neighbourhood(graph: Graph, node_index: int, radius: int = 2,
                         specs: Mapping[str, TensorSpec] | None = None) -> str:
    """The node at position ``node_index`` marked ``>>``, with up to ``radius`` nodes on each
    side, each labelled with its position (and its id where that differs); ``...`` marks nodes
    left out.  For error messages."""
    n = len(graph.nodes)
    if not 0 <= node_index < n:
        raise IndexError(f"node index {node_index} is out of range for a graph of {n} nodes")
    lo, hi = max(0, node_index - max(radius, 0)), min(n, node_index + max(radius, 0) + 1)
    labels = {i: _label(graph, i) for i in range(lo, hi)}
    width = max(len(label) for label in labels.values())
    lines = ["   ..."] if lo > 0 else []
    for i in range(lo, hi):
        marker = ">>" if i == node_index else "  "
        lines.append(f"{marker} {labels[i]:<{width}} {format_node(graph.nodes[i], graph, specs)}")
    if hi < n:
        lines.append("   ...")
    return "\n".join(lines)
