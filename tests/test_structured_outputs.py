"""Constrained decoding: `vaswani serve`'s `response_format`, vLLM's `structured_outputs` and `guided_*` fields, and
the same constraint offline as a `GrammarLogitsProcessor` for `generate`.

Oracles: the `jsonschema` package validates every constrained answer against its schema (the unconstrained model,
random weights, almost never writes valid JSON: shown on the same requests); `re.fullmatch` for regular expressions;
offline `generate` on the same export (unconstrained requests batched beside constrained ones keep its greedy answer,
and a seeded constrained request equals `generate` with the processor under `torch.manual_seed`).
"""

import asyncio
import json
import re

import httpx
import pytest
from serving_cases import offline_answer, serving, tiny_chat_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import torch  # noqa: E402

from vaswani.constraints import Grammar, GrammarLogitsProcessor  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.serving import create_app, load_service  # noqa: E402

MODEL = "tiny-chat"
MAX_TOKENS = 160  # the random model's answers under these schemas end well before (strings are bounded)

SCHEMAS = {
    "object": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
                "additionalProperties": False,
            },
            "note": {"type": "string", "maxLength": 6},
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {"type": "string", "enum": ["positive", "negative", "neutral"]},
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
}
QUESTIONS = ["Describe a person as JSON.", "Tell me a story about a cat.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def offline(tiny_chat_pair):
    return OrtModelForCausalLM.from_pretrained(tiny_chat_pair["onnx"], session_options=default_session_options(1))


@pytest.fixture(scope="module")
def server(tiny_chat_pair):
    service = load_service(tiny_chat_pair["onnx"], threads=1, max_batch=16, max_waiting=64)
    with serving(create_app(service)) as running:
        yield running


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def chat_body(question: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS, **fields}


async def chat(client: httpx.AsyncClient, body: dict) -> tuple[str, str]:
    """(text, finish_reason) of one chat request, streamed or not."""
    if not body.get("stream"):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, reason = "", None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                reason = choice["finish_reason"] or reason
    return text, reason


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_every_constrained_answer_validates_beside_unconstrained_ones(server, offline, tokenizer):
    """Each schema, greedy and sampled (seeded), streamed and not, with n=2: every answer parses and validates and
    ends with "stop"; the same requests without the schema give no valid answer; unconstrained greedy requests sent at
    the same time keep `generate`'s answer."""
    requests = []
    for index, name in enumerate(SCHEMAS):
        for temperature, stream in ((0.0, False), (0.9, True), (0.9, False)):
            fields = {"temperature": temperature, "seed": index, "stream": stream}
            requests.append((name, chat_body(QUESTIONS[index % 3], response_format=schema_format(name), **fields)))
    plain_prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"])
        for q in QUESTIONS
    ]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            constrained = [chat(client, body) for _, body in requests]
            unconstrained = [chat(client, {**body, "response_format": None}) for _, body in requests]
            plain = [chat(client, chat_body(q, temperature=0.0, max_tokens=24)) for q in QUESTIONS]
            return await asyncio.gather(asyncio.gather(*constrained), asyncio.gather(*unconstrained), *plain)

    constrained, unconstrained, *plain = asyncio.run(run())
    for (name, _), (text, reason) in zip(requests, constrained):
        assert valid(text, SCHEMAS[name]), (name, text)
        assert reason == "stop", (name, text, reason)
    assert sum(valid(text, SCHEMAS[name]) for (name, _), (text, _) in zip(requests, unconstrained)) == 0
    for prompt, (text, _) in zip(plain_prompts, plain):
        assert text == offline_answer(offline, tokenizer, prompt, 24)[0]


def test_n_choices_each_validate_and_json_object_gives_an_object(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = chat_body("Hi", n=3, temperature=1.0, seed=5, response_format=schema_format("nested"))
        choices = client.post("/v1/chat/completions", json=body).json()["choices"]
        assert len(choices) == 3 and all(valid(c["message"]["content"], SCHEMAS["nested"]) for c in choices)
        body = chat_body("Hi", response_format={"type": "json_object"}, max_tokens=400, temperature=0.0)
        body["structured_outputs"] = None
        answer = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        if answer["finish_reason"] == "stop":  # a free object may be long: either it closed, or it was cut
            assert isinstance(json.loads(answer["message"]["content"]), dict)
        else:
            assert answer["finish_reason"] == "length"


def test_vllm_fields_regex_choice_and_grammar_on_both_routes(server):
    pattern = r"[a-c]{2,4}-\d{2}"
    cases = [
        ({"guided_regex": pattern}, lambda text: re.fullmatch(pattern, text)),
        ({"structured_outputs": {"regex": pattern}}, lambda text: re.fullmatch(pattern, text)),
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, lambda text: re.fullmatch(r"x\d\d?", text)),
        ({"structured_outputs": {"grammar": 'start: "a" ("b" | "c")'}}, lambda text: text in ("ab", "ac")),
        ({"guided_json": SCHEMAS["array"]}, lambda text: valid(text, SCHEMAS["array"])),
        ({"structured_outputs": {"json": SCHEMAS["enum"]}}, lambda text: valid(text, SCHEMAS["enum"])),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for fields, check in cases:
            for seed in range(3):
                chat_answer = client.post("/v1/chat/completions", json=chat_body("Hi", seed=seed, **fields)).json()
                text = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "seed": seed}
                text_answer = client.post("/v1/completions", json={**text, **fields}).json()
                for answer in (chat_answer["choices"][0]["message"]["content"], text_answer["choices"][0]["text"]):
                    assert check(answer), (fields, answer)


def test_an_answer_cut_by_max_tokens_finishes_with_length(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = chat_body("Hi", max_tokens=3, response_format=schema_format("nested"))
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "length" and not valid(choice["message"]["content"], SCHEMAS["nested"])


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}},
            "response_format",
            "if",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", "regular expression"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
        ({"guided_choice": []}, "guided_choice", "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, None, "one constraint"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one constraint"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "Field required",
        ),
    ],
)
def test_constraints_that_cannot_be_enforced_get_a_400_naming_them(server, fields, param, words):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        response = client.post("/v1/chat/completions", json=chat_body("Hi", **fields))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert words in error["message"] and error["param"] == param
        assert client.get("/health").status_code == 200


def test_the_openai_clients_parse_returns_the_pydantic_object(server):
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: str = Field(max_length=6)
        legs: int = Field(ge=0, le=8)

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "A pet?"}], response_format=Pet, max_tokens=MAX_TOKENS
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_offline_processor_and_server_give_the_same_tokens(server, offline, tokenizer, temperature):
    """`generate` with a `GrammarLogitsProcessor` under `torch.manual_seed(seed)` equals the served answer."""
    schema, seed = SCHEMAS["object"], 11
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    processor = GrammarLogitsProcessor(Grammar.json_schema(schema), tokenizer)
    values = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
    torch.manual_seed(seed)
    output = offline.generate(**prompt, max_new_tokens=MAX_TOKENS, logits_processor=[processor], **values)
    expected = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    body = chat_body(QUESTIONS[0], temperature=temperature, seed=seed, response_format=schema_format("object"))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        served = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert served == expected and valid(expected, schema)


def test_offline_processor_on_the_pytorch_folder_keeps_every_row_in_the_grammar(tiny_chat_pair, tokenizer):
    from vaswani import VaswaniForCausalLM

    model = VaswaniForCausalLM.from_pretrained(tiny_chat_pair["pytorch"])
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in QUESTIONS[:2]
    ]
    width = max(map(len, prompts))
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    assert batch["input_ids"].shape[1] == width
    processor = GrammarLogitsProcessor(Grammar.json_schema(SCHEMAS["array"]), tokenizer)
    torch.manual_seed(0)
    output = model.generate(
        **batch,
        logits_processor=[processor],
        do_sample=True,
        top_k=0,
        num_return_sequences=2,
        max_new_tokens=80,
        pad_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    assert len(texts) == 4 and all(valid(text, SCHEMAS["array"]) for text in texts), texts


def test_offline_processor_refuses_beam_search(tiny_chat_pair, tokenizer):
    from vaswani import VaswaniForCausalLM

    model = VaswaniForCausalLM.from_pretrained(tiny_chat_pair["pytorch"])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    processor = GrammarLogitsProcessor(Grammar.regex("[a-z]{30}"), tokenizer)
    with pytest.raises(ValueError, match="beam search"):
        model.generate(**prompt, logits_processor=[processor], num_beams=3, max_new_tokens=20)
