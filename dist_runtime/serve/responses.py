"""The answers the server sends, as its OpenAPI schema (``GET /openapi.json``) documents them.

Documentation only: the endpoints build their answers as dicts, and FastAPI would otherwise
describe every one as "any JSON" and every error as its own 422 validation error, which this
server never sends.  tests/test_serve_fuzz.py checks real answers against these models, so they
cannot drift from what the endpoints build without a test failing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error object: every 4xx and 5xx of /v1 and /metrics."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"]
    model: str


class HealthDown(BaseModel):
    status: Literal["down"]
    message: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    kind: Literal["generate", "embed"]
    context_length: int | None
    chat: bool


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV rows came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian f32, for encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


#: One server-sent event of a stream (``stream: true``), in FastAPI's form for event streams.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a chunk (text_completion or chat.completion.chunk) as JSON, an error "
                                     "object as JSON if generation fails, and [DONE] last"}}}

CLIENT_ERROR = ("400: invalid input (`param` names it); 401: a missing or wrong API key (with --api-key); 404: "
                "an unknown model or path; 429 (with Retry-After): the queue is full")


def answers(ok: type[BaseModel] | None = None, *, stream: bool = False, client_errors: bool = True,
            server_errors: bool = False) -> dict:
    """A route's ``responses=``: ``ok`` as its 200 (with an event stream besides, for ``stream``)
    and OpenAI error objects for the 4xx and 5xx it can answer.  Ranges, not codes: naming
    any 4xx code would make FastAPI add its 422, which this server never sends."""
    out: dict = {}
    if ok is not None:
        out[200] = {"model": ok}
        if stream:
            out[200]["content"] = {"text/event-stream": {"itemSchema": SSE_EVENT}}
    if client_errors:
        out["4XX"] = {"model": ErrorBody, "description": CLIENT_ERROR}
    if server_errors:
        out["5XX"] = {"model": ErrorBody, "description": "500: generation failed; 503: the server is stopping"}
    return out
