"""Tool calls as open chat models write them, read into OpenAI `tool_calls` (whole or streamed) and enforced with
llguidance grammars. Formats have vLLM's `--tool-call-parser` names: `hermes` (Hermes, Qwen 2.5 / 3, our ChatML: text
and `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks) and `llama3_json` (Llama 3.1 / 3.2: the
answer is `{"name": ..., "parameters": {...}}`, or several joined by `;`, maybe after `<|python_tag|>`). A call's
`arguments` is the value's JSON text exactly as written, so streamed argument deltas concatenate to it; a block that is
not a JSON object with a string "name" stays in the content (the text outside calls, stripped; None when empty).

    >>> fmt = tool_call_format(None, tokenizer.chat_template)   # HermesFormat for a template with <tool_call>
    >>> content, calls = fmt.parse(answer)                      # never raises, never drops text but markers
    >>> deltas = [*(stream := fmt.stream()).feed(piece), *stream.finish()]     # OpenAI chunk deltas
    >>> grammar = fmt.grammar(tools, "required", parallel_tool_calls=False)    # Lark for llguidance
"""

import json
import logging
import re
import secrets
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

JSON_WHITESPACE = " \t\n\r"  # what json skips between tokens (str.isspace is wider)
_WHITESPACE, _DECODER = re.compile(f"[{JSON_WHITESPACE}]*"), json.JSONDecoder()


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and 24 hex characters."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One call the model wrote: the function's name and the raw JSON text of its arguments."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        """The call as an OpenAI chat completion message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _skip_whitespace(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()


def read_call(text: str, start: int, argument_keys: tuple[str, ...]) -> tuple[ToolCall, int] | None:
    """The call whose JSON object starts at `start` (after whitespace) and the index past its `}`, or None when there
    is no object with a string "name" there. Members are read with raw_decode, which gives each value's raw span: the
    first "name" and the first of `argument_keys` count ("{}" without one), as a stream must keep what it has sent."""
    if not text.startswith("{", i := _skip_whitespace(text, start)):
        return None
    name, arguments, seen_name = None, None, False
    i = _skip_whitespace(text, i + 1)
    try:
        while text.startswith('"', i):  # `{}` and a trailing comma end here too: neither is a call
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_whitespace(text, i)
            if not text.startswith(":", i):
                return None
            value_start = i = _skip_whitespace(text, i + 1)
            value, i = _DECODER.raw_decode(text, i)
            if key == "name" and not seen_name:
                name, seen_name = value, True
            elif key in argument_keys and arguments is None:
                arguments = text[value_start:i]
            i = _skip_whitespace(text, i)
            if not text.startswith(",", i):
                break
            i = _skip_whitespace(text, i + 1)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; absurd nesting recurses
        return None
    if not text.startswith("}", i) or not isinstance(name, str):
        return None
    return ToolCall(name, "{}" if arguments is None else arguments), i + 1


class _ObjectScanner:
    """`read_call` a character at a time, for streams (`arguments` grows as its text comes): `phase` ends "done" at
    the `}`, or "failed" once read_call would refuse the text (a finished value is checked by json.loads, as there)."""

    expected = {"open": "{", "first_key": '"}', "next_key": '"', "colon": ":", "after_value": ",}"}
    after = {"{": "first_key", ":": "value_start", ",": "next_key"}

    def __init__(self, argument_keys: tuple[str, ...]):
        self.argument_keys, self.phase = argument_keys, "open"
        self.name: str | None = None
        self.arguments: str | None = None  # the arguments' text so far, once their key is read
        self._key, self._raw, self._depth = None, "", 0  # the member's key, the key or value being read, its nesting
        self._seen_name = self._capturing = self._escaped = self._in_string = self.name_first = False

    def feed(self, ch: str) -> None:
        phase = self.phase
        if phase in ("key", "value"):
            self._value_char(ch)
        elif phase in ("done", "failed") or ch in JSON_WHITESPACE:
            return
        elif phase == "value_start" or ch == '"' and phase in ("first_key", "next_key"):
            self._capturing = phase == "value_start" and self._key in self.argument_keys and self.arguments is None
            if self._capturing:
                self.arguments = ""
            self.phase, self._raw, self._escaped = "value" if phase == "value_start" else "key", "", False
            self._value_char(ch)
        elif ch not in self.expected[phase]:
            self.phase = "failed"
        else:
            self.phase = ("done" if self.name is not None else "failed") if ch == "}" else self.after[ch]

    def _value_char(self, ch: str) -> None:
        kind = self._raw[:1]  # the first character says what the value is
        if kind and kind not in '{["' and (ch in JSON_WHITESPACE or ch in ",}]"):
            self._end()  # a number or literal ends at the character after it, which the object then reads
            self.feed(ch)
            return
        self._raw += ch
        if self._capturing:
            self.arguments += ch
        if not kind:
            kind, self._in_string, self._depth = ch, ch == '"', int(ch in "{[")
        elif self._in_string:  # a quote closes the string unless escaped
            self._in_string, self._escaped = self._escaped or ch != '"', not self._escaped and ch == "\\"
        elif ch in '"{[}]':
            self._in_string, self._depth = ch == '"', self._depth + (ch in "{[") - (ch in "}]")
        if kind == '"' and not self._in_string or kind in "{[" and self._depth == 0:
            self._end()

    def _end(self) -> None:
        try:
            value = json.loads(self._raw)
        except (ValueError, RecursionError):
            self.phase = "failed"
            return
        self._capturing = False
        if self.phase == "key":
            self._key, self.phase = value, "colon"
        elif self._key == "name" and not self._seen_name:  # the first "name" is the name, and must be a string
            self._seen_name, self.name = True, value if isinstance(value, str) else None
            self.name_first = self.arguments is None  # else the call is sent whole, once it is known to be one
            self.phase = "after_value" if self.name is not None else "failed"
        else:
            self.phase = "after_value"


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that starts `marker` without being all of it (held back)."""
    return next((size for size in range(min(len(text), len(marker) - 1), 0, -1) if text.endswith(marker[:size])), 0)


class ToolCallStream:
    """A format's parse as a stream: `feed(delta_text)` and `finish()` return OpenAI chat-completion-chunk deltas.
    Text comes as `{"content": ...}`, stripped as parse() strips it (leading whitespace dropped, a run of whitespace
    held until more text follows, dropped at the end), holding back any end that could still become a marker. A call
    comes as `{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}` once its
    name is read, then `{"tool_calls": [{"index", "function": {"arguments": piece}}]}` as its arguments' text grows
    (a call whose name follows its arguments comes whole once its object closes).
    Contents and each index's arguments concatenate to parse()'s, except where a stream cannot know: once a name is
    sent the call stays a call, so a block found invalid after it (bad JSON, or cut by max_tokens) ends as a truncated
    call (the text from the faulty character on is content) where parse() keeps the whole block as content."""

    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self):
        self.calls = 0  # calls announced so far, indexes 0..calls-1
        self._buffer, self._held_space, self._content_started = "", "", False  # text not yet read, whitespace held
        self._pending = ""  # the current call's text, read again as text if it fails before its name is sent
        self._scanner: _ObjectScanner | None = None
        self._announced, self._sent = False, 0  # the current call's name sent; how much of its arguments
        self._deltas: list[dict] = []

    def feed(self, delta_text: str) -> list[dict]:
        """The deltas that can be sent once `delta_text` is added to the answer (possibly none)."""
        self._buffer += delta_text
        self._advance(final=False)
        deltas, self._deltas = self._deltas, []
        return deltas

    def finish(self) -> list[dict]:
        """The last deltas, at the end of the answer: held text, and any unfinished block that never became a call."""
        self._advance(final=True)
        deltas, self._deltas = self._deltas, []
        return deltas

    def _content(self, text: str) -> None:
        body = text.rstrip()
        if not body:
            self._held_space += text
            return
        piece, self._held_space = self._held_space + body, text[len(body) :]
        if not self._content_started:
            piece, self._content_started = piece.lstrip(), True
        if self._deltas and "content" in self._deltas[-1]:
            self._deltas[-1]["content"] += piece
        else:
            self._deltas.append({"content": piece})

    def _open_call(self) -> None:
        self._scanner, self._pending, self._announced, self._sent = _ObjectScanner(self.argument_keys), "", False, 0

    def _scan(self, final: bool) -> str:
        """Read the buffer into the current call: "done", "failed", "cut" (the answer ended in it) or "more"."""
        scanner, read = self._scanner, len(self._buffer)
        for i, ch in enumerate(self._buffer):
            scanner.feed(ch)
            if scanner.phase in ("done", "failed"):
                read = i + 1
                break
        self._pending, self._buffer = self._pending + self._buffer[:read], self._buffer[read:]
        if scanner.phase == "failed":
            if self._announced:
                self._buffer = self._pending[-1] + self._buffer  # the faulty character and what follows are text
            return "failed"
        self._send_call(scanner)
        return scanner.phase if scanner.phase == "done" else "cut" if final else "more"

    def _send_call(self, scanner: _ObjectScanner) -> None:
        if not self._announced and scanner.name is not None and (scanner.name_first or scanner.phase == "done"):
            self._announced, self.calls = True, self.calls + 1
            function = {"name": scanner.name, "arguments": ""}
            call = {"index": self.calls - 1, "id": new_call_id(), "type": "function", "function": function}
            self._deltas.append({"tool_calls": [call]})
        arguments = "{}" if scanner.arguments is None and scanner.phase == "done" else scanner.arguments or ""
        if self._announced and len(arguments) > self._sent:
            piece = {"index": self.calls - 1, "function": {"arguments": arguments[self._sent :]}}
            self._deltas.append({"tool_calls": [piece]})
            self._sent = len(arguments)


class _HermesStream(ToolCallStream):
    start, end = "<tool_call>", "</tool_call>"
    _state = "text"  # text, call, after_call

    def _advance(self, final: bool) -> None:
        while True:
            if self._state == "text":
                at = self._buffer.find(self.start)
                if at < 0:
                    keep = len(self._buffer) - (0 if final else _partial_marker(self._buffer, self.start))
                    self._content(self._buffer[:keep])
                    self._buffer = self._buffer[keep:]
                    return
                self._content(self._buffer[:at])
                self._buffer, self._state = self._buffer[at + len(self.start) :], "call"
                self._open_call()
            elif self._state == "call":
                outcome = self._scan(final)
                if outcome == "more" or outcome == "cut" and self._announced:
                    return
                if outcome == "done":
                    self._state = "after_call"
                elif not self._announced:  # not a call: the marker is text, and what followed it is read again
                    self._content(self.start)
                    self._buffer, self._state = self._pending + self._buffer, "text"
                else:
                    self._state = "text"
            else:  # whitespace and the closing marker belong to the call; anything else is text
                rest = self._buffer.lstrip(JSON_WHITESPACE)
                if not final and self.end.startswith(rest):
                    return
                if rest.startswith(self.end):
                    self._buffer = rest[len(self.end) :]
                self._state = "text"


class _Llama3JsonStream(ToolCallStream):
    tag, argument_keys = "<|python_tag|>", ("parameters", "arguments")
    _state = "start"  # start, next (a call must follow), call, between (after a call), content
    _done = 0  # calls read to their end
    _fallback = ""  # the text since the last call's end (all of it before the first call): content if no call follows

    def _advance(self, final: bool) -> None:
        while True:
            rest = self._buffer.lstrip(JSON_WHITESPACE)
            skipped = self._buffer[: len(self._buffer) - len(rest)]
            if self._state == "content":
                self._content(self._buffer)
                self._buffer = ""
                return
            if self._state == "start":
                if not final and self.tag.startswith(rest):
                    return
                if rest.startswith(self.tag):
                    self._fallback, self._buffer = skipped + self.tag, rest[len(self.tag) :]
                self._state = "next"
            elif self._state == "next":
                if not rest and not final:
                    return
                if rest.startswith("{"):
                    self._fallback, self._buffer, self._state = self._fallback + skipped, rest, "call"
                    self._open_call()
                elif not rest and self._done:  # a trailing separator
                    self._buffer = ""
                    return
                else:  # no call: everything since the last call's end is text
                    self._buffer, self._state = self._fallback + self._buffer, "content"
            elif self._state == "call":
                outcome = self._scan(final)
                if outcome == "more" or outcome == "cut" and self._announced:
                    return
                if outcome == "done":
                    self._done, self._fallback, self._state = self._done + 1, "", "between"
                elif not self._announced:
                    self._buffer, self._state = self._fallback + self._pending + self._buffer, "content"
                else:
                    self._state = "content"
            else:  # between calls: a separator and the next call, or text to the end
                if not rest and not final:
                    return
                if rest.startswith(";"):
                    self._fallback, self._buffer, self._state = skipped + ";", rest[1:], "next"
                else:
                    self._state = "content"


class ToolCallFormat:
    """How a family of chat templates writes tool calls: `parse(text)` gives an answer's (content, calls), `stream()`
    reads one piece by piece, `grammar()` allows only calls (`start` is `calls_rule` or `call_rule` over `call`)."""

    name: str
    arguments_key: str
    stream_class: type[ToolCallStream]
    # JSON as json.dumps and templates' tojson write it, as models saw it (flexible spaces let weak models loop).
    json_style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def stream(self) -> ToolCallStream:
        """A `ToolCallStream` that turns an answer's text, piece by piece, into chunk deltas."""
        return self.stream_class()

    def grammar(self, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool | None = True) -> str:
        """A Lark grammar for llguidance that allows only calls in this format, to any of `tools` ("required") or to
        `{"type": "function", "function": {"name": ...}}`: one, or one or more unless `parallel_tool_calls` is False.
            >>> matcher = llguidance.LLMatcher(lltokenizer, fmt.grammar(tools, "required"))
        """
        functions = [tool.get("function", tool) for tool in tools or []]  # OpenAI's {"type": "function", ...}
        parameters = {function["name"]: function.get("parameters") or {"type": "object"} for function in functions}
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
        if name not in parameters and isinstance(tool_choice, dict):
            raise ValueError(f"the function {name!r} is not among the tools ({', '.join(parameters) or 'none'}).")
        if tool_choice != "required" and name is None or not parameters:
            raise ValueError(f"{tool_choice!r} has no grammar: give 'required' with one or more tools, or a function.")
        key = self.arguments_key
        calls = [
            {"type": "object", "properties": {"name": {"const": name}, key: schema}, "required": ["name", key]}
            | {"additionalProperties": False}
            for name, schema in ({name: parameters[name]} if name is not None else parameters).items()
        ]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        start = self.calls_rule if parallel_tool_calls is not False else self.call_rule
        return f"start: {start}\n{self.rules}call: %json {json.dumps({'x-guidance': self.json_style, **call})}\n"


class HermesFormat(ToolCallFormat):
    """`<tool_call>`, whitespace, a JSON object with a string "name" (the arguments: "arguments" or "parameters", "{}"
    without), whitespace and `</tool_call>` (optional: text may follow, or nothing), among text (Hermes, Qwen 2.5 / 3).
    A `<tool_call>` without such an object after it is content, and reading resumes after it."""

    name, arguments_key, stream_class = "hermes", "arguments", _HermesStream
    call_rule, calls_rule = "tool_call", 'tool_call ("\\n" tool_call)*'
    rules = 'tool_call: "<tool_call>\\n" call "\\n</tool_call>"\n'

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start, end = _HermesStream.start, _HermesStream.end
        content, calls, position = [], [], 0
        while (at := text.find(start, position)) >= 0:
            content.append(text[position:at])
            position = at + len(start)
            if (read := read_call(text, position, _HermesStream.argument_keys)) is None:
                content.append(start)
                continue
            call, position = read
            calls.append(call)
            if text.startswith(end, after := _skip_whitespace(text, position)):
                position = after + len(end)
        content.append(text[position:])
        return "".join(content).strip() or None, calls


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1 / 3.2: `{"name": ..., "parameters": {...}}` ("arguments" too), or several joined by `;`, maybe after
    `<|python_tag|>`. An answer whose first call is not such an object is all content; after a call, anything but `;`
    and a call is content from its end on (a `;` with nothing after it is dropped)."""

    name, arguments_key, stream_class = "llama3_json", "parameters", _Llama3JsonStream
    call_rule, calls_rule, rules = "call", 'call ("; " call)*', ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        position = _skip_whitespace(text, 0)
        if text.startswith(_Llama3JsonStream.tag, position):
            position += len(_Llama3JsonStream.tag)
        calls, rest_from = [], 0  # content is the text from the end of the last call on (all of it without calls)
        while (read := read_call(text, position, _Llama3JsonStream.argument_keys)) is not None:
            call, rest_from = read
            calls.append(call)
            if not text.startswith(";", after := _skip_whitespace(text, rest_from)):
                break
            position = _skip_whitespace(text, after + 1)
            if position == len(text):  # a trailing separator
                rest_from = position
                break
        return text[rest_from:].strip() or None, calls


TOOL_CALL_PARSERS: dict[str, ToolCallFormat] = {"hermes": HermesFormat(), "llama3_json": Llama3JsonFormat()}

# What in a chat template shows the format its model writes, most specific first.
_TEMPLATE_SIGNS = {
    "<tool_call>": "hermes",
    "<|python_tag|>": "llama3_json",
    '"parameters": dictionary of argument name': "llama3_json",  # Llama 3's instruction for JSON calls
}


def chat_template_format(chat_template: str | None) -> str | None:
    """The name of the tool-call format `chat_template` shows (`_TEMPLATE_SIGNS`), or None when it cannot tell."""
    return next((name for sign, name in _TEMPLATE_SIGNS.items() if sign in (chat_template or "")), None)


def tool_call_format(name: str | None, chat_template: str | None) -> ToolCallFormat:
    """The format named `name` (`--tool-call-parser`), or for None / "auto" the one `chat_template` uses; logged."""
    choices = ", ".join(TOOL_CALL_PARSERS)
    if name not in (None, "auto", *TOOL_CALL_PARSERS):
        raise ValueError(f"Unknown tool-call parser {name!r}: choose one of {choices}.")
    if name in TOOL_CALL_PARSERS:
        logger.info("Tool calls are read in the %s format, as --tool-call-parser asks.", name)
        return TOOL_CALL_PARSERS[name]
    for sign, detected in _TEMPLATE_SIGNS.items():
        if sign in (chat_template or ""):
            logger.info("Tool calls are read in the %s format: the chat template contains %r.", detected, sign)
            return TOOL_CALL_PARSERS[detected]
    raise ValueError(f"The chat template does not show its tool-call format: pass --tool-call-parser ({choices}).")


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as chat templates take them (transformers' tool-use convention): `tool_calls[*].function.
    arguments` JSON text becomes the object (templates write `arguments | tojson`), None values are dropped (a
    template's `is defined` sees them) but a missing or None content becomes "", and the rest (`tool_call_id`...) stays.
        >>> tokenizer.apply_chat_template(template_messages(request_messages), tools=tools, tokenize=False)
    """
    rendered = [{key: value for key, value in message.items() if value is not None} for message in messages]
    for message in rendered:
        message["content"] = message.get("content", "")
        if "tool_calls" in message:  # copied: the request's messages stay as they came
            message["tool_calls"] = [{**call, "function": {**call["function"]}} for call in message["tool_calls"]]
        for call in message.get("tool_calls", []):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except (KeyError, TypeError, ValueError):
                pass  # absent, already an object, or not JSON: the template writes it as it is
    return rendered
