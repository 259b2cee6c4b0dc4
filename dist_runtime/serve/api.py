"""The HTTP API: OpenAI's endpoints, shapes and error objects, on FastAPI.

``create_app`` builds the app for one :class:`~dist_runtime.serve.served_model.ServedModel` and its
backend: an :class:`~dist_runtime.serve.bridge.EngineBridge` for a generative model (completions,
chat), an :class:`~dist_runtime.serve.bridge.Encoder` for a sentence-transformers model
(embeddings).  Every error is ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import time
import uuid
from pathlib import Path
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException

from ..errors import DistRuntimeError
from ..requests import Request as EngineRequest, check_requests
from .bridge import EngineBridge, Encoder, QueueFull, ShuttingDown, Subscription
from .metrics import Metrics
from .responses import (ChatCompletion, Completion, EmbeddingList, Health, HealthDown, ModelCard, ModelList,
                        answers)
from .schema import ChatRequest, CompletionRequest, EmbeddingRequest, GenerationRequest
from . import tools
from .served_model import ServedModel
from .text import StopText, TokenText, render_chat

PAGE = Path(__file__).resolve().parent / "static" / "index.html"


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, self.status, headers=self.headers)


def create_app(model: ServedModel, backend: EngineBridge | Encoder, metrics: Metrics, *,
               api_key: str | None = None, keep_alive: float = 10.0, health=None, admin=None) -> FastAPI:
    """The app.  ``api_key``: required as ``Authorization: Bearer`` on /v1, /metrics and /admin;
    ``keep_alive``: seconds between SSE comments while a stream waits for a token; ``health``:
    a callable saying what is down (a message), or a state that is not a failure (a dict with its
    ``status``, e.g. a stage being recovered), or None when all is well; ``admin``: a pipeline's
    operations (``server.PipelineAdmin``: its stages, drain a node), or None in one process."""
    app = FastAPI(title="dist-runtime", summary="OpenAI-compatible API of one dist-runtime model")
    _errors(app)
    auth = [Depends(_authorizer(api_key))] if api_key is not None else []
    keyed = api_key is not None  # only then can a route answer 401
    # The schema lists what this model offers; the other routes stay, to say why they refuse.
    generates, embeds = model.kind == "generate", model.kind == "embed"

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/health", responses={200: {"model": Health}, 503: {"model": HealthDown}})
    async def health_check():
        state = await asyncio.to_thread(health) if health is not None else None  # may ping stages
        if not isinstance(state, str) and not backend.alive:
            state = "the engine has stopped"
        if state:
            if isinstance(state, str):
                return JSONResponse({"status": "down", "message": state}, 503)
            # Recovering: requests are accepted and wait for the replacement, none fails, so 200
            # (docs/serving.md): a liveness probe must not restart a server that is healing.
            return {"model": model.id, **state}
        return {"status": "ok", "model": model.id}

    # response_class=Response: no media type of its own, so the 200 is text only and errors are JSON
    @app.get("/metrics", dependencies=auth, response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus' text exposition format"},
                        **answers(client_errors=keyed)})
    async def metrics_text():
        # on a thread: a scrape may wait (briefly) for the stages' memory
        return Response(await asyncio.to_thread(metrics.text), media_type=metrics.content_type)

    def _admin():
        if admin is None:
            raise APIError(404, "this server runs the model in one process: it has no pipeline to manage",
                           type="not_found_error")
        return admin

    @app.get("/admin/pipeline", dependencies=auth, include_in_schema=admin is not None)
    async def pipeline_state():
        return await asyncio.to_thread(_admin().state)

    @app.post("/admin/drain", dependencies=auth, include_in_schema=admin is not None)
    async def drain(request: Request):
        ops = _admin()
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, 'the body is not JSON: send {"node": "<node id>"}') from None
        node = body.get("node") if isinstance(body, dict) else None
        if not isinstance(node, str) or not node.strip():
            raise APIError(400, 'node: a node id (or its first characters) is required, e.g. {"node": "3f9a1c"}; '
                                'GET /admin/pipeline lists the stages\' nodes', param="node")
        return await asyncio.to_thread(ops.drain, node.strip())

    @app.get("/v1/models", dependencies=auth, responses=answers(ModelList, client_errors=keyed))
    async def list_models():
        return {"object": "list", "data": [_model_card(model)]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth, responses=answers(ModelCard))
    async def get_model(model_id: str):
        _check_model(model, model_id, param=None)
        return _model_card(model)

    @app.post("/v1/completions", dependencies=auth, include_in_schema=generates,
              responses=answers(Completion, stream=True, server_errors=True))
    async def completions(body: CompletionRequest, request: Request):
        _require(model, "generate", "/v1/completions")
        _check_model(model, body.model)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) \
            else [body.prompt]
        ids = [_encode(model, p) for p in prompts]
        return await _generate(request, model, backend, metrics, body, ids, body.max_tokens or 16,
                               chat=False, keep_alive=keep_alive, logprobs=body.logprobs)

    @app.post("/v1/chat/completions", dependencies=auth,
              include_in_schema=generates and model.chat_template is not None,
              responses=answers(ChatCompletion, stream=True, server_errors=True))
    async def chat_completions(body: ChatRequest, request: Request):
        _require(model, "generate", "/v1/chat/completions")
        _check_model(model, body.model)
        if model.chat_template is None:
            raise APIError(400, f"model {model.id!r} has no chat template (its source had none for `convert` "
                                f"to keep; see `dist-runtime serve --chat-template`): "
                                f"use /v1/completions", param="messages", code="no_chat_template")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        try:
            mode = tools.mode_of(body.tools, body.tool_choice)
        except DistRuntimeError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        if mode not in (None, "auto") and body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, "tool_choice required or a named function holds the answer to tool calls: "
                                "response_format cannot also hold it", param="tool_choice")
        text = render_chat(model.chat_template, [m.rendered() for m in body.messages], model.special_tokens(),
                           tools.template_tools(body.tools) if body.tools else None)
        ids = model.tokenizer.encode(text, add_special_tokens=False)  # the template wrote them
        max_tokens = body.max_tokens or body.max_completion_tokens
        if max_tokens is None:
            max_tokens = max(model.context - len(ids), 1) if model.context else 16
        return await _generate(request, model, backend, metrics, body, [ids], max_tokens, chat=True,
                               keep_alive=keep_alive, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                               calls=(body.tools, mode, body.parallel_tool_calls) if mode else None)

    @app.post("/v1/embeddings", dependencies=auth, include_in_schema=embeds,
              responses=answers(EmbeddingList, server_errors=True))
    async def embeddings(body: EmbeddingRequest):
        _require(model, "embed", "/v1/embeddings")
        _check_model(model, body.model)
        from ..embed import token_batches

        texts = [body.input] if isinstance(body.input, str) else body.input
        batches = token_batches(model.tokenizer, texts, 32, model.metadata)  # read once, truncating
        used = int(sum(b["attention_mask"].sum() for b in batches))
        vectors = await backend.embed(batches)
        metrics.count("prompt_tokens", used)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
                 if body.encoding_format == "base64" else v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model.id,
                "usage": {"prompt_tokens": used, "total_tokens": used}}

    app.add_middleware(_Counted, metrics=metrics)
    return app


# -- requests in ---------------------------------------------------------------------------------
#: Declares the scheme in the OpenAPI schema (so clients and the fuzz test know to send the key);
#: the check itself is ``_authorizer``'s, to answer OpenAI's 401 rather than FastAPI's 403.
_BEARER = HTTPBearer(auto_error=False, description="the server's --api-key")


def _authorizer(api_key: str):
    def check(request: Request, _=Depends(_BEARER)) -> None:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided: give it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
    return check


def _check_model(model: ServedModel, name: str, param: str | None = "model") -> None:
    if name != model.id:
        raise APIError(404, f"The model {name!r} does not exist: this server serves {model.id!r}",
                       param=param, code="model_not_found")


def _require(model: ServedModel, kind: str, endpoint: str) -> None:
    if model.kind != kind:
        what = "generates text" if model.kind == "generate" else "is an encoder (sentence embeddings)"
        raise APIError(400, f"model {model.id!r} {what}: {endpoint} is not available for it",
                       code="unsupported_endpoint")


def _encode(model: ServedModel, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if model.tokenizer is None:
        raise APIError(400, f"model {model.id!r} has no tokenizer: give the prompt as token ids", param="prompt")
    return model.tokenizer.encode(prompt)


def _constraint(model: ServedModel, response_format, calls) -> Callable[[], object]:
    """What makes each choice's grammar state for ``response_format``, or for tool calls that
    ``calls`` (tools, mode) requires (nothing for text); a 400 naming the problem for a schema
    that cannot be enforced."""
    if calls is not None and calls[1] != "auto":
        schema, param = tools.calls_schema(*calls), "tools"  # (tools, mode, parallel)
    elif response_format is None or response_format.type == "text":
        return lambda: None
    elif response_format.type == "json_schema" and response_format.json_schema is None:
        raise APIError(400, "response_format of type json_schema needs json_schema", param="response_format")
    else:
        schema, param = (response_format.json_schema.schema_ or {} if response_format.type == "json_schema"
                         else None), "response_format"
    from ..grammar import Constraint, json_grammar

    try:
        tokenizer = model.grammar_tokenizer()
        grammar = json_grammar(schema)
        Constraint(tokenizer, grammar)  # compiled once here, so that a bad schema is a 400 before any work
    except DistRuntimeError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
    return lambda: Constraint(tokenizer, grammar)


def _sampling(body: GenerationRequest):
    """OpenAI's defaults: temperature 1; temperature 0 is greedy, whatever filters are given."""
    from ..errors import SamplingError
    from ..sampling import Sampling, fresh_seed

    seed = fresh_seed() if body.seed is None else body.seed
    if body.temperature == 0:
        return Sampling(seed=seed)
    try:
        return Sampling.from_options(temperature=1.0 if body.temperature is None else body.temperature,
                                     top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, seed=seed)
    except SamplingError as e:
        raise APIError(400, str(e), param="temperature") from None


# -- generation ------------------------------------------------------------------------------------
class _Choice:
    """One generated sequence: its text so far (cut at a stop string) and how it ended."""

    def __init__(self, index: int, model: ServedModel, stops: list[str], calls: tuple | None = None) -> None:
        self.index, self.stop_ids, self.tokenizer = index, model.stop, model.tokenizer
        # Tool calls (tools, mode): the text is held back while it may be calls (always, unless
        # auto and it began as plain text), and read as calls at the end (serve/tools.py).
        self.calls, self.held, self.holding = calls, "", calls is not None
        self.tool_calls: list[dict] | None = None
        self.text, self.stops = TokenText(model.tokenizer), StopText(stops)
        self.tokens, self.finish_reason, self.error = 0, None, None
        self.cached = 0  # prompt tokens the prefix cache gave
        self.logprobs: list = []  # (token, TokenLogprobs) not yet sent
        self.offset = 0  # of the next token's text, for completions' text_offset

    def take(self, event) -> str:
        """The text ``event`` adds (empty while it may be the start of a stop string)."""
        if event.error is not None:
            self.error, self.finish_reason = event.error, "error"
            return ""
        self.tokens += 1
        self.cached += event.cached
        if event.logprobs is not None:
            self.logprobs.append((event.token, event.logprobs))
        piece, stopped = self.stops.add(self.text.add(event.token))
        if not stopped and event.done:
            rest, stopped = self.stops.add(self.text.finish())
            piece += rest if stopped else rest + self.stops.flush()
            self.finish_reason = "stop" if stopped or event.token in self.stop_ids else "length"
        elif stopped:
            self.finish_reason = "stop"
        return self._held(piece) if self.holding else piece

    def message(self, text: str) -> dict:
        """The chat answer: its text, or its tool calls."""
        if self.tool_calls is not None:
            return {"role": "assistant", "content": None, "tool_calls": self.tool_calls}
        return {"role": "assistant", "content": text}

    def _held(self, piece: str) -> str:
        """``piece`` held back while the text may be tool calls; at the end the calls, or the
        text it was after all."""
        self.held += piece
        start = self.held.lstrip()
        if self.calls[1] == "auto" and start and not start.startswith(("[", "{", "<tool_call>"[:len(start)])):
            self.holding = False  # plain text: it streams from here
            return self.held
        if self.finish_reason is None:
            return ""
        self.tool_calls = tools.parse_calls(self.held, self.calls[0])
        if self.tool_calls is None:
            return self.held
        self.finish_reason = "tool_calls"
        return ""

    def sent_logprobs(self, chat: bool) -> dict | None:
        """The log-probabilities of the tokens taken since the last call, in OpenAI's shape for
        chat or for completions (None when the request asked for none)."""
        if not self.logprobs:
            return None
        taken, self.logprobs = self.logprobs, []
        text = self._token_text
        if chat:
            def entry(t, lp):
                return {"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
            return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(i, p) for i, p in lp.top]}
                                for t, lp in taken]}
        offsets = []
        for t, _ in taken:
            offsets.append(self.offset)
            self.offset += len(text(t))
        return {"tokens": [text(t) for t, _ in taken], "token_logprobs": [lp.logprob for _, lp in taken],
                "top_logprobs": [{text(i): p for i, p in lp.top} for _, lp in taken], "text_offset": offsets}

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)


async def _generate(request: Request, model: ServedModel, bridge: EngineBridge, metrics: Metrics,
                    body: GenerationRequest, prompts: list[list[int]], max_tokens: int, *, chat: bool,
                    keep_alive: float, logprobs: int | None, calls: tuple | None = None):
    sampling = _sampling(body)
    constraint = _constraint(model, body.response_format, calls)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    requests = [EngineRequest(f"{rid}-{i}", ids, max_tokens, sampling.with_seed(sampling.seed + i % body.n),
                              model.stop, logprobs=logprobs, constraint=constraint())
                for i, ids in enumerate(p for p in prompts for _ in range(body.n))]
    try:
        check_requests(requests, vocab=model.vocab, context=model.context)
    except DistRuntimeError as e:
        raise APIError(400, str(e), param="max_tokens" if "context" in str(e) else "prompt",
                       code="context_length_exceeded" if "context" in str(e) else None) from None
    pool = getattr(bridge.engine, "max_kv_rows", None)  # the KV rows this process's memory holds
    if pool is not None and any(len(r.prompt) + r.max_new_tokens > pool for r in requests):
        raise APIError(400, f"the prompt plus max_tokens need more KV rows than the {pool} this server's memory "
                            f"holds", param="max_tokens", code="context_length_exceeded")
    if len(requests) > bridge.max_queue:  # could never fit: a 429 would have the client retry forever
        raise APIError(400, f"{len(requests)} choices (n x prompts) exceed the {bridge.max_queue} sessions this "
                            f"server holds at once (--max-queue)", param="n")
    try:
        sub = bridge.subscribe(requests, keep_alive)
    except QueueFull as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
    except ShuttingDown as e:
        raise APIError(503, str(e), type="server_error") from None
    choices = {r.session: _Choice(i, model, body.stops, calls) for i, r in enumerate(requests)}
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model.id}
    prompt_tokens = sum(map(len, prompts)) * body.n
    metrics.count("prompt_tokens", prompt_tokens)

    def usage() -> dict:
        done, cached = sum(c.tokens for c in choices.values()), sum(c.cached for c in choices.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": cached}}

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(sub, choices, head, chat, usage if include_usage else None),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts = {c.index: "" for c in choices.values()}
    collect = asyncio.ensure_future(_collect(sub, choices, texts))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():  # the client left: its sessions are cancelled as the collector ends
            collect.cancel()
    if not collect.done() or collect.cancelled():
        return PlainTextResponse("", 499)
    collect.result()
    failed = next((c.error for c in choices.values() if c.error is not None), None)
    if failed is not None:
        raise APIError(503 if isinstance(failed, ShuttingDown) else 500, f"generation failed: {failed}",
                       type="server_error")
    out = [{"index": c.index, "logprobs": c.sent_logprobs(chat), "finish_reason": c.finish_reason,
            **({"message": c.message(texts[c.index])} if chat else {"text": texts[c.index]})}
           for c in choices.values()]
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": out, "usage": usage()}


async def _events(sub: Subscription, choices: dict):
    """(choice, new text) per token; None for a keep-alive pause.  A choice that hit a stop
    string leaves the engine at once; the subscription's unfinished sessions are cancelled when
    this generator is closed (the client left)."""
    try:
        async for event in sub:
            if event is None:
                yield None
                continue
            choice = choices[event.session]
            if choice.finish_reason is not None:  # a token already in flight when a stop string ended it
                continue
            piece = choice.take(event)
            if choice.finish_reason is not None and not event.done:
                sub.finish(event.session)
            yield choice, piece
    finally:
        sub.close()


async def _collect(sub: Subscription, choices: dict, texts: dict) -> None:
    async for item in _events(sub, choices):
        if item is not None:
            texts[item[0].index] += item[1]


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(sub: Subscription, choices: dict, head: dict, chat: bool, usage):
    """Server-sent events as OpenAI streams them, ``data: [DONE]`` last."""
    def chunk(choice, piece: str, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": piece} if piece or first else {})
            if choice.tool_calls is not None and finish:  # the calls, whole, in one delta
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(choice.tool_calls)]
            item = {"index": choice.index, "delta": delta, "logprobs": choice.sent_logprobs(True), "finish_reason": finish}
        else:
            item = {"index": choice.index, "text": piece, "logprobs": choice.sent_logprobs(False),
                    "finish_reason": finish}
        return _data({**head, "choices": [item], **({"usage": None} if usage else {})})

    if chat:
        for choice in choices.values():
            yield chunk(choice, "", None, first=True)
    async for item in _events(sub, choices):
        if item is None:
            yield ": keep-alive\n\n"
            continue
        choice, piece = item
        if choice.error is not None:
            yield _data({"error": {"message": f"generation failed: {choice.error}", "type": "server_error",
                                   "param": None, "code": None}})
            break
        finish = choice.finish_reason
        if piece or finish:
            yield chunk(choice, piece, finish)
    else:
        if usage:
            yield _data({**head, "choices": [], "usage": usage()})
    yield "data: [DONE]\n\n"


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _model_card(model: ServedModel) -> dict:
    return {"id": model.id, "object": "model", "created": model.created, "owned_by": "dist-runtime",
            "kind": model.kind, "context_length": model.context, "chat": model.chat_template is not None}


# -- errors and bookkeeping ----------------------------------------------------------------------
def _errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "invalid_unicode":  # a model's whole input is checked: ctx names the field
            loc.append(first["ctx"]["field"])
        if first.get("type") == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {first.get('msg')}").response()
        where = ".".join(loc) or None
        return APIError(400, f"{where or 'body'}: {first.get('msg')}", param=where,
                        code="invalid_type" if "type" in first.get("type", "") else first.get("type")).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()  # 405's Allow

    @app.exception_handler(DistRuntimeError)
    async def refused(request, exc: DistRuntimeError):
        return APIError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        # A bug, but clients still get an error object they can parse; Starlette logs the
        # traceback after this answers.
        return APIError(500, f"internal error ({type(exc).__name__}); see the server's log",
                        type="server_error").response()


class _Counted:
    """ASGI middleware: counts answered requests by route and status (unknown paths as one)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {}

        async def sending(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status.setdefault("code", 500)  # answered by Starlette's outermost middleware, after this one
            raise
        finally:
            route = getattr(scope.get("route"), "path", "other")
            self.metrics.count("requests", endpoint=route, status=status.get("code", 499))
