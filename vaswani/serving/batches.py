"""The model side of continuous batching: one decoding step over a batch whose rows are at different lengths, and the
batch's cache, which rows join and leave between steps. Two kinds of batch, one interface (`Batch`, `Prefill`), so
that the scheduler never asks which graph it runs:

- **Left-padded** (`RunningBatch`, `PrefillGroup`), for the portable export (`OrtStepModel`) and PyTorch
  (`TorchStepModel`): a step model runs the decoding graph on token ids, an attention mask, positions and the cache
  tensors, and returns the last position's logits and the new cache (the lean generation loop's step,
  `OrtModelForCausalLM.run_step_arrays` on the CPU, `run_decoding_graph` with IO binding on CUDA). The cache of every
  running sequence is one set of tensors, (batch, heads, length, head_dim) per layer, left-padded: a row's real tokens
  end at the last column and the mask zeroes the padding before them, as in batched `generate` on left-padded
  prompts. Prompts are prefilled apart from the batch (several left-padded together) and join it by `join`: the
  shorter of the two caches is padded on the left and the rows concatenated, one copy of the cache. A sequence leaves
  by dropping its row (`keep`); columns that only padding occupies after rows left are cut off (`trim`).
- **Per-row lengths** (`GqaBatch`, `GqaPrefill`), for the GroupQueryAttention form that quantized and optimized
  exports take (`GqaStepModel`, on `gqa_runtime.GqaDecoder`): each row holds its tokens at the front of its slot of
  one in-place KV buffer per cache tensor, (slots, kv_heads, capacity, head_dim), and the graph reads each row's
  length (`seqlens_k`) instead of a mask. A decoding step appends one token per row in place (no copy of the cache)
  through an IO binding kept while the rows and the capacity stay the same; the capacity doubles when the longest row
  needs it. A joining prompt is copied once into a free slot; a leaving row's slot takes the last row's cache.
- **Held by OpenVINO** (`OpenVinoBatch`, with `PrefillGroup`), for `engine="openvino"` (`OpenVinoStepModel`): a
  left-padded batch whose cache, between OpenVINO's decode steps, stays inside one infer request of the stateful graph
  (`openvino_engine.OpenVinoDecoder`), so that a step feeds only the tokens; joins and leaves read it out and write it
  back once.

Positions follow one rule everywhere, offline `generate`'s (`contract.positions_from_mask`): each token's count of
real tokens before it. The GroupQueryAttention graph derives exactly that from the lengths.

    >>> step = OrtStepModel(OrtModelForCausalLM.from_pretrained("exported"))   # or step_model(...) for either form
    >>> batch, group = step.new_batch(), step.prefill_group(sequences, prompts)
    >>> first = group.run(columns=len(max(prompts, key=len)))                # one call: every prompt's logits
    >>> batch.join(group, keep=list(range(len(sequences))))
    >>> logits = batch.step(np.array([...]))                                   # one token per row
"""

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from ..modeling import cache_of
from ..runtime.contract import positions_from_mask
from ..runtime.generation import OrtModelForCausalLM, store_in_cache
from ..runtime.gqa import GqaDecoder
from ..runtime.openvino import OpenVinoDecoder

Array = Any  # numpy arrays on the CPU, torch tensors on a GPU


def concat(arrays: Sequence[Array], axis: int) -> Array:
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays, axis=axis)
    return torch.cat(list(arrays), dim=axis)


def zeros(like: Array, shape: tuple[int, ...]) -> Array:
    if isinstance(like, np.ndarray):
        return np.zeros(shape, dtype=like.dtype)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def take_rows(array: Array, rows: list[int]) -> Array:
    if isinstance(array, np.ndarray):
        return array[rows]
    return array[torch.tensor(rows, device=array.device)]


def cut_columns(array: Array, start: int) -> Array:
    """array[:, :, start:] as a contiguous copy (the graphs take contiguous tensors)."""
    view = array[:, :, start:]
    return np.ascontiguousarray(view) if isinstance(array, np.ndarray) else view.contiguous()


def pad_left(array: Array, columns: int) -> Array:
    """Zeros before the sequence axis (axis 2) of a cache tensor."""
    if columns == 0:
        return array
    batch, heads, _, head_dim = array.shape
    return concat([zeros(array, (batch, heads, columns, head_dim)), array], axis=2)


class Prefill(Protocol):
    """Prompts prefilled together, apart from the running batch, before they join it."""

    rows: list[Any]  # the sequences, in the order of the logits `run` returns (a prefill may reorder them)

    @property
    def columns(self) -> int:
        """The longest prompt: `run(columns)` feeds them all at once."""

    @property
    def tokens(self) -> int:
        """Tokens one call over every column computes (padding included)."""

    @property
    def done(self) -> bool:
        """Whether every prompt has been fed."""

    def run(self, columns: int) -> np.ndarray:
        """Feed the next `columns` columns of the prompts; returns (rows, vocab) float32 logits, each row's last
        prompt token's once `done`."""


class Batch(Protocol):
    """The running sequences' cache: one token per row per `step`; rows join from a `Prefill` and leave."""

    rows: list[Any]  # the sequence in each row

    def __len__(self) -> int: ...

    def join(self, group: Prefill, keep: list[int]) -> None:
        """Add the rows `keep` (indices into `group.rows`) of a finished prefill."""

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per row (`tokens`, (batch,) int64); returns the logits (batch, vocab) float32."""

    def keep(self, rows: list[int]) -> None:
        """Keep only the rows listed (indices into `rows`); `rows` then lists the kept sequences, in any order."""


class PaddedStepModel:
    """A step model whose batches are left-padded (`RunningBatch`, `PrefillGroup`): it runs
    `run(input_ids, attention_mask, positions, past)` and makes `empty_cache(batch)`."""

    def new_batch(self) -> "RunningBatch":
        return RunningBatch(self)

    def prefill_group(self, rows: list[Any], prompts: list[list[int]]) -> "PrefillGroup":
        return PrefillGroup(self, rows, prompts)


class OrtStepModel(PaddedStepModel):
    """One decoding step of an exported causal LM (`OrtModelForCausalLM`), on any batch and cache length."""

    def __init__(self, model: OrtModelForCausalLM):
        self.model = model
        self.graph = model.graphs[model.decoding_graph]
        self.takes_positions = "position_ids" in self.graph.inputs
        self.vocab_size = model.manifest["vocab_size"]
        self.context_length = context_length(model.config)

    def empty_cache(self, batch: int = 1) -> list[Array]:
        past = self.model.empty_past(batch)
        return past if self.graph.use_io_binding else [tensor.numpy() for tensor in past]

    def run(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, positions: np.ndarray, past: list[Array]
    ) -> tuple[np.ndarray, list[Array]]:
        """Feed `input_ids` (batch, new) after `past` (batch, heads, cached, head_dim per tensor) under
        `attention_mask` (batch, cached + new); returns the last position's logits as float32 (batch, vocab) and the
        cache (batch, heads, cached + new, head_dim)."""
        inputs = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "logits_positions": torch.tensor([input_ids.shape[1] - 1]),
        }
        if self.takes_positions:
            inputs["position_ids"] = torch.from_numpy(positions)
        if not self.graph.use_io_binding:
            logits, present = self.model.run_step_arrays(inputs, past)
        else:
            inputs = {name: tensor.to(self.model.device) for name, tensor in inputs.items()}
            logits, present = self.model.run_decoding_graph(inputs, past, None)
        return logits[:, -1].float().cpu().numpy(), present


class TorchStepModel(PaddedStepModel):
    """The same step for a PyTorch `VaswaniForCausalLM`: the cache arrays wrap into a `DynamicCache` without a copy,
    and the updated one unwraps again. It runs on torch's intra-op threads as the process set them (set once at
    startup; a library that changed them around each step would change them under every other thread)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.context_length = context_length(model.config)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def empty_cache(self, batch: int = 1) -> list[Array]:
        heads = self.config.num_key_value_heads
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        shape = (batch, heads, 0, head_dim)
        empty = torch.empty(shape, dtype=self.dtype, device=self.device)
        return [empty if self.device.type != "cpu" else empty.numpy()] * (2 * self.config.num_hidden_layers)

    def run(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, positions: np.ndarray, past: list[Array]
    ) -> tuple[np.ndarray, list[Array]]:
        cache = DynamicCache(config=self.config)
        if past[0].shape[2]:
            store_in_cache(cache, [torch.as_tensor(tensor, device=self.device) for tensor in past])
        with torch.inference_mode():
            output = self.model(
                input_ids=torch.from_numpy(input_ids).to(self.device),
                attention_mask=torch.from_numpy(attention_mask).to(self.device),
                position_ids=torch.from_numpy(positions).to(self.device),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        present = [tensor for layer in cache_of(output).layers for tensor in (layer.keys, layer.values)]
        if self.device.type == "cpu":
            present = [tensor.numpy() for tensor in present]
        return output.logits[:, -1].float().cpu().numpy(), present


def context_length(config: Any) -> int:
    """The longest sequence (prompt and answer) the model was built for."""
    return int(getattr(config, "max_position_embeddings", None) or 2048)


class PrefillGroup:
    """Prompts prefilled together: left-padded to the longest, fed in chunks of columns (`run`), so that one call
    never holds more than a chosen number of tokens. Positions and mask as in `generate` (`positions_from_mask`)."""

    def __init__(self, model: PaddedStepModel, rows: list[Any], prompts: list[list[int]]):
        self.model, self.rows = model, rows
        longest = max(len(prompt) for prompt in prompts)
        self.ids = np.zeros((len(prompts), longest), dtype=np.int64)
        self.mask = np.zeros((len(prompts), longest), dtype=np.int64)
        for i, prompt in enumerate(prompts):
            self.ids[i, longest - len(prompt) :] = prompt
            self.mask[i, longest - len(prompt) :] = 1
        self.positions = positions_from_mask(torch.from_numpy(self.mask)).numpy()
        self.cache = model.empty_cache(len(prompts))
        self.filled = 0  # columns in `cache`

    @property
    def columns(self) -> int:
        return self.ids.shape[1]

    @property
    def tokens(self) -> int:
        return self.ids.size

    @property
    def done(self) -> bool:
        return self.filled == self.ids.shape[1]

    def run(self, columns: int) -> np.ndarray:
        """Feed the next `columns` columns; returns the logits of the last one (rows, vocab)."""
        start, end = self.filled, min(self.filled + columns, self.ids.shape[1])
        chunk = (self.ids[:, start:end], self.mask[:, :end], self.positions[:, start:end])
        logits, self.cache = self.model.run(*(np.ascontiguousarray(array) for array in chunk), self.cache)
        self.filled = end
        return logits

    def keep(self, rows: list[int]) -> tuple[list[Any], list[Array], np.ndarray]:
        """The rows listed, with their cache and mask, to join a `RunningBatch`."""
        cache = self.cache if len(rows) == len(self.rows) else [take_rows(tensor, rows) for tensor in self.cache]
        return [self.rows[i] for i in rows], cache, self.mask[rows]


class RunningBatch:
    """The cache and attention mask of the running sequences, one row each, left-padded to a common length.

    `rows[i]` is the sequence in row i (any object; the scheduler's `Sequence`s).
    """

    def __init__(self, model: PaddedStepModel) -> None:
        self.model = model
        self.rows: list[Any] = []
        self.cache: list[Array] = []
        self.mask = np.zeros((0, 0), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def join(self, group: PrefillGroup, keep: list[int]) -> None:
        """Add the rows `keep` of a prefilled group: their cache (len(keep), heads, length, head_dim) per tensor and
        their mask (len(keep), length), left-padded like the batch's."""
        if not keep:
            return
        rows, cache, mask = group.keep(keep)
        if not self.rows:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            return
        length = max(self.length, mask.shape[1])
        own, new = length - self.length, length - mask.shape[1]
        self.cache = [concat([pad_left(old, own), pad_left(add, new)], axis=0) for old, add in zip(self.cache, cache)]
        self.mask = np.concatenate([np.pad(self.mask, ((0, 0), (own, 0))), np.pad(mask, ((0, 0), (new, 0)))])
        self.rows += rows

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per row (`tokens`, (batch,)); returns the logits (batch, vocab)."""
        mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), dtype=np.int64)], axis=1)
        positions = np.ascontiguousarray(positions_from_mask(torch.from_numpy(mask))[:, -1:].numpy())
        logits, self.cache = self.model.run(tokens.reshape(-1, 1), mask, positions, self.cache)
        self.mask = mask
        return logits

    def keep(self, rows: list[int]) -> None:
        """Keep only the rows listed (in that order), then `trim`."""
        if len(rows) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in rows]
        if not rows:
            self.cache, self.mask = [], np.zeros((0, 0), dtype=np.int64)
            return
        self.cache = [take_rows(tensor, rows) for tensor in self.cache]
        self.mask = self.mask[rows]
        self.trim()

    def trim(self, min_columns: int = 8) -> None:
        """Cut the leading columns that are padding in every row, when there are at least `min_columns` of them
        (each cut copies the cache once)."""
        used = np.flatnonzero(self.mask.any(axis=0))
        start = int(used[0]) if used.size else self.length
        if start >= min_columns:
            self.cache = [cut_columns(tensor, start) for tensor in self.cache]
            self.mask = np.ascontiguousarray(self.mask[:, start:])


# ------------------------------------------------------------------------------ the GroupQueryAttention form


class GqaStepModel:
    """The step model of a GroupQueryAttention-form export (`OrtModelForCausalLM` whose `gqa` is set: quantized and
    optimized exports on the CPU): its batches keep per-row lengths in in-place KV buffers (`GqaBatch`)."""

    def __init__(self, model: OrtModelForCausalLM):
        if model.gqa is None:
            raise ValueError(f"{model.folder} holds the portable decoder form; serve it with OrtStepModel.")
        self.model = model
        self.decoder: GqaDecoder = model.gqa
        self.vocab_size = model.manifest["vocab_size"]
        self.context_length = min(context_length(model.config), self.decoder.max_positions)

    def new_batch(self) -> "GqaBatch":
        return GqaBatch(self.decoder)

    def prefill_group(self, rows: list[Any], prompts: list[list[int]]) -> "GqaPrefill":
        return GqaPrefill(self.decoder, rows, prompts)


def step_model(model: OrtModelForCausalLM) -> "OrtStepModel | GqaStepModel | OpenVinoStepModel":
    """The step model for an exported causal LM, whichever attention form its export holds and engine runs it."""
    if model.gqa is not None:
        return GqaStepModel(model)
    decoder = model.openvino_decoder()
    return OrtStepModel(model) if decoder is None else OpenVinoStepModel(model, decoder)


# ------------------------------------------------------------------------------ engine="openvino"


class OpenVinoStepModel(OrtStepModel):
    """The step model of `engine="openvino"`: prompts prefilled by the route (`OrtStepModel`: chunks of several
    tokens in OpenVINO), and running batches whose cache OpenVINO holds between its decode steps (`OpenVinoBatch`)."""

    def __init__(self, model: OrtModelForCausalLM, decoder: OpenVinoDecoder):
        super().__init__(model)
        self.decoder = decoder

    def new_batch(self) -> "OpenVinoBatch":
        return OpenVinoBatch(self)


class OpenVinoBatch(RunningBatch):
    """A `RunningBatch` whose decode steps OpenVINO runs on its stateful graph where `OpenVinoDecoder.serves` says so
    (else ONNX Runtime's, as the route), the cache held in one infer request between them: such a step feeds only the
    tokens, mask and positions. A join, leave or trim reads the cache out once (`cache`), `RunningBatch`'s own code
    edits it, and the next OpenVINO step writes it back."""

    held = False  # whether the cache is in the request rather than in `_cache`

    def __init__(self, model: OpenVinoStepModel):
        self.decoder = model.decoder
        self.request = self.decoder.new_request()
        super().__init__(model)

    @property
    def cache(self) -> list[Array]:
        if self.held:
            self._cache, self.held = self.decoder.read_cache(self.request), False
        return self._cache

    @cache.setter
    def cache(self, arrays: list[Array]) -> None:
        self._cache, self.held = arrays, False

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per row (`tokens`, (batch,)); returns the logits (batch, vocab)."""
        if not self.decoder.serves(self.model.model.manifest, len(self.rows)):
            return super().step(tokens)
        if not self.held:
            self.decoder.write_cache(self.request, self._cache)
            self._cache, self.held = [], True
        mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), dtype=np.int64)], axis=1)
        positions = positions_from_mask(torch.from_numpy(mask))[:, -1:].numpy()
        logits = self.decoder.infer(self.request, tokens.reshape(-1, 1), mask, positions)
        self.mask = mask
        return logits


def kv_buffers(decoder: GqaDecoder, slots: int, capacity: int) -> list[torch.Tensor]:
    """One (slots, kv_heads, capacity, head_dim) buffer per cache tensor, uninitialized: the kernel reads each row's
    first `seqlens_k + 1` columns only, all of which it or a copy wrote."""
    shape = (slots, decoder.kv_heads, capacity, decoder.head_dim)
    return [torch.empty(shape) for _ in decoder.past_names]


class GqaPrefill:
    """Prompts prefilled together into buffers of their own, each at the front of its row (right-padded), fed in
    chunks of columns. The rows are held longest prompt first, so that the rows a chunk still feeds are always the
    first ones: a contiguous view of the buffers, and no row is ever fed zero tokens."""

    def __init__(self, decoder: GqaDecoder, rows: list[Any], prompts: list[list[int]]):
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        self.decoder = decoder
        self.rows = [rows[i] for i in order]
        self.lengths = np.array([len(prompts[i]) for i in order], dtype=np.int64)
        self.ids = torch.zeros(len(order), int(self.lengths[0]), dtype=torch.int64)
        for row, i in enumerate(order):
            self.ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
        self.buffers = kv_buffers(decoder, len(order), self.columns)
        self.logits = np.zeros((len(order), decoder.vocab), dtype=np.float32)
        self.filled = 0  # columns fed

    @property
    def columns(self) -> int:
        return self.ids.shape[1]

    @property
    def tokens(self) -> int:
        return self.ids.numel()

    @property
    def done(self) -> bool:
        return self.filled == self.columns

    def run(self, columns: int) -> np.ndarray:
        """Feed the next `columns` columns of the rows whose prompts reach them; keep the logits of each prompt
        whose last token is among them. Returns every row's logits so far (rows, vocab)."""
        start, end = self.filled, min(self.filled + columns, self.columns)
        active = int((self.lengths > start).sum())  # a prefix: longest first
        lengths = torch.from_numpy(self.lengths[:active])
        query = lengths.clamp(max=end) - start
        last = lengths - 1 - start  # each row's last prompt token, as a column of this chunk
        finishing = torch.nonzero(last < end - start).flatten()
        wanted = torch.unique(last[finishing]) if finishing.numel() else torch.zeros(1, dtype=torch.long)
        buffers = [buffer[:active] for buffer in self.buffers]
        logits = self.decoder.run(self.ids[:active, start:end], query, start + query, buffers, wanted)
        for row in finishing.tolist():
            self.logits[row] = logits[row, int(torch.searchsorted(wanted, last[row]))].numpy()
        self.filled = end
        return self.logits


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
