"""The GroupQueryAttention runtime: ONNX Runtime on the decoder form that quantized and optimized exports take
(`com.microsoft.GroupQueryAttention`, CPU only), driven by `gqa.GqaDecoder`; and the server's batch kind for it.

**Per-row lengths** (`GqaBatch`, `GqaPrefill`): each row holds its tokens at the front of its slot of one in-place KV
buffer per cache tensor, (slots, kv_heads, capacity, head_dim), and the graph reads each row's length (`seqlens_k`)
instead of a mask. A decoding step appends one token per row in place (no copy of the cache) through an IO binding
kept while the rows and the capacity stay the same; the capacity doubles when the longest row needs it. A joining
prompt is copied once into a free slot; a leaving row's slot takes the last row's cache. The graph derives each
token's position from the lengths, which is offline `generate`'s rule (`contract.positions_from_mask`).

    >>> step = OrtModelForCausalLM.from_pretrained("int8-export").decoder_runtime.step_model()   # a GqaStepModel
"""

from typing import Any

import numpy as np
import torch

from ..contract import is_gqa_form
from ..gqa import GqaDecoder
from ..held_cache import held_cache_sample
from ..session import checked_mask, logits_positions
from .portable import context_length
from .verification import rollback_lengths, verify_lengths


class GqaRuntime:
    """ONNX Runtime on the GroupQueryAttention form, on the CPU: `forward` compacts each row's tokens to the front of
    fresh buffers (`GqaDecoder.forward_hf`), `generate` runs the held-cache loop on one buffer per cache tensor
    (`sample`), the server keeps per-row lengths (`GqaBatch`). The graph takes no cache tensors in and out, so the
    left-padded lean step and batch do not apply."""

    name = "gqa"
    engine = "onnxruntime"
    takes_cache_tensors = False

    @classmethod
    def refusal(cls, request) -> str | None:
        if not is_gqa_form(request.manifest):
            return f"{request.folder} holds the portable form of the decoder, not the GroupQueryAttention one."
        if request.provider != "CPUExecutionProvider":
            return (
                f"{request.folder} holds the GroupQueryAttention form of the decoder (what --quantize and --optimize "
                f"write), which runs on the CPU only; run it on the CPU, or export for {request.provider} with "
                "--attention portable."
            )
        return None

    @classmethod
    def load(cls, model: Any, request) -> "GqaRuntime":
        return cls(model)

    def __init__(self, model: Any):
        self.model = model  # an OrtModelForCausalLM
        graph = model.graphs[model.decoding_graph]
        self.decoder = GqaDecoder(graph.session, model.manifest, model.config.max_position_embeddings)

    @property
    def provider(self) -> str:
        return self.decoder.session.get_providers()[0]

    @property
    def description(self) -> str:
        return "every step in ONNX Runtime's GroupQueryAttention, the cache in in-place buffers"

    def forward(self, input_ids, attention_mask, position_ids, past, logits_to_keep, cache):
        total = past[0].shape[2] + input_ids.shape[1]
        mask = torch.as_tensor(checked_mask(attention_mask, input_ids.shape[0], total, self.model.device))
        positions = logits_positions(logits_to_keep, input_ids.shape[1])
        return self.decoder.forward_hf(input_ids, mask, position_ids, past, positions)

    def run(self, inputs, past, buffers):
        raise ValueError("The GroupQueryAttention form takes no cache tensors in and out; run it through forward.")

    run_arrays = run

    def sample(self, input_ids, attention_mask, position_ids, logits_processor, stopping_criteria, generation_config):
        loop = (logits_processor, stopping_criteria, generation_config)
        return held_cache_sample(self.decoder, input_ids, attention_mask, position_ids, *loop)

    def step_model(self) -> "GqaStepModel":
        return GqaStepModel(self.model, self.decoder)


class GqaStepModel:
    """The step model of a GroupQueryAttention-form export (quantized and optimized exports on the CPU): its batches
    keep per-row lengths in in-place KV buffers (`GqaBatch`)."""

    def __init__(self, model: Any, decoder: GqaDecoder):
        self.model = model  # an OrtModelForCausalLM
        self.decoder = decoder
        self.vocab_size = model.manifest["vocab_size"]
        self.context_length = min(context_length(model.config), self.decoder.max_positions)

    @property
    def description(self) -> str:
        return self.model.decoder_runtime.description

    def new_batch(self) -> "GqaBatch":
        return GqaBatch(self.decoder)

    def prefill_group(
        self, rows: list[Any], prompts: list[list[int]], prefixes: list[list[np.ndarray] | None] | None = None
    ) -> "GqaPrefill":
        return GqaPrefill(self.decoder, rows, prompts, prefixes)


def kv_buffers(decoder: GqaDecoder, slots: int, capacity: int) -> list[torch.Tensor]:
    """One (slots, kv_heads, capacity, head_dim) buffer per cache tensor, uninitialized: the kernel reads each row's
    first `seqlens_k + 1` columns only, all of which it or a copy wrote."""
    shape = (slots, decoder.kv_heads, capacity, decoder.head_dim)
    return [torch.empty(shape) for _ in decoder.past_names]


class GqaPrefill:
    """Prompts prefilled together into buffers of their own, each at the front of its row (right-padded), fed in
    chunks of columns. The rows are held longest rest first, so that the rows a chunk still feeds are always the
    first ones: a contiguous view of the buffers, and no row is ever fed zero tokens.

    A prompt whose first tokens' cache is given (`prefixes[i]`: (kv_heads, cached, head_dim) per cache tensor, from
    the server's prefix cache) has it copied to the front of its row and feeds only the rest (its "rest"): the kernel
    takes each row's own count of cached tokens.
    """

    def __init__(
        self,
        decoder: GqaDecoder,
        rows: list[Any],
        prompts: list[list[int]],
        prefixes: list[list[np.ndarray] | None] | None = None,
    ):
        prefixes = prefixes or [None] * len(prompts)
        cached = [0 if prefix is None else prefix[0].shape[1] for prefix in prefixes]
        order = sorted(range(len(prompts)), key=lambda i: -(len(prompts[i]) - cached[i]))
        self.decoder = decoder
        self.rows = [rows[i] for i in order]
        self.lengths = np.array([len(prompts[i]) for i in order], dtype=np.int64)
        self.cached = np.array([cached[i] for i in order], dtype=np.int64)
        rests = self.lengths - self.cached
        self.ids = torch.zeros(len(order), int(rests[0]), dtype=torch.int64)
        for row, i in enumerate(order):
            self.ids[row, : rests[row]] = torch.tensor(prompts[i][cached[i] :])
        # The kernel wants room for each row's cached tokens and a whole chunk's width after them, padding included.
        self.buffers = kv_buffers(decoder, len(order), int(self.cached.max()) + self.columns)
        for row, i in enumerate(order):
            if prefixes[i] is not None:
                for buffer, array in zip(self.buffers, prefixes[i]):
                    buffer[row, :, : cached[i]] = torch.as_tensor(array)
        self.logits = np.zeros((len(order), decoder.vocab), dtype=np.float32)
        self.filled = 0  # columns of the rests fed

    @property
    def columns(self) -> int:
        return self.ids.shape[1]

    @property
    def tokens(self) -> int:
        return self.ids.numel()

    @property
    def computed(self) -> int:
        return len(self.rows) * self.filled

    @property
    def done(self) -> bool:
        return self.filled == self.columns

    def run(self, columns: int) -> np.ndarray:
        """Feed the next `columns` columns of the rows whose rests reach them; keep the logits of each prompt whose
        last token is among them. Returns every row's logits so far (rows, vocab)."""
        start, end = self.filled, min(self.filled + columns, self.columns)
        rests = torch.from_numpy(self.lengths - self.cached)
        active = int((rests > start).sum())  # a prefix: longest rest first
        rests = rests[:active]
        query = rests.clamp(max=end) - start
        last = rests - 1 - start  # each row's last prompt token, as a column of this chunk
        finishing = torch.nonzero(last < end - start).flatten()
        wanted = torch.unique(last[finishing]) if finishing.numel() else torch.zeros(1, dtype=torch.long)
        buffers = [buffer[:active] for buffer in self.buffers]
        total = torch.from_numpy(self.cached[:active]) + start + query
        logits = self.decoder.run(self.ids[:active, start:end], query, total, buffers, wanted)
        for row in finishing.tolist():
            self.logits[row] = logits[row, int(torch.searchsorted(wanted, last[row]))].numpy()
        self.filled = end
        return self.logits

    def row_cache(self, row: int, start: int, stop: int) -> list[np.ndarray]:
        """A copy of the cache of row `row`'s tokens [start, stop), (kv_heads, stop - start, head_dim) per tensor."""
        return [buffer[row, :, start:stop].numpy().copy() for buffer in self.buffers]


class GqaBatch:
    """The running sequences of a GroupQueryAttention-form export: row i's `lengths[i]` tokens at the front of slot i
    of each KV buffer (slots, kv_heads, capacity, head_dim); rows 0..n-1 are the running ones, a contiguous view.

    A step binds that view as both past and present (the kernel appends in place) with `seqlens_k` = the lengths;
    the binding is kept while the rows and the buffers stay the same, so that a step only writes the tokens and the
    lengths and runs. The buffers grow by doubling (capacity up to the rotary table's positions) and are let go when
    the batch empties, so memory follows the longest running sequence rather than the context length.
    """

    def __init__(self, decoder: GqaDecoder):
        self.decoder = decoder
        self.rows: list[Any] = []
        self.lengths = np.zeros(0, dtype=np.int64)  # tokens held per row
        self.buffers: list[torch.Tensor] = []
        self.binding: Any = None  # the IO binding of the current rows and buffers, None when they changed

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def slots(self) -> int:
        return self.buffers[0].shape[0] if self.buffers else 0

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2] if self.buffers else 0

    def reserve(self, slots: int, length: int) -> None:
        """Make room for `slots` rows of `length` tokens: reallocate to the next powers of two (the capacity at most
        the rotary table's positions) and copy the running rows over, if the buffers are smaller."""
        if slots <= self.slots and length <= self.capacity:
            return
        self.decoder.check_capacity(length - 1)
        capacity = min(grown(self.capacity, length, least=16), self.decoder.max_positions)
        buffers = kv_buffers(self.decoder, grown(self.slots, slots, least=1), capacity)
        rows, used = len(self.rows), int(self.lengths.max(initial=0))
        if rows:
            for new, old in zip(buffers, self.buffers):
                new[:rows, :, :used] = old[:rows, :, :used]
        self.buffers, self.binding = buffers, None

    def join(self, group: GqaPrefill, keep: list[int]) -> None:
        """Copy the rows `keep` of a prefilled group into the slots after the running rows (one copy of their
        caches)."""
        if not keep:
            return
        start, count = len(self.rows), len(keep)
        lengths = group.lengths[keep]
        longest = int(lengths.max())
        self.reserve(start + count, max(longest, int(self.lengths.max(initial=0))) + 1)
        contiguous = keep == list(range(count))
        index = torch.tensor(keep)
        for buffer, source in zip(self.buffers, group.buffers):
            part = source[:count, :, :longest] if contiguous else source.index_select(0, index)[:, :, :longest]
            buffer[start : start + count, :, :longest] = part
        self.rows = self.rows + [group.rows[i] for i in keep]
        self.lengths = np.concatenate([self.lengths, lengths])
        self.binding = None

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per row (`tokens`, (batch,)); returns the logits (batch, vocab), a view of the output
        buffer that the next step overwrites."""
        longest = int(self.lengths.max()) + 1
        self.reserve(len(self.rows), longest)
        if self.binding is None:
            self.bind()
        self.tokens[:, 0] = tokens
        self.seqlens[:] = self.lengths  # tokens after the step, minus one
        self.total[...] = longest
        self.decoder.session.run_with_iobinding(self.binding)
        self.lengths += 1
        return self.logits

    def verify(self, fed: list[list[int]]) -> np.ndarray:
        """Feed each row its tokens `fed[i]` (its last token and proposals) in one call; the logits of every fed
        position (rows, longest, vocab). Speculative decoding's step (`verification`)."""
        return verify_lengths(self, fed)

    def rollback(self, rejected: list[int]) -> None:
        """Forget the last `rejected[i]` tokens of each row (proposals that were not kept)."""
        rollback_lengths(self, rejected)

    def bind(self) -> None:
        """Bind the running rows' view of the buffers and the step's inputs and logits, which `step` then writes in
        place: one binding for every step until a row joins or leaves or the buffers grow."""
        rows = len(self.rows)
        feeds = {
            "input_ids": torch.zeros(rows, 1, dtype=torch.int64),
            "seqlens_k": torch.zeros(rows, dtype=torch.int32),
            "total_sequence_length": torch.zeros((), dtype=torch.int32),
            "query_seqlens": torch.ones(rows, dtype=torch.int32),
            "logits_positions": torch.zeros(1, dtype=torch.int64),
        }
        logits = torch.empty(rows, 1, self.decoder.vocab)
        views = [buffer[:rows] for buffer in self.buffers]
        self.binding = self.decoder.bind(feeds, views, logits)
        self.bound = (feeds, views, logits)  # the binding holds pointers: keep their owners alive
        # Written through numpy views: a few microseconds a step instead of torch's dispatch.
        self.tokens, self.seqlens = feeds["input_ids"].numpy(), feeds["seqlens_k"].numpy()
        self.total, self.logits = feeds["total_sequence_length"].numpy(), logits.numpy()[:, 0]

    def row_cache(self, row: int, start: int, stop: int) -> list[np.ndarray]:
        """A copy of the cache of row `row`'s tokens [start, stop), (kv_heads, stop - start, head_dim) per tensor."""
        if stop > self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} tokens, not {stop}.")
        return [buffer[row, :, start:stop].numpy().copy() for buffer in self.buffers]

    def keep(self, rows: list[int]) -> None:
        """Keep only the rows listed: each freed slot among the first len(rows) takes a kept row from beyond them
        (one row's copy), so the running rows stay the first ones; the kept rows' order changes accordingly."""
        if len(rows) == len(self.rows):
            return
        count, kept = len(rows), set(rows)
        holes = [slot for slot in range(count) if slot not in kept]
        movers = [slot for slot in rows if slot >= count]
        sequences, lengths = self.rows[:count], self.lengths[:count].copy()  # new objects: callers may hold the old
        for hole, mover in zip(holes, movers):
            length = int(self.lengths[mover])
            for buffer in self.buffers:
                buffer[hole, :, :length] = buffer[mover, :, :length]
            sequences[hole], lengths[hole] = self.rows[mover], self.lengths[mover]
        self.rows, self.lengths = sequences, lengths
        self.binding = None
        if not count:
            self.buffers = []  # let the memory go; the next join allocates what it needs


def grown(size: int, needed: int, least: int) -> int:
    """`size` (at least `least`) doubled until it holds `needed`."""
    size = max(size, least)
    while size < needed:
        size *= 2
    return size
