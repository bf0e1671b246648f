"""`vaswani export`: a vaswani or transformers model folder to a validated ONNX folder (`export.export_onnx`)."""

import argparse
import sys

from ..quantization.scheme import Quantization, add_quantization_arguments
from .options import add_device_argument, stage_progress

# Ends the process as soon as the command has finished, without the interpreter's teardown (`main.exit_now`).
EXIT_WITHOUT_TEARDOWN = True

DESCRIPTION = (
    "Export a saved vaswani model to an ONNX folder (graphs with external weights, config, tokenizer, "
        "manifest.json describing every input and output) with torch.onnx.export(dynamo=True). A transformers folder "
        "is converted in memory first, as `vaswani convert` would (same graphs, no intermediate folder), and must "
        "match the transformers model on a left-padded batch (max abs diff <= 1e-4). Every graph is then "
        "run by ONNX Runtime on fresh shapes and padded batches and compared with PyTorch; the table of max abs "
        "differences ends the output. The folder is built beside OUT and moved into place only when it validates."
)
EPILOG = (
    "exit status: 0 exported and validated; 1 the converted transformers model or ONNX Runtime disagrees "
        "with PyTorch beyond the tolerance (nothing is written); 2 bad input (missing folder, unsupported "
        "architecture or task, non-empty output without --overwrite)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `vaswani export`."""
    parser.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="the model folder (save_pretrained): a vaswani one, or a transformers one (LLaMA, Mistral, Qwen2, "
        "GPT-2, BERT, BART, T5), converted in memory and checked against it before the export",
    )
    parser.add_argument(
        "--task",
        help="feature-extraction, fill-mask, text-classification, token-classification, text-generation or "
        "text2text-generation (default: the task of the saved model's head)",
    )
    parser.add_argument("--output", required=True, metavar="OUT", help="the folder to write")
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32", help="weights and activations (fp32)")
    add_device_argument(parser, "trace and validate on")
    parser.add_argument("--optimize", action="store_true", help="save the graphs after ONNX Runtime's fusions")
    add_quantization_arguments(parser)  # --quantize and each scheme's options (vaswani.quantization.SCHEMES)
    parser.add_argument(
        "--attention",
        choices=("auto", "gqa", "portable"),
        default="auto",
        help="decoders' attention graph: gqa (ONNX Runtime's fused GroupQueryAttention with rotary and an in-place KV "
        "buffer, fastest in ONNX Runtime on CPU; a CPU export also carries the portable graph, over the same weights, "
        "for --engine openvino), portable (opset-23 Attention + RotaryEmbedding, any runtime), or auto (default: gqa "
        "for --quantize and --optimize exports where it applies, else portable)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    parser.add_argument(
        "--tolerance",
        type=float,
        help="validation tolerance: relative to each output's largest value, per layer of depth for fp32 (default "
        "2e-6) and overall for fp16 (5e-3); for int8 (0.15) and int4 (0.4) the logits' relative RMS error, beside "
        "fixed cosine and top-1 bounds (docs/deployment.md)",
    )
    parser.add_argument(
        "--opset",
        type=int,
        help="ONNX opset (default: 23 on cpu, whose Attention/RotaryEmbedding ops run fastest; 20 for older runtimes)",
    )
    parser.add_argument(
        "--full-trace",
        action="store_true",
        help="trace every layer (slower, grows with depth) instead of tracing two and stamping the rest",
    )


def run(args: argparse.Namespace) -> int:
    # Imported here, so that `vaswani --help` does not load torch and transformers.
    from ..conversion.checkpoints import ParityError
    from ..export import OnnxValidationError, export_onnx
    from ..runtime.loading import set_command_threads

    try:
        quantization = Quantization.from_cli(args)
        if quantization is not None and args.device == "cpu":
            set_command_threads(quantization.scheme.export_torch_work)  # what the scheme's graph pass runs fastest on
        result = export_onnx(
            args.model,
            args.output,
            args.task,
            dtype=args.dtype,
            device=args.device,
            optimize=args.optimize,
            quantize=quantization,
            attention=args.attention,
            overwrite=args.overwrite,
            tolerance=args.tolerance,
            opset=args.opset,
            stamp_layers=not args.full_trace,
            progress=stage_progress(),
        )
    except OnnxValidationError as error:
        print(error.report)
        print(f"error: the export does not match PyTorch; nothing was written to {args.output}.", file=sys.stderr)
        return 1
    except ParityError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(result.validation)
    return 0
