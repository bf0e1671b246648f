"""The OpenAI API's request shapes (the subset `vaswani serve` answers) and its error bodies.

Requests are pydantic models that reject what the server cannot honour instead of ignoring it: an unknown field, a
field of the wrong type or out of range (the sampling values are checked as vLLM checks them, non-finite numbers
included), or a feature that is not implemented (the deprecated `functions`) each end in a 400
whose body names the field, in OpenAI's error shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Besides OpenAI's fields, the completion routes take vLLM's sampling extensions that clients written for vLLM send:
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens` and `spaces_between_special_tokens`. An answer may be constrained by one of OpenAI's
`response_format` (json_object, json_schema), vLLM's `structured_outputs` or its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` (`SamplingFields.constraint`); a chat request may offer `tools`.

The response bodies are in `responses.py`.
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..constraints import Grammar
from .sampling import MAX_LOGPROBS

# OpenAI's API takes 4 stop strings; vLLM takes any number. A bound keeps the per-token check cheap.
MAX_STOP_SEQUENCES = 64
MAX_CHOICES = 16
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions route's bound (OpenAI's)
NULL_MEANS_DEFAULT = (
    "temperature",
    "top_p",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stream",
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
MAX_LOGIT_BIAS = 300  # OpenAI's bound on the entries of logit_bias


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


class ConstraintError(ValueError):
    """A request's constraint on its answer cannot be built; `field` is the request field that carried it (None when
    the problem is between fields)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class StrictModel(BaseModel):
    """Unknown fields are errors (a misspelt `max_token` must not silently do nothing); so are lax conversions
    ("8" for an integer) and non-finite numbers (NaN, Infinity)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`: the schema the answer must satisfy, with its name."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the answer is always held to the schema, strict or not


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format takes json_schema exactly when its type is "json_schema"')
        return self


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs`: one of `json` (a schema), `regex`, `choice`, `grammar` (Lark or GBNF/EBNF) or
    `json_object`; `disable_any_whitespace` writes JSON compactly."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # there is one engine here, so no fallback to disable
    disable_additional_properties: bool = False

    model_config = ConfigDict(populate_by_name=True)

    def grammar_of(self) -> Grammar | None:
        given = {
            "json": self.json_schema,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
        }
        named = [name for name, value in given.items() if value is not None]
        if len(named) > 1:
            raise ValueError(f"structured_outputs takes one constraint, got {', '.join(named)}")
        flexible = not self.disable_any_whitespace
        if self.json_schema is not None:
            schema = self.json_schema
            if self.disable_additional_properties:
                schema = closed_objects(json.loads(schema) if isinstance(schema, str) else schema)
            return Grammar.json_schema(schema, flexible)
        if self.json_object:
            return Grammar.json_object(flexible)
        if self.regex is not None:
            return Grammar.regex(self.regex)
        if self.choice is not None:
            return Grammar.choice(self.choice)
        return Grammar.grammar(self.grammar) if self.grammar is not None else None


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that does not say (vLLM's
    `disable_additional_properties`)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if closed.get("type") == "object" or "properties" in closed:
        closed.setdefault("additionalProperties", False)
    return closed


class SamplingFields(StrictModel):
    """The fields both completion routes share; ranges as vLLM checks them (temperature 0 is greedy; a positive one
    below 0.01 is raised to 0.01 by `SamplingParams`)."""

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
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # vLLM's extensions: top_k -1 or 0 is off.
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    # vLLM's extension, for benchmarks that need answers of a fixed length.
    ignore_eos: bool = False
    # vLLM's: end-of-sequence (and stop_token_ids) masked until this many tokens; extra ids that end with "stop"; a
    # stop string kept in the text; how token ids become text.
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # OpenAI's: token id (a string key in JSON) -> a bias in [-100, 100] added to its score before sampling.
    logit_bias: dict[str, float] | None = None
    # Constraints on the answer's text (at most one): OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's deprecated function calling: accepted at its no-op values only (clients send the defaults); use tools.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator(*NULL_MEANS_DEFAULT, mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """null stands for the default (vLLM takes it so; some clients send every field)."""
        return cls.model_fields[info.field_name].default if value is None else value

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
            raise ValueError(f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings, got {len(stops)}")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if len(value or {}) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes up to {MAX_LOGIT_BIAS} tokens, got {len(value)}")
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f'logit_bias keys are token ids (as strings, e.g. {{"42": -100}}), got {key!r}')
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values are between -100 and 100, got {bias} for token {key}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(value) > MAX_STOP_SEQUENCES or any(token < 0 for token in value)):
            raise ValueError(f"stop_token_ids takes up to {MAX_STOP_SEQUENCES} non-negative token ids")
        return value

    def token_biases(self) -> dict[int, float] | None:
        """`logit_bias` keyed by token id (None when empty)."""
        return {int(key): bias for key, bias in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("functions", "function_call")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value and value != "none":  # an empty list or "none" asks for nothing: clients send them as defaults
            raise ValueError(f"{info.field_name} is deprecated by OpenAI and not served here; send tools instead")
        return value

    def constraint(self) -> tuple[str, Grammar] | None:
        """The constraint the request puts on its answer's text, with the field that carried it (None: free text); a
        `ConstraintError` names a bad constraint (and its field), or two given at once."""
        given: dict[str, Any] = {}
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            given["response_format"] = Grammar.json_object
        elif response_format is not None and response_format.type == "json_schema":
            given["response_format"] = lambda: Grammar.json_schema(response_format.json_schema.json_schema)
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.grammar_of
        makers = {
            "guided_json": Grammar.json_schema,
            "guided_regex": Grammar.regex,
            "guided_choice": Grammar.choice,
            "guided_grammar": Grammar.grammar,
        }
        for name, make in makers.items():
            if getattr(self, name) is not None:
                given[name] = lambda make=make, value=getattr(self, name): make(value)
        if len(given) > 1:
            raise ConstraintError(f"a request takes one constraint on its answer, got {' and '.join(given)}")
        for name, make in given.items():
            try:
                grammar = make()
            except ValueError as error:
                raise ConstraintError(f"{name}: {error}", field=name) from None
            return (name, grammar) if grammar is not None else None
        return None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = Field(
        default=None, description="a string, or text parts (other part types are not supported)"
    )
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, sent back with the tools' results
    tool_call_id: str | None = None  # a tool message: the call it answers
    refusal: str | None = None  # OpenAI's assistant messages carry it; clients send them back as they came

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's tool calls may come without)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def template_input(self) -> dict[str, Any]:
        """The message as chat templates take it: the text parts joined into one string, tool calls as OpenAI sends
        them (`tools.template_messages` turns their arguments into the dicts templates expect)."""
        content = self.content if not isinstance(self.content, list) else "".join(part.text for part in self.content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Tools the model may call: given to the chat template, and its calls parsed from the answer. tool_choice "auto"
    # (the default with tools) lets the model choose; "required" and a named function are enforced by a grammar.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, "none") and not info.data.get("tools"):
            raise ValueError("tool_choice needs tools: send the tools the model may call, or drop tool_choice")
        return value

    @property
    def tool_mode(self) -> str | None:
        """How the answer uses the tools: None (no tools, or tool_choice "none"), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_max_completion_tokens(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"max_completion_tokens must be at least 1, got {value}")
        return value

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def alternatives(self) -> int | None:
        """The alternatives reported per token (None: no log probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a prompt (a string or a list of token ids) or a list of prompts"
    )
    echo: bool = False
    max_tokens: int | None = 16  # OpenAI's default for this route
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if len(value) == 0 or any(not isinstance(prompt, int) and len(prompt) == 0 for prompt in value):
            raise ValueError("prompt is empty, or holds an empty prompt")
        return value

    @model_validator(mode="after")
    def _echo_without_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs (the prompt's log probabilities) is not supported; drop one of them")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one entry each: a string or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def alternatives(self) -> int | None:
        return self.logprobs


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
