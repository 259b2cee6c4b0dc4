"""The request bodies the server accepts, with OpenAI's field names and types (strict: a number
given as a string is a 400, as OpenAI answers it).  Fields OpenAI defines that the server does
not use are accepted and ignored, so that clients sending their defaults work."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError


def _whole(value):
    # JSON has one number type: 2.0 is the integer 2 to JSON Schema (and to the OpenAPI schema's
    # readers), so strict mode, which refuses any float, would refuse what the schema allows.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int(**bounds):
    """An integer field's type: strict (no strings, no booleans) but 2.0 is 2.  The bounds go
    before the validator: after it, pydantic still checks them but the schema no longer states them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


def _lone_surrogate(value) -> str | None:
    """Where in ``value`` (decoded JSON) a string or key holds half of a UTF-16 surrogate pair
    (``"\\ud800"`` in JSON), as ``messages.0.content``; None when every string is Unicode text."""
    if not isinstance(value, (str, dict, list)):
        return None
    todo = [((), value)]
    while todo:  # not recursive: the JSON decoder allows deeper nesting than Python's stack
        path, value = todo.pop()
        if isinstance(value, str):
            if not _unicode(value):
                return ".".join(map(str, path)) or "body"
            continue
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and not _unicode(key):
                return ".".join(map(str, path)) or "body"  # the object holding it: the key cannot be shown
            if isinstance(item, (str, dict, list)):  # ids by the thousand are neither
                todo.append((path + (key,), item))
    return None


def _unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data):
        # JSON can escape half a surrogate pair, and Python decodes it to a str with no UTF-8
        # form, on which the tokenizers fail: refused here, for any field (a chat template may
        # render any of them), before it gets that far.
        where = _lone_surrogate(data)
        if where is not None:
            raise PydanticCustomError("invalid_unicode", "not Unicode text: it holds half of a UTF-16 surrogate "
                                      "pair (an escape such as \\ud800 without its other half)", {"field": where})
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: free text, any JSON object (JSON mode), or JSON matching
    ``json_schema.schema``; the last two are enforced by constrained sampling
    (dist_runtime/grammar.py).  ``json_schema`` type without a ``json_schema``: a 400."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationRequest(_Body):
    """What completions and chat share."""

    model: str
    max_tokens: _int(ge=1) | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: _int(ge=0) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: _int(ge=0) | None = None
    stop: str | list[str] | None = None
    n: _int(ge=1, le=16) = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(GenerationRequest):
    prompt: str | list[_int()] | list[str] | list[list[_int()]]
    logprobs: _int(ge=0, le=20) | None = None  # this many alternatives per token


class ChatMessage(_Body):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls...: the template's business
    role: str
    content: str | list[dict] | None = None

    def rendered(self) -> dict:
        """The message as a chat template expects it, content parts joined into one text."""
        content = self.content
        if isinstance(content, list):
            content = "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
        return self.model_dump(exclude_none=True) | {"content": content or ""}


class ToolFunction(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # calls are a list: one or more
    max_completion_tokens: _int(ge=1) | None = None  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: _int(ge=0, le=20) | None = None  # alternatives per token, with logprobs


class EmbeddingRequest(_Body):
    model: str
    # The schema by hand: pydantic writes min_length beside the anyOf, where JSON Schema bounds
    # only strings, so [] looked valid (and was a 400).
    input: Annotated[str | list[str], Field(min_length=1), WithJsonSchema(
        {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string"}, "minItems": 1}],
         "title": "Input"})]
    encoding_format: Literal["float", "base64"] = "float"
