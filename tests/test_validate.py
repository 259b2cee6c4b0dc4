"""Validation at load: the seed's invariants, shape inference through the graph, -1 dims resolved
from actual inputs, the memory estimate, and errors that name the node and show its neighbours."""

import pytest

from conftest import tiny_decoder
from dist_runtime.dtypes import DType
from dist_runtime.errors import GraphValidationError
from dist_runtime.ir import (Add, Graph, KvCache, Matmul, Node, Relu, Split, TensorSpec,
                             estimate_memory, infer_shapes, validate_graph)

F32 = DType.F32


def spec(*shape, dtype=F32):
    return TensorSpec(shape, dtype)


def chain() -> Graph:
    """x f32[4] -> a = relu(x) -> b = relu(a) -> c = a + b."""
    nodes = [Node(0, Relu(), ["x"], ["a"]), Node(1, Relu(), ["a"], ["b"]), Node(2, Add(), ["a", "b"], ["c"])]
    return Graph(nodes, [spec(4)], ["c"])


def with_weights(graph: Graph, weights: dict) -> Graph:
    return Graph(graph.nodes, graph.inputs, graph.outputs,
                 {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in weights.items()})


def test_tiny_decoder_validates_and_infers_every_shape():
    graph, weights, _ = tiny_decoder()
    graph = with_weights(graph, weights)
    assert validate_graph(graph).warnings == []
    specs = infer_shapes(graph, {"tokens": spec(5, dtype=DType.I32)})
    # hidden 16, 2 heads x 8, 1 KV head x 8, FFN 32, vocab 32; 5 tokens
    assert specs["h_embed"] == spec(5, 16)
    assert specs["l0_q"] == spec(5, 16) and specs["l0_k"] == spec(5, 8)
    assert specs["l0_k_all"] == spec(-1, 8)  # past + 5 rows: known only at run time
    assert specs["l0_attn"] == spec(5, 16)
    assert specs["l0_gate"] == spec(5, 32) and specs["l0_act"] == spec(5, 32)
    assert specs["logits"] == spec(5, 32)
    assert specs["next_token"] == spec(5, dtype=DType.I64)


def test_input_names_are_derived_in_order_of_first_use():
    graph, weights, _ = tiny_decoder()
    assert with_weights(graph, weights).input_names == ["tokens"]
    g = Graph([Node(0, Add(), ["b", "a"], ["c"]), Node(1, Add(), ["c", "a"], ["d"])], [spec(2), spec(2)], ["d"])
    assert g.input_names == ["b", "a"]


def test_memory_estimate_by_hand():
    g = chain()
    est = estimate_memory(g, infer_shapes(g))
    # inputs: x 16 B. Live intermediates: a (16), a+b (32), a+b+c (48), then a, b freed.
    assert (est.inputs, est.weights, est.peak_intermediates, est.total, est.exact) == (16, 0, 48, 64, True)
    assert validate_graph(g, max_memory=64).warnings == []
    with pytest.raises(GraphValidationError, match=r"estimated memory 64 bytes .* exceeds the declared maximum of 63"):
        validate_graph(g, max_memory=63)


def test_memory_estimate_counts_dynamic_dims_as_one_until_resolved():
    g = Graph([Node(0, Relu(), ["x"], ["y"])], [spec(-1, 4)], ["y"])
    est = estimate_memory(g, infer_shapes(g))
    assert (est.inputs, est.peak_intermediates, est.exact) == (16, 16, False)
    est = estimate_memory(g, infer_shapes(g, {"x": spec(10, 4)}))
    assert (est.inputs, est.peak_intermediates, est.exact) == (160, 160, True)


def test_actual_input_must_match_its_declaration():
    g = Graph([Node(0, Relu(), ["x"], ["y"])], [spec(-1, 4)], ["y"])
    with pytest.raises(GraphValidationError, match=r"declared f32\[-1,4\], but f32\[10,5\] was given"):
        infer_shapes(g, {"x": spec(10, 5)})
    with pytest.raises(GraphValidationError, match="'z' is not a graph input"):
        infer_shapes(g, {"z": spec(1)})


def test_shape_mismatch_names_node_op_shapes_and_neighbours():
    nodes = [Node(0, Relu(), ["x"], ["a"]), Node(7, Matmul(), ["a", "w"], ["b"]), Node(2, Relu(), ["b"], ["c"])]
    g = Graph(nodes, [spec(3, 8)], ["c"], {"w": spec(4, 9)})
    with pytest.raises(GraphValidationError) as e:
        validate_graph(g)
    msg = str(e.value)
    assert msg.startswith("node 7 (Matmul, position 1): Matmul: inner dims disagree")
    assert "f32[3,8]" in msg and "f32[4,9]" in msg
    assert ">>" in msg and "%a = Relu %x" in msg and "%c = Relu %b" in msg  # the neighbourhood


@pytest.mark.parametrize("nodes, inputs, outputs, message", [
    ([Node(0, Relu(), ["b"], ["a"]), Node(1, Relu(), ["x"], ["b"])], [spec(1)] * 2, ["a"],
     r"node 0 .*consumes 'b' before node 1 \(position 1\) produces it"),
    ([Node(0, Relu(), ["x"], ["a"]), Node(0, Relu(), ["a"], ["b"])], [spec(1)], ["b"],
     r"id 0 is also used by the node at position 0"),
    ([Node(0, Relu(), ["x"], ["a"]), Node(1, Relu(), ["x"], ["a"])], [spec(1)], ["a"],
     r"'a' is already produced by node 0"),
    ([Node(0, Add(), ["x"], ["a"])], [spec(1)], ["a"], r"Add takes 2 inputs, got 1"),
    ([Node(0, Split(sizes=(1, 1)), ["x"], ["a"])], [spec(2)], ["a"], r"Split produces 2 outputs, 1 are named"),
    ([Node(0, KvCache(), ["x", "x"], ["k", "v"], backend_hint=9)], [spec(1, 4)], ["k"],
     r"unknown backend hint 9 \(known: 0=cpu"),
    ([Node(0, Relu(), ["x"], ["pos"])], [spec(1)], ["pos"], r"output 'pos' is the name of the injected position"),
    ([Node(0, Relu(), ["x"], [""])], [spec(1)], [""], r"an output name is empty"),
    ([Node(0, Relu(), ["x"], ["a"])], [spec(1), spec(1)], ["a"], r"declares 2 input specs but .* consume 1 .*\['x'\]"),
    ([Node(0, Relu(), ["x"], ["a"])], [spec(1)], ["a", "a"], r"name a tensor twice"),
    ([Node(0, Relu(), ["x"], ["a"])], [spec(1)], ["nope"], r"graph output 'nope' is produced by no node"),
])
def test_invariant_violations(nodes, inputs, outputs, message):
    with pytest.raises(GraphValidationError, match=message):
        validate_graph(Graph(nodes, inputs, outputs))


def test_output_named_like_a_weight_is_refused():
    g = Graph([Node(0, Relu(), ["x"], ["w"])], [spec(1)], ["w"], {"w": spec(1)})
    with pytest.raises(GraphValidationError, match="output 'w' is the name of a weight"):
        validate_graph(g)


def test_dead_code_and_unused_weights_are_warnings():
    nodes = [Node(0, Relu(), ["x"], ["a"]), Node(1, Relu(), ["x"], ["dead"]), Node(2, Add(), ["a", "w"], ["y"])]
    g = Graph(nodes, [spec(2)], ["y"], {"w": spec(2), "spare": spec(3)})
    warnings = validate_graph(g).warnings
    assert warnings == ["dead intermediate: 'dead' from node 1 (Relu) is never used",
                        "unused weight: 'spare' is consumed by no node"]


def test_graph_outputs_and_inputs_are_never_counted_as_freed():
    # y is an output consumed by nothing: it stays live to the end, as does the input x.
    g = Graph([Node(0, Relu(), ["x"], ["y"]), Node(1, Relu(), ["x"], ["z"])], [spec(4)], ["y", "z"])
    est = estimate_memory(g, infer_shapes(g))
    assert (est.inputs, est.peak_intermediates) == (16, 32)


def test_validation_does_not_touch_weights_arrays():
    # validation works from specs alone: a weights dict of specs, no arrays needed
    graph, weights, _ = tiny_decoder()
    g = with_weights(graph, weights)
    assert all(isinstance(s, TensorSpec) for s in g.weights.values())
    est = estimate_memory(g, infer_shapes(g))
    assert est.weights == sum(w.nbytes for w in weights.values())
