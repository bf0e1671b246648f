"""The lean generation loop's cheap per-step work against transformers' own: the min-length processors' in-place
replacement gives transformers' scores, the numpy argmax torch's tokens (ties and NaN included), and generation
with `min_new_tokens` / `min_length` stays token-identical to PyTorch in both loops."""

import math

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    TemperatureLogitsWarper,
)

from vaswani.runtime.lean_steps import (
    SuppressTokensUntilLength,
    apply_processors,
    greedy_tokens,
    lean_logits_processors,
)

VOCAB = 50


@pytest.mark.parametrize("eos", [3, [3, 7], [3, VOCAB + 5, -1]], ids=["one", "two", "outside-vocabulary"])
@pytest.mark.parametrize("length", [4, 6, 9])  # shorter than, equal to, longer than the current sequence
def test_min_length_processors_give_transformers_scores(eos, length):
    input_ids = torch.randint(0, VOCAB, (3, 6))
    scores = torch.randn(3, VOCAB)
    scores[1, 5] = math.nan  # NaN elsewhere is kept as it is
    for reference in (
        MinLengthLogitsProcessor(length, eos),
        MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=length - 2, eos_token_id=eos),
    ):
        expected = reference(input_ids, scores.clone())
        lean = lean_logits_processors(LogitsProcessorList([reference]))
        assert isinstance(lean[0], SuppressTokensUntilLength)
        actual = apply_processors(lean, input_ids, scores.clone())
        torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=0)


def test_other_processors_are_kept_and_run_in_order():
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5), MinLengthLogitsProcessor(10, 3)])
    lean = lean_logits_processors(processors)
    assert lean[0] is processors[0]
    input_ids, scores = torch.randint(0, VOCAB, (2, 4)), torch.randn(2, VOCAB)
    torch.testing.assert_close(apply_processors(lean, input_ids, scores.clone()), processors(input_ids, scores))


def test_a_processor_with_extra_arguments_keeps_transformers_list_and_its_error():
    class NeedsCurrentLength:
        def __call__(self, input_ids, scores, cur_len):
            return scores

    processors = LogitsProcessorList([NeedsCurrentLength()])
    assert lean_logits_processors(processors) is processors
    with pytest.raises(ValueError, match="cur_len"):
        apply_processors(processors, torch.zeros(1, 2, dtype=torch.long), torch.randn(1, VOCAB))


def test_greedy_tokens_are_torch_argmax_with_ties_and_nan():
    scores = torch.randn(6, VOCAB)
    scores[1, [4, 9]] = 100.0  # a tie: the first one wins
    scores[2, 7] = math.nan  # NaN is the maximum for both
    scores[3, [8, 2]] = math.nan
    scores[4] = -math.inf
    for case in (scores, scores[:, ::2], scores.double()):  # strided and float64 too
        expected = torch.argmax(case, dim=-1)
        actual = greedy_tokens(case)
        assert actual.dtype == expected.dtype
        assert torch.equal(actual, expected)
    half = scores.half()
    assert torch.equal(greedy_tokens(half), torch.argmax(half, dim=-1))
