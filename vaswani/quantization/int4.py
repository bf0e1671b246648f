"""How the 4-bit weights of an int4 export are chosen (`INT4_METHODS` in scheme.py). Every method stores the
same `MatMulNBits` nodes as ONNX Runtime's round to nearest (RTN): 4-bit integers, one float scale and one 4-bit zero
point per block of `block_size` input rows and output column, so size and decode speed do not depend on the method.

- `rtn`: ONNX Runtime's quantizer: each block's scale and zero point from its range (min and max, 0 included).
- `search` (the default): per block and column, the scale and zero point among RTN's and a few around it
  (`SCALE_FACTORS` x `ZERO_SHIFTS`) whose rounding leaves the smallest squared error, then round to nearest on that
  grid. A block's range is set by its two extreme weights; a slightly narrower or wider grid, or the zero point one
  step over, often fits the other 30 better. No data, a few seconds per model.
- `gptq` (Frantar et al., 2022), calibrated: rows are quantized in order and each row's rounding error is spread
  over the rows not yet quantized, weighted by H = sum of x x^T, the second moments of the layer's input x on
  calibration text (`calibrate`: the float32 graphs run on the package's corpus, `vaswani/data/corpus.txt`, tokenized
  with the export's tokenizer; nothing downloads). It fits the calibration text closely, and generalizes to other
  text only as far as that text resembles it: on SmolLM2-135M-Instruct, calibrated on the corpus's children's
  stories, it loses to RTN on technical prose (docs/results/int4_quality.md).

    hessians = calibrate({"model": folder / "model.onnx"}, calibration_windows(folder))
    quantize_graph(folder / "model.onnx", replace(format, method="gptq"), hessians["model"])
"""

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

# Calibration tokens and window length: a few windows of ordinary text; more tokens barely move the result.
CALIBRATION_TOKENS = 2048
CALIBRATION_WINDOW = 256
# Ridge added to H's diagonal, as a fraction of its mean: keeps H invertible where inputs are (almost) constant.
DAMPING = 0.01
# Input rows updated at once between GPTQ's lazy full updates (only speed, not the result, depends on it).
LAZY_ROWS = 128


def row_key(row: np.ndarray) -> int:
    """A row of float32 weights by content: how statistics gathered on PyTorch's `nn.Linear` rows (Fisher scores,
    input mean squares) find the ONNX weight that holds the row, fused (q/k/v, gate/up) or not."""
    return hash(np.ascontiguousarray(row, dtype=np.float32).tobytes())


def calibration_windows(
    folder: Path | None, text: str | None = None, tokens: int = CALIBRATION_TOKENS, window: int = CALIBRATION_WINDOW
) -> list[np.ndarray]:
    """The first `tokens` tokens of the calibration text (default: the package's corpus) in windows of `window` tokens
    ([1, window] int64 each; at most the model's positions), tokenized with the tokenizer in `folder`."""
    from transformers import AutoTokenizer

    if text is None:
        from ..data import corpus_text

        text = corpus_text()
    try:
        if folder is None:
            raise OSError("the model was given as an object, not a saved folder")
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"int4_method='gptq' tokenizes calibration text with the model's tokenizer, and there is none "
            f"({error}). Export from a saved folder with its tokenizer files, or use int4_method='search' (no data)."
        ) from error
    text = text[: tokens * 16]  # enough characters for `tokens` tokens
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    windows = [ids[start : start + window] for start in range(0, len(ids), window)]
    return [np.array([window], dtype=np.int64) for window in windows if len(window) > 1]


def weight_matmul_inputs(model: onnx.ModelProto) -> list[str]:
    """The activation input of every MatMul whose second input is a weight (an initializer), in graph order."""
    initializers = {tensor.name for tensor in model.graph.initializer}
    names = [node.input[0] for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in initializers]
    return list(dict.fromkeys(names))


def _synthetic_feeds(session: ort.InferenceSession, ids: np.ndarray, earlier: dict[str, np.ndarray]) -> dict:
    """A graph's inputs for one window of token ids: the prompt call of a generation graph (empty past, every
    position's logits), all-ones masks; inputs another graph produced (an encoder's cross keys/values) are taken from
    `earlier`."""
    length = ids.shape[1]
    feeds = {}
    for value in session.get_inputs():
        name = value.name
        if name in earlier:
            feeds[name] = earlier[name]
        elif name == "input_ids":
            feeds[name] = ids
        elif name in ("attention_mask", "encoder_attention_mask"):
            feeds[name] = np.ones((1, length), dtype=np.int64)
        elif name == "position_ids":
            feeds[name] = np.arange(length, dtype=np.int64)[None]
        elif name == "logits_positions":
            feeds[name] = np.arange(length, dtype=np.int64)
        elif name == "token_type_ids":
            feeds[name] = np.zeros((1, length), dtype=np.int64)
        elif name.startswith("past_key_values."):
            shape = [
                1 if axis == 0 else 0 if not isinstance(size, int) else size for axis, size in enumerate(value.shape)
            ]
            feeds[name] = np.zeros(shape, dtype=np.float32)
        else:
            raise ValueError(f"Calibration cannot feed graph input {name!r}; use int4_method='search' (no data).")
    return feeds


def calibrate(
    graph_paths: dict[str, Path], windows: Iterable[np.ndarray], threads: int | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """Per graph, the second moment H = sum over calibration tokens of x x^T (float64 [K, K]) of the input x of every
    weight MatMul, keyed by that input's name; graphs run in the given order (an encoder before its decoder), each
    on the float32 graph with those inputs added as outputs."""
    windows = list(windows)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads or torch.get_num_threads()
    sessions, names, probes = {}, {}, []
    try:
        for graph, path in graph_paths.items():
            # The graph alone, with the MatMuls' inputs as outputs, saved beside the original: its weights stay in
            # the original's weights file, which the probe names (no copy of a model's weights on disk or in memory).
            model = onnx.load(str(path), load_external_data=False)
            names[graph] = weight_matmul_inputs(model)
            outputs = {output.name for output in model.graph.output}
            model.graph.output.extend(
                onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                for name in names[graph]
                if name not in outputs
            )
            probes.append(Path(path).with_name(f".{Path(path).stem}.calibration.onnx"))
            onnx.save(model, str(probes[-1]))
            sessions[graph] = ort.InferenceSession(str(probes[-1]), options, providers=["CPUExecutionProvider"])
    finally:
        for probe in probes:
            probe.unlink(missing_ok=True)
    hessians = {graph: {} for graph in graph_paths}
    for ids in windows:
        earlier: dict[str, np.ndarray] = {}
        for graph, session in sessions.items():
            output_names = [output.name for output in session.get_outputs()]
            results = dict(zip(output_names, session.run(None, _synthetic_feeds(session, ids, earlier))))
            earlier.update(results)
            for name in names[graph]:
                x = results[name].reshape(-1, results[name].shape[-1]).astype(np.float64)
                hessians[graph][name] = hessians[graph].get(name, 0.0) + x.T @ x
    return hessians


def rtn_grid(block: torch.Tensor, bits: int = 4, symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of a block of rows [..., rows, N] (any leading axes: several blocks at once): the scale and integer
    zero point [..., N] of round to nearest from the block's range, as ONNX Runtime's quantizer takes them.
    Asymmetric: the range extended to include 0, so that 0 is exact. Symmetric: the zero point is fixed at the middle
    (8 of 0..15, which `MatMulNBits` assumes when a graph stores none) and the scale is signed, so that the block's
    largest magnitude lands on the wider side of the grid (-8, not 7)."""
    levels = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        high, low = block.amax(dim=-2), block.amin(dim=-2)
        scale = torch.where(high.abs() > low.abs(), high, low) / -half
        scale = torch.where(scale != 0, scale, torch.ones_like(scale))
        return scale, torch.full_like(scale, half)
    low = block.amin(dim=-2).clamp(max=0)
    high = block.amax(dim=-2).clamp(min=0)
    scale = (high - low) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-low / scale).clamp(0, levels)
    return scale, zero


def gptq(
    weight: np.ndarray, hessian: np.ndarray, block_size: int, bits: int = 4, symmetric: bool = False
) -> tuple[np.ndarray, ...]:
    """GPTQ of a MatMul weight [K, N] (x @ weight) with block-wise grids (`rtn_grid`) of `block_size` input rows.

    Returns the integers [K, N] (uint8, 0..2^bits-1), scales and zero points [K / block_size, N]. Each block's grid is
    RTN's, taken from the block's rows as GPTQ has updated them when it reaches the block.
    """
    levels = 2**bits - 1
    rows, columns = weight.shape
    w = torch.tensor(weight, dtype=torch.float64)
    h = torch.tensor(hessian, dtype=torch.float64).clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: their rows do not matter
    h[dead, dead] = 1
    w[dead] = 0
    h += DAMPING * torch.mean(torch.diag(h)) * torch.eye(rows, dtype=torch.float64)
    # Upper Cholesky factor of H^-1: row i holds how quantizing row i moves the rows after it.
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    integers = torch.zeros(rows, columns, dtype=torch.uint8)
    blocks = rows // block_size
    scales = torch.zeros(blocks, columns, dtype=torch.float64)
    zeros = torch.zeros(blocks, columns, dtype=torch.float64)
    for start in range(0, rows, LAZY_ROWS):
        end = min(start + LAZY_ROWS, rows)
        errors = torch.zeros(end - start, columns, dtype=torch.float64)
        for row in range(start, end):
            if row % block_size == 0:
                block = row // block_size
                scales[block], zeros[block] = rtn_grid(w[row : row + block_size], bits, symmetric)
            scale, zero = scales[row // block_size], zeros[row // block_size]
            q = torch.clamp(torch.round(w[row] / scale + zero), 0, levels)
            integers[row] = q.to(torch.uint8)
            error = (w[row] - (q - zero) * scale) / inverse[row, row]
            w[row + 1 : end] -= torch.outer(inverse[row, row + 1 : end], error)
            errors[row - start] = error
        w[end:] -= inverse[start:end, end:].T @ errors
    return integers.numpy(), scales.numpy().astype(np.float32), zeros.numpy().astype(np.uint8)


# Scales tried per block, as multiples of RTN's (1: RTN's own; 15/14: 14 steps over the range), each with the zero
# points around RTN's.
# fmt: off
SCALE_FACTORS = (
    0.7, 0.75, 0.8, 0.84, 0.87, 0.9, 0.92, 0.94, 0.96, 0.98, 1.0, 1.02, 1.04, 1.06, 15 / 14, 1.09, 1.12, 1.15, 1.2, 1.25,
)
# fmt: on
ZERO_SHIFTS = (-1, 0, 1)
# About 1 MiB of float32 weights per slice of `search_quantize` (fastest of 128K-512K elements on a 2048 x 8192
# and an 8192 x 2048 weight).
SEARCH_SLICE_ELEMENTS = 2**18


def search_grid(
    block: torch.Tensor, bits: int = 4, symmetric: bool = False, row_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of a block of rows [..., rows, N] (any leading axes: several blocks at once), the scale and integer
    zero point [..., N], RTN's or one of `SCALE_FACTORS` x `ZERO_SHIFTS` around it, whose round to nearest leaves the
    smallest sum of squared errors, each row's weighted by `row_weights` [..., rows, 1] if given. RTN's own grid is a
    candidate, so no block's error exceeds RTN's. Symmetric grids keep their fixed zero point and search the scale
    only."""
    levels = 2**bits - 1
    scale_rtn, zero_rtn = rtn_grid(block, bits, symmetric)
    low = block.amin(dim=-2).clamp(max=0)
    best_loss = torch.full_like(scale_rtn, float("inf"))
    best_scale, best_zero = scale_rtn.clone(), zero_rtn.clone()
    for factor in SCALE_FACTORS:
        scale = scale_rtn * factor
        center = zero_rtn if factor == 1.0 or symmetric else torch.round(-low / scale)
        for shift in (0,) if symmetric else ZERO_SHIFTS:
            zero = (center + shift).clamp(0, levels)
            grid_scale, grid_zero = scale.unsqueeze(-2), zero.unsqueeze(-2)
            error = (
                block - (torch.clamp(torch.round(block / grid_scale + grid_zero), 0, levels) - grid_zero) * grid_scale
            )
            squares = error.square() if row_weights is None else error.square() * row_weights
            loss = squares.sum(dim=-2)
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def search_quantize(
    weight: np.ndarray,
    block_size: int,
    bits: int = 4,
    symmetric: bool = False,
    input_mean_squares: np.ndarray | None = None,
) -> tuple[np.ndarray, ...]:
    """Round to nearest on each block's `search_grid` grid. Returns the integers [K, N], scales and zero points
    [K / block_size, N], as `gptq`.

    With `input_mean_squares` [K] (of the MatMul's input on calibration text), each row's squared error counts in
    proportion to its input's root mean square: an error on a row that large activations read moves the output
    more. The root, not the mean square itself (the output error's own weight), because the calibration text is
    one domain: on SmolLM2-135M-Instruct the mean square fitted its outlier channels at the cost of code and
    technical prose, the root lowered perplexity on all five domains of benchmarks/int4_domains.py. A floor of
    1% of the mean keeps inputs the text never excited from being ignored."""
    levels = 2**bits - 1
    rows, columns = weight.shape
    # Every block of a slice of columns at once [blocks, block_size, columns]: a few large tensor ops instead of many
    # small ones per block, on slices of about SEARCH_SLICE_ELEMENTS so that the 60 candidates' passes stay in the
    # CPU's cache (columns are independent). The whole matrix at once streamed it from memory in every pass: a
    # 2048 x 8192 weight took 39 s, in slices 2.3 s (one thread).
    blocks = torch.tensor(weight, dtype=torch.float32).reshape(rows // block_size, block_size, columns)
    row_weights = None
    if input_mean_squares is not None:
        rms = torch.tensor(input_mean_squares, dtype=torch.float32).sqrt()
        row_weights = (rms / rms.mean()).clamp(min=0.01).reshape(rows // block_size, block_size, 1)
    width = max(1, SEARCH_SLICE_ELEMENTS // rows)
    integers = torch.empty(blocks.shape, dtype=torch.uint8)
    scales = torch.empty(rows // block_size, columns, dtype=torch.float32)
    zeros = torch.empty(rows // block_size, columns, dtype=torch.uint8)
    for start in range(0, columns, width):
        part = blocks[..., start : start + width]
        scale, zero = search_grid(part, bits, symmetric, row_weights)
        rounded = torch.clamp(torch.round(part / scale.unsqueeze(1) + zero.unsqueeze(1)), 0, levels)
        integers[..., start : start + width] = rounded.to(torch.uint8)
        scales[:, start : start + width], zeros[:, start : start + width] = scale, zero.to(torch.uint8)
    return integers.reshape(rows, columns).numpy(), scales.numpy(), zeros.numpy()


def pack_matmul_nbits(integers: np.ndarray, scales: np.ndarray, zeros: np.ndarray, block_size: int):
    """4-bit integers [K, N], scales and zero points [K / block_size, N] in `MatMulNBits`' layout: B [N, blocks,
    block_size / 2] uint8 (two per byte, the earlier row in the low nibble), scales [N, blocks], zero points [N,
    ceil(blocks / 2)] packed the same way."""
    rows, columns = integers.shape
    blocks = rows // block_size
    q = integers.T.reshape(columns, blocks, block_size // 2, 2)
    packed = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)
    z = zeros.T
    if blocks % 2:
        z = np.concatenate([z, np.full((columns, 1), 8, dtype=np.uint8)], axis=1)  # ONNX Runtime's filler
    packed_zeros = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scales.T), np.ascontiguousarray(packed_zeros)


def unpack_matmul_nbits(packed: np.ndarray, scales: np.ndarray, packed_zeros: np.ndarray, rows: int) -> np.ndarray:
    """The float weight [K, N] a 4-bit `MatMulNBits` computes with: (integer - zero point) * scale."""
    columns, blocks, _ = packed.shape
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(columns, blocks, -1).astype(np.float32)
    z = np.stack([packed_zeros & 0x0F, packed_zeros >> 4], axis=-1).reshape(columns, -1)[:, :blocks].astype(np.float32)
    weight = (q - z[..., None]) * scales.reshape(columns, blocks)[..., None]
    return weight.reshape(columns, -1)[:, :rows].T


def block_quantizer(
    config,
    method: str,
    hessians: dict[str, np.ndarray] | None = None,
    input_mean_squares: dict[int, np.ndarray] | None = None,
) -> Callable[[np.ndarray, str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The `MatMulNBits` tensors (packed B, scales, packed zero points) of a float weight [K, N] whose MatMul reads
    the activation named by the second argument, for ONNX Runtime's `DefaultWeightOnlyQuantConfig` `config`: ONNX
    Runtime's round to nearest, or for 4-bit weights `method`'s integers, scales and zero points (`gptq`: where that
    activation has second moments in `hessians`; `search` weighs rows by `input_mean_squares`, keyed by `row_key` of
    the PyTorch weight rows, which are the ONNX weight's columns). 8-bit weights and K not a multiple of the block
    keep round to nearest."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    round_to_nearest = DefaultWeightOnlyQuantizer(config).qbits_block_quant
    block_size = config.block_size

    def quantize(weight: np.ndarray, activation: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        hessian = (hessians or {}).get(activation)
        if (
            method == "rtn"
            or config.bits != 4
            or weight.shape[0] % block_size
            or (method == "gptq" and hessian is None)
        ):
            return round_to_nearest(weight)
        # Runs on the caller's torch threads (`vaswani export` gives itself one: see set_command_threads).
        symmetric = config.is_symmetric  # then the graph stores no zero points: MatMulNBits assumes 8
        if method == "gptq":
            integers, scales, zeros = gptq(weight, hessian, block_size, bits=4, symmetric=symmetric)
        else:
            mean_squares = (input_mean_squares or {}).get(row_key(weight[:, 0]))
            integers, scales, zeros = search_quantize(weight, block_size, 4, symmetric, mean_squares)
        return pack_matmul_nbits(integers, scales, zeros, block_size)

    return quantize
