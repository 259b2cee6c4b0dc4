"""The fusion pre-pass (dist_runtime/fusion.py): which groups fuse, which must not, and that the
fused graph computes what the unfused one does, through the GraphExecutor (prefill and decode)."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dist_runtime.dtypes import DType
from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.fusion import (PATTERNS, backend_acceptor, expand_fused_node, expand_rejected,
                                 fuse_graph)
from dist_runtime.ir import (Add, FusedNormMatmul, FusedSkipNorm, FusedSwiGlu, Graph, Matmul, Mul, Node,
                             Relu, RmsNorm, Silu, SwiGlu, TensorSpec, decode_graph, encode_graph,
                             graph_from_toml, graph_to_toml, validate_graph)
from dist_runtime.ir.builder import GraphBuilder
from dist_runtime.ir.hints import BackendHint

CONFIGS = [
    LlamaConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48),  # GQA
    LlamaConfig(vocab=48, hidden=48, layers=3, heads=6, kv_heads=1, ffn=64),  # MQA, 3 layers
    LlamaConfig(vocab=32, hidden=16, layers=1, heads=2, kv_heads=2, ffn=40),  # MHA, 1 layer
]
PROMPT = np.array([3, 17, 12, 5, 30, 8, 11], np.int32)


def with_specs(graph: Graph, weights: dict) -> Graph:
    specs = {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in weights.items()}
    return Graph(graph.nodes, graph.inputs, graph.outputs, specs)


def llama(cfg: LlamaConfig, dtype=np.float32) -> tuple[Graph, dict]:
    weights = {n: w.astype(dtype) for n, w in llama_weights(cfg).items()}
    return with_specs(llama_graph(cfg), weights), weights


def ops(graph: Graph) -> Counter:
    return Counter(n.op_name for n in graph.nodes)


def assert_runs_agree(graph: Graph, weights: dict, steps: list[dict], rtol=1e-5, atol=1e-5) -> None:
    """Run ``steps`` (one inputs dict per run: a prefill, then decode steps) unfused and fused."""
    unfused = GraphExecutor((graph, weights), kv_dtype="f32", fuse=False)
    fused = GraphExecutor((graph, weights), kv_dtype="f32", fuse=True)
    assert len(fused.graph.nodes) < len(unfused.graph.nodes)
    for inputs in steps:
        want, got = unfused.run(inputs), fused.run(inputs)
        assert want.keys() == got.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
            scale = float(np.abs(want[name]).max()) if want[name].size else 1.0
            np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol * max(scale, 1.0),
                                       err_msg=name)


# -- the example Llama ---------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", CONFIGS, ids=["gqa", "mqa-3layers", "mha-1layer"])
def test_llama_fused_matches_unfused_prefill_and_decode(cfg):
    graph, weights = llama(cfg)
    steps = [{"tokens": PROMPT}] + [{"tokens": np.array([t], np.int32)} for t in (4, 9, 1, 22)]
    assert_runs_agree(graph, weights, steps)


def test_llama_fused_matches_unfused_with_f16_weights():
    graph, weights = llama(CONFIGS[0], np.float16)
    steps = [{"tokens": PROMPT}] + [{"tokens": np.array([t], np.int32)} for t in (4, 9)]
    # f16 activations: the fused ops round once where the unfused graph rounds after every op
    assert_runs_agree(graph, weights, steps, rtol=2e-2, atol=2e-2)


HF_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"


@pytest.mark.parametrize("name, fused_counts", [
    ("llama", {"FusedSkipNorm": 3, "FusedSwiGlu": 2, "FusedNormMatmul": 1}),
    ("qwen2", {"FusedSkipNorm": 3, "FusedSwiGlu": 2, "FusedNormMatmul": 1}),  # q/k/v biases, tied lm_head
    ("mistral", {"FusedSkipNorm": 3, "FusedSwiGlu": 2, "FusedNormMatmul": 1}),  # sliding window
    ("phi", {}),  # LayerNorm, Gelu, parallel block: no pattern applies
])
def test_real_models_fused_and_unfused_agree_with_transformers(name, fused_counts):
    """The Hugging Face fixtures (tiny checkpoints written by transformers, with its logits):
    fused and unfused runs agree with each other and with transformers, prefill and decode."""
    pytest.importorskip("safetensors")
    from dist_runtime.importers.hf.llama import load_hf

    imported = load_hf(HF_FIXTURES / name)
    graph = imported.graph
    fused = fuse_graph(graph)
    counts = ops(fused)
    assert {op: n for op, n in counts.items() if op.startswith("Fused")} == fused_counts
    assert len(graph.nodes) - len(fused.nodes) == sum(
        {"FusedSkipNorm": 1, "FusedSwiGlu": 2, "FusedNormMatmul": 1}[op] * n for op, n in fused_counts.items())
    with np.load(HF_FIXTURES / f"{name}.npz") as ref:
        prompt, tokens, logits = ref["prompt"], ref["tokens"], ref["logits"]
    steps = [{"tokens": prompt.astype(np.int32)}] + [{"tokens": np.array([t], np.int32)} for t in tokens[:6]]
    if fused_counts:
        assert_runs_agree(graph, imported.weights, steps)
    ex = GraphExecutor((graph, imported.weights), kv_dtype="f32")
    ours = np.concatenate([ex.run(s)["logits"] for s in steps])
    ref_rows = logits[: len(ours)]
    assert np.abs(ours - ref_rows).max() <= 1e-4 * np.abs(ref_rows).max()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_real_models_fused_and_unfused_agree_with_f16_weights(name):
    pytest.importorskip("safetensors")
    from dist_runtime.importers.hf.llama import load_hf

    imported = load_hf(HF_FIXTURES / name, "f16")
    with np.load(HF_FIXTURES / f"{name}.npz") as ref:
        prompt, tokens = ref["prompt"], ref["tokens"]
    steps = [{"tokens": prompt.astype(np.int32)}] + [{"tokens": np.array([t], np.int32)} for t in tokens[:4]]
    assert_runs_agree(imported.graph, imported.weights, steps, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["gqa", "mqa-3layers", "mha-1layer"])
def test_llama_node_counts_before_and_after(cfg):
    graph, _ = llama(cfg)
    fused = fuse_graph(graph)
    L = cfg.layers
    assert len(graph.nodes) == 16 * L + 4
    # per layer: gate+up+SwiGlu -> 1 (-2), post-attention Add+RmsNorm -> 1 (-1), the next layer's
    # input Add+RmsNorm -> 1 (-1, L-1 times), final RmsNorm+lm_head -> 1 (-1)
    assert len(fused.nodes) == 12 * L + 4
    counts = ops(fused)
    assert counts["FusedSwiGlu"] == L
    assert counts["FusedSkipNorm"] == 2 * L - 1
    assert counts["FusedNormMatmul"] == 1  # the final norm into lm_head
    assert counts["SwiGlu"] == 0 and counts["Add"] == 1 and counts["RmsNorm"] == 1  # layer 0's norm
    assert counts["Matmul"] == 5 * L  # q, k, v, o, down
    assert validate_graph(fused).warnings == []


def test_llama_norm_into_qkv_only_when_asked():
    graph, _ = llama(CONFIGS[0])
    fused = fuse_graph(graph, norm_matmul_max_consumers=3)
    assert ops(fused)["FusedNormMatmul"] == 1 + 3  # lm_head, and layer 0's q/k/v
    assert ops(fused)["RmsNorm"] == 0
    no_skip = fuse_graph(graph, norm_matmul_max_consumers=3, patterns=("swiglu", "norm_matmul"))
    assert ops(no_skip)["FusedNormMatmul"] == 3 * CONFIGS[0].layers + 1
    assert ops(no_skip)["FusedSkipNorm"] == 0
    weights = {n: w for n, w in llama(CONFIGS[0])[1].items()}
    a = GraphExecutor((graph, weights), kv_dtype="f32", fuse=False).run({"tokens": PROMPT})["logits"]
    for g in (fused, no_skip):
        b = GraphExecutor((g, weights), kv_dtype="f32", fuse=False).run({"tokens": PROMPT})["logits"]
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_input_graph_is_unchanged_and_shares_nothing_mutable():
    graph, _ = llama(CONFIGS[0])
    graph.nodes[3].attrs["note"] = "kept"
    before = copy.deepcopy(graph)
    fused = fuse_graph(graph)
    assert graph == before
    assert not {id(n) for n in graph.nodes} & {id(n) for n in fused.nodes}
    for n in fused.nodes:
        n.attrs["mutated"] = True
        n.inputs.append("x")
    assert graph == before


def test_deterministic_ids_unique_and_idempotent():
    graph, _ = llama(CONFIGS[1])
    a, b = fuse_graph(graph), fuse_graph(graph)
    assert a == b
    ids = [n.id for n in a.nodes]
    assert len(set(ids)) == len(ids)
    assert fuse_graph(a) == a  # nothing left to fuse
    for n in a.nodes:
        if "fused_ids" in n.attrs:
            assert n.id == n.attrs["fused_ids"][0]  # the first id of the replaced group
            assert len(n.attrs["fused_from"].split(",")) == len(n.attrs["fused_ids"])


def test_fused_graph_survives_the_binary_and_toml_forms():
    graph, _ = llama(CONFIGS[0])
    fused = fuse_graph(graph)
    back = graph_from_toml(graph_to_toml(fused))
    assert back.nodes == fused.nodes  # attrs (fused_from, fused_ids) included
    decoded = decode_graph(encode_graph(fused))
    assert [(n.id, n.op, n.inputs, n.outputs) for n in decoded.nodes] == \
           [(n.id, n.op, n.inputs, n.outputs) for n in fused.nodes]


def test_a_graph_that_does_not_validate_is_returned_unchanged():
    bad = Graph([Node(0, Relu(), ["x"], ["y"]), Node(0, Relu(), ["y"], ["z"])],
                [TensorSpec((4,), DType.F32)], ["z"])
    assert fuse_graph(bad) == bad


def test_unknown_pattern_name_is_an_error():
    with pytest.raises(ValueError, match="unknown fusion patterns"):
        fuse_graph(llama(CONFIGS[0])[0], patterns=("swiglu", "gelu"))
    assert PATTERNS == ("swiglu", "skip_norm", "norm_matmul")


# -- hand-built graphs, one per pattern ------------------------------------------------------------
K, F, N = 16, 24, 12
RNG = np.random.default_rng(7)


def w(*shape) -> np.ndarray:
    return (RNG.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


WEIGHTS = {"nw": (1 + 0.1 * RNG.standard_normal(K)).astype(np.float32), "nw2": np.ones(K, np.float32),
           "W": w(N, K), "W2": w(N, K), "W3": w(N, K), "Wg": w(F, K), "Wu": w(F, K), "Wd": w(K, F),
           "Wkn": w(K, N)}
X = {"x": RNG.standard_normal((5, K)).astype(np.float32), "r": RNG.standard_normal((5, K)).astype(np.float32)}


def graph_of(nodes, outputs, inputs=("x",), weights=WEIGHTS) -> Graph:
    specs = {n: TensorSpec(a.shape, DType.F32) for n, a in weights.items()}
    used = {i for n in nodes for i in n.inputs}
    specs = {n: s for n, s in specs.items() if n in used}
    return Graph(nodes, [TensorSpec((-1, K), DType.F32) for _ in inputs], list(outputs), specs)


def run_both(graph: Graph, inputs=("x",)) -> tuple[Graph, dict]:
    """The fused graph; asserts fused and unfused outputs agree."""
    fused = fuse_graph(graph)
    assert validate_graph(fused).warnings == validate_graph(graph).warnings
    feed = {n: X[n] for n in inputs}
    want = GraphExecutor((graph, WEIGHTS), kv_dtype="f32", fuse=False).run(feed)
    got = GraphExecutor((fused, WEIGHTS), kv_dtype="f32", fuse=False).run(feed)
    assert GraphExecutor((graph, WEIGHTS), kv_dtype="f32").graph == fused  # the executor's default pre-pass
    for name in graph.outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)
    return fused, got


def test_norm_matmul_single_consumer():
    g = graph_of([Node(0, RmsNorm(eps=1e-4), ["x", "nw"], ["n"], {"a": 1}, BackendHint.CPU),
                  Node(1, Matmul(), ["n", "W"], ["y"], {"a": 2, "b": "kept"}, BackendHint.CPU)], ["y"])
    fused, _ = run_both(g)
    (node,) = fused.nodes
    assert node.op == FusedNormMatmul(eps=1e-4)  # eps carried over
    assert node.id == 0 and node.inputs == ["x", "nw", "W"] and node.outputs == ["y"]
    assert node.backend_hint == BackendHint.CPU
    assert node.attrs == {"a": 1, "b": "kept", "fused_from": "RmsNorm,Matmul", "fused_ids": (0, 1)}


def qkv_graph(extra=()):
    return graph_of([Node(0, RmsNorm(), ["x", "nw"], ["n"]),
                     Node(1, Matmul(), ["n", "W"], ["q"]),
                     Node(2, Relu(), ["q"], ["q2"]),
                     Node(3, Matmul(), ["n", "W2"], ["k"]),
                     Node(4, Matmul(), ["n", "W3"], ["v"]), *extra], ["q2", "k", "v"])


def test_norm_with_several_matmuls_is_left_by_default_and_fused_per_consumer_when_allowed():
    g = qkv_graph()
    assert fuse_graph(g) == g
    fused = fuse_graph(g, norm_matmul_max_consumers=3)
    assert [(n.id, n.op_name, n.outputs) for n in fused.nodes] == [
        (0, "FusedNormMatmul", ["q"]), (2, "Relu", ["q2"]),
        (3, "FusedNormMatmul", ["k"]), (4, "FusedNormMatmul", ["v"])]  # each where its Matmul was
    feed = {"x": X["x"]}
    want = GraphExecutor((g, WEIGHTS), kv_dtype="f32", fuse=False).run(feed)
    got = GraphExecutor((fused, WEIGHTS), kv_dtype="f32", fuse=False).run(feed)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("why, nodes, outputs", [
    ("norm output is a graph output",
     [Node(0, RmsNorm(), ["x", "nw"], ["n"]), Node(1, Matmul(), ["n", "W"], ["y"])], ["y", "n"]),
    ("norm also feeds a non-matmul",
     [Node(0, RmsNorm(), ["x", "nw"], ["n"]), Node(1, Matmul(), ["n", "W"], ["y"]),
      Node(2, Relu(), ["n"], ["z"])], ["y", "z"]),
    ("norm is the matmul's b, not its a",
     [Node(0, RmsNorm(), ["x", "nw"], ["n"]), Node(1, Matmul(), ["x", "n"], ["y"])], ["y"]),
    ("matmul without transpose_b",
     [Node(0, RmsNorm(), ["x", "nw"], ["n"]), Node(1, Matmul(transpose_b=False), ["n", "Wkn"], ["y"])], ["y"]),
    ("different backend hints",
     [Node(0, RmsNorm(), ["x", "nw"], ["n"], backend_hint=BackendHint.CPU),
      Node(1, Matmul(), ["n", "W"], ["y"], backend_hint=BackendHint.TORCH)], ["y"]),
])
def test_norm_matmul_not_fused(why, nodes, outputs):
    g = graph_of(nodes, outputs)
    assert ops(fuse_graph(g)) == ops(g), why


def skip_graph(*extra, outputs=("y", "h2")):
    """h = x + r; n = RmsNorm(h); y = n @ W^T; h2 = h + ... (the residual used later)."""
    return graph_of([Node(0, Add(), ["x", "r"], ["h"]),
                     Node(1, Relu(), ["h"], ["hr"]),
                     Node(2, RmsNorm(eps=1e-3), ["h", "nw"], ["n"]),
                     Node(3, Matmul(), ["n", "W2"], ["y0"]),
                     Node(4, Matmul(), ["n", "W3"], ["y1"]),
                     Node(5, Add(), ["y0", "y1"], ["y"]),
                     Node(6, Add(), ["h", "hr"], ["h2"]), *extra], outputs, inputs=("x", "r"))


def test_skip_norm_when_the_sum_is_used_later():
    fused, _ = run_both(skip_graph(), inputs=("x", "r"))
    first = fused.nodes[0]
    assert first.op == FusedSkipNorm(eps=1e-3) and first.id == 0
    assert first.inputs == ["x", "r", "nw"] and first.outputs == ["h", "n"]
    assert fused.nodes[1].op_name == "Relu"  # h is consumed between the Add and the RmsNorm: fused at the Add
    assert ops(fused)["RmsNorm"] == 0 and ops(fused)["Matmul"] == 2


def test_add_then_norm_without_residual_use_goes_to_norm_matmul():
    g = graph_of([Node(0, Add(), ["x", "r"], ["h"]), Node(1, RmsNorm(), ["h", "nw"], ["n"]),
                  Node(2, Matmul(), ["n", "W"], ["y"])], ["y"], inputs=("x", "r"))
    fused, _ = run_both(g, inputs=("x", "r"))
    assert [n.op_name for n in fused.nodes] == ["Add", "FusedNormMatmul"]


def test_skip_norm_when_the_sum_is_a_graph_output():
    g = graph_of([Node(0, Add(), ["x", "r"], ["h"]), Node(1, RmsNorm(), ["h", "nw"], ["n"]),
                  Node(2, Relu(), ["n"], ["y"])], ["y", "h"], inputs=("x", "r"))
    fused, _ = run_both(g, inputs=("x", "r"))
    assert [n.op_name for n in fused.nodes] == ["FusedSkipNorm", "Relu"]


def test_skip_norm_not_fused_across_broadcasting_or_hints():
    bcast = graph_of([Node(0, Add(), ["x", "nw2"], ["h"]), Node(1, RmsNorm(), ["h", "nw"], ["n"]),
                      Node(2, Relu(), ["n"], ["y"])], ["y", "h"])  # [T, K] + [K]: the fused op does not broadcast
    assert ops(fuse_graph(bcast)) == ops(bcast)
    hinted = skip_graph()
    hinted.nodes[2] = replace(hinted.nodes[2], backend_hint=BackendHint.TORCH)
    assert ops(fuse_graph(hinted))["FusedSkipNorm"] == 0


def mlp_graph(act_nodes, extra=(), outputs=("y",)):
    return graph_of([Node(0, RmsNorm(), ["x", "nw"], ["n"]),
                     Node(1, Matmul(), ["n", "Wg"], ["gate"]),
                     Node(2, Matmul(), ["n", "Wu"], ["up"]),
                     *act_nodes,
                     Node(9, Matmul(), ["act", "Wd"], ["y"]), *extra], outputs)


@pytest.mark.parametrize("form, act", [
    ("SwiGlu", [Node(3, SwiGlu(), ["gate", "up"], ["act"])]),
    ("Silu*up", [Node(3, Silu(), ["gate"], ["s"]), Node(4, Mul(), ["s", "up"], ["act"])]),
    ("up*Silu", [Node(3, Silu(), ["gate"], ["s"]), Node(4, Mul(), ["up", "s"], ["act"])]),
])
def test_swiglu_pattern(form, act):
    fused, _ = run_both(mlp_graph(act))
    assert [n.op_name for n in fused.nodes] == ["RmsNorm", "FusedSwiGlu", "Matmul"], form
    node = fused.nodes[1]
    assert node.id == 1 and node.inputs == ["n", "Wg", "Wu"] and node.outputs == ["act"]
    assert node.attrs["fused_ids"] == tuple(n.id for n in [*mlp_graph(act).nodes[1:3], *act])


@pytest.mark.parametrize("why, act, extra, outputs", [
    ("gate has another consumer", [Node(3, SwiGlu(), ["gate", "up"], ["act"])],
     [Node(10, Relu(), ["gate"], ["z"])], ("y", "z")),
    ("up is a graph output", [Node(3, SwiGlu(), ["gate", "up"], ["act"])], [], ("y", "up")),
    ("silu(gate) has another consumer",
     [Node(3, Silu(), ["gate"], ["s"]), Node(4, Mul(), ["s", "up"], ["act"])],
     [Node(10, Relu(), ["s"], ["z"])], ("y", "z")),
    ("gate and up swapped: SwiGlu(up, gate) still fuses with W_up as the gate",
     [Node(3, SwiGlu(), ["up", "gate"], ["act"])], [], ("y",)),
])
def test_swiglu_not_fused_when_an_intermediate_survives(why, act, extra, outputs):
    g = mlp_graph(act, extra, outputs)
    fused = fuse_graph(g)
    if why.startswith("gate and up swapped"):
        assert fused.nodes[1].inputs == ["n", "Wu", "Wg"]  # roles follow the SwiGlu's inputs
        run_both(g)
    else:
        assert ops(fused)["FusedSwiGlu"] == 0, why


def test_swiglu_needs_one_x_for_both_projections():
    g = graph_of([Node(0, RmsNorm(), ["x", "nw"], ["n"]), Node(1, Matmul(), ["n", "Wg"], ["gate"]),
                  Node(2, Matmul(), ["x", "Wu"], ["up"]), Node(3, SwiGlu(), ["gate", "up"], ["act"])], ["act"])
    assert ops(fuse_graph(g))["FusedSwiGlu"] == 0


def test_matmul_then_silu_alone_is_not_fused():
    g = graph_of([Node(0, Matmul(), ["x", "W"], ["m"]), Node(1, Silu(), ["m"], ["y"])], ["y"])
    assert fuse_graph(g) == g


# -- accepts: a fused node that no backend takes ---------------------------------------------------
def test_groups_whose_fused_node_is_rejected_stay_unfused():
    graph, weights = llama(CONFIGS[0])
    seen = []

    def accepts(node, specs):
        seen.append((node.op_name, [s.shape for s in specs]))
        return not isinstance(node.op, FusedSwiGlu)

    fused = fuse_graph(graph, accepts)
    counts = ops(fused)
    assert counts["FusedSwiGlu"] == 0 and counts["SwiGlu"] == CONFIGS[0].layers
    assert counts["FusedSkipNorm"] == 2 * CONFIGS[0].layers - 1 and counts["FusedNormMatmul"] == 1
    assert ("FusedSwiGlu", [(-1, 32), (48, 32), (48, 32)]) in seen
    assert fuse_graph(graph, lambda n, s: False) == graph  # nothing accepted: nothing fused
    a = GraphExecutor((graph, weights), kv_dtype="f32", fuse=False).run({"tokens": PROMPT})["logits"]
    b = GraphExecutor((fused, weights), kv_dtype="f32", fuse=False).run({"tokens": PROMPT})["logits"]
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def prefused_graph():
    """Fused ops written by an author (or an importer), and names that collide with the expansion's."""
    return graph_of([Node(5, FusedSkipNorm(eps=1e-3), ["x", "r", "nw"], ["h", "n"], {"k": 1}, BackendHint.TORCH),
                     Node(2, FusedNormMatmul(eps=1e-4), ["n", "nw", "W"], ["y"]),
                     Node(7, FusedSwiGlu(), ["h", "Wg", "Wu"], ["act"]),
                     Node(8, Relu(), ["act"], ["act.gate"])], ["y", "act.gate", "h"], inputs=("x", "r"))


def test_rejected_fused_nodes_already_in_the_graph_are_expanded():
    g = prefused_graph()
    before = copy.deepcopy(g)
    expanded = fuse_graph(g, accepts=lambda node, specs: False)
    assert g == before
    assert [(n.id, n.op_name, n.inputs, n.outputs) for n in expanded.nodes] == [
        (5, "Add", ["x", "r"], ["h"]),
        (9, "RmsNorm", ["h", "nw"], ["n"]),
        (2, "RmsNorm", ["n", "nw"], ["y.normed"]),
        (10, "Matmul", ["y.normed", "W"], ["y"]),
        (7, "Matmul", ["h", "Wg"], ["act.gate.1"]),  # "act.gate" is taken
        (11, "Matmul", ["h", "Wu"], ["act.up"]),
        (12, "SwiGlu", ["act.gate.1", "act.up"], ["act"]),
        (8, "Relu", ["act"], ["act.gate"]),
    ]
    assert expanded.nodes[0].attrs == {"k": 1, "expanded_from": "FusedSkipNorm"}
    assert expanded.nodes[1].backend_hint == BackendHint.TORCH and expanded.nodes[1].op.eps == pytest.approx(1e-3)
    assert expanded.nodes[2].op.eps == pytest.approx(1e-4)
    assert validate_graph(expanded).warnings == []
    feed = {"x": X["x"], "r": X["r"]}
    want = GraphExecutor((g, WEIGHTS), kv_dtype="f32", fuse=False).run(feed)
    got = GraphExecutor((expanded, WEIGHTS), kv_dtype="f32", fuse=False).run(feed)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_expansion_only_of_what_is_rejected_and_accepted_ones_stay():
    g = prefused_graph()
    out = expand_rejected(g, lambda node, specs: not isinstance(node.op, FusedSwiGlu))
    assert [n.op_name for n in out.nodes] == ["FusedSkipNorm", "FusedNormMatmul", "Matmul", "Matmul",
                                             "SwiGlu", "Relu"]
    assert fuse_graph(g) == g  # no accepts: fused nodes stay, nothing else to fuse
    with pytest.raises(ValueError, match="not a fused op"):
        expand_fused_node(g.nodes[3], GraphBuilder(100))


def test_backend_acceptor_follows_the_selection_chain():
    from dist_runtime.backends.blas import NumpyBlasBackend
    from dist_runtime.backends.cpu import CpuBackend

    graph, _ = llama(CONFIGS[0])
    # only the numpy-blas backend: it takes FusedSwiGlu and FusedNormMatmul, not FusedSkipNorm
    only_blas = fuse_graph(graph, backend_acceptor([NumpyBlasBackend()]))
    counts = ops(only_blas)
    assert counts["FusedSwiGlu"] == 2 and counts["FusedNormMatmul"] == 1 and counts["FusedSkipNorm"] == 0
    assert fuse_graph(graph, backend_acceptor([NumpyBlasBackend(), CpuBackend()])) == fuse_graph(graph)
