"""PyTorch's side of validating an export (`validation.py` is ONNX Runtime's): the models compared with, and for decoders
every call's inputs and outputs computed up front, so that the model can be freed before ONNX Runtime loads a graph
as large as itself.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
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
    # A quantized export's error model (`rounding_response`): what rounding noise in every matrix does to this model.
    rounding_response: "RoundingResponse | None" = None


@dataclass(frozen=True)
class RoundingResponse:
    """How far the float model's outputs move when every linear layer's output is perturbed by random noise of
    relative RMS `noise` (what a quantized matrix's honest rounding does to its output): the logits' relative RMS
    error, cosine similarity and top-1 agreement with the unperturbed model, and the worst of each over the states
    (caches, hidden states)."""

    noise: float
    logits_relative_rms: float
    logits_cosine: float
    logits_top1: float
    states_relative_rms: float
    states_cosine: float


def pytorch_references(
    model: PreTrainedModel,
    task: str,
    dtype: str,
    device: str,
    family: str,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
    rounding_noise: float | None = None,
) -> PyTorchReferences:
    """PyTorch's side of validating an export of `model` (the manifest's `task`, `dtype`, `device` and `family`):
    for decoders every call computed now (the model may go afterwards), for other families the models, run as
    ONNX Runtime's calls are made. `compute_dtype` (default: the export's dtype) is what the runtime computes in:
    bfloat16 for OpenVINO's bf16 run of an fp32 graph. `rounding_noise` (quantized exports): also measure the model's
    `rounding_response` to that much noise in every matrix."""
    compute_dtype = compute_dtype or DTYPES[dtype]
    reference = cast_model(task_model(model, task), compute_dtype, device)
    models = [reference]
    if compute_dtype in (torch.float16, torch.bfloat16):  # the float32 model beside it measures what 16 bits lose
        models.append(cast_model(task_model(model, task), torch.float32, device))
    references = PyTorchReferences(reference.config, models, device)
    if rounding_noise is not None:
        references.rounding_response = rounding_response(reference, family, rounding_noise, seed)
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


@contextmanager
def rounding_noise(model: nn.Module, relative_rms: float, generator: torch.Generator):
    """While inside, every `nn.Linear` of `model` adds Gaussian noise of `relative_rms` times its output's RMS."""

    def add_noise(module, inputs, output):
        noise = torch.randn(output.shape, generator=generator, dtype=output.dtype).to(output.device)
        return output + relative_rms * output.pow(2).mean().sqrt() * noise

    handles = [module.register_forward_hook(add_noise) for module in model.modules() if isinstance(module, nn.Linear)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def rounding_response(model: PreTrainedModel, family: str, noise: float, seed: int = 0) -> RoundingResponse:
    """`model`'s outputs on random tokens (batch 3, 12 tokens), with and without `rounding_noise` at `noise`.

    Why: quantization error compounds through the layers by as much as the model amplifies a perturbation, which
    depends on its weights: a trained 30-layer model turns int8's per-matrix rounding (relative RMS ~0.01) into logits
    off by ~0.02, a deep model with random weights into ~0.3. Measured on the float model itself, this response says
    how far an honest quantized graph of this model may land from it."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = random_ids(3, 12, model.config.vocab_size, generator).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if family == "seq2seq":
        inputs["decoder_input_ids"] = random_ids(3, 12, model.config.vocab_size, generator).to(device)
    runs = []
    with torch.no_grad():
        for perturbed in (False, True):
            with rounding_noise(model, noise if perturbed else 0.0, generator):
                outputs = model(**inputs, output_hidden_states=True)
            states = [outputs.get(name) for name in ("last_hidden_state", "encoder_last_hidden_state")]
            states += list(outputs.get("hidden_states") or ()) + list(outputs.get("decoder_hidden_states") or ())
            runs.append((outputs.get("logits"), [state for state in states if state is not None]))
    (clean_logits, clean_states), (noisy_logits, noisy_states) = runs

    def compare(expected: torch.Tensor, actual: torch.Tensor) -> tuple[float, float]:
        expected, actual = expected.double().flatten(), actual.double().flatten()
        relative = ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()
        return relative, torch.nn.functional.cosine_similarity(actual, expected, dim=0).item()

    states = [compare(clean, noisy) for clean, noisy in zip(clean_states, noisy_states)] or [(0.0, 1.0)]
    logits = compare(clean_logits, noisy_logits) if clean_logits is not None else max(states)
    top1 = (
        (clean_logits.argmax(-1) == noisy_logits.argmax(-1)).double().mean().item()
        if clean_logits is not None and clean_logits.dim() == 3
        else 1.0
    )
    return RoundingResponse(
        noise,
        logits_relative_rms=logits[0],
        logits_cosine=logits[1],
        logits_top1=top1,
        states_relative_rms=max(relative for relative, _ in states),
        states_cosine=min(cosine for _, cosine in states),
    )


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
