"""`vaswani serve` on every decoder export the exporter writes: the README's `--quantize int8` recipe, int4 and
`--optimize` (the GroupQueryAttention form: in-place KV buffers driven by per-row lengths) and fp32 (the portable
form), each exported with validation on.

Oracle: offline greedy `OrtModelForCausalLM.generate` on the same folder, each prompt alone; batching, chunked
prefill, rows joining and leaving, and the buffers' growth must not change a token.
"""

import asyncio
import json
import threading

import httpx
import numpy as np
import pytest
import torch
from serving_cases import serving, tiny_chat_tokenizer, tiny_gqa_chat_folder

pytest.importorskip("fastapi")

from vaswani.cli import main as vaswani  # noqa: E402
from vaswani.conversion.onnx import OrtModelForCausalLM, default_session_options, export_onnx  # noqa: E402
from vaswani.serving import SamplingParams, create_app, load_service  # noqa: E402
from vaswani.serving.engine import GqaBatch, GqaStepModel, step_model  # noqa: E402
from vaswani.serving.scheduler import Engine  # noqa: E402

MODEL = "tiny-gqa-chat"
# form -> (the attention form the export takes, how it is exported)
FORMS = {
    "int8": ("gqa", "cli"),  # the README's command, through the CLI
    "int4": ("gqa", {"quantize": "int4"}),
    "optimize": ("gqa", {"optimize": True}),
    "fp32": ("portable", {}),
}
QUESTIONS = [
    "Hi",
    "Tell me a story about a cat.",
    "Once upon a time there was a little girl who lived in a village near the forest. What happened next?",
    "Why is the sky blue?",
    "a b c",
    "What did the dog say to the bird when they met in the garden and the sun was shining on them both?",
    "Hello!",
    "Count to ten.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer):
    """folder(form): the tiny chat model exported in that form, validated against PyTorch; each form once."""
    root = tmp_path_factory.mktemp("forms")
    source, folders = tiny_gqa_chat_folder(root, tokenizer), {}

    def folder(form: str):
        if form not in folders:
            output = root / form
            how = FORMS[form][1]
            if how == "cli":
                command = ["export", "--model", str(source), "--task", "text-generation", "--quantize", "int8"]
                assert vaswani([*command, "--output", str(output)]) == 0
            else:
                export_onnx(source, output, task="text-generation", validate=True, **how)
            folders[form] = output
        return folders[form]

    return folder


@pytest.fixture(scope="module")
def offline(exported):
    models = {}

    def model(form: str) -> OrtModelForCausalLM:
        if form not in models:
            models[form] = OrtModelForCausalLM.from_pretrained(exported(form), session_options=default_session_options(1))
        return models[form]

    return model


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def generated(model: OrtModelForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: offline greedy `generate` on `prompt` alone (no early stop, so every answer has its length)."""
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
        )
    return output[0, len(prompt) :].tolist()


@pytest.mark.parametrize("form", list(FORMS))
def test_16_concurrent_chats_on_each_export_form_get_generates_answers(form, exported, offline, tokenizer):
    """The README's int8 recipe (and int4, --optimize, fp32) served: 16 greedy chats at once, streamed and not, each
    answer the tokens of offline `generate` on that folder. Before the GroupQueryAttention form had a batch of its
    own, every request to a quantized export answered 500 (the graph's seqlens_k etc. were never fed)."""
    folder = exported(form)
    assert json.loads((folder / "manifest.json").read_text())["attention_form"] == FORMS[form][0]
    cases = [(QUESTIONS[i % len(QUESTIONS)], 6 + (11 * i) % 37) for i in range(16)]
    prompts = {question: chat_prompt(tokenizer, question) for question in QUESTIONS}
    expected = {case: generated(offline(form), prompts[case[0]], case[1]) for case in set(cases)}

    async def chat(http: httpx.AsyncClient, index: int) -> list[int]:
        question, max_tokens = cases[index]
        body = {
            "model": MODEL,
            "prompt": prompts[question],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": index % 2 == 1,
        }
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if index % 2:
            events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            text = "".join(event["choices"][0]["text"] for event in events)
        else:
            text = response.json()["choices"][0]["text"]
        return text

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(chat(http, index) for index in range(len(cases))))

    service = load_service(folder, threads=1, max_batch=16, name=MODEL)
    assert isinstance(service.engine.model, GqaStepModel) == (FORMS[form][0] == "gqa")
    with serving(create_app(service)) as server:
        answers = asyncio.run(run_all())
    expected_texts = [tokenizer.decode(expected[case], skip_special_tokens=True) for case in cases]
    assert answers == expected_texts
