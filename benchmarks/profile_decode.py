"""Where a decode step's time goes: vaswani's ONNX exports against onnxruntime-genai's builds, from ONNX Runtime's
own profiler, each export in a process of its own, in alternating rounds.

    python -m benchmarks.profile_decode vaswani=outputs/engines-benchmark/vaswani-onnx-int4 \\
        ortgenai=outputs/engines-benchmark/ortgenai-int4 --rounds 3 --json docs/results/decode_profile_cpu.json \\
        --markdown docs/results/decode_profile_cpu.md

A NAME=FOLDER whose folder holds genai_config.json is run by onnxruntime-genai (`og.Generator`, in the venv that
benchmarks/engines/setup.sh makes, `--engines`), any other by vaswani's `OrtModelForCausalLM.generate`.
Both generate `--new-tokens` greedy tokens after the same random `--prompt`-token prompt, at batch 1 (`--batch N`:
N rows, each its own prompt of that length), with ONNX Runtime's profiler on. Every run of the graph after the
prompt's is a decode step; the first `--skip` steps are left out, and each figure is the median over the other steps,
then over rounds:

- weight products: the MatMulNBits / MatMul / Gemm nodes that multiply by a weight, with the rate at which they read
  their weights (bytes of the weights, scales and zero points over their time);
- attention: GroupQueryAttention, Attention, MultiHeadAttention, RotaryEmbedding nodes;
- other nodes: everything else inside the graph (norms, activations, splits, gathers);
- run overhead: the graph run's time outside its nodes (ONNX Runtime's own work per run);
- loop: the time between one run's end and the next run's start (the generation loop: picking the token, feeding it).

An export named with `--openvino NAME` runs through `--engine openvino` instead, profiled by OpenVINO's own
counters (`PERF_COUNT`): each call of the decoder's OpenVINO graph is a run, its executed nodes its kernels. There the
weight products are the CPU plugin's FullyConnected nodes (the graph's MatMulNBits, compressed), attention its
ScaledDotProductAttention and RoPE nodes, and the read rate counts every weight product's bytes once per step.

`--prompt-step` profiles the prompt's run instead, the time to first token (its loop is 0), one per round:

    python -m benchmarks.profile_decode int8=outputs/engines-benchmark/vaswani-onnx-int8 \
        int4=outputs/engines-benchmark/vaswani-onnx-int4 --prompt 512 --new-tokens 2 --prompt-step
"""

import argparse
import bisect
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.provenance import command_line, machine
from benchmarks.results.engines import PROFILE_PARTS as PARTS
from benchmarks.results.pages import render, write

WEIGHT_PRODUCTS = ("MatMulNBits", "MatMul", "Gemm")
ATTENTION = ("GroupQueryAttention", "Attention", "MultiHeadAttention", "RotaryEmbedding")
# OpenVINO's CPU plugin names (its profiling info's node types) for the same parts.
OPENVINO_WEIGHT_PRODUCTS = ("FullyConnected", "FullyConnectedCompressed")
OPENVINO_ATTENTION = ("ScaledDotProductAttention", "ScaledDotProductAttentionWithKVCache", "RoPE")


def generate_vaswani(folder: Path, prompts: list[list[int]], new_tokens: int, threads: int, profile_dir: Path) -> str:
    """Greedy generation by vaswani's runtime with the decoding graph's session profiled; the trace's path."""
    import torch

    from vaswani.runtime import OrtModelForCausalLM, default_session_options

    torch.set_num_threads(threads)
    options = default_session_options(threads)
    options.enable_profiling = True
    options.profile_file_prefix = str(profile_dir / "vaswani")
    model = OrtModelForCausalLM.from_pretrained(folder, session_options=options)
    ids = torch.tensor(prompts)
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return model.graphs[model.decoding_graph].session.end_profiling()


def generate_openvino(folder: Path, prompts: list[list[int]], new_tokens: int, threads: int, profile_dir: Path) -> str:
    """Greedy generation by vaswani's `--engine openvino` with OpenVINO's performance counters on; every call of the
    OpenVINO graph (`OpenVinoDecoder.infer`) and its executed nodes written as ONNX Runtime's profiler writes runs and
    kernels (microseconds), so that `summarize` reads both. The trace's path."""
    import time

    import openvino
    import torch

    from vaswani.runtime import OrtModelForCausalLM, default_session_options
    from vaswani.runtime.openvino import OpenVinoDecoder

    compile_model, infer = openvino.Core.compile_model, OpenVinoDecoder.infer
    events, reading = [], [0.0]  # reading: seconds spent reading the counters so far, kept out of the timeline
    generating = [False]  # the load's own call (the steps' graph run once) is not the generation's

    def counted_compile(core, model, device=None, config=None, **kwargs):
        return compile_model(core, model, device, {**(config or {}), "PERF_COUNT": True}, **kwargs)

    def profiled_infer(decoder, request, *args):
        if not generating[0]:
            return infer(decoder, request, *args)
        start = time.perf_counter()
        logits = infer(decoder, request, *args)
        end = time.perf_counter()
        at = (start - reading[0]) * 1e6
        events.append({"cat": "Session", "name": "model_run", "ts": at, "dur": (end - start) * 1e6})
        executed = (info for info in request.get_profiling_info() if info.status == info.Status.EXECUTED)
        for info in executed:  # OpenVINO gives durations, not start times: each is placed at its run's start
            kernel = {"name": f"{info.node_name}_kernel_time", "ts": at, "args": {"op_name": info.node_type}}
            events.append({"cat": "Node", "dur": info.real_time.total_seconds() * 1e6, **kernel})
        reading[0] += time.perf_counter() - end  # about 3 ms a call at 135M: not the generation loop's
        return logits

    openvino.Core.compile_model, OpenVinoDecoder.infer = counted_compile, profiled_infer
    try:
        torch.set_num_threads(threads)
        options = default_session_options(threads)
        model = OrtModelForCausalLM.from_pretrained(folder, engine="openvino", session_options=options)
        model.decoder_runtime.openvino.compile_steps()  # its first run is the load's, not the generation's
        ids, generating[0] = torch.tensor(prompts), True
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    finally:
        openvino.Core.compile_model, OpenVinoDecoder.infer = compile_model, infer
    runs = sum(event["name"] == "model_run" for event in events)
    if runs < 2:
        sys.exit(
            f"{folder}: OpenVINO ran only the prompt; this export's single row decodes in ONNX Runtime (see "
            "ONE_ROW_OPENVINO_BYTES in vaswani/runtime/decoders/openvino.py). Profile it without --openvino."
        )
    trace = profile_dir / "openvino.json"
    trace.write_text(json.dumps(events))
    return str(trace)


def generate_ortgenai(folder: Path, prompts: list[list[int]], new_tokens: int, threads: int, profile_dir: Path) -> str:
    """Greedy generation by onnxruntime-genai's `og.Generator` with its session profiled (a session-level profile,
    written when the model is released); the trace's path."""
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    options = {"intra_op_num_threads": threads, "enable_profiling": str(profile_dir / "ortgenai")}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    length = len(prompts[0]) + new_tokens
    params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompts, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    del generator, model  # writes the profile
    return str(max(profile_dir.glob("ortgenai*.json"), key=lambda path: path.stat().st_mtime))


def weight_bytes(graph_path: Path) -> dict[str, int]:
    """Bytes of the initializers each weight product reads (weights, scales, zero points, bias), by node name."""
    import onnx

    from vaswani.evaluation.speed import initializer_bytes

    graph = onnx.load(str(graph_path), load_external_data=False).graph
    sizes = initializer_bytes(graph_path)
    # A tied LM head in an fp32 graph multiplies by Transpose(embedding), which ONNX Runtime folds at load time.
    for node in graph.node:
        if node.op_type == "Transpose" and node.input[0] in sizes:
            sizes[node.output[0]] = sizes[node.input[0]]
    return {
        node.name: sum(sizes.get(name, 0) for name in node.input[1:])
        for node in graph.node
        if node.op_type in WEIGHT_PRODUCTS and len(node.input) > 1 and node.input[1] in sizes
    }


def summarize(trace_path: Path, graph_path: Path, skip: int, prompt_step: bool = False) -> dict[str, float]:
    """Median microseconds per decode step of each of `PARTS`, and the weight products' GB/s; with `prompt_step`,
    those of the prompt's run (its "loop" is 0: what follows it is the first decode step's input)."""
    trace = json.loads(trace_path.read_text())
    runs = sorted((event for event in trace if event.get("name") == "model_run"), key=lambda event: event["ts"])
    starts = [run["ts"] for run in runs]
    products = weight_bytes(graph_path)
    every_product = sum(products.values())  # what an OpenVINO run that multiplies by weights reads
    per_run = [dict.fromkeys(("weight products", "attention", "other nodes", "bytes"), 0.0) for _ in runs]
    for event in trace:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        index = bisect.bisect_right(starts, event["ts"]) - 1
        if index < 0:
            continue
        node, op = event["name"].removesuffix("_kernel_time"), event["args"]["op_name"]
        if node in products:
            per_run[index]["weight products"] += event["dur"]
            per_run[index]["bytes"] += products[node]
        elif op in OPENVINO_WEIGHT_PRODUCTS:
            # OpenVINO's nodes are not the graph's: a run that multiplies by weights reads them all once.
            per_run[index]["weight products"] += event["dur"]
            per_run[index]["bytes"] = every_product
        elif op in ATTENTION or op in OPENVINO_ATTENTION:
            per_run[index]["attention"] += event["dur"]
        else:
            per_run[index]["other nodes"] += event["dur"]
    steps = []
    # The prompt's run first; the last run has no next start.
    for index in [0] if prompt_step else range(1 + skip, len(runs) - 1):
        step = per_run[index]
        inside = step["weight products"] + step["attention"] + step["other nodes"]
        step["run overhead"] = runs[index]["dur"] - inside
        step["loop"] = 0.0 if prompt_step else runs[index + 1]["ts"] - runs[index]["ts"] - runs[index]["dur"]
        step["GB/s"] = step["bytes"] / step["weight products"] / 1e3 if step["weight products"] else 0.0
        steps.append(step)
    if not steps:
        raise RuntimeError(f"{trace_path}: only {len(runs)} graph runs; generate more tokens or skip fewer")
    keys = [*PARTS, "GB/s"]
    return {key: statistics.median(step[key] for step in steps) for key in keys} | {"steps": len(steps)}


def run_worker(name: str, folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """One profiled generation in a fresh process (onnxruntime-genai's in its own venv), summarized here."""
    genai = (folder / "genai_config.json").is_file()
    python = args.engines / "ortgenai" / "bin" / "python" if genai else Path(sys.executable)
    engine = "ortgenai" if genai else "openvino" if name in args.openvino else "vaswani"
    with tempfile.TemporaryDirectory() as scratch:
        worker = ["--worker", engine, str(folder), scratch]
        command = [str(python), "-m", __spec__.name, *worker]
        command += ["--prompt", str(args.prompt), "--batch", str(args.batch), "--new-tokens", str(args.new_tokens)]
        command += ["--threads", str(args.threads)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
        trace = Path(result.stdout.strip().splitlines()[-1])
        graph = next(folder.glob("model.onnx"), None) or next(folder.glob("*.onnx"))
        return summarize(trace, graph, args.skip, args.prompt_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exports", nargs="*", metavar="NAME=FOLDER")
    parser.add_argument("--engines", type=Path, default=Path.home() / ".cache" / "vaswani-bench-engines")
    parser.add_argument("--prompt", type=int, default=47, help="prompt tokens (47: the engine benchmark's chat)")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together, each its own prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", type=int, default=4, help="decode steps left out at the start (warm-up)")
    parser.add_argument(
        "--prompt-step", action="store_true", help="profile the prompt's run (time to first token), not decode steps"
    )
    parser.add_argument(
        "--openvino", action="append", default=[], metavar="NAME", help="run this export with --engine openvino"
    )
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument(
        "--json", type=Path, help="the results as JSON (per round, per export); --markdown is rendered from it"
    )
    parser.add_argument("--worker", nargs=3, metavar=("ENGINE", "FOLDER", "PROFILE_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    # The same ids for every engine; each row of a batch its own prompt of the same length.
    prompts = [
        [(7919 * index + 104729 * row) % 40000 + 100 for index in range(args.prompt)] for row in range(args.batch)
    ]
    if args.worker:
        engine, folder, profile_dir = args.worker
        generate = {"ortgenai": generate_ortgenai, "openvino": generate_openvino}.get(engine, generate_vaswani)
        print(generate(Path(folder), prompts, args.new_tokens, args.threads, Path(profile_dir)))
        return
    exports = dict(pair.split("=", 1) for pair in args.exports)
    if set(args.openvino) - set(exports):
        parser.error(f"--openvino names {sorted(set(args.openvino) - set(exports))}, which no NAME=FOLDER gives")
    results: dict[str, list[dict]] = {name: [] for name in exports}
    for round_index in range(args.rounds):
        names = list(exports)[round_index % len(exports) :] + list(exports)[: round_index % len(exports)]
        for name in names:
            summary = run_worker(name, Path(exports[name]), args)
            results[name].append(summary)
            parts = ", ".join(f"{part} {summary[part]:.0f}" for part in PARTS)
            print(f"round {round_index + 1} {name}: {parts} us; {summary['GB/s']:.1f} GB/s", flush=True)
    settings = {
        key: getattr(args, key)
        for key in ("prompt", "batch", "new_tokens", "threads", "rounds", "skip", "prompt_step", "openvino")
    }
    title = "Where the prompt step's time goes" if args.prompt_step else "Where a decode step's time goes"
    # The page's table is computed from the rounds when it is rendered (results.profile_tables).
    page = {"title": title, "command": command_line(), "machine": machine(args.threads), "after": []}
    page |= {"tables_from": "profile_decode", "raw": {"rounds": results, "settings": settings}}
    print(render(page, args.json.name if args.json else "profile.json"))
    if args.json:
        write(page, args.json, args.markdown)
    elif args.markdown:
        args.markdown.write_text(render(page, "profile.json"))


if __name__ == "__main__":
    main()
