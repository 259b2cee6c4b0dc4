"""The TOML form: round trips (every op, random graphs), a golden text, and strict reading."""

from __future__ import annotations

import dataclasses
import math
import tomllib

import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_runtime.dtypes import DType
from dist_runtime.errors import GraphValidationError, ModelFormatError
from dist_runtime.ir import ops
from dist_runtime.ir.graph import POS, Graph, Node, TensorSpec
from dist_runtime.ir.toml_form import MAX_TOML_BYTES, graph_from_toml, graph_to_toml


# -- helpers --------------------------------------------------------------------------------------
def sample_value(f: ops.Field, salt: int) -> object:
    """A valid value for any payload field, from its wire type alone (not its default)."""
    wire = f.wire
    if wire.name == "bool":
        return f.default is dataclasses.MISSING or not f.default
    if wire.name == "f32":
        return 0.25 + salt
    if wire.name == "dtype":
        return DType.Q4_K
    if wire.fmt is None:
        return (1, -1, 2**40 + salt)
    return int(wire.lo) + 1 + salt % 3 if wire.lo < 0 else min(int(wire.hi), 3 + salt)


ODD = 'ñ·名前 "q"'  # a non-ASCII name with quotes


def every_op_graph() -> Graph:
    """One node per op with generic non-default payloads, plus hand-picked nodes."""
    weights = {
        "model.embed_tokens.weight": TensorSpec((32000, 64), DType.Q8_0, 0, 2176000),
        "model.norm.weight": TensorSpec((64,), DType.F32, 2176000, 256),
        "model.層.0.weight": TensorSpec((4, 4), DType.BF16),
    }
    nodes = [Node(0, ops.TokenEmbed(), ["tokens", "model.embed_tokens.weight"], ["h0"])]
    prev = "h0"
    for i, (name, spec) in enumerate(sorted(ops.OPS_BY_NAME.items()), start=1):
        values = {f.name: sample_value(f, i) for f in spec.fields}
        payload = spec.cls(**values)
        n_in = spec.inputs[0]
        inputs = [prev] + ["model.norm.weight"] * (n_in - 1)
        n_out = spec.num_outputs(payload)
        outputs = [f"t{i}_{k}" for k in range(n_out)] if n_out < 50 else [f"t{i}"]
        nodes.append(Node(i, payload, inputs, outputs, {"op_index": i}, i % 4 or None))
        prev = outputs[0]
    base = len(nodes)
    nodes += [
        Node(base, ops.Clamp(min=-math.inf, max=math.inf), [prev, POS], ["clamped"]),
        Node(base + 1, ops.NanToNum(nan=1.5, posinf=math.inf, neginf=-3.0), ["clamped"], [ODD]),
        Node(base + 2, ops.Reshape(shape=(0, -1, 2**62)), [ODD], ["r"], backend_hint=255),
        Node(base + 3, ops.Split(dim=-2, sizes=(1, 2, 3)), ["r"], ["s0", "s1", "s2"], {}, 0),
        Node(base + 4, ops.Quantize(dtype=DType.Q4_0, axis=-1), ["s0", "second input"], ["q"]),
        Node(base + 5, ops.KvDecompress(dtype=DType.BOOL), ["q"], ["d"]),
        Node(
            base + 6,
            ops.RmsNorm(eps=1e-6),
            ["d", "model.層.0.weight"],
            ["logits"],
            {
                "fuse": True,
                "off": False,
                "count": -(2**63),
                "ratio": 0.1,  # kept as a Python float, not rounded to f32
                "big": 1e300,
                "inf": -math.inf,
                "label": "ünï \"quoted\"\n\tline",
                "ids": (1, -2, 2**63 - 1),
                "scales": (0.5, -1e-300, math.inf),
                "empty": (),
                "key with spaces": "",
                "": 0,
            },
            7,
        ),
    ]
    inputs = [TensorSpec((-1,), DType.I32), TensorSpec((2, -1, 3), DType.F16, 5, 6)]
    return Graph(nodes, inputs, ["logits", "s2"], weights)


def doc_of(graph: Graph, **kw) -> dict:
    return tomllib.loads(graph_to_toml(graph, **kw))


def load_doc(doc: dict) -> Graph:
    return graph_from_toml(tomli_w.dumps(doc))


def small_graph() -> Graph:
    return Graph(
        [
            Node(0, ops.TokenEmbed(), ["tokens", "model.embed_tokens.weight"], ["h0"]),
            Node(1, ops.Rope(head_dim=64, rope_dim=32), ["h0", POS], ["logits"], {"fuse": True}, 1),
        ],
        [TensorSpec((-1,), DType.I32)],
        ["logits"],
        {"model.embed_tokens.weight": TensorSpec((32000, 64), DType.F32, 0, 8192000)},
    )


def bad(doc_or_text, fragment: str | tuple[str, ...]) -> ModelFormatError:
    """Reading must fail with ModelFormatError whose message contains every fragment."""
    text = doc_or_text if isinstance(doc_or_text, (str, bytes)) else tomli_w.dumps(doc_or_text)
    with pytest.raises(ModelFormatError) as info:
        graph_from_toml(text)
    message = str(info.value)
    for frag in (fragment,) if isinstance(fragment, str) else fragment:
        assert frag in message, message
    return info.value


# -- round trips ----------------------------------------------------------------------------------
def test_every_op_round_trips():
    graph = every_op_graph()
    covered = {n.op_name for n in graph.nodes}
    assert covered == set(ops.OPS_BY_NAME)
    text = graph_to_toml(graph)
    back = graph_from_toml(text)
    assert back == graph
    assert [n.attrs for n in back.nodes] == [n.attrs for n in graph.nodes]
    assert [n.backend_hint for n in back.nodes] == [n.backend_hint for n in graph.nodes]
    assert back.nodes[-1].attrs["ratio"] == 0.1  # not f32-rounded
    assert graph_from_toml(text.encode("utf-8")) == graph
    assert graph_to_toml(back) == text  # stable


def test_nan_attrs_round_trip_and_nan_payloads_are_refused():
    graph = Graph([Node(0, ops.Clamp(min=-1.0, max=math.inf), ["x"], ["y"], {"n": math.nan})],
                  [TensorSpec((1,), DType.F32)], ["y"])
    text = graph_to_toml(graph)
    back = graph_from_toml(text)
    assert back.nodes[0].op.max == math.inf and math.isnan(back.nodes[0].attrs["n"])
    # NaN is meaningless in every payload and its bits would not round-trip: refused.
    with pytest.raises(ModelFormatError, match="must not be NaN"):
        graph_from_toml(text.replace("min = -1.0", "min = nan"))


def test_without_weights():
    graph = every_op_graph()
    text = graph_to_toml(graph, include_weights=False)
    assert "[weights" not in text
    back = graph_from_toml(text)
    assert back == Graph(graph.nodes, graph.inputs, graph.outputs, {})


def test_f32_payloads_print_short_and_read_back_exactly():
    graph = Graph([Node(0, ops.RmsNorm(eps=1e-6), ["x", "w"], ["y"]),
                   Node(1, ops.NanToNum(), ["y"], ["z"])], [], ["z"])
    text = graph_to_toml(graph)
    assert "payload = { eps = 1e-06 }" in text
    assert "posinf = 3.4028235e+38" in text
    assert graph_from_toml(text) == graph


def test_empty_graph():
    graph = Graph()
    assert graph_to_toml(graph) == 'outputs = []\n'
    assert graph_from_toml(graph_to_toml(graph)) == graph


def test_golden_text():
    expected = '''\
outputs = ["logits"]

[[inputs]]
name = "tokens"
shape = [-1]
dtype = "i32"

[[nodes]]
id = 0
op = "TokenEmbed"
inputs = ["tokens", "model.embed_tokens.weight"]
outputs = ["h0"]
payload = {}

[[nodes]]
id = 1
op = "Rope"
inputs = ["h0", "pos"]
outputs = ["logits"]
backend_hint = 1
payload = { head_dim = 64, rope_dim = 32, base = 10000.0 }
attrs = { fuse = true }

[weights."model.embed_tokens.weight"]
shape = [32000, 64]
dtype = "f32"
offset = 0
size = 8192000
'''
    assert graph_to_toml(small_graph()) == expected
    assert graph_from_toml(expected) == small_graph()


# -- a property over random graphs ----------------------------------------------------------------
names = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
f32s = st.floats(width=32, allow_nan=False)


def field_strategy(f: ops.Field):
    wire = f.wire
    if wire.name == "bool":
        return st.booleans()
    if wire.name == "f32":
        return f32s
    if wire.name == "dtype":
        return st.sampled_from(list(DType))
    if wire.fmt is None:
        return st.lists(st.integers(int(wire.lo), int(wire.hi)), max_size=4).map(tuple)
    return st.integers(int(wire.lo), int(wire.hi))


@st.composite
def payloads(draw):
    spec = draw(st.sampled_from(sorted(ops.OPS_BY_NAME.values(), key=lambda s: s.tag)))
    return spec.cls(**{f.name: draw(field_strategy(f)) for f in spec.fields})


attr_values = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    names,
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3).map(tuple),
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=3).map(tuple),
)
specs = st.builds(
    lambda shape, dtype, place: TensorSpec(shape, dtype, *(place or (None, None))),
    st.lists(st.integers(-1, 2**63 - 1), max_size=4),
    st.sampled_from(list(DType)),
    st.none() | st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
)
nodes = st.builds(
    Node,
    st.integers(0, 2**32 - 1),
    payloads(),
    st.lists(names, max_size=3),
    st.lists(names, max_size=3),
    st.dictionaries(names, attr_values, max_size=3),
    st.none() | st.integers(0, 255),
)
graphs = st.builds(
    Graph,
    st.lists(nodes, max_size=5),
    st.lists(specs, max_size=3),
    st.lists(names, max_size=3),
    st.dictionaries(names, specs, max_size=3),
)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(graphs)
def test_random_graphs_round_trip(graph):
    text = graph_to_toml(graph)
    assert graph_from_toml(text) == graph
    assert graph_from_toml(text.encode("utf-8")) == graph
    without = graph_from_toml(graph_to_toml(graph, include_weights=False))
    assert without == Graph(graph.nodes, graph.inputs, graph.outputs, {})


# -- strict reading: one test per class of bad input ----------------------------------------------
def test_invalid_toml():
    bad("outputs = [\n", "invalid TOML")
    bad("outputs = []\noutputs = []\n", "invalid TOML")


def test_deep_nesting():
    bad("outputs = " + "[" * 10_000 + "]" * 10_000, "nested too deeply")


def test_too_large_is_rejected_before_parsing():
    huge = "#" * (65 * 1024 * 1024)  # a valid comment, so only the size check can reject it
    bad(huge, ("exceeds the TOML limit", str(MAX_TOML_BYTES)))
    bad(huge.encode(), "exceeds the TOML limit")
    # Multi-byte characters count by their UTF-8 size.
    bad("#" + "é" * (MAX_TOML_BYTES // 2 + 1), "bytes (UTF-8) exceeds")


def test_bad_utf8_and_surrogates():
    bad(b'outputs = ["\xff"]\n', "not valid UTF-8")
    bad('outputs = ["\ud800"]\n', "not valid Unicode")


def test_unknown_keys():
    doc = doc_of(small_graph())
    doc["outptus"] = []
    bad(doc, ("top level", "unknown key 'outptus'", "did you mean 'outputs'"))

    doc = doc_of(small_graph())
    doc["nodes"][1]["bakend_hint"] = 1
    bad(doc, ("nodes[1] (id 1)", "'bakend_hint'", "did you mean 'backend_hint'"))

    doc = doc_of(small_graph())
    doc["inputs"][0]["dtyp"] = "f32"
    bad(doc, ("inputs[0]", "unknown key 'dtyp'"))

    doc = doc_of(small_graph())
    doc["weights"]["model.embed_tokens.weight"]["ofset"] = 1
    bad(doc, ("weights['model.embed_tokens.weight']", "unknown key 'ofset'"))


def test_extra_payload_field():
    doc = doc_of(small_graph())
    doc["nodes"][1]["payload"]["bse"] = 1.0
    bad(doc, ("nodes[1] (id 1) key 'payload.bse'", "Rope has no payload field 'bse'",
              "did you mean 'base'"))
    doc = doc_of(small_graph())
    doc["nodes"][0]["payload"]["eps"] = 1.0
    bad(doc, ("nodes[0] (id 0)", "TokenEmbed has no payload field 'eps'"))


def test_missing_keys():
    for key in ("id", "op", "inputs", "outputs"):
        doc = doc_of(small_graph())
        del doc["nodes"][1][key]
        bad(doc, ("nodes[1]", f"missing key {key!r}"))
    doc = doc_of(small_graph())
    del doc["outputs"]
    bad(doc, ("top level", "missing key 'outputs'"))
    doc = doc_of(small_graph())
    del doc["inputs"][0]["shape"]
    bad(doc, ("inputs[0]", "missing key 'shape'"))
    doc = doc_of(small_graph())
    del doc["weights"]["model.embed_tokens.weight"]["size"]
    bad(doc, ("weights['model.embed_tokens.weight'] key 'size'", "missing key"))


def test_missing_payload_fields_use_defaults_or_fail():
    doc = doc_of(small_graph())
    del doc["nodes"][1]["payload"]["base"]
    assert load_doc(doc).nodes[1].op == ops.Rope(64, 32, 10000.0)
    del doc["nodes"][1]["payload"]  # a missing payload table is an empty one
    bad(doc, ("nodes[1] (id 1) key 'payload.head_dim'", "no default"))
    doc = doc_of(small_graph())
    del doc["nodes"][0]["payload"]
    assert load_doc(doc) == small_graph()


@pytest.mark.parametrize(
    "path, value, fragments",
    [
        (("nodes", 1, "id"), True, ("nodes[1] (id ?) key 'id'", "expected an integer", "boolean")),
        (("nodes", 1, "id"), "1", ("key 'id'", "expected an integer (u32)", "a string")),
        (("nodes", 1, "op"), 3, ("key 'op'", "expected a string")),
        (("nodes", 1, "inputs"), "h0", ("key 'inputs'", "expected an array of strings")),
        (("nodes", 1, "inputs"), ["h0", 1], ("key 'inputs[1]'", "expected a string")),
        (("nodes", 1, "outputs"), [["x"]], ("key 'outputs[0]'", "expected a string")),
        (("nodes", 1, "backend_hint"), 1.0, ("key 'backend_hint'", "expected an integer (u8)")),
        (("nodes", 1, "payload"), [1], ("key 'payload'", "expected a table")),
        (("nodes", 1, "payload", "head_dim"), True, ("'payload.head_dim'", "u32", "boolean")),
        (("nodes", 1, "payload", "head_dim"), 1.5, ("key 'payload.head_dim'", "a float")),
        (("nodes", 1, "payload", "base"), True, ("key 'payload.base'", "expected a number (f32)")),
        (("nodes", 1, "payload", "base"), "1", ("key 'payload.base'", "expected a number (f32)")),
        (("nodes", 1, "attrs"), 5, ("key 'attrs'", "expected a table")),
        (("nodes", 1, "attrs", "x"), {"a": 1}, ("key 'attrs.x'", "an attr value must be")),
        (("nodes", 1, "attrs", "x"), [1, 2.0], ("key 'attrs.x'", "only integers or only floats")),
        (("nodes", 1, "attrs", "x"), [True], ("key 'attrs.x'", "an attr value must be")),
        (("inputs", 0, "shape"), [1, "2"], ("inputs[0] key 'shape[1]'", "expected an integer")),
        (("inputs", 0, "shape"), 4, ("inputs[0] key 'shape'", "expected an array of integers")),
        (("inputs", 0, "dtype"), 0, ("inputs[0] key 'dtype'", "expected a string")),
        (("inputs", 0, "name"), 0, ("inputs[0] key 'name'", "expected a string")),
        (("outputs",), "logits", ("key 'outputs'", "expected an array of strings")),
        (("nodes",), {"id": 0}, ("key 'nodes'", "expected an array of tables")),
        (("nodes", 0), [1], ("nodes[0]", "expected a table")),
        (("weights",), [1], ("key 'weights'", "expected a table")),
        (("weights", "model.embed_tokens.weight"), 3, ("weights['model.embed_tokens.weight']",
                                                       "expected a table")),
    ],
)
def test_wrong_types(path, value, fragments):
    doc = doc_of(small_graph())
    target = doc
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    bad(doc, fragments)


def test_ints_for_f32_fields_are_fine():
    doc = doc_of(small_graph())
    doc["nodes"][1]["payload"]["base"] = 500000
    assert load_doc(doc).nodes[1].op.base == 500000.0


@pytest.mark.parametrize(
    "path, value, fragments",
    [
        (("nodes", 1, "id"), 2**32, ("key 'id'", "out of range for u32")),
        (("nodes", 1, "id"), -1, ("key 'id'", "out of range for u32")),
        (("nodes", 1, "backend_hint"), 256, ("key 'backend_hint'", "out of range for u8")),
        (("nodes", 1, "payload", "head_dim"), -1, ("key 'payload.head_dim'", "for u32")),
        (("nodes", 1, "payload", "head_dim"), 2**32, ("key 'payload.head_dim'", "for u32")),
        (("nodes", 1, "payload", "base"), 1e39, ("key 'payload.base'", "out of range for f32")),
        (("nodes", 1, "payload", "base"), 2**200, ("key 'payload.base'", "out of range for f32")),
        (("nodes", 1, "attrs", "x"), [2**63], ("key 'attrs.x[0]'", "out of range for i64")),
        (("inputs", 0, "shape"), [-2], ("inputs[0] key 'shape[0]'", "below -1")),
        (("inputs", 0, "shape"), [1] * 65, ("inputs[0] key 'shape'", "rank 65")),
        (("weights", "model.embed_tokens.weight", "offset"), -5, ("key 'offset'", "for u64")),
        (("weights", "model.embed_tokens.weight", "size"), 2**64, ("key 'size'", "for u64")),
    ],
)
def test_out_of_range(path, value, fragments):
    doc = doc_of(small_graph())
    target = doc
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    bad(doc, fragments)


def test_wire_ranges_of_other_types():
    def one(op, payload):
        return {"outputs": [], "nodes": [{"id": 9, "op": op, "inputs": [], "outputs": [],
                                          "payload": payload}]}

    bad(one("Pool", {"mode": 256, "kernel_h": 1, "kernel_w": 1}),
        ("nodes[0] (id 9) key 'payload.mode'", "out of range for u8"))
    bad(one("Softmax", {"dim": 2**31}), ("key 'payload.dim'", "out of range for i32"))
    bad(one("Softmax", {"dim": -(2**31) - 1}), ("key 'payload.dim'", "out of range for i32"))
    bad(one("Reshape", {"shape": [1, 2**63]}), ("key 'payload.shape[1]'", "for i64[]"))
    bad(one("Reshape", {"shape": 3}), ("key 'payload.shape'", "expected an array of integers"))
    bad(one("Matmul", {"transpose_b": 1}), ("key 'payload.transpose_b'", "expected a boolean"))
    assert load_doc(one("Softmax", {"dim": -(2**31)})).nodes[0].op.dim == -(2**31)


def test_unknown_op_lists_close_matches():
    doc = doc_of(small_graph())
    doc["nodes"][1]["op"] = "RopeX"
    bad(doc, ("nodes[1] (id 1) key 'op'", "unknown op 'RopeX'", "close matches", "Rope"))
    doc["nodes"][1]["op"] = "matmul"
    bad(doc, ("unknown op 'matmul'", "Matmul"))
    doc["nodes"][1]["op"] = "Zzzzzzzz"
    err = bad(doc, "unknown op 'Zzzzzzzz'")
    assert "close matches" not in str(err)


def test_unknown_dtype():
    doc = doc_of(small_graph())
    doc["inputs"][0]["dtype"] = "f33"
    bad(doc, ("unknown dtype 'f33'", "inputs[0] key 'dtype'", "known: f32"))
    doc = {"outputs": [], "nodes": [{"id": 4, "op": "Quantize", "inputs": [], "outputs": [],
                                     "payload": {"dtype": "q9_9"}}]}
    bad(doc, ("unknown dtype 'q9_9'", "nodes[0] (id 4) key 'payload.dtype'"))


def test_input_name_must_agree_with_derived_name():
    doc = doc_of(small_graph())
    doc["inputs"][0]["name"] = "tokenz"
    bad(doc, ("inputs[0] key 'name'", "'tokenz'", "'tokens'"))
    doc["inputs"].append({"name": "extra", "shape": [1], "dtype": "f32"})
    doc["inputs"][0]["name"] = "tokens"
    bad(doc, ("inputs[1] key 'name'", "'extra'", "derive only 1"))
    del doc["inputs"][1]["name"]  # names are informative: an unnamed extra input is read
    assert len(load_doc(doc).inputs) == 2


def test_input_names_without_weights_table():
    doc = doc_of(small_graph(), include_weights=False)
    assert load_doc(doc) == Graph(small_graph().nodes, small_graph().inputs, ["logits"], {})
    doc["inputs"][0]["name"] = "h0"  # produced by a node, so it cannot be an input
    bad(doc, ("inputs[0] key 'name'", "'h0'", "'tokens'"))


def test_payload_class_errors_become_model_format_errors(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Broken(ops.OpPayload):
        def __post_init__(self):
            raise GraphValidationError("broken on purpose")

    spec = ops.OpSpec(65000, "Broken", Broken, (), (0, 1), 1, lambda *a: [], "")
    Broken.spec = spec
    monkeypatch.setitem(ops.OPS_BY_NAME, "Broken", spec)
    doc = {"outputs": [], "nodes": [{"id": 2, "op": "Broken", "inputs": [], "outputs": []}]}
    bad(doc, ("nodes[0] (id 2) key 'payload'", "invalid Broken payload", "broken on purpose"))


def test_error_values_are_bounded():
    doc = doc_of(small_graph())
    doc["nodes"][1]["op"] = "x" * 100_000
    err = bad(doc, "unknown op")
    assert len(str(err)) < 500

