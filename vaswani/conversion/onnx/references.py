"""PyTorch's side of validating an export (`validation.py` is ONNX Runtime's): the models compared with, and for decoders
every call's inputs and outputs computed up front, so that the model can be freed before ONNX Runtime loads a graph
as large as itself.
"""

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ...modeling import cache_of
from .contract import DTYPES, PAST_PLUS_SEQUENCE, padded_mask, positions_from_mask
from .tasks import cast_model, task_model


@dataclass
class PyTorchReferences:
    """PyTorch's side of a validation (`pytorch_references`): the models compared with, and for decoders every call's
    inputs and outputs, computed before ONNX Runtime loads a graph, so that the model need not stay in memory beside
    it (`export_onnx` frees a model it loaded itself: a 1B model is 5 GB, as is its graph)."""

    config: object
    models: list
    device: str
    causal_lm_steps: list[dict] | None = None


def pytorch_references(
    model: PreTrainedModel,
    task: str,
    dtype: str,
    device: str,
    family: str,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
) -> PyTorchReferences:
    """PyTorch's side of validating an export of `model` (the manifest's `task`, `dtype`, `device` and `family`):
    for decoders every call computed now (the model may go afterwards), for other families the models, run as
    ONNX Runtime's calls are made. `compute_dtype` (default: the export's dtype) is what the runtime computes in:
    bfloat16 for OpenVINO's bf16 run of an fp32 graph."""
    compute_dtype = compute_dtype or DTYPES[dtype]
    reference = cast_model(task_model(model, task), compute_dtype, device)
    models = [reference]
    if compute_dtype in (torch.float16, torch.bfloat16):  # the float32 model beside it measures what 16 bits lose
        models.append(cast_model(task_model(model, task), torch.float32, device))
    references = PyTorchReferences(reference.config, models, device)
    if family != "seq2seq" and task == "text-generation":
        with torch.no_grad():
            references.causal_lm_steps = _causal_lm_references(models, torch.Generator().manual_seed(seed), device)
        references.models = []
    return references


def _causal_lm_references(models, generator, device) -> list[dict]:
    """Every call of a decoder's validation, driven like generate, with each model's outputs (its own cache)."""
    vocab, steps = models[0].config.vocab_size, []
    for batch, lengths in ((3, (7, 5, 1)), (1, (1,))):
        mask = torch.zeros(batch, 0, dtype=torch.long)
        caches = [None] * len(models)
        for length in lengths:
            new_mask = (
                padded_mask(batch, length, right=False)
                if not mask.shape[1]
                else torch.ones(batch, length, dtype=torch.long)
            )
            mask = torch.cat([mask, new_mask], dim=1)
            inputs = {
                "input_ids": random_ids(batch, length, vocab, generator),
                "attention_mask": mask,
                "position_ids": positions_from_mask(mask)[:, -length:],
            }
            results = []
            for index, model in enumerate(models):
                outputs = model(**on_device(device, inputs), cache=caches[index], use_cache=True)
                caches[index] = cache_of(outputs)
                present = {name: tensor.clone() for name, tensor in named_cache("present", caches[index]).items()}
                results.append({"logits": outputs.logits, **present})
            steps.append(
                {
                    "batch": batch,
                    "first": len(steps) == 0 or steps[-1]["batch"] != batch,
                    "inputs": inputs,
                    "case": f"batch {batch}, past {mask.shape[1] - length}, new {length}",
                    "masks": {"sequence": mask, PAST_PLUS_SEQUENCE: mask},
                    "results": results,
                }
            )
    return steps


def named_cache(prefix: str, cache: Cache) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.{layer}.{kind}": tensor
        for layer, layer_cache in enumerate(cache.layers)
        for kind, tensor in (("key", layer_cache.keys), ("value", layer_cache.values))
    }


def random_ids(batch: int, length: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def on_device(device: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.to(device) for name, tensor in tensors.items()}
