"""The lean greedy/sampling loop over a decoder that holds its cache for a whole `generate` call (`held_cache_sample`),
shared by the GroupQueryAttention form (`gqa.GqaDecoder`: one preallocated buffer per cache tensor) and OpenVINO's
stateful graph (`openvino.OpenVinoDecoder`: the cache inside an infer request), with the checks both make.

A held-cache decoder is a duck type (`HeldCacheDecoder`): `start` prefills a left-padded prompt, `decode` appends one
token per row, `check_capacity` refuses a step past the rotary table, and `plain_greedy` is its own loop for plain
greedy search (None where it has none). Neither runtime imports the other; both import this module.

    >>> tokens = held_cache_sample(decoder, input_ids, mask, None, processors, criteria, generation_config)
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .lean_steps import (
    SuppressTokensUntilLength,
    apply_processors,
    draw_tokens,
    lean_logits_processors,
    pad_token_tensor,
)


class NotLeftPaddedError(Exception):
    """The prompt's last column holds padding: the lean loop decodes it through `forward` instead."""


def refuse_step_past(length: int, max_positions: int | None) -> None:
    """A ValueError for a decode step at `length` tokens past the rotary table's `max_positions` (None: no limit)."""
    if max_positions is not None and length >= max_positions:
        raise ValueError(
            f"Generation reached the {max_positions} positions of this export's rotary table "
            f"(max_position_embeddings); ask for fewer tokens."
        )


def refuse_capacity_past(capacity: int | None, max_positions: int | None) -> None:
    """A ValueError for a generation of `capacity` tokens (prompt + new) past the rotary table's `max_positions`."""
    if None not in (capacity, max_positions) and capacity > max_positions:
        raise ValueError(
            f"{capacity} tokens (prompt + new) exceed the {max_positions} positions of this export's rotary "
            f"table (max_position_embeddings); generate fewer tokens."
        )


def positions_follow_mask(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, shape) -> bool:
    """Whether `position_ids` (None, or those of the last `shape[1]` tokens) are each real token's count of attended
    tokens before it, which is what the held-cache decoders rotate by (generate passes exactly those)."""
    if position_ids is None:
        return True
    batch, length = shape
    mask = torch.ones(batch, length, dtype=torch.long) if attention_mask is None else torch.as_tensor(attention_mask)
    expected = (mask.cumsum(-1) - 1)[:, -length:]
    real = mask[:, -length:].bool()
    return torch.equal(torch.as_tensor(position_ids).expand(batch, -1)[real], expected[real])


class HeldCacheDecoder(Protocol):
    """What `held_cache_sample` drives: a decoder holding one generate call's cache in a state of its own."""

    max_positions: int | None  # the rotary table's positions; None where the config names no context length
    # Plain greedy search's own loop (state, first logits, ids, length, stops, pad, suppressed) -> ids; or None.
    plain_greedy: Callable[..., torch.Tensor] | None

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, capacity: int) -> tuple[Any, Any]:
        """Prefill a left-padded prompt: each row's last token's logits (batch, vocab) and the decode steps' state;
        raises `NotLeftPaddedError` where the last column holds padding."""

    def decode(self, state: Any, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row (batch,): the (batch, vocab) logits of the next."""

    def check_capacity(self, length: int) -> None:
        """Refuse a step at `length` tokens past the rotary table."""


def held_cache_sample(
    decoder: HeldCacheDecoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    logits_processor,
    stopping_criteria,
    generation_config,
) -> torch.Tensor | None:
    """The lean greedy/sampling loop (`OrtModelForGeneration.lean_sample`) on a decoder that holds its cache for the
    whole call. The same processors, stopping criteria and random draws, and per step only the token and the run;
    plain greedy search (no processor but those holding end-of-sequence back, the standard criteria) runs the
    decoder's own `plain_greedy` loop where it has one. Returns None when the prompt is not left-padded (its last
    column is padding) or `position_ids` are not the mask's: the caller then runs it through `forward`."""
    batch, length = input_ids.shape
    if not positions_follow_mask(position_ids, attention_mask, input_ids.shape):
        return None  # other positions than the mask's: `forward` says why it cannot run them
    capacity = max(generation_config.max_length, length + 1)
    try:
        limit = decoder.max_positions
        next_logits, state = decoder.start(
            input_ids, attention_mask, capacity if limit is None else min(capacity, limit)
        )
    except NotLeftPaddedError:
        return None
    # The sequences so far, in one preallocated tensor: each step writes a column and the processors and criteria
    # see a view (no concatenation per token).
    ids = torch.empty(batch, capacity, dtype=input_ids.dtype)
    ids[:, :length] = input_ids
    pad_token_id = pad_token_tensor(generation_config, input_ids.device)
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    stops = StandardStops.of(stopping_criteria)
    unfinished = torch.ones(batch, dtype=torch.long)
    processors = lean_logits_processors(logits_processor)
    # Greedy search whose only processors hold end-of-sequence back (min_new_tokens, min_length) runs on numpy too.
    plain_greedy = (
        not generation_config.do_sample
        and isinstance(processors, list)
        and all(isinstance(processor, SuppressTokensUntilLength) for processor in processors)
    )
    fits = stops is not None and (pad_token_id is not None or not has_eos_stopping_criteria)
    if decoder.plain_greedy is not None and plain_greedy and fits:
        pad = None if pad_token_id is None else int(pad_token_id)
        suppressed = [
            (processor.columns_in(next_logits.shape[-1]).numpy(), processor.length) for processor in processors
        ]
        pad = pad if has_eos_stopping_criteria else None
        return decoder.plain_greedy(state, next_logits, ids, length, stops, pad, suppressed)
    while True:
        scores = apply_processors(processors, ids[:, :length], next_logits)
        next_tokens = draw_tokens(scores, generation_config.do_sample)
        if has_eos_stopping_criteria:
            next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
        ids[:, length] = next_tokens
        length += 1
        if stops is not None:
            unfinished &= ~stops(ids[:, :length])
        else:
            unfinished = unfinished & ~stopping_criteria(ids[:, :length], None)
        if not unfinished.any():
            return ids[:, :length].clone()
        decoder.check_capacity(length)
        next_logits = decoder.decode(state, next_tokens)


@dataclass
class StandardStops:
    """transformers' `MaxLengthCriteria` and `EosTokenCriteria` (what generate builds from `max_length` and the
    end-of-sequence ids) evaluated in one step: the same decisions, without the list's per-criterion dispatch and
    full-batch tensors (0.1 ms a token)."""

    max_length: int | None
    eos_token_id: torch.Tensor | None

    @classmethod
    def of(cls, criteria) -> "StandardStops | None":
        """The two standard criteria of `criteria`, or None if it holds any other kind."""
        max_length = eos = None
        for criterion in criteria:
            if type(criterion) is MaxLengthCriteria:
                max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
            elif type(criterion) is EosTokenCriteria and eos is None:
                eos = criterion.eos_token_id
            else:
                return None
        return cls(max_length, eos)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.max_length is not None and input_ids.shape[1] >= self.max_length:
            return torch.ones(input_ids.shape[0], dtype=torch.bool)
        if self.eos_token_id is None:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        return torch.isin(input_ids[:, -1], self.eos_token_id)
