"""PyTorch's side of validating an export (`validation.py` is ONNX Runtime's): the models compared with, and for decoders
every call's inputs and outputs computed up front, so that the model can be freed before ONNX Runtime loads a graph
as large as itself.
"""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ..modeling import cache_of
from ..runtime.contract import DTYPES, PAST_PLUS_SEQUENCE, padded_mask, positions_from_mask
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
    # A quantized export's error model (`rounding_response`): what rounding every matrix does to this model.
    rounding_response: "RoundingResponse | None" = None


@dataclass(frozen=True)
class RoundingResponse:
    """How far the float model's outputs move when every matrix is rounded to nearest in `bits` (blocks of 32 input
    rows, the head in 8 bits; `simulated_rounding`): the logits' relative RMS error, cosine similarity and top-1
    agreement with the float model, and the worst of each over the states (hidden states); for a decoder also each
    output that validation judges, on validation's own calls (`outputs`)."""

    bits: int
    int8_activations: bool  # each matrix's input rounded to int8 per block too, as MatMulNBits' accuracy level 4 does
    logits_relative_rms: float
    logits_cosine: float
    logits_top1: float
    states_relative_rms: float
    states_cosine: float
    # Output name -> (relative RMS, cosine), the worst over validation's calls (`_causal_lm_references`). Why: the
    # hidden states are no stand-in for the caches. A trained model's residual stream is dominated by a few large
    # channels that rounding barely moves, while the value rows of deep layers nearly cancel on them: on SmolLM2-135M
    # rounding to 4 bits moves the hidden states by 0.18 of their RMS and layer 29's values of a first token by 0.99.
    outputs: dict[str, tuple[float, float]] = field(default_factory=dict)

    def of(self, output: str, is_logits: bool) -> tuple[float, float]:
        """(relative RMS, cosine) of `output` under simulated rounding: measured on that output where `outputs` has
        it, else the logits' or the worst hidden state's."""
        if output in self.outputs:
            return self.outputs[output]
        if is_logits:
            return self.logits_relative_rms, self.logits_cosine
        return self.states_relative_rms, self.states_cosine


def pytorch_references(
    model: PreTrainedModel,
    task: str,
    dtype: str,
    device: str,
    family: str,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
    rounding_bits: int | None = None,
    int8_activations: bool = False,
) -> PyTorchReferences:
    """PyTorch's side of validating an export of `model` (the manifest's `task`, `dtype`, `device` and `family`):
    for decoders every call computed now (the model may go afterwards), for other families the models, run as
    ONNX Runtime's calls are made. `compute_dtype` (default: the export's dtype) is what the runtime computes in:
    bfloat16 for OpenVINO's bf16 run of an fp32 graph. `rounding_bits` (quantized exports): also measure the model's
    `rounding_response` to its matrices rounded to that many bits (and their inputs to int8, `int8_activations`)."""
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
    if rounding_bits is not None:
        references.rounding_response = rounding_response(
            reference, family, rounding_bits, int8_activations, seed, references.causal_lm_steps
        )
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


# Blocks of input rows with a scale each, as the exporter's MatMulNBits layout stores every quantized matrix.
ROUNDING_BLOCK = 32
# Output rows of a weight rounded at once by `simulated_rounding`: 16 MB of a 1B model's float32 head.
ROUNDING_ROWS = 2048


def rounding_error(weight: torch.Tensor, bits: int, block: int = ROUNDING_BLOCK) -> torch.Tensor:
    """What rounding `weight` ([out, in]) to nearest in `bits` per block of `block` input columns changes: symmetric
    at 8 bits (the int8 export's), asymmetric with an integer zero point at 4 (the int4 export's layout)."""
    rows, columns = weight.shape
    blocks = torch.nn.functional.pad(weight.float(), (0, -columns % block)).reshape(rows, -1, block)
    if bits == 8:
        scale = (blocks.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
        rounded = (blocks / scale).round().clamp(-128, 127) * scale
    else:
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        scale = ((high - low) / (2**bits - 1)).clamp_min(1e-12)
        zero = (-low / scale).round()
        rounded = ((blocks / scale).round() + zero).clamp(0, 2**bits - 1).sub(zero) * scale
    return (rounded - blocks).reshape(rows, -1)[:, :columns].to(weight.dtype)


def rounded_activations(inputs: torch.Tensor, block: int = ROUNDING_BLOCK) -> torch.Tensor:
    """`inputs` ([..., in]) rounded to int8 per block of `block` values, each block with its own scale: what
    `MatMulNBits` at accuracy level 4 multiplies the weights with."""
    columns = inputs.shape[-1]
    blocks = torch.nn.functional.pad(inputs, (0, -columns % block)).unflatten(-1, (-1, block))
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
    return ((blocks / scale).round() * scale).flatten(-2)[..., :columns]


@contextmanager
def simulated_rounding(model: PreTrainedModel, bits: int, int8_activations: bool = False):
    """While inside, every `nn.Linear` of `model` computes with its weight rounded to nearest in `bits`
    (`rounding_error`; the output head in 8 bits, as exports keep it) and, with `int8_activations`, with its input
    rounded to int8 per block (`rounded_activations`). The rounded weights are made `ROUNDING_ROWS` output rows at a
    time when the layer runs and dropped after: a 1B model's head alone is 1 GB, and an export's peak memory is its
    largest stage's."""
    head = model.get_output_embeddings()

    def rounded(module, inputs, output):
        activations = rounded_activations(inputs[0]) if int8_activations else inputs[0]
        pieces = []
        for start in range(0, module.weight.shape[0], ROUNDING_ROWS):
            weight = module.weight[start : start + ROUNDING_ROWS]
            error = rounding_error(weight, 8 if module is head else bits)
            pieces.append(torch.nn.functional.linear(activations, weight + error))
        product = torch.cat(pieces, dim=-1)
        return product if module.bias is None else product + module.bias

    handles = [module.register_forward_hook(rounded) for module in model.modules() if isinstance(module, nn.Linear)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def rounding_response(
    model: PreTrainedModel,
    family: str,
    bits: int,
    int8_activations: bool = False,
    seed: int = 0,
    causal_lm_steps: list[dict] | None = None,
) -> RoundingResponse:
    """`model`'s outputs on random tokens (batch 3, 12 tokens), float and under `simulated_rounding` in `bits`; for a
    text-generation decoder also each output of validation's calls (`causal_lm_steps`, the float side that
    `pytorch_references` computed with the same `seed`) beside the same calls rounded.

    Why: quantization error compounds through the layers by as much as the model amplifies a perturbation, which its
    weights decide: a trained 30-layer model keeps int8's rounding near its per-matrix size in the logits, a deep
    model with random weights multiplies it thirtyfold. Measured on the float model itself, in PyTorch, this response
    says how far an honest quantized graph of this model may land from it."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = random_ids(3, 12, model.config.vocab_size, generator).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if family == "seq2seq":
        inputs["decoder_input_ids"] = random_ids(3, 12, model.config.vocab_size, generator).to(device)
    runs = []
    with torch.no_grad():
        for rounded in (False, True):
            with simulated_rounding(model, bits, int8_activations) if rounded else nullcontext():
                outputs = model(**inputs, output_hidden_states=True)
            states = [outputs.get(name) for name in ("last_hidden_state", "encoder_last_hidden_state")]
            states += list(outputs.get("hidden_states") or ()) + list(outputs.get("decoder_hidden_states") or ())
            runs.append((outputs.get("logits"), [state for state in states if state is not None]))
    (clean_logits, clean_states), (noisy_logits, noisy_states) = runs

    states = [_relative_rms_and_cosine(clean, noisy) for clean, noisy in zip(clean_states, noisy_states)]
    states = states or [(0.0, 1.0)]
    logits = _relative_rms_and_cosine(clean_logits, noisy_logits) if clean_logits is not None else max(states)
    top1 = (
        (clean_logits.argmax(-1) == noisy_logits.argmax(-1)).double().mean().item()
        if clean_logits is not None and clean_logits.dim() == 3
        else 1.0
    )
    per_output = {}
    if causal_lm_steps is not None:
        per_output = _causal_lm_response(model, causal_lm_steps, bits, int8_activations, seed, str(device))
    return RoundingResponse(
        bits,
        int8_activations,
        logits_relative_rms=logits[0],
        logits_cosine=logits[1],
        logits_top1=top1,
        states_relative_rms=max(relative for relative, _ in states),
        states_cosine=min(cosine for _, cosine in states),
        outputs=per_output,
    )


def _causal_lm_response(
    model: PreTrainedModel, clean: list[dict], bits: int, int8_activations: bool, seed: int, device: str
) -> dict[str, tuple[float, float]]:
    """Each output of validation's calls (`clean`, from `_causal_lm_references` with `seed`), beside the same calls
    (the same tokens) under `simulated_rounding`: output name -> the worst (relative RMS, cosine) over the calls, at
    real tokens only."""
    with torch.no_grad(), simulated_rounding(model, bits, int8_activations):
        noisy = _causal_lm_references([model], torch.Generator().manual_seed(seed), device)
    worst: dict[str, tuple[float, float]] = {}
    for clean_step, noisy_step in zip(clean, noisy):
        for name, expected in clean_step["results"][0].items():
            axis, mask = (1, "sequence") if name == "logits" else (2, PAST_PLUS_SEQUENCE)  # the axis along tokens
            tokens = clean_step["masks"][mask]
            keep = tokens[:, tokens.shape[1] - expected.shape[axis] :].bool().to(expected.device)
            actual = noisy_step["results"][0][name]
            relative, cosine = _relative_rms_and_cosine(expected.movedim(axis, 1)[keep], actual.movedim(axis, 1)[keep])
            before = worst.get(name, (0.0, 1.0))
            worst[name] = (max(before[0], relative), min(before[1], cosine))
    return worst


def _relative_rms_and_cosine(expected: torch.Tensor, actual: torch.Tensor) -> tuple[float, float]:
    expected, actual = expected.double().flatten(), actual.double().flatten()
    relative = ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()
    return relative, torch.nn.functional.cosine_similarity(actual, expected, dim=0).item()


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
