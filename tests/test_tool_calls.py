"""Tool calls (vaswani/serving/tools.py) and the ChatML template's tool support (vaswani/data/chat.py).

Oracles: the arguments each answer was written from (json.dumps of a dict the test holds), parse() for the streams
(every chunking must reassemble to it), llguidance's matcher and the `jsonschema` package for the grammars, and a
literal copy of the template as it was before tools for the rendering without them.
"""

import json
import logging
import random
import re

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest

from vaswani.data import corpus_stories
from vaswani.data.chat import CHATML_TEMPLATE, chat_tokenizer
from vaswani.serving.tools import (
    TOOL_CALL_PARSERS,
    HermesFormat,
    Llama3JsonFormat,
    ToolCall,
    chat_template_format,
    template_messages,
    tool_call_format,
)

HERMES, LLAMA = TOOL_CALL_PARSERS["hermes"], TOOL_CALL_PARSERS["llama3_json"]

# The template before tool support, the oracle for rendering without tools.
CHATML_BEFORE_TOOLS = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def hermes_block(name: str, arguments: dict, key: str = "arguments") -> str:
    return f"<tool_call>\n{json.dumps({'name': name, key: arguments})}\n</tool_call>"


def llama_call(name: str, arguments: dict, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: arguments})


def calls_of(calls: list[ToolCall]) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


# --- parse -------------------------------------------------------------------------------------------------------


def test_hermes_parses_one_call_with_its_raw_arguments():
    arguments = {"city": "Paris", "days": [1, 2]}
    content, calls = HERMES.parse(hermes_block("get_weather", arguments))
    assert content is None
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", json.dumps(arguments))]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert calls[0].to_openai() == {
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
    }


def test_hermes_parses_content_before_two_calls_and_keeps_the_arguments_as_written():
    first, second = {"city": "Lyon"}, {"a": 1, "b": True}
    spaced = '{ "name" : "add" ,\n  "arguments" :  {"a": 1,   "b": true} }'  # whitespace kept inside the value
    text = f"Let me check.\n{hermes_block('get_weather', first)}\n<tool_call>{spaced}</tool_call>"
    content, calls = HERMES.parse(text)
    assert content == "Let me check."
    assert calls_of(calls) == [("get_weather", first), ("add", second)]
    assert calls[1].arguments == '{"a": 1,   "b": true}'
    assert calls[0].id != calls[1].id


def test_hermes_keeps_invalid_blocks_as_content():
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    nameless = '<tool_call>\n{"arguments": {}}\n</tool_call>'
    text = f"A {broken} B {nameless} C {hermes_block('add', {'a': 2})}"
    content, calls = HERMES.parse(text)
    assert content == f"A {broken} B {nameless} C"
    assert calls_of(calls) == [("add", {"a": 2})]


def test_duplicate_keys_keep_their_first_value_as_a_stream_must():
    content, calls = HERMES.parse('<tool_call>{"name": "f", "arguments": [1], "name": "g", "arguments": [2]}')
    assert (content, [(call.name, call.arguments) for call in calls]) == (None, [("f", "[1]")])


def test_hermes_without_a_call_is_all_content():
    assert HERMES.parse("  Just text, <tool_call nearly.\n") == ("Just text, <tool_call nearly.", [])
    assert HERMES.parse(" \n ") == (None, [])


def test_llama3_parses_one_call_after_the_python_tag_and_two_separated_by_semicolons():
    arguments = {"city": "Oslo"}
    assert calls_of(LLAMA.parse("<|python_tag|>" + llama_call("get_weather", arguments))[1]) == [
        ("get_weather", arguments)
    ]
    text = f" {llama_call('get_weather', arguments)}; {llama_call('add', {'a': 3}, key='arguments')}"
    content, calls = LLAMA.parse(text)
    assert content is None
    assert calls_of(calls) == [("get_weather", arguments), ("add", {"a": 3})]
    assert calls[0].arguments == json.dumps(arguments)


def test_llama3_keeps_text_and_invalid_calls_as_content():
    assert LLAMA.parse("The weather is fine.") == ("The weather is fine.", [])
    broken = '{"name": "add", "parameters": {"a": }}'
    assert LLAMA.parse(broken) == (broken, [])
    content, calls = LLAMA.parse(llama_call("add", {"a": 1}) + " and then some text")
    assert (content, calls_of(calls)) == ("and then some text", [("add", {"a": 1})])


# --- streaming ---------------------------------------------------------------------------------------------------

NESTED = {
    "query": "a } b { c",
    "quote": 'one " then } and ]',  # an escaped quote must not end the string
    "backslash": "ends with \\",  # nor must an escaped backslash escape the closing quote
    "deep": {"list": [1, {"x": [None, True, -2.5e3]}]},
    "é": "日本",
}
STREAMED_ANSWERS = {
    "hermes": [
        "Plain text, no calls at all.",
        hermes_block("get_weather", {"city": "Paris"}),
        "Sure!\n\n" + hermes_block("search", NESTED) + "\n" + hermes_block("add", {"a": 1}) + "\n",
        '<tool_call>\n{"arguments": {"a": [1, "]"]}, "name": "add"}\n</tool_call> after',  # name after arguments
        '<tool_call>{"name": "now"}</tool_call>',  # no arguments: "{}"
        '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}, "name": "g"}</tool_call>',  # firsts
        '<tool_call>{"name": "n", "arguments": 12}\n text <tool_call> not json </tool_call> end <tool_',
        '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>x',  # a name that is not a string: content
        '<tool_call>{"arguments": {"a": 1}, "name": "f", "x": tru}</tool_call>',  # invalid after a late name: content
        'x <tool_call>\n{"arguments": {"a": "unfinished',  # cut before its name: content
        "Unicode: 日本語 </tool_call> <tool_call\n",
    ],
    "llama3_json": [
        "Plain text, no calls at all.",
        llama_call("get_weather", {"city": "Paris"}),
        "<|python_tag|>" + llama_call("search", NESTED) + "; " + llama_call("add", {"a": 1}, key="arguments"),
        '  {"parameters": {"q": "}"}, "name": "f"};{"name": "g"}; ',
        llama_call("add", {"a": 1}) + " trailing words",
        llama_call("add", {"a": 1}) + "; not a call",
        '{"parameters": {"a": 1 2}, "name": "add"}',  # invalid arguments before the name: content
        "<|python_tag|> no json here",
        '{"nam": "x"}',
        "<|python",
    ],
}


def reassemble(fmt, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """The content, the (name, arguments) of each call index, and the deltas of a stream fed `pieces`."""
    stream, deltas = fmt.stream(), []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    content = "".join(delta.get("content", "") for delta in deltas)
    names, arguments = {}, {}
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        for call in delta.get("tool_calls", []):
            index = call["index"]
            if "id" in call:  # the announcement comes once per call, before its arguments
                assert index not in names and index == len(names)
                assert call["type"] == "function" and call["function"]["arguments"] == ""
                assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
                names[index] = call["function"]["name"]
            else:
                assert index in names and set(call["function"]) == {"arguments"}
            arguments[index] = arguments.get(index, "") + call["function"]["arguments"]
    return content or None, [(names[i], arguments[i]) for i in sorted(names)], deltas


def chunkings(text: str) -> list[list[str]]:
    rng = random.Random(1234)
    random_pieces = []
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 3))) if len(text) > 1 else []
        random_pieces.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return [list(text), [text], *random_pieces]


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json"])
def test_stream_reassembles_to_parse_in_every_chunking(fmt_name):
    fmt = TOOL_CALL_PARSERS[fmt_name]
    for text in STREAMED_ANSWERS[fmt_name]:
        content, calls = fmt.parse(text)
        expected = (content, [(call.name, call.arguments) for call in calls])
        for pieces in chunkings(text):
            assert "".join(pieces) == text
            assert reassemble(fmt, pieces)[:2] == expected, (text, pieces)


def test_stream_sends_arguments_before_the_call_closes_and_holds_back_marker_starts():
    stream = HERMES.stream()
    assert stream.feed("Checking <tool") == [{"content": "Checking"}]  # " <tool" could still start a marker
    announced, first_piece = stream.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    call_id = announced["tool_calls"][0]["id"]
    function = {"name": "get_weather", "arguments": ""}
    assert announced == {"tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": function}]}
    assert first_piece == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}
    assert stream.feed('ris"}}\n</tool') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]
    # The space held after "Checking" comes with the next text; a trailing one is held, then dropped.
    assert stream.feed("_call> done ") == [{"content": "  done"}]
    assert stream.finish() == []


def test_stream_keeps_a_call_whose_name_was_sent_when_the_block_fails_later():
    # The documented difference from parse(): a stream cannot take back a call it has announced.
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    assert HERMES.parse(cut) == (cut, [])
    assert reassemble(HERMES, [cut[:30], cut[30:]])[:2] == (None, [("add", '{"a": 1')])
    invalid = '{"name": "add", "parameters": {"a": 1 2}}'
    assert LLAMA.parse(invalid) == (invalid, [])
    content, calls, _ = reassemble(LLAMA, list(invalid))
    assert [name for name, _ in calls] == ["add"] and '{"a": 1 2}'.startswith(calls[0][1])
    assert content == "}}"  # the text from the faulty character on
    # Cut before the name: nothing was sent yet, so the stream agrees with parse().
    early = '<tool_call>{"arguments": {"a": 1'
    assert reassemble(HERMES, list(early))[:2] == HERMES.parse(early) == (early, [])


# --- grammars ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer(corpus_stories()[:150], vocab_size=300)


@pytest.fixture(scope="module")
def lltokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer)


def written(fmt, calls: list[tuple[str, object]]) -> str:
    """Calls as a model following the format (and the grammar's JSON style) writes them."""
    if fmt is HERMES:
        return "\n".join(hermes_block(name, arguments) for name, arguments in calls)
    return "; ".join(llama_call(name, arguments) for name, arguments in calls)


def accepts(tokenizer, lltokenizer, grammar: str, text: str) -> bool:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer)
    assert not is_error, messages
    matcher = llguidance.LLMatcher(lltokenizer, grammar)
    consumed = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    return consumed and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("fmt", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
def test_required_grammar_accepts_valid_calls_and_rejects_the_rest(fmt, tokenizer, lltokenizer):
    weather, add = ("get_weather", {"city": "Paris"}), ("add", {"a": 7, "b": False})
    required = fmt.grammar(TOOLS, "required")
    assert accepts(tokenizer, lltokenizer, required, written(fmt, [weather]))
    assert accepts(tokenizer, lltokenizer, required, written(fmt, [weather, add]))
    assert not accepts(tokenizer, lltokenizer, required, written(fmt, [("get_time", {})]))  # unknown function
    assert not accepts(tokenizer, lltokenizer, required, written(fmt, [("get_weather", {"city": 5})]))  # wrong type
    assert not accepts(tokenizer, lltokenizer, required, written(fmt, [("add", {"a": 7})]))  # a required argument
    assert not accepts(tokenizer, lltokenizer, required, "The weather in Paris is fine.")
    single = fmt.grammar(TOOLS, "required", parallel_tool_calls=False)
    assert accepts(tokenizer, lltokenizer, single, written(fmt, [add]))
    assert not accepts(tokenizer, lltokenizer, single, written(fmt, [weather, add]))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
def test_named_function_grammar_allows_only_that_function(fmt, tokenizer, lltokenizer):
    named = fmt.grammar(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert accepts(tokenizer, lltokenizer, named, written(fmt, [("add", {"a": 1, "b": True})]))
    assert not accepts(tokenizer, lltokenizer, named, written(fmt, [("get_weather", {"city": "Paris"})]))
    untyped = fmt.grammar([{"type": "function", "function": {"name": "now"}}], "required")  # parameters default
    assert accepts(tokenizer, lltokenizer, untyped, written(fmt, [("now", {"any": ["thing"]})]))
    with pytest.raises(ValueError, match="'get_time'.*get_weather, add"):
        fmt.grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(ValueError, match="'auto' has no grammar"):
        fmt.grammar(TOOLS, "auto")
    with pytest.raises(ValueError, match="'required' has no grammar"):
        fmt.grammar([], "required")


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("fmt", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
def test_random_walks_through_the_grammar_parse_into_valid_calls(fmt, parallel, tokenizer, lltokenizer):
    grammar = fmt.grammar(TOOLS, "required", parallel_tool_calls=parallel)
    finished = 0
    for seed in range(20):
        rng, matcher, tokens = np.random.default_rng(seed), llguidance.LLMatcher(lltokenizer, grammar), []
        for _ in range(300):
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            token = int(rng.choice(np.flatnonzero(bits[: len(tokenizer)])))
            if token == tokenizer.eos_token_id:
                break
            assert matcher.consume_token(token), matcher.get_error()
            tokens.append(token)
        else:
            continue  # a walk that never stopped says nothing about what a finished answer parses to
        assert matcher.is_accepting()
        finished += 1
        text = tokenizer.decode(tokens)
        content, calls = fmt.parse(text)
        assert content is None and calls and (len(calls) == 1 or parallel)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        streamed = [(call.name, call.arguments) for call in calls]
        assert all(reassemble(fmt, pieces)[:2] == (None, streamed) for pieces in chunkings(text))
    assert finished >= 10  # most walks end, so the check above ran


# --- the chat template -------------------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ],
    [
        {"role": "user", "content": "One\ntwo"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": " {json?} <tool_call> "},
        {"role": "assistant", "content": "Fine\n"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_template_without_tools_renders_as_before(messages, tokenizer):
    for add_generation_prompt in (False, True):
        render = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
        before = tokenizer.apply_chat_template(messages, chat_template=CHATML_BEFORE_TOOLS, **render)
        assert tokenizer.apply_chat_template(messages, **render) == before
    masks = dict(return_dict=True, return_assistant_tokens_mask=True)
    before = tokenizer.apply_chat_template(messages, chat_template=CHATML_BEFORE_TOOLS, **masks)
    assert tokenizer.apply_chat_template(messages, **masks) == before


def test_template_lists_tools_and_round_trips_a_rendered_tool_call(tokenizer):
    arguments = [{"city": "Paris"}, {"a": 3, "b": True}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments[0])},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "add", "arguments": json.dumps(arguments[1])},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(template_messages(messages), tools=TOOLS, tokenize=False)
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and "<tool_call>" in system
    listed = system[system.index("<tools>\n") + len("<tools>\n") : system.index("\n</tools>")].split("\n")
    assert [json.loads(line) for line in listed] == TOOLS
    answer = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert answer == "Looking.\n" + hermes_block("get_weather", arguments[0]) + "\n" + hermes_block("add", arguments[1])
    content, calls = HERMES.parse(answer)
    assert content == "Looking."
    assert calls_of(calls) == [("get_weather", arguments[0]), ("add", arguments[1])]
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.count("Be brief.") == 1  # the system message is not repeated as a turn of its own


def test_template_messages_prepares_openai_messages_for_templates():
    messages = [
        {"role": "user", "content": "Hi", "name": None},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "42"},
    ]
    prepared = template_messages(messages)
    assert prepared[0] == {"role": "user", "content": "Hi"}
    assert prepared[1]["content"] == ""
    assert prepared[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": [1]}}}
    ]
    assert prepared[2] == messages[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": [1]}'  # the request is not changed


# --- choosing the format -----------------------------------------------------------------------------------------

LLAMA3_TEMPLATE_EXCERPT = (
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
    "{%- if message.tool_calls -%}{{- '<|python_tag|>' -}}{%- endif -%}"
)


def test_the_format_is_read_from_the_chat_template(caplog):
    assert chat_template_format(CHATML_TEMPLATE) == "hermes"
    assert chat_template_format(LLAMA3_TEMPLATE_EXCERPT) == "llama3_json"
    assert chat_template_format(LLAMA3_TEMPLATE_EXCERPT.replace("<|python_tag|>", "")) == "llama3_json"
    assert chat_template_format(CHATML_BEFORE_TOOLS) is None and chat_template_format(None) is None
    with caplog.at_level(logging.INFO, logger="vaswani.serving.tools"):
        assert isinstance(tool_call_format(None, CHATML_TEMPLATE), HermesFormat)
        assert isinstance(tool_call_format("auto", LLAMA3_TEMPLATE_EXCERPT), Llama3JsonFormat)
        assert isinstance(tool_call_format("llama3_json", CHATML_TEMPLATE), Llama3JsonFormat)
    assert [("hermes" in r.message, "<tool_call>" in r.message) for r in caplog.records][0] == (True, True)
    assert "--tool-call-parser" in caplog.records[2].message


def test_unknown_formats_and_templates_are_errors_that_name_the_choices():
    with pytest.raises(ValueError, match="--tool-call-parser.*hermes, llama3_json"):
        tool_call_format(None, CHATML_BEFORE_TOOLS)
    with pytest.raises(ValueError, match="'mistral'.*hermes, llama3_json"):
        tool_call_format("mistral", CHATML_TEMPLATE)
