"""Calibrated 4-bit weights for `MatMulNBits`: the same graph, node types, block size and kernel as round to nearest
(RTN), so the same size and speed, with each block's integers, scale and zero point chosen to keep each layer's
output, not each weight, close to float32.

A layer computes x @ W; a rounding error E on W changes its output by x @ E, whose size over text is the quadratic
form of E with H = sum of x x^T, the second moments of the layer's input on calibration tokens. RTN ignores H: on a
checkpoint whose weights already sit on a 4-bit grid with a float offset per block (SmolLM2-135M-Instruct, shipped as
Q4_1), its integer zero point shifts every weight of a block by the same amount, errors that add up in the product.

- `search`: per block and output column, the scale and zero point among RTN's and a few around it (`SCALE_FACTORS`,
  `ZERO_SHIFTS`) whose error is smallest in the block's own H; then round to nearest on that grid. It only picks
  among grids, so it cannot fit the calibration text's peculiarities.
- `gptq` (Frantar et al., 2022): rows are quantized in order and each row's error is spread over the rows not yet
  quantized, with all of H. Its error on the calibration text is far smaller, but on other text it can be larger
  than RTN's when the calibration text is narrow (docs/results/int4_quality.md).

    hessians = calibrate({"model": folder / "model.onnx"}, calibration_windows(folder))
    quantize_graph(folder / "model.onnx", replace(format, method="search"), hessians["model"])

The calibration text is the package's own corpus (`vaswani/data/corpus.txt`; nothing downloads), tokenized with the
export's tokenizer; `calibration_windows(folder, text)` takes another one.
"""

import tempfile
from collections.abc import Iterable
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


def calibration_windows(
    folder: Path | None, text: str | None = None, tokens: int = CALIBRATION_TOKENS
) -> list[np.ndarray]:
    """The first `tokens` tokens of the calibration text (default: the package's corpus) in windows of
    `CALIBRATION_WINDOW` ([1, window] int64 each), tokenized with the tokenizer in `folder`."""
    from transformers import AutoTokenizer

    if text is None:
        from ...data import corpus_text

        text = corpus_text()
    try:
        if folder is None:
            raise OSError("the model was given as an object, not a saved folder")
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"Calibrated int4 quantization tokenizes calibration text with the model's tokenizer, and there is none "
            f"({error}). Export from a saved folder with its tokenizer files, or use int4_method='rtn'."
        ) from error
    text = text[: tokens * 16]  # enough characters for `tokens` tokens
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    windows = [ids[start : start + CALIBRATION_WINDOW] for start in range(0, len(ids), CALIBRATION_WINDOW)]
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
            raise ValueError(f"Calibration cannot feed graph input {name!r}; use int4_method='rtn'.")
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
    sessions, names = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for graph, path in graph_paths.items():
            model = onnx.load(str(path), load_external_data=True)
            names[graph] = weight_matmul_inputs(model)
            outputs = {output.name for output in model.graph.output}
            model.graph.output.extend(
                onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                for name in names[graph]
                if name not in outputs
            )
            probe = Path(scratch) / f"{graph}.onnx"
            onnx.save(model, str(probe), save_as_external_data=True, location=f"{graph}.onnx.data")
            sessions[graph] = ort.InferenceSession(str(probe), options, providers=["CPUExecutionProvider"])
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


def rtn_grid(block: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of a block of rows [rows, N]: the asymmetric scale and integer zero point of round to nearest from
    the block's range (extended to include 0, as ONNX Runtime does, so that 0 is exact)."""
    levels = 2**bits - 1
    low = block.min(dim=0).values.clamp(max=0)
    high = block.max(dim=0).values.clamp(min=0)
    scale = (high - low) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-low / scale).clamp(0, levels)
    return scale, zero


def gptq(weight: np.ndarray, hessian: np.ndarray, block_size: int, bits: int = 4) -> tuple[np.ndarray, ...]:
    """GPTQ of a MatMul weight [K, N] (x @ weight) with block-wise asymmetric grids of `block_size` input rows.

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
                scales[block], zeros[block] = rtn_grid(w[row : row + block_size], bits)
            scale, zero = scales[row // block_size], zeros[row // block_size]
            q = torch.clamp(torch.round(w[row] / scale + zero), 0, levels)
            integers[row] = q.to(torch.uint8)
            error = (w[row] - (q - zero) * scale) / inverse[row, row]
            w[row + 1 : end] -= torch.outer(inverse[row, row + 1 : end], error)
            errors[row - start] = error
        w[end:] -= inverse[start:end, end:].T @ errors
    return integers.numpy(), scales.numpy().astype(np.float32), zeros.numpy().astype(np.uint8)


# Scales tried per block, as multiples of RTN's (1: RTN's own), each with the zero points around RTN's.
SCALE_FACTORS = (0.8, 0.85, 0.9, 0.94, 0.97, 1.0, 1.03, 1.05, 1.0714, 1.1, 1.15, 1.2)
ZERO_SHIFTS = (-1, 0, 1)


def search_grid(block: torch.Tensor, hessian: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of a block of rows [rows, N], the scale and integer zero point (RTN's, or one of `SCALE_FACTORS` x
    `ZERO_SHIFTS` around it) whose rounding error e minimizes e^T H e, H [rows, rows] being the block's second
    moments: the error the block adds to the layer's output on calibration text, not the weights' own error. Errors
    of one sign across a block add up in the product (RTN's integer zero point shifts a whole block by the same
    amount when the weights sit on a 4-bit grid with a float offset, as in a checkpoint that was once Q4_1); this
    objective sees that, a per-weight one does not."""
    levels = 2**bits - 1
    scale_rtn, zero_rtn = rtn_grid(block, bits)
    low = block.min(dim=0).values.clamp(max=0)
    best_loss = torch.full_like(scale_rtn, float("inf"))
    best_scale, best_zero = scale_rtn.clone(), zero_rtn.clone()
    for factor in SCALE_FACTORS:
        scale = scale_rtn * factor
        center = zero_rtn if factor == 1.0 else torch.round(-low / scale)
        for shift in ZERO_SHIFTS:
            zero = (center + shift).clamp(0, levels)
            error = block - (torch.clamp(torch.round(block / scale + zero), 0, levels) - zero) * scale
            loss = ((hessian @ error) * error).sum(dim=0)
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def search_quantize(weight: np.ndarray, hessian: np.ndarray, block_size: int, bits: int = 4) -> tuple[np.ndarray, ...]:
    """Round to nearest on each block's `search_grid` grid. Returns the integers [K, N], scales and zero points
    [K / block_size, N], as `gptq`."""
    levels = 2**bits - 1
    w = torch.tensor(weight, dtype=torch.float32)
    h = torch.tensor(hessian, dtype=torch.float32)
    integers, scales, zeros = [], [], []
    for start in range(0, weight.shape[0], block_size):
        rows = slice(start, start + block_size)
        scale, zero = search_grid(w[rows], h[rows, rows], bits)
        integers.append(torch.clamp(torch.round(w[rows] / scale + zero), 0, levels))
        scales.append(scale)
        zeros.append(zero)
    return (
        torch.cat(integers).to(torch.uint8).numpy(),
        torch.stack(scales).numpy().astype(np.float32),
        torch.stack(zeros).to(torch.uint8).numpy(),
    )


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


def calibrated_node_quantizer(config, hessians: dict[str, np.ndarray], method: str):
    """ONNX Runtime's weight-only node quantizer (`DefaultWeightOnlyQuantizer`, which builds the `MatMulNBits` nodes)
    with `method`'s integers, scales and zero points (`ALGORITHMS`) in place of its round to nearest for each 4-bit
    weight whose input has second moments in `hessians`; anything else (8 bits, inputs not calibrated, K not a
    multiple of the block) keeps RTN."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    class CalibratedQuantizer(DefaultWeightOnlyQuantizer):
        activation: str | None = None

        def quantize_matmul(self, node, graph_stack):
            self.activation = node.input[0]
            return super().quantize_matmul(node, graph_stack)

        def qbits_block_quant(self, fp32weight):
            hessian = hessians.get(self.activation)
            block_size = self.config.block_size
            if self.config.bits != 4 or hessian is None or fp32weight.shape[0] % block_size:
                return super().qbits_block_quant(fp32weight)
            # One thread: these are many small tensor ops, which intra-op threads spin-waiting on a busy machine made
            # 30x slower (a 576 x 3072 weight: 37 s with 2 threads, 1.2 s with one).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                integers, scales, zeros = ALGORITHMS[method](fp32weight, hessian, block_size, bits=4)
            finally:
                torch.set_num_threads(threads)
            return pack_matmul_nbits(integers, scales, zeros, block_size)

    return CalibratedQuantizer(config)


# `INT4_METHODS` (postprocess.py) that calibrate -> the function choosing a weight's integers, scales and zero points.
ALGORITHMS = {"search": search_quantize, "gptq": gptq}
