"""The numba backend (dist_runtime/backends/numba.py): what it takes, and that every kernel agrees
with the CPU library (itself proven against ONNX, transformers and closed-form references) on the
shapes a model gives it, its edge cases included, and falls back to the CPU library's kernel --
same result, same error -- off its fast path.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dist_runtime.backends import default_backends, make_backends
from dist_runtime.backends.cpu import CpuBackend
from dist_runtime.backends.numba import NumbaBackend
from dist_runtime.dtypes import DType
from dist_runtime.kernels._common import KernelError
from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
from dist_runtime.batched_pass import Segment
from dist_runtime.executor import GraphExecutor
from dist_runtime.importers.hf.llama import DecoderConfig, decoder_graph, random_weights
from dist_runtime.ir import (FusedNormMatmul, FusedSkipNorm, FusedSwiGlu, Graph, Matmul, Node, RmsNorm, Rope,
                             Sdpa, SdpaWindow, TensorSpec)
from dist_runtime.ir.hints import BackendHint
from dist_runtime.kernels.registry import KernelContext

RNG = np.random.default_rng(11)
NUMBA, CPU = NumbaBackend(), CpuBackend()


def spec(*shape, dtype=DType.F32) -> TensorSpec:
    return TensorSpec(shape, dtype)


def f32(*shape, scale=1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def both(op, *inputs):
    """The op's outputs from the numba backend and from the CPU library."""
    node = Node(0, op, [f"in{i}" for i in range(len(inputs))], [f"out{i}" for i in range(2)])
    ctx = KernelContext()
    return NUMBA.bind(node)(list(inputs), ctx), CPU.bind(node)(list(inputs), ctx)


def assert_agree(got, want, rtol=2e-6) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == np.float32 and g.shape == w.shape
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


# -- what it takes -------------------------------------------------------------------------------
@pytest.mark.parametrize("op, specs, ok", [
    (RmsNorm(eps=1e-6), [spec(-1, 8), spec(8)], True),
    (RmsNorm(), [spec(2, -1, 8), spec(8)], True),
    (RmsNorm(), [spec(-1, 8, dtype=DType.F16), spec(8, dtype=DType.F16)], False),
    (FusedSkipNorm(), [spec(-1, 8), spec(-1, 8), spec(8)], True),
    (Rope(head_dim=8, rope_dim=8), [spec(-1, 16), spec(1)], True),
    (Rope(head_dim=8, rope_dim=8), [spec(2, -1, 16), spec(1)], False),  # batched: CPU's
    (Sdpa(num_heads=2, kv_heads=1, head_dim=8, causal=True), [spec(-1, 16), spec(-1, 8), spec(-1, 8)], True),
    (Sdpa(num_heads=2, kv_heads=1, head_dim=8), [spec(-1, 16), spec(-1, 8), spec(-1, 8), spec(-1, -1)], False),
    (Sdpa(num_heads=2, kv_heads=1, head_dim=8), [spec(1, -1, 16), spec(1, -1, 8), spec(1, -1, 8)], False),
    (SdpaWindow(num_heads=2, kv_heads=1, head_dim=8, window=4), [spec(-1, 16), spec(-1, 8), spec(-1, 8)], True),
    (SdpaWindow(num_heads=2, kv_heads=1, head_dim=8, window=0), [spec(-1, 16), spec(-1, 8), spec(-1, 8)], False),
    (Matmul(), [spec(-1, 8), spec(4, 8)], True),
    (Matmul(), [spec(-1, 8), spec(4, 8, dtype=DType.F16)], True),  # any stored type: compiled products
    (Matmul(), [spec(-1, 32), spec(4, 32, dtype=DType.Q8_0)], True),
    (Matmul(), [spec(-1, 256), spec(4, 256, dtype=DType.Q4_K)], True),
    (Matmul(), [spec(-1, 32, dtype=DType.F16), spec(4, 32, dtype=DType.Q8_0)], False),  # f16 activations
    (Matmul(), [spec(-1, 256), spec(4, 256, dtype=DType.Q2_K)], False),  # no compiled Q2_K product
    (FusedSwiGlu(), [spec(-1, 8), spec(6, 8), spec(6, 8)], True),
    (FusedNormMatmul(), [spec(-1, 8), spec(8), spec(4, 8)], True),
])
def test_supports(op, specs, ok):
    assert NUMBA.supports(op, specs) is ok


def test_default_backends_put_numba_first_and_cpu_last():
    assert default_backends() == ["numba"]
    assert [b.name for b in make_backends(None)] == ["numba", "cpu"]
    assert [b.name for b in make_backends([])] == ["cpu"]  # an explicit list is taken as given


# -- each kernel against the CPU library -----------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 768), (7, 32), (2, 3, 16), (5, 1), (4, 4096)])
def test_rms_norm(shape):
    x, w = f32(*shape, scale=3.0), f32(shape[-1])
    assert_agree(*both(RmsNorm(eps=1e-5), x, w))


def test_rms_norm_propagates_nan_and_inf_as_numpy():
    x, w = f32(3, 8), f32(8)
    x[0, 2], x[1, 5] = np.nan, np.inf
    with np.errstate(invalid="ignore"):
        got, want = both(RmsNorm(eps=1e-6), x, w)
    np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want[0]))
    np.testing.assert_allclose(got[0][2], want[0][2], rtol=2e-6)


@pytest.mark.parametrize("shape", [(1, 768), (9, 32), (2, 3, 16)])
def test_fused_skip_norm(shape):
    x, r, w = f32(*shape), f32(*shape), f32(shape[-1])
    assert_agree(*both(FusedSkipNorm(eps=1e-6), x, r, w))


@pytest.mark.parametrize("rows, heads, head_dim, rope_dim, start", [
    (1, 12, 64, 64, 0), (1, 4, 64, 64, 1000), (16, 3, 32, 32, 5),
    (5, 2, 64, 32, 7),  # partial rotary (Phi): the rest of each head passes through
    (3, 2, 16, 0, 2),   # no rotary dims at all
])
def test_rope(rows, heads, head_dim, rope_dim, start):
    x = f32(rows, heads * head_dim)
    op = Rope(head_dim=head_dim, rope_dim=rope_dim, base=10000.0)
    assert_agree(*both(op, x, np.array([start], np.float32)), rtol=1e-5)


def test_rope_bad_position_is_the_cpu_librarys_error():
    x = f32(1, 16)
    for pos in (np.array([-1.0], np.float32), np.array([1.5], np.float32), np.zeros(2, np.float32)):
        with pytest.raises(KernelError, match="Rope") as ours:
            both(Rope(head_dim=8, rope_dim=8), x, pos)
        with pytest.raises(KernelError) as ref:
            CPU.bind(Node(0, Rope(head_dim=8, rope_dim=8), ["a", "b"], ["c"]))([x, pos], KernelContext())
        assert str(ours.value) == str(ref.value)


def attention_inputs(tq, tk, heads, kv_heads, head_dim, scale=1.0):
    return f32(tq, heads * head_dim, scale=scale), f32(tk, kv_heads * head_dim), f32(tk, kv_heads * head_dim)


@pytest.mark.parametrize("tq, tk, heads, kv_heads, head_dim, causal", [
    (1, 1, 12, 4, 64, True),      # the first decode step
    (1, 37, 12, 4, 64, True),     # grouped-query decode, keys not a multiple of 4
    (1, 1024, 4, 1, 64, True),    # multi-query, a long context
    (7, 7, 4, 2, 16, True),       # a short prefill
    (3, 10, 4, 4, 8, True),       # end-aligned: 3 new rows after 7 cached ones
    (5, 9, 6, 3, 32, False),      # encoder-style, no causal mask
    (16, 64, 2, 1, 8, True),      # the size limit exactly
    (1, 300, 8, 2, 128, True),    # head_dim 128 (most 7B models), threaded over kv heads
    (2, 45, 4, 2, 80, True),      # head_dim 80
    (3, 11, 4, 2, 12, True),      # a head size without compiled cores: numba's loops
])
def test_sdpa(tq, tk, heads, kv_heads, head_dim, causal):
    op = Sdpa(num_heads=heads, kv_heads=kv_heads, head_dim=head_dim, causal=causal)
    assert_agree(*both(op, *attention_inputs(tq, tk, heads, kv_heads, head_dim)), rtol=1e-5)


def test_sdpa_large_scores_are_stable():
    """Scores in the hundreds: the max is subtracted before exp, as in the CPU library."""
    op = Sdpa(num_heads=2, kv_heads=1, head_dim=16, causal=True)
    assert_agree(*both(op, *attention_inputs(1, 50, 2, 1, 16, scale=60.0)), rtol=1e-5)


@pytest.mark.parametrize("tq, tk, heads, kv_heads, head_dim, window", [
    (6, 40, 12, 4, 64, 0), (5, 9, 4, 2, 12, 0), (16, 64, 2, 1, 8, 0),
    (3, 600, 12, 4, 64, 0),      # rows of 2 and 3 pieces
    (11, 1030, 6, 3, 128, 0),    # groups of rows (GROUP_ROWS) whose pieces end, and some begin, apart
    (9, 700, 4, 2, 64, 300),     # a window: each row's keys begin elsewhere
])
def test_sdpa_rows_are_batch_invariant(tq, tk, heads, kv_heads, head_dim, window):
    """Each query row is bitwise what it gives alone over the keys it sees (a batched step mixes
    rows whose results must not depend on one another; a prompt's rows attend in groups)."""
    op = (SdpaWindow(num_heads=heads, kv_heads=kv_heads, head_dim=head_dim, window=window, causal=True) if window
          else Sdpa(num_heads=heads, kv_heads=kv_heads, head_dim=head_dim, causal=True))
    q, k, v = attention_inputs(tq, tk, heads, kv_heads, head_dim)
    rows, _ = both(op, q, k, v)
    for r in range(tq):
        at = r + tk - tq
        alone, _ = both(op, q[r:r + 1], k[:at + 1], v[:at + 1])
        np.testing.assert_array_equal(rows[0][r], alone[0][0])


@pytest.mark.parametrize("tq, tk, heads, kv_heads, head_dim", [(1, 700, 12, 4, 64), (5, 260, 12, 4, 64),
                                                            (1, 333, 6, 3, 128), (2, 9, 4, 2, 8)])
def test_compiled_attention_gives_the_same_bits_on_any_threads(monkeypatch, tq, tk, heads, kv_heads, head_dim):
    """Serial or threaded over the pieces of the rows' keys, on 1 or 2 threads: the pieces are
    the keys', never the threads', so every run gives the same bits -- and agrees with the CPU
    library (scores in blocks of 8 keys, a tail of tk mod 8; 700 keys: three pieces merged)."""
    import numba

    from dist_runtime.backends.compiled import attention as compiled_attention
    from dist_runtime.kernels.attention import sdpa

    q, k, v = attention_inputs(tq, tk, heads, kv_heads, head_dim)
    runs = []
    for serial_bytes, threads in ((1 << 40, 1), (0, 2), (0, 1), (1 << 40, 2)):
        monkeypatch.setattr(compiled_attention, "SERIAL_KV_BYTES", serial_bytes)
        before = numba.get_num_threads()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            out = np.empty_like(q)
            compiled_attention.attention_rows(q, k, v, heads, kv_heads, head_dim, True, 0, out)
        finally:
            numba.set_num_threads(before)
        runs.append(out)
    for out in runs[1:]:
        np.testing.assert_array_equal(out, runs[0])
    want = sdpa(q, k, v, num_heads=heads, kv_heads=kv_heads, head_dim=head_dim, causal=True)
    np.testing.assert_allclose(runs[0], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_compiled_attention_propagates_nan_and_inf():
    """A NaN key poisons the heads that see it; an infinite query score makes its softmax NaN, as
    in the CPU library."""
    q, k, v = attention_inputs(1, 40, 4, 2, 16)
    k = k.copy()
    k[17, :16] = np.nan  # kv head 0 only
    got, want = both(Sdpa(num_heads=4, kv_heads=2, head_dim=16, causal=True), q, k, v)
    assert np.isnan(got[0][0, :32]).all() and not np.isnan(got[0][0, 32:]).any()
    np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want[0]))


def test_compiled_attention_nan_in_one_piece_poisons_its_heads_whole_row():
    """A NaN key in one piece of a long row makes its heads' whole output NaN through the merge,
    and leaves the other kv head's heads untouched."""
    from dist_runtime.backends.compiled.attention import SPLIT_KEYS

    tk = 3 * SPLIT_KEYS - 50
    q, k, v = attention_inputs(1, tk, 4, 2, 16)
    k = k.copy()
    k[SPLIT_KEYS + 7, 16:] = np.nan  # kv head 1, second piece
    got, _ = both(Sdpa(num_heads=4, kv_heads=2, head_dim=16, causal=True), q, k, v)
    assert np.isnan(got[0][0, 32:]).all() and not np.isnan(got[0][0, :32]).any()


def test_attention_merge_of_pieces():
    """The merge of a row's pieces: a lone piece comes out with its own bits (its share is exactly
    1), several give the softmax over all their keys (closed form in float64)."""
    from dist_runtime.backends.compiled.attention import _merge

    rng = np.random.default_rng(5)
    heads, hd = 3, 8
    starts = np.array([0, 1, 4], np.int64)  # row 0: one piece; row 1: three
    sums = rng.standard_normal((4, heads * hd)).astype(np.float32)
    stats = np.stack([rng.normal(0, 3, (4, heads)), rng.uniform(1, 50, (4, heads))], axis=1).astype(np.float32)
    out = np.empty((2, heads * hd), np.float32)
    _merge(starts, sums, stats, heads, hd, out)
    np.testing.assert_array_equal(out[0], sums[0])
    m, total = stats[1:, 0].astype(np.float64), stats[1:, 1].astype(np.float64)
    w = total * np.exp(m - m.max(axis=0))  # [pieces, heads]
    want = np.einsum("ph,phd->hd", w / w.sum(axis=0), sums[1:].reshape(3, heads, hd).astype(np.float64))
    np.testing.assert_allclose(out[1], want.reshape(-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tq, tk, window, causal", [
    (1, 900, 300, True), (2, 700, 600, False),  # pieces cut from each row's first key, not key 0
    (1, 40, 8, True), (4, 12, 3, True), (5, 9, 2, False), (1, 6, 100, True), (6, 6, 1, True)])
def test_sdpa_window(tq, tk, window, causal):
    op = SdpaWindow(num_heads=4, kv_heads=2, head_dim=16, window=window, causal=causal)
    assert_agree(*both(op, *attention_inputs(tq, tk, 4, 2, 16)), rtol=1e-5)


def test_large_attention_without_vector_cores_stays_compiled_and_agrees():
    """A prefill with a head size the vector cores lack runs in numba's loops (every attention is
    compiled: a row's result must not depend on how many rows share the call), and agrees with
    the CPU library."""
    tq, tk = 64, 64
    got, want = both(Sdpa(num_heads=2, kv_heads=1, head_dim=12, causal=True), *attention_inputs(tq, tk, 2, 1, 12))
    assert_agree(got, want, rtol=1e-5)


def test_a_large_prefill_runs_on_the_vector_cores():
    op = Sdpa(num_heads=4, kv_heads=2, head_dim=32, causal=True)
    assert_agree(*both(op, *attention_inputs(300, 300, 4, 2, 32)), rtol=1e-5)


@pytest.mark.parametrize("case", ["causal_more_queries_than_keys", "no_keys", "v_rows", "width"])
def test_attention_off_the_fast_path_gives_the_cpu_librarys_answer(case):
    op = Sdpa(num_heads=2, kv_heads=1, head_dim=8, causal=True)
    q, k, v = attention_inputs(3, 5, 2, 1, 8)
    if case == "causal_more_queries_than_keys":
        k, v = k[:2], v[:2]
    elif case == "no_keys":
        op = Sdpa(num_heads=2, kv_heads=1, head_dim=8, causal=False)
        k, v = k[:0], v[:0]
    elif case == "v_rows":
        v = v[:4]
    else:
        q = q[:, :8]
    node = Node(0, op, ["q", "k", "v"], ["o"])
    try:
        want = CPU.bind(node)([q, k, v], KernelContext())
    except KernelError as e:
        with pytest.raises(KernelError) as ours:
            NUMBA.bind(node)([q, k, v], KernelContext())
        assert str(ours.value) == str(e)
    else:
        np.testing.assert_array_equal(NUMBA.bind(node)([q, k, v], KernelContext())[0], want[0])


@pytest.mark.parametrize("rows", [1, 6])
def test_fused_swiglu_and_norm_matmul(rows):
    x = f32(rows, 48)
    assert_agree(*both(FusedSwiGlu(), x, f32(96, 48, scale=0.2), f32(96, 48, scale=0.2)), rtol=1e-5)
    assert_agree(*both(FusedNormMatmul(eps=1e-5), x, f32(48), f32(80, 48, scale=0.2)), rtol=1e-5)


def test_non_contiguous_and_read_only_inputs():
    """A KV cache hands out read-only views; a transposed activation is not contiguous."""
    q, k, v = attention_inputs(1, 20, 4, 2, 16)
    k.flags.writeable = v.flags.writeable = False
    assert_agree(*both(Sdpa(num_heads=4, kv_heads=2, head_dim=16, causal=True), q, k, v), rtol=1e-5)
    x = f32(32, 6).T  # [6, 32], Fortran order
    assert_agree(*both(RmsNorm(eps=1e-6), x, f32(32)))


# -- whole models: the default executor (numba) against the CPU library alone ------------------------
@pytest.mark.parametrize("cfg", [
    LlamaConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64),
    LlamaConfig(vocab=50, hidden=48, layers=1, heads=6, kv_heads=1, ffn=40),
])
@pytest.mark.parametrize("fuse", [True, False])
def test_llama_decode_matches_the_cpu_library(cfg, fuse):
    weights = llama_weights(cfg, seed=4)
    g = llama_graph(cfg)
    specs = {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in weights.items()}
    graph = Graph(g.nodes, g.inputs, g.outputs, specs)
    ours, ref = GraphExecutor((graph, weights), fuse=fuse), GraphExecutor((graph, weights), ["cpu"], fuse=fuse)
    assert {p["op"] for p in ours.plan() if p["backend"] == "numba"} >= {"Rope", "Sdpa", "Matmul"}
    prompt = np.array([3, 17, 42, 5, 9, 8, 11, 2, 30], np.int32)
    for tokens in [prompt, *([t] for t in (4, 9, 1, 33, 7))]:
        got = ours.run({"tokens": np.asarray(tokens, np.int32)})["logits"]
        want = ref.run({"tokens": np.asarray(tokens, np.int32)})["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


# -- hint 4 (BackendHint.NUMBA) asks for this backend --------------------------------------------------
def hinted_llama(hints: dict[str, BackendHint]) -> tuple[Graph, dict]:
    cfg = LlamaConfig(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64)
    g, weights = llama_graph(cfg), llama_weights(cfg)
    specs = {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in weights.items()}
    nodes = [replace(n, backend_hint=hints.get(n.op_name)) for n in g.nodes]
    return Graph(nodes, g.inputs, g.outputs, specs), weights


def plan_of(model: tuple[Graph, dict], backends) -> dict[str, set[tuple[str, str]]]:
    out: dict[str, set] = {}
    for p in GraphExecutor(model, backends, fuse=False).plan():
        out.setdefault(p["op"], set()).add((p["backend"], p["reason"]))
    return out


def test_a_node_hinted_numba_runs_on_numba():
    assert NUMBA.hint == BackendHint.NUMBA
    model = hinted_llama({"Rope": BackendHint.NUMBA, "RmsNorm": BackendHint.CPU})
    plan = plan_of(model, None)  # numba is the default, yet the hint is what chose it
    assert plan["Rope"] == {("numba", "hint numba")}
    assert plan["RmsNorm"] == {("cpu", "hint cpu")}
    plan = plan_of(model, ["numpy-blas", "numba"])  # numba in use but not the default
    assert plan["Rope"] == {("numba", "hint numba")}
    assert plan["Sdpa"] == {("cpu", "default numpy-blas does not support it; fallback to cpu")}
    plan = plan_of(model, ["numpy-blas"])
    assert plan["Rope"] == {("cpu", "hint numba not in use; default numpy-blas does not support it; fallback to cpu")}


def test_products_reading_one_x_share_a_launch(monkeypatch):
    """A layer's q, k and v (Matmuls reading one x) run in one launch (the executor's shared
    launches, NumbaBackend.bind_siblings): the same bits as three launches, in a run and in a
    batched pass (rows enough to be threaded), and every node still observed with its own output."""
    import dist_runtime.executor as executor_module
    from dist_runtime.batched_pass import Segment

    cfg = LlamaConfig(vocab=64, hidden=256, layers=2, heads=4, kv_heads=2, ffn=128)
    weights = llama_weights(cfg, seed=5)
    g = llama_graph(cfg)
    specs = {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in weights.items()}
    graph = Graph(g.nodes, g.inputs, g.outputs, specs)
    shared = GraphExecutor((graph, weights))
    monkeypatch.setattr(executor_module, "_shared_launches", lambda steps, *args: steps)
    separate = GraphExecutor((graph, weights))
    def products_passed_on(ex):  # (the executor's chains pass on a layer's attention too)
        return [ex.graph.nodes[s.index].outputs for s in ex._steps
                if s.fn is executor_module._pass_on and isinstance(ex.graph.nodes[s.index].op, Matmul)]

    assert len(products_passed_on(shared)) == 2 * cfg.layers  # k and v of every layer
    assert not products_passed_on(separate)
    launches = [p["launch"] for p in shared.plan() if p["launch"] and p["op"] == "Matmul"]
    assert len(launches) == 3 * cfg.layers and sum(t.startswith("launched with node(s) ") for t in launches) == cfg.layers
    assert not any(p["launch"] for p in separate.plan() if p["op"] == "Matmul")
    seen = []

    def observe(node, outs, live):
        seen.append(len(outs) == len(node.outputs))
        assert not any(name.endswith("@shared") for name in node.outputs)

    for tokens in ([3, 17, 42, 5, 9, 8, 11, 2, 30], [4], [9]):
        ids = np.asarray(tokens, np.int32)
        got = shared.run({"tokens": ids}, observe=observe)["logits"]
        assert np.array_equal(got.view(np.uint32), separate.run({"tokens": ids})["logits"].view(np.uint32))
    assert seen and all(seen)
    ids = np.array([7, 1, 2, 3, 60, 61, 5], np.int32)
    segments = [Segment("a", 3), Segment("b", 4)]
    got, want = (ex.run_batch({"tokens": ids}, segments)["logits"] for ex in (shared, separate))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _chained_and_not(monkeypatch, cfg: DecoderConfig, seed: int = 3):
    """Executors of ``cfg``'s decoder, batch-invariant: with the executor's chains, and without
    (neither with the compiled program, which runs the chains' compiled code itself:
    tests/test_program.py)."""
    import dist_runtime.executor as executor_module

    weights = random_weights(cfg, seed)
    g = decoder_graph(cfg)
    specs = {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in weights.items()}
    graph = Graph(g.nodes, g.inputs, g.outputs, specs)
    chained = GraphExecutor((graph, weights), compiled_program=False)
    with monkeypatch.context() as m:
        m.setattr(executor_module, "_chains", lambda steps, *args: steps)
        alone = GraphExecutor((graph, weights), compiled_program=False)
    return chained, alone


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("cfg", [
    DecoderConfig(vocab=64, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=128),  # the vector cores
    DecoderConfig(vocab=64, hidden=96, layers=2, heads=4, kv_heads=1, head_dim=24, ffn=64, rope_dim=12,
                  qkv_bias=True, windows=(0, 5)),  # partial rotation, biases, a sliding window
    DecoderConfig(vocab=64, hidden=40, layers=1, heads=4, kv_heads=2, head_dim=10, ffn=32),  # no vector cores
], ids=["head64", "partial-window", "head10"])
def test_a_layers_attention_chain_gives_the_nodes_bits(monkeypatch, cfg):
    """Rope of q, Rope of k, KvCache and Sdpa of a layer run as one call (the executor's chains,
    NumbaBackend.bind_chain): the same bits as the four nodes alone, in runs that grow the KV
    cache, rewind it (a retried step), after a reset, and in batched passes of several sessions;
    every node still observed with its own outputs; the plan names the group."""
    import dist_runtime.executor as executor_module

    chained, alone = _chained_and_not(monkeypatch, cfg)
    def followers(ex):
        return [ex.graph.nodes[s.index].op_name for s in ex._steps if s.fn is executor_module._pass_on]

    passed_on = followers(chained)
    assert passed_on.count("Rope") == passed_on.count("KvCache") == cfg.layers
    assert sum(op in ("Sdpa", "SdpaWindow") for op in passed_on) == cfg.layers
    assert set(followers(alone)) <= {"Matmul"}  # only the shared launches of q, k and v
    plan = chained.plan()
    leads = [p for p in plan if p["op"] == "Rope" and p["launch"].startswith("launched with node(s) ")]
    assert len(leads) == cfg.layers
    assert all(p["launch"].endswith(", on numba") for p in plan if p["op"] == "KvCache")  # a CPU-library node
    seen = []

    def observe(node, outs, live):
        seen.append((node.id, [o.shape for o in outs]))

    for tokens, pos in (([3, 17, 42, 5, 9, 8, 11, 2, 30], None), ([4], None), ([9], None), (list(range(21)), None),
                        ([7], 30), ([7], 30), ([1], None)):
        ids = np.asarray(tokens, np.int32)
        seen.clear()
        got = chained.run({"tokens": ids}, pos=pos, observe=observe)["logits"]
        chained_seen, seen[:] = seen[:], []
        assert _same_bits(got, alone.run({"tokens": ids}, pos=pos, observe=observe)["logits"])
        assert chained_seen == seen
    chained.reset()
    alone.reset()
    taken = []  # per chain call in a batched pass: did every segment go in one call?
    for step in chained._steps:
        if hasattr(step.fn, "over_segments"):
            def spy(*args, over=step.fn.over_segments):
                taken.append(over(*args))
                return taken[-1]
            step.fn.over_segments = spy
    ids = np.array([7, 1, 2, 3, 60, 61, 5, 9], np.int32)
    for segments in ([Segment("a", 3), Segment("b", 5)], [Segment("a", 1), Segment("b", 1), Segment("c", 6)],
                     [Segment("b", 1), Segment("a", 1)]):
        rows = sum(seg.rows for seg in segments)
        got, want = (ex.run_batch({"tokens": ids[:rows]}, segments)["logits"] for ex in (chained, alone))
        assert _same_bits(got, want)
    vector_cores = cfg.head_dim in (64, 24)  # else the four kernels, a segment at a time
    assert len(taken) == 3 * cfg.layers and all((t is not None) == vector_cores for t in taken)


def test_an_error_inside_the_attention_chain_names_its_own_node(monkeypatch):
    """A write the KV cache refuses (a position past the rows it holds) or a bad position fails as
    the node that refuses it, with the same message as without the chain."""
    from dist_runtime.errors import DistRuntimeError

    cfg = DecoderConfig(vocab=64, hidden=256, layers=1, heads=4, kv_heads=2, head_dim=64, ffn=128)
    chained, alone = _chained_and_not(monkeypatch, cfg)
    for pos, node in ((5, "KvCache"), (-1, "Rope")):
        errors = []
        for ex in (chained, alone):
            ex.reset()
            with pytest.raises(DistRuntimeError) as info:
                ex.run({"tokens": np.array([1], np.int32)}, pos=pos)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1] and f"({node})" in errors[0][1]
    errors = []  # in a batched pass: one segment's write refused, the other's fine
    for ex in (chained, alone):
        ex.reset()
        ex.run({"tokens": np.array([1, 2], np.int32)}, session="a")
        before = ex.position("a")
        with pytest.raises(DistRuntimeError) as info:
            ex.run_batch({"tokens": np.array([3, 4], np.int32)}, [Segment("a", 1), Segment("b", 1, pos=7)])
        node, _, why = str(info.value).partition(" reading ")  # (the chain names the segment's rows it read)
        errors.append((type(info.value), node, why.partition(": ")[2], before))
    assert errors[0] == errors[1] and errors[0][1].endswith("(KvCache)")
