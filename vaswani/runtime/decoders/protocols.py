"""What a decoder runtime is (`DecoderRuntime`), what it is asked with (`LoadRequest`), and what it supplies the
server (`StepModel`, whose `Batch` and `Prefill` the scheduler drives). Structural: an implementation imports nothing
from here; `decoders/__init__.py` registers it.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import torch


class Prefill(Protocol):
    """Prompts prefilled together, apart from the running batch, before they join it."""

    rows: list[Any]  # the sequences, in the order of the logits `run` returns (a prefill may reorder them)

    @property
    def computed(self) -> int:
        """Tokens computed so far, padding included (the scheduler's step log)."""

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
        """Feed the next `columns` columns of the prompts (or, where nothing is padded, up to `columns` x rows of
        their tokens); returns (rows, vocab) float32 logits, each row's last prompt token's once `done`."""

    # Optional, where rows are independent (the paged batch): `take_finished()` -> (a done `Prefill` of the prompts
    # already in, their last tokens' logits) or None, so that those join the batch while the others go on; and
    # `extend(rows, prompts, prefixes)`, which takes more prompts after the group's while it runs.

    def row_cache(self, row: int, start: int, stop: int) -> Any:
        """Once `done`: the cache of `rows[row]`'s tokens [start, stop) as the server's prefix cache keeps it: a copy,
        (kv_heads, stop - start, head_dim) per cache tensor, or, for a step model with `prefix_storage`, what it
        keeps (the paged batch: the block itself, held once more)."""


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

    def row_cache(self, row: int, start: int, stop: int) -> Any:
        """The cache of `rows[row]`'s tokens [start, stop), as `Prefill.row_cache`."""


@dataclass(frozen=True)
class LoadRequest:
    """What `from_pretrained` was asked for, as a decoder runtime's `refusal` and `load` read it."""

    folder: Path
    manifest: dict
    provider: str  # "CPUExecutionProvider", "CUDAExecutionProvider"
    use_io_binding: bool | None = None
    openvino_precision: str = "auto"


class StepModel(Protocol):
    """The server's side of a decoder runtime: one decoding step over a batch of rows at different lengths."""

    vocab_size: int
    context_length: int  # the longest sequence (prompt and answer) a row may reach
    description: str  # what runs where, for the server's startup line ("" where there is nothing to add)
    # Optional: how the server's prefix cache keeps this model's blocks where the model shares its own (the paged
    # batch's `SharedBlocks`; `PrefixCache.for_model` reads it). Absent: the prefix cache keeps copies.

    def new_batch(self) -> Batch:
        """An empty running batch of this runtime's kind."""

    def prefill_group(self, rows: list[Any], prompts: list[list[int]], prefixes: list[Any] | None = None) -> Prefill:
        """Prompts to prefill together before they join the batch. `prefixes[i]`, where not None, is the cache of
        prompt i's first tokens as the prefix cache's `lookup` gives it ((kv_heads, cached, head_dim) per cache
        tensor, or a `prefix_storage` prefix): only the rest of that prompt is computed."""


class DecoderRuntime(Protocol):
    """One way to run an exported text-generation decoder (a registered class; `load` makes the instance a model
    keeps as `decoder_runtime`)."""

    name: ClassVar[str]  # its key in `DECODER_RUNTIMES`
    engine: ClassVar[str]  # the `engine=` that asks for it: "onnxruntime", "openvino", ...
    # A runtime of an engine other than the default ("onnxruntime", what "auto" falls back to, which needs none of
    # these) is a candidate of `engine="auto"` (`chosen_engine`) and also declares `title`, `auto_reason` and
    # `auto_refusal`:
    title: ClassVar[str]  # the engine's name in logs: "OpenVINO"
    auto_reason: ClassVar[str]  # why `engine="auto"` chooses it where `auto_refusal` is None, for the log
    # Whether the graph takes the cache as tensors, past in and present out (`run`, `run_arrays`: the lean step
    # and a left-padded batch); False where the runtime keeps the cache its own way.
    takes_cache_tensors: ClassVar[bool]

    @classmethod
    def refusal(cls, request: LoadRequest) -> str | None:
        """None where this runtime runs `request`'s export; else why not, with the fix (raised when asked for)."""

    @classmethod
    def auto_refusal(cls, manifest: dict, provider: str) -> str | None:
        """Why `engine="auto"` does not choose this runtime's engine here (None: it does, for being faster). Asked
        only of the runtimes of engines other than the default; raises ImportError where the engine is not
        installed."""

    @classmethod
    def load(cls, model: Any, request: LoadRequest) -> "DecoderRuntime":
        """The runtime of `model` (an `OrtModelForCausalLM`; under an engine other than the default, its ONNX Runtime
        sessions open at their first use: `session.OrtGraph.session`)."""

    @property
    def provider(self) -> str:
        """What `OrtModel.provider` reports: "CPUExecutionProvider", "OpenVINO (bf16)", ..."""

    @property
    def description(self) -> str:
        """One line: what runs where (the server's startup line, benchmark results)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Any,
        position_ids: Any,
        past: list[torch.Tensor],
        logits_to_keep: int | torch.Tensor,
        cache: Any,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`OrtModelForCausalLM.forward`'s call in transformers' layout: the logits and the present cache tensors.
        `cache` is the `DynamicCache` being filled (None without `use_cache`), for runtimes that keep buffers."""

    def run(
        self, inputs: dict[str, torch.Tensor], past: list[torch.Tensor], buffers: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One call of the graph on prepared inputs and the past tensors: logits (batch, sequence, vocab), present."""

    def run_arrays(
        self, inputs: dict[str, torch.Tensor], past: list[np.ndarray]
    ) -> tuple[torch.Tensor, list[np.ndarray]]:
        """`run` with the cache as numpy arrays (the CPU's lean step and left-padded batch)."""

    def sample(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
    ) -> torch.Tensor | None:
        """The runtime's own greedy/sampling loop for `generate` (the cache held for the whole call), or None to
        leave the call to the model's lean loop over `run` (or `forward`)."""

    def step_model(self) -> StepModel:
        """The server's step model, which makes this runtime's batches."""
