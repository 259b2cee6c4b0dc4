"""KV caches kept in F16 (the default; ``--kv-dtype``): half the memory, rows rounded to nearest even as numpy
rounds them, the same bits for a session alone or batched and on pipeline stages, logits close to
an F32 cache's, and plans sized for them."""

from __future__ import annotations

import numpy as np
import pytest

from dist_runtime.batched_pass import Segment
from dist_runtime.dtypes import DType
from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.kernels.attention import KvState, KvStates
from dist_runtime.ir.ops import KvCache
from dist_runtime.partitioner.graph_costs import graph_costs

from conftest import save_example

CFG = LlamaConfig(vocab=96, hidden=128, layers=2, heads=4, kv_heads=2, ffn=160)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_example(tmp_path_factory.mktemp("kv") / "m.model", CFG, seed=5)


def _rows(rng, t, width=16):
    return (rng.standard_normal((t, width)) * 3).astype(np.float32)


def test_an_f16_cache_keeps_rows_as_numpy_rounds_them():
    rng = np.random.default_rng(0)
    state = KvState(0, DType.F16)
    k, v = _rows(rng, 5), _rows(rng, 5)
    k[0, :3] = [65520.0, 1e-8, -0.0]  # past f16's largest (inf, as llama.cpp's), under its smallest, -0
    k_all, v_all = state.write(0, k, v)
    assert k_all.dtype == v_all.dtype == np.float16 and not k_all.flags.writeable
    with np.errstate(over="ignore"):
        assert np.array_equal(k_all.view(np.uint16), k.astype(np.float16).view(np.uint16))
    assert np.isinf(k_all[0, 0])
    assert np.array_equal(v_all.view(np.uint16), v.astype(np.float16).view(np.uint16))
    again_k, _ = state.write(3, k[3:], v[3:])  # a replayed step: the same rows, the same bits
    assert np.array_equal(again_k.view(np.uint16), k_all.view(np.uint16))
    assert state.room(3, 2, 16) is None  # not F32 rows
    k_at, v_at, rows = state.room(3, 2, 16, DType.F16)  # the compiled program of F16 caches writes here
    assert (k_at, rows) == (state.addresses()[0], state.allocated) and v_at == state.addresses()[1]
    with pytest.raises(ValueError, match="KV caches store"):
        KvState(0, DType.Q4_0)


def test_a_session_s_states_are_made_in_its_element_type():
    states = KvStates(DType.F16)
    assert KvState.held_in(states, 3, KvCache(max_seq=8)).dtype == DType.F16
    assert KvState.held_in({}, 3, KvCache(max_seq=8)).dtype is None


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("program", [True, False], ids=["program", "attention-chain"])
def test_kept_caches_give_a_session_the_same_bits_alone_or_batched(model, program, kv_dtype):
    rng = np.random.default_rng(1)
    batched, alone = (GraphExecutor(model, kv_dtype=kv_dtype, compiled_program=program) for _ in range(2))
    for round_ in range(4):  # prefills, then decode rows beside prompt chunks
        segments = [Segment(s, int(rng.integers(1, 7)) if round_ == 0 or s == 2 else 1) for s in range(4)]
        tokens = {seg.session: rng.integers(0, CFG.vocab, seg.rows).astype(np.int32) for seg in segments}
        out = batched.run_batch({"tokens": np.concatenate([tokens[s.session] for s in segments])}, segments)
        at = 0
        for seg in segments:
            want = alone.run({"tokens": tokens[seg.session]}, session=seg.session)["logits"]
            assert np.array_equal(out["logits"][at:at + seg.rows], want), (round_, seg)
            at += seg.rows


def test_f16_caches_stay_close_to_f32_ones(model):
    """Logits over a prompt and 24 decode steps within 2e-3 of the F32 cache's, relative to the
    largest logit (measured: ~5e-4 on the 125M model)."""
    f32, f16 = GraphExecutor(model, kv_dtype="f32"), GraphExecutor(model)  # f16: the default
    assert f16.kv_dtype == DType.F16 and f32.kv_dtype == DType.F32
    ids = np.random.default_rng(2).integers(0, CFG.vocab, 40).astype(np.int32)
    worst = 0.0
    for chunk in (ids[:16], *ids[16:, None]):
        a, b = (e.run({"tokens": chunk})["logits"] for e in (f32, f16))
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
    assert 0 < worst < 2e-3


def test_a_model_may_declare_its_kv_dtype_and_the_caller_overrides_it(model, tmp_path):
    from dist_runtime.model import save_model

    graph, weights = llama_graph(CFG), llama_weights(CFG, seed=5)
    declared = tmp_path / "f32.model"
    save_model(declared, graph, weights, {**llama_metadata(CFG), "kv_dtype": "f32"}).close()
    assert GraphExecutor(declared).kv_dtype == DType.F32
    assert GraphExecutor(declared, kv_dtype="f16").kv_dtype == DType.F16
    assert GraphExecutor(model).kv_dtype == DType.F16  # nothing declared: the default
    with pytest.raises(ValueError, match=r"metadata key 'kv_dtype' must be one of f16, f32, q8_0, got 'q4'"):
        save_model(tmp_path / "bad.model", graph, weights, {**llama_metadata(CFG), "kv_dtype": "q4"})


def test_plans_size_f16_caches_at_half():
    from test_partitioner_graph import llama

    graph = llama()
    f32, f16 = (graph_costs(graph, max_context=512, sessions=3, kv_dtype=d) for d in ("f32", "f16"))
    assert f32.kv.sum() > 0 and np.array_equal(f16.kv * 2, f32.kv)
    assert np.array_equal(f16.live, f32.live) and np.array_equal(f16.compute, f32.compute)


def test_generate_takes_kv_dtype_and_refuses_what_it_does_not_know(model, capsys):
    from dist_runtime.cli import main

    path = model
    assert main(["generate", str(path), "--ids", "1,2,3", "-n", "4", "--kv-dtype", "f16", "--show-ids"]) == 0
    assert len(capsys.readouterr().out.split()) >= 4
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(path), "--ids", "1", "--kv-dtype", "q4"])
    assert exit_.value.code == 2 and "invalid choice: 'q4' (choose from 'f16', 'f32', 'q8_0')" in capsys.readouterr().err


@pytest.mark.slow  # Ray stages
@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_f16_caches_on_pipeline_stages_give_the_tokens_of_one_process(model, capsys, kv_dtype):
    from dist_runtime.cli import main

    code = main(["pipeline", str(model), "--stages", "2", "--sessions", "3", "--prompt-ids", "4,5,6",
                 "--max-new-tokens", "6", "--max-context", "64", "--kv-dtype", kv_dtype, "--cpus-per-stage", "0.5",
                 "--check"])
    out = capsys.readouterr().out
    assert code == 0 and "check: the same tokens as one process" in out, out


@pytest.mark.parametrize("head_dim", [64, 128, 20])
@pytest.mark.parametrize("rows, keys", [(1, 40), (1, 3000), (7, 300)])  # a decode step, a long one, a chunk
def test_compiled_attention_reads_f16_keys_and_values_as_their_f32_widening(head_dim, rows, keys):
    """The compiled cores widen F16 rows exactly as they read them: the same bits as the same keys
    and values given as F32, on one thread and over the threads (the pieces of a long context);
    a head size without compiled cores widens them first."""
    from dist_runtime.backends.compiled import attention

    rng = np.random.default_rng(head_dim + rows)
    heads, kv_heads = 4, 2
    q = rng.standard_normal((rows, heads * head_dim)).astype(np.float32)
    k16, v16 = (rng.standard_normal((keys, kv_heads * head_dim)).astype(np.float16) for _ in range(2))
    for a in (k16, v16):
        a.flags.writeable = False  # as a KV cache hands them out
    got, want = np.empty_like(q), np.empty_like(q)
    attention.attention_rows(q, k16, v16, heads, kv_heads, head_dim, True, 0, got)
    attention.attention_rows(q, k16.astype(np.float32), v16.astype(np.float32), heads, kv_heads, head_dim, True,
                             0, want)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_numba_backend_attends_over_f16_caches_compiled(model, monkeypatch):
    """Over F16 caches the numba backend's attention runs the compiled cores, not the CPU library."""
    import dist_runtime.backends.numba as numba_backend

    reference = []
    real = numba_backend.NumbaBackend.reference
    monkeypatch.setattr(numba_backend.NumbaBackend, "reference", lambda self, node: (
        lambda inputs, ctx, _r=real(self, node), _n=node: (reference.append(_n.op_name), _r(inputs, ctx))[1]))
    ex = GraphExecutor(model, kv_dtype="f16")
    ex.run({"tokens": np.arange(1, 9, dtype=np.int32)})
    ex.run({"tokens": np.array([3], np.int32)})
    assert "Sdpa" not in reference


def test_halves_store_f32_values_as_numpy_rounds_them():
    """The compiled conversion against numpy's, on random bit patterns (NaNs, infinities and
    subnormals among them) and around every F16 value: each one, its neighbours, and the
    midpoints to the next, where ties go to even."""
    import numba

    from dist_runtime.backends.compiled.halves import f16_bits

    @numba.njit
    def convert(a, out):
        for i in range(a.shape[0]):
            out[i] = f16_bits(a[i])

    rng = np.random.default_rng(3)
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    every = every.astype(np.int64)
    bits = np.concatenate([rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32),
                           *(((every + d) % 2**32).astype(np.uint32) for d in (-1, 0, 1, 0xFFF, 0x1000, 0x1001)),
                           np.array([0x477FEFFF, 0x477FF000, 0x47800000, 0x7F800001, 0x33000000, 0x32FFFFFF],
                                    np.uint32)])
    x = bits.view(np.float32)
    got = np.empty(x.shape, np.uint16)
    convert(x, got)
    with np.errstate(all="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want)


def test_the_program_writes_and_reads_f16_caches_with_the_steps_bits(model, monkeypatch):
    """The compiled program of an executor with F16 caches runs (it is not left to the steps) and
    gives the bits of the steps (the attention chain's compiled call), prefill, chunks and decode
    steps alike."""
    import dist_runtime.backends.program.vm as vm

    calls, real = [], vm.execute
    monkeypatch.setattr(vm, "execute", lambda *args: (calls.append(1), real(*args))[1])
    runs = [GraphExecutor(model, kv_dtype="f16"), GraphExecutor(model, kv_dtype="f16", compiled_program=False)]
    ids = np.random.default_rng(4).integers(0, CFG.vocab, 30).astype(np.int32)
    for chunk in (ids[:9], ids[9:20], *ids[20:, None]):
        a, b = (e.run({"tokens": chunk})["logits"] for e in runs)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert len(calls) == 12
