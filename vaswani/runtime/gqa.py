"""The runtime of the GroupQueryAttention decoder form (`ort_llm.py` writes it): `GqaDecoder` drives such a graph
through IO binding, one in-place KV buffer per cache tensor bound as both past and present; `step_hf` takes and
returns transformers' layout (for `OrtModelForCausalLM.forward` and validation), `held_cache_sample` is the lean
greedy/sampling loop. The graph's I/O and how padding becomes lengths: `ort_llm.py` and docs/deployment.md.

    >>> decoder = GqaDecoder(session, manifest, rotary_positions=config.max_position_embeddings)
    >>> logits, present = decoder.step_hf(input_ids, attention_mask, past, logits_positions)
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort
import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .contract import FORM_GQA
from .lean_steps import (
    SuppressTokensUntilLength,
    apply_processors,
    draw_tokens,
    lean_logits_processors,
    pad_token_tensor,
)

if TYPE_CHECKING:
    from .openvino import OpenVinoDecoder


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


def is_gqa_form(manifest: dict) -> bool:
    """Whether an export's decoder graph is the GroupQueryAttention form."""
    return manifest.get("attention_form") == FORM_GQA


class GqaDecoder:
    """Drives a GroupQueryAttention-form decoder graph on the CPU through IO binding: the KV buffers are bound as
    both past and present (the kernel appends in place, no copy of the past), logits into a buffer reused per step.

    `step_hf` takes and returns transformers' layout (a padded mask, caches aligned with it) for `forward` and
    validation; `start`/`decode` are the lean loop's (`held_cache_sample`).
    """

    def __init__(self, session: ort.InferenceSession, manifest: dict, rotary_positions: int):
        self.session = session
        layers = manifest["num_layers"]
        self.kv_heads, self.head_dim = manifest["num_key_value_heads"], manifest["head_dim"]
        self.vocab = manifest["vocab_size"]
        self.max_positions = rotary_positions
        self.past_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        self.present_names = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]

    # -- binding helpers

    @staticmethod
    def _bind_input(binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        binding.bind_input(name, "cpu", 0, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())

    @staticmethod
    def _bind_output(binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        binding.bind_output(name, "cpu", 0, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())

    def bind(self, feeds: dict[str, torch.Tensor], buffers: list[torch.Tensor], logits: torch.Tensor) -> ort.IOBinding:
        """A binding of `feeds`, each KV buffer as both past and present (the kernel appends in place), and `logits`.
        The tensors must outlive the binding's runs."""
        binding = self.session.io_binding()
        for name, tensor in feeds.items():
            self._bind_input(binding, name, tensor)
        for past, present, buffer in zip(self.past_names, self.present_names, buffers):
            self._bind_input(binding, past, buffer)
            self._bind_output(binding, present, buffer)
        self._bind_output(binding, "logits", logits)
        return binding

    def check_capacity(self, length: int) -> None:
        """Refuse a step past the rotary table's positions (the kernel would read past its end)."""
        refuse_step_past(length, self.max_positions)

    def new_buffers(self, batch: int, capacity: int) -> list[torch.Tensor]:
        refuse_capacity_past(capacity, self.max_positions)
        return [torch.zeros(batch, self.kv_heads, capacity, self.head_dim) for _ in self.past_names]

    def run(
        self,
        input_ids: torch.Tensor,
        query_lengths: torch.Tensor,
        total_lengths: torch.Tensor,
        buffers: list[torch.Tensor],
        logits_positions: torch.Tensor,
    ) -> torch.Tensor:
        """One call: `input_ids` (batch, chunk) right-padded with `query_lengths` real tokens per row, rows holding
        `total_lengths` tokens afterwards; the new keys/values land in `buffers`. Returns (batch, positions, vocab)."""
        int32 = torch.int32
        feeds = {
            "input_ids": input_ids.to(torch.int64).contiguous(),
            "seqlens_k": (total_lengths - 1).to(int32),
            "total_sequence_length": total_lengths.max().to(int32).reshape(()),
            "query_seqlens": query_lengths.to(int32),
            "logits_positions": logits_positions.to(torch.int64).contiguous(),
        }
        logits = torch.empty(input_ids.shape[0], logits_positions.shape[0], self.vocab)
        self.session.run_with_iobinding(self.bind(feeds, buffers, logits))
        return logits

    # -- transformers' layout

    def step_hf(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: list[torch.Tensor] | None,
        logits_positions: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One forward call in transformers' layout: `attention_mask` (batch, past + new), `past` caches aligned with
        its first columns (None or empty: no past), logits at `logits_positions` of the new tokens. Returns the logits
        (batch, positions, vocab; zero where the requested token is padding) and the present caches (batch, kv_heads,
        past + new, head_dim; zero at padding). Each row's attended tokens are compacted to the front of a buffer,
        run, and laid back out along the mask."""
        batch, new = input_ids.shape
        mask = attention_mask.to(torch.bool)
        past_length = mask.shape[1] - new
        past_mask, new_mask = mask[:, :past_length], mask[:, past_length:].clone()
        # A row with no token at all still needs one for the kernel (its outputs are unspecified, as in PyTorch).
        empty = ~(past_mask.any(1) | new_mask.any(1))
        new_mask[empty, -1] = True
        past_counts, query_counts = past_mask.sum(1), new_mask.sum(1)
        chunk = max(int(query_counts.max()), 1)
        capacity = int((past_counts + chunk).max())
        buffers = self.new_buffers(batch, capacity)
        if past_length and past is not None:
            source = _front_indices(past_mask, capacity)
            keep = (torch.arange(capacity)[None] < past_counts[:, None])[:, None, :, None]
            gather = source[:, None, :, None].expand(batch, self.kv_heads, capacity, self.head_dim)
            for buffer, tensor in zip(buffers, past):
                buffer.copy_(torch.gather(tensor.float(), 2, gather) * keep)
        ids = torch.gather(input_ids, 1, _front_indices(new_mask, chunk)) * (
            torch.arange(chunk)[None] < query_counts[:, None]
        )
        # Each requested column's rank among its row's real new tokens (-1: padding).
        rank = torch.where(new_mask, new_mask.cumsum(1) - 1, -1)[:, logits_positions]
        wanted = torch.unique(rank[rank >= 0]) if (rank >= 0).any() else torch.zeros(1, dtype=torch.long)
        logits = self.run(ids, query_counts, past_counts + query_counts, buffers, wanted)
        lookup = torch.searchsorted(wanted, rank.clamp(min=0))
        out = torch.gather(logits, 1, lookup[..., None].expand(-1, -1, self.vocab)) * (rank >= 0)[..., None]
        full = torch.cat([past_mask, new_mask], 1)
        position = (
            (full.cumsum(1) - 1)
            .clamp(min=0)[:, None, :, None]
            .expand(batch, self.kv_heads, full.shape[1], self.head_dim)
        )
        on = full[:, None, :, None]
        present = [torch.gather(buffer, 2, position) * on for buffer in buffers]
        return out, present

    def forward_hf(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        past: list[torch.Tensor],
        logits_positions: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`step_hf` for `OrtModelForCausalLM.forward` (`past` may be empty): positions are the mask's (`cumsum - 1`,
        as generate passes them); other position ids are refused rather than ignored."""
        if not positions_follow_mask(position_ids, attention_mask, input_ids.shape):
            raise ValueError(
                "This export (GroupQueryAttention form) takes positions from attention_mask (each token's count "
                "of attended tokens before it); pass no position_ids, or export with --attention portable."
            )
        return self.step_hf(input_ids, attention_mask, past if past[0].shape[2] else None, logits_positions)

    # -- the lean loop

    def start(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, capacity: int
    ) -> tuple[torch.Tensor, "GqaState"]:
        """Prefill a (left- or otherwise padded) prompt into buffers of `capacity` tokens per row; the last real
        token's logits of each row (batch, vocab) and the state the decode steps continue from."""
        batch, length = input_ids.shape
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if not bool(mask[:, -1].all()):
            raise NotLeftPaddedError
        counts = mask.sum(1)
        ids = torch.gather(input_ids, 1, _front_indices(mask, length)) * (torch.arange(length)[None] < counts[:, None])
        buffers = self.new_buffers(batch, capacity)
        last = counts - 1
        wanted = torch.unique(last)
        logits = self.run(ids, counts, counts, buffers, wanted)
        rows = logits[torch.arange(batch), torch.searchsorted(wanted, last)]
        return rows, GqaState.bind(self, buffers, counts)

    def decode(self, state: "GqaState", tokens: torch.Tensor) -> torch.Tensor:
        """One token per row (batch,) appended in place; the (batch, vocab) logits (a buffer reused every step)."""
        state.step(tokens)
        self.session.run_with_iobinding(state.binding)
        return state.logits[:, 0]


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}


def positions_follow_mask(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, shape) -> bool:
    """Whether `position_ids` (None, or those of the last `shape[1]` tokens) are each real token's count of attended
    tokens before it, which is what the GroupQueryAttention form rotates by (generate passes exactly those)."""
    if position_ids is None:
        return True
    batch, length = shape
    mask = torch.ones(batch, length, dtype=torch.long) if attention_mask is None else torch.as_tensor(attention_mask)
    expected = (mask.cumsum(-1) - 1)[:, -length:]
    real = mask[:, -length:].bool()
    return torch.equal(torch.as_tensor(position_ids).expand(batch, -1)[real], expected[real])


class NotLeftPaddedError(Exception):
    """The prompt's last column holds padding: the lean loop decodes it through `forward` instead."""


def _front_indices(mask: torch.Tensor, width: int) -> torch.Tensor:
    """(batch, width) column indices that bring each row's True columns to its front, in order (the rest repeat
    column 0; callers zero them)."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    if order.shape[1] < width:
        order = torch.cat([order, order.new_zeros(order.shape[0], width - order.shape[1])], 1)
    return order[:, :width]


@dataclass
class GqaState:
    """A decode step's bound inputs and outputs, updated in place: the binding is made once per generate call."""

    binding: ort.IOBinding
    tokens: torch.Tensor  # (batch, 1) int64
    seqlens: torch.Tensor  # (batch,) int32: tokens held minus one
    total: torch.Tensor  # () int32
    logits: torch.Tensor  # (batch, 1, vocab)
    keep: list  # the bound tensors' owners

    @classmethod
    def bind(cls, decoder: GqaDecoder, buffers: list[torch.Tensor], counts: torch.Tensor) -> "GqaState":
        batch = counts.shape[0]
        tokens = torch.zeros(batch, 1, dtype=torch.int64)
        seqlens = (counts - 1).to(torch.int32)
        total = counts.max().to(torch.int32).reshape(()).clone()  # each step adds one before it runs
        ones = torch.ones(batch, dtype=torch.int32)
        positions = torch.zeros(1, dtype=torch.int64)
        logits = torch.empty(batch, 1, decoder.vocab)
        feeds = {
            "input_ids": tokens,
            "seqlens_k": seqlens,
            "total_sequence_length": total,
            "query_seqlens": ones,
            "logits_positions": positions,
        }
        binding = decoder.bind(feeds, buffers, logits)
        return cls(binding, tokens, seqlens, total, logits, [buffers, ones, positions])

    def step(self, tokens: torch.Tensor) -> None:
        self.tokens[:, 0] = tokens
        self.seqlens += 1
        self.total += 1


def held_cache_sample(
    decoder: "GqaDecoder | OpenVinoDecoder",
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    logits_processor,
    stopping_criteria,
    generation_config,
) -> torch.Tensor | None:
    """The lean greedy/sampling loop (`OrtModelForGeneration.lean_sample`) on a decoder that holds its cache for the
    whole call: a GroupQueryAttention-form graph (one preallocated buffer per cache tensor) or OpenVINO's stateful
    graph (`openvino_engine.OpenVinoDecoder`). The same processors, stopping criteria and random draws, and per step
    only the token and the run; on the GroupQueryAttention form, plain greedy search (no processor, the standard
    criteria) runs that on numpy views of the bound buffers (`_greedy_numpy`). Returns None when the prompt is not
    left-padded (its last column is padding) or `position_ids` are not the mask's: the caller then runs it through
    `forward`."""
    batch, length = input_ids.shape
    if not positions_follow_mask(position_ids, attention_mask, input_ids.shape):
        return None  # other positions than the mask's: `forward` says why it cannot run them
    capacity = max(generation_config.max_length, length + 1)
    try:
        limit = decoder.max_positions  # None where the config names no context length (OpenVinoDecoder)
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
    bound = isinstance(decoder, GqaDecoder)
    if bound and plain_greedy and stops is not None and (pad_token_id is not None or not has_eos_stopping_criteria):
        pad = None if pad_token_id is None else int(pad_token_id)
        suppressed = [
            (processor.columns_in(next_logits.shape[-1]).numpy(), processor.length) for processor in processors
        ]
        return _greedy_numpy(
            decoder, state, next_logits, ids, length, stops, pad if has_eos_stopping_criteria else None, suppressed
        )
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


def _greedy_numpy(
    decoder: GqaDecoder,
    state: GqaState,
    next_logits: torch.Tensor,
    ids: torch.Tensor,
    length: int,
    stops: "StandardStops",
    pad: int | None,
    suppressed: list[tuple[np.ndarray, int]] = (),
) -> torch.Tensor:
    """`held_cache_sample`'s loop for plain greedy search (the standard stopping criteria) on numpy views of the bound
    buffers: the same tokens and stops (numpy's argmax takes the first highest score, as torch's does), at a few
    microseconds per operation instead of torch's dispatch (0.1 ms of a step at batch 1).
    `pad`: the token finished rows get (None: no end-of-sequence criterion, no row finishes early).
    `suppressed`: (token ids, length) of each `SuppressTokensUntilLength`: those columns get -inf while the
    sequences are shorter than the length (the scores are the step's own output buffer, rewritten by every run)."""
    rows = next_logits.numpy()
    logits = state.logits.numpy()[:, 0]  # the step's output buffer, a view
    tokens, seqlens, total = state.tokens.numpy(), state.seqlens.numpy(), state.total.numpy()
    sequences = ids.numpy()
    eos = None if stops.eos_token_id is None else stops.eos_token_id.numpy().reshape(-1)
    unfinished = np.ones(ids.shape[0], dtype=bool)
    run, binding = decoder.session.run_with_iobinding, state.binding
    while True:
        for columns, until in suppressed:
            if length < until:
                rows[:, columns] = -np.inf
        next_tokens = rows.argmax(-1)
        if pad is not None:
            next_tokens = np.where(unfinished, next_tokens, pad)
        sequences[:, length] = next_tokens
        length += 1
        if stops.max_length is not None and length >= stops.max_length:
            break
        if eos is not None:
            unfinished &= ~(next_tokens[:, None] == eos).any(1)  # np.isin costs 20 us a call
            if not unfinished.any():
                break
        decoder.check_capacity(length)
        tokens[:, 0] = next_tokens
        seqlens += 1
        total += 1
        run(binding)
        rows = logits
    return ids[:, :length].clone()


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


class GqaValidationRunner:
    """`validation._GraphRunner`'s interface over a GroupQueryAttention-form graph: fed and read in the portable
    graph's layout (mask, positions, caches aligned with the mask), so that validation compares it with PyTorch as it
    compares the portable graph. Positions are the mask's (`cumsum - 1`), which is what validation feeds."""

    def __init__(self, runner, manifest: dict, rotary_positions: int):
        self.runner, self.name, self.inputs = runner, runner.name, runner.inputs
        self.decoder = GqaDecoder(runner.session, manifest, rotary_positions)
        outputs = []
        for spec in runner.graph["outputs"]:
            shape = list(spec["shape"])
            if spec["name"].startswith("present."):
                shape[2] = "past_sequence + sequence"
            outputs.append({**spec, "shape": shape})
        self.graph = {**runner.graph, "outputs": outputs}

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        return self.runner.empty_past(batch)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        past = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in self.decoder.past_names]
        logits, present = self.decoder.step_hf(
            torch.from_numpy(feeds["input_ids"]),
            torch.from_numpy(feeds["attention_mask"]),
            past,
            torch.from_numpy(np.asarray(feeds["logits_positions"])),
        )
        return {"logits": logits.numpy(), **{name: t.numpy() for name, t in zip(self.decoder.present_names, present)}}

    def compare(self, *args, **kwargs) -> None:
        type(self.runner).compare(self, *args, **kwargs)
