"""``dist-runtime serve`` on pipeline stages (Ray): the same tokens as one process, the stages'
busy time in the metrics, a stage killed mid-stream recovered with the stream going on as a
fault-free run would have (also with 8 concurrent streams), /health while it recovers, and a
session closed while a stage is dead."""

from __future__ import annotations

import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
ray = pytest.importorskip("ray")

from conftest import wait_dead  # noqa: E402

from dist_runtime.pipeline import Pipeline, StageOptions  # noqa: E402
from dist_runtime.serve.metrics import Metrics  # noqa: E402
from dist_runtime.serve.served_model import ServedModel  # noqa: E402
from dist_runtime.serve.server import Server, local_backend, pipeline_backend, pipeline_health  # noqa: E402

# Ray once for the module (conftest); slow: a live server on Ray stages
pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]
ASK = {"model": "tiny4", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 4, "n": 3}


def _texts(url: str, stream: bool = False) -> list[str]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    if not stream:
        return [ch.text for ch in c.completions.create(**ASK).choices]
    out = [""] * ASK["n"]
    for chunk in c.completions.create(**ASK, stream=True):
        for ch in chunk.choices:
            out[ch.index] += ch.text
    return out


def _eventually(check, seconds: float = 30.0) -> bool:
    """A scrape waits for the stages' reports at most a second, then shows the last ones read."""
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


@pytest.fixture(scope="module")
def reference(pipeline_model) -> list[str]:
    model = ServedModel.open(pipeline_model, context=64)
    metrics = Metrics()
    with Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=8), metrics, port=0) as s:
        return _texts(s.url)


def test_stages_give_the_tokens_of_one_process_and_survive_a_killed_stage(pipeline_model, reference):
    model = ServedModel.open(pipeline_model, context=64)
    metrics = Metrics()
    pipe = Pipeline(pipeline_model, stages=2, max_context=64, options=StageOptions(cpus=0.5))
    backend = pipeline_backend(model, pipe, metrics, max_queue=8)
    with Server(model, backend, metrics, port=0, health=lambda: None, on_close=pipe.close) as s:
        assert _texts(s.url) == reference
        assert _eventually(lambda: metrics.get("stage_busy_seconds", stage=1) > 0)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = [""] * ASK["n"]
        stream = c.completions.create(**ASK, stream=True)
        for i, chunk in enumerate(stream):
            for ch in chunk.choices:
                out[ch.index] += ch.text
            if i == 3:  # mid-stream: a stage dies
                actor, pid = pipe.actors[1], pipe.reports[1]["pid"]
                ray.kill(actor)
                wait_dead(actor, pid)
        assert out == reference
        assert _eventually(lambda: metrics.get("recoveries") == ASK["n"])  # each session was rebuilt
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
    assert pipe.actors == []  # closed with the server


def test_health_says_recovering_while_a_killed_stage_is_replaced_then_ok(pipeline_model, reference):
    """/health as a client sees it at each point: ok; recovering (which stage, 200) from the
    moment the engine noticed the dead stage until the replacement has answered; ok after, with
    the stream's text that of a fault-free run.  The recovery is observed from inside it -- the
    coordinator's ``repair`` asks /health before and after placing the new actor, and again when
    the first replayed step's reply is awaited -- so the test does not race it.  Then a stage killed while idle is down (503) until a request replaces it."""
    model = ServedModel.open(pipeline_model, context=64)
    metrics = Metrics()
    pipe = Pipeline(pipeline_model, stages=2, max_context=64, options=StageOptions(cpus=0.5))
    backend = pipeline_backend(model, pipe, metrics, max_queue=8)
    co = pipe.coordinator
    with Server(model, backend, metrics, port=0, health=pipeline_health(pipe), on_close=pipe.close) as s:
        def health() -> tuple[int, dict]:
            r = httpx.get(s.url + "/health", timeout=30)
            return r.status_code, r.json()

        assert health() == (200, {"status": "ok", "model": "tiny4"})
        seen: list = []
        real_repair = co.repair

        def observed_repair(dead, progress):
            seen.append(("before", co.recovering(), health()))
            repaired = real_repair(dead, progress)
            seen.append(("after", co.recovering(), health()))
            channel = repaired.channel
            real_get = channel.get

            def observed_get(handle, timeout=None):  # the replacement's first reply: a replayed step
                if len(seen) == 2:
                    seen.append(("replay", co.recovering(), health()))
                return real_get(handle, timeout)

            channel.get = observed_get
            return repaired

        co.repair = observed_repair
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = [""] * ASK["n"]
        for i, chunk in enumerate(c.completions.create(**ASK, stream=True)):
            for ch in chunk.choices:
                out[ch.index] += ch.text
            if i == 3:
                actor, pid = pipe.actors[1], pipe.reports[1]["pid"]
                ray.kill(actor)
                wait_dead(actor, pid)
        assert out == reference  # the stream went on as a fault-free run
        assert [when for when, _, _ in seen] == ["before", "after", "replay"]  # one recovery, one attempt
        for (when, state, (code, body)), phase in zip(seen, ["replacing", "replacing", "replaying"]):
            assert state is not None and state.stages == (1,) and state.phase == phase, (when, state)
            assert code == 200 and body["status"] == "recovering" and body["model"] == "tiny4", (when, body)
            assert body["stages"] == [1] and body["phase"] == phase and body["attempt"] == 1, (when, body)
            assert "stage 1" in body["message"] and body["seconds"] >= 0, (when, body)
        assert co.recovering() is None
        assert health() == (200, {"status": "ok", "model": "tiny4"})

        # Idle, nothing notices a dead stage but /health's ping: down, until a request comes.
        co.repair = real_repair
        actor, pid = pipe.actors[0], pipe.reports[0]["pid"]
        ray.kill(actor)
        wait_dead(actor, pid)
        code, body = health()
        assert code == 503 and body == {"status": "down", "message": "stage(s) 0 do not answer"}
        assert _texts(s.url) == reference
        assert health() == (200, {"status": "ok", "model": "tiny4"})
    assert pipe.actors == []


def _stream_text(url: str, seed: int, chunks: list | None = None) -> str:
    """One streamed completion of its own seed; ``chunks`` (if given) counts what arrived."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    text = ""
    for chunk in c.completions.create(**(ASK | {"n": 1, "seed": seed, "max_tokens": 40}), stream=True):
        text += "".join(ch.text for ch in chunk.choices)
        if chunks is not None:
            chunks.append(seed)
    return text


def test_a_stage_killed_during_8_concurrent_streams_leaves_every_stream_as_a_fault_free_run(pipeline_model):
    """8 clients stream at once (8 seeds); once they are under way a stage is killed: each stream
    ends with the text of the same request served by one process, with no fault."""
    from concurrent.futures import ThreadPoolExecutor

    model = ServedModel.open(pipeline_model, context=64)
    metrics = Metrics()
    with Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=8), metrics, port=0) as s:
        expected = [_stream_text(s.url, seed) for seed in range(8)]
    assert len(set(expected)) > 1  # the seeds matter: a mixed-up stream would show
    metrics = Metrics()
    pipe = Pipeline(pipeline_model, stages=2, max_context=64, sessions=8, options=StageOptions(cpus=0.5))
    backend = pipeline_backend(model, pipe, metrics, max_queue=8)
    with Server(model, backend, metrics, port=0, health=pipeline_health(pipe), on_close=pipe.close) as s:
        chunks: list = []
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(_stream_text, s.url, seed, chunks) for seed in range(8)]
            deadline = time.monotonic() + 60
            while len(set(chunks)) < 8 and time.monotonic() < deadline:  # every stream under way
                time.sleep(0.01)
            assert len(set(chunks)) == 8
            assert sum(not f.done() for f in streams) >= 4  # the kill hits streams under way (they run in step)
            actor, pid = pipe.actors[0], pipe.reports[0]["pid"]
            ray.kill(actor)
            wait_dead(actor, pid)
            got = [f.result(timeout=120) for f in streams]
        assert got == expected
        assert _eventually(lambda: metrics.get("recoveries") >= 1)
        assert httpx.get(s.url + "/health").json()["status"] == "ok"


def test_closing_a_session_while_a_stage_is_dead_passes_it_over(pipeline_model):
    """The server closes each finished session at once; a stage that died meanwhile holds no
    caches, so closing passes it over (it raised Ray's ActorDiedError, which failed every request
    of the server), and the next request recovers the stage with the tokens of before."""
    from dist_runtime.requests import Request

    pipe = Pipeline(pipeline_model, stages=2, max_context=64, options=StageOptions(cpus=0.5))
    try:
        before = [e.token for e in pipe.coordinator.stream([Request("a", [5, 6, 7], 6)])]
        actor, pid = pipe.actors[1], pipe.reports[1]["pid"]
        ray.kill(actor)
        wait_dead(actor, pid)
        pipe.coordinator.close_session("a")
        assert "a" not in pipe.coordinator.sessions
        assert [e.token for e in pipe.coordinator.stream([Request("b", [5, 6, 7], 6)])] == before
        assert len(pipe.coordinator.recoveries) == 1
    finally:
        pipe.close()
