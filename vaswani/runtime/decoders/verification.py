"""Speculative decoding's two batch operations, for each batch kind: `verify` feeds every row its last token and its
proposed tokens in one call and returns the logits of every fed position; `rollback` gives back the cache of the
proposals that were not kept. The batches' own `verify` and `rollback` methods call these (`GqaBatch` keeps per-row
lengths, `RunningBatch` a left-padded cache and mask: OpenVINO's and PyTorch's batches share its code).

    >>> logits = batch.verify([[last, *proposals] for ...])   # (rows, longest, vocab)
    >>> batch.rollback([rejected for each row])
"""

import weakref
from typing import Any

import numpy as np
import torch

from ..contract import positions_from_mask


def right_padded(fed: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The rows' tokens right-padded with zeros (rows, longest), and each row's count."""
    counts = np.array([len(tokens) for tokens in fed], dtype=np.int64)
    ids = np.zeros((len(fed), int(counts.max())), dtype=np.int64)
    for row, tokens in enumerate(fed):
        ids[row, : len(tokens)] = tokens
    return ids, counts


class VerifyBinding:
    """A verification call's IO binding on a `GqaBatch`, kept while its rows, width and buffers stay the same (as the
    batch keeps its step's binding): binding the 2 x layers KV buffers anew took about 3 ms a call."""

    def __init__(self, batch: Any, width: int):
        rows = len(batch.rows)
        # The key. Weakly: the batch lets its buffers go when it grows or empties, and the binding must not keep
        # them (the batch replaces all of them together, so the first one stands for the set).
        self.buffer, self.rows, self.width = weakref.ref(batch.buffers[0]), rows, width
        self.feeds = {
            "input_ids": torch.zeros(rows, width, dtype=torch.int64),
            "seqlens_k": torch.zeros(rows, dtype=torch.int32),
            "total_sequence_length": torch.zeros((), dtype=torch.int32),
            "query_seqlens": torch.zeros(rows, dtype=torch.int32),
            "logits_positions": torch.arange(width),
        }
        self.logits = torch.empty(rows, width, batch.decoder.vocab)
        views = [buffer[:rows] for buffer in batch.buffers]
        self.binding = batch.decoder.bind(self.feeds, views, self.logits)

    def fits(self, batch: Any, width: int) -> bool:
        return self.buffer() is batch.buffers[0] and self.rows == len(batch.rows) and self.width == width


def verify_lengths(batch: Any, fed: list[list[int]]) -> np.ndarray:
    """`GqaBatch.verify`: row i's tokens land at [lengths[i], lengths[i] + len(fed[i])) of its slot (the kernel
    takes per-row query lengths, right-padded, as a prefill chunk does); returns (rows, longest, vocab), where a
    row's columns past its own count are padding's: a view of an output buffer that the next verification
    overwrites."""
    ids, counts = right_padded(fed)
    totals = batch.lengths + counts
    # ONNX Runtime's kernel wants room for a whole chunk's width after each row's tokens, padding included.
    batch.reserve(len(batch.rows), int(batch.lengths.max()) + ids.shape[1])
    bound = getattr(batch, "verifying", None)
    if bound is None or not bound.fits(batch, ids.shape[1]):
        bound = batch.verifying = VerifyBinding(batch, ids.shape[1])
    feeds = bound.feeds
    feeds["input_ids"].numpy()[...] = ids
    feeds["seqlens_k"].numpy()[...] = totals - 1
    feeds["total_sequence_length"].numpy()[...] = totals.max()
    feeds["query_seqlens"].numpy()[...] = counts
    batch.decoder.session.run_with_iobinding(bound.binding)
    batch.lengths = totals  # a new array: the step's binding reads `lengths` afresh each step
    return bound.logits.numpy()


def rollback_lengths(batch: Any, rejected: list[int]) -> None:
    """`GqaBatch.rollback`: the rejected tokens' keys and values stay in the buffers and are overwritten by the next
    ones; the kernel reads a row's first `lengths` only."""
    batch.lengths = batch.lengths - np.asarray(rejected, dtype=np.int64)


def verify_padded(batch: Any, fed: list[list[int]]) -> np.ndarray:
    """`RunningBatch.verify`: the tokens are appended as columns, right-padded with mask-0 columns for rows fed
    fewer; positions are the mask's (each token's count of attended tokens before it), so a hole left by a rejected
    proposal does not shift the positions after it. Returns (rows, longest, vocab)."""
    ids, counts = right_padded(fed)
    width = ids.shape[1]
    added = (np.arange(width)[None] < counts[:, None]).astype(np.int64)
    mask = np.concatenate([batch.mask, added], axis=1)
    positions = np.ascontiguousarray(positions_from_mask(torch.from_numpy(mask))[:, -width:].numpy())
    logits, batch.cache = batch.model.run(ids, mask, positions, batch.cache, logits_to_keep=width)
    batch.mask = mask
    return logits if logits.ndim == 3 else logits[:, None]  # one position: the step model's (rows, vocab)


def rollback_padded(batch: Any, rejected: list[int]) -> None:
    """`RunningBatch.rollback`: each row's last `rejected[i]` attended columns are masked out (holes the mask hides:
    positions come from the mask), and the trailing columns no row attends any more are cut off, so that at batch 1
    the cache holds exactly the kept tokens."""
    mask = batch.mask
    for row, dropped in enumerate(rejected):
        if dropped:
            mask[row, np.flatnonzero(mask[row])[-dropped:]] = 0
    used = np.flatnonzero(mask.any(axis=0))
    width = int(used[-1]) + 1 if used.size else 0
    if width < mask.shape[1]:
        batch.cache = [slice_columns(tensor, width) for tensor in batch.cache]
        batch.mask = np.ascontiguousarray(mask[:, :width])


def slice_columns(array: Any, end: int) -> Any:
    """array[:, :, :end] as a contiguous copy (the graphs take contiguous tensors)."""
    view = array[:, :, :end]
    return np.ascontiguousarray(view) if isinstance(array, np.ndarray) else view.contiguous()
