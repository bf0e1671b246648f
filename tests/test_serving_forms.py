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
from serving_cases import QUESTIONS, scheduled_tokens, serving, tiny_chat_tokenizer, tiny_gqa_chat_folder

pytest.importorskip("fastapi")

from vaswani.cli.main import main as vaswani  # noqa: E402
from vaswani.export import trace_onnx  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.runtime.decoders.gqa import GqaBatch, GqaStepModel  # noqa: E402
from vaswani.serving import SamplingParams, create_app, load_service  # noqa: E402
from vaswani.serving.scheduler import Scheduler  # noqa: E402

MODEL = "tiny-gqa-chat"
# form -> (the attention form the export takes, how it is exported)
FORMS = {
    "int8": ("gqa", "cli"),  # the README's command, through the CLI
    "int4": ("gqa", {"quantize": "int4"}),
    "optimize": ("gqa", {"optimize": True}),
    "fp32": ("portable", {}),
}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer):
    """folder(form): the tiny chat model exported in that form, validated against PyTorch; each form once, the
    library's forms from one trace."""
    root = tmp_path_factory.mktemp("forms")
    source, folders, traces = tiny_gqa_chat_folder(root, tokenizer), {}, []

    def folder(form: str):
        if form not in folders:
            output = root / form
            how = FORMS[form][1]
            if how == "cli":
                command = ["export", "--model", str(source), "--task", "text-generation", "--quantize", "int8"]
                assert vaswani([*command, "--output", str(output)]) == 0
            else:
                if not traces:
                    traces.append(trace_onnx(source, task="text-generation"))
                traces[0].export(output, validate=True, **how)
            folders[form] = output
        return folders[form]

    yield folder
    for traced in traces:
        traced.close()


@pytest.fixture(scope="module")
def offline(exported):
    models = {}

    def model(form: str) -> OrtModelForCausalLM:
        if form not in models:
            models[form] = OrtModelForCausalLM.from_pretrained(
                exported(form), session_options=default_session_options(1)
            )
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

    async def chat(http: httpx.AsyncClient, index: int) -> str:
        question, max_tokens = cases[index]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": index % 2 == 1,
        }
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        if index % 2:
            events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            assert all("choices" in event for event in events), events
            return "".join(event["choices"][0]["delta"].get("content", "") for event in events if event["choices"])
        return response.json()["choices"][0]["message"]["content"]

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(chat(http, index) for index in range(len(cases))))

    service = load_service(folder, threads=1, max_batch=16, name=MODEL)
    assert isinstance(service.scheduler.model, GqaStepModel) == (FORMS[form][0] == "gqa")
    with serving(create_app(service)) as server:
        answers = asyncio.run(run_all())
    expected_texts = [tokenizer.decode(expected[case], skip_special_tokens=True) for case in cases]
    assert len(set(expected_texts)) == len(cases)  # 16 different answers: a swapped or repeated row would show
    assert answers == expected_texts


# ------------------------------------------------------------------- the GroupQueryAttention batch, at engine level


def test_gqa_batch_rows_join_mid_stream_leave_early_and_grow_its_buffers_as_generate(offline, tokenizer):
    """Driven by hand: a row decodes; three prompts are prefilled in chunks of 4 columns between its steps (the
    longest first, so a chunk never feeds a row zero tokens) and two of them join (the third, say, finished at its
    first token); the first row leaves, the last row moves into its slot; the buffers' capacity doubles three times. Every row's tokens equal offline greedy `generate` on its prompt alone."""
    model = offline("int8")
    step = model.decoder_runtime.step_model()
    assert isinstance(step, GqaStepModel)
    batch = step.new_batch()
    prompts = {name: chat_prompt(tokenizer, QUESTIONS[i]) for name, i in (("a", 0), ("b", 1), ("c", 5), ("d", 4))}
    tokens = {name: [] for name in prompts}
    capacities, sizes = [], []

    def decode(steps: int) -> None:
        for _ in range(steps):
            logits = batch.step(np.array([tokens[name][-1] for name in batch.rows]))
            for name, token in zip(batch.rows, logits.argmax(-1).tolist()):
                tokens[name].append(token)
            capacities.append(batch.capacity)
            sizes.append(len(batch))

    first = step.prefill_group(["a"], [prompts["a"]])
    tokens["a"].append(int(first.run(first.columns)[0].argmax()))
    batch.join(first, [0])
    decode(3)
    group = step.prefill_group(["b", "c", "d"], [prompts[name] for name in "bcd"])
    assert group.rows == ["c", "b", "d"]  # longest prompt first
    chunks = 0
    while not group.done:
        logits = group.run(4)
        chunks += 1
        decode(1)
    assert chunks >= 5
    for name, row in zip(group.rows, logits.argmax(-1).tolist()):
        tokens[name].append(row)
    batch.join(group, [0, 2])  # "c" and "d"; "b" leaves before joining
    assert batch.rows == ["a", "c", "d"]
    decode(10)
    batch.keep([1, 2])  # "a" leaves: "d", the last row, moves into its slot
    assert batch.rows == ["d", "c"]
    decode(90)
    # Doubled from 32 (a's prompt) as a decoded, when c joined, and as c decoded.
    assert len(prompts["c"]) + len(tokens["c"]) > 128
    assert capacities[0] == 32 and sorted(set(capacities)) == [32, 64, 128, 256]
    assert 3 in sizes and sizes[-1] == 2
    for name in ("a", "c", "d"):
        assert tokens[name] == generated(model, prompts[name], len(tokens[name])), name
    assert tokens["b"] == generated(model, prompts["b"], 1)


class RecordingGqaStepModel(GqaStepModel):
    """The step model, recording (rows, columns) of every prefill call and (rows, capacity) of every decoding step.
    With `hold_at` n, the decoding step after the first n waits for `gate` (`held` says it is waiting): requests
    submitted meanwhile reach the scheduler together, at the same point of the running answer in every run, however
    slowly a busy machine runs either thread (where they join decides which calls compute which tokens, and a call's
    size can change a quantized graph's rounding)."""

    def __init__(self, model, hold_at: int | None = None):
        super().__init__(model, model.decoder_runtime.decoder)
        self.prefills, self.steps = [], []
        self.hold_at = hold_at
        self.gate, self.held = threading.Event(), threading.Event()
        run = self.decoder.run

        def recorded(input_ids, *args):
            self.prefills.append(tuple(input_ids.shape))
            return run(input_ids, *args)

        self.decoder = type(self.decoder)(self.decoder.session, model.manifest, self.decoder.max_positions)
        self.decoder.run = recorded

    def new_batch(self):
        step_model, batch = self, GqaBatch(self.decoder)
        original = batch.step

        def step(tokens):
            if len(step_model.steps) == step_model.hold_at:
                step_model.held.set()
                step_model.gate.wait(timeout=30)
            logits = original(tokens)
            step_model.steps.append((len(batch), batch.capacity))
            return logits

        batch.step = step
        return batch


def test_engine_on_the_gqa_form_prefills_in_chunks_beside_running_rows(offline, tokenizer):
    """The engine's scheduler on the GroupQueryAttention batch: five prompts of different lengths and answer lengths
    join in chunks of 5 columns while a long answer decodes, leave at their own lengths, and all answers equal offline
    `generate`."""
    model = offline("int4")
    step = RecordingGqaStepModel(model, hold_at=3)  # the five arrive together, after the long answer's 3rd step
    engine = Scheduler(step, max_batch=8, max_num_batched_tokens=1 + 5 + 5 * 5)  # 5 columns for 5 rows beside 1
    prompts = [chat_prompt(tokenizer, question) for question in QUESTIONS[:5]]
    lengths = [7, 30, 3, 18, 12]
    answers, finished = {i: [] for i in range(len(prompts) + 1)}, threading.Semaphore(0)

    def emitter(index):
        def emit(event):
            answers[index].append(event.token)
            if event.finish_reason:
                finished.release()

        return emit

    first = chat_prompt(tokenizer, QUESTIONS[6])
    params = dict(temperature=0, ignore_eos=True)
    engine.start()
    try:
        engine.submit(first, SamplingParams(max_tokens=120, **params), emitter(len(prompts)))
        assert step.held.wait(timeout=30)
        for index, prompt in enumerate(prompts):
            engine.submit(prompt, SamplingParams(max_tokens=lengths[index], **params), emitter(index))
        step.gate.set()
        for _ in range(len(prompts) + 1):
            assert finished.acquire(timeout=30)
    finally:
        engine.stop()
    for index, prompt in enumerate(prompts):
        assert answers[index] == generated(model, prompt, lengths[index])
    assert answers[len(prompts)] == generated(model, first, 120)
    assert max(rows for rows, _ in step.steps) == 6 and step.steps[-1][0] == 1
    assert any(columns < max(map(len, prompts)) for _, columns in step.prefills[1:])  # chunks, not whole prompts
    assert len({capacity for _, capacity in step.steps}) > 1


def test_gqa_form_on_cuda_is_refused_at_load_time_with_the_fix(exported):
    with pytest.raises(ValueError, match="--attention portable"):
        load_service(exported("int8"), provider="cuda")


def test_seeded_sampling_on_the_gqa_form_equals_generate_alone_and_beside_others(offline, tokenizer):
    """One sampler for both forms: on the int8 (GroupQueryAttention) folder, a seeded sampled answer is
    `generate(do_sample=True)`'s under the same seed, whether it runs alone or beside two other sampled rows."""
    model = offline("int8")
    prompts = [chat_prompt(tokenizer, question) for question in QUESTIONS[:3]]
    values = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2)
    torch.manual_seed(5)
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompts[0]]), max_new_tokens=30, min_new_tokens=30, do_sample=True, top_k=0, **values
        )
    expected = output[0, len(prompts[0]) :].tolist()
    others = [SamplingParams(max_tokens=20 + 10 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(2)]
    seeded = SamplingParams(max_tokens=30, seed=5, ignore_eos=True, **values)
    assert served_tokens(model, [(prompts[0], seeded)])[0] == expected
    assert served_tokens(model, [(prompts[0], seeded), *zip(prompts[1:], others)])[0] == expected


def served_tokens(model: OrtModelForCausalLM, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Each request's tokens from a scheduler over `model`, every request submitted before it starts."""
    return scheduled_tokens(Scheduler(model.decoder_runtime.step_model(), max_batch=4), requests, timeout=30)
