"""Convert transformers' own checkpoints into vaswani models and back: configs, weights, whole folders.

Where things are:

- One module per source architecture, each holding its config mapping both ways, its weight-name table and the
  transformers classes it covers: `llama.py` (LLaMA, with Mistral and Qwen2 as variants), `gpt2.py`, `bert.py`,
  `bart.py`, `t5.py`.
- `architecture.py`: what an architecture module provides (`Architecture`, the `Renames` table format) and the
  helpers they share (`rename_weights` reads a table in either direction, so a rename is written once).
- `registry.py`: the one place where architecture modules are registered (`ARCHITECTURES` by `model_type`,
  `TARGET_CLASSES` by transformers class name).
- `in_memory.py`: models in memory, `from_transformers` / `to_transformers`, and `check_convertible`, which lists
  every field of a vaswani model that a target architecture cannot express.
- `parity.py`: `measure_parity`, the check a converted model must pass.
- `convert.py`: `convert_checkpoint`, whole folders (safetensors, generation config, tokenizer), written only once
  the saved copy passes the parity check; `load_converted`, a transformers folder converted in memory (weights
  shared) and checked, for the ONNX export of a transformers folder.

A new architecture (Phi, Gemma, ...) is one new module beside `llama.py` (copy the shape of the closest one) and one
entry in `registry.ARCHITECTURE_MODULES`; a variant of an existing one (as Mistral is of LLaMA) is an entry in that
module's `ARCHITECTURES` and `TARGET_CLASSES`.

This package needs neither `onnx` nor `onnxruntime`.

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from vaswani.conversion.checkpoints import from_transformers, to_transformers
    >>> llama = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
    ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    >>> model = from_transformers(llama)  # a VaswaniForCausalLM with the same logits
    >>> type(to_transformers(model)).__name__  # and back (the architecture is inferred: rope -> llama)
    'LlamaForCausalLM'

Whole folders, tokenizer included, with a parity check before anything is written:

    >>> convert_checkpoint("llama-folder", "vaswani-folder")  # doctest: +SKIP
    >>> convert_checkpoint("vaswani-folder", "llama-again", reverse="llama")  # doctest: +SKIP
"""

from .convert import convert_checkpoint, load_converted
from .in_memory import check_convertible, from_transformers, infer_architecture, to_transformers
from .parity import PARITY_TOLERANCE, Parity, ParityError, measure_parity
from .registry import ARCHITECTURES, TARGET_CLASSES

__all__ = [
    "ARCHITECTURES",
    "PARITY_TOLERANCE",
    "TARGET_CLASSES",
    "Parity",
    "ParityError",
    "check_convertible",
    "convert_checkpoint",
    "from_transformers",
    "infer_architecture",
    "load_converted",
    "measure_parity",
    "to_transformers",
]
