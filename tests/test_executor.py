"""GraphExecutor: the seed's walk, stateful sessions, liveness, weight preparation, memory check.

The tiny Llama is checked against a plain numpy decoder written here from the Llama equations
(not from our kernels); the transformers comparison lives in test_hf_import.py.
"""

import numpy as np
import pytest

from dist_runtime.dtypes import DType
from dist_runtime.errors import GraphValidationError, KernelError
from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.ir import Graph, Node, Relu, TensorSpec
from dist_runtime.tensor import QuantizedArray
from dist_runtime.kernels.quant import quantize
from dist_runtime.backends import compiled
from dist_runtime.backends.compiled import cpu as compiled_cpu, threads

CFG = LlamaConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48)


def executor(cfg=CFG, weights=None, **kw) -> GraphExecutor:
    weights = llama_weights(cfg) if weights is None else weights
    kw.setdefault("kv_dtype", "f32")  # the references here are F32 decoders, compared at 1e-5
    return GraphExecutor((with_specs(llama_graph(cfg), weights), weights), fuse=False, **kw)


def with_specs(graph: Graph, weights) -> Graph:
    specs = {n: TensorSpec(w.shape, w.dtype if isinstance(w, QuantizedArray) else DType.from_numpy(w.dtype))
             for n, w in weights.items()}
    return Graph(graph.nodes, graph.inputs, graph.outputs, specs)


def reference_logits(cfg: LlamaConfig, w: dict, tokens: np.ndarray) -> np.ndarray:
    """A plain float64 Llama forward over the whole sequence (causal), from the equations."""
    hd, T = cfg.head_dim, len(tokens)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.eps) * g

    def rope(x, n):  # x [T, n*hd], rotate-half
        x = x.reshape(T, n, hd)
        inv = cfg.rope_base ** (-np.arange(0, hd, 2) / hd)
        ang = np.arange(T)[:, None] * inv[None, :]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return (x * cos[:, None] + rot * sin[:, None]).reshape(T, n * hd)

    W = {k: v.astype(np.float64) for k, v in w.items()}
    h = W["model.embed_tokens.weight"][tokens]
    group = cfg.heads // cfg.kv_heads
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        x = rms(h, W[p + "input_layernorm.weight"])
        q = rope(x @ W[p + "self_attn.q_proj.weight"].T, cfg.heads).reshape(T, cfg.heads, hd)
        k = rope(x @ W[p + "self_attn.k_proj.weight"].T, cfg.kv_heads).reshape(T, cfg.kv_heads, hd)
        v = (x @ W[p + "self_attn.v_proj.weight"].T).reshape(T, cfg.kv_heads, hd)
        out = np.empty((T, cfg.heads, hd))
        for head in range(cfg.heads):
            s = q[:, head] @ k[:, head // group].T / np.sqrt(hd) + mask
            a = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (a / a.sum(-1, keepdims=True)) @ v[:, head // group]
        h = h + out.reshape(T, -1) @ W[p + "self_attn.o_proj.weight"].T
        x = rms(h, W[p + "post_attention_layernorm.weight"])
        g, u = x @ W[p + "mlp.gate_proj.weight"].T, x @ W[p + "mlp.up_proj.weight"].T
        h = h + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
    return rms(h, W["model.norm.weight"]) @ W["lm_head.weight"].T


TOKENS = np.array([3, 17, 42, 5, 60, 8, 11])


def test_prefill_matches_an_independent_numpy_decoder():
    w = llama_weights(CFG)
    out = executor(weights=w).run({"tokens": TOKENS})
    ref = reference_logits(CFG, w, TOKENS)
    assert out["logits"].dtype == np.float32
    np.testing.assert_allclose(out["logits"], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_array_equal(out["next_token"], ref.argmax(-1))


def test_prefill_equals_token_by_token_and_positions_advance():
    ex = executor()
    full = ex.run({"tokens": TOKENS})["logits"]
    assert ex.past_seq_len == len(TOKENS)
    ex.reset()
    assert ex.past_seq_len == 0
    steps = []
    for i, t in enumerate(TOKENS):
        steps.append(ex.run({"tokens": [t]})["logits"])
        assert ex.past_seq_len == i + 1
    np.testing.assert_allclose(np.concatenate(steps), full, rtol=1e-5, atol=1e-5)
    ex.reset()
    mixed = [ex.run({"tokens": TOKENS[:3]})["logits"], ex.run({"tokens": TOKENS[3:4]})["logits"],
             ex.run({"tokens": TOKENS[4:]})["logits"]]
    np.testing.assert_allclose(np.concatenate(mixed), full, rtol=1e-5, atol=1e-5)


def test_sessions_are_independent_and_interleave():
    ex = executor()
    a, b = TOKENS, TOKENS[::-1].copy()
    alone_a = [executor().run({"tokens": [a[0]]})["logits"]]
    ref = executor()
    ref_a = [ref.run({"tokens": [t]}, session="a")["logits"] for t in a]
    ref_b = [ref.run({"tokens": [t]}, session="b")["logits"] for t in b]
    got_a, got_b = [], []
    for ta, tb in zip(a, b):  # interleaved, one executor
        got_a.append(ex.run({"tokens": [ta]}, session="a")["logits"])
        got_b.append(ex.run({"tokens": [tb]}, session="b")["logits"])
    np.testing.assert_array_equal(np.concatenate(got_a), np.concatenate(ref_a))
    np.testing.assert_array_equal(np.concatenate(got_b), np.concatenate(ref_b))
    np.testing.assert_array_equal(got_a[0], alone_a[0])
    assert ex.position("a") == ex.position("b") == len(TOKENS)
    ex.reset("a")
    assert ex.position("a") == 0 and ex.position("b") == len(TOKENS)
    ex.reset()
    assert ex.position("b") == 0


def test_explicit_pos_replays_a_step_idempotently():
    ex = executor()
    ex.run({"tokens": TOKENS[:4]})
    first = ex.run({"tokens": TOKENS[4:5]})["logits"]
    again = ex.run({"tokens": TOKENS[4:5]}, pos=4)["logits"]  # a retried step: same rows rewritten
    np.testing.assert_array_equal(first, again)
    assert ex.past_seq_len == 5


def test_intermediates_are_freed_after_their_last_use():
    graph = llama_graph(CFG)
    last = {}
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            last[name] = i
    produced = {n: i for i, node in enumerate(graph.nodes) for n in node.outputs}
    seen = []

    def observe(node, outs, live):
        i = len(seen)
        seen.append(node.id)
        for name, p in produced.items():
            should_live = p <= i and (last.get(name, -1) > i or name in graph.outputs)
            assert (name in live) == should_live, (node.op_name, name)

    executor().run({"tokens": TOKENS}, observe=observe)
    assert seen == [n.id for n in graph.nodes]


def test_activations_stay_float32_in_a_decode_step():
    ex = executor()
    ex.run({"tokens": TOKENS[:3]})
    dtypes = set()
    ex.run({"tokens": TOKENS[3:4]}, observe=lambda n, outs, live: dtypes.update(
        (n.op_name, o.dtype.name) for o in outs))
    floats = {d for _, d in dtypes if d.startswith("float")}
    assert floats == {"float32"}, sorted(dtypes)


def test_matmul_weights_stay_quantized_and_others_are_widened_once():
    w = llama_weights(CFG)
    q = {n: quantize(a, DType.Q8_0) if a.ndim == 2 and a.shape[-1] % 32 == 0 else a.astype(np.float16)
         for n, a in w.items()}
    ex = executor(weights=q)
    consts = ex._constants
    assert isinstance(consts["model.layers.0.self_attn.q_proj.weight"], QuantizedArray)
    assert isinstance(consts["model.embed_tokens.weight"], QuantizedArray)  # TokenEmbed gathers rows
    assert consts["model.norm.weight@f32"].dtype == np.float32  # f16 norm scale widened once
    assert "model.norm.weight" not in consts
    got = ex.run({"tokens": TOKENS})["logits"]
    ref = reference_logits(CFG, w, TOKENS)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()  # Q8_0 + f16 error, small


def test_memory_limit_is_checked_before_running():
    calls = []
    ex = executor(max_memory=1000)
    with pytest.raises(GraphValidationError, match="exceeds max_memory 1,000"):
        ex.run({"tokens": TOKENS}, observe=lambda *a: calls.append(a))
    assert calls == [] and ex.past_seq_len == 0


@pytest.mark.parametrize("inputs, message", [
    ({}, r"missing \['tokens'\]"),
    ({"tokens": [1], "extra": [2]}, r"unexpected \['extra'\]"),
    ({"tokens": np.array([1.5])}, r"input 'tokens' is float64, the graph declares i32\[-1\]"),
])
def test_bad_inputs(inputs, message):
    with pytest.raises(GraphValidationError, match=message):
        executor().run(inputs)


def test_graph_without_kv_cache_advances_by_one_per_run_as_in_the_seed():
    g = Graph([Node(0, Relu(), ["x"], ["y"])], [TensorSpec((-1,), DType.F32)], ["y"])
    ex = GraphExecutor((g, {}))
    np.testing.assert_array_equal(ex.run({"x": np.array([-1.0, 2.0], np.float32)})["y"], [0.0, 2.0])
    ex.run({"x": np.zeros(3, np.float32)})
    assert ex.past_seq_len == 2


def test_plan_names_backend_and_reason():
    plan = executor().plan()
    assert len(plan) == len(llama_graph(CFG).nodes)
    by_op: dict[str, set] = {}
    for p in plan:
        by_op.setdefault(p["op"], set()).add((p["backend"], p["reason"]))
    for op in ("RmsNorm", "Rope", "Sdpa"):  # by default, numba first (when installed)
        assert by_op[op] == {("numba", "default")}, op
    (matmul,) = by_op["Matmul"]  # a product also says how it runs: its route in the product table
    route = compiled.route(DType.F32, "f32")
    assert matmul == ("numba", f"default; compiled product: F32 on {route.tile}, f32 activations "
                               f"({compiled_cpu.REASON}; {threads.REASON})")
    for op in ("TokenEmbed", "KvCache", "Sample"):
        assert by_op[op] == {("cpu", "default numba does not support it; fallback to cpu")}, op
    plan = executor(backends=["cpu"]).plan()
    assert {p["backend"] for p in plan} == {"cpu"} and all(p["reason"] == "default" for p in plan)


def test_runs_from_a_model_file(tmp_path):
    from dist_runtime.model import save_model
    from dist_runtime.examples import llama_metadata

    w = llama_weights(CFG)
    save_model(tmp_path / "m.model", llama_graph(CFG), w, llama_metadata(CFG)).close()
    got = GraphExecutor(tmp_path / "m.model", kv_dtype="f32").run({"tokens": TOKENS})["logits"]
    np.testing.assert_allclose(got, executor(weights=w).run({"tokens": TOKENS})["logits"], rtol=1e-6, atol=1e-6)


def test_an_error_inside_a_kernel_names_the_node_its_op_and_inputs():
    ex = executor(backends=["cpu"])
    with pytest.raises(KernelError, match=r"^node 0 \(TokenEmbed\) reading tokens i32\[2\], "
                                          r"model.embed_tokens.weight f32\[64,32\]: TokenEmbed: .*99"):
        ex.run({"tokens": np.array([1, 99], np.int32)})


def test_an_unexpected_exception_in_a_backend_becomes_a_kernel_error_naming_the_node():
    """Not only the project's own errors: a bare exception from any backend comes out as the
    project's error, with the node, and the original as its cause."""
    from dist_runtime.backends.cpu import CpuBackend

    class Broken(CpuBackend):
        name = "broken"

        def bind(self, node):
            if node.op_name != "Relu":
                return super().bind(node)

            def fn(inputs, ctx):
                raise IndexError("index 7 is out of bounds")
            return fn

    g = Graph([Node(5, Relu(), ["x"], ["y"])], [TensorSpec((-1, 3), DType.F32)], ["y"], {})
    ex = GraphExecutor((g, {}), backends=[Broken()], fuse=False)
    with pytest.raises(KernelError, match=r"node 5 \(Relu\) reading x f32\[2,3\]: index 7 .* \(IndexError\)") as e:
        ex.run({"x": np.zeros((2, 3), np.float32)})
    assert isinstance(e.value.__cause__, IndexError)
