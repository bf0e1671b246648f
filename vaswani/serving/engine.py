"""The model side of continuous batching: one decoding step over a batch whose rows are at different lengths, and the
batch's cache, which rows join and leave between steps.

A step model (`OrtStepModel` over an exported folder, `TorchStepModel` over a PyTorch one) runs the decoding graph on
token ids, an attention mask and the cache tensors, and returns the last position's logits and the new cache. It is
the lean generation loop's step (`OrtModelForCausalLM.run_step_arrays` on the CPU, `run_decoding_graph` with IO
binding on CUDA), called by the scheduler instead of `generate`.

`RunningBatch` holds the cache of every running sequence in one set of tensors, (batch, heads, length, head_dim) per
layer, left-padded: a row's real tokens end at the last column and the attention mask zeroes the padding before
them, as in batched `generate` on left-padded prompts. Sequences join after their prompts were prefilled apart from
the batch (`PrefillGroup`, several prompts left-padded together), by `join`: the shorter of the two caches is padded
on the left and the rows concatenated, one copy of the cache, about what one decoding step copies anyway. A sequence
leaves by dropping its row (`keep`). Columns that only padding occupies
after rows left are cut off (`trim`) so that the others do not keep attending over them.

    >>> step = OrtStepModel(OrtModelForCausalLM.from_pretrained("exported"))
    >>> logits, cache = step.run(ids, mask, positions, step.empty_cache(batch=1))
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from ..conversion.onnx.generation import OrtModelForCausalLM, store_in_cache, torch_threads
from ..modeling import cache_of

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


class OrtStepModel:
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


class TorchStepModel:
    """The same step for a PyTorch `VaswaniForCausalLM`: the cache arrays wrap into a `DynamicCache` without a copy,
    and the updated one unwraps again."""

    def __init__(self, model: torch.nn.Module, threads: int | None = None):
        self.model = model.eval()
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.context_length = context_length(model.config)
        self.threads = threads or torch.get_num_threads()
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
        with torch_threads(self.threads), torch.inference_mode():
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
    never holds more than a chosen number of tokens. Padding columns get position 0 and mask 0, as in `generate`."""

    def __init__(self, rows: list[Any], prompts: list[list[int]], empty_cache: list[Array]):
        self.rows = rows
        longest = max(len(prompt) for prompt in prompts)
        self.ids = np.zeros((len(prompts), longest), dtype=np.int64)
        self.mask = np.zeros((len(prompts), longest), dtype=np.int64)
        for i, prompt in enumerate(prompts):
            self.ids[i, longest - len(prompt) :] = prompt
            self.mask[i, longest - len(prompt) :] = 1
        self.positions = np.maximum(self.mask.cumsum(axis=1) - 1, 0)
        self.cache = empty_cache
        self.filled = 0  # columns in `cache`

    @property
    def tokens(self) -> int:
        return self.ids.size

    @property
    def done(self) -> bool:
        return self.filled == self.ids.shape[1]

    def run(self, model: Any, columns: int) -> np.ndarray:
        """Feed the next `columns` columns; returns the logits of the last one (rows, vocab)."""
        start, end = self.filled, min(self.filled + columns, self.ids.shape[1])
        chunk = (self.ids[:, start:end], self.mask[:, :end], self.positions[:, start:end])
        logits, self.cache = model.run(*(np.ascontiguousarray(array) for array in chunk), self.cache)
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

    def __init__(self) -> None:
        self.rows: list[Any] = []
        self.cache: list[Array] = []
        self.mask = np.zeros((0, 0), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def join(self, rows: list[Any], cache: list[Array], mask: np.ndarray) -> None:
        """Add prefilled sequences: their cache (len(rows), heads, length, head_dim) per tensor and their mask
        (len(rows), length), left-padded like the batch's."""
        if not rows:
            return
        if not self.rows:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            return
        length = max(self.length, mask.shape[1])
        own, new = length - self.length, length - mask.shape[1]
        self.cache = [concat([pad_left(old, own), pad_left(add, new)], axis=0) for old, add in zip(self.cache, cache)]
        self.mask = np.concatenate([np.pad(self.mask, ((0, 0), (own, 0))), np.pad(mask, ((0, 0), (new, 0)))])
        self.rows += rows

    def step(self, model: Any, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Feed one token per row (`tokens` and their `positions`, (batch, 1)); returns the logits (batch, vocab)."""
        mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), dtype=np.int64)], axis=1)
        logits, self.cache = model.run(tokens, mask, positions, self.cache)
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
