"""How `vaswani serve` chooses tokens, and the request fields clients written for vLLM send.

Oracles: offline `generate(do_sample=True, ...)` under `torch.manual_seed(seed)` on the same exported folder (a
seeded served answer must equal it token for token); softmax(logits / T) of the PyTorch folder's own forward pass (the
empirical distribution of sampled tokens must match it); log-softmax of the exported model's forward pass (reported
log probabilities); offline greedy `generate` (the answers of requests batched beside a poisoned one).
"""

import asyncio
import json
import math
import threading

import httpx
import numpy as np
import pytest
import torch
from serving_cases import offline_answer, scheduled_results, serving, tiny_chat_tokenizer

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from vaswani.runtime import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.runtime.decoders.portable import OrtStepModel  # noqa: E402
from vaswani.serving import SamplingParams, create_app, load_service, scheduler  # noqa: E402
from vaswani.serving.scheduler import Scheduler  # noqa: E402
from vaswani.serving.text import TextStream  # noqa: E402

MODEL = "tiny-chat"
QUESTIONS = ["Tell me a story about a cat.", "Why is the sky blue?", "Hello!", "Count to ten."]
MAX_BATCH, MAX_WAITING = 8, 16


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
    service = load_service(folders[1], threads=1, max_batch=MAX_BATCH, max_waiting=MAX_WAITING)
    with serving(create_app(service)) as running:
        yield running


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def run_engine(step_model, requests: list[tuple[list[int], SamplingParams]], max_batch: int = 16):
    """Every request submitted before the scheduler starts (so the first ones are prefilled as one group), run to the
    end; returns each request's (tokens, finish reason, error)."""
    return scheduled_results(Scheduler(step_model, max_batch=max_batch, max_waiting=len(requests)), requests)


def generate_sampled(model, prompt: list[int], seed: int, max_new_tokens: int, **values) -> list[int]:
    """The oracle: `generate` with exactly the request's values (transformers' default top_k of 50 turned off unless
    asked for), the presence and frequency penalties as a logits processor, under `torch.manual_seed(seed)`."""
    from vaswani.serving.sampling import PresenceFrequencyPenalty

    presence, frequency = values.pop("presence_penalty", 0.0), values.pop("frequency_penalty", 0.0)
    processors = [PresenceFrequencyPenalty(presence, frequency, len(prompt))] if presence or frequency else []
    temperature = values.pop("temperature")
    if temperature > 0:
        values = {"do_sample": True, "temperature": temperature, "top_k": 0, **values}
    else:
        values = {"do_sample": False, **values}
    torch.manual_seed(seed)
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, logits_processor=processors, **values
        )
    return output[0, len(prompt) :].tolist()


# ---------------------------------------------------------------------------------- one sampler, shared with generate

SAMPLING_CASES = {
    "temperature": dict(temperature=0.7),
    "top-k-top-p": dict(temperature=1.0, top_k=20, top_p=0.8),
    "min-p-repetition-penalty": dict(temperature=1.3, min_p=0.05, repetition_penalty=1.3),
    "presence-frequency-penalties": dict(temperature=0.9, top_p=0.95, presence_penalty=1.5, frequency_penalty=0.8),
    "greedy-with-penalties": dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_seeded_engine_answer_equals_generate_with_the_same_values(offline, tokenizer, case):
    """At batch 1 the engine's tokens are `generate`'s under the same seed, for each sampling value; and each value
    changes the answer (so the comparison would catch a value the engine ignored)."""
    values, eos = SAMPLING_CASES[case], frozenset({tokenizer.eos_token_id})
    prompt = chat_prompt(tokenizer, QUESTIONS[0])
    for seed in (3, 12345):
        params = SamplingParams(max_tokens=40, seed=seed, stop_token_ids=eos, **values)
        [(served, _, error)] = run_engine(OrtStepModel(offline), [(prompt, params)])
        assert error is None
        assert served == generate_sampled(offline, prompt, seed, 40, **values)
    plain = dict(temperature=values["temperature"])
    assert served != generate_sampled(offline, prompt, seed, 40, **plain) or values == plain


def test_a_seeded_answer_does_not_depend_on_the_rows_beside_it(offline, tokenizer):
    """Each row draws from its own generator: a seeded sequence prefilled and decoded beside three sampled others
    (other seeds, temperatures, penalties) gets the tokens it gets alone."""
    prompts = [chat_prompt(tokenizer, question) for question in QUESTIONS]
    seeded = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=21, ignore_eos=True)
    [(alone, _, _)] = run_engine(OrtStepModel(offline), [(prompts[0], seeded)])
    others = [
        SamplingParams(max_tokens=30 + 5 * i, temperature=0.5 + i / 2, seed=i, presence_penalty=0.5, ignore_eos=True)
        for i in range(3)
    ]
    results = run_engine(OrtStepModel(offline), [(prompts[0], seeded), *zip(prompts[1:], others)])
    assert results[0][0] == alone


def test_presence_and_frequency_penalties_follow_openais_definition():
    """score - presence * [count > 0] - frequency * count, counting the answer's tokens only (not the prompt's)."""
    from collections import Counter

    from vaswani.serving.sampling import PresenceFrequencyPenalty

    prompt, answer = [1, 2, 3], [4, 4, 4, 2, 7]
    scores = torch.randn(1, 10, generator=torch.Generator().manual_seed(0))
    penalized = PresenceFrequencyPenalty(0.5, 0.25, len(prompt))(torch.tensor([prompt + answer]), scores.clone())
    counts = Counter(answer)
    expected = [
        value - (0.5 + 0.25 * counts[token] if counts[token] else 0.0) for token, value in enumerate(scores[0].tolist())
    ]
    assert penalized[0].tolist() == pytest.approx(expected)


def test_engine_parameters_are_checked_and_a_tiny_temperature_is_floored():
    assert SamplingParams(max_tokens=1, temperature=1e-320).temperature == 0.01  # vLLM's floor
    assert SamplingParams(max_tokens=1, temperature=0.0).temperature == 0.0  # greedy stays greedy
    for field, value in [
        ("temperature", math.nan),
        ("temperature", 3.0),
        ("top_p", 0.0),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", math.inf),
        ("top_k", -5),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(max_tokens=1, **{field: value})


def test_seeded_answers_over_http_equal_generate(server, offline, tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    prompt = tokenizer("Once upon a time")["input_ids"]
    values = dict(temperature=0.8, top_p=0.9, top_k=40)
    expected = tokenizer.decode(generate_sampled(offline, prompt, 11, 30, **values), skip_special_tokens=True)
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, seed=11, temperature=0.8, top_p=0.9, extra_body={"top_k": 40}
    )
    assert reply.choices[0].text == expected

    question = chat_prompt(tokenizer, QUESTIONS[1])
    values = dict(temperature=1.1, presence_penalty=1.0, frequency_penalty=0.5, min_p=0.02, repetition_penalty=1.1)
    expected = tokenizer.decode(generate_sampled(offline, question, 5, 30, **values), skip_special_tokens=True)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        max_tokens=30,
        seed=5,
        temperature=1.1,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        extra_body={"min_p": 0.02, "repetition_penalty": 1.1},
    )
    assert reply.choices[0].message.content == expected


def binned(probabilities: np.ndarray, order: np.ndarray, edges: list[int]) -> np.ndarray:
    """The probability mass of the tokens ranked edges[i] to edges[i + 1] by `order`."""
    ranked = probabilities[order]
    return np.array([ranked[start:end].sum() for start, end in zip(edges, edges[1:])])


def test_temperature_changes_the_spread_of_sampled_tokens_as_softmax_of_logits_over_t(folders, offline, tokenizer):
    """The first sampled token over 1000 seeds at T = 0.2 and T = 2.0: its distribution matches softmax(logits / T)
    of the PyTorch folder's forward pass (tokens binned by the oracle's rank; total variation within 3 standard
    deviations per bin), and the two spreads differ (entropy). Were the temperature ignored, both would follow
    softmax(logits), which is farther than the bound from either."""
    from vaswani import VaswaniForCausalLM

    prompt = chat_prompt(tokenizer, "Hi")
    with torch.inference_mode():
        logits = VaswaniForCausalLM.from_pretrained(folders[0]).eval()(torch.tensor([prompt])).logits[0, -1].double()
    order = torch.argsort(logits, descending=True).numpy()
    edges = [0, 1, 3, 8, 20, 50, 120, len(logits)]
    draws, entropies = 1000, {}
    for temperature in (0.2, 2.0):
        params = [SamplingParams(max_tokens=1, temperature=temperature, seed=seed) for seed in range(draws)]
        results = run_engine(OrtStepModel(offline), [(prompt, p) for p in params], max_batch=64)
        tokens = np.array([result[0][0] for result in results])
        empirical = np.bincount(tokens, minlength=len(logits)) / draws
        expected = torch.softmax(logits / temperature, -1).numpy()
        untempered = torch.softmax(logits, -1).numpy()
        observed, oracle = binned(empirical, order, edges), binned(expected, order, edges)
        bound = 0.5 * np.sum(3 * np.sqrt(oracle * (1 - oracle) / draws))
        assert 0.5 * np.abs(observed - oracle).sum() <= bound, (temperature, observed, oracle)
        assert 0.5 * np.abs(binned(untempered, order, edges) - oracle).sum() > 2 * bound  # the test has power
        seen = empirical[empirical > 0]
        entropies[temperature] = -(seen * np.log(seen)).sum()
    assert entropies[0.2] < 2.0 < 4.0 < entropies[2.0]


# ------------------------------------------------------------------------------------------------------- isolation


def test_a_tiny_temperature_is_floored_and_its_batch_gets_generates_answers(offline, tokenizer):
    """temperature 1e-320 made logits / T overflow and the probabilities NaN: the raise failed the whole prefill group.
    Now it is raised to vLLM's floor (0.01), its request answers, and three greedy requests prefilled with it in one
    group get `generate`'s answers."""
    prompts = [chat_prompt(tokenizer, question) for question in QUESTIONS]
    requests = [(prompts[0], SamplingParams(max_tokens=20, temperature=1e-320, seed=1))]
    requests += [(prompt, SamplingParams(max_tokens=20, temperature=0)) for prompt in prompts[1:]]
    results = run_engine(OrtStepModel(offline), requests)
    assert [error for _, _, error in results] == [None] * 4
    assert len(results[0][0]) == 20
    for prompt, (tokens, _, _) in zip(prompts[1:], results[1:]):
        assert tokens == offline_answer(offline, tokenizer, prompt, 20)[1]


@pytest.mark.parametrize("after", [0, 5])
def test_a_row_whose_token_choice_raises_fails_alone(offline, tokenizer, monkeypatch, after):
    """One sampled row's logits turn to NaN after `after` tokens (at 0: in the prefill group, else while decoding
    beside the others): the sampler raises for that row; its sequence ends with an error naming it, and three greedy
    sequences in the same batch get `generate`'s answers."""
    prompts = [chat_prompt(tokenizer, question) for question in QUESTIONS]
    victim = SamplingParams(max_tokens=20, temperature=1.0, seed=2, ignore_eos=True)
    choose = scheduler.choose_tokens

    def poisoned(logits, sequences):
        logits = logits.copy()
        for row, sequence in enumerate(sequences):
            if sequence.params is victim and len(sequence.generated) >= after:
                logits[row] = np.nan
        return choose(logits, sequences)

    monkeypatch.setattr(scheduler, "choose_tokens", poisoned)
    requests = [(prompts[0], victim)] + [
        (prompt, SamplingParams(max_tokens=20, temperature=0)) for prompt in prompts[1:]
    ]
    results = run_engine(OrtStepModel(offline), requests)
    for prompt, (tokens, _, error) in zip(prompts[1:], results[1:]):
        assert error is None
        assert tokens == offline_answer(offline, tokenizer, prompt, 20)[1]
    tokens, reason, error = results[0]
    assert (len(tokens), reason) == (after, "error")
    assert "sequence 0" in error and "nan" in error.lower()


def test_a_poisoned_request_sent_with_innocent_ones_over_http(server, offline, tokenizer):
    """Four requests at once, one with temperature 1e-320: every one answers 200, the innocent (greedy) ones with
    `generate`'s answers, and the server serves the next request."""

    async def send_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            bodies = [
                {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 16, "temperature": 0}
                for q in QUESTIONS[1:]
            ]
            poisoned = bodies[0] | {"temperature": 1e-320, "seed": 3, "messages": [{"role": "user", "content": "Hi"}]}
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for body in [poisoned, *bodies]))

    responses = asyncio.run(send_all())
    assert [response.status_code for response in responses] == [200] * 4
    for question, response in zip(QUESTIONS[1:], responses[1:]):
        expected, _ = offline_answer(offline, tokenizer, chat_prompt(tokenizer, question), 16)
        assert response.json()["choices"][0]["message"]["content"] == expected
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


# ------------------------------------------------------------------------------------------------- log probabilities


def reference_logprobs(offline, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log-softmax of the exported model's logits at each answer position (batch 1, one forward pass)."""
    with torch.inference_mode():
        logits = offline(input_ids=torch.tensor([prompt + answer])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)], dim=-1)


def test_chat_logprobs_are_the_models_log_softmax_streamed_and_not(server, offline, tokenizer):
    """`logprobs` / `top_logprobs` on chat: OpenAI's `content` entries, one per token, with the raw model's log
    probabilities (vLLM's default: before temperature), whether streamed or not. (The streamed request repeats the
    prompt, which the prefix cache then supplies: its log probabilities may differ from the first's in float
    rounding, so each is held to the model's own.)"""
    prompt = chat_prompt(tokenizer, QUESTIONS[0])
    text, answer = offline_answer(offline, tokenizer, prompt, 12)
    reference = reference_logprobs(offline, prompt, answer)

    def assert_the_models(content):
        assert len(content) == len(answer)
        for entry, token, row in zip(content, answer, reference):
            assert entry.token == tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
            assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
            best = torch.topk(row, 3)
            assert [top.token for top in entry.top_logprobs] == [tokenizer.decode([i]) for i in best.indices.tolist()]
            assert [top.logprob for top in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    ask = dict(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=12, logprobs=True)
    reply = client.chat.completions.create(**ask, temperature=0, top_logprobs=3)
    assert reply.choices[0].message.content == text
    content = reply.choices[0].logprobs.content
    assert_the_models(content)
    chunks = list(client.chat.completions.create(**ask, temperature=0, top_logprobs=3, stream=True))
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert_the_models(streamed)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text
    # Sampled at T = 0.3, the first token's alternatives are still the raw distribution's (vLLM's default).
    sampled = client.chat.completions.create(**ask, temperature=0.3, seed=4, top_logprobs=3)
    first = sampled.choices[0].logprobs.content[0].top_logprobs
    assert [top.logprob for top in first] == pytest.approx([top.logprob for top in content[0].top_logprobs], abs=1e-5)


def test_completion_logprobs_in_the_legacy_shape(server, offline, tokenizer):
    prompt = tokenizer("The little cat")["input_ids"]
    text, answer = offline_answer(offline, tokenizer, prompt, 10)
    reference = reference_logprobs(offline, prompt, answer)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2}
    choice = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == text
    assert logprobs["tokens"] == [tokenizer.decode([token]) for token in answer]
    assert logprobs["token_logprobs"] == pytest.approx([row[t].item() for row, t in zip(reference, answer)], abs=1e-4)
    for top, row in zip(logprobs["top_logprobs"], reference):
        best = torch.topk(row, 2)  # keyed by text, as OpenAI's: two tokens of one text share an entry
        expected = {tokenizer.decode([i]): value for i, value in zip(best.indices.tolist(), best.values.tolist())}
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(answer))]
    streamed = httpx.post(server.url + "/v1/completions", json=body | {"stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    tokens = [
        token
        for event in events
        if event["choices"][0]["logprobs"]
        for token in event["choices"][0]["logprobs"]["tokens"]
    ]
    assert tokens == logprobs["tokens"]


# --------------------------------------------------------------------------------------- what vLLM clients send


def test_completions_take_a_list_of_prompts_with_choices_indexed_prompt_major(server, offline, tokenizer):
    prompts = ["Once upon a time", "The dog", "Why"]
    ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [choice.index for choice in reply.choices] == list(range(6))
    for choice in reply.choices:
        assert choice.text == offline_answer(offline, tokenizer, ids[choice.index // 2], 8)[0]
    assert reply.usage.prompt_tokens == sum(map(len, ids))
    as_id_lists = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [choice.text for choice in as_id_lists.choices] == [choice.text for choice in reply.choices[::2]]


def test_more_than_four_stop_strings_nulls_and_harmless_defaults_are_accepted(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "stop": [f"zz{i}" for i in range(20)],
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "top_k": -1,
        "temperature": 1e-320,
        "top_p": None,  # null stands for the default, as vLLM takes it
        "presence_penalty": None,
        "logprobs": None,
    }
    assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


BAD_SAMPLING = {
    "temperature NaN": (
        b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
        "temperature",
    ),
    "temperature Infinity": (
        b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], "temperature": 1e999}',
        "temperature",
    ),
    "temperature above 2": (chat(temperature=2.5), "temperature"),
    "top_p zero": (chat(top_p=0), "top_p"),
    "top_k below -1": (chat(top_k=-2), "top_k"),
    "min_p above 1": (chat(min_p=1.5), "min_p"),
    "repetition_penalty zero": (chat(repetition_penalty=0), "repetition_penalty"),
    "presence_penalty above 2": (chat(presence_penalty=2.5), "presence_penalty"),
    "frequency_penalty below -2": (chat(frequency_penalty=-3), "frequency_penalty"),
    "top_logprobs above 20": (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    "top_logprobs without logprobs": (chat(top_logprobs=2), "top_logprobs"),
    "response_format of an unknown type": (chat(response_format={"type": "xml"}), "response_format.type"),
    "response_format json_schema without a name": (
        chat(response_format={"type": "json_schema", "json_schema": {}}),
        "response_format.json_schema.name",
    ),
    "tools with a bad function name": (
        chat(tools=[{"type": "function", "function": {"name": "two words"}}]),
        "tools.0.function.name",
    ),
    "tool_choice": (chat(tool_choice="auto"), "tool_choice"),
    "functions": (chat(functions=[{"name": "f"}]), "functions"),
    "stop past 64 strings": (chat(stop=[f"s{i}" for i in range(65)]), "stop"),
}


@pytest.mark.parametrize("case", list(BAD_SAMPLING))
def test_bad_sampling_values_get_a_400_naming_the_field(server, case):
    body, named = BAD_SAMPLING[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        server.url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert named in response.json()["error"]["message"]


def test_completion_logprobs_past_5_and_more_sequences_than_the_server_holds_get_400(server):
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 6})
    assert response.status_code == 400 and "logprobs" in response.json()["error"]["message"]
    too_many = {"model": MODEL, "prompt": ["Hi"] * 5, "n": 16, "max_tokens": 2}  # 80 > 8 running + 16 waiting
    response = httpx.post(server.url + "/v1/completions", json=too_many)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n" and "at most" in response.json()["error"]["message"]


def test_the_429_message_does_not_count_the_requests_own_choices(folders):
    """One slot, held by a running sequence (its second token's callback blocks the engine), and room for one
    waiting: a request for n=2 queues its first choice and is refused on its second. Nobody else is waiting, and the
    message says so."""
    service = load_service(folders[1], threads=1, max_batch=1, max_waiting=1)
    tokens, holding, release = [], threading.Event(), threading.Event()

    def emit(event):
        tokens.append(event.token)
        if len(tokens) == 2:
            holding.set()
            release.wait(30)

    with serving(create_app(service)) as running:
        blocker = service.scheduler.submit([5, 6, 7], SamplingParams(max_tokens=100, temperature=0), emit)
        try:
            assert holding.wait(30)
            refused = httpx.post(running.url + "/v1/chat/completions", json=chat(max_tokens=2, n=2), timeout=30)
        finally:
            service.scheduler.cancel(blocker)
            release.set()
        assert refused.status_code == 429
        assert "0 other requests are waiting" in refused.json()["error"]["message"]
        assert httpx.post(running.url + "/v1/chat/completions", json=chat(max_tokens=2), timeout=30).status_code == 200


# ------------------------------------------------------------------------------------------------------ stop strings


def test_stop_strings_cut_at_the_earliest_match_not_the_first_listed(tokenizer):
    """stop=["e", "th"] on "I saw the" ends before "th" (index 6), not before "e" (index 8), whichever is listed
    first and however the tokenizer splits the text."""
    text = "I saw the cat and the dog."
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(tokens) == text
    cases = ((["e", "th"], "I saw "), (["th", "e"], "I saw "), (["dog", "cat"], "I saw the "))
    for stops, expected in cases:
        stream = TextStream(tokenizer, stops)
        pieces = [stream.add(token) for token in tokens] + [stream.flush()]
        assert "".join(pieces) == expected and stream.stopped

    from vaswani.serving.text import earliest_stop

    for stops, expected in cases:
        assert earliest_stop(text, stops, 0) == len(expected)
