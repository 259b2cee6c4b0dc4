"""The request bodies the server accepts, with OpenAI's field names and types (strict: a number
given as a string is a 400, as OpenAI answers it).  Fields OpenAI defines that the server does
not use are accepted and ignored, so that clients sending their defaults work."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema


def _whole(value):
    # JSON has one number type: 2.0 is the integer 2 to JSON Schema (and to the OpenAPI schema's
    # readers), so strict mode, which refuses any float, would refuse what the schema allows.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int(**bounds):
    """An integer field's type: strict (no strings, no booleans) but 2.0 is 2.  The bounds go
    before the validator: after it, pydantic still checks them but the schema no longer states them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


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


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
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
