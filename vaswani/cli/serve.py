"""`vaswani serve`: an OpenAI-compatible HTTP server over a model folder (`serving`), or Ray Serve replicas of it."""

import argparse
import logging
import os
import re
import sys

from .options import add_runtime_arguments

DESCRIPTION = (
    "Serve an exported ONNX folder (text-generation: /v1/chat/completions and /v1/completions with "
    "continuous batching; feature-extraction: /v1/embeddings; text-classification: /v1/classifications) or, with "
    "--backend torch, a PyTorch vaswani causal LM folder. With --ray, N replicas run behind Ray Serve's router."
)
EPILOG = (
    "exit status: 0 after a clean shutdown (after SIGTERM, the signal's own status, 143: uvicorn re-raises "
    "it once the requests have drained); 2 bad input (not a model folder, a task that is not served)."
)


# vLLM's names of the tool-call formats (serving.tools.TOOL_CALL_PARSERS; not imported: `--help` loads no server).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")


SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def byte_size(text: str) -> int:
    """A byte count as `--prefix-cache-bytes` takes it: an integer, or a number with a unit (K, M, G: powers of 1000;
    KiB, MiB, GiB: powers of 1024), e.g. "512MiB", "2G"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg](?:i?b)?|)\s*", str(text), re.IGNORECASE)
    unit = match.group(2).lower() if match else None
    if unit is not None and unit.endswith("b") and not unit.endswith("ib"):
        unit = unit[:-1]  # "MB" as "M"
    if match is None or unit not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes or a number with a unit, e.g. 1GiB.")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `vaswani serve`."""
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
    add_runtime_arguments(parser)
    parser.add_argument("--model-name", help="the model id clients send (default: the folder's name)")
    parser.add_argument("--max-batch", type=int, default=16, help="sequences decoded together at most (16)")
    parser.add_argument("--max-waiting", type=int, default=64, help="requests queued at most; more get 429 (64)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,  # serving.scheduler.DEFAULT_MAX_NUM_BATCHED_TOKENS
        help="tokens computed per scheduler step at most: one per running sequence, and a chunk of waiting prompts "
        "with the rest, so a long prompt delays running streams by one chunk per token (256; at least --max-batch)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        default="auto",
        help="with --engine openvino: the precision of its paged KV cache (auto: 16 bits, which hold half float32's "
        "bytes, so each decoding step reads half as much of it: float16 at f32 compute, at no measured perplexity "
        "cost, and bfloat16 at bf16 compute, the only type OpenVINO's paged attention takes there; float32 for a "
        "cache at full precision, at f32 compute)",
    )
    parser.add_argument(
        "--openvino-int8-activations",
        choices=("on", "off"),
        default="on",
        help="with --engine openvino on an int8 or int4 export: off gives the weights' products float activations in "
        "every call. OpenVINO otherwise rounds them to int8 in calls of several tokens (prompts, steps of several "
        "rows, speculative verification) but not in a one-row step, so an answer's tokens can depend on the requests "
        "it shares steps with, and greedy speculation can part from plain decoding; off makes both exact at f32 "
        "compute (bf16 kernels round a call of several tokens otherwise too: add --openvino-precision f32 on CPUs "
        "with bfloat16), at the cost of slower prompts and of speculation's gain (on)",
    )
    parser.add_argument(
        "--prefix-cache-bytes",
        type=byte_size,
        default="1GiB",  # serving.prefix_cache.DEFAULT_MAX_BYTES
        metavar="SIZE",
        help="keep the keys and values of up to SIZE of prompt prefixes (a shared system prompt, a chat so far) so that "
        "later prompts starting the same way compute only the rest; bytes, or with a unit: 512MiB, 2GiB (1GiB; 0: off)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="how the model writes tool calls: hermes (<tool_call> JSON blocks: Hermes, Qwen 2.5/3), llama3_json "
        "(Llama 3.1/3.2's JSON); auto: the one its chat template shows (auto)",
    )
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, as vLLM\'s flag: a JSON object such as \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup: '
        "tokens that followed an earlier occurrence of the text's last words, verified in one step; the answer is "
        'unchanged), or \'{"method": "draft_model", "model": "SMALLER-EXPORT"}\' (a smaller model with the same '
        'tokenizer proposes); "disable_by_batch_size": N speculates only in steps of at most N rows (4) (default: off)',
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


def run(args: argparse.Namespace) -> int:
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
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_cache_bytes=args.prefix_cache_bytes,
        tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser,
    )
    if args.speculative_config is not None:
        options.update(speculative_config=args.speculative_config)
    # Ray's replicas and the PyTorch backend run ONNX Runtime or PyTorch only; "auto" falls back to ONNX Runtime there.
    if args.engine not in ("onnxruntime", "auto") and (args.ray or args.backend != "onnx"):
        print(f"error: --engine {args.engine} serves an ONNX export without --ray (--backend onnx).", file=sys.stderr)
        return 2
    if args.engine != "onnxruntime" and not args.ray and args.backend == "onnx":
        options.update(engine=args.engine, openvino_precision=args.openvino_precision)
    # --engine openvino's paged batch: `load_service` refuses these with the fix where the batch is not OpenVINO's;
    # Ray's replicas do not take them.
    paged = dict(kv_cache_dtype=args.kv_cache_dtype, openvino_int8_activations=args.openvino_int8_activations == "on")
    if args.ray and paged != dict(kv_cache_dtype="auto", openvino_int8_activations=True):
        print(
            "error: --kv-cache-dtype and --openvino-int8-activations set --engine openvino's paged batch; it serves "
            "without --ray.",
            file=sys.stderr,
        )
        return 2
    if not args.ray:
        options.update(paged)
    try:
        if args.ray:
            from ..serving.ray_app import load_runtime_env, serve_with_ray

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

        from ..runtime.loading import set_command_threads
        from ..serving import create_app, load_service

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        service = load_service(args.folder, **options)
        set_command_threads("model" if args.backend == "torch" else "small-ops", args.threads)
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
    logging.getLogger("vaswani.serving").info("%s", serving_line(service, args))
    uvicorn.Server(config).run()
    return 0


def serving_line(service, args: argparse.Namespace) -> str:
    """What is served where: the startup line of `vaswani serve`."""
    import json

    from ..serving.services import resolve_folder

    folder = resolve_folder(args.folder)
    form = f"{args.backend} on {args.device}"
    manifest = folder / "manifest.json"
    if args.backend == "onnx" and manifest.is_file():
        described = json.loads(manifest.read_text())
        form += f", {described.get('task')}, {described.get('dtype', 'fp32')}"
        form += f", {described.get('quantization') or 'not quantized'}"
        form += f", {described.get('attention_form', 'portable')} attention"
    if service.description:  # what runs where: the decoder runtime's own line (`DecoderRuntime.description`)
        form += f", {service.description}"
    threads = args.threads or len(os.sched_getaffinity(0))
    scheme = "https" if args.ssl_certfile else "http"
    host = f"[{args.host}]" if ":" in args.host else args.host
    guarded = "API key required" if args.api_key else "no API key"
    return (
        f"vaswani serve: model {service.name!r} from {folder.resolve()} ({form}, {threads} intra-op threads) at "
        f"{scheme}://{host}:{args.port}/v1 ({guarded}, shutdown grace {args.shutdown_timeout:g} s)"
    )
