"""Structured output (``response_format``): JSON mode and JSON schemas enforced by constrained
sampling (dist_runtime/grammar.py, llguidance) on a random-weight model with a byte-level
tokenizer: every output parses and validates against its schema (jsonschema), alone or batched
with the same tokens; bad schemas are a 400 naming ``response_format``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from dist_runtime.engine import LocalEngine, Request, generate  # noqa: E402
from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights  # noqa: E402
from dist_runtime.executor import GraphExecutor  # noqa: E402
from dist_runtime.grammar import Constraint, GrammarTokenizer, json_grammar  # noqa: E402
from dist_runtime.model import save_model  # noqa: E402

CFG = LlamaConfig(vocab=260, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
EOS = 256

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "tag"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}, "label": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"choice": {"const": "yes"}, "score": {"type": "number", "minimum": 0,
                                                                            "maximum": 1}},
     "required": ["choice"], "additionalProperties": False},
]


def byte_level_tokenizer(path: Path) -> Path:
    """A byte-level BPE of the 256 bytes (no merges) and ``</s>``: any text, JSON included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)} | {"</s>": EOS}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    model = root / "json.model"
    save_model(model, llama_graph(CFG), llama_weights(CFG, seed=11),
               {**llama_metadata(CFG), "eos_token_id": EOS}).close()
    return {"model": model, "tok": byte_level_tokenizer(root / "tokenizer.json")}


@pytest.fixture(scope="module")
def grammar_tokenizer(served):
    return GrammarTokenizer(served["tok"].read_text(), CFG.vocab, [EOS])


def decoded(served, ids) -> str:
    from dist_runtime.importers.tokenizer import Tokenizer

    return Tokenizer(served["tok"]).decode([t for t in ids if t != EOS])


def test_every_schema_s_outputs_validate_and_batching_changes_no_token(served, grammar_tokenizer):
    from dist_runtime.sampling import Sampling

    def requests(tag):
        return [Request(f"{tag}{i}", [72, 105, 33 + i], 96, Sampling(temperature=1.0, seed=i),
                        frozenset({EOS}), constraint=Constraint.json(grammar_tokenizer, SCHEMAS[i % len(SCHEMAS)]))
                for i in range(10)]

    batched = generate(LocalEngine(GraphExecutor(served["model"])), requests("b"))
    alone = [generate(LocalEngine(GraphExecutor(served["model"]), max_sessions=1), [r]) for r in requests("a")]
    for i, ids in enumerate(batched.tokens.values()):
        value = json.loads(decoded(served, ids))
        jsonschema.validate(value, SCHEMAS[i % len(SCHEMAS)])
    assert list(batched.tokens.values()) == [next(iter(a.tokens.values())) for a in alone]


def test_json_mode_holds_to_an_object_and_the_grammar_ends_the_session(served, grammar_tokenizer):
    """JSON mode on a random model: its strings may run to max_tokens, but what it writes is the
    start of an object, every token of it allowed; a bounded schema's grammar ends the session
    before max_tokens, as a stop token would."""
    c = Constraint.json(grammar_tokenizer, None)
    result = generate(LocalEngine(GraphExecutor(served["model"])),
                      [Request("j", [1, 2, 3], 40, stop=frozenset({EOS}), constraint=c)])
    text = decoded(served, next(iter(result.tokens.values())))
    assert text.startswith("{") and not c.matcher.is_error()
    bounded = Constraint.json(grammar_tokenizer, SCHEMAS[1])
    result = generate(LocalEngine(GraphExecutor(served["model"])),
                      [Request("k", [1, 2, 3], 200, stop=frozenset({EOS}), constraint=bounded)])
    ids = next(iter(result.tokens.values()))
    assert bounded.finished and len(ids) < 200 and json.loads(decoded(served, ids))["tag"] in ("red", "green", "blue")


def test_a_schema_that_cannot_compile_is_an_error_naming_it(grammar_tokenizer):
    from dist_runtime.errors import DistRuntimeError

    with pytest.raises(DistRuntimeError, match="grammar cannot be used"):
        Constraint(grammar_tokenizer, json_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))


@pytest.mark.slow  # a live server
def test_fifty_requests_with_schemas_through_the_openai_client(served):
    import httpx
    import openai

    from dist_runtime.serve.metrics import Metrics
    from dist_runtime.serve.served_model import ServedModel
    from dist_runtime.serve.server import Server, local_backend

    model = ServedModel.open(served["model"], tokenizer=served["tok"])
    metrics = Metrics()
    with Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=64), metrics, port=0) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)

        def ask(i):
            schema = SCHEMAS[i % len(SCHEMAS)]
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i % 5}", "schema": schema, "strict": True}}
            if i % 2:
                r = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": f"n{i}"}],
                                                   max_tokens=128, temperature=0.8, seed=i, response_format=fmt) \
                    if model.chat_template else None
                text = r.choices[0].message.content if r else None
            else:
                text = None
            if text is None:
                r = client.completions.create(model=model.id, prompt=f"value {i}:", max_tokens=128,
                                              temperature=0.8, seed=i, extra_body={"response_format": fmt})
                text = r.choices[0].text
            jsonschema.validate(json.loads(text), schema)
            return text

        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(ask, range(50)))
        assert len(outputs) == 50
        stream = client.completions.create(model=model.id, prompt="x", max_tokens=128, stream=True, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[1]}}})
        jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), SCHEMAS[1])
        mode = client.completions.create(model=model.id, prompt="x", max_tokens=24,
                                         extra_body={"response_format": {"type": "json_object"}})
        assert mode.choices[0].text.startswith("{")
        bad = httpx.post(s.url + "/v1/completions", json={
            "model": model.id, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
                "name": "b", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
        missing = httpx.post(s.url + "/v1/completions", json={"model": model.id, "prompt": "x",
                                                              "response_format": {"type": "json_schema"}})
        assert missing.status_code in (400, 422)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": SCHEMAS[1]}},
         {"type": "function", "function": {"name": "add", "parameters": SCHEMAS[2]}}]
TOOL_TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


def test_tool_calls_are_read_in_the_shapes_models_write_them():
    from dist_runtime.serve.schema import Tool
    from dist_runtime.serve.tools import calls_schema, parse_calls

    tools = [Tool.model_validate(t) for t in TOOLS]
    for text in ('[{"name": "add", "arguments": {"items": [1, 2]}}]', '{"name": "add", "parameters": {"items": [1]}}',
                 '<tool_call>\n{"name": "add", "arguments": {"items": [3]}}\n</tool_call>'):
        calls = parse_calls(text, tools)
        assert calls and calls[0]["function"]["name"] == "add" and json.loads(calls[0]["function"]["arguments"])["items"]
    for text in ("hello", '{"name": "nope", "arguments": {}}', '[{"name": "add", "arguments": 3}]', "{"):
        assert parse_calls(text, tools) is None
    schema = calls_schema(tools, "add")
    jsonschema.validate([{"name": "add", "arguments": {"items": [1]}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"ok": True, "tag": "red"}}], schema)
    two = [{"name": "add", "arguments": {"items": [1]}}] * 2
    jsonschema.validate(two, calls_schema(tools, "required"))  # parallel calls: OpenAI's default
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(two, calls_schema(tools, "required", parallel=False))


@pytest.mark.slow  # a live server
def test_required_and_named_tool_choice_answer_with_calls(served, tmp_path):
    import httpx
    import openai

    from dist_runtime.serve.metrics import Metrics
    from dist_runtime.serve.served_model import ServedModel
    from dist_runtime.serve.server import Server, local_backend

    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    model = ServedModel.open(served["model"], tokenizer=served["tok"], chat_template=template)
    metrics = Metrics()
    with Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=16), metrics, port=0) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "weather in Paris?"}]
        for choice, names in (("required", {"get_weather", "add"}),
                              ({"type": "function", "function": {"name": "add"}}, {"add"})):
            for seed in range(4):
                r = client.chat.completions.create(model=model.id, messages=messages, tools=TOOLS, tool_choice=choice,
                                                   max_tokens=200, temperature=0.9, seed=seed,
                                                   parallel_tool_calls=False)
                c = r.choices[0]
                assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
                for call in c.message.tool_calls:
                    assert call.function.name in names and call.id.startswith("call_")
                    params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
                    jsonschema.validate(json.loads(call.function.arguments), params)
        stream = client.chat.completions.create(model=model.id, messages=messages, tools=TOOLS, tool_choice="required",
                                                max_tokens=200, stream=True, seed=1, parallel_tool_calls=False)
        chunks = list(stream)
        deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert deltas and chunks[-1].choices[0].finish_reason == "tool_calls"
        assert all(d.function.name in {"get_weather", "add"} for d in deltas)
        text = client.chat.completions.create(model=model.id, messages=messages, tools=TOOLS, tool_choice="none",
                                              max_tokens=8, seed=1)
        assert text.choices[0].message.tool_calls is None and text.choices[0].finish_reason in ("stop", "length")
        auto = client.chat.completions.create(model=model.id, messages=messages, tools=TOOLS, max_tokens=8, seed=1)
        assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
        for body, says in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
                            "not among the tools"),
                           ({"tool_choice": "required"}, "tool_choice needs tools")):
            bad = httpx.post(s.url + "/v1/chat/completions", json={"model": model.id, "messages": messages, **body})
            assert bad.status_code == 400 and says in bad.json()["error"]["message"]
            assert bad.json()["error"]["param"] == "tool_choice"
