"""KV caches kept as Q8_0 (``--kv-dtype q8_0``): GGML's blocks of 32 (an f16 scale, 32 int8 codes),
17/32 of F16's memory; rows quantized as numpy's ``quantize`` does whoever writes them, the same
bits for a session alone or batched, program or steps, chunked prefill or at once; logits close
to an F32 cache's; plans sized for them; widths that are not a multiple of 32 refused."""

from __future__ import annotations

import numpy as np
import pytest

from dist_runtime.dtypes import DType
from dist_runtime.errors import KernelError
from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.kernels.attention import KvState, KvStates, sdpa
from dist_runtime.kernels.quant import dequantize, quantize
from dist_runtime.ir.ops import KvCache
from dist_runtime.partitioner.graph_costs import graph_costs
from dist_runtime.tensor import QuantizedArray

CFG = LlamaConfig(vocab=96, hidden=128, layers=2, heads=4, kv_heads=2, ffn=160)  # head_dim 32
#: head_dim 64 (the 125M model's), grouped-query attention.
CFG64 = LlamaConfig(vocab=96, hidden=256, layers=2, heads=4, kv_heads=2, ffn=320)


def _save(tmp_path_factory, cfg, name):
    from dist_runtime.model import save_model

    path = tmp_path_factory.mktemp("kvq8") / name
    save_model(path, llama_graph(cfg), llama_weights(cfg, seed=5), llama_metadata(cfg)).close()
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _save(tmp_path_factory, CFG, "m.model")


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    return _save(tmp_path_factory, CFG64, "m64.model")


def _rows(rng, t, width=64):
    return (rng.standard_normal((t, width)) * rng.uniform(0, 8, (t, 1))).astype(np.float32)


def test_a_q8_0_cache_keeps_rows_as_numpy_quantizes_them():
    rng = np.random.default_rng(0)
    state = KvState(0, DType.Q8_0)
    k, v = _rows(rng, 5), _rows(rng, 5)
    k[0, :32] = 0.0  # d = 0: codes 0
    k[1, 3] = 1e7  # a scale (1e7 / 127) past f16's largest: inf, as GGML stores it
    k_all, v_all = state.write(0, k, v)
    assert isinstance(k_all, QuantizedArray) and k_all.dtype == v_all.dtype == DType.Q8_0
    assert k_all.shape == (5, 64) and k_all.data.shape == (5, 68) and not k_all.data.flags.writeable
    with np.errstate(over="ignore"):
        assert np.array_equal(k_all.data, quantize(k, DType.Q8_0).data)
    assert np.isinf(k_all.data[1, :2].view(np.float16)[0]) and not k_all.data[0, :34].any()
    assert np.array_equal(v_all.data, quantize(v, DType.Q8_0).data)
    again_k, _ = state.write(3, k[3:], v[3:])  # a replayed step: the same rows, the same bytes
    assert np.array_equal(again_k.data, k_all.data)
    assert state.nbytes()[0] == 2 * 5 * 68
    assert state.room(3, 2, 64) is None and state.room(3, 2, 64, DType.F16) is None  # not F32 / F16 rows
    k_at, v_at, rows = state.room(3, 2, 64, DType.Q8_0)  # the compiled program of Q8_0 caches writes here
    assert (k_at, v_at, rows) == (*state.addresses(), state.allocated)
    assert KvState.held_in(KvStates(DType.Q8_0), 1, KvCache(max_seq=8)).dtype == DType.Q8_0


def test_a_q8_0_cache_refuses_rows_that_are_not_whole_blocks():
    state = KvState(0, DType.Q8_0)
    rows = np.zeros((2, 48), np.float32)
    with pytest.raises(KernelError, match=r"KvCache: .*Q8_0.* rows of width 48 .*not a multiple of 32"):
        state.write(0, rows, rows)
    assert state.length == 0 and state.allocated == 0  # refused before anything changed


def test_the_cpu_library_attends_over_q8_0_views_as_over_their_decoding():
    rng = np.random.default_rng(1)
    state = KvState(0, DType.Q8_0)
    k, v = state.write(0, _rows(rng, 9), _rows(rng, 9))
    q = rng.standard_normal((3, 128)).astype(np.float32)
    got = sdpa(q, k, v, num_heads=4, kv_heads=2, head_dim=32, causal=True)
    want = sdpa(q, dequantize(k), dequantize(v), num_heads=4, kv_heads=2, head_dim=32, causal=True)
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_compiled_code_quantizes_rows_as_numpy_does():
    """:func:`kv_q8.q8_row` against ``quantize``: random rows of every scale, zeros, ties
    (x / d exactly k + 1/2), subnormal scales, scales past f16's range."""
    from dist_runtime.backends.compiled.kv_q8 import q8_rows

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((4000, 96)) * np.exp(rng.uniform(-30, 12, (4000, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :31] = np.arange(31, dtype=np.float32) + np.float32(0.5)  # d = 1 (max 127): x / d ties, away from 0
    x[1, 31] = 127.0
    x[2] = -x[1]
    x[3] *= np.float32(1e-38)  # subnormal f32 rows and an f16 scale of 0
    x[4] = rng.standard_normal(96).astype(np.float32) * np.float32(1e8)  # scales past f16's largest
    out = np.zeros((x.shape[0], 96 // 32 * 34), np.uint8)
    q8_rows(x, out, 0)
    with np.errstate(all="ignore"):
        assert np.array_equal(out, quantize(x, DType.Q8_0).data)


@pytest.mark.parametrize("head_dim, kv_heads", [(64, 2), (128, 2), (48, 2), (20, 8)])
@pytest.mark.parametrize("rows, keys", [(1, 40), (1, 3000), (7, 300)])  # a decode step, a long one, a chunk
def test_compiled_attention_reads_q8_0_rows_as_their_decoding(head_dim, kv_heads, rows, keys):
    """The compiled cores read Q8_0 blocks in place (code x d is exact in f32): the bits of the
    same rows decoded to F32, on one thread and over the threads; heads of 48 values straddle
    blocks; a head size without cores (20) decodes them first."""
    from dist_runtime.backends.compiled import attention

    rng = np.random.default_rng(head_dim + rows)
    heads = 2 * kv_heads
    q = rng.standard_normal((rows, heads * head_dim)).astype(np.float32)
    k, v = (quantize(_rows(rng, keys, kv_heads * head_dim), DType.Q8_0) for _ in range(2))
    for a in (k, v):
        a.data.flags.writeable = False  # as a KV cache hands them out
    got, want = np.empty_like(q), np.empty_like(q)
    attention.attention_rows(q, k, v, heads, kv_heads, head_dim, True, 0, got)
    attention.attention_rows(q, dequantize(k), dequantize(v), heads, kv_heads, head_dim, True, 0, want)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_an_unknown_kv_dtype_names_the_choices_q8_0_among_them(model):
    with pytest.raises(ValueError, match=r"--kv-dtype 'q4' is not one of f16, f32, q8_0"):
        GraphExecutor(model, kv_dtype="q4")
    assert GraphExecutor(model, kv_dtype="q8_0").kv_dtype == DType.Q8_0


@pytest.mark.parametrize("which", ["model", "model64"])
def test_the_program_the_chain_and_the_steps_give_the_same_bits_chunked_or_at_once(which, request, monkeypatch):
    """The compiled program (which runs: not left to the steps), the attention chain's compiled
    call and its nodes one by one (Python writes the rows, the compiled cores read them) write the
    same Q8_0 bytes and give the same logits, the prompt at once or in chunks."""
    import dist_runtime.backends.numba as numba_backend
    import dist_runtime.backends.program.vm as vm

    path = request.getfixturevalue(which)
    calls, real = [], vm.execute
    monkeypatch.setattr(vm, "execute", lambda *args: (calls.append(1), real(*args))[1])
    ids = np.random.default_rng(4).integers(0, CFG.vocab, 30).astype(np.int32)
    chunks = (ids[:9], ids[9:20], *ids[20:, None])

    def logits(executor):
        return [executor.run({"tokens": chunk})["logits"].view(np.uint32) for chunk in chunks]

    program = logits(GraphExecutor(path, kv_dtype="q8_0"))
    assert len(calls) == 12
    chain = logits(GraphExecutor(path, kv_dtype="q8_0", compiled_program=False))
    monkeypatch.setattr(numba_backend.AttentionChain, "_fits", lambda self, q, k, v: False)
    nodes = logits(GraphExecutor(path, kv_dtype="q8_0", compiled_program=False))
    monkeypatch.undo()
    for a, b, c in zip(program, chain, nodes):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    whole = GraphExecutor(path, kv_dtype="q8_0")
    at_once = whole.run({"tokens": ids[:20]})["logits"]
    chunked = GraphExecutor(path, kv_dtype="q8_0")
    parts = np.concatenate([chunked.run({"tokens": ids[:9]})["logits"], chunked.run({"tokens": ids[9:20]})["logits"]])
    assert np.array_equal(at_once.view(np.uint32), parts.view(np.uint32))
    mine = [s.kv for s in (whole.session(), chunked.session())]
    for key in mine[0]:  # the same bytes in the caches too
        a_state, b_state = mine[0][key], mine[1][key]
        assert a_state.length == b_state.length == 20
        assert np.array_equal(a_state._k.buf[:20], b_state._k.buf[:20])
        assert np.array_equal(a_state._v.buf[:20], b_state._v.buf[:20])


def test_a_long_context_s_pieces_over_the_threads_keep_the_bits(model, monkeypatch):
    """Past SERIAL_KV_BYTES the attention runs in pieces over the threads (the program's own
    stages; the chain's threaded driver after its call; the nodes' Sdpa): the same bits."""
    import numba

    import dist_runtime.backends.numba as numba_backend
    from dist_runtime.backends.compiled import attention

    if numba.get_num_threads() < 2:
        pytest.skip("one thread: attention is never cut into pieces")
    ids = np.random.default_rng(6).integers(0, CFG.vocab, 700).astype(np.int32)
    chunks = (ids[:600], ids[600:650], *ids[650:654, None])
    assert 654 * 2 * CFG.kv_heads * (CFG.hidden // CFG.heads) * 4 >= attention.SERIAL_KV_BYTES

    def logits(executor):
        return [executor.run({"tokens": chunk})["logits"].view(np.uint32) for chunk in chunks]

    program = logits(GraphExecutor(model, kv_dtype="q8_0"))
    chain = logits(GraphExecutor(model, kv_dtype="q8_0", compiled_program=False))
    monkeypatch.setattr(numba_backend.AttentionChain, "_fits", lambda self, q, k, v: False)
    nodes = logits(GraphExecutor(model, kv_dtype="q8_0", compiled_program=False))
    for a, b, c in zip(program, chain, nodes):
        assert np.array_equal(a, b) and np.array_equal(a, c)


def test_the_numba_backend_attends_over_q8_0_caches_compiled(model, monkeypatch):
    """Over Q8_0 caches the numba backend's attention runs the compiled cores, not the CPU library."""
    import dist_runtime.backends.numba as numba_backend

    reference = []
    real = numba_backend.NumbaBackend.reference
    monkeypatch.setattr(numba_backend.NumbaBackend, "reference", lambda self, node: (
        lambda inputs, ctx, _r=real(self, node), _n=node: (reference.append(_n.op_name), _r(inputs, ctx))[1]))
    for fuse in (True, False):
        ex = GraphExecutor(model, kv_dtype="q8_0", compiled_program=False, fuse=fuse)
        ex.run({"tokens": np.arange(1, 9, dtype=np.int32)})
        ex.run({"tokens": np.array([3], np.int32)})
    assert "Sdpa" not in reference and "KvCache" not in reference


@pytest.mark.parametrize("which", ["model", "model64"])
def test_q8_0_caches_stay_close_to_f32_ones(which, request):
    """Logits over a prompt and 24 decode steps within 3e-2 of the F32 cache's, relative to the
    largest logit (measured: 1.8e-2 with head_dim 32, 2.0e-2 with 64, 1.9e-2 with 128; F16 caches
    6-14e-4; the 125M-shaped model over a 256-token prompt 1.5e-2: docs/architecture.md)."""
    path = request.getfixturevalue(which)
    f32, q8 = GraphExecutor(path, kv_dtype="f32"), GraphExecutor(path, kv_dtype="q8_0")
    ids = np.random.default_rng(2).integers(0, CFG.vocab, 40).astype(np.int32)
    worst = 0.0
    for chunk in (ids[:16], *ids[16:, None]):
        a, b = (e.run({"tokens": chunk})["logits"] for e in (f32, q8))
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
    assert 0 < worst < 3e-2


def test_a_model_may_declare_q8_0_caches(tmp_path):
    from dist_runtime.model import save_model

    declared = tmp_path / "q8.model"
    metadata = {**llama_metadata(CFG), "kv_dtype": "q8_0"}
    save_model(declared, llama_graph(CFG), llama_weights(CFG, seed=5), metadata).close()
    assert GraphExecutor(declared).kv_dtype == DType.Q8_0
    assert GraphExecutor(declared, kv_dtype="f16").kv_dtype == DType.F16


@pytest.mark.parametrize("program", [True, False], ids=["program", "steps"])
def test_a_kv_width_not_a_multiple_of_32_is_refused_with_q8_0(tmp_path, program):
    """kv_heads x head_dim = 2 x 24 = 48: refused as the executor is made when it builds its
    program, else at the first write, before anything is kept; f16 caches take it."""
    from dist_runtime.model import save_model

    cfg = LlamaConfig(vocab=96, hidden=96, layers=1, heads=4, kv_heads=2, ffn=64)  # head_dim 24
    path = tmp_path / "narrow.model"
    save_model(path, llama_graph(cfg), llama_weights(cfg, seed=5), llama_metadata(cfg)).close()
    tokens = {"tokens": np.arange(1, 4, dtype=np.int32)}
    GraphExecutor(path, kv_dtype="f16", compiled_program=program).run(tokens)
    if program:
        with pytest.raises(KernelError, match=r"KvCache: node \d+'s rows are 48 values wide .*not a multiple of 32"):
            GraphExecutor(path, kv_dtype="q8_0")
        return
    executor = GraphExecutor(path, kv_dtype="q8_0", compiled_program=False)
    with pytest.raises(KernelError, match=r"rows of width 48 .*not a multiple of 32"):
        executor.run(tokens)
    assert all(state.length == 0 for state in executor.session().kv.values())


def test_plans_size_q8_0_caches_at_34_64ths_of_f16():
    from test_partitioner_graph import llama

    graph = llama()
    f16, q8 = (graph_costs(graph, max_context=512, sessions=3, kv_dtype=d) for d in ("f16", "q8_0"))
    assert q8.kv.sum() > 0 and np.array_equal(q8.kv * 64, f16.kv * 34)
    assert np.array_equal(q8.live, f16.live) and np.array_equal(q8.compute, f16.compute)


def test_generate_takes_q8_0(model, capsys):
    from dist_runtime.cli import main

    assert main(["generate", str(model), "--ids", "1,2,3", "-n", "4", "--kv-dtype", "q8_0", "--show-ids"]) == 0
    assert len(capsys.readouterr().out.split()) >= 4
