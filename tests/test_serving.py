"""`vaswani serve`: the OpenAI-compatible server and its continuous-batching engine, on a tiny exported chat model.

Oracles: offline `OrtModelForCausalLM.generate` (greedy) on the same prompt, alone, for every served answer (batching
must not change a token); the PyTorch model for the torch backend and the encoder routes; the official `openai`
client for the protocol. Servers bind 127.0.0.1 on a free port.
"""

import asyncio
import json
import threading

import httpx
import pytest
from serving_cases import CONTEXT, QUESTIONS, offline_answer, serving, tiny_chat_tokenizer

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from vaswani.runtime import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.runtime.decoders.portable import OrtStepModel  # noqa: E402
from vaswani.serving import SamplingParams, create_app, load_service  # noqa: E402
from vaswani.serving.scheduler import Scheduler  # noqa: E402
from vaswani.serving.text import TextStream  # noqa: E402

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def folders(tiny_chat_pair):
    """(PyTorch folder, its ONNX export): the session's tiny chat pair, read and never written here."""
    return tiny_chat_pair["pytorch"], tiny_chat_pair["onnx"]


@pytest.fixture(scope="module")
def offline(folders):
    return OrtModelForCausalLM.from_pretrained(folders[1], session_options=default_session_options(1))


@pytest.fixture(scope="module")
def server(folders):
    with serving(create_app(load_service(folders[1], threads=1, max_batch=8))) as running:
        yield running


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def chat_body(question: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0, **fields}


# ------------------------------------------------------------------------------------- the protocol, with openai


def test_openai_client_chats_with_the_server_streaming_and_not(server, offline, tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [model.id for model in client.models.list()] == [MODEL]
    expected, tokens = offline_answer(offline, tokenizer, chat_prompt(tokenizer, QUESTIONS[1]), 24)

    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=24, temperature=0
    )
    assert reply.choices[0].message.content == expected
    as_parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": QUESTIONS[1][:9]}, {"type": "text", "text": QUESTIONS[1][9:]}],
        }
    ]
    assert (
        client.chat.completions.create(model=MODEL, messages=as_parts, max_tokens=24, temperature=0)
        .choices[0]
        .message.content
        == expected
    )
    assert reply.choices[0].finish_reason == ("stop" if tokens[-1] == tokenizer.eos_token_id else "length")
    assert reply.usage.prompt_tokens == len(chat_prompt(tokenizer, QUESTIONS[1]))
    assert reply.usage.completion_tokens == len(tokens)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTIONS[1]}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_completions_route_answers_a_text_prompt_as_generate_does(server, offline, tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    prompt = "Once upon a time"
    expected, _ = offline_answer(offline, tokenizer, tokenizer(prompt)["input_ids"], 16)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert reply.choices[0].text == expected
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + expected
    ids = tokenizer(prompt)["input_ids"]
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0).choices[0].text == expected


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_choices(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    ask = dict(model=MODEL, prompt="The cat", max_tokens=20, temperature=1.0, top_p=0.9, seed=7, n=3)
    first = client.completions.create(**ask, extra_body={"ignore_eos": True})
    second = client.completions.create(**ask, extra_body={"ignore_eos": True})
    texts = [choice.text for choice in first.choices]
    assert texts == [choice.text for choice in second.choices]
    assert len(set(texts)) > 1  # each choice draws from its own generator (seed, seed + 1, ...)
    assert first.usage.completion_tokens == 3 * 20
    negative = client.completions.create(**(ask | {"seed": -5, "n": 1}))  # any integer seeds, as in OpenAI's API
    assert negative.choices[0].text == client.completions.create(**(ask | {"seed": -5, "n": 1})).choices[0].text
    assert {choice.finish_reason for choice in first.choices} == {"length"}
    streamed = ["", "", ""]
    for chunk in client.completions.create(**ask, stream=True, extra_body={"ignore_eos": True}):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == texts  # the choices' chunks interleave on one stream, told apart by their index


def test_stop_string_ends_the_answer_before_it(server, offline, tokenizer):
    full, _ = offline_answer(offline, tokenizer, chat_prompt(tokenizer, QUESTIONS[3]), 40)
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # spans tokens in general
    expected = full[: full.find(stop)]
    for stream in (False, True):
        response = httpx.post(
            server.url + "/v1/chat/completions", json=chat_body(QUESTIONS[3], max_tokens=40, stop=[stop], stream=stream)
        )
        assert response.status_code == 200
        if stream:
            events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            text = "".join(event["choices"][0]["delta"].get("content", "") for event in events)
            reason = events[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = (
                response.json()["choices"][0]["message"]["content"],
                response.json()["choices"][0]["finish_reason"],
            )
        assert (text, reason) == (expected, "stop")


# ------------------------------------------------------------------------ continuous batching: same tokens, under load


def test_64_requests_from_8_concurrent_clients_get_generates_answers(server, offline, tokenizer):
    """Every answer equals offline greedy `generate` on its prompt alone: sequences that join, run beside others and
    leave at different lengths (max_tokens 4 to 60, prompts of 15 to 40 tokens), with bad requests rejected in
    between, never change or swap a token."""
    cases = [(QUESTIONS[i % len(QUESTIONS)], 4 + (7 * i) % 57) for i in range(64)]
    expected = {
        case: offline_answer(offline, tokenizer, chat_prompt(tokenizer, case[0]), case[1])[0] for case in set(cases)
    }

    async def client(worker: int, http: httpx.AsyncClient) -> list[tuple[tuple[str, int], str]]:
        answers = []
        for i in range(worker, len(cases), 8):
            question, max_tokens = cases[i]
            body = chat_body(question, max_tokens=max_tokens, stream=i % 2 == 1)
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            if i % 2:
                events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
                text = "".join(event["choices"][0]["delta"].get("content", "") for event in events)
            else:
                text = response.json()["choices"][0]["message"]["content"]
            answers.append((cases[i], text))
            if i % 16 == worker:  # bad requests in between: rejected, and no trace in anyone's answer
                bad = await http.post("/v1/chat/completions", json=chat_body(question, max_tokens=-1, stream=True))
                assert bad.status_code == 400
                cut = await http.post("/v1/completions", json={"model": MODEL, "prompt": [7] * CONTEXT})
                assert cut.status_code == 400
        return answers

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(client(worker, http) for worker in range(8)))

    answers = [answer for worker in asyncio.run(run_all()) for answer in worker]
    assert len(answers) == 64
    mismatches = [(case, text, expected[case]) for case, text in answers if text != expected[case]]
    assert not mismatches


class RecordingStepModel(OrtStepModel):
    """The step model, recording the batch size of every call."""

    def __init__(self, model):
        super().__init__(model)
        self.batches: list[int] = []

    def run(self, input_ids, attention_mask, positions, past):
        self.batches.append(input_ids.shape[0])
        return super().run(input_ids, attention_mask, positions, past)


def test_a_sequence_joins_the_running_batch_and_leaves_without_waiting(offline, tokenizer):
    step_model = RecordingStepModel(offline)
    engine = Scheduler(step_model, max_batch=4).start()
    finished_order, done = [], threading.Event()
    tokens = {"long": [], "short": []}

    def emitter(name):
        def emit(event):
            tokens[name].append(event.token)
            if event.finish_reason:
                finished_order.append(name)
                if len(finished_order) == 2:
                    done.set()

        return emit

    try:
        long_prompt, short_prompt = chat_prompt(tokenizer, QUESTIONS[2]), chat_prompt(tokenizer, QUESTIONS[0])
        engine.submit(long_prompt, SamplingParams(max_tokens=300, temperature=0), emitter("long"))
        while len(tokens["long"]) < 5:
            threading.Event().wait(0.001)
        engine.submit(short_prompt, SamplingParams(max_tokens=10, temperature=0), emitter("short"))
        assert done.wait(30)
    finally:
        engine.stop()
    assert finished_order == ["short", "long"]
    assert 2 in step_model.batches and step_model.batches[-1] == 1  # it ran beside the other, then left
    assert tokens["long"] == offline_answer(offline, tokenizer, long_prompt, 300)[1]
    assert tokens["short"] == offline_answer(offline, tokenizer, short_prompt, 10)[1]


@pytest.fixture(scope="module")
def io_bound(folders):
    """The export with IO binding on the CPU: the engine's cache is then torch tensors, as on CUDA."""
    return OrtModelForCausalLM.from_pretrained(
        folders[1], session_options=default_session_options(1), use_io_binding=True
    )


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("binding", ["numpy", "io-binding"])
def test_prompts_prefilled_together_get_generates_tokens(offline, io_bound, tokenizer, chunk, binding):
    """Prompts of different lengths, left-padded into one prefill group: in one call (nothing running), or fed
    `chunk` columns at a time between the decoding steps of a sequence that is already running (the token budget
    that leaves 3 rows x 5 columns beside the running row and the group's own first step); with the cache in
    ONNX Runtime's numpy arrays (the CPU's lean loop) or in torch tensors bound by pointer (the CUDA path)."""
    step_model = RecordingStepModel(offline if binding == "numpy" else io_bound)
    budget = 1 + 3 + 3 * chunk if chunk else 256
    engine = Scheduler(step_model, max_batch=4 if chunk else 8, max_num_batched_tokens=budget)
    prompts = [chat_prompt(tokenizer, question) for question in QUESTIONS[:5]]
    answers, finished = {i: [] for i in range(len(prompts) + 1)}, threading.Semaphore(0)

    def emitter(index):
        def emit(event):
            answers[index].append(event.token)
            if event.finish_reason:
                finished.release()

        return emit

    first = chat_prompt(tokenizer, QUESTIONS[6])
    if chunk:  # a sequence runs first; the group joins while it decodes
        engine.start()
        engine.submit(first, SamplingParams(max_tokens=200, temperature=0), emitter(len(prompts)))
        while len(answers[len(prompts)]) < 3:
            threading.Event().wait(0.001)
    for index, prompt in enumerate(prompts):
        engine.submit(prompt, SamplingParams(max_tokens=20, temperature=0), emitter(index))
    engine.start()
    try:
        for _ in range(len(prompts) + bool(chunk)):
            assert finished.acquire(timeout=30)
    finally:
        engine.stop()
    for index, prompt in enumerate(prompts):
        assert answers[index] == offline_answer(offline, tokenizer, prompt, 20)[1]
    if chunk:
        assert answers[len(prompts)] == offline_answer(offline, tokenizer, first, 200)[1]
        assert max(step_model.batches) == 4  # the running sequence and a group of 3; the other 2 waited
    else:
        assert step_model.batches[0] == len(prompts)  # one prefill call for the five


def test_torch_backend_serves_the_pytorch_folder(folders, tokenizer):
    from vaswani import VaswaniForCausalLM

    model = VaswaniForCausalLM.from_pretrained(folders[0]).eval()
    with serving(create_app(load_service(folders[0], backend="torch", threads=1, name=MODEL))) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused")
        for question in QUESTIONS[:3]:
            expected, _ = offline_answer(model, tokenizer, chat_prompt(tokenizer, question), 12)
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0
            )
            assert reply.choices[0].message.content == expected


# ------------------------------------------------------------------------------------ disconnects, bad input, queue


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    body = chat_body("Tell me everything.", max_tokens=CONTEXT - 100, ignore_eos=True, stream=True)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert len(received) >= 3
            assert http.get("/health").json()["running"] == 1
        # The stream is closed after a handful of its ~1900 tokens: the row must leave the batch.
        for _ in range(200):
            if http.get("/health").json()["running"] == 0:
                break
            threading.Event().wait(0.05)
        assert http.get("/health").json()["running"] == 0
        # ignore_eos: the tiny model may sample its end-of-text token before the third.
        request = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
        reply = http.post("/v1/completions", json=request)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


BAD_REQUESTS = {
    "malformed JSON": ("/v1/chat/completions", b'{"model": "tiny-chat", "messages": [', 400, "not valid JSON"),
    "wrong type": ("/v1/chat/completions", chat_body("Hi", temperature="hot"), 400, "temperature"),
    "messages not a list": ("/v1/chat/completions", {"model": MODEL, "messages": "Hi"}, 400, "messages"),
    "unknown field": ("/v1/chat/completions", chat_body("Hi", max_token=5), 400, "max_token"),
    "max_tokens zero": ("/v1/chat/completions", chat_body("Hi", max_tokens=0), 400, "max_tokens"),
    "max_tokens negative": ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": -3}, 400, "max_tokens"),
    "prompt longer than the context": (
        "/v1/completions",
        {"model": MODEL, "prompt": [5] * (CONTEXT + 1), "max_tokens": 1},
        400,
        "maximum context length",
    ),
    "answer past the context": (
        "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "max_tokens": CONTEXT},
        400,
        "max_tokens",
    ),
    "token id outside the vocabulary": ("/v1/completions", {"model": MODEL, "prompt": [10**6]}, 400, "vocabulary"),
    "unknown model": ("/v1/chat/completions", chat_body("Hi") | {"model": "gpt-9"}, 404, "gpt-9"),
    "image content part": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content",
    ),
    "unsupported feature": (
        "/v1/chat/completions",
        chat_body("Hi", functions=[{"name": "f", "parameters": {"type": "object"}}]),
        400,
        "functions",
    ),
    "embeddings of a decoder": ("/v1/embeddings", {"model": MODEL, "input": "Hi"}, 400, "embedding"),
    "unknown route": ("/v1/images/generations", {"model": MODEL}, 404, "Not Found"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_a_4xx_with_an_openai_error_body(server, case):
    path, body, status, named = BAD_REQUESTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert named in error["message"] and error["type"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_past_the_queue_limit_the_server_answers_429_with_retry_after(folders):
    service = load_service(folders[1], threads=1, max_batch=1, max_waiting=1)
    long = chat_body("Go on.", max_tokens=CONTEXT - 100, ignore_eos=True, stream=True)
    with serving(create_app(service)) as running, httpx.Client(base_url=running.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=long) as first:
            with http.stream("POST", "/v1/chat/completions", json=long) as second:
                assert first.status_code == second.status_code == 200
                third = http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=2))
                assert third.status_code == 429
                assert int(third.headers["retry-after"]) >= 1
                assert "capacity" in third.json()["error"]["message"]
        for _ in range(200):  # both streams closed: the queue drains and the server serves again
            if http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=2)).status_code == 200:
                break
            threading.Event().wait(0.05)
        else:
            pytest.fail("the server did not recover after the streams closed")


# ------------------------------------------------------------------------------------------------ the text stream


def test_text_stream_deltas_add_up_to_the_decoded_text_cut_at_the_stop_string(tokenizer):
    text = "The little cat sat on the mat. Then it slept — happily, ünder the sün."
    tokens = tokenizer(text)["input_ids"]
    for stop in ([], ["sat on"], ["ünder"], ["zzz"]):
        stream = TextStream(tokenizer, stop)
        pieces = [stream.add(token) for token in tokens] + [stream.flush()]
        decoded = tokenizer.decode(tokens, skip_special_tokens=True)
        expected = decoded[: decoded.find(stop[0])] if stop and stop[0] in decoded else decoded
        assert "".join(pieces) == expected
        assert stream.stopped == bool(stop and stop[0] in decoded)
        assert not any("\ufffd" in piece for piece in pieces)
