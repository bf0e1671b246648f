"""Speculative decoding in the server (`serving.speculation`): prompt-lookup proposals verified in one step of the
model, on every batch kind (per-row lengths: the GroupQueryAttention form; the left-padded batch: the portable form,
PyTorch, and OpenVINO holding the cache between steps).

Oracles: plain decoding through the same scheduler, and offline greedy `generate` (greedy speculation must give the
same tokens and log probabilities, with proposals kept and with every proposal rejected); plain sampling's empirical
distribution (sampled speculation must draw from the same one: the total variation distance between the histograms
stays within sampling noise, while a rule that keeps every proposal lands outside it, so the test can fail).
"""

import math
import threading
from collections import Counter

import httpx
import pytest
import torch
from serving_cases import QUESTIONS, scheduled_results, scrape, serving, tiny_chat_tokenizer, tiny_gqa_chat_folder

pytest.importorskip("onnxruntime")

from vaswani import VaswaniForCausalLM  # noqa: E402
from vaswani.export import export_onnx  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.runtime.speculative import propose_ngram  # noqa: E402
from vaswani.serving import SamplingParams, create_app, load_service  # noqa: E402
from vaswani.serving.batches import TorchStepModel  # noqa: E402
from vaswani.serving.draft import DraftProposer, load_draft  # noqa: E402
from vaswani.serving.scheduler import Scheduler  # noqa: E402
from vaswani.serving.speculation import SpeculativeConfig, Speculator, check_draft  # noqa: E402

# Text that repeats itself, so that prompt lookup finds n-grams to propose.
REPEATING = "Once upon a time there was a cat. The cat was happy. Once upon a time there was a cat. The cat"
NEW_TOKENS = 24
DRAWS = 300
FORMS = ("gqa-int8", "portable", "torch", "openvino")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    """{"torch": the PyTorch folder, "portable": its fp32 export, "gqa-int8": its int8 GroupQueryAttention export}."""
    root = tmp_path_factory.mktemp("speculative-serving")
    source = tiny_gqa_chat_folder(root, tokenizer)
    export_onnx(source, root / "portable", task="text-generation", validate=False)
    export_onnx(source, root / "gqa-int8", task="text-generation", quantize="int8", validate=False)
    return {"torch": source, "portable": root / "portable", "gqa-int8": root / "gqa-int8"}


@pytest.fixture(scope="module")
def step_models(folders):
    models = {}

    def step_model(form: str):
        if form not in models:
            if form == "torch":
                models[form] = TorchStepModel(VaswaniForCausalLM.from_pretrained(folders[form]))
            elif form == "openvino":  # the portable export, OpenVINO holding the batch's cache between steps
                pytest.importorskip("openvino")
                # In f32: greedy speculation keeps plain decoding's tokens only where a verification call computes
                # what one-token steps do, which OpenVINO's bf16 kernels ("auto" on CPUs with bfloat16) do not.
                model = OrtModelForCausalLM.from_pretrained(
                    folders["portable"], engine="openvino", openvino_precision="f32"
                )
                models[form] = model.decoder_runtime.step_model()
            else:
                model = OrtModelForCausalLM.from_pretrained(folders[form], session_options=default_session_options(1))
                models[form] = model.decoder_runtime.step_model()
        return models[form]

    return step_model


def prompts(tokenizer) -> list[list[int]]:
    """A repeating prompt and chat questions of different lengths (rows of one batch with different proposals)."""
    texts = [REPEATING, QUESTIONS[2], f"{QUESTIONS[1]} {QUESTIONS[1]}", QUESTIONS[4]]
    return [tokenizer(text)["input_ids"] for text in texts]


def greedy(max_tokens: int = NEW_TOKENS, **values) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **values)


def ngram(**values) -> Speculator:
    return Speculator(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None, **values))


def test_propose_ngram_takes_what_followed_the_last_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(tokens, 2, longest=3, shortest=2) == [7, 8]  # "2 3" last occurred before "7 8"
    assert propose_ngram([1, 2, 3, 4], 2, longest=3, shortest=1) == []  # nothing recurs
    assert propose_ngram([5, 6, 5, 6], 4, longest=2, shortest=1) == [5, 6]  # what is left, not more


@pytest.mark.parametrize("form", FORMS)
def test_greedy_speculation_serves_plain_greedy_tokens_and_logprobs(step_models, folders, tokenizer, form):
    """Four rows speculating together (different proposals, some none): the tokens are plain greedy decoding's
    (and the first row's `generate`'s), the log probabilities within float tolerance, and proposals were kept."""
    step_model = step_models(form)
    requests = [(prompt, greedy(logprobs=3)) for prompt in prompts(tokenizer)]
    plain = scheduled_results(Scheduler(step_model), requests)
    speculator = ngram()
    speculative = scheduled_results(Scheduler(step_model, speculator=speculator), requests)
    assert [tokens for tokens, _, _ in speculative] == [tokens for tokens, _, _ in plain]
    assert speculator.accepted_tokens > 0 and speculator.draft_tokens > speculator.accepted_tokens
    if form in ("gqa-int8", "portable"):
        offline = OrtModelForCausalLM.from_pretrained(folders[form])
        prompt = requests[0][0]
        output = offline.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert speculative[0][0] == output[0, len(prompt) :].tolist()


@pytest.mark.parametrize("form", ["gqa-int8", "portable"])
@pytest.mark.parametrize("draft", ["other-model", "itself"])
def test_draft_model_speculation_serves_plain_greedy_tokens(
    step_models, folders, tiny_chat_pair, tokenizer, form, draft
):
    """A draft model's greedy proposals (another tiny model with the same tokenizer, or the target's own export,
    whose proposals are nearly all kept), one draft cache per row: the tokens are plain greedy decoding's."""
    step_model = step_models(form)
    requests = [(prompt, greedy()) for prompt in prompts(tokenizer)]
    plain = scheduled_results(Scheduler(step_model), requests)
    draft_model = load_draft(tiny_chat_pair["onnx"] if draft == "other-model" else folders[form], threads=1)
    config = SpeculativeConfig(method="draft_model", model="draft", disable_by_batch_size=None)
    speculator = Speculator(config, DraftProposer(draft_model))
    speculative = scheduled_results(Scheduler(step_model, speculator=speculator), requests)
    assert [tokens for tokens, _, _ in speculative] == [tokens for tokens, _, _ in plain]
    assert speculator.draft_tokens > 0
    if draft == "itself":
        assert speculator.accepted_tokens > 0.9 * speculator.draft_tokens


def scheduled_logprobs(scheduler, requests: list) -> list[list]:
    """Each request's tokens' log probabilities from `scheduler` (started after every request is submitted)."""
    events = [[] for _ in requests]
    finished = threading.Semaphore(0)

    def emitter(row):
        def emit(event):
            events[row].append(event)
            if event.finish_reason is not None:
                finished.release()

        return emit

    for row, (prompt, params) in enumerate(requests):
        scheduler.submit(prompt, params, emitter(row))
    scheduler.start()
    try:
        for _ in requests:
            assert finished.acquire(timeout=60), "the scheduler did not finish every request"
    finally:
        scheduler.stop()
    return [[event.logprobs for event in row] for row in events]


@pytest.mark.parametrize("form", ["gqa-int8", "portable"])
def test_greedy_speculation_logprobs_match_plain_logprobs(step_models, tokenizer, form):
    step_model = step_models(form)
    requests = [(prompt, greedy(logprobs=3)) for prompt in prompts(tokenizer)[:2]]
    plain = scheduled_logprobs(Scheduler(step_model), requests)
    speculative = scheduled_logprobs(Scheduler(step_model, speculator=ngram()), requests)
    for plain_row, speculative_row in zip(plain, speculative):
        assert len(plain_row) == len(speculative_row) == NEW_TOKENS
        for expected, actual in zip(plain_row, speculative_row):
            assert actual.logprob == pytest.approx(expected.logprob, abs=1e-4)
            assert [token for token, _ in actual.top] == [token for token, _ in expected.top]
            assert [value for _, value in actual.top] == pytest.approx([value for _, value in expected.top], abs=1e-4)


class WrongProposals(Speculator):
    """Proposes, for one row, tokens that differ from the known answer at every position: all are rejected."""

    def __init__(self, answer: list[int], vocab: int):
        super().__init__(SpeculativeConfig(num_speculative_tokens=3))
        self.answer, self.vocab = answer, vocab

    def proposals(self, sequences, context_length):
        done = len(sequences[0].generated)
        wrong = [(token + 1) % self.vocab for token in self.answer[done : done + 3]]
        return [wrong[: max(0, NEW_TOKENS - done - 1)]] if wrong[: NEW_TOKENS - done - 1] else None


@pytest.mark.parametrize("form", ["gqa-int8", "portable"])
def test_greedy_speculation_with_every_proposal_rejected_is_plain_greedy(step_models, tokenizer, form):
    step_model = step_models(form)
    request = [(prompts(tokenizer)[1], greedy())]
    [(plain, _, _)] = scheduled_results(Scheduler(step_model), request)
    speculator = WrongProposals(plain, step_model.vocab_size)
    [(speculative, _, _)] = scheduled_results(Scheduler(step_model, speculator=speculator), request)
    assert speculative == plain
    assert speculator.draft_tokens > 0 and speculator.accepted_tokens == 0


class FixedProposals(Speculator):
    """Proposes the same tokens at every step (whatever the text), so that the rule is exercised at each position."""

    def __init__(self, tokens: list[int]):
        super().__init__(SpeculativeConfig(num_speculative_tokens=len(tokens), disable_by_batch_size=None))
        self.tokens = tokens

    def proposals(self, sequences, context_length):
        left = [sequence.params.max_tokens - len(sequence.generated) - 1 for sequence in sequences]
        return [self.tokens[: max(0, room)] for room in left]


class KeepEveryProposal(FixedProposals):
    """A wrong rule: every proposal is kept, whatever its probability (the sampled tokens' law changes)."""

    def step(self, batch, sequences, proposed):
        from vaswani.serving import speculation

        keep = speculation.rejection_sample
        speculation.rejection_sample = lambda sampler, logits, proposal: proposal
        try:
            return super().step(batch, sequences, proposed)
        finally:
            speculation.rejection_sample = keep


def later_tokens(step_model, prompt, seeds, speculator=None) -> Counter:
    """How often each (second, third) answer token pair is drawn over `seeds` (the first comes from the prefill)."""
    requests = [(prompt, SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=seed)) for seed in seeds]
    results = scheduled_results(
        Scheduler(step_model, max_batch=16, max_waiting=len(seeds), speculator=speculator), requests
    )
    return Counter(tuple(tokens[1:3]) for tokens, _, _ in results)


def total_variation(a: Counter, b: Counter) -> float:
    total_a, total_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[key] / total_a - b[key] / total_b) for key in set(a) | set(b))


def test_sampled_speculation_draws_from_the_plain_distribution(step_models, tokenizer):
    """Plain sampling, prompt lookup, fixed proposals (the plain run's most frequent tokens) and a draft model (the
    target itself: greedy proposals), each over seeds of its own: the histograms of the second and third tokens agree within sampling noise; keeping every proposal is told
    apart at the same size."""
    step_model = step_models("gqa-int8")
    prompt = prompts(tokenizer)[0]
    plain = later_tokens(step_model, prompt, range(DRAWS))
    again = later_tokens(step_model, prompt, range(DRAWS, 2 * DRAWS))
    lookup = later_tokens(step_model, prompt, range(2 * DRAWS, 3 * DRAWS), ngram())
    likely = [Counter(pair[i] for pair in plain.elements()).most_common(1)[0][0] for i in (0, 1)]
    fixed_speculator = FixedProposals(likely)
    fixed = later_tokens(step_model, prompt, range(3 * DRAWS, 4 * DRAWS), fixed_speculator)
    wrong = later_tokens(step_model, prompt, range(4 * DRAWS, 5 * DRAWS), KeepEveryProposal(likely))
    config = SpeculativeConfig(method="draft_model", model="itself", disable_by_batch_size=None)
    drafted = later_tokens(
        step_model, prompt, range(5 * DRAWS, 6 * DRAWS), Speculator(config, DraftProposer(step_model))
    )
    # Two independent samples of DRAWS over k cells differ by about sqrt(k / (2 pi DRAWS)) in total variation (the
    # mean absolute deviation of the cells' binomial frequencies, summed): three times that is the bound.
    cells = len(set(plain) | set(again))
    bound = 3 * math.sqrt(cells / (2 * math.pi * DRAWS))
    assert total_variation(plain, again) < bound, "the bound must hold for two plain samples"
    assert total_variation(plain, lookup) < bound and total_variation(plain, fixed) < bound
    assert total_variation(plain, drafted) < bound
    # The rule was exercised both ways: some proposals kept, some rejected.
    assert 0 < fixed_speculator.accepted_tokens < fixed_speculator.draft_tokens
    assert total_variation(plain, wrong) > bound, "a wrong rule must land outside the bound"


def test_served_speculation_counts_drafts_in_metrics_and_health(folders, tokenizer):
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    service = load_service(folders["gqa-int8"], threads=1, speculative_config=config)
    plain_service = load_service(folders["gqa-int8"], threads=1)
    answers = []
    for served in (plain_service, service):
        with serving(create_app(served)) as running, httpx.Client(base_url=running.url, timeout=30) as http:
            body = {"model": served.name, "prompt": REPEATING, "max_tokens": NEW_TOKENS, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["text"])
            if served is service:
                metrics = scrape(http)
                health = http.get("/health").json()
    assert answers[0] == answers[1]
    proposed = metrics[("vaswani_spec_decode_num_draft_tokens_total", ())]
    accepted = metrics[("vaswani_spec_decode_num_accepted_tokens_total", ())]
    assert metrics[("vaswani_spec_decode_num_drafts_total", ())] > 0 and 0 < accepted <= proposed
    assert health["speculation"]["accepted_tokens"] == accepted


@pytest.mark.parametrize(
    "config, named",
    [
        ('{"method": "ngram", "num_speculative_token": 4}', "num_speculative_token"),
        ('{"method": "eagle"}', "method"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ("ngram", "JSON"),
        ('{"method": "draft_model"}', "model"),
        ('{"method": "draft_model", "model": "/no/such/folder"}', "no config.json"),
    ],
)
def test_bad_speculative_config_is_refused_with_what_to_fix(tiny_chat_pair, capsys, config, named):
    from vaswani.cli.main import main as vaswani

    if named != "no config.json":  # the config itself is wrong; a missing draft folder is found when it loads
        with pytest.raises(ValueError, match=named):
            SpeculativeConfig.parse(config)
    assert vaswani(["serve", str(tiny_chat_pair["onnx"]), "--speculative-config", config]) == 2
    assert named in capsys.readouterr().err


def test_load_service_loads_a_draft_model_and_checks_its_vocabulary(folders, tiny_chat_pair, tokenizer):
    config = {"method": "draft_model", "model": str(tiny_chat_pair["onnx"]), "num_speculative_tokens": 3}
    service = load_service(folders["gqa-int8"], threads=1, speculative_config=config)
    assert service.scheduler.speculator.draft is not None
    requests = [(prompts(tokenizer)[0], greedy())]
    [(plain, _, _)] = scheduled_results(Scheduler(service.scheduler.model), requests)
    [(speculative, _, _)] = scheduled_results(service.scheduler, requests)
    assert speculative == plain and service.scheduler.speculator.draft_tokens > 0
    other = Speculator(SpeculativeConfig(method="draft_model", model="other"), service.scheduler.speculator.draft)
    with pytest.raises(ValueError, match="vocabulary"):
        check_draft(other, service.vocab_size + 1)  # a draft whose tokenizer is not the served model's
