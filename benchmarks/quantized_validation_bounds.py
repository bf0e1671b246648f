"""Where the quantized validation bounds come from (each scheme's `logits_bounds` and `states_bounds`, `vaswani/quantization/schemes.py`): the relative RMS error, cosine
similarity and top-1 agreement of honest int8/int4 exports against PyTorch, next to the same exports with their
`MatMulNBits` scales zeroed or doubled, or their zero points swapped between blocks.

Honest exports: small random decoders and an encoder-decoder shaped like the test suite's (rope + grouped-query,
learned positions, T5-style relative positions; 2 layers, where rounding error is largest relative to the signal),
and, with `--model`, a trained checkpoint at default options (SmolLM2-135M-Instruct, see README "A real checkpoint").
Each export is validated with bounds wide open, so every metric is recorded whatever it is.

    python -m benchmarks.quantized_validation_bounds --model /tmp/smol/vaswani --output docs/results/quantized_validation

writes OUTPUT.json (every measurement, under `raw`, and the table) and OUTPUT.md (rendered from the JSON by
benchmarks/results/). `--from-json OUTPUT.json` makes the table again from the measurements in that file.
"""

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from benchmarks.provenance import command_line, machine
from benchmarks.results.pages import write
from vaswani import (
    VaswaniDecoderConfig,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniSeq2SeqConfig,
)
from vaswani.export import export_onnx
from vaswani.export.validation import validate_onnx_export
from vaswani.quantization import SCHEMES, QuantizedBounds, scheme_named

OPEN = QuantizedBounds(relative_rms=float("inf"), cosine=-1.0, top1=0.0)
SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def random_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "decoder rope gqa": VaswaniForCausalLM(
            VaswaniDecoderConfig(**SMALL, num_key_value_heads=2, position_embedding_type="rope")
        ),
        "decoder learned": VaswaniForCausalLM(VaswaniDecoderConfig(**SMALL, position_embedding_type="learned")),
        "seq2seq relative": VaswaniForConditionalGeneration(
            VaswaniSeq2SeqConfig(**SMALL, encoder_layers=2, position_embedding_type="relative_bias")
        ),
    }


def corrupt(folder: Path, how: str) -> None:
    """Rewrite every graph of `folder` with its MatMulNBits scales zeroed or doubled, or its zero points swapped
    between neighbouring output columns."""
    for path in folder.glob("*.onnx"):
        graph = onnx.load(str(path))
        initializers = {tensor.name: tensor for tensor in graph.graph.initializer}
        for node in graph.graph.node:
            if node.op_type != "MatMulNBits":
                continue
            index = 3 if how == "swapped zero points" else 2
            if len(node.input) <= index or node.input[index] not in initializers:
                continue
            tensor = initializers[node.input[index]]
            values = numpy_helper.to_array(tensor)
            if how == "zeroed scales":
                values = np.zeros_like(values)
            elif how == "doubled scales":
                values = values * 2
            else:  # each output column gets its neighbour's zero points (stored column by column)
                columns = next(attribute.i for attribute in node.attribute if attribute.name == "N")
                values = np.roll(values.reshape(columns, -1), 1, axis=0).reshape(values.shape)
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
        onnx.save(graph, str(path), save_as_external_data=len(graph.SerializeToString()) > 1_500_000_000)


def measure(folder: Path, model: torch.nn.Module, quantization: str) -> list[dict]:
    saved = scheme_named(quantization)
    SCHEMES[saved.key] = dataclasses.replace(saved, logits_bounds=OPEN, states_bounds=OPEN)
    try:
        report = validate_onnx_export(folder, model, tolerance=float("inf"))
    finally:
        SCHEMES[saved.key] = saved
    return [
        {
            "output": f"{row.graph}/{row.output}",
            "relative_rms": row.relative_rms,
            "cosine": row.cosine,
            "top1": row.top1,
        }
        for row in report.rows
    ]


def run(models: dict[str, Path | torch.nn.Module], work: Path) -> list[dict]:
    results = []
    for name, source in models.items():
        if isinstance(source, torch.nn.Module):
            folder = work / name.replace(" ", "-")
            source.save_pretrained(folder)
            model = source
        else:
            folder, model = source, VaswaniForCausalLM.from_pretrained(source)
        task = "text2text-generation" if "seq2seq" in name else "text-generation"
        for quantize in ("int8", "int4"):
            output = work / f"{folder.name}-{quantize}"
            start = time.perf_counter()
            export_onnx(folder, output, task=task, quantize=quantize, validate=False, overwrite=True)
            quantization = f"{quantize}-weight-only"
            kinds = ["honest", "zeroed scales", "doubled scales"] + (
                ["swapped zero points"] if quantize == "int4" else []
            )
            for kind in kinds:
                if kind != "honest":
                    corrupted = work / f"{output.name}-{kind.replace(' ', '-')}"
                    shutil.copytree(output, corrupted, dirs_exist_ok=True)
                    corrupt(corrupted, kind)
                rows = measure(output if kind == "honest" else corrupted, model, quantization)
                results.append({"model": name, "quantization": quantization, "graph": kind, "rows": rows})
                worst = max(rows, key=lambda row: row["relative_rms"])
                print(f"{name:22s} {quantize} {kind:20s} worst rel RMS {worst['relative_rms']:.4f} ({worst['output']})")
            print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return results


def results_page(measured: list[dict], command: str, described: dict | None) -> dict:
    """The page's results: the measurements as `raw`, from which benchmarks/results/ computes the table."""
    return {
        "title": "Quantized validation: honest exports against corrupted ones",
        "command": command,
        "machine": described,
        "notes": [
            "Per export: the logits' relative RMS error against PyTorch (RMS of the difference over RMS of PyTorch's "
            "logits, worst validation case), their lowest cosine similarity and their top-1 agreement, then the same "
            "for the states (caches, encoder outputs; the worst one named). Validation feeds random tokens. The bounds "
            "of each scheme in `vaswani/quantization/schemes.py` (and docs/deployment.md) sit between the "
            "honest rows and the corrupted ones."
        ],
        # The table is computed from these measurements when the page is rendered (results.quantized_validation_tables).
        "tables_from": "quantized_validation",
        "raw": measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a trained vaswani causal-LM folder to measure at defaults too")
    parser.add_argument("--output", type=Path, required=True, help="writes OUTPUT.json and OUTPUT.md")
    parser.add_argument("--from-json", type=Path, help="make the table again from this file's measurements (no run)")
    parser.add_argument("--command", help="with --from-json: the command that measured them, if the file lacks it")
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json is not None:
        previous = json.loads(args.from_json.read_text())
        if isinstance(previous, list):  # the measurements alone, as the first run wrote them
            previous = {"raw": previous, "command": args.command, "machine": None}
        command = previous["command"] or args.command
        page = results_page(previous["raw"], command, previous["machine"])
    else:
        models: dict = random_models()
        if args.model is not None:
            models[args.model.name] = args.model
        with tempfile.TemporaryDirectory() as work:
            measured = run(models, Path(work))
        command = command_line()
        page = results_page(measured, command, machine(torch.get_num_threads(), shared=False))
    write(page, args.output.with_suffix(".json"), args.output.with_suffix(".md"))


if __name__ == "__main__":
    main()
