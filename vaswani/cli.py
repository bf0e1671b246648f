"""The `vaswani` command line: convert checkpoints, export to ONNX, serve over HTTP, fine-tune, chat, perplexity, bench.

`vaswani convert` (checkpoints), `vaswani export` (ONNX), `vaswani serve` (HTTP), `vaswani finetune` (transformers'
Trainer), `vaswani chat`, `vaswani perplexity` and `vaswani bench` (any PyTorch or ONNX folder).

`vaswani serve` is an OpenAI-compatible server with continuous batching (`vaswani.serving`).

Example:
    $ vaswani convert --from ./llama-folder --to ./vaswani-folder
    $ vaswani export --model ./vaswani-folder --task text-generation --output ./onnx-folder
    $ vaswani export --model ./llama-folder --output ./onnx-folder  # both steps in one process
    $ vaswani serve ./onnx-folder --port 8000
    $ vaswani perplexity ./onnx-folder --text story.txt --context 512 --stride 256
    $ vaswani chat ./onnx-folder --prompt "Tell me a story."  # without --prompt: an interactive chat
    $ vaswani bench ./onnx-folder --batch-sizes 1 8 --json bench.json
    $ vaswani finetune --model ./vaswani-folder --train_file train.txt --output_dir out --lora
    $ torchrun --nproc_per_node 2 -m vaswani finetune ...  # or: accelerate launch ... -m vaswani finetune ...
"""

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """`--engine` and `--openvino-precision`, for the commands that run an ONNX export (chat, perplexity, bench,
    serve). The names are spelled out here (not imported) so that `--help` loads no runtime."""
    parser.add_argument(
        "--engine",
        choices=("onnxruntime", "openvino", "auto"),
        default="onnxruntime",
        help="what runs an ONNX export: onnxruntime, or openvino (text-generation on the CPU: prompts in OpenVINO, "
        "in bfloat16 where the CPU has AVX512_BF16 or AMX, and decode steps too where that is faster, the cache held "
        "inside OpenVINO; the rest in ONNX Runtime; needs pip install "
        "'vaswani[openvino]' and an export with --attention portable), or auto (openvino where that applies and the "
        "CPU has bfloat16, else onnxruntime) (onnxruntime)",
    )
    parser.add_argument(
        "--openvino-precision",
        choices=("auto", "f32", "bf16"),
        default="auto",
        help="with --engine openvino: its compute precision (auto: bf16 where the CPU has it, else f32)",
    )


def _add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a transformers checkpoint folder to vaswani, or back",
        description="Convert a transformers model folder (LLaMA, Mistral, Qwen2, GPT-2, BERT, BART, T5) into a vaswani "
        "one, or with --reverse a vaswani folder back into transformers' architecture. The result is loaded back "
        "and checked against the source (max abs diff <= 1e-4, greedy generation identical) before it is moved into "
        "place; the tokenizer is carried over. On any failure nothing is written.",
        epilog="exit status: 0 converted and verified; 1 the converted model does not reproduce the source; "
        "2 bad input (missing folder, unsupported architecture, fields that do not map, non-empty target).",
    )
    parser.add_argument("--from", dest="source", required=True, metavar="DIR", help="the model folder to convert")
    parser.add_argument("--to", dest="target", required=True, metavar="DIR", help="the folder to write")
    parser.add_argument(
        "--reverse",
        metavar="ARCH",
        help="convert a vaswani folder to transformers' ARCH: llama, mistral, qwen2, gpt2, bert, bart, t5, or auto "
        "(rope decoder -> llama, learned -> gpt2; encoder -> bert; seq2seq learned -> bart, relative_bias -> t5)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty target folder")
    parser.set_defaults(run=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    # Imported here, so that `vaswani --help` does not load torch and transformers.
    from .conversion.checkpoints import ParityError, convert_checkpoint

    try:
        convert_checkpoint(args.source, args.target, reverse=args.reverse, overwrite=args.overwrite, log=print)
    except ParityError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a vaswani or transformers model folder to ONNX and validate it",
        description="Export a saved vaswani model to an ONNX folder (graphs with external weights, config, tokenizer, "
        "manifest.json describing every input and output) with torch.onnx.export(dynamo=True). A transformers folder "
        "is converted in memory first, as `vaswani convert` would (same graphs, no intermediate folder), and must "
        "match the transformers model on a left-padded batch (max abs diff <= 1e-4). Every graph is then "
        "run by ONNX Runtime on fresh shapes and padded batches and compared with PyTorch; the table of max abs "
        "differences ends the output. The folder is built beside OUT and moved into place only when it validates.",
        epilog="exit status: 0 exported and validated; 1 the converted transformers model or ONNX Runtime disagrees "
        "with PyTorch beyond the tolerance (nothing is written); 2 bad input (missing folder, unsupported "
        "architecture or task, non-empty output without --overwrite).",
    )
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="trace and validate on (cpu)")
    parser.add_argument("--optimize", action="store_true", help="save the graphs after ONNX Runtime's fusions")
    parser.add_argument(
        "--quantize",
        choices=("int8", "int4"),
        help="weight-only block-wise quantization for CPU, from fp32 (int8: within 1%% of fp32 perplexity on trained "
        "models; int4: smaller and faster, lossier); the LM head stays 8-bit",
    )
    parser.add_argument("--block-size", type=int, help="weights per quantization block (default 32)")
    parser.add_argument(
        "--int4-method",
        choices=("search", "gptq", "rtn"),
        help="how int4 weights are chosen, all in the same layout and speed: search (default: each block's scale and "
        "zero point searched for the smallest error), rtn (round to nearest from the block's range), or gptq "
        "(calibrated on the package's corpus)",
    )
    parser.add_argument(
        "--accuracy-level",
        type=int,
        choices=(0, 1, 4),
        help="quantized matmuls compute in int8 (4, default, fastest) or float32 (0 or 1)",
    )
    parser.add_argument(
        "--int4-mlp-out-bits",
        type=int,
        choices=(4, 8),
        help="bits of the MLP output projections (down_proj, fc2) of an int4 export: 8 keeps these most sensitive "
        "matrices in 8 bits, like the LM head, for some size and speed",
    )
    parser.add_argument(
        "--int4-8bit-budget",
        type=float,
        metavar="FRACTION",
        help="int4: bytes that 8-bit copies of the matrices most sensitive to rounding may add, as a fraction of the "
        "4-bit weights (default 0.3; ranked by Fisher-weighted rounding error on the package's corpus, which needs the "
        "model's tokenizer; 0: every body matrix in 4 bits)",
    )
    parser.add_argument(
        "--int4-head-bits",
        type=int,
        choices=(4, 8),
        help="int4: bits of the LM head (default 8; 4 is onnxruntime-genai's layout, smaller and lossier)",
    )
    parser.add_argument(
        "--int4-symmetric",
        action="store_true",
        default=None,
        help="int4: the speed-first layout, one scale per block and no zero points (MatMulNBits' faster kernels; "
        "higher perplexity than the default's scale and zero point per block)",
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "gqa", "portable"),
        default="auto",
        help="decoders' attention graph: gqa (ONNX Runtime's fused GroupQueryAttention with rotary and an in-place KV "
        "buffer, fastest on CPU), portable (opset-23 Attention + RotaryEmbedding, any runtime), or auto (default: gqa "
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
    parser.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    # Imported here, so that `vaswani --help` does not load torch and transformers.
    from .conversion.checkpoints import ParityError
    from .conversion.onnx import OnnxValidationError, export_onnx
    from .loading import set_command_threads

    if args.quantize == "int4" and args.device == "cpu":
        set_command_threads("int4-export", None)
    try:
        result = export_onnx(
            args.model,
            args.output,
            args.task,
            dtype=args.dtype,
            device=args.device,
            optimize=args.optimize,
            quantize=args.quantize,
            block_size=args.block_size,
            accuracy_level=args.accuracy_level,
            int4_method=args.int4_method,
            int4_mlp_out_bits=args.int4_mlp_out_bits,
            int4_8bit_budget=args.int4_8bit_budget,
            int4_head_bits=args.int4_head_bits,
            int4_symmetric=args.int4_symmetric,
            attention=args.attention,
            overwrite=args.overwrite,
            tolerance=args.tolerance,
            opset=args.opset,
            stamp_layers=not args.full_trace,
            progress=_stage_progress(),
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


def _stage_progress() -> Callable[[str], None]:
    """Print each progress line to stderr with when it came and the process's peak resident memory so far:
    "Validating fp32 graphs against PyTorch  [61.4 s, peak RSS 5.40 GB]", so that a user sees what each stage costs."""
    import resource
    import time

    start = time.perf_counter()

    def say(message: str) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
        print(
            f"{message}  [{time.perf_counter() - start:.1f} s, peak RSS {peak / 1e9:.2f} GB]",
            file=sys.stderr,
            flush=True,
        )

    return say


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model folder over HTTP with OpenAI's API (needs pip install 'vaswani[serve]')",
        description="Serve an exported ONNX folder (text-generation: /v1/chat/completions and /v1/completions with "
        "continuous batching; feature-extraction: /v1/embeddings; text-classification: /v1/classifications) or, with "
        "--backend torch, a PyTorch vaswani causal LM folder. With --ray, N replicas run behind Ray Serve's router.",
        epilog="exit status: 0 after a clean shutdown (after SIGTERM, the signal's own status, 143: uvicorn re-raises "
        "it once the requests have drained); 2 bad input (not a model folder, a task that is not served).",
    )
    parser.add_argument(
        "folder",
        metavar="FOLDER",
        help="the exported (or, with --backend torch, saved) model folder, or a Hugging Face Hub repository id",
    )
    operations = parser.add_argument_group("operations")
    operations.add_argument(
        "--api-key",
        default=os.environ.get("VASWANI_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise; /health and /metrics stay open); default: "
        "the VASWANI_API_KEY environment variable (prefer it: a command line is visible to every user of the machine)",
    )
    operations.add_argument(
        "--allowed-origins",
        action="append",
        metavar="ORIGINS",
        help="origins browsers may call the API from (CORS), comma-separated or repeated, e.g. "
        "https://app.example.com; '*' for any (default: none, no CORS headers)",
    )
    operations.add_argument(
        "--ssl-keyfile", metavar="FILE", help="serve HTTPS with this private key (with --ssl-certfile)"
    )
    operations.add_argument(
        "--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate (with --ssl-keyfile)"
    )
    operations.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,  # serving.app.MAX_BODY_BYTES (not imported here: `--help` loads no server)
        help="larger request bodies get a 413 before they are read (1048576, 1 MiB)",
    )
    operations.add_argument(
        "--request-timeout",
        type=float,
        metavar="SECONDS",
        help="a generation that takes longer (from its arrival) ends with finish_reason 'length' and the text so far "
        "(default: no limit)",
    )
    operations.add_argument(
        "--shutdown-timeout",
        type=float,
        default=25.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, stop accepting and let running requests finish for at most this long, then cancel "
        "them and exit (25: under Kubernetes' default 30 s grace period)",
    )
    operations.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="the server's and uvicorn's log level; info logs the startup line and one access line per request (info)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (8000)")
    parser.add_argument("--backend", choices=("onnx", "torch"), default="onnx", help="ONNX Runtime or PyTorch (onnx)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs (cpu)")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: every core this process may use)")
    add_engine_arguments(parser)
    parser.add_argument("--model-name", help="the model id clients send (default: the folder's name)")
    parser.add_argument("--max-batch", type=int, default=16, help="sequences decoded together at most (16)")
    parser.add_argument("--max-waiting", type=int, default=64, help="requests queued at most; more get 429 (64)")
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=32,
        help="prompt tokens fed between two decoding steps while others run, times the joining prompts per running "
        "sequence (32)",
    )
    ray = parser.add_argument_group("Ray Serve (--ray)")
    ray.add_argument("--ray", action="store_true", help="run replicas behind Ray Serve (needs ray[serve])")
    ray.add_argument("--replicas", type=int, default=1, help="replicas of the app (1)")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves per replica (1)")
    ray.add_argument(
        "--gpus-per-replica", type=float, help="GPUs Ray reserves per replica (default: 1 with --device cuda, else 0)"
    )
    ray.add_argument("--ray-address", help="the Ray cluster to join, e.g. auto (default: start a local one)")
    ray.add_argument(
        "--ray-app-name",
        help="the Ray application's name (default: the model id); one per model, so models share a cluster",
    )
    ray.add_argument(
        "--route-prefix", default="/", help="the HTTP path the model's routes live under, e.g. /smol (default: /)"
    )
    ray.add_argument(
        "--runtime-env",
        help="Ray's runtime_env for the replicas: a JSON object, or the path of a JSON or YAML file holding one",
    )
    ray.add_argument(
        "--max-ongoing-requests",
        type=int,
        help="requests Ray sends one replica at once (default: 2 x (max-batch + max-waiting), so that the replica's "
        "own 429 is reached rather than Ray queueing in front of it)",
    )
    parser.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        print("error: HTTPS needs both --ssl-keyfile and --ssl-certfile.", file=sys.stderr)
        return 2
    origins = [origin.strip() for value in args.allowed_origins or [] for origin in value.split(",") if origin]
    app_options = dict(
        api_key=args.api_key or None,
        allowed_origins=origins,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
    )
    options = dict(
        backend=args.backend,
        provider=args.device,
        threads=args.threads,
        name=args.model_name,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        prefill_chunk=args.prefill_chunk,
    )
    if args.engine == "openvino" and (args.ray or args.backend != "onnx"):
        print("error: --engine openvino serves an ONNX export without --ray (--backend onnx).", file=sys.stderr)
        return 2
    if args.engine != "onnxruntime" and not args.ray and args.backend == "onnx":
        options.update(engine=args.engine, openvino_precision=args.openvino_precision)
    try:
        if args.ray:
            from .serving.ray_app import load_runtime_env, serve_with_ray

            serve_with_ray(
                args.folder,
                replicas=args.replicas,
                cpus_per_replica=args.cpus_per_replica,
                host=args.host,
                port=args.port,
                address=args.ray_address,
                app_name=args.ray_app_name,
                route_prefix=args.route_prefix,
                gpus_per_replica=args.gpus_per_replica,
                runtime_env=load_runtime_env(args.runtime_env),
                max_ongoing_requests=args.max_ongoing_requests,
                app_options=app_options,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                **options,
            )
            return 0
        import uvicorn

        from .loading import set_command_threads
        from .serving import create_app, load_service

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        service = load_service(args.folder, **options)
        set_command_threads(args.backend, args.threads)
        app = create_app(service, **app_options)
    except ImportError as error:
        extra = "ray" if args.ray else "openvino" if "openvino" in str(error) else "serve"
        print(f"error: {error}. Install the server's dependencies: pip install 'vaswani[{extra}]'", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,  # the app logs each request with its request id (serving.middleware)
        timeout_graceful_shutdown=args.shutdown_timeout,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    logging.getLogger("vaswani.serving").info("%s", _serving_line(service, args))
    uvicorn.Server(config).run()
    return 0


def _serving_line(service, args: argparse.Namespace) -> str:
    """What is served where: the startup line of `vaswani serve`."""
    import json

    from .serving.models import resolve_folder

    folder = resolve_folder(args.folder)
    form = f"{args.backend} on {args.device}"
    model = getattr(service, "model", None) or getattr(getattr(service, "engine", None), "model", None)
    provider = getattr(getattr(model, "model", model), "provider", "")  # a step model holds the OrtModel
    if provider.startswith("OpenVINO"):  # --engine openvino (or auto, where it chose it)
        from .conversion.onnx.openvino_engine import route_description

        form += f", {route_description(provider)}"
    manifest = folder / "manifest.json"
    if args.backend == "onnx" and manifest.is_file():
        described = json.loads(manifest.read_text())
        form += f", {described.get('task')}, {described.get('dtype', 'fp32')}"
        form += f", {described.get('quantization') or 'not quantized'}"
        form += f", {described.get('attention_form', 'portable')} attention"
    threads = args.threads or len(os.sched_getaffinity(0))
    scheme = "https" if args.ssl_certfile else "http"
    host = f"[{args.host}]" if ":" in args.host else args.host
    guarded = "API key required" if args.api_key else "no API key"
    return (
        f"vaswani serve: model {service.name!r} from {folder.resolve()} ({form}, {threads} intra-op threads) at "
        f"{scheme}://{host}:{args.port}/v1 ({guarded}, shutdown grace {args.shutdown_timeout:g} s)"
    )


# Commands whose parser and body live in their own module (`add_arguments(parser)`, `run(args)`); the module is
# imported when its command runs, so `vaswani --help` stays quick.
MODULE_COMMANDS = {
    "chat": ("chatting", "chat with a chat model's folder (PyTorch or ONNX): interactive, or one --prompt"),
    "bench": ("benchmarking", "time to first token and decode tokens/s of a folder on this machine"),
}


def _add_module_parser(subparsers: argparse._SubParsersAction, command: str, selected: bool) -> None:
    import importlib

    module_name, help_text = MODULE_COMMANDS[command]
    if not selected:
        subparsers.add_parser(command, help=help_text, add_help=False)
        return
    module = importlib.import_module(f".{module_name}", __package__)
    parser = subparsers.add_parser(command, help=help_text, description=module.__doc__.split("\n\n")[0])
    module.add_arguments(parser)
    parser.set_defaults(run=module.run, parser=parser)


def _add_finetune_parser(subparsers: argparse._SubParsersAction) -> None:
    # Listed here for `vaswani --help` only: `main` hands `vaswani finetune ARGS` to the module's own parser
    # (HfArgumentParser over the Trainer's flags), which `vaswani finetune --help` shows.
    subparsers.add_parser(
        "finetune",
        help="fine-tune a model folder with transformers' Trainer (full or LoRA; text, chat, classification, "
        "seq2seq; torchrun/accelerate launch -m vaswani finetune); needs pip install 'vaswani[train]'",
        add_help=False,
    )


def _exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's teardown.

    After an export, torch, ONNX Runtime and the traced programs leave so many objects, modules and thread pools
    behind that tearing them down takes 1.5-3 s, longer than a small model's whole conversion, and does nothing the
    user can see: `export_onnx` has written, closed and moved every file into place before it returns. Only
    Python's own buffers (the printed report, piped output is block-buffered) still need to be flushed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _add_perplexity_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "perplexity",
        help="the perplexity of a PyTorch or ONNX folder on a text file",
        description="Perplexity of a model folder (PyTorch or ONNX export, any precision) on a UTF-8 text. A causal "
        "LM is scored by strided windows (--context tokens, starting every --stride tokens; each token scored once "
        "with the left context its window gives it), a masked LM on 15%% masked positions (seeded), an "
        "encoder-decoder by teacher-forced reconstruction of each window. Prints one line; --json writes it too.",
        epilog="exit status: 0 measured; 2 bad input (missing or empty text, stride larger than context, context "
        "longer than the model's positions, not a model folder).",
    )
    parser.add_argument("folder", metavar="FOLDER", help="a PyTorch model folder or an ONNX export folder")
    parser.add_argument("--text", required=True, metavar="FILE", help="a UTF-8 text file to score")
    parser.add_argument(
        "--context", type=int, metavar="N", help="window length in tokens (default: max positions, at most 1024)"
    )
    parser.add_argument(
        "--stride", type=int, metavar="N", help="tokens between windows' starts (default: the context; causal LM only)"
    )
    parser.add_argument("--max-tokens", type=int, metavar="N", help="score at most the text's first N tokens")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, metavar="N", help="intra-op threads (default: every core)")
    add_engine_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")
    parser.set_defaults(run=lambda args: _run_perplexity(args, parser))


def _run_perplexity(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .perplexity import run

    return run(args, parser)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vaswani` console script; returns the process exit code.

    Run as the console script (`argv` None: the arguments come from the command line), `vaswani export` ends the
    process as soon as it has finished (`_exit_now`). Called with arguments, as tests and other Python code do, every
    command returns its exit code.

    Example:
        >>> main(["export", "--model", "llama-folder", "--output", "llama-onnx"])  # doctest: +SKIP
        0
    """
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments[:1] == ["finetune"]:
        try:  # torch, transformers and datasets load only for this command
            from .finetuning import main as finetune_main
        except ImportError as error:
            print(f"error: {error}. Install the training dependencies: pip install 'vaswani[train]'", file=sys.stderr)
            return 2
        return finetune_main(arguments[1:])
    parser = argparse.ArgumentParser(prog="vaswani", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_convert_parser(subparsers)
    _add_export_parser(subparsers)
    _add_serve_parser(subparsers)
    _add_perplexity_parser(subparsers)
    words = sys.argv[1:] if argv is None else argv
    for command in MODULE_COMMANDS:
        _add_module_parser(subparsers, command, selected=command in words[:1])
    _add_finetune_parser(subparsers)
    args = parser.parse_args(argv)
    code = args.run(args)
    if argv is None and args.command == "export":
        _exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
