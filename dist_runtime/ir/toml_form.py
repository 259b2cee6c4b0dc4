"""The TOML form of a graph: the same structure as the canonical binary form, for people to read.

Binary is canonical (``codec.py``); this form is a convenience for inspection and hand edits, and
it additionally carries ``Node.attrs`` (the binary form does not) and, optionally, the weights
index.  Layout::

    outputs = ["logits"]

    [[inputs]]
    name = "tokens"            # informative: input names are derived (Graph.input_names)
    shape = [-1]
    dtype = "i32"              # lowercase DType name

    [[nodes]]
    id = 0
    op = "TokenEmbed"          # the op class name (ops.OPS_BY_NAME)
    inputs = ["tokens", "model.embed_tokens.weight"]
    outputs = ["h0"]
    backend_hint = 1           # optional (u8)
    payload = {}               # every payload field by name, in wire order
    attrs = { fuse = true }    # optional free-form hints

    [weights."model.embed_tokens.weight"]   # only with include_weights
    shape = [32000, 64]
    dtype = "f32"
    offset = 0                 # optional pair offset / size
    size = 8192000

Payload values follow the field's wire type (``Wire.name``): integers for ``u8``/``u32``/``i32``,
booleans for ``bool``, floats for ``f32`` (``inf``/``nan`` allowed; written as the shortest
decimal that reads back as the same f32), a lowercase dtype name for ``dtype`` and an array of
integers for ``i64[]``.  Nothing here names an op or a field: everything is driven by
``OpSpec.fields``.

Every literal and key is rendered by ``tomli_w`` (so strings and keys are always escaped
correctly); this module only lays the lines out, so that arrays and payload tables stay on one
line.  Reading (stdlib ``tomllib``) is strict and raises :class:`ModelFormatError` naming the
node (index and id) and the key for anything wrong: invalid TOML, unknown or missing keys,
wrong types, integers outside their wire range, unknown ops or dtypes, bad payloads.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import struct

import tomli_w

from ..dtypes import DType
from ..errors import GraphValidationError, ModelFormatError
from ..safe_toml import MAX_TOML_BYTES, parse_toml  # noqa: F401  (the limit is part of this API)
from .codec import MAX_RANK
from .graph import POS, AttrValue, Graph, Node, TensorSpec
from .payload import OPS_BY_NAME, Wire, round_f32

#: A TOML text larger than this (in UTF-8 bytes) is rejected before it is parsed.

_U8 = (0, 2**8 - 1)
_U32 = (0, 2**32 - 1)
_I64 = (-(2**63), 2**63 - 1)
_U64 = (0, 2**64 - 1)

_TOP_KEYS = ("outputs", "inputs", "nodes", "weights")
_SPEC_KEYS = ("shape", "dtype", "offset", "size")
_INPUT_KEYS = ("name",) + _SPEC_KEYS
_NODE_KEYS = ("id", "op", "inputs", "outputs", "backend_hint", "payload", "attrs")

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlist = 6
_repr.maxdict = 6
_repr.maxlevel = 3


def _short(value: object) -> str:
    """A bounded repr for error messages (values may be huge or deeply nested)."""
    return _repr.repr(value)


# -- writing -------------------------------------------------------------------------------------
def _lit(value: bool | int | float | str) -> str:
    """One TOML scalar literal, rendered by tomli_w."""
    return tomli_w.dumps({"v": value})[4:-1]


def _key(key: str) -> str:
    """One TOML key (bare when possible, else quoted), rendered by tomli_w."""
    return tomli_w.dumps({key: 0})[: -len(" = 0\n")]


def _array(items) -> str:
    return "[" + ", ".join(_lit(x) for x in items) + "]"


def _inline_table(pairs: list[tuple[str, str]]) -> str:
    if not pairs:
        return "{}"
    return "{ " + ", ".join(f"{_key(k)} = {v}" for k, v in pairs) + " }"


def shortest_f32(x: float) -> float:
    """The float with the shortest decimal form that rounds to the same f32 as ``x``.

    ``x`` must already be an f32 value (payload floats are).  ``repr`` of the result is what a
    person wants to read (``1e-06`` rather than ``9.999999974752427e-07``), and reading it back
    and rounding to f32 gives ``x`` exactly.
    """
    if not math.isfinite(x):
        return x
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if round_f32(candidate) == x:
            return candidate
    return x


def _field_literal(wire: Wire, value: object) -> str:
    """The TOML literal of one payload field, chosen by its wire type."""
    if wire.name == "bool":
        return _lit(bool(value))
    if wire.name == "f32":
        return _lit(shortest_f32(float(value)))
    if wire.name == "dtype":
        return _lit(DType(value).name.lower())
    if wire.fmt is None:  # a list of integers
        return _array(int(v) for v in value)
    return _lit(int(value))


def _attr_literal(value: AttrValue) -> str:
    if isinstance(value, (list, tuple)):
        return _array(value)
    return _lit(value)


def _spec_lines(spec: TensorSpec) -> list[str]:
    lines = [f"shape = {_array(spec.shape)}", f"dtype = {_lit(spec.dtype.name.lower())}"]
    if spec.offset is not None:
        lines += [f"offset = {_lit(spec.offset)}", f"size = {_lit(spec.size)}"]
    return lines


def _node_lines(node: Node) -> list[str]:
    spec = type(node.op).spec
    lines = [
        "[[nodes]]",
        f"id = {_lit(node.id)}",
        f"op = {_lit(spec.name)}",
        f"inputs = {_array(node.inputs)}",
        f"outputs = {_array(node.outputs)}",
    ]
    if node.backend_hint is not None:
        lines.append(f"backend_hint = {_lit(node.backend_hint)}")
    payload = [(f.name, _field_literal(f.wire, getattr(node.op, f.name))) for f in spec.fields]
    lines.append(f"payload = {_inline_table(payload)}")
    if node.attrs:
        attrs = [(k, _attr_literal(v)) for k, v in node.attrs.items()]
        lines.append(f"attrs = {_inline_table(attrs)}")
    return lines


def graph_to_toml(graph: Graph, *, include_weights: bool = True) -> str:
    """The TOML form of ``graph``; :func:`graph_from_toml` reads it back to an equal graph
    (with ``include_weights=False``, to one whose ``weights`` are empty)."""
    lines = [f"outputs = {_array(graph.outputs)}"]
    names = graph.input_names
    for i, spec in enumerate(graph.inputs):
        lines += ["", "[[inputs]]"]
        if i < len(names):
            lines.append(f"name = {_lit(names[i])}")
        lines += _spec_lines(spec)
    for node in graph.nodes:
        lines.append("")
        lines += _node_lines(node)
    if include_weights:
        for name, spec in graph.weights.items():
            lines += ["", f"[weights.{_key(name)}]"]
            lines += _spec_lines(spec)
    return "\n".join(lines) + "\n"


# -- reading -------------------------------------------------------------------------------------
def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def _got(value: object) -> str:
    return f"got {_type_name(value)} {_short(value)}"


def _unknown_key(key: str, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}; allowed keys: {', '.join(allowed) or 'none'}"


class _Reader:
    """Checks a parsed TOML document against the layout.

    Every error names the place (``where``: ``nodes[3] (id 7)``, ``inputs[0]``, ``top level``)
    and the key (``payload.eps``, ``shape[2]``).
    """

    def __init__(self, what: str) -> None:
        self.what = what

    def fail(self, where: str, key: str | None, message: str) -> ModelFormatError:
        at = where if key is None else f"{where} key {key!r}"
        return ModelFormatError(f"{self.what}: {at}: {message}")

    # -- generic checks ------------------------------------------------------------------------
    def table(self, value: object, where: str, key: str | None) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, key, f"expected a table, {_got(value)}")
        return value

    def keys(self, table: dict, allowed: tuple[str, ...], required: tuple[str, ...], where: str,
             prefix: str = "") -> None:
        for key in table:
            if key not in allowed:
                raise self.fail(where, prefix + key, _unknown_key(key, allowed))
        for key in required:
            if key not in table:
                raise self.fail(where, prefix + key, f"missing key {key!r}")

    def integer(self, value: object, lo: int, hi: int, wire: str, where: str, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, key, f"expected an integer ({wire}), {_got(value)}")
        if not lo <= value <= hi:
            raise self.fail(where, key, f"{value} is out of range for {wire} [{lo}, {hi}]")
        return value

    def integers(self, value: object, lo: int, hi: int, wire: str, where: str,
                 key: str) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise self.fail(where, key, f"expected an array of integers ({wire}), {_got(value)}")
        return tuple(self.integer(v, lo, hi, wire, where, f"{key}[{i}]")
                     for i, v in enumerate(value))

    def string(self, value: object, where: str, key: str) -> str:
        if not isinstance(value, str):
            raise self.fail(where, key, f"expected a string, {_got(value)}")
        return value

    def strings(self, value: object, where: str, key: str) -> list[str]:
        if not isinstance(value, list):
            raise self.fail(where, key, f"expected an array of strings, {_got(value)}")
        return [self.string(v, where, f"{key}[{i}]") for i, v in enumerate(value)]

    def f32(self, value: object, where: str, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(where, key, f"expected a number (f32), {_got(value)}")
        try:
            x = float(value)
            struct.pack("<f", x)
        except OverflowError:
            raise self.fail(where, key, f"{_short(value)} is out of range for f32") from None
        return x

    def dtype(self, value: object, where: str, key: str) -> DType:
        name = self.string(value, where, key)
        return DType.from_name(name, f" in {self.what}: {where} key {key!r}")

    # -- pieces --------------------------------------------------------------------------------
    def spec(self, table: dict, where: str, allowed: tuple[str, ...] = _SPEC_KEYS) -> TensorSpec:
        self.keys(table, allowed, ("shape", "dtype"), where)
        shape = self.integers(table["shape"], *_I64, "i64", where, "shape")
        if len(shape) > MAX_RANK:
            raise self.fail(where, "shape", f"rank {len(shape)} exceeds the limit of {MAX_RANK}")
        for i, d in enumerate(shape):
            if d < -1:
                raise self.fail(where, f"shape[{i}]", f"dim {d} is below -1 (-1 = dynamic)")
        dtype = self.dtype(table["dtype"], where, "dtype")
        if ("offset" in table) != ("size" in table):
            missing = "size" if "offset" in table else "offset"
            raise self.fail(where, missing, f"missing key {missing!r} (offset and size come "
                                            "together, or neither is given)")
        if "offset" in table:
            offset = self.integer(table["offset"], *_U64, "u64", where, "offset")
            size = self.integer(table["size"], *_U64, "u64", where, "size")
            return TensorSpec(shape, dtype, offset, size)
        return TensorSpec(shape, dtype)

    def field(self, wire: Wire, value: object, where: str, key: str) -> object:
        """One payload field's value, checked against its wire type."""
        if wire.name == "bool":
            if not isinstance(value, bool):
                raise self.fail(where, key, f"expected a boolean, {_got(value)}")
            return value
        if wire.name == "f32":
            return self.f32(value, where, key)
        if wire.name == "dtype":
            return self.dtype(value, where, key)
        if wire.lo is None or wire.hi is None:
            raise AssertionError(f"the TOML form has no rule for wire type {wire.name!r}")
        if wire.fmt is None:
            return self.integers(value, int(wire.lo), int(wire.hi), wire.name, where, key)
        return self.integer(value, int(wire.lo), int(wire.hi), wire.name, where, key)

    def payload(self, op: str, value: object, where: str):
        spec = OPS_BY_NAME[op]
        table = self.table(value, where, "payload")
        names = tuple(f.name for f in spec.fields)
        for key in table:
            if key not in names:
                raise self.fail(where, f"payload.{key}",
                                f"{op} has no payload field {key!r}: {_unknown_key(key, names)}")
        values = {}
        for f in spec.fields:
            key = f"payload.{f.name}"
            if f.name in table:
                values[f.name] = self.field(f.wire, table[f.name], where, key)
            elif f.default is dataclasses.MISSING:
                raise self.fail(where, key, f"missing {op} payload field {f.name!r} "
                                            f"({f.wire.name}), which has no default")
        try:
            return spec.cls(**values)
        except GraphValidationError as e:
            raise self.fail(where, "payload", f"invalid {op} payload: {e}") from None

    def attr(self, value: object, where: str, key: str) -> AttrValue:
        if isinstance(value, (bool, float, str)):
            return value
        if isinstance(value, int):
            return self.integer(value, *_I64, "i64", where, key)
        if isinstance(value, list):
            if value and all(isinstance(v, float) for v in value):
                return tuple(value)
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return self.integers(value, *_I64, "i64", where, key)
        raise self.fail(where, key, "an attr value must be a boolean, integer, float, string, or "
                                    f"an array of only integers or only floats; {_got(value)}")

    def node(self, index: int, value: object) -> Node:
        table = self.table(value, f"nodes[{index}]", None)
        raw_id = table.get("id")
        shown = raw_id if isinstance(raw_id, int) and not isinstance(raw_id, bool) else "?"
        where = f"nodes[{index}] (id {shown})"
        self.keys(table, _NODE_KEYS, ("id", "op", "inputs", "outputs"), where)
        node_id = self.integer(table["id"], *_U32, "u32", where, "id")
        op = self.string(table["op"], where, "op")
        if op not in OPS_BY_NAME:
            close = difflib.get_close_matches(op, OPS_BY_NAME, n=3, cutoff=0.5)
            close += [n for n in OPS_BY_NAME if n.lower() == op.lower() and n not in close]
            hint = f"; close matches: {', '.join(close)}" if close else ""
            raise self.fail(where, "op", f"unknown op {_short(op)}{hint}")
        inputs = self.strings(table["inputs"], where, "inputs")
        outputs = self.strings(table["outputs"], where, "outputs")
        hint = None
        if "backend_hint" in table:
            hint = self.integer(table["backend_hint"], *_U8, "u8", where, "backend_hint")
        payload = self.payload(op, table.get("payload", {}), where)
        attrs: dict[str, AttrValue] = {}
        if "attrs" in table:
            raw = self.table(table["attrs"], where, "attrs")
            attrs = {k: self.attr(v, where, f"attrs.{k}") for k, v in raw.items()}
        return Node(node_id, payload, inputs, outputs, attrs, hint)

    def array_of_tables(self, doc: dict, key: str) -> list[dict]:
        value = doc.get(key, [])
        if not isinstance(value, list):
            raise self.fail("top level", key, f"expected an array of tables, {_got(value)}")
        return value

    def check_input_names(self, graph: Graph, names: dict[int, str], have_weights: bool) -> None:
        """Input names in the TOML are informative; they must agree with the derived ones."""
        if not names:
            return
        if have_weights:
            derived = graph.input_names
            for i, name in names.items():
                if i >= len(derived):
                    raise self.fail(
                        f"inputs[{i}]", "name",
                        f"the input is named {_short(name)}, but the nodes derive only "
                        f"{len(derived)} graph input name(s): {_short(derived)}",
                    )
                if name != derived[i]:
                    raise self.fail(
                        f"inputs[{i}]", "name",
                        f"the input is named {_short(name)}, but the name derived from the nodes "
                        f"is {_short(derived[i])} (graph input names are the names consumed "
                        "before any node produces them, that are not weights or 'pos', in "
                        "order of first use)",
                    )
            return
        # Without a weights table, weights cannot be told apart from inputs: the named inputs
        # must be, in order, among the names the nodes consume before producing them.
        produced: set[str] = set()
        candidates: list[str] = []
        seen: set[str] = set()
        for node in graph.nodes:
            for name in node.inputs:
                if name not in produced and name != POS and name not in seen:
                    seen.add(name)
                    candidates.append(name)
            produced.update(node.outputs)
        start = 0
        for i, name in sorted(names.items()):
            try:
                start = candidates.index(name, start) + 1
            except ValueError:
                raise self.fail(
                    f"inputs[{i}]", "name",
                    f"the input is named {_short(name)}, which is not, in this order, among the "
                    f"names the nodes consume before producing them: {_short(candidates)}",
                ) from None

    def graph(self, doc: dict) -> Graph:
        self.keys(doc, _TOP_KEYS, ("outputs",), "top level")
        outputs = self.strings(doc["outputs"], "top level", "outputs")
        inputs: list[TensorSpec] = []
        names: dict[int, str] = {}
        for i, item in enumerate(self.array_of_tables(doc, "inputs")):
            where = f"inputs[{i}]"
            table = self.table(item, where, None)
            inputs.append(self.spec(table, where, _INPUT_KEYS))
            if "name" in table:
                names[i] = self.string(table["name"], where, "name")
        nodes = [self.node(i, item) for i, item in enumerate(self.array_of_tables(doc, "nodes"))]
        weights: dict[str, TensorSpec] = {}
        if "weights" in doc:
            table = self.table(doc["weights"], "top level", "weights")
            for name, item in table.items():
                where = f"weights[{_short(name)}]"
                weights[name] = self.spec(self.table(item, where, None), where)
        graph = Graph(nodes, inputs, outputs, weights)
        self.check_input_names(graph, names, "weights" in doc)
        return graph


def graph_from_toml(text: str | bytes, *, what: str = "graph.toml") -> Graph:
    """Parse the TOML form.  Raises :class:`ModelFormatError` for anything malformed; ``what``
    names the source in messages."""
    return _Reader(what).graph(parse_toml(text, what))
