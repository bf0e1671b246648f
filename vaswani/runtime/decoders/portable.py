"""The portable runtime: ONNX Runtime on the portable decoder graph (opset-23 attention), the cache plain tensors fed
back as the graph's past inputs; and the server's batch kind for it, which the OpenVINO runtime and PyTorch share.

**Left-padded batches** (`RunningBatch`, `PrefillGroup`): a step model (`OrtStepModel`; `serving.batches`'
`TorchStepModel` for PyTorch) runs the decoding graph on token ids, an attention mask, positions and the cache
tensors, and returns the last position's logits and the new cache (the lean generation loop's step: `run_arrays` on
the CPU, `run` with IO binding on CUDA). The cache of every running sequence is one set of tensors, (batch, heads,
length, head_dim) per layer, left-padded: a row's real tokens end at the last column and the mask zeroes the padding
before them, as in batched `generate` on left-padded prompts. Prompts are prefilled apart from the batch (several
left-padded together) and join it by `join`: the shorter of the two caches is padded on the left and the rows
concatenated, one copy of the cache. A sequence leaves by dropping its row (`keep`); columns that only padding
occupies after rows left are cut off (`trim`).

Positions follow one rule everywhere, offline `generate`'s (`contract.positions_from_mask`): each token's count of
real tokens before it.

    >>> step = OrtModelForCausalLM.from_pretrained("exported").decoder_runtime.step_model()
    >>> batch, group = step.new_batch(), step.prefill_group(sequences, prompts)
    >>> first = group.run(columns=len(max(prompts, key=len)))                # one call: every prompt's logits
    >>> batch.join(group, keep=list(range(len(sequences))))
    >>> logits = batch.step(np.array([...]))                                   # one token per row
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..contract import is_gqa_form, positions_from_mask
from .verification import rollback_padded, verify_padded


class PortableRuntime:
    """ONNX Runtime on the portable decoder graph, on any provider: each call feeds the past cache tensors and gets
    the present ones back (with IO binding, written into preallocated buffers: `OrtModelForGeneration.kv_buffers_for`).
    `generate`'s lean loop and the server's left-padded batch (`OrtStepModel`) run `run` / `run_arrays`."""

    name = "portable"
    engine = "onnxruntime"
    takes_cache_tensors = True

    @classmethod
    def refusal(cls, request) -> str | None:
        if is_gqa_form(request.manifest):
            return f"{request.folder} holds the GroupQueryAttention form of the decoder, not the portable one."
        return None

    @classmethod
    def load(cls, model: Any, request) -> "PortableRuntime":
        return cls(model)

    def __init__(self, model: Any):
        self.model = model  # an OrtModelForCausalLM
        self.graph = model.graphs[model.decoding_graph]

    @property
    def provider(self) -> str:
        return self.graph.session.get_providers()[0]

    @property
    def description(self) -> str:
        return f"every step in ONNX Runtime ({self.provider}), the cache left-padded"

    def forward(self, input_ids, attention_mask, position_ids, past, logits_to_keep, cache):
        model = self.model
        inputs = model.decoder_inputs(input_ids, attention_mask, position_ids, past, logits_to_keep)
        buffers = None if cache is None else model.kv_buffers_for(cache, *inputs["attention_mask"].shape)
        return self.run(inputs, [inputs.pop(name) for name in model.past_names], buffers)

    def run(self, inputs, past, buffers):
        return self.model.decoding.run(inputs, past, buffers)

    def run_arrays(self, inputs, past):
        return self.model.decoding.run_arrays(inputs, past)

    def sample(self, input_ids, attention_mask, position_ids, logits_processor, stopping_criteria, generation_config):
        return None  # the model's lean loop over `run` / `run_arrays`

    def step_model(self) -> "OrtStepModel":
        return OrtStepModel(self.model)


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


class PaddedStepModel:
    """A step model whose batches are left-padded (`RunningBatch`, `PrefillGroup`): it runs
    `run(input_ids, attention_mask, positions, past)` and makes `empty_cache(batch)`."""

    description = ""

    def new_batch(self) -> "RunningBatch":
        return RunningBatch(self)

    def prefill_group(
        self, rows: list[Any], prompts: list[list[int]], prefixes: list[list[Array] | None] | None = None
    ) -> "PrefillGroup":
        return PrefillGroup(self, rows, prompts, prefixes)


class OrtStepModel(PaddedStepModel):
    """One decoding step of an exported causal LM (`OrtModelForCausalLM`), on any batch and cache length."""

    def __init__(self, model: Any):
        self.model = model  # an OrtModelForCausalLM
        self.graph = model.graphs[model.decoding_graph]
        self.takes_positions = "position_ids" in self.graph.inputs
        self.vocab_size = model.manifest["vocab_size"]
        self.context_length = context_length(model.config)

    @property
    def description(self) -> str:
        return self.model.decoder_runtime.description

    def empty_cache(self, batch: int = 1) -> list[Array]:
        past = self.model.empty_past(batch)
        return past if self.graph.use_io_binding else [tensor.numpy() for tensor in past]

    def run(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        positions: np.ndarray,
        past: list[Array],
        logits_to_keep: int = 1,
    ) -> tuple[np.ndarray, list[Array]]:
        """Feed `input_ids` (batch, new) after `past` (batch, heads, cached, head_dim per tensor) under
        `attention_mask` (batch, cached + new); returns the last position's logits as float32 (batch, vocab) (with
        `logits_to_keep` > 1, the last positions' (batch, logits_to_keep, vocab)) and the cache (batch, heads,
        cached + new, head_dim)."""
        new = input_ids.shape[1]
        inputs = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "logits_positions": torch.arange(new - logits_to_keep, new),
        }
        if self.takes_positions:
            inputs["position_ids"] = torch.from_numpy(positions)
        if not self.graph.use_io_binding:
            logits, present = self.model.run_step_arrays(inputs, past)
        else:
            inputs = {name: tensor.to(self.model.device) for name, tensor in inputs.items()}
            logits, present = self.model.run_decoding_graph(inputs, past, None)
        logits = logits[:, -1] if logits_to_keep == 1 else logits
        return logits.float().cpu().numpy(), present


def context_length(config: Any) -> int:
    """The longest sequence (prompt and answer) the model was built for."""
    return int(getattr(config, "max_position_embeddings", None) or 2048)


class PrefillGroup:
    """Prompts prefilled together: left-padded to the longest, fed in chunks of columns (`run`), so that one call
    never holds more than a chosen number of tokens. Positions and mask as in `generate` (`positions_from_mask`).

    A prompt whose first tokens' cache is given (`prefixes[i]`: (heads, cached, head_dim) per cache tensor, from the
    server's prefix cache) feeds only the rest. The given caches start the group's cache, left-padded to the longest
    of them, and the rest of each prompt follows left-padded to the longest rest: a row with a shorter rest has
    padding between its two parts, which the mask zeroes as it zeroes left padding (attention reads the mask per
    key, and positions count the attended tokens before each one).
    """

    def __init__(
        self,
        model: PaddedStepModel,
        rows: list[Any],
        prompts: list[list[int]],
        prefixes: list[list[Array] | None] | None = None,
    ):
        self.model, self.rows = model, rows
        prefixes = prefixes or [None] * len(prompts)
        cached = [0 if prefix is None else prefix[0].shape[1] for prefix in prefixes]
        rests = [prompt[count:] for prompt, count in zip(prompts, cached)]
        longest, past = max(len(rest) for rest in rests), max(cached)
        self.ids = np.zeros((len(prompts), longest), dtype=np.int64)
        self.mask = np.zeros((len(prompts), past + longest), dtype=np.int64)
        for i, (rest, count) in enumerate(zip(rests, cached)):
            self.ids[i, longest - len(rest) :] = rest
            self.mask[i, past - count : past] = 1
            self.mask[i, past + longest - len(rest) :] = 1
        self.positions = positions_from_mask(torch.from_numpy(self.mask)).numpy()[:, past:]
        self.cache = model.empty_cache(len(prompts))
        if past:
            self.cache = [left_padded_prefixes(empty, prefixes, t, past) for t, empty in enumerate(self.cache)]
        self.past = past  # cache columns before the prompts' rests
        self.filled = 0  # columns of the rests in `cache`

    @property
    def columns(self) -> int:
        return self.ids.shape[1]

    @property
    def tokens(self) -> int:
        return self.ids.size

    @property
    def computed(self) -> int:
        return len(self.rows) * self.filled

    @property
    def done(self) -> bool:
        return self.filled == self.ids.shape[1]

    def run(self, columns: int) -> np.ndarray:
        """Feed the next `columns` columns; returns the logits of the last one (rows, vocab)."""
        start, end = self.filled, min(self.filled + columns, self.ids.shape[1])
        chunk = (self.ids[:, start:end], self.mask[:, : self.past + end], self.positions[:, start:end])
        logits, self.cache = self.model.run(*(np.ascontiguousarray(array) for array in chunk), self.cache)
        self.filled = end
        return logits

    def keep(self, rows: list[int]) -> tuple[list[Any], list[Array], np.ndarray]:
        """The rows listed, with their cache and mask, to join a `RunningBatch`."""
        cache = self.cache if len(rows) == len(self.rows) else [take_rows(tensor, rows) for tensor in self.cache]
        return [self.rows[i] for i in rows], cache, self.mask[rows]

    def row_cache(self, row: int, start: int, stop: int) -> list[Array]:
        """A copy of the cache of row `row`'s tokens [start, stop) (counting its real tokens), (heads, stop - start,
        head_dim) per cache tensor: for the server's prefix cache."""
        return real_columns(self.cache, self.mask[:, : self.past + self.filled], row, start, stop)


def left_padded_prefixes(empty: Array, prefixes: list[list[Array] | None], tensor: int, columns: int) -> Array:
    """Cache tensor `tensor` of the given prefixes, one row each, left-padded to `columns` (zeros for a row without
    one); `empty` is the empty batch's tensor, for its type and shape."""
    _, heads, _, head_dim = empty.shape
    rows = []
    for prefix in prefixes:
        if prefix is None:
            rows.append(zeros(empty, (1, heads, columns, head_dim)))
        else:
            rows.append(pad_left(prefix[tensor][None], columns - prefix[tensor].shape[1]))
    return concat(rows, axis=0)


def real_columns(cache: list[Array], mask: np.ndarray, row: int, start: int, stop: int) -> list[Array]:
    """The cache of row `row`'s real tokens [start, stop) under `mask` (batch, columns): a copy per tensor."""
    columns = np.flatnonzero(mask[row])[start:stop]
    if len(columns) != stop - start:
        raise ValueError(f"row {row} holds {np.count_nonzero(mask[row])} tokens, not {stop}.")
    if isinstance(cache[0], np.ndarray):
        return [tensor[row][:, columns] for tensor in cache]
    index = torch.from_numpy(columns).to(cache[0].device)
    return [tensor[row].index_select(1, index) for tensor in cache]


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

    def verify(self, fed: list[list[int]]) -> np.ndarray:
        """Feed each row its tokens `fed[i]` (its last token and proposals) in one call; the logits of every fed
        position (rows, longest, vocab). Speculative decoding's step (`verification`)."""
        return verify_padded(self, fed)

    def rollback(self, rejected: list[int]) -> None:
        """Forget the last `rejected[i]` tokens of each row (proposals that were not kept)."""
        rollback_padded(self, rejected)

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

    def row_cache(self, row: int, start: int, stop: int) -> list[Array]:
        """A copy of the cache of row `row`'s tokens [start, stop), (heads, stop - start, head_dim) per tensor."""
        return real_columns(self.cache, self.mask, row, start, stop)

    def trim(self, min_columns: int = 8) -> None:
        """Cut the leading columns that are padding in every row, when there are at least `min_columns` of them
        (each cut copies the cache once)."""
        used = np.flatnonzero(self.mask.any(axis=0))
        start = int(used[0]) if used.size else self.length
        if start >= min_columns:
            self.cache = [cut_columns(tensor, start) for tensor in self.cache]
            self.mask = np.ascontiguousarray(self.mask[:, start:])
