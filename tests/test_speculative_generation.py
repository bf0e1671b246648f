"""Speculative decoding offline on ONNX Runtime folders: prompt lookup (`prompt_lookup_num_tokens`, n-gram proposals from
the prompt; one prompt runs in the lean loop `runtime.speculative.prompt_lookup_sample`) and a draft model
(`assistant_model`, a smaller export with the same tokenizer, through transformers' assisted generation), each proposal
verified in one step of the target.

Oracles: plain greedy `generate` on the same folder (speculative greedy output must be identical, token for token,
for the portable fp32 form and the GroupQueryAttention int8 form); plain sampling's empirical distribution (sampled
speculation must draw from the same distribution: the total variation distance between the two histograms stays
within what sampling noise gives, while a different sampler lands outside it, so the test can fail).
"""

import math
from collections import Counter

import pytest
import torch
from serving_cases import tiny_chat_tokenizer, tiny_gqa_chat_folder

pytest.importorskip("onnxruntime")

from vaswani.export import export_onnx  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM  # noqa: E402

# A prompt that repeats itself, so that prompt lookup finds n-grams to propose.
PROMPT = "Once upon a time there was a cat. The cat was happy. Once upon a time there was a cat. The cat"
NEW_TOKENS = 24
DRAWS = 240


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer, tiny_chat_pair):
    """{"portable": fp32 export, "gqa-int8": int8 export in the GroupQueryAttention form} of one target model, and
    the tiny chat export as the draft (same tokenizer, fewer parameters)."""
    root = tmp_path_factory.mktemp("speculative")
    source = tiny_gqa_chat_folder(root, tokenizer)
    export_onnx(source, root / "portable", task="text-generation", validate=False)
    export_onnx(source, root / "gqa-int8", task="text-generation", quantize="int8", validate=False)
    return {"portable": root / "portable", "gqa-int8": root / "gqa-int8", "draft": tiny_chat_pair["onnx"]}


def prompt_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer(PROMPT)["input_ids"]])


@pytest.mark.parametrize("form", ["portable", "gqa-int8"])
def test_greedy_speculation_is_plain_greedy_token_for_token(folders, tokenizer, form):
    target = OrtModelForCausalLM.from_pretrained(folders[form])
    draft = OrtModelForCausalLM.from_pretrained(folders["draft"])
    ids = prompt_ids(tokenizer)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    lookup = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=4)
    drafted = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft)
    assert torch.equal(lookup, plain) and torch.equal(drafted, plain)


@pytest.mark.parametrize("form", ["portable", "gqa-int8"])
def test_prompt_lookup_runs_in_the_lean_loop_with_plain_greedy_tokens(folders, tokenizer, form, monkeypatch):
    """One prompt with `prompt_lookup_num_tokens` runs the lean speculative loop (`prompt_lookup_sample`), not
    transformers' assisted generation; both give plain greedy search's tokens."""
    from vaswani.runtime import generation, speculative

    taken = []
    lean_loop = speculative.prompt_lookup_sample
    monkeypatch.setattr(
        generation, "prompt_lookup_sample", lambda *args, **kwargs: taken.append(1) or lean_loop(*args, **kwargs)
    )
    target = OrtModelForCausalLM.from_pretrained(folders[form])
    ids = prompt_ids(tokenizer)
    lean = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=3)
    assert taken, "the lean loop must run prompt lookup on one prompt"
    target.fast_generation = False  # transformers' own loops
    assisted = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=3)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert len(taken) == 1 and torch.equal(lean, plain) and torch.equal(assisted, plain)


def first_tokens(model, ids, seeds, **values) -> Counter:
    """How often each (first, second) answer token pair is drawn over `seeds`."""
    counts = Counter()
    for seed in seeds:
        torch.manual_seed(seed)
        output = model.generate(ids, max_new_tokens=2, do_sample=True, **values)
        counts[tuple(output[0, ids.shape[1] :].tolist())] += 1
    return counts


def total_variation(a: Counter, b: Counter) -> float:
    total_a, total_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[key] / total_a - b[key] / total_b) for key in set(a) | set(b))


def test_sampled_speculation_draws_from_the_plain_distribution(folders, tokenizer):
    """Plain sampling, prompt lookup and the draft model, each over its own seeds: the histograms of the first two
    tokens agree within sampling noise; a sampler at another temperature is told apart at the same size."""
    target = OrtModelForCausalLM.from_pretrained(folders["portable"])
    draft = OrtModelForCausalLM.from_pretrained(folders["draft"])
    ids = prompt_ids(tokenizer)
    values = dict(temperature=1.0, top_k=4)
    plain = first_tokens(target, ids, range(DRAWS), **values)
    again = first_tokens(target, ids, range(DRAWS, 2 * DRAWS), **values)
    lookup = first_tokens(target, ids, range(2 * DRAWS, 3 * DRAWS), prompt_lookup_num_tokens=2, **values)
    drafted = first_tokens(target, ids, range(3 * DRAWS, 4 * DRAWS), assistant_model=draft, **values)
    other = first_tokens(target, ids, range(4 * DRAWS, 5 * DRAWS), temperature=0.1, top_k=4)
    # Two independent samples of DRAWS over k cells differ by about sqrt(k / (2 pi DRAWS)) in total variation (the
    # mean absolute deviation of the cells' binomial frequencies, summed): three times that is the bound.
    cells = len(set(plain) | set(again))
    bound = 3 * math.sqrt(cells / (2 * math.pi * DRAWS))
    assert total_variation(plain, again) < bound, "the bound must hold for two plain samples"
    assert total_variation(plain, lookup) < bound and total_variation(plain, drafted) < bound
    assert total_variation(plain, other) > bound, "a different sampler must land outside the bound"


def later_tokens(model, ids, seeds, **values) -> Counter:
    """How often each second answer token is drawn over `seeds` (the first comes from the prompt's step, before any
    proposal; the second is the first one a proposal can decide)."""
    counts = Counter()
    for seed in seeds:
        torch.manual_seed(seed)
        output = model.generate(ids, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=3, **values)
        counts[int(output[0, ids.shape[1] + 1])] += 1
    return counts


def test_lean_prompt_lookup_sampling_keeps_the_plain_distribution(folders, tokenizer, monkeypatch):
    """The lean loop's rejection rule, with every proposal fixed to plain sampling's most frequent second token (so
    that it keeps some and rejects some): the histogram stays within sampling noise of plain sampling's,
    while keeping every proposal that has any probability lands outside the bound."""
    from vaswani.runtime import speculative

    target = OrtModelForCausalLM.from_pretrained(folders["portable"])
    ids = prompt_ids(tokenizer)
    plain = later_tokens(target, ids, range(DRAWS))
    again = later_tokens(target, ids, range(DRAWS, 2 * DRAWS))
    likely = plain.most_common(1)[0][0]

    def fixed(tokens, count, longest, shortest):
        return [likely] * count

    monkeypatch.setattr(speculative, "propose_ngram", fixed)
    lookup = later_tokens(target, ids, range(2 * DRAWS, 3 * DRAWS), prompt_lookup_num_tokens=2)
    monkeypatch.setattr(speculative, "keeps", lambda probability: probability > 0.0)
    wrong = later_tokens(target, ids, range(3 * DRAWS, 4 * DRAWS), prompt_lookup_num_tokens=2)
    cells = len(set(plain) | set(again))
    bound = 3 * math.sqrt(cells / (2 * math.pi * DRAWS))
    assert total_variation(plain, again) < bound and total_variation(plain, lookup) < bound
    assert total_variation(plain, wrong) > bound, "a wrong rule must land outside the bound"
