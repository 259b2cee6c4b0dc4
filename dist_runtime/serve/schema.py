"""The request bodies the server accepts, with OpenAI's field names and types (strict: a number
given as a string is a 400, as OpenAI answers it).  Fields OpenAI defines that the server does
not use are accepted and ignored, so that clients sending their defaults work."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class GenerationRequest(_Body):
    """What completions and chat share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)  # this many alternatives per token


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
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # alternatives per token, with logprobs


class EmbeddingRequest(_Body):
    model: str
    input: str | list[str] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
