"""A pass that wants some rows' outputs only (``GraphExecutor.run``/``run_batch``'s ``rows=``: a
prompt's last row, whose logits pick the next token): the steps after the last one that mixes rows
(the last layer's work after its attention, the final norm, the vocabulary's product) run on those
rows alone, with or without the compiled program, and give each row the bits of a pass that makes
them all; the sessions' KV caches and positions are as after a full pass."""

from __future__ import annotations

import numpy as np
import pytest

from dist_runtime.batched_pass import Segment
from dist_runtime.dtypes import DType
from dist_runtime.engine import LocalEngine, generate
from dist_runtime.errors import GraphValidationError
from dist_runtime.executor import GraphExecutor, _keep_rows
from dist_runtime.importers.hf.llama import DecoderConfig, decoder_graph, random_weights
from dist_runtime.ir import Graph, TensorSpec
from dist_runtime.requests import Request
from dist_runtime.sampling import Sampling

CFG = DecoderConfig(vocab=64, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=128)


WEIGHTS = random_weights(CFG, 3)


def model(outputs=None) -> Graph:
    g = decoder_graph(CFG)
    specs = {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in WEIGHTS.items()}
    return Graph(g.nodes, g.inputs, outputs or g.outputs, specs)


def executor(program: bool = True, graph=None, cls=GraphExecutor) -> GraphExecutor:
    return cls((graph or model(), WEIGHTS), compiled_program=program)


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


IDS = np.array([7, 1, 2, 3, 60, 61, 5, 9, 33, 12, 40], np.int32)


@pytest.mark.parametrize("program", [True, False], ids=["program", "steps"])
def test_wanted_rows_get_the_bits_of_a_full_pass(program):
    full, some = executor(program), executor(program)
    assert some._some_rows is not None
    for rows in ([10], [0, 4, 10], [3]):
        want = full.run({"tokens": IDS}, session=str(rows))["logits"]
        got = some.run({"tokens": IDS}, session=str(rows), rows=rows)["logits"]
        assert same_bits(got, want[rows])
        assert some.position(str(rows)) == full.position(str(rows)) == len(IDS)
    # the caches are as after a full pass: the next step's logits are the same bits
    assert same_bits(some.run({"tokens": IDS[:1]}, session="[3]")["logits"],
                     full.run({"tokens": IDS[:1]}, session="[3]")["logits"])


def test_only_the_tail_runs_on_the_wanted_rows():
    """The steps after the row-keeping step are row-alone; it comes after the last attention."""
    ex = executor(False)
    plain, _ = ex._some_rows
    k = next(i for i, s in enumerate(plain) if s.fn is _keep_rows)
    ops = [ex.graph.nodes[s.index].op_name for s in plain[k + 1:]]
    assert ops and not {"Sdpa", "KvCache", "Rope"} & set(ops)
    assert "Matmul" in ops  # the vocabulary's product among them
    assert all(not s.rows.per_segment for s in plain[k + 1:])


@pytest.mark.parametrize("program", [True, False], ids=["program", "steps"])
def test_a_batched_pass_keeps_each_segment_s_last_row(program):
    ex, full = executor(program), executor(program)
    passes = ([Segment("a", 3), Segment("b", 5)], [Segment("a", 1), Segment("b", 1), Segment("c", 6)])
    for segments in passes:
        total = sum(seg.rows for seg in segments)
        ends = np.cumsum([seg.rows for seg in segments]) - 1
        got = ex.run_batch({"tokens": IDS[:total]}, segments, rows=ends)["logits"]
        want = full.run_batch({"tokens": IDS[:total]}, segments)["logits"]
        assert same_bits(got, want[ends])


def test_without_a_tail_the_outputs_are_cut():
    """A graph whose output is made before a row-mixing step has no tail to cut: the pass makes
    every row and hands back the wanted ones."""
    g = decoder_graph(CFG)
    ex = executor(graph=model([*g.outputs, g.nodes[1].outputs[0]]))
    assert ex._some_rows is None
    out = ex.run({"tokens": IDS}, rows=[2, 10])
    assert {name: v.shape[0] for name, v in out.items()} == {name: 2 for name in out}


def test_all_rows_wanted_is_a_full_pass():
    ex = executor()
    a = ex.run({"tokens": IDS}, session="a", rows=range(len(IDS)))["logits"]
    b = ex.run({"tokens": IDS}, session="b")["logits"]
    assert same_bits(a, b)


@pytest.mark.parametrize("rows", [[11], [-1], [], [[1, 2]]])
def test_rows_out_of_the_pass_are_refused(rows):
    with pytest.raises(GraphValidationError, match="rows= takes row numbers of this pass's 11 rows"):
        executor(False).run({"tokens": IDS}, rows=rows)


def test_the_engine_s_tokens_are_those_of_full_passes():
    """LocalEngine asks for each session's last row: the same tokens as full passes give."""
    requests = [Request(s, list(IDS[:n]), 6, Sampling.from_options(greedy=True)) for s, n in (("a", 11), ("b", 4))]
    got = generate(LocalEngine(executor()), requests).tokens

    class Full(GraphExecutor):
        def run_batch(self, inputs, segments, rows=None):
            return {k: v[rows] for k, v in super().run_batch(inputs, segments).items()}

    want = generate(LocalEngine(executor(cls=Full)), requests).tokens
    assert got == want
