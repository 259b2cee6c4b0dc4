"""The executor's compiled program (dist_runtime/backends/program.py): a run of steps as one
compiled call gives the very bits of the steps run one by one from Python, in every kind of pass
a session makes (prefill, decode, a retried step, after a reset, a cache that grows, attention
over the threads at long contexts, one thread or two), leaves what it cannot take to the steps,
and fails as they fail, naming the same node."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import dist_runtime.backends.program.instructions as instructions
import dist_runtime.backends.program.vm as vm
from dist_runtime.dtypes import DType
from dist_runtime.errors import DistRuntimeError
from dist_runtime.executor import GraphExecutor
from dist_runtime.importers.hf.llama import DecoderConfig, decoder_graph, random_weights
from dist_runtime.ir import Graph, TensorSpec
from dist_runtime.kernels.quant import dequantize, quantize
from dist_runtime.tensor import QuantizedArray

HEAD64 = DecoderConfig(vocab=64, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=128)
KQ = DecoderConfig(vocab=64, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=256)  # K-quant rows
WINDOW = DecoderConfig(vocab=64, hidden=64, layers=2, heads=4, kv_heads=1, head_dim=16, ffn=96, rope_dim=8,
                       windows=(0, 5))  # partial rotation, a sliding window on one layer


def executors(cfg: DecoderConfig, weights=None, backends=None):
    """(with the program, without it) on the same weights."""
    weights = random_weights(cfg, 3) if weights is None else weights
    g = decoder_graph(cfg)
    specs = {n: TensorSpec(w.shape, w.dtype if isinstance(w, QuantizedArray) else DType.from_numpy(w.dtype))
             for n, w in weights.items()}
    graph = Graph(g.nodes, g.inputs, g.outputs, specs)
    return tuple(GraphExecutor((graph, weights), backends, compiled_program=p)
                 for p in (True, False))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture
def calls(monkeypatch):
    """How many times the compiled program ran."""
    count = [0]
    real = vm.execute

    def counted(*args):
        count[0] += 1
        return real(*args)
    monkeypatch.setattr(vm, "execute", counted)
    return count


RUNS = (([3, 17, 42, 5, 9, 8, 11, 2, 30], None), ([4], None), ([9], None), (list(range(21)), None),
        ([7], 30), ([7], 30), ([1, 2], None), ([5], 12))  # ... a retried step, a rewind


@pytest.mark.parametrize("cfg", [HEAD64, WINDOW], ids=["head64", "window"])
def test_the_program_gives_the_steps_bits(cfg, calls):
    ex, steps = executors(cfg)
    assert ex.program.startswith(f"{len(ex._steps) - 1} steps from node ")  # all but TokenEmbed
    assert steps.program == "not asked for"
    for round_ in range(2):
        for tokens, pos in RUNS:
            ids = np.asarray(tokens, np.int32)
            got, want = (e.run({"tokens": ids}, pos=pos)["logits"] for e in (ex, steps))
            assert same_bits(got, want)
            assert ex.position() == steps.position()
        ex.reset()
        steps.reset()
    assert calls[0] == 2 * len(RUNS)


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16, DType.Q8_0])
def test_the_program_on_f16_bf16_and_q8_0_weights(dtype, calls):
    """Products of F16 or BF16 weights (a safetensors model's own) or Q8_0 ones (a GGUF file's):
    the same bits as the steps; a model mixing product formats (F32 down_proj, a joint launch
    of the other format's gate and up) runs in the same one program, each product in its
    weight's format."""
    weights = {n: quantize(w, dtype) if w.ndim == 2 and "embed" not in n else w  # F32 rows from the table
               for n, w in random_weights(HEAD64, 3).items()}
    ex, steps = executors(HEAD64, weights=weights)
    assert f"{dtype.name} products" in ex.program
    for tokens, pos in RUNS:
        ids = np.asarray(tokens, np.int32)
        assert same_bits(*(e.run({"tokens": ids}, pos=pos)["logits"] for e in (ex, steps)))
    assert calls[0] == len(RUNS)
    mixed = {n: (dequantize(w) if isinstance(w, QuantizedArray) else w.astype(np.float32)) if "down_proj" in n else w
             for n, w in weights.items()}
    ex, steps = executors(HEAD64, weights=mixed)
    assert ex.program.startswith(f"{len(ex._steps) - 1} steps from node ")
    assert f"{dtype.name} and F32 products" in ex.program
    for tokens, pos in RUNS[:3]:
        ids = np.asarray(tokens, np.int32)
        assert same_bits(*(e.run({"tokens": ids}, pos=pos)["logits"] for e in (ex, steps)))
    assert calls[0] == len(RUNS) + 3


def k_quant(w: np.ndarray, dtype: DType, rng) -> QuantizedArray:
    """Random K-quant blocks of ``w``'s shape with sane f16 scales (there is no K-quant encoder:
    tests/test_compiled_linear.py's way)."""
    n, k = w.shape
    data = rng.integers(0, 256, (n, k // 256 * dtype.block_bytes), dtype=np.uint8)
    blocks = data.reshape(n, k // 256, dtype.block_bytes)
    for at in {DType.Q4_K: (0, 2), DType.Q5_K: (0, 2), DType.Q6_K: (208,)}[dtype]:
        scale = rng.uniform(0.002, 0.02, blocks.shape[:2]).astype(np.float16)
        blocks[..., at:at + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return QuantizedArray(data, dtype, (n, k))


def test_the_program_on_k_quant_weights(calls):
    """A Q4_K_M-like model (Q4_K and Q6_K products, joint launches mixing them, a Q5_K one, an
    F32 lm_head): the same bits as the steps, in one program."""
    rng = np.random.default_rng(5)
    kinds = {"v_proj": DType.Q6_K, "down_proj": DType.Q6_K, "o_proj": DType.Q5_K}
    weights = {n: k_quant(w, next((d for part, d in kinds.items() if part in n), DType.Q4_K), rng)
               if w.ndim == 2 and "embed" not in n and "lm_head" not in n else w
               for n, w in random_weights(KQ, 3).items()}
    ex, steps = executors(KQ, weights=weights)
    assert ex.program.startswith(f"{len(ex._steps) - 1} steps from node ")
    code = ex._program_steps[1].fn.code
    blocks = code[code[:, 0] == instructions.K_BLOCKS]
    assert instructions.PRODUCT in code[:, 0] and {1, 2, 3} <= set(blocks[:, 2])  # F32 lm_head; o_proj, gate/up, q/k/v
    for tokens, pos in RUNS:
        ids = np.asarray(tokens, np.int32)
        assert same_bits(*(e.run({"tokens": ids}, pos=pos)["logits"] for e in (ex, steps)))
    assert calls[0] == len(RUNS)


def test_the_program_on_one_thread_and_with_attention_over_the_threads(calls):
    """A prefill long enough that attention is threaded over the keys (and a decode step past
    SPLIT_KEYS), on two threads and on one: the same bits as the steps."""
    ex, steps = executors(HEAD64)
    ids = (np.arange(300) % 64).astype(np.int32)
    threads = numba.get_num_threads()
    try:
        for n in sorted({1, threads}):
            numba.set_num_threads(n)
            for e in (ex, steps):
                e.reset()
            for tokens in (ids, [5], [6]):
                got, want = (e.run({"tokens": np.asarray(tokens, np.int32)})["logits"] for e in (ex, steps))
                assert same_bits(got, want)
    finally:
        numba.set_num_threads(threads)
    assert calls[0] == 3 * len({1, threads})


def test_a_thread_alone_does_every_task_planned_for_several(monkeypatch):
    """The program's threads take tasks by ticket, as they turn up: if numba's pool sends only
    the calling thread, it alone runs a plan made for four threads (products in four parts, the
    attention's keys in pieces), in order, to the last task, and gives the steps' bits."""
    most = []

    def alone(code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions, threads, attention_spec,
              kernels):
        stages, pieces, sums, stats, counters = vm._prepare(code, slots, weights, m, starts, positions, 4)
        vm._work(stages, counters, code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions,
                 attention_spec, pieces, sums, stats, *kernels)
        assert counters[vm._DONE] == counters[vm._CLAIMED] - 1 == stages[-1, 2] + stages[-1, 3]
        products = [tasks for i, _, tasks, _ in stages if code[i, 0] != instructions.ATTENTION]
        most.append((max(products), int(pieces.max())))
    monkeypatch.setattr(vm, "execute", alone)
    ex, steps = executors(HEAD64)
    for tokens in ((np.arange(300) % 64), [5], [6]):
        got, want = (e.run({"tokens": np.asarray(tokens, np.int32)})["logits"] for e in (ex, steps))
        assert same_bits(got, want)
    assert most[0][0] == 4 and most[0][1] > 1 and len(most) == 3  # four-part products, pieces of keys


def test_spin_counters_count_every_thread_s_increments():
    """:mod:`.compiled.spin`: concurrent ``fetch_add`` calls lose no increment and each returns
    a distinct value before it; ``wait_until`` returns once the count is reached."""
    from dist_runtime.backends.compiled import spin

    @numba.njit(parallel=True)
    def bump(counters, seen, n):
        for t in numba.prange(4):
            for i in range(n):
                seen[t * n + i] = spin.fetch_add(counters, 0)
        spin.wait_until(counters, 0, 4 * n)
        return spin.load_acquire(counters, 0)

    counters, seen = np.zeros(16, np.int64), np.zeros(4 * 5000, np.int64)
    assert bump(counters, seen, 5000) == 20000 == counters[0]
    assert np.array_equal(np.sort(seen), np.arange(20000))


@pytest.mark.parametrize("cfg", [HEAD64, WINDOW], ids=["head64", "window"])
def test_a_batched_pass_gives_the_steps_bits(cfg, calls):
    """Several sessions' rows in one pass: one call of the program, each segment attending over
    its own session's cache (the threads taking segments); the same bits as the steps, and as
    each session alone."""
    from dist_runtime.batched_pass import Segment

    ex, steps = executors(cfg)
    alone, _ = executors(cfg)
    ids = np.array([7, 1, 2, 3, 60, 61, 5, 9], np.int32)
    passes = ([Segment("a", 3), Segment("b", 5)], [Segment("a", 1), Segment("b", 1), Segment("c", 6)],
              [Segment("b", 1), Segment("a", 1)], [Segment("c", 1), Segment("a", 2, pos=1)])
    for segments in passes:
        rows = sum(seg.rows for seg in segments)
        got, want = (e.run_batch({"tokens": ids[:rows]}, segments)["logits"] for e in (ex, steps))
        assert same_bits(got, want)
        at = 0
        for seg in segments:
            own = alone.run({"tokens": ids[at:at + seg.rows]}, session=seg.session, pos=seg.pos)["logits"]
            assert same_bits(got[at:at + seg.rows], own)
            at += seg.rows
        assert [ex.position(seg.session) for seg in segments] == [steps.position(seg.session) for seg in segments]
    assert calls[0] == len(passes) + sum(len(p) for p in passes)  # each pass once, and alone each segment


@pytest.mark.parametrize("pos, node", [(5, "KvCache"), (-1, "Rope")])
def test_an_error_names_the_node_as_without_the_program(pos, node):
    """A write the KV cache refuses, a bad position: the steps run and fail as they do alone,
    naming the same node with the same message; the session is left as it was."""
    errors = []
    for e in executors(HEAD64):
        e.run({"tokens": np.array([1, 2], np.int32)})
        with pytest.raises(DistRuntimeError) as info:
            e.run({"tokens": np.array([1], np.int32)}, pos=pos)
        errors.append((type(info.value), str(info.value), e.position(), {st.length for st in e.session().kv.values()}))
    assert errors[0] == errors[1] and f"({node})" in errors[0][1] and errors[0][3] == {2}


@pytest.mark.parametrize("backends", [["numba-f32", "cpu"], ["numba-q8", "cpu"]], ids=["f32 activations", "q8 activations"])
def test_the_program_on_legacy_blocks_and_quantized_activations(backends, calls):
    """A GGUF-like model of every product family: K-quants (Q4_K, Q5_K, Q6_K, joint launches
    mixing them), legacy blocks (a joint Q4_1 gate and Q5_0 up, a Q4_0 down_proj) and a Q8_0
    lm_head, with f32 activations or quantized ones (the numba-q8 backend: llama.cpp's numerics):
    one program, the same bits as the steps."""
    rng = np.random.default_rng(5)
    kinds = {"v_proj": DType.Q6_K, "o_proj": DType.Q5_K, "q_proj": DType.Q4_K, "k_proj": DType.Q4_K}
    legacy = {"gate_proj": DType.Q4_1, "up_proj": DType.Q5_0, "down_proj": DType.Q4_0, "lm_head": DType.Q8_0}
    weights = {}
    for n, w in random_weights(KQ, 3).items():
        kind = next((d for part, d in kinds.items() if part in n), None)
        block = next((d for part, d in legacy.items() if part in n), None)
        weights[n] = k_quant(w, kind, rng) if kind else quantize(w, block) if block else w
    ex, steps = executors(KQ, weights=weights, backends=backends)
    assert ex.program.startswith(f"{len(ex._steps) - 1} steps from node ")
    assert ("Q8-quantized activations" in ex.program) == (backends[0] == "numba-q8")
    code = ex._program_steps[1].fn.code
    launches = {(op, count) for op, count in code[:, :3:2] if op in (instructions.K_BLOCKS, instructions.L_BLOCKS)}
    assert {(instructions.K_BLOCKS, 3), (instructions.K_BLOCKS, 1), (instructions.L_BLOCKS, 2),
            (instructions.L_BLOCKS, 1)} <= launches  # q/k/v, o_proj, gate/up, down_proj
    for tokens, pos in RUNS[:5]:
        ids = np.asarray(tokens, np.int32)
        assert same_bits(*(e.run({"tokens": ids}, pos=pos)["logits"] for e in (ex, steps)))
    assert calls[0] == 5


def test_what_the_program_leaves_out():
    """Steps of the CPU library's kernels are not the program's: the plan says why, and the
    results are the steps' own."""
    cpu, steps = executors(HEAD64, backends=["cpu"])
    assert cpu.program.startswith("no compiled program: node ")
    ids = np.array([5, 6, 7], np.int32)
    assert same_bits(*(e.run({"tokens": ids})["logits"] for e in (cpu, steps)))


def test_the_arena_reuses_what_is_no_longer_read():
    """Intermediates share the arena once their last reader has run: a 12-layer model's arena
    is a few values wide, not every value's."""
    cfg = DecoderConfig(vocab=64, hidden=64, layers=12, heads=4, kv_heads=2, head_dim=16, ffn=128)
    ex, _ = executors(cfg)
    prog = ex._program_steps[1].fn
    every = int(prog.slots[:, 1].sum())
    assert prog.per_row < every / 8
    assert prog.per_row >= cfg.vocab + cfg.hidden  # the logits and the last hidden state at least


def test_compiled_program_takes_true_or_false():
    weights = random_weights(HEAD64, 3)
    g = decoder_graph(HEAD64)
    graph = Graph(g.nodes, g.inputs, g.outputs,
                  {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in weights.items()})
    with pytest.raises(TypeError, match=r"compiled_program= takes True or False, not 'yes'"):
        GraphExecutor((graph, weights), compiled_program="yes")
