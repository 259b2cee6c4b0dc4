"""``GET /metrics`` as Prometheus reads it (prometheus-client's parser): counters named ``_total``
with the values the requests imply, one observation per request in each latency and length
histogram, and each stage's memory -- in one process, and on two pipeline stages beside the plan's
estimate.  Also: a scrape does not wait for a slow memory read, and a failed read keeps the last
values."""

from __future__ import annotations

import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("tokenizers")
parser = pytest.importorskip("prometheus_client.parser")

from conftest import served_llama  # noqa: E402

from dist_runtime.serve.metrics import HISTOGRAMS, Metrics  # noqa: E402
from dist_runtime.serve.served_model import ServedModel  # noqa: E402
from dist_runtime.serve.server import Server, local_backend, pipeline_backend  # noqa: E402

LIVE_KINDS = {"resident", "peak", "weights", "kv_in_use", "kv_reserved"}


def scrape(url: str) -> dict:
    """``/metrics`` parsed: {family name: family}, after checking its content type."""
    r = httpx.get(url + "/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
    return {f.name: f for f in parser.text_string_to_metric_families(r.text)}


def value(families: dict, sample: str, **labels) -> float:
    """The one sample named ``sample`` with exactly ``labels``."""
    wanted = {k: str(v) for k, v in labels.items()}
    (found,) = [s.value for f in families.values() for s in f.samples if s.name == sample and s.labels == wanted]
    return found


def memory(families: dict, name: str = "dist_runtime_stage_memory_bytes") -> dict[str, dict[str, float]]:
    """{stage: {kind: bytes}} of a memory family."""
    out: dict = {}
    for s in families[name].samples:
        out.setdefault(s.labels["stage"], {})[s.labels["kind"]] = s.value
    return out


def _eventually(check, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def _requests(url: str) -> tuple[int, int]:
    """Two plain completions, a streamed completion and a streamed chat; (prompt tokens,
    generated tokens) as their usage says."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    usages = [c.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0).usage
              for p in ("w5 w6", "w7")]
    for chunk in c.completions.create(model="tiny", prompt="w8 w9 w10", max_tokens=4, stream=True,
                                      stream_options={"include_usage": True}):
        usages += [chunk.usage] if chunk.usage else []
    for chunk in c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=3,
                                           stream=True, stream_options={"include_usage": True}):
        usages += [chunk.usage] if chunk.usage else []
    assert len(usages) == 4
    return sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)


# -- one process -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_counters_histograms_and_memory_of_a_local_server(tmp_path):
    files = served_llama(tmp_path)
    model = ServedModel.open(files["model"], context=256, tokenizer=files["tok"])
    metrics = Metrics(max_length=model.context)
    with Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=8), metrics, port=0) as s:
        prompt, generated = _requests(s.url)
        got = scrape(s.url)

    assert value(got, "dist_runtime_requests_total", endpoint="/v1/completions", status=200) == 3
    assert value(got, "dist_runtime_requests_total", endpoint="/v1/chat/completions", status=200) == 1
    assert value(got, "dist_runtime_prompt_tokens_total") == prompt
    assert value(got, "dist_runtime_generated_tokens_total") == generated
    assert "dist_runtime_recoveries" not in got and "dist_runtime_stage_busy_seconds" not in got  # a pipeline's
    assert value(got, "dist_runtime_queued_sessions") == value(got, "dist_runtime_running_sessions") == 0
    for name in HISTOGRAMS:
        assert got[f"dist_runtime_{name}"].type == "histogram"
    per_request = set(HISTOGRAMS) - {"inter_token_latency_seconds"}
    assert {name: value(got, f"dist_runtime_{name}_count") for name in per_request} == dict.fromkeys(per_request, 4)
    # each token after a request's first is one inter-token gap
    assert value(got, "dist_runtime_inter_token_latency_seconds_count") == generated - 4
    assert value(got, "dist_runtime_request_generation_tokens_sum") == generated
    assert value(got, "dist_runtime_request_prompt_tokens_sum") == prompt
    assert value(got, "dist_runtime_time_to_first_token_seconds_sum") > 0
    buckets = [s.labels["le"] for s in got["dist_runtime_request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert buckets[-2:] == ["200.0", "+Inf"]  # 1-2-5 up to the context
    (stage,) = memory(got).items()
    assert stage[0] == "0" and set(stage[1]) == LIVE_KINDS
    assert all(stage[1][k] > 0 for k in ("resident", "peak", "weights"))
    assert "dist_runtime_stage_memory_planned_bytes" not in got  # no plan in one process


# -- two stages ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_memory_of_each_pipeline_stage_beside_the_plan(pipeline_model):
    pytest.importorskip("ray")
    from dist_runtime.pipeline import Pipeline, StageOptions

    model = ServedModel.open(pipeline_model, context=64)
    metrics = Metrics(max_length=model.context)
    pipe = Pipeline(pipeline_model, stages=2, max_context=64, options=StageOptions(cpus=0.5))
    backend = pipeline_backend(model, pipe, metrics, max_queue=8)
    with Server(model, backend, metrics, port=0, on_close=pipe.close) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = c.completions.create(model="tiny4", prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert _eventually(lambda: "dist_runtime_stage_memory_bytes" in scrape(s.url)
                           and len(memory(scrape(s.url))) == 2)
        got = scrape(s.url)
        assert value(got, "dist_runtime_e2e_request_latency_seconds_count") == 1
        assert value(got, "dist_runtime_generated_tokens_total") == out.usage.completion_tokens
        assert _eventually(lambda: metrics.get("stage_busy_seconds", stage=1) > 0)
    live, planned = memory(got), memory(got, "dist_runtime_stage_memory_planned_bytes")
    assert set(live) == set(planned) == {"0", "1"}
    for k, st in enumerate(pipe.plan.stages):
        assert set(live[str(k)]) == LIVE_KINDS
        assert all(live[str(k)][kind] > 0 for kind in ("resident", "peak", "weights"))
        m = st.memory
        assert planned[str(k)] == {"weights": m.weights, "kv": m.kv, "activations": m.activations,
                                   "reserve": m.reserve, "total": m.total,
                                   **({"budget": m.budget} if m.budget is not None else {})}
        assert planned[str(k)]["weights"] > 0


# -- the memory read -------------------------------------------------------------------------------------
def _memory_of(metrics: Metrics) -> dict:
    return memory({f.name: f for f in parser.text_string_to_metric_families(metrics.text())})


def test_a_slow_memory_read_does_not_hold_the_scrape_and_shows_when_done():
    reads = []

    def slow() -> list[dict]:
        reads.append(time.monotonic())
        time.sleep(0.6)
        return [{"resident": 7}]

    metrics = Metrics()
    metrics.watch_memory(slow, wait=0.05)
    start = time.monotonic()
    assert _memory_of(metrics) == {} and _memory_of(metrics) == {}  # nothing read yet
    assert time.monotonic() - start < 0.5 and len(reads) == 1  # one read at a time, not one per scrape
    assert _eventually(lambda: _memory_of(metrics) == {"0": {"resident": 7}}, 5)


def test_a_failed_memory_read_keeps_the_last_values():
    answers = iter([[{"resident": 5, "plan": {"weights": 1}}], RuntimeError("stage 1 is dead")])

    def read() -> list[dict]:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    metrics = Metrics()
    metrics.watch_memory(read, planned=lambda: [{"weights": 3, "budget": 10}])
    assert _memory_of(metrics) == {"0": {"resident": 5}}  # the nested "plan" is not a gauge
    assert _memory_of(metrics) == {"0": {"resident": 5}}
    planned = memory({f.name: f for f in parser.text_string_to_metric_families(metrics.text())},
                     "dist_runtime_stage_memory_planned_bytes")
    assert planned == {"0": {"weights": 3, "budget": 10}}


def test_stage_busy_seconds_and_recoveries_are_read_when_scraped():
    """A busy server's stream never ends: what the stages and the coordinator counted so far is
    read at each scrape, not when a stream ends."""
    busy = iter([[{"resident": 9, "busy_seconds": 1.5}, {"resident": 8, "busy_seconds": 0.5}],
                 [{"resident": 9, "busy_seconds": 2.5}, {"resident": 8, "busy_seconds": 0.75}]])
    recoveries = [0]
    metrics = Metrics()
    metrics.watch_memory(lambda: next(busy), wait=5.0)
    metrics.watch_pipeline(list, lambda: recoveries[0])
    families = {f.name: f for f in parser.text_string_to_metric_families(metrics.text())}
    assert value(families, "dist_runtime_stage_busy_seconds_total", stage=0) == 1.5
    assert value(families, "dist_runtime_stage_busy_seconds_total", stage=1) == 0.5
    assert memory(families) == {"0": {"resident": 9}, "1": {"resident": 8}}  # busy is not a memory kind
    assert value(families, "dist_runtime_recoveries_total") == 0
    recoveries[0] = 3
    families = {f.name: f for f in parser.text_string_to_metric_families(metrics.text())}
    assert value(families, "dist_runtime_stage_busy_seconds_total", stage=0) == 2.5
    assert value(families, "dist_runtime_recoveries_total") == 3
    assert metrics.get("recoveries") == 3
    with pytest.raises(KeyError):  # a misspelt name is not a 0
        metrics.get("recovery")


def test_each_metrics_has_its_own_registry():
    a, b = Metrics(), Metrics()
    a.count("requests", endpoint="/x", status=200)
    assert a.get("requests", endpoint="/x", status=200) == 1 and b.get("requests", endpoint="/x", status=200) == 0
