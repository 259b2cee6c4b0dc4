"""The pipeline's parts without Ray: the cut, a stage driven in-process, sampling, telemetry.

The stages of a cut, run one after another in this process and fed each other's messages, must
give exactly the single-process executor's logits -- including a cut where a tensor skips a stage
and must be forwarded.  A stage must refuse hostile messages call by call and keep serving.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import msgpack
import numpy as np
import pytest

from conftest import PIPELINE_CFG, save_example
from dist_runtime.errors import DistRuntimeError, TransportError
from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.model import load_model, save_model
from dist_runtime.pipeline.header import StageRecord, StepHeader
from dist_runtime.pipeline import coordinator
from dist_runtime.pipeline.channels import Channel
from dist_runtime.pipeline.launch import kv_rows, make_plan
from dist_runtime.engine import LocalEngine, Request, generate
from dist_runtime.sampling import Sampling
from dist_runtime.pipeline.stage import StageWorker
from dist_runtime.pipeline.subgraph import cut_stages, stages_for_plan
from dist_runtime.pipeline.telemetry import RunTelemetry
from dist_runtime.pipeline.weights import fingerprint
from dist_runtime.transport import decode_message, encode_message
from dist_runtime.kernels.generation import MIN_P, TOP_K, TOP_P, sample

CFG = PIPELINE_CFG


@pytest.fixture(scope="module")
def model_path(pipeline_model):
    return pipeline_model


@pytest.fixture(scope="module")
def model(model_path):
    with load_model(model_path) as m:
        yield m


def _message(tokens, session, pos, step=1, **meta) -> bytes:
    return encode_message({"tokens": np.asarray(tokens, np.int32)},
                          {"session": session, "pos": pos, "step": step, "logits": "all", **meta})


def _run(workers, message: bytes) -> dict:
    for w in workers:
        message = w.step(message)
    return decode_message(message)[0]


def _workers(stages, path):
    workers = [StageWorker(st, fuse=False) for st in stages]
    for w in workers:
        assert w.load_file(str(path))["loaded"]
    return workers


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_cut_matches_plan_and_reference(model, model_path, n):
    plan = make_plan(model.graph, stages=n, max_context=64)
    stages = stages_for_plan(model.graph, plan)
    for st, ps in zip(stages, plan.stages):
        assert st.weights == ps.weights  # each stage maps exactly the plan's weights
        assert set(st.receives) == set(ps.tensors_in)
        if st.index < n - 1:
            assert set(st.sends) == set(ps.tensors_out)
        else:  # the driver samples: the graph's next_token is not sent
            assert st.sends == ("logits",) and st.logits == "logits"
    ref = GraphExecutor(model, fuse=False)
    workers = _workers(stages, model_path)
    for tokens, pos in (([3, 1, 4, 1, 5], 0), ([9], 5), ([2, 6], 6)):
        want = ref.run({"tokens": np.array(tokens, np.int32)}, session="s", pos=pos)["logits"]
        got = _run(workers, _message(tokens, "s", pos))["logits"]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        assert got.dtype == np.float32


def test_a_stage_counts_its_busy_seconds_and_sends_only_the_records_asked_for(model, model_path):
    plan = make_plan(model.graph, stages=2, max_context=64)
    workers = _workers(stages_for_plan(model.graph, plan), model_path)
    for step, (tokens, pos) in enumerate((([3, 1, 4], 0), ([9], 3), ([2], 4)), start=1):
        _run(workers, _message(tokens, "s", pos, step=step))
    first = workers[0]
    records = first.telemetry(first_step=2)  # the driver keeps steps 2 and later only
    assert [r.step for r in records] == [2, 3] and first.telemetry() == []  # and the rest is gone
    busy = first.memory()["busy_seconds"]
    assert busy >= sum(r.end - r.start for r in records) > 0  # every step counts, sent or not


def test_forwarded_tensor_skips_a_stage(model, model_path):
    """Stage 1 takes only layer 0's k projection: the residual stream and the normed input skip
    past it to stage 2 (received and sent on unchanged, outside its executor)."""
    order = [node.id for node in model.graph.nodes]
    k_proj = next(i for i, node in enumerate(model.graph.nodes) if node.outputs == ["l0_k"])
    stages = cut_stages(model.graph, [(0, k_proj), (k_proj, k_proj + 1), (k_proj + 1, len(order))], order)
    middle = stages[1]
    assert middle.executor_inputs == ("l0_attn_in",)
    assert "h_embed" in middle.forwards and "h_embed" not in middle.executor_inputs
    assert set(middle.sends) == {"h_embed", "l0_attn_in", "l0_q", "l0_k"}  # v is computed later
    assert middle.weights == ("model.layers.0.self_attn.k_proj.weight",)
    ref = GraphExecutor(model, fuse=False)
    workers = _workers(stages, model_path)
    for tokens, pos in (([7, 7, 2], 0), ([11], 3)):
        want = ref.run({"tokens": np.array(tokens, np.int32)}, session=0, pos=pos)["logits"]
        np.testing.assert_allclose(_run(workers, _message(tokens, 0, pos))["logits"], want, rtol=0, atol=1e-5)


def test_hostile_messages_fail_one_call_only(model, model_path):
    stages = stages_for_plan(model.graph, make_plan(model.graph, stages=2, max_context=64))
    first, second = _workers(stages, model_path)
    good = _run([first, second], _message([1, 2, 3], "a", 0))["logits"]
    h = first.step(_message([1, 2, 3], "b", 0))
    frame = msgpack.unpackb(h, raw=False)
    name = stages[0].sends[0]
    lying = dict(frame, tensors={name: dict(frame["tensors"][name], shape=[10**9, 10**9])})
    hostile = [
        b"\x00garbage",
        h[: len(h) // 2],  # truncated
        msgpack.packb(lying, use_bin_type=True),  # a shape that promises far more than the bytes
        msgpack.packb(dict(frame, tensors={name: dict(frame["tensors"][name], dtype="object")}), use_bin_type=True),
        encode_message({}, {"session": "b", "pos": 0, "step": 2}),  # its input is missing
        encode_message({name: decode_message(h)[0][name]}, {"session": [1], "pos": 0, "step": 2}),
        encode_message({name: decode_message(h)[0][name]}, {"session": "b", "pos": -1, "step": 2}),
    ]
    for bad in hostile:
        with pytest.raises(TransportError):
            second.step(bad)
    assert second.errors == len(hostile)
    # ... and both sessions carry on: session a's next step equals a clean single-process run
    ref = GraphExecutor(model, fuse=False)
    ref.run({"tokens": np.array([1, 2, 3], np.int32)}, session="a", pos=0)
    want = ref.run({"tokens": np.array([4], np.int32)}, session="a", pos=3)["logits"]
    np.testing.assert_allclose(_run([first, second], _message([4], "a", 3))["logits"], want, atol=1e-5)
    np.testing.assert_allclose(decode_message(second.step(h))[0]["logits"], good, atol=1e-5)


class _InProcess(Channel):
    """The stages as ``StageWorker`` objects in this process: a step goes through all of them."""

    kind = "in-process"

    def submit(self, message: bytes) -> bytes:
        for worker in self.actors:
            message = worker.step(message)
        return message

    def get(self, handle: bytes, timeout: float | None = None) -> bytes:
        return handle


def test_a_request_that_fills_the_context_exactly_gets_all_its_tokens(model, model_path, monkeypatch):
    """The coordinator's KV budget is the plan's (sessions x context): prompt + max_new_tokens ==
    the context is admitted and gets every token, those of one process (not zero tokens)."""
    monkeypatch.setattr(coordinator, "call_all",  # the stages' telemetry, from the workers themselves
                        lambda actors, method, *args, timeout: [getattr(a, method)(*args) for a in actors])
    context = 12
    plan = make_plan(model.graph, stages=2, max_context=context)
    stages = stages_for_plan(model.graph, plan)
    workers = _workers(stages, model_path)
    co = coordinator.Coordinator(stages, workers, _InProcess(workers), max_kv_rows=kv_rows(plan))
    assert co.max_kv_rows == context
    prompt = [3, 1, 4, 1, 5]
    request = Request("full", prompt, context - len(prompt))
    want = generate(LocalEngine(GraphExecutor(model, fuse=False)), [request]).tokens["full"]
    assert len(want) == context - len(prompt)
    assert co.generate([request]) == {"full": want}


def test_weights_source_and_fingerprint(model, model_path, tmp_path):
    stages = stages_for_plan(model.graph, make_plan(model.graph, stages=2, max_context=64))
    worker = StageWorker(stages[1], fuse=False)
    assert not worker.load_file(str(tmp_path / "absent.model"))["loaded"]
    other = tmp_path / "other.model"  # same architecture, different weights: a stale copy
    save_example(other, CFG, seed=4)
    expected = fingerprint(model, stages[1].weights)
    result = worker.load_file(str(other), expected)
    assert not result["loaded"] and "different file" in result["reason"]
    tiny = tmp_path / "tiny.model"  # another model altogether: its index lacks these tensors
    save_model(tiny, llama_graph(LlamaConfig()), llama_weights(LlamaConfig()), {}).close()
    assert not worker.load_file(str(tiny), expected)["loaded"]
    with pytest.raises(DistRuntimeError):
        worker.step(_message([1], "x", 0))  # nothing loaded yet
    worker.load_weights({n: np.array(model.tensor(n)) for n in stages[1].weights})
    report = worker.report()
    assert report["source"] == "object store" and report["weights"] == list(stages[1].weights)
    assert report["weight_bytes"] == make_plan(model.graph, stages=2, max_context=64).stages[1].memory.weights


def test_reference_and_sampling_settings(model):
    logits = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    for settings, method, p, k in ((Sampling(0.8, top_k=5, seed=1), TOP_K, 1.0, 5),
                                   (Sampling(0.7, top_p=0.9, seed=2), TOP_P, 0.9, 0),
                                   (Sampling(1.3, min_p=0.1, seed=3), MIN_P, 0.1, 0)):
        want = sample(logits[-1:], method=method, temperature=settings.temperature, p=p, k=k,
                      rng=np.random.default_rng(settings.seed))
        assert settings.choose(logits, settings.rng()) == int(want[0])
    assert Sampling().choose(logits, None) == int(np.argmax(logits[-1]))
    # interleaving sessions in the reference changes nothing: each session alone gives the same
    ex = GraphExecutor(model, fuse=False)
    reqs = [Request("a", [1, 2], 5), Request("b", [3], 4, Sampling(0.9, top_k=8, seed=5))]
    both = generate(LocalEngine(ex), reqs).tokens
    assert both == {**generate(LocalEngine(ex), reqs[:1]).tokens, **generate(LocalEngine(ex), reqs[1:]).tokens}
    assert [len(both["a"]), len(both["b"])] == [5, 4]


def test_telemetry_join_table_and_svg():
    run = RunTelemetry(2)
    # two sessions, one step each; stage 1 is busy with step 1 when step 2's input is ready
    run.submitted(1, ["a"], "prefill", 3, 0.000)
    run.submitted(2, ["b"], "prefill", 2, 0.001)
    R = StageRecord
    run.add_stage_records(0, [R(1, "a", 0.001, 0.011, 0.0001, 0.0098, 0.0001, 0.0),
                              R(2, "b", 0.011, 0.021, 0.0001, 0.0098, 0.0001, 0.011)])
    run.add_stage_records(1, [R(1, "a", 0.012, 0.025, 0.0001, 0.0128, 0.0001, 0.0),
                              R(2, "b", 0.025, 0.035, 0.0001, 0.0098, 0.0001, 0.025)])
    run.token(1, 0.026, 0.0002)
    run.token(2, 0.036, 0.0002)
    run.finish()
    s0, s1 = run.steps[2].stages
    assert s0.queue == pytest.approx(0.010) and s0.transfer == pytest.approx(0.0)  # waited for step 1
    assert s1.queue == pytest.approx(0.004) and s1.transfer == pytest.approx(0.0)
    assert run.steps[1].stages[1].transfer == pytest.approx(0.001)
    summary = run.summary()
    assert summary["tokens"] == 2 and summary["ttft_ms_max"] == pytest.approx(35.0)
    assert summary["stages"][0]["busy_pct"] == pytest.approx(100 * 0.020 / 0.036)
    assert "bubble" in run.table()
    svg = ET.fromstring(run.svg())
    bars = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect") if r.find("{http://www.w3.org/2000/svg}title") is not None]
    assert len(bars) == 2 + 4  # two sampling bars on the driver's lane, four stage bars


def _texts_fit(svg_text: str) -> list[str]:
    """The texts of an SVG that run past its right edge (by the drawing code's own estimate)."""
    from dist_runtime.partitioner.svg import text_width

    ns = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(svg_text)
    width = float(root.get("width"))
    cut = []
    for t in root.iter(ns + "text"):
        size = float(t.get("font-size") or root.get("font-size") or 12)
        anchor = t.get("text-anchor", "start")
        left = float(t.get("x")) - (text_width(t.text, size, t.get("font-weight", "normal")) / 2 if anchor == "middle" else 0)
        if left + text_width(t.text, size, t.get("font-weight", "normal")) > width:
            cut.append(t.text)
    return cut


def test_pictures_fit_their_canvas_and_show_micro_batches(model_path):
    """The plan's right-hand title was cut at 1000 px; a timeline's legend ran off with many
    sessions.  Every label now fits, and two batches in flight get two colours."""
    from dist_runtime.partitioner.svg import plan_svg

    plan = make_plan(load_model(model_path).graph, budgets="1GiB,1GiB", speeds="1,2", max_context=64)
    svg = plan_svg(plan)
    assert "time = compute / speed (share of compute)" in svg and _texts_fit(svg) == []
    run = RunTelemetry(2, micro_batches=2)
    for step in range(40):  # single sessions and two micro-batches of 4
        sessions = [f"a-rather-long-session-name-{step}"] if step < 30 else [f"s{i}" for i in range(step % 2, 8, 2)]
        run.submitted(step, sessions, "decode", len(sessions), step * 0.01, slot=step % 2)
        run.add_stage_records(0, [StageRecord(step, sessions[0], step * 0.01, step * 0.01 + 0.005, 0, 0.005, 0, 0)])
        run.token(step, step * 0.01 + 0.009, 0.0001)
    run.finish()
    svg = run.svg()
    assert _texts_fit(svg) == [] and "micro-batch 0" in svg and "micro-batch 1" in svg and "and 8 more" in svg
    assert "batch of 4 sessions (s0, s2, s4, s6)" in svg


def test_cluster_configs_pass_rays_schema():
    """cluster/*.yaml are valid cluster-launcher configs, with token auth on and the dashboard on
    localhost in every start command."""
    yaml = pytest.importorskip("yaml")
    from pathlib import Path

    from ray.autoscaler._private.util import prepare_config, validate_config

    for path in sorted((Path(__file__).resolve().parents[1] / "cluster").glob("*.yaml")):
        config = prepare_config(yaml.safe_load(path.read_text()))
        validate_config(config)
        head = " ".join(config["head_start_ray_commands"])
        assert "--dashboard-host=127.0.0.1" in head, path
        for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
            assert "RAY_AUTH_MODE=token" in " ".join(commands), path
        assert "~/.ray/auth_token" in config["file_mounts"], path


def test_run_telemetry_stays_bounded():
    """A stream that serves for hours keeps the last ``max_steps`` step records, not all."""
    from dist_runtime.pipeline.telemetry import RunTelemetry

    run = RunTelemetry(2, max_steps=100)
    for step in range(1000):
        run.submitted(step, [step % 4], "decode", 1, float(step))
        run.token(step, step + 0.5, 0.0)
    run.token(10**6, 0.0, 0.0)  # a step dropped while in flight is ignored, not a KeyError
    assert len(run.steps) == 100 and min(run.steps) == 900
    assert run.tokens[0] == [0.5, 996.5, 250]
    summary = run.summary()
    assert summary["tokens"] == 100 and summary["session_decode_tokens_per_s"] > 0
    # a server's stream: every request a new session, and the oldest of them forgotten
    for step in range(1000, 1300):
        run.submitted(step, [f"request-{step}"], "prefill", 4, float(step))
        run.token(step, step + 0.25, 0.0)
    assert len(run.session_start) == len(run.first_token) == len(run.tokens) == 100
    assert "request-1299" in run.tokens and "request-1199" not in run.session_start
    run.token(1299, 1299.5, 0.0, sessions=["request-1000"])  # a forgotten session is not brought back
    assert "request-1000" not in run.first_token and run.summary()["ttft_ms_max"] == 250.0


def test_thread_env_lets_idle_threads_sleep_when_oversubscribed():
    from dist_runtime.pipeline.stage import thread_env

    assert thread_env(1, 1.0) == {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                  "NUMBA_NUM_THREADS": "1"}
    assert thread_env(2, 1.0)["OPENBLAS_THREAD_TIMEOUT"] == "4"  # stages taking turns on shared cores
    assert "OPENBLAS_THREAD_TIMEOUT" not in thread_env(2, 2.0)


@pytest.mark.parametrize("meta, words", [
    ({"pos": 0, "step": 1}, "'session' must be an int or a string"),
    ({"session": True, "pos": 0, "step": 1}, "'session' must be an int or a string"),
    ({"session": "s", "pos": -1, "step": 1}, "'pos' must be a non-negative integer"),
    ({"session": "s", "pos": 0, "step": 1.5}, "'step' must be a non-negative integer"),
    ({"session": "s", "pos": 0, "step": 1, "reset": 1}, "'reset' must be true or false"),
    ({"session": "s", "pos": 0, "step": 1, "logits": "max"}, "'logits' must be one of 'last', 'all', 'argmax', got 'max'"),
])
def test_a_step_header_from_the_wire_is_checked_field_by_field(meta, words):
    from dist_runtime.errors import TransportError

    with pytest.raises(TransportError, match=words):
        StepHeader.from_meta(meta)


def test_a_step_header_round_trips_through_its_meta():
    from dist_runtime.pipeline.header import BatchSegment

    for h in (StepHeader("s", 3, 7), StepHeader(4, 0, 1, reset=True, close=True, logits="all"),
              StepHeader(4, 0, 1, logits="argmax"), StepHeader("s", 0, 2, ceiling=96),
              StepHeader("a", 0, 3, batch=(BatchSegment("a", 0, 2, True, 40), BatchSegment("b", 5, 1)))):
        assert StepHeader.from_meta(h.to_meta()) == h
    assert StepHeader("s", 3, 7).to_meta() == {"session": "s", "pos": 3, "step": 7}
    four = StepHeader.from_meta({"session": "a", "pos": 0, "step": 1, "batch": [["a", 0, 2, True]]})
    assert four.batch == (BatchSegment("a", 0, 2, True, 0),)  # a segment without a ceiling: none


@pytest.mark.parametrize("meta, says", [
    ({"ceiling": -1}, "meta 'ceiling' must be a non-negative integer, got -1"),
    ({"ceiling": True}, "meta 'ceiling' must be a non-negative integer, got True"),
    ({"batch": [["a", 0, 1, False, "x"]]}, "meta 'ceiling' must be a non-negative integer, got 'x'"),
    ({"batch": [["a", 0, 1, False, 2, 3]]}, "must be [session, pos, rows, reset, ceiling]"),
])
def test_a_bad_ceiling_on_the_wire_is_a_transport_error(meta, says):
    from dist_runtime.errors import TransportError

    with pytest.raises(TransportError) as err:
        StepHeader.from_meta({"session": "a", "pos": 0, "step": 1, **meta})
    assert says in str(err.value)


def test_a_stage_grows_a_session_s_caches_to_the_ceiling_its_segment_carries(model, model_path):
    from dist_runtime.pipeline.header import BatchSegment

    stages = stages_for_plan(model.graph, make_plan(model.graph, stages=2, max_context=64))
    workers = _workers(stages, model_path)
    header = StepHeader("a", 0, 1, batch=(BatchSegment("a", 0, 3, True, 10), BatchSegment("b", 0, 2, True)))
    _run(workers, encode_message({"tokens": np.asarray([1, 2, 3, 4, 5], np.int32)}, header.to_meta()))
    for w in workers:
        sizes = {sid: {s.allocated for s in w._executor.session(sid).kv.values()} for sid in ("a", "b")}
        assert sizes == {"a": {10}, "b": {256}}  # "b" carried none: a whole block


def test_the_last_stage_sends_greedy_tokens_when_asked(model, model_path):
    """``logits: argmax`` (every session of the pass greedy): the last stage sends each segment's
    token, int32, chosen as Sampling.choose chooses; the same pass's logits give the same tokens."""
    from dist_runtime.pipeline.header import BatchSegment
    from dist_runtime.sampling import Sampling

    stages = stages_for_plan(model.graph, make_plan(model.graph, stages=2, max_context=64))
    workers = _workers(stages, model_path)
    batch = [list(BatchSegment("a", 0, 3)), list(BatchSegment("b", 0, 2))]

    def step(logits, sessions):
        meta = {"session": sessions[0], "pos": 0, "step": 1, "logits": logits, "reset": True,
                "batch": [[sessions[0], *batch[0][1:3], True], [sessions[1], *batch[1][1:3], True]]}
        return _run(workers, encode_message({"tokens": np.asarray([1, 2, 3, 4, 5], np.int32)}, meta))["logits"]

    rows = step("last", ["a", "b"])
    tokens = step("argmax", ["c", "d"])
    assert tokens.dtype == np.int32 and tokens.shape == (2,)
    assert list(tokens) == [Sampling().choose(r, np.random.default_rng(0)) for r in rows] == list(np.argmax(rows, -1))


def test_placement_gives_each_stage_the_cores_no_other_stage_computes_on():
    from dist_runtime.pipeline.launch import placement_threads

    one_node = [{"node_id": "a"}, {"node_id": "a"}, {"node_id": "a"}]
    assert placement_threads(one_node, {"a": 4}, 1, None) == (
        [4, 4, 4], "stages sharing a node take turns: each uses all its cores")
    threads, why = placement_threads(one_node, {"a": 4}, 2, None)  # two passes in flight: two at once
    assert threads == [2, 2, 2] and "split its cores" in why
    own = [{"node_id": "a"}, {"node_id": "b"}]
    assert placement_threads(own, {"a": 8, "b": 2}, 2, None) == (
        [8, 2], "each stage alone on its node: all its cores")
    assert placement_threads(own, {"a": 8, "b": 2}, 2, 3) == ([3, 3], "asked for (--threads-per-stage)")
    assert placement_threads([{"host": "h"}], {}, 1, None)[0] == [1]  # a node it cannot size: one thread
