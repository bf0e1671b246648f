"""The GroupQueryAttention decoder form's kernel driver (`export/gqa_rewrite.py` writes the form): `GqaDecoder` drives
such a graph through IO binding, one in-place KV buffer per cache tensor bound as both past and present; `step_hf`
takes and returns transformers' layout (for `OrtModelForCausalLM.forward` and validation), `start`/`decode` and
`plain_greedy` are what the held-cache lean loop (`held_cache.held_cache_sample`) drives. The runtime built on it
(its serving batch included) is `decoders/gqa.py`. The graph's I/O and how padding becomes lengths: docs/deployment.md.

    >>> decoder = GqaDecoder(session, manifest, rotary_positions=config.max_position_embeddings)
    >>> logits, present = decoder.step_hf(input_ids, attention_mask, past, logits_positions)
"""

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import torch

from .contract import is_gqa_form
from .held_cache import NotLeftPaddedError, StandardStops, positions_follow_mask, refuse_capacity_past, refuse_step_past

__all__ = ["GqaDecoder", "GqaState", "GqaValidationRunner", "is_gqa_form"]


class GqaDecoder:
    """Drives a GroupQueryAttention-form decoder graph on the CPU through IO binding: the KV buffers are bound as
    both past and present (the kernel appends in place, no copy of the past), logits into a buffer reused per step.

    `step_hf` takes and returns transformers' layout (a padded mask, caches aligned with it) for `forward` and
    validation; `start`/`decode`/`plain_greedy` are the lean loop's (`held_cache.held_cache_sample`).
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

    def plain_greedy(self, state: "GqaState", *args) -> torch.Tensor:
        """Plain greedy search's loop on numpy views of the bound buffers (`_greedy_numpy`)."""
        return _greedy_numpy(self, state, *args)


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}


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


def _greedy_numpy(
    decoder: GqaDecoder,
    state: GqaState,
    next_logits: torch.Tensor,
    ids: torch.Tensor,
    length: int,
    stops: StandardStops,
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
