"""Where the per-matrix bounds come from (`matmul_check.MATMUL_BOUNDS`) and how well the end-to-end error model
(each scheme's `rounding_bits`, `vaswani/quantization/schemes.py`) predicts honest exports: every quantized matrix of honest int8/int4 graphs, fed the float
graph's own activations, beside the same graphs with one matrix broken (first, middle or last; scales times 1.25,
doubled or zeroed), and each model's logits error against its response to simulated rounding.

Models: the suite's tiny random decoders and encoder-decoder, and with `--model NAME=FOLDER` any transformers or
vaswani folder (SmolLM2-135M-Instruct trained; `benchmarks/reference_shapes.py` builds at a trained model's scales).
The graphs are quantized as `export_onnx` quantizes them at default options, less the int4 8-bit budget (which only
chooses which matrices get 8 bits, and needs calibration text): each matrix is judged by its own bits.

    python -m benchmarks.matmul_bounds --model smollm2-135m=/tmp/smollm2-135m --json docs/results/matmul_validation.json \
        --markdown docs/results/matmul_validation.md

writes the raw errors (JSON) and the page rendered from them (benchmarks/results/, table maker `matmul_bounds`).
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

from benchmarks.provenance import command_line, machine
from benchmarks.quantized_validation_bounds import random_models
from benchmarks.results.pages import write
from vaswani.export import OnnxValidationError, export_onnx
from vaswani.quantization import Quantization
from vaswani.quantization.matmul_check import quantized_matmul_errors, record_graphs
from vaswani.quantization.matmul_nbits import quantize_graph
from vaswani.runtime.contract import save_graph

CORRUPTIONS = {"scales x1.25": 1.25, "scales doubled": 2.0, "scales zeroed": 0.0}


def break_one_matrix(folder: Path, graph_file: str, position: str, factor: float) -> str:
    """Scale the `position` (first, middle, last) body MatMulNBits node's scales by `factor` in place (the head is
    left alone); returns the node's name."""
    graph = onnx.load(str(folder / graph_file), load_external_data=True)
    initializers = {tensor.name: tensor for tensor in graph.graph.initializer}
    nodes = [node for node in graph.graph.node if node.op_type == "MatMulNBits"]
    body = nodes[:-1] if graph_file != "encoder_model.onnx" else nodes
    node = body[{"first": 0, "middle": len(body) // 2, "last": len(body) - 1}[position]]
    scales = initializers[node.input[2]]
    values = onnx.numpy_helper.to_array(scales) * np.float32(factor)
    scales.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), scales.name))
    for stale in folder.glob(f"{graph_file}*"):
        stale.unlink()
    save_graph(graph, folder / graph_file)
    return node.name


def rows_of(rows) -> list[dict]:
    return [
        {"graph": row.graph, "weight": row.weight, "bits": row.bits, "relative_rms": row.relative_rms} for row in rows
    ]


def measure(name: str, source, work: Path) -> dict:
    task = "text2text-generation" if "seq2seq" in name else "text-generation"
    float_folder = export_onnx(source, work / f"{name}-fp32", task, validate=False, overwrite=True).folder
    recordings = record_graphs(float_folder)
    measured = {}
    for quantize in ("int8", "int4"):
        quantized = work / f"{name}-{quantize}"
        shutil.copytree(float_folder, quantized, dirs_exist_ok=True)
        honest, broken = [], []
        for graph, recorded in recordings.items():
            file = f"{graph}_model.onnx" if graph != "model" else "model.onnx"
            quantize_graph(quantized / file, Quantization.of(quantize, **({"eight_bit_budget": 0.0} if quantize == "int4" else {})))
            honest += rows_of(quantized_matmul_errors(quantized / file, recorded, graph))
            for position in ("first", "middle", "last"):
                for how, factor in CORRUPTIONS.items():
                    copy = work / f"{name}-{quantize}-broken"
                    shutil.rmtree(copy, ignore_errors=True)
                    shutil.copytree(quantized, copy)
                    node = break_one_matrix(copy, file, position, factor)
                    rows = quantized_matmul_errors(copy / file, recorded, graph)
                    row = next(row for row in rows if f"{row.matmul}_Q{row.bits}" == node)
                    broken.append({"position": f"{graph} {position}", "how": how, **rows_of([row])[0]})
        measured[quantize] = {"honest": honest, "broken": broken, **end_to_end(source, work / f"{name}-{quantize}-validated", task, quantize)}
        print(f"{name} {quantize}: worst honest {max(row['relative_rms'] for row in honest):.4f}")
    return measured


def end_to_end(source, output: Path, task: str, quantize: str) -> dict:
    """The export as `export_onnx` makes it (validated): the logits' relative RMS against float32 beside the float
    model's response to simulated rounding, whatever the verdict."""
    try:
        report = export_onnx(source, output, task, quantize=quantize, overwrite=True).validation
    except OnnxValidationError as failure:
        report = failure.report
    logits = next(row for row in report.rows if row.output == "logits")
    response = report.rounding_response
    return {
        "logits_relative_rms": logits.relative_rms,
        "response_logits_relative_rms": response.logits_relative_rms,
        "bits": response.bits,
        "passed": report.passed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=[], help="NAME=FOLDER, a model folder to measure too")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    sources = {}
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        for name, model in random_models().items():
            model.save_pretrained(work / name.replace(" ", "-"))
            sources[name.replace(" ", "-")] = work / name.replace(" ", "-")
        sources.update(dict(entry.split("=", 1) for entry in arguments.model))
        raw = {name: measure(name, source, work) for name, source in sources.items()}
    results = {
        "title": "Quantized validation, matrix by matrix: honest graphs against one broken matrix",
        "command": command_line(),
        "machine": machine(threads=2),
        "tables_from": "matmul_bounds",
        "raw": raw,
    }
    print(write(results, arguments.json, arguments.markdown))


if __name__ == "__main__":
    main()
