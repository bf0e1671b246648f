"""The OpenAI API's request and response shapes (the subset `vaswani serve` answers) and its error bodies.

Requests are pydantic models that reject what the server cannot honour instead of ignoring it: an unknown field, a
field of the wrong type, `max_tokens` <= 0 or a feature that is not implemented (log probabilities, tools, penalties)
each end in a 400 whose body names the field, in OpenAI's error shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Responses are plain dicts built by the helpers at the end (`completion_body`, `chunk_body`), so a streamed chunk costs
one `json.dumps` and no model validation.
"""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_SEQUENCES = 4  # as OpenAI's API
MAX_CHOICES = 16


class OpenAIError(Exception):
    """An error the server answers with `status` and OpenAI's error body; the server keeps serving."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StrictModel(BaseModel):
    """Unknown fields are errors (a misspelt `max_token` must not silently do nothing); so are lax conversions
    ("8" for an integer)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """The fields both completion routes share."""

    model: str
    max_tokens: int | None = Field(default=None, description="new tokens at most; default: up to the context")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # Accepted at their no-op values only (clients send the defaults explicitly); anything else is a 400.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extension, for benchmarks that need answers of a fixed length.
    ignore_eos: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not stop for stop in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings, got {value!r}")
        return stops

    @model_validator(mode="after")
    def _supported(self):
        unsupported = {
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logprobs": bool(self.logprobs),
            "logit_bias": bool(self.logit_bias),
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"{name} is not supported by this server; leave it unset")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] = Field(description="a string, or text parts (other part types are not supported)")
    name: str | None = None

    def template_input(self) -> dict[str, str]:
        """The message as chat templates take it: the text parts joined into one string."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content, **({"name": self.name} if self.name else {})}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_max_completion_tokens(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"max_completion_tokens must be at least 1, got {value}")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(description="one prompt: a string or a list of token ids")
    echo: bool = False
    max_tokens: int | None = 16  # OpenAI's default for this route

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("prompt is empty")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class EmbeddingRequest(StrictModel):
    model: str
    input: str | list[str] = Field(description="a text or a list of texts")
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 (the openai client's default)
    user: str | None = None

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class ClassificationRequest(StrictModel):
    model: str
    input: str | list[str]

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


# ------------------------------------------------------------------------------------------- response bodies


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    kind: Literal["chat", "text"], id: str, model: str, choices: list[tuple[str, str]], usage: dict[str, int]
) -> dict[str, Any]:
    """A whole (non-streamed) answer; `choices` holds (text, finish_reason) per choice."""
    if kind == "chat":
        entries = [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": None}
            for i, (text, reason) in enumerate(choices)
        ]
        obj = "chat.completion"
    else:
        entries = [
            {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
            for i, (text, reason) in enumerate(choices)
        ]
        obj = "text_completion"
    return {"id": id, "object": obj, "created": int(time.time()), "model": model, "choices": entries, "usage": usage}


def chunk_body(
    kind: Literal["chat", "text"],
    id: str,
    created: int,
    model: str,
    index: int,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One server-sent event of a streamed answer, in OpenAI's chunk format."""
    if kind == "chat":
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {"id": id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk_body(kind: Literal["chat", "text"], id: str, created: int, model: str, usage: dict[str, int]):
    """The last chunk of a stream with `stream_options: {"include_usage": true}`: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
