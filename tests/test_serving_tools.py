"""Tool calls through `vaswani serve`: the tools go to the chat template, the calls the model writes come back as
OpenAI `tool_calls` (whole or as streamed deltas), `tool_choice` "required" and a named function are enforced by a
grammar, and the tool's result goes back through the template for the final answer.

Oracles: the openai client (it parses the bodies and the streamed deltas); `jsonschema` validates every call's
arguments against its tool's parameters; offline greedy `generate` on the prompt transformers' own
`apply_chat_template(messages, tools=...)` renders (the "auto" answer that does not call, and the final answer after
the tool's result).
"""

import json

import pytest
from serving_cases import offline_answer, scrape, serving, tiny_chat_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from vaswani.runtime import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.serving import create_app, load_service  # noqa: E402

MODEL = "tiny-chat"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def offline(tiny_chat_pair):
    return OrtModelForCausalLM.from_pretrained(tiny_chat_pair["onnx"], session_options=default_session_options(1))


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def server(request, tiny_chat_pair):
    """The tiny chat model served with each tool-call format (hermes: read from its template; llama3_json: named)."""
    parser = None if request.param == "hermes" else request.param
    service = load_service(tiny_chat_pair["onnx"], threads=1, max_batch=8, tool_call_parser=parser)
    with serving(create_app(service)) as running:
        running.format = request.param
        yield running


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls, names: set[str]) -> None:
    """Every call names one of `names`, and its arguments parse and validate against that tool's parameters."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice_always_give_a_call_that_parses(server):
    for seed in range(4):
        answer = client(server).chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
        named = client(server).chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        assert named.choices[0].finish_reason == "stop"
        check_calls(named.choices[0].message.tool_calls, {"get_time"})


def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(server):
    values = dict(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=7,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
    )
    whole = client(server).chat.completions.create(**values).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client(server).chat.completions.create(**values, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None, "a call's id is sent once"
                    call["id"] = delta.id
                if delta.function.name:
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert [r for r in reasons if r] == ["tool_calls"]
    streamed = [calls[index] for index in sorted(calls)]
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"] and c["id"].startswith("call_") for c in streamed)


def test_a_tool_round_trip_ends_in_the_answer_generate_gives(server, tokenizer, offline):
    """The call, the tool's result sent back (role "tool"), and the final answer: the greedy answer `generate` gives to
    the conversation rendered by transformers' `apply_chat_template(..., tools=TOOLS)`."""
    first = client(server).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = first.choices[0].message.tool_calls[0]
    check_calls([call], {"get_weather"})
    conversation = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    final = client(server).chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, max_tokens=16, temperature=0.0
    )
    template_conversation = QUESTION + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                }
            ],
        },
        conversation[2],
    ]
    prompt = tokenizer.apply_chat_template(template_conversation, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    assert json.dumps({"temperature": 21}) in tokenizer.decode(prompt), "the tool's result reached the prompt"
    expected, _ = offline_answer(offline, tokenizer, list(prompt), 16)
    message = final.choices[0].message
    if message.tool_calls:  # the random model may call again: then its text is not an answer to compare
        pytest.skip("the model called a tool again")
    assert message.content == expected


def test_auto_falls_back_to_text_when_the_model_does_not_call(server, tokenizer, offline):
    answer = client(server).chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=16, temperature=0.0
    )
    prompt = tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    expected, _ = offline_answer(offline, tokenizer, list(prompt), 16)
    choice = answer.choices[0]
    assert not choice.message.tool_calls and choice.message.content == expected
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "pattern"),
    ],
)
def test_bad_tool_requests_get_a_400_naming_the_field(server, fields, param, words):
    import httpx

    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_template_without_tool_calls_and_no_parser_is_a_400(tiny_chat_pair, tmp_path):
    import shutil

    import httpx

    folder = tmp_path / "plain-template"
    shutil.copytree(tiny_chat_pair["onnx"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with serving(create_app(load_service(folder, threads=1))) as running:
        body = {"model": "plain-template", "messages": QUESTION, "tools": TOOLS}
        response = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400 and "--tool-call-parser" in response.json()["error"]["message"]


def test_the_command_line_offers_every_tool_call_format():
    from vaswani.cli.serve import TOOL_CALL_PARSERS as offered
    from vaswani.serving.tools import TOOL_CALL_PARSERS

    assert offered == ("auto", *TOOL_CALL_PARSERS)


def test_metrics_count_constrained_requests_and_tool_calls(server):
    """/metrics, read with prometheus' own parser: each forced request counts under tool_choice, its compile is
    timed, and every call returned (whole or streamed) counts."""
    import httpx

    http = httpx.Client(base_url=server.url, timeout=10)
    before = scrape(http)
    values = dict(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    client(server).chat.completions.create(**values)
    list(client(server).chat.completions.create(**values, stream=True))
    after = scrape(http)

    def moved(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert moved("vaswani_constrained_requests_total", (("field", "tool_choice"),)) == 2
    assert moved("vaswani_grammar_compile_seconds_count") == 2
    assert moved("vaswani_tool_calls_total") == 2
