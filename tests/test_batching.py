"""Continuous batching in one process: the op table's row kinds, batched passes, the scheduler.

The property that matters: a session's tokens are bitwise the same whether it ran alone or in any
batch, whatever arrives when, however its prompt is chunked, with any sampling settings.
"""

from __future__ import annotations

import numpy as np
import pytest

from dist_runtime.batched_pass import Segment, plan_rows
from dist_runtime.dtypes import DType
from dist_runtime.errors import DistRuntimeError, GraphValidationError
from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.engine import Inbox, LocalEngine, Request, generate
from dist_runtime.ir.graph import Graph, Node, TensorSpec
from dist_runtime.ir.ops import OPS_BY_NAME, Conv1d, Matmul, Reshape, Softmax
from dist_runtime.ir.payload import ROW_KINDS
from dist_runtime.ir.validate import infer_shapes
from dist_runtime.kernels.quant import quantize
from dist_runtime.model import save_model
from dist_runtime.sampling import Sampling
from dist_runtime.scheduling import Scheduler

pytest.importorskip("numba")

CFG = LlamaConfig(vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)


@pytest.fixture(scope="module", params=["F32", "Q8_0"])
def model(request, tmp_path_factory):
    """The tiny Llama, its projections F32 or Q8_0 (the compiled products of both types)."""
    weights = llama_weights(CFG, seed=5)
    if request.param == "Q8_0":
        weights = {n: quantize(w, DType.Q8_0) if n.endswith("proj.weight") else w for n, w in weights.items()}
    path = tmp_path_factory.mktemp("batching") / f"{request.param}.model"
    save_model(path, llama_graph(CFG), weights, {}).close()
    return path


def _executor(model, **kw):
    return GraphExecutor(model, **kw)


# -- the op table ----------------------------------------------------------------------------------
def test_every_op_declares_how_its_rows_behave():
    kinds = {name: spec.rows for name, spec in OPS_BY_NAME.items()}
    assert set(kinds.values()) <= {*ROW_KINDS, "along dim"}
    assert (kinds["Matmul"], kinds["Rope"], kinds["KvCache"], kinds["Sdpa"], kinds["Sample"], kinds["Conv1d"]) == (
        "independent", "positional", "per-session", "per-session", "per-session", "mixed")
    assert Softmax(dim=-1).spec.row_kind(Softmax(dim=-1)) == "independent"
    assert Softmax(dim=0).spec.row_kind(Softmax(dim=0)) == "mixed"


def _graph(nodes, inputs, outputs, weights=None) -> Graph:
    return Graph(nodes=nodes, inputs=inputs, outputs=outputs, weights=weights or {})


def test_a_graph_that_mixes_rows_runs_one_session_per_pass_and_says_why(model):
    assert _executor(model).rows.reason is None
    conv = _graph([Node(0, Conv1d(kernel=3, padding=1), ["x0", "w"], ["y"])],
                  [TensorSpec((1, 4, -1), DType.F32)], ["y"], {"w": TensorSpec((4, 4, 3), DType.F32)})
    reason = plan_rows(conv, infer_shapes(conv)).reason
    assert reason is not None and "input 'x0'" in reason  # its rows (time) are not on axis 0
    reshape = _graph([Node(0, Reshape(shape=(1, -1)), ["x0"], ["y"])], [TensorSpec((-1, 4), DType.F32)], ["y"])
    assert plan_rows(reshape, infer_shapes(reshape)).reason == \
        "node 0 (Reshape) mixes rows: its op's rows are 'mixed' (docs/ops.md)"
    product = _graph([Node(0, Matmul(), ["x0", "x1"], ["y"])],
                     [TensorSpec((-1, 4), DType.F32), TensorSpec((-1, 4), DType.F32)], ["y"])
    assert "multiplies two activations" in plan_rows(product, infer_shapes(product)).reason
    ex = GraphExecutor((reshape, {}))
    assert ex.batching().startswith("one session per pass: node 0 (Reshape)")
    with pytest.raises(GraphValidationError, match="runs one session per pass"):
        ex.run_batch({"x0": np.zeros((3, 4), np.float32)}, [Segment("a", 1), Segment("b", 2)])


# -- batched passes --------------------------------------------------------------------------------
def test_a_batched_pass_gives_each_session_the_bits_it_gets_alone(model):
    rng = np.random.default_rng(0)
    batched, alone = _executor(model), _executor(model)
    for round_ in range(4):  # prefills, then mixes of decode rows and prompt chunks
        sessions = rng.choice(12, size=int(rng.integers(2, 7)), replace=False)
        segments = [Segment(int(s), int(rng.integers(1, 9) if round_ == 0 or rng.random() < 0.3 else 1))
                    for s in sessions]
        tokens = {seg.session: rng.integers(0, CFG.vocab, seg.rows).astype(np.int32) for seg in segments}
        out = batched.run_batch({"tokens": np.concatenate([tokens[s.session] for s in segments])}, segments)
        at = 0
        for seg in segments:
            want = alone.run({"tokens": tokens[seg.session]}, session=seg.session)["logits"]
            got = out["logits"][at:at + seg.rows]
            at += seg.rows
            assert np.array_equal(got, want), (round_, seg)
            assert batched.position(seg.session) == alone.position(seg.session)


def test_a_prompt_fed_in_chunks_gives_the_bits_of_the_prompt_at_once(model):
    ex = _executor(model)
    prompt = np.random.default_rng(1).integers(0, CFG.vocab, 70).astype(np.int32)
    whole = ex.run({"tokens": prompt}, session="whole")["logits"]
    parts = [ex.run({"tokens": prompt[a:b]}, session="chunked")["logits"] for a, b in ((0, 33), (33, 34), (34, 70))]
    assert np.array_equal(np.concatenate(parts), whole)


def test_batched_pass_refuses_what_it_cannot_cut(model):
    ex = _executor(model)
    ids = np.zeros(3, np.int32)
    with pytest.raises(GraphValidationError, match="each session once"):
        ex.run_batch({"tokens": ids}, [Segment("a", 1), Segment("a", 2)])
    with pytest.raises(GraphValidationError, match="has 3 rows, the segments 4"):
        ex.run_batch({"tokens": ids}, [Segment("a", 2), Segment("b", 2)])
    with pytest.raises(GraphValidationError, match="at least one row"):
        ex.run_batch({"tokens": ids}, [Segment("a", 3), Segment("b", 0)])


# -- the scheduler ---------------------------------------------------------------------------------
def _random_requests(rng, n) -> list[Request]:
    out = []
    for i in range(n):
        kind = rng.integers(0, 4)
        sampling = [Sampling(), Sampling(temperature=0.9, top_k=8, seed=i), Sampling(temperature=1.2, top_p=0.8, seed=i),
                    Sampling(temperature=0.7, min_p=0.1, seed=i)][kind]
        prompt = [int(t) for t in rng.integers(0, CFG.vocab, int(rng.integers(1, 40)))]
        out.append(Request(f"s{i}", prompt, int(rng.integers(1, 12)), sampling, stop=frozenset({int(rng.integers(0, 96))})))
    return out


@pytest.mark.parametrize("sessions", [1, 5, 32])
def test_tokens_are_those_of_each_session_alone_whatever_arrives_when(model, sessions):
    """Random arrivals (a request joins between random passes), prompt lengths, sampling settings
    and budgets; every session's tokens equal its tokens run alone."""
    rng = np.random.default_rng(sessions)
    requests = _random_requests(rng, sessions)
    alone_engine = LocalEngine(_executor(model))
    alone = {r.session: generate(alone_engine, [r]).tokens[r.session] for r in requests}
    engine = LocalEngine(_executor(model))
    sched = Scheduler(max_batch_tokens=int(rng.integers(4, 64)), max_sessions=int(rng.integers(1, 12)))
    arrivals = sorted(rng.integers(0, 30, len(requests)))
    pending, got, passes = list(zip(arrivals, requests)), {}, 0
    while pending or not sched.done:
        while pending and pending[0][0] <= passes:
            sched.add(pending.pop(0)[1])
        batch = sched.next_batch()
        passes += 1
        if batch:
            for event in sched.complete(batch, engine._pass(batch)):
                got.setdefault(event.session, []).append(event.token)
    assert got == alone


def test_the_scheduler_feeds_decode_rows_first_and_chunks_prompts_to_the_budget():
    sched = Scheduler([Request("short", [1, 2], 3), Request("long", list(range(600)), 2)], max_batch_tokens=16)
    first = sched.next_batch()  # no one is generating yet: prompts may take IDLE_PREFILL_TOKENS rows
    assert [(w.session, len(w.tokens), w.samples) for w in first] == [("short", 2, True), ("long", 510, False)]
    events = sched.complete(first, [np.eye(8)[3]] * 2)
    assert [(e.session, e.token) for e in events] == [("short", 3)]
    second = sched.next_batch()  # short's decode row first, then long's next chunk, to a quarter of the budget
    assert [(w.session, len(w.tokens), w.pos) for w in second] == [("short", 1, 2), ("long", 3, 510)]
    assert sched.next_batch() == []  # both are in flight
    sched.abort(second)
    assert [len(w.tokens) for w in sched.next_batch(max_sessions=1)] == [1]


def test_decode_rows_leave_a_quarter_of_the_budget_to_waiting_prompts():
    sched = Scheduler([Request(f"d{i}", [1], 5) for i in range(20)], max_batch_tokens=16)
    for _ in range(2):  # all 20 prompts, then 16 decode rows (no prompt waits)
        batch = sched.next_batch()
        sched.complete(batch, [np.eye(8)[3]] * len(batch))
    assert len(batch) == 16
    sched.add(Request("new", list(range(40)), 2))
    batch = sched.next_batch()
    assert [w.session for w in batch].count("new") == 1 and len(batch) == 13
    assert sum(len(w.tokens) for w in batch) == 16  # 12 decode rows + 4 prompt rows


def test_prompt_rows_beside_decoders_fill_a_quarter_of_the_budget_or_add_half_the_decode_rows():
    """A long prompt beside D decoders, 24 rows a pass: it fills the pass to 6 rows (D = 1: 5),
    or adds D / 2 (D = 8: 4), never what would fill the budget (D = 20: the 6 rows left); with a
    budget of 2, still a row."""
    for decoders, budget, decoded, expected in ((1, 24, 1, 5), (8, 24, 8, 4), (12, 24, 12, 6), (20, 24, 18, 6),
                                                (3, 2, 1, 1)):
        sched = Scheduler([Request(f"d{i}", [1], 5) for i in range(decoders)], max_batch_tokens=budget)
        while not all(s.generated for s in sched.live.values()) or sched.waiting:
            sched.complete(batch := sched.next_batch(), [np.eye(8)[3]] * len(batch))
        sched.add(Request("long", list(range(500)), 2))
        batch = sched.next_batch()
        rows = {w.session: len(w.tokens) for w in batch}
        assert rows.pop("long") == expected and set(rows.values()) == {1} and len(rows) == decoded


def test_admission_queues_what_memory_cannot_hold_and_never_fails_it():
    sched = Scheduler([Request(f"r{i}", [1] * 10, 10) for i in range(4)], max_kv_rows=45)
    assert len(sched.next_batch()) == 2 and sched.queued() == {"r2": 0, "r3": 1}
    with pytest.raises(DistRuntimeError, match="exceed the KV budget of 45 rows"):
        sched.add(Request("huge", [1] * 40, 10))


def _run_to_the_end(sched: Scheduler) -> dict:
    """Drive ``sched`` with logits that always pick token 3 (greedy); the tokens per session."""
    got: dict = {}
    while not sched.done:
        batch = sched.next_batch()
        assert batch, f"nothing runs, yet {sorted(sched.queued())} wait"
        for event in sched.complete(batch, [np.eye(8)[3]] * len(batch)):
            got.setdefault(event.session, []).append(event.token)
    return got


def test_admission_takes_a_session_whose_need_equals_the_budget_exactly():
    """Prompt + new tokens == ``max_kv_rows``: queued, admitted and run to its last token (a
    ``<`` for ``<=`` would leave it waiting for ever, and a pipeline would give it no tokens)."""
    sched = Scheduler([Request("a", [1] * 10, 10)], max_kv_rows=20)
    assert [w.session for w in sched.next_batch()] == ["a"]
    assert _run_to_the_end(Scheduler([Request("a", [1] * 10, 10)], max_kv_rows=20)) == {"a": [3] * 10}
    # two sessions that fill the budget exactly are resident together; a third row waits
    sched = Scheduler([Request("a", [1] * 10, 10), Request("b", [1] * 4, 6), Request("c", [1], 1)], max_kv_rows=30)
    assert sched.ready() == 2 and set(sched.live) == {"a", "b"} and sched.queued() == {"c": 0}
    assert _run_to_the_end(sched) == {"a": [3] * 10, "b": [3] * 6, "c": [3]}
    # add() refuses only a need beyond the budget
    with pytest.raises(DistRuntimeError, match="11 new tokens exceed the KV budget of 20 rows"):
        Scheduler(max_kv_rows=20).add(Request("over", [1] * 10, 11))


def test_admission_holds_exactly_max_sessions():
    sched = Scheduler([Request(f"r{i}", [1, 2], 2) for i in range(3)], max_sessions=2)
    assert sched.ready() == 2 and set(sched.live) == {"r0", "r1"} and sched.queued() == {"r2": 0}
    assert _run_to_the_end(sched) == {f"r{i}": [3, 3] for i in range(3)}


def test_each_session_s_caches_hold_no_more_rows_than_its_request_may_reach(model):
    """Prompt + new tokens is the ceiling the engine gives a session's KV caches: they never take
    a whole block (256 rows) for a short request, and the tokens are the same as without one."""
    ex, seen = _executor(model), {}
    requests = [Request("short", [1, 2, 3], 5), Request("longer", list(range(1, 40)), 9)]
    for event in LocalEngine(ex, max_batch_tokens=16).stream(requests):
        states = ex.session(event.session).kv.values()
        seen[event.session] = max(seen.get(event.session, 0), *(s.allocated for s in states))
    assert seen == {"short": 3 + 5, "longer": 39 + 9}
    unbounded = GraphExecutor(model)
    unbounded.set_kv_ceiling = lambda session, rows: None
    assert generate(LocalEngine(unbounded), requests).tokens == generate(LocalEngine(_executor(model)), requests).tokens


def test_local_engine_batches_and_matches_one_session_per_pass(model):
    requests = _random_requests(np.random.default_rng(7), 6)
    ex = _executor(model)
    batched = generate(LocalEngine(ex, max_batch_tokens=24), requests)
    assert batched.tokens == generate(LocalEngine(_executor(model), max_sessions=1), requests).tokens


def test_an_inbox_brings_requests_and_cancellations_into_the_running_batch(model):
    requests = _random_requests(np.random.default_rng(3), 4)
    for r in requests:
        r.max_new_tokens = 8
    late = Request("late", [5, 6, 7], 6, Sampling(temperature=0.8, seed=3))
    alone_engine = LocalEngine(_executor(model))
    alone = {r.session: generate(alone_engine, [r]).tokens[r.session] for r in [*requests, late]}
    ex = _executor(model)
    inbox, got = Inbox(), {}
    for event in LocalEngine(ex, max_batch_tokens=16).stream(requests, inbox=inbox):
        got.setdefault(event.session, []).append(event.token)
        if event.session == "s0" and event.index == 1:
            inbox.put(late)
            inbox.cancel("s1")
    assert "s1" not in ex.sessions()  # its KV caches were freed
    assert len(got.get("s1", [])) <= 2 and got.get("s1", []) == alone["s1"][:len(got.get("s1", []))]
    assert {s: t for s, t in got.items() if s != "s1"} == {s: t for s, t in alone.items() if s != "s1"}


def test_the_kv_pool_queues_what_does_not_fit_and_fails_only_what_never_can(model):
    """A LocalEngine with a pool of KV rows (the server's: what memory holds, kv_pool_rows):
    requests beyond what is free wait their turn with the tokens they get alone; one larger than
    the whole pool fails alone, with an error naming the budget, and the others go on."""
    from dist_runtime.engine import kv_pool_rows

    ex = GraphExecutor(model)
    assert ex.kv_row_bytes() == CFG.layers * 2 * CFG.kv_heads * (CFG.hidden // CFG.heads) * 2  # F16 rows
    assert kv_pool_rows(ex) is None or kv_pool_rows(ex) > 1000
    reqs = [Request("a", [1, 2, 3], 20), Request("b", [4, 5, 6], 20), Request("huge", list(range(1, 40)), 30)]
    events = list(LocalEngine(ex, max_kv_rows=40).stream(reqs))  # a and b: 23 rows each
    failed = [e for e in events if e.error is not None]
    assert [e.session for e in failed] == ["huge"] and "exceed the KV budget of 40 rows" in str(failed[0].error)
    got = {s: [e.token for e in events if e.session == s] for s in ("a", "b")}
    alone = generate(LocalEngine(_executor(model)), reqs[:2]).tokens
    assert got == {s: alone[s] for s in ("a", "b")}
    first_b = next(i for i, e in enumerate(events) if e.session == "b")
    last_a = max(i for i, e in enumerate(events) if e.session == "a")
    assert first_b > last_a  # "b" waited for "a"'s rows
