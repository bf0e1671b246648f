"""The request fields that steer an answer token by token: OpenAI's `logit_bias`, and vLLM's `min_tokens`,
`stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens` and `spaces_between_special_tokens`.

Oracles: offline greedy `generate` on the same exported folder, with transformers' own `SequenceBiasLogitsProcessor`
for a biased answer; the tokenizer's `decode` of the expected tokens.
"""

import json

import httpx
import pytest
from serving_cases import offline_answer, scheduled_tokens, serving, tiny_chat_tokenizer

pytest.importorskip("fastapi")

import torch  # noqa: E402
from transformers.generation.logits_process import SequenceBiasLogitsProcessor  # noqa: E402

from vaswani.runtime import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.runtime.decoders.portable import OrtStepModel  # noqa: E402
from vaswani.serving import SamplingParams, create_app, load_service  # noqa: E402
from vaswani.serving.scheduler import Scheduler  # noqa: E402

MODEL = "tiny-chat"
QUESTIONS = ["Tell me a story about a cat.", "Why is the sky blue?", "Hello!"]
STEPS = 12


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def offline(tiny_chat_pair):
    return OrtModelForCausalLM.from_pretrained(tiny_chat_pair["onnx"], session_options=default_session_options(1))


@pytest.fixture(scope="module")
def server(tiny_chat_pair):
    service = load_service(tiny_chat_pair["onnx"], threads=1, max_batch=8, max_waiting=16)
    with serving(create_app(service)) as running:
        yield running


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def engine_tokens(offline, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    return scheduled_tokens(Scheduler(OrtStepModel(offline), max_batch=8, max_waiting=len(requests)), requests)


def biased_generate(offline, prompt: list[int], bias: dict[int, float]) -> list[int]:
    """The oracle of a biased greedy answer: `generate` with transformers' sequence bias on single tokens."""
    processor = SequenceBiasLogitsProcessor({(token,): float(value) for token, value in bias.items()})
    with torch.inference_mode():
        output = offline.generate(
            torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, logits_processor=[processor]
        )
    return output[0, len(prompt) :].tolist()


def most_common(tokens: list[int]) -> int:
    return max(set(tokens), key=tokens.count)


def test_logit_bias_bans_and_forces_a_token_per_row_of_the_batch(offline, tokenizer):
    """-100 on the token greedy picks most removes it (the answer is `generate`'s with the same bias), +100 on another
    makes it every token, greedy and sampled, and an unbiased row batched beside them keeps `generate`'s answer."""
    eos = frozenset({tokenizer.eos_token_id})
    prompts = [chat_prompt(tokenizer, question) for question in QUESTIONS]
    plain = [offline_answer(offline, tokenizer, prompt, STEPS)[1] for prompt in prompts]
    banned = most_common(plain[0])
    forced = next(token for token in range(5, 200) if token not in plain[2])
    requests = [
        (prompts[0], SamplingParams(max_tokens=STEPS, temperature=0.0, stop_token_ids=eos, logit_bias={banned: -100})),
        (prompts[1], SamplingParams(max_tokens=STEPS, temperature=0.0, stop_token_ids=eos)),
        (prompts[2], SamplingParams(max_tokens=STEPS, temperature=0.0, stop_token_ids=eos, logit_bias={forced: 100})),
        (prompts[2], SamplingParams(max_tokens=STEPS, seed=3, stop_token_ids=eos, logit_bias={forced: 100})),
    ]
    banning, unbiased, forcing, sampled = engine_tokens(offline, requests)
    assert banned in plain[0] and banned not in banning
    assert banning == biased_generate(offline, prompts[0], {banned: -100})
    assert unbiased == plain[1]
    assert forcing == sampled == [forced] * STEPS


def test_min_tokens_holds_the_end_back_and_stop_token_ids_end_the_answer(offline, tokenizer):
    """A +100 bias on the end-of-sequence ends the answer at its first token; min_tokens=5 masks it for five tokens
    (the sixth is the end). A request's stop_token_ids end it at that token, even under ignore_eos, and min_tokens
    holds them back too."""
    eos = tokenizer.eos_token_id
    prompt = chat_prompt(tokenizer, QUESTIONS[0])
    plain = offline_answer(offline, tokenizer, prompt, STEPS)[1]
    stop = plain[3]
    cut = plain.index(stop)
    biased = dict(max_tokens=STEPS, temperature=0.0, stop_token_ids=frozenset({eos}), logit_bias={eos: 100})
    stopped = dict(max_tokens=STEPS, temperature=0.0, ignore_eos=True, request_stop_ids=frozenset({stop}))
    early, held, at_stop, held_stop = engine_tokens(
        offline,
        [
            (prompt, SamplingParams(**biased)),
            (prompt, SamplingParams(**biased, min_tokens=5)),
            (prompt, SamplingParams(**stopped)),
            (prompt, SamplingParams(**stopped, min_tokens=cut + 2)),
        ],
    )
    assert early == [eos]
    assert len(held) == 6 and held[-1] == eos and eos not in held[:-1]
    assert at_stop == plain[: cut + 1]
    assert len(held_stop) > cut + 2 and stop not in held_stop[: cut + 2]


def post(server, route: str, **fields) -> httpx.Response:
    if route == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}], "temperature": 0, **fields}
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    body = {"model": MODEL, "prompt": QUESTIONS[0], "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def text_of(response: httpx.Response) -> tuple[str, str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"], choice["finish_reason"]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_logit_bias_over_http_with_string_keys(server, offline, tokenizer, route):
    prompt = chat_prompt(tokenizer, QUESTIONS[0]) if route == "chat" else tokenizer(QUESTIONS[0])["input_ids"]
    plain_text, plain = offline_answer(offline, tokenizer, prompt, STEPS)
    banned = most_common(plain)
    assert text_of(post(server, route, max_tokens=STEPS))[0] == plain_text
    expected = tokenizer.decode(biased_generate(offline, prompt, {banned: -100}), skip_special_tokens=True)
    assert text_of(post(server, route, max_tokens=STEPS, logit_bias={str(banned): -100}))[0] == expected
    assert expected != plain_text


def test_stop_token_ids_and_stop_strings_kept_or_cut(server, offline, tokenizer):
    """A stop token ends the answer with "stop" and is not in its text; a stop string is cut off, or kept with
    include_stop_str_in_output (streamed and not), and does not stop an answer shorter than min_tokens."""
    prompt = chat_prompt(tokenizer, QUESTIONS[0])
    plain_text, plain = offline_answer(offline, tokenizer, prompt, STEPS)
    assert len(plain) == STEPS and tokenizer.eos_token_id not in plain  # the answer runs to max_tokens
    cut = plain.index(plain[3])
    text, reason = text_of(post(server, "chat", max_tokens=STEPS, stop_token_ids=[plain[3]], ignore_eos=True))
    assert (text, reason) == (tokenizer.decode(plain[:cut], skip_special_tokens=True), "stop")

    stop = plain_text[len(plain_text) // 2 :][:3]
    end = plain_text.index(stop)
    assert text_of(post(server, "chat", max_tokens=STEPS, stop=[stop])) == (plain_text[:end], "stop")
    kept = (plain_text[: end + len(stop)], "stop")
    assert text_of(post(server, "chat", max_tokens=STEPS, stop=[stop], include_stop_str_in_output=True)) == kept
    assert text_of(post(server, "chat", max_tokens=STEPS, stop=[stop], min_tokens=STEPS)) == (plain_text, "length")
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": STEPS, "stream": True}
    body |= {"stop": [stop], "include_stop_str_in_output": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line)["choices"][0] for line in lines]
    assert "".join(chunk["text"] for chunk in chunks) == kept[0] and chunks[-1]["finish_reason"] == "stop"


def test_special_tokens_are_shown_only_when_not_skipped(server, tokenizer):
    """A special token forced with logit_bias is left out of the text by default and shown with
    skip_special_tokens false; spaces_between_special_tokens is taken (a fast tokenizer has no spaces to add)."""
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert special != tokenizer.eos_token_id
    forced = dict(max_tokens=3, logit_bias={str(special): 100})
    assert text_of(post(server, "chat", **forced)) == ("", "length")
    shown = text_of(post(server, "chat", **forced, skip_special_tokens=False, spaces_between_special_tokens=False))
    assert shown == ("<|endoftext|>" * 3, "length")


BAD_FIELDS = {
    "bias above 100": (dict(logit_bias={"5": 101}), "logit_bias", "between -100 and 100"),
    "bias below -100": (dict(logit_bias={"5": -100.5}), "logit_bias", "between -100 and 100"),
    "bias key not an id": (dict(logit_bias={"hello": 1}), "logit_bias", "keys are token ids"),
    "bias id outside the vocabulary": (dict(logit_bias={"100000": 1}), "logit_bias", "outside the vocabulary"),
    "stop id outside the vocabulary": (dict(stop_token_ids=[100000]), "stop_token_ids", "outside the vocabulary"),
    "min_tokens above max_tokens": (dict(max_tokens=4, min_tokens=5), "min_tokens", "raise max_tokens"),
    "min_tokens negative": (dict(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
}


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_bad_values_get_a_400_naming_the_field_and_the_fix(server, case, route):
    fields, named, fix = BAD_FIELDS[case]
    response = post(server, route, **fields)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == named and named in error["message"] and fix in error["message"]


def test_the_new_fields_at_their_defaults_and_nulls_are_accepted(server):
    fields = dict(logit_bias={}, stop_token_ids=[], min_tokens=None, include_stop_str_in_output=None)
    fields |= dict(skip_special_tokens=None, spaces_between_special_tokens=True, max_tokens=2)
    assert text_of(post(server, "chat", **fields))[1] == "length"
