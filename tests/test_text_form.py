"""The one-line-per-node text form: exact lines written by hand."""

from __future__ import annotations

import math

import pytest

from dist_runtime.dtypes import DType
from dist_runtime.ir import ops
from dist_runtime.ir.graph import POS, Graph, Node, TensorSpec
from dist_runtime.ir.text_form import format_graph, format_neighbourhood, format_node

Q = "model.layers.0.self_attn.q_proj.weight"


def llama_bits() -> Graph:
    return Graph(
        [
            Node(0, ops.TokenEmbed(), ["tokens", "model.embed_tokens.weight"], ["h0"]),
            Node(1, ops.RmsNorm(), ["h0", "model.layers.0.input_layernorm.weight"],
                 ["layer_0_normed"]),
            Node(2, ops.Matmul(), ["layer_0_normed", Q], ["layer_0_q"]),
            Node(3, ops.Rope(head_dim=64, rope_dim=64), ["layer_0_q", POS], ["layer_0_q_rot"]),
            Node(4, ops.KvCache(), ["layer_0_q_rot", "layer_0_q_rot"], ["k_full", "v_full"],
                 {"fuse": True, "group": "attn", "ids": (1, 2), "w": (0.5,), "n": -3, "f": 2.0}, 1),
            Node(5, ops.Matmul(transpose_b=False), ["k_full", "v_full"], ["logits"],
                 backend_hint=0),
        ],
        [TensorSpec((-1,), DType.I32)],
        ["logits"],
        {
            "model.embed_tokens.weight": TensorSpec((32000, 4096), DType.Q8_0),
            "model.layers.0.input_layernorm.weight": TensorSpec((4096,), DType.F32),
            Q: TensorSpec((4096, 4096), DType.Q4_0),
        },
    )


def test_plain_node_lines():
    g = llama_bits()
    assert format_node(g.nodes[0], g) == "%h0 = TokenEmbed %tokens, model.embed_tokens.weight"
    # Matmul's transpose_b defaults to true, so nothing is shown.
    assert format_node(g.nodes[2], g) == f"%layer_0_q = Matmul %layer_0_normed, {Q}"
    assert format_node(g.nodes[1], g) == (
        "%layer_0_normed = RmsNorm %h0, model.layers.0.input_layernorm.weight"
    )


def test_fields_without_defaults_always_shown_and_defaults_hidden():
    g = llama_bits()
    assert format_node(g.nodes[3], g) == (
        "%layer_0_q_rot = Rope(head_dim=64, rope_dim=64) %layer_0_q, %pos"
    )
    n = Node(9, ops.Rope(head_dim=64, rope_dim=32, base=500000.0), ["x", POS], ["y"])
    assert format_node(n, g) == "%y = Rope(head_dim=64, rope_dim=32, base=500000.0) %x, %pos"


def test_payload_value_kinds():
    g = Graph()
    cases = [
        (ops.RmsNorm(eps=1e-6), "RmsNorm"),  # the default, after f32 rounding
        (ops.LayerNorm(eps=1e-6), "LayerNorm(eps=1e-06)"),
        (ops.Clamp(min=0.0), "Clamp(min=0.0)"),
        (ops.Clamp(min=-math.inf, max=6.0), "Clamp(max=6.0)"),
        (ops.NanToNum(nan=0.5, posinf=math.inf), "NanToNum(nan=0.5, posinf=inf)"),
        (ops.NanToNum(), "NanToNum"),
        (ops.Reshape(shape=(0, -1, 64)), "Reshape(shape=[0,-1,64])"),
        (ops.Quantize(dtype=DType.Q4_0), "Quantize(dtype=q4_0)"),
        (ops.Quantize(), "Quantize"),
        (ops.Sdpa(32, 8, 128, causal=True),
         "Sdpa(num_heads=32, kv_heads=8, head_dim=128, causal=true)"),
        (ops.Softmax(dim=1), "Softmax(dim=1)"),
        (ops.Sample(method=2, temperature=0.7, k=40),
         "Sample(method=2, temperature=0.7, k=40)"),
    ]
    for payload, text in cases:
        assert format_node(Node(0, payload, ["x"], ["y"]), g) == f"%y = {text} %x"


def test_multi_output_hint_and_attrs():
    g = llama_bits()
    assert format_node(g.nodes[4], g) == (
        "%k_full, %v_full = KvCache %layer_0_q_rot, %layer_0_q_rot @backend=1 "
        '{fuse=true, group="attn", ids=[1,2], w=[0.5], n=-3, f=2.0}'
    )
    assert format_node(g.nodes[5], g) == (
        "%logits = Matmul(transpose_b=false) %k_full, %v_full @backend=0"
    )


def test_specs_comment():
    g = llama_bits()
    specs = {
        "layer_0_q": TensorSpec((-1, 4096), DType.F32),
        "k_full": TensorSpec((-1, 4096), DType.F32),
    }
    assert format_node(g.nodes[2], g, specs) == (
        f"%layer_0_q = Matmul %layer_0_normed, {Q}  # f32[-1,4096]"
    )
    assert format_node(g.nodes[4], g, specs).endswith("  # f32[-1,4096], ?")
    assert "#" not in format_node(g.nodes[2], g)


def test_odd_names_are_quoted():
    g = Graph(weights={"a weight": TensorSpec((1,), DType.F32)})
    n = Node(0, ops.Add(), ["two words", "a weight", "ünïcode.ok-1/x:y"], ['q"uote', ""])
    assert format_node(n, g) == (
        '%"q\\"uote", %"" = Add %"two words", "a weight", %ünïcode.ok-1/x:y'
    )
    assert format_node(Node(1, ops.Add(), [], []), g) == "() = Add"


def test_graph():
    g = llama_bits()
    specs = {"logits": TensorSpec((-1, 4096), DType.F32)}
    assert format_graph(g, specs) == "\n".join([
        "graph(%tokens: i32[-1]) -> %logits: f32[-1,4096]",
        "  %h0 = TokenEmbed %tokens, model.embed_tokens.weight  # ?",
        "  %layer_0_normed = RmsNorm %h0, model.layers.0.input_layernorm.weight  # ?",
        f"  %layer_0_q = Matmul %layer_0_normed, {Q}  # ?",
        "  %layer_0_q_rot = Rope(head_dim=64, rope_dim=64) %layer_0_q, %pos  # ?",
        "  %k_full, %v_full = KvCache %layer_0_q_rot, %layer_0_q_rot @backend=1 "
        '{fuse=true, group="attn", ids=[1,2], w=[0.5], n=-3, f=2.0}  # ?, ?',
        "  %logits = Matmul(transpose_b=false) %k_full, %v_full @backend=0  # f32[-1,4096]",
    ])
    assert format_graph(g).splitlines()[0] == "graph(%tokens: i32[-1]) -> %logits"


def test_graph_header_edge_cases():
    assert format_graph(Graph()) == "graph() -> ()"
    g = Graph([Node(0, ops.Add(), ["a", "b"], ["c"])], [TensorSpec((2,), DType.F16)], ["c", "a"])
    assert format_graph(g) == "graph(%a: f16[2], %b: ?) -> %c, %a\n  %c = Add %a, %b"
    g = Graph([], [TensorSpec((), DType.F32)], [])
    assert format_graph(g) == "graph(%?: f32[]) -> ()"


def chain(n: int, first_id: int = 0) -> Graph:
    nodes = [Node(first_id + i, ops.Relu(), [f"x{i}"], [f"x{i + 1}"]) for i in range(n)]
    return Graph(nodes, [TensorSpec((4,), DType.F32)], [f"x{n}"])


def test_neighbourhood_middle():
    assert format_neighbourhood(chain(12), 5, radius=2) == "\n".join([
        "   ...",
        "   [3] %x4 = Relu %x3",
        "   [4] %x5 = Relu %x4",
        ">> [5] %x6 = Relu %x5",
        "   [6] %x7 = Relu %x6",
        "   [7] %x8 = Relu %x7",
        "   ...",
    ])


def test_neighbourhood_edges_widths_ids_and_specs():
    g = chain(12)
    assert format_neighbourhood(g, 0, radius=1) == "\n".join([
        ">> [0] %x1 = Relu %x0",
        "   [1] %x2 = Relu %x1",
        "   ...",
    ])
    assert format_neighbourhood(g, 11, radius=2) == "\n".join([
        "   ...",
        "   [9]  %x10 = Relu %x9",
        "   [10] %x11 = Relu %x10",
        ">> [11] %x12 = Relu %x11",
    ])
    assert format_neighbourhood(chain(3, first_id=7), 1, radius=0) == "\n".join([
        "   ...",
        ">> [1 id=8] %x2 = Relu %x1",
        "   ...",
    ])
    specs = {"x2": TensorSpec((4,), DType.F32)}
    assert format_neighbourhood(chain(2), 1, specs=specs) == "\n".join([
        "   [0] %x1 = Relu %x0  # ?",
        ">> [1] %x2 = Relu %x1  # f32[4]",
    ])


def test_neighbourhood_index_out_of_range():
    with pytest.raises(IndexError, match="out of range"):
        format_neighbourhood(chain(2), 2)
    with pytest.raises(IndexError):
        format_neighbourhood(chain(2), -1)
