"""Backends and backend selection (dist_runtime/backends/: the registry, assign.py, blas.py).

The selection passes -- a node's hint, the default backend, the CPU library, an error naming the
node -- are exercised with the ``numpy-blas`` backend, which CI always has and which computes
real results.  No backend serves hint ``torch`` (3) today: a node hinted so runs on the default.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest

import dist_runtime.backends as backends_module
import dist_runtime.fusion as fusion_module
from dist_runtime.backends import Backend, available_backends, make_backends
from dist_runtime.backends.blas import NumpyBlasBackend, PackCache
from dist_runtime.backends.cpu import CpuBackend
from dist_runtime.dtypes import DType
from dist_runtime.errors import GraphValidationError
from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.fusion import backend_acceptor, fuse_graph
from dist_runtime.ir import (FusedNormMatmul, FusedSkipNorm, FusedSwiGlu, Graph, LoraApply, Matmul, Node,
                             RmsNorm, Sdpa, TensorSpec)
from dist_runtime.ir.hints import BackendHint
from dist_runtime.kernels.quant import quantize
from dist_runtime.kernels.registry import KernelContext, kernel_for

CFG = LlamaConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)
PROMPT = np.array([3, 17, 42, 5, 60, 8, 11], np.int32)
RNG = np.random.default_rng(3)


def spec(*shape, dtype=DType.F32) -> TensorSpec:
    return TensorSpec(shape, dtype)


def llama(dtype=np.float32, hints: dict[str, int] | None = None) -> tuple[Graph, dict]:
    """The example Llama with weight specs; ``hints`` maps op names to a backend hint."""
    weights = {n: w.astype(dtype) for n, w in llama_weights(CFG).items()}
    g = llama_graph(CFG)
    nodes = [replace(n, backend_hint=hints.get(n.op_name)) if hints else n for n in g.nodes]
    specs = {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in weights.items()}
    return Graph(nodes, g.inputs, g.outputs, specs), weights


def decode(ex: GraphExecutor, steps=(4, 9, 1)) -> list[np.ndarray]:
    out = [ex.run({"tokens": PROMPT})["logits"]]
    out += [ex.run({"tokens": np.array([t], np.int32)})["logits"] for t in steps]
    return out


def assert_close_runs(got: list, want: list, rtol=1e-5, atol=1e-5) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * max(1.0, float(np.abs(w).max())))


def mat(*shape, dtype=np.float32) -> np.ndarray:
    return (RNG.standard_normal(shape) / np.sqrt(shape[-1])).astype(dtype)


# -- the numpy-blas backend: what it takes, what it computes ---------------------------------------
@pytest.mark.parametrize("op, specs, ok", [
    (Matmul(), [spec(-1, 8), spec(4, 8)], True),
    (Matmul(), [spec(8), spec(4, 8, dtype=DType.F16)], True),
    (Matmul(transpose_b=False), [spec(2, 3, 8), spec(8, 4)], True),
    (Matmul(), [spec(2, 3, 8), spec(2, 4, 8)], False),  # batched b: attention-style, CPU's
    (Matmul(), [spec(-1, 32), spec(4, 32, dtype=DType.Q8_0)], False),  # block weights: CPU's
    (Matmul(), [spec(-1, 8), spec(4, 8, dtype=DType.BF16)], False),
    (Matmul(), [spec(-1, 8, dtype=DType.F64), spec(4, 8, dtype=DType.F64)], False),
    (FusedNormMatmul(), [spec(-1, 8), spec(8), spec(4, 8, dtype=DType.F16)], True),
    (FusedSwiGlu(), [spec(-1, 8, dtype=DType.F16), spec(6, 8), spec(6, 8)], True),
    (LoraApply(), [spec(-1, 8), spec(4, 8), spec(2, 8), spec(4, 2)], True),
    (FusedSkipNorm(), [spec(-1, 8), spec(-1, 8), spec(8)], False),
    (RmsNorm(), [spec(-1, 8), spec(8)], False),
])
def test_numpy_blas_supports_the_matmul_family_on_f32_f16(op, specs, ok):
    assert NumpyBlasBackend().supports(op, specs) is ok


CASES = [
    (Matmul(), lambda dt: [mat(5, 16), mat(12, 16, dtype=dt)]),
    (Matmul(), lambda dt: [mat(16), mat(12, 16, dtype=dt)]),  # a vector a
    (Matmul(), lambda dt: [mat(2, 3, 16), mat(12, 16, dtype=dt)]),  # batched a
    (Matmul(transpose_b=False), lambda dt: [mat(5, 16), mat(16, 12, dtype=dt)]),
    (FusedNormMatmul(eps=1e-4), lambda dt: [mat(5, 16) * 3, 1 + mat(16), mat(12, 16, dtype=dt)]),
    (FusedSwiGlu(), lambda dt: [mat(5, 16), mat(24, 16, dtype=dt), mat(24, 16, dtype=dt)]),
    (LoraApply(scale=0.5), lambda dt: [mat(5, 16), mat(12, 16, dtype=dt), mat(4, 16, dtype=dt), mat(12, 4, dtype=dt)]),
]


def backend_vs_cpu(backend, op, inputs, rtol, atol):
    node = Node(0, op, [f"i{k}" for k in range(len(inputs))], ["y"])
    assert backend.supports(op, [spec(*a.shape, dtype=DType.from_numpy(a.dtype)) for a in inputs])
    fn = backend.bind(node)
    want = kernel_for(type(op))(op, inputs, KernelContext())[0]
    for _ in range(2):  # second call: packed weights reused
        got = fn(inputs, KernelContext())[0]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    np.testing.assert_allclose(backend.execute(node, inputs, KernelContext())[0], want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dt", [np.float32, np.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_numpy_blas_computes_what_the_cpu_library_computes(case, dt):
    op, make = CASES[case]
    backend_vs_cpu(NumpyBlasBackend(), op, make(dt), rtol=1e-5, atol=1e-5)


def test_numpy_blas_f16_activations_round_once_to_f16():
    x, w = mat(5, 16, dtype=np.float16), mat(12, 16, dtype=np.float16)
    y = NumpyBlasBackend().execute(Node(0, Matmul(), ["x", "w"], ["y"]), [x, w], KernelContext())[0]
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, (x.astype(np.float32) @ w.astype(np.float32).T).astype(np.float16))


def test_pack_cache_packs_a_weight_once_and_repacks_a_new_operand():
    calls = []
    cache = PackCache(lambda a: calls.append(a) or a.astype(np.float32))
    w, other = mat(4, 8, dtype=np.float16), mat(4, 8, dtype=np.float16)
    first = cache(1, w)
    assert cache(1, w) is first and len(calls) == 1
    cache(1, other)
    assert len(calls) == 2 and cache(1, other) is not first and len(calls) == 2
    cache(2, w)
    assert len(calls) == 3  # per slot


def test_backends_meet_the_protocol_and_register_by_name():
    assert isinstance(NumpyBlasBackend(), Backend) and isinstance(CpuBackend(), Backend)
    assert "numpy-blas" in available_backends()
    made = make_backends(["numpy-blas"])
    assert [b.name for b in made] == ["numpy-blas", "cpu"]
    assert NumpyBlasBackend(hint=BackendHint.WGPU).hint == BackendHint.WGPU
    with pytest.raises(GraphValidationError, match="unknown backend 'nope'"):
        make_backends(["nope"])


# -- selection: hint, default, CPU fallback, error ------------------------------------------------
def plan_by_op(ex: GraphExecutor) -> dict[str, set[tuple[str, str]]]:
    out: dict[str, set] = {}
    for p in ex.plan():
        out.setdefault(p["op"], set()).add((p["backend"], p["reason"]))
    return out


def test_default_backend_takes_what_it_supports_and_the_rest_falls_back_to_cpu():
    graph, weights = llama()
    ex = GraphExecutor((graph, weights), kv_dtype="f32", backends=["numpy-blas"], fuse=False)
    plan = plan_by_op(ex)
    assert plan["Matmul"] == {("numpy-blas", "default")}
    for op in ("RmsNorm", "Rope", "KvCache", "Sdpa", "Add", "SwiGlu", "TokenEmbed", "Sample"):
        assert plan[op] == {("cpu", "default numpy-blas does not support it; fallback to cpu")}, op
    assert [p["id"] for p in ex.plan()] == [n.id for n in graph.nodes]
    assert_close_runs(decode(ex), decode(GraphExecutor((graph, weights), kv_dtype="f32", fuse=False)))


def test_fused_graph_on_numpy_blas_agrees_with_unfused_cpu():
    graph, weights = llama()
    ex = GraphExecutor((graph, weights), kv_dtype="f32", backends=["numpy-blas"])
    plan = plan_by_op(ex)
    assert plan["FusedSwiGlu"] == {("numpy-blas", "default")}
    assert plan["FusedNormMatmul"] == {("numpy-blas", "default")}
    assert plan["FusedSkipNorm"] == {("cpu", "default numpy-blas does not support it; fallback to cpu")}
    assert_close_runs(decode(ex), decode(GraphExecutor((graph, weights), kv_dtype="f32", fuse=False)))


def test_f16_weights_on_numpy_blas_are_widened_once_and_agree():
    graph, weights = llama(np.float16)
    ex = GraphExecutor((graph, weights), kv_dtype="f32", backends=["numpy-blas"])
    assert_close_runs(decode(ex), decode(GraphExecutor((graph, weights), kv_dtype="f32")), rtol=1e-2, atol=1e-2)


def test_hint_is_honoured_over_the_default():
    graph, weights = llama(hints={"Matmul": BackendHint.WGPU, "RmsNorm": BackendHint.WGPU})
    blas = NumpyBlasBackend(hint=BackendHint.WGPU)  # serves the nodes hinted wgpu
    ex = GraphExecutor((graph, weights), kv_dtype="f32", backends=["cpu", blas], fuse=False)  # default: cpu
    plan = plan_by_op(ex)
    assert plan["Matmul"] == {("numpy-blas", "hint wgpu")}
    assert plan["RmsNorm"] == {("cpu", "hint wgpu does not support it; default")}
    assert plan["Rope"] == {("cpu", "default")}
    assert_close_runs(decode(ex), decode(GraphExecutor((graph, weights), kv_dtype="f32", fuse=False)))


def test_hint_for_a_backend_not_in_use_falls_back_to_default_then_cpu():
    graph, weights = llama(hints={"Matmul": BackendHint.TORCH, "RmsNorm": BackendHint.TORCH,
                                  "Sdpa": BackendHint.METAL})
    ex = GraphExecutor((graph, weights), kv_dtype="f32", backends=["numpy-blas"], fuse=False)
    plan = plan_by_op(ex)
    assert plan["Matmul"] == {("numpy-blas", "hint torch not in use; default")}
    assert plan["RmsNorm"] == {
        ("cpu", "hint torch not in use; default numpy-blas does not support it; fallback to cpu")}
    assert plan["Sdpa"] == {
        ("cpu", "hint metal not in use; default numpy-blas does not support it; fallback to cpu")}
    assert_close_runs(decode(ex), decode(GraphExecutor((graph, weights), kv_dtype="f32", fuse=False)))


def test_a_node_the_hinted_backend_declines_for_its_dtypes_goes_to_cpu():
    graph, weights = llama(hints={"Matmul": BackendHint.WGPU})
    weights = dict(weights)
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = quantize(weights[name], DType.Q8_0)
    graph = Graph(graph.nodes, graph.inputs, graph.outputs,
                  {**graph.weights, name: TensorSpec(weights[name].shape, DType.Q8_0)})
    ex = GraphExecutor((graph, weights), kv_dtype="f32", backends=[NumpyBlasBackend(hint=BackendHint.WGPU)], fuse=False)
    by_id = {p["id"]: p for p in ex.plan()}
    q_node = next(n for n in graph.nodes if n.inputs[1:] == [name])
    assert (by_id[q_node.id]["backend"], by_id[q_node.id]["reason"]) == (
        "cpu", "hint wgpu does not support it; default numpy-blas does not support it; fallback to cpu")
    others = [p for p in ex.plan() if p["op"] == "Matmul" and p["id"] != q_node.id]
    assert {(p["backend"], p["reason"]) for p in others} == {("numpy-blas", "hint wgpu")}
    assert_close_runs(decode(ex), decode(GraphExecutor((graph, weights), kv_dtype="f32", numerics="f32", fuse=False)))


class CpuWithoutSdpa(CpuBackend):
    """The CPU library built without one kernel (as a port that lacks an op would be)."""

    def supports(self, op, input_specs):
        return not isinstance(op, Sdpa) and super().supports(op, input_specs)


def test_no_backend_accepts_is_an_error_naming_the_node():
    graph, weights = llama()
    sdpa = next(n for n in graph.nodes if n.op_name == "Sdpa")
    with pytest.raises(GraphValidationError, match=rf"node {sdpa.id} \(Sdpa\): no backend accepts it "
                                                   r"\(default numpy-blas does not support it; cpu has no "
                                                   r"kernel\); backends in use: \['numpy-blas', 'cpu'\]"):
        GraphExecutor((graph, weights), kv_dtype="f32", backends=[NumpyBlasBackend(), CpuWithoutSdpa()])


def test_acceptor_mirrors_the_chain_a_fused_node_would_go_through():
    graph, _ = llama(hints={"RmsNorm": BackendHint.WGPU, "Add": BackendHint.WGPU})
    blas = NumpyBlasBackend(hint=BackendHint.WGPU)
    accepts = backend_acceptor([CpuBackend(), blas, CpuWithoutFused()])  # default: a full CPU library
    assert fuse_graph(graph, accepts) == fuse_graph(graph)
    accepts = backend_acceptor([CpuWithoutFused(), blas])
    fused = fuse_graph(graph, accepts)
    ops = [n.op_name for n in fused.nodes]
    # Add+RmsNorm hinted wgpu: numpy-blas (wgpu) and the CPU library both decline FusedSkipNorm;
    # the final RmsNorm (wgpu) + lm_head (no hint) differ in hints and never fuse
    assert "FusedSkipNorm" not in ops and "FusedNormMatmul" not in ops and ops.count("FusedSwiGlu") == 2


class CpuWithoutFused(CpuBackend):
    """The CPU library without the two norm-fused kernels."""

    def supports(self, op, input_specs):
        return not isinstance(op, (FusedSkipNorm, FusedNormMatmul)) and super().supports(op, input_specs)


def test_executor_does_not_form_fused_nodes_no_backend_takes():
    graph, weights = llama()
    ex = GraphExecutor((graph, weights), kv_dtype="f32", backends=[NumpyBlasBackend(), CpuWithoutFused()])
    ops = {n.op_name for n in ex.graph.nodes}
    assert "FusedSkipNorm" not in ops and "FusedSwiGlu" in ops and "FusedNormMatmul" in ops  # blas takes it
    assert_close_runs(decode(ex), decode(GraphExecutor((graph, weights), kv_dtype="f32", fuse=False)))


@pytest.mark.parametrize("name", ["numba"])
def test_optional_backends_by_name_and_a_missing_package_is_named(monkeypatch, name):
    assert {"cpu", "numpy-blas", name} <= set(available_backends())
    monkeypatch.setitem(sys.modules, name, None)  # as where the package is not installed
    monkeypatch.delitem(sys.modules, f"dist_runtime.backends.{name}", raising=False)
    monkeypatch.setitem(backends_module._REGISTRY, name, f"dist_runtime.backends.{name}")  # not imported yet
    with pytest.raises(GraphValidationError, match=f"backend '{name}' is not available: .*{name}"):
        make_backends([name])


def test_one_registry_every_name_is_made_or_names_what_is_missing():
    assert available_backends() == sorted(backends_module._REGISTRY)
    assert available_backends() == ["cpu", "numba", "numba-f32", "numba-q8", "numpy-blas"]
    for name in available_backends():
        try:
            made = make_backends([name])
        except GraphValidationError as e:
            assert str(e).startswith(f"backend {name!r} is not available: "), e
        else:
            assert isinstance(made[0], Backend) and made[0].name == name and made[-1].name == "cpu"


def test_fusion_takes_its_chain_from_candidate_backends(monkeypatch):
    """backend_acceptor asks the function assign_backends uses: with no candidates, nothing fuses."""
    graph, _ = llama()
    accepts = backend_acceptor(make_backends(["numpy-blas"]))
    assert fuse_graph(graph, accepts) == fuse_graph(graph)
    asked = []
    monkeypatch.setattr(fusion_module, "candidate_backends", lambda node, backends: asked.append(node) or [])
    fused = fuse_graph(graph, accepts)
    assert asked and not any(isinstance(n.op, (FusedSkipNorm, FusedNormMatmul, FusedSwiGlu)) for n in fused.nodes)
