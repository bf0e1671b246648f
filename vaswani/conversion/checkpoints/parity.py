"""Whether two models holding the same weights compute the same: the check that every folder conversion passes
before anything is written."""

from typing import NamedTuple

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from ...modeling import cache_keyword
from ...modeling.positions import positions_from_mask

PARITY_TOLERANCE = 1e-4  # fp32


class Parity(NamedTuple):
    """How closely two models holding the same weights agree (`measure_parity`)."""

    max_abs_diff: float  # over every float output both models return
    outputs: tuple[str, ...]  # the outputs compared, e.g. ("logits", "encoder_last_hidden_state")
    greedy_identical: bool | None  # whether greedy generation chose the same tokens; None if not compared
    left_padded: bool = False  # whether the batch had a left-padded row (differences counted at real tokens only)

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= PARITY_TOLERANCE and self.greedy_identical is not False

    def __str__(self) -> str:
        if self.greedy_identical is None:
            greedy = "greedy generation not compared"
        else:
            greedy = "greedy generation " + ("identical" if self.greedy_identical else "DIFFERS")
        batch = " on a left-padded batch" if self.left_padded else ""
        return (
            f"max abs diff {self.max_abs_diff:.3g} over {', '.join(self.outputs)}{batch} (tolerance "
            f"{PARITY_TOLERANCE:g}); {greedy}"
        )


class ParityError(RuntimeError):
    """A converted checkpoint does not reproduce its source's outputs."""


def _first_set(*token_ids: int | None) -> int:
    """The first token id that is set, else 0."""
    return next((token_id for token_id in token_ids if token_id is not None), 0)


def _greedy_tokens(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int
) -> list[list[int]]:
    eos_token_id = model.generation_config.eos_token_id
    if isinstance(eos_token_id, list):
        eos_token_id = eos_token_id[0]
    pad_token_id = _first_set(model.generation_config.pad_token_id, eos_token_id)
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1)
    if model.config.is_encoder_decoder:
        # transformers' T5 sizes a default cache by its encoder depth; a cache without a config grows as needed.
        settings.update(cache_keyword(EncoderDecoderCache(DynamicCache(), DynamicCache())))
    output = model.generate(input_ids, attention_mask=attention_mask, pad_token_id=pad_token_id, **settings)
    return output.tolist()


def _max_abs_diff(actual: torch.Tensor, expected: torch.Tensor, real_tokens: torch.Tensor | None) -> float:
    """Over every element, or, for a (batch, tokens, ...) output of the padded input, over its real tokens only:
    what a model computes at a padding position is discarded, and implementations differ there."""
    difference = (actual.to(expected) - expected).abs()
    if real_tokens is not None and difference.ndim >= 3 and difference.shape[:2] == real_tokens.shape:
        difference = difference[real_tokens]
    return difference.max().item()


@torch.no_grad()
def measure_parity(
    reference: PreTrainedModel,
    converted: PreTrainedModel,
    *,
    batch_size: int = 2,
    length: int = 8,
    seed: int = 0,
    left_padded: bool = False,
    greedy: bool = True,
) -> Parity:
    """Run two models that hold the same weights (a transformers model and its vaswani conversion, either way round)
    on one seeded random batch: the largest absolute difference over the float outputs both return, and whether
    greedy generation (`length` new tokens, no early stop) picks the same tokens.

    With `left_padded`, every row after the first has its first `length // 2` tokens masked out, as a tokenizer pads
    a batch for generation: causal LMs then get the positions that generation gives them (counted from the first
    real token), and outputs are compared at the real tokens only. `greedy=False` skips the generation check
    (`greedy_identical` is then None), which costs `2 * length` forward passes of each model.

    Example:
        >>> parity = measure_parity(llama, from_transformers(llama))  # doctest: +SKIP
        >>> parity.max_abs_diff, parity.greedy_identical  # doctest: +SKIP
        (0.0, True)
        >>> print(measure_parity(llama, from_transformers(llama), left_padded=True, greedy=False))  # doctest: +SKIP
        max abs diff 0 over logits on a left-padded batch (tolerance 0.0001); greedy generation not compared
    """
    generator = torch.Generator().manual_seed(seed)
    config = reference.config
    input_ids = torch.randint(0, config.vocab_size, (batch_size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if left_padded:
        attention_mask[1:, : length // 2] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if left_padded and not config.is_encoder_decoder and reference.can_generate():
        inputs["position_ids"] = positions_from_mask(attention_mask)
    # The encoder's outputs (all outputs of a model without a decoder) have one row per padded input token.
    padded_outputs = "encoder_" if config.is_encoder_decoder else ""
    if config.is_encoder_decoder:
        decoder_ids = torch.randint(0, config.vocab_size, (batch_size, length), generator=generator)
        generation = getattr(reference, "generation_config", None)  # bare encoder-decoders have none
        decoder_ids[:, 0] = _first_set(generation and generation.decoder_start_token_id, config.decoder_start_token_id)
        inputs["decoder_input_ids"] = decoder_ids
    inputs = {name: tensor.to(reference.device) for name, tensor in inputs.items()}
    real_tokens = inputs["attention_mask"].bool() if left_padded else None
    expected, actual = reference(**inputs), converted(**inputs)
    outputs = tuple(
        name
        for name, value in expected.items()
        if torch.is_tensor(value) and value.is_floating_point() and torch.is_tensor(actual.get(name))
    )
    if not outputs:
        raise ValueError(f"{type(reference).__name__} and {type(converted).__name__} return no common float output.")
    max_abs_diff = max(
        _max_abs_diff(actual[name], expected[name], real_tokens if name.startswith(padded_outputs) else None)
        for name in outputs
    )
    greedy_identical = None
    if greedy and reference.can_generate() and converted.can_generate():
        tokens = [
            _greedy_tokens(model, inputs["input_ids"], inputs["attention_mask"], length)
            for model in (reference, converted)
        ]
        greedy_identical = tokens[0] == tokens[1]
    return Parity(max_abs_diff, outputs, greedy_identical, left_padded)
