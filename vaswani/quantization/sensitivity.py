"""Which weight matrices of an int4 export to keep in 8 bits: the ones whose 4-bit rounding costs the model most,
within a byte budget (`Quantization.eight_bit_budget`, 0.3 by default for `quantize="int4"`).

A matrix's cost is its Fisher-weighted rounding error, sum over its weights of F_i * (w_i - q(w_i))^2, where F is
the diagonal Fisher information of the model's own predictions: labels are sampled from the model's softmax, so the
calibration text only supplies inputs, never targets. To second order that sum is twice the KL divergence from the
float model that rounding the matrix adds, so matrices that matter in any layer or shape compare on one scale. The
matrices with the highest score per added byte go to 8 bits until the budget (a fraction of the 4-bit weights'
bytes) is spent. On SmolLM2-135M-Instruct (docs/results/int4_domains.md), a budget of 0.04 left int4 at +5.4% to
+15.2% perplexity over float32 on the five texts that chose the default and +8.2% to +17.4% on five held-out ones;
the default 0.3 (13% more weight bytes read per decode step) at -0.4% to +5.7% and +1.5% to +5.5%.

Scores are computed per output row of each PyTorch `nn.Linear` and looked up in the graph by the row's content, so a
fused (q/k/v, gate/up) or transposed ONNX weight finds the rows it holds:

    >>> windows = calibration_windows(folder, tokens=SCORING_TOKENS, window=SCORING_WINDOW)
    >>> scores = fisher_row_scores(model, windows, block_size=32)
    >>> eight_bit = choose_eight_bit_matmuls(onnx_model, scores, budget=0.3, candidates=names, read=weights.array)
"""

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from .int4 import calibration_windows, row_key

# Tokens of calibration text the Fisher information is estimated on, in windows of this many tokens. The ranking of
# matrices settles by about a thousand tokens (each window's gradient sums many tokens' independent draws).
SCORING_TOKENS = 1024
SCORING_WINDOW = 128
SCORING_SLICE_ELEMENTS = 2**17  # weights per slice when the scores are summed

logger = logging.getLogger(__name__)


def rounding_error(weight: torch.Tensor, bits: int, block_size: int, symmetric: bool) -> torch.Tensor:
    """w - q(w) for round to nearest of a Linear weight [out, in] in blocks of `block_size` inputs per output row
    (MatMulNBits' blocks: one scale, and for asymmetric grids one integer zero point, per block and output), in
    float32 as ONNX Runtime's quantizer computes it: the scorer runs it for every matrix in every calibration window."""
    rows, columns = weight.shape
    padding = -columns % block_size
    blocks = nn.functional.pad(weight.float(), (0, padding)).reshape(rows, -1, block_size)
    if symmetric:
        half = 2 ** (bits - 1)
        scale = blocks.abs().amax(-1, keepdim=True) / half
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        quantized = torch.clamp(torch.round(blocks / scale), -half, half - 1) * scale
    else:
        levels = 2**bits - 1
        low = blocks.amin(-1, keepdim=True).clamp(max=0)
        high = blocks.amax(-1, keepdim=True).clamp(min=0)
        scale = (high - low) / levels
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-low / scale)
        quantized = (torch.clamp(torch.round(blocks / scale + zero), 0, levels) - zero) * scale
    return (blocks - quantized).reshape(rows, -1)[:, :columns]


@contextmanager
def recorded_input_mean_squares(model: nn.Module) -> Iterator[dict[int, np.ndarray]]:
    """While the block runs the model, the mean square of each input feature of every `nn.Linear`; on leaving it, the
    yielded dict maps `row_key` of each of the Linear's weight rows to those [in_features] float32 values (the
    inputs of the fused ONNX weight that holds the row). `int4.search_quantize` weighs rows by them."""
    sums: dict[nn.Linear, list] = {}

    def accumulate(linear: nn.Linear, args: tuple) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
        total = sums.setdefault(linear, [torch.zeros(x.shape[-1], dtype=torch.float64), 0])
        total[0] += x.square().sum(0)
        total[1] += x.shape[0]

    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    hooks = [linear.register_forward_pre_hook(accumulate) for linear in linears]
    by_row: dict[int, np.ndarray] = {}
    try:
        yield by_row
    finally:
        for hook in hooks:
            hook.remove()
    for linear, (total, count) in sums.items():
        mean_squares = (total / count).float().numpy()
        for row in linear.weight.detach().float().numpy():
            by_row[row_key(row)] = mean_squares


def _model_inputs(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One window as the model's inputs: an encoder-decoder reads it on both sides."""
    inputs = {"input_ids": ids}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    return inputs


def fisher_row_scores(
    model: nn.Module, windows: list[np.ndarray], block_size: int, seed: int = 0, symmetric: bool = False
) -> dict[int, float]:
    """Per output row of every `nn.Linear` weight (keyed by `row_key`), how much rounding that row to 4 bits rather
    than 8 adds to the model's loss: sum over the row of F * (e4^2 - e8^2), F the diagonal Fisher information of
    the model's predictive distribution on `windows` ([1, length] token ids each).

    F is estimated per window as the square of the gradient of the log-likelihood of labels drawn from the model's
    own softmax. The draws make each token's gradient zero in expectation, so the square of their sum estimates the
    sum of their squares without bias, at one backward pass per window. `symmetric`: the 4-bit grid has no zero
    point (`int4_symmetric`).
    """
    # Not the LM head: it stays in 8 bits anyway, and its gradient would cost as much as the rest of the backward.
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    weights = list(dict.fromkeys(module.weight for module in linears if module.weight is not head_weight))
    # Per row, sum over windows of sum over the row of g^2 * (e4^2 - e8^2): the Fisher-weighted gain is linear in F,
    # so each window's squared gradient is weighed as it lands and no total of F (the model's size again) is kept.
    gains = [torch.zeros(weight.shape[0], dtype=torch.float64) for weight in weights]
    generator = torch.Generator().manual_seed(seed)
    parameters = list(model.parameters())
    was_training, wanted_grad = model.training, [parameter.requires_grad for parameter in parameters]
    scored = {id(weight) for weight in weights}

    def accumulate(total: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(weight: torch.Tensor) -> None:
            # Each gradient is weighed as the backward pass makes it, then dropped: the whole model's gradients at
            # once would add the model's size again to the peak (5 GB for a 1B model).
            total.add_(_row_gains(weight.detach(), weight.grad.square(), block_size, symmetric))
            weight.grad = None

        return hook

    model.eval()
    hooks = [weight.register_post_accumulate_grad_hook(accumulate(total)) for weight, total in zip(weights, gains)]
    try:
        for parameter in parameters:
            parameter.requires_grad_(id(parameter) in scored)
        with torch.enable_grad():
            for window in windows:
                logits = model(**_model_inputs(model, torch.as_tensor(window))).logits.float()
                logits = logits.reshape(-1, logits.shape[-1])
                labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=generator).squeeze(1)
                nn.functional.cross_entropy(logits, labels, reduction="sum").backward()
    finally:
        for hook in hooks:
            hook.remove()
        for parameter, wanted in zip(parameters, wanted_grad):
            parameter.requires_grad_(wanted)
        model.train(was_training)
    scores: dict[int, float] = {}
    for weight, total in zip(weights, gains):
        for row, score in zip(weight.detach().float().numpy(), total.tolist()):
            key = row_key(row)
            scores[key] = scores.get(key, 0.0) + score  # identical rows (rare): both carry the sum
    return scores


def _row_gains(weight: torch.Tensor, information: torch.Tensor, block_size: int, symmetric: bool) -> torch.Tensor:
    """Per output row of a Linear weight, sum of information * (e4^2 - e8^2): what 4-bit rounding costs over 8-bit."""
    # In slices of rows that stay in the CPU's cache (an 8192 x 2048 weight: 0.07 s on one thread, 0.7 s whole).
    rows = max(1, SCORING_SLICE_ELEMENTS // weight.shape[1])
    gains = []
    for part, part_information in zip(weight.float().split(rows), information.split(rows)):
        four_bits = rounding_error(part, 4, block_size, symmetric=symmetric).square()
        eight_bits = rounding_error(part, 8, block_size, symmetric=True).square()
        gains.append((part_information * (four_bits - eight_bits)).sum(1))
    return torch.cat(gains)


def choose_eight_bit_matmuls(
    model: onnx.ModelProto,
    row_scores: dict[int, float],
    budget: float,
    candidates: list[str],
    read: Callable[[str], np.ndarray],
) -> tuple[list[str], dict[str, float]]:
    """The `candidates` (names of 4-bit weight MatMuls of `model`) to keep in 8 bits: the highest Fisher score per
    added byte first, while the added bytes stay within `budget` times the candidates' 4-bit bytes.

    Returns the chosen names, in order of choice, and every candidate's score (nan where some column of its weight
    is not a row of `row_scores`: such a matrix is never chosen). `read` gives a weight by its initializer's name
    (`GraphWeights.array`).
    """
    nodes = {node.name: node for node in model.graph.node}
    scores, extra_bytes = {}, {}
    for name in candidates:
        weight = read(nodes[name].input[1])  # [K, N]: x @ weight
        columns = [row_scores.get(row_key(column)) for column in weight.T]
        scores[name] = math.nan if None in columns else float(sum(columns))
        extra_bytes[name] = weight.size / 2  # 4 more bits per weight
    allowed = budget * sum(extra_bytes.values())  # the 4-bit weights take half a byte each, as the copies add
    ranked = sorted(
        (name for name in candidates if not math.isnan(scores[name])),
        key=lambda name: scores[name] / extra_bytes[name],
        reverse=True,
    )
    chosen, spent = [], 0.0
    for name in ranked:
        if scores[name] > 0 and spent + extra_bytes[name] <= allowed:
            chosen.append(name)
            spent += extra_bytes[name]
    return chosen, scores


def export_row_scores(
    model: nn.Module,
    folder: Path | None,
    text: str | None,
    budget: float,
    block_size: int,
    explicit: bool,
    say: Callable[[str], None],
    symmetric: bool = False,
) -> tuple[dict[int, float], dict[int, np.ndarray]] | None:
    """`fisher_row_scores` of a model being exported with an 8-bit budget, on calibration text tokenized with the
    tokenizer in `folder`, and the mean squares of every Linear's input over the same pass
    (`recorded_input_mean_squares`); None when the budget cannot be spent: no output head to score, no tokenizer,
    or one whose ids do not fit the model's vocabulary. Then an explicit budget (`explicit`) is a ValueError, and
    the default one says why and leaves every body matrix in 4 bits."""

    def refuse(reason: str) -> None:
        if explicit:
            raise ValueError(
                f"int4_8bit_budget={budget} ranks matrices on calibration text, but {reason}. Export from a saved "
                f"folder with its tokenizer files, or pass int4_8bit_budget=0 (every body matrix in 4 bits)."
            )
        say(f"int4: no 8-bit budget, every body matrix stays 4-bit ({reason})")
        logger.warning("int4: no 8-bit budget, every body matrix stays 4-bit (%s)", reason)

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return refuse("the model has no output head to take predictions from")
    positions = getattr(model.config, "max_position_embeddings", None) or SCORING_WINDOW
    try:
        windows = calibration_windows(folder, text, SCORING_TOKENS, min(SCORING_WINDOW, positions))
    except ValueError:
        return refuse("there is no tokenizer beside the model")
    vocabulary = head.weight.shape[0]
    largest = max(int(window.max()) for window in windows)
    if largest >= vocabulary:
        return refuse(f"the tokenizer's id {largest} is outside the model's vocabulary of {vocabulary}")
    say(f"Scoring int4 sensitivity: Fisher information on {sum(w.shape[1] for w in windows)} calibration tokens")
    with recorded_input_mean_squares(model) as input_mean_squares:
        scores = fisher_row_scores(model, windows, block_size, symmetric=symmetric)
    return scores, input_mean_squares
