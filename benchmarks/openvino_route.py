"""The OpenVINO route (`--engine openvino`) against ONNX Runtime alone, on the same portable exports: time to first
token of a long prompt, decode tokens/s at batch 1 and 8, and the memory each process peaks at.

Systems, each timed in a process of its own (`vaswani.evaluation.speed.bench_folder`, what `vaswani bench` runs), in
rotated order for `--rounds` rounds (figures: medians over rounds; ratios: medians of per-round ratios):
- ONNX Runtime: `vaswani bench FOLDER`;
- OpenVINO route: `vaswani bench FOLDER --engine openvino` (OpenVINO at its automatic precision; `generate` runs
  every step in OpenVINO's stateful graph where `OpenVinoDecoder.serves` says so, else prompt steps in OpenVINO and
  one-token steps in ONNX Runtime);
- OpenVINO route, prompts only: the same with the stateful loop turned off (prompt steps in OpenVINO, one-token steps
  in ONNX Runtime at every batch): what the stateful loop adds;
- ONNX Runtime, GQA form (with `--gqa-build NAME=FOLDER`): the same export in the GroupQueryAttention form that
  `--quantize` writes by default, which only ONNX Runtime runs: the decode speed the route gives up.

    python -m benchmarks.openvino_route --build fp32=/tmp/smol/onnx-fp32 \\
        --build int8=/tmp/smol/onnx-int8-attention-portable --build int4=/tmp/smol/onnx-int4-attention-portable \\
        --gqa-build int8=/tmp/smol/onnx-int8 --gqa-build int4=/tmp/smol/onnx-int4 --rounds 3 \\
        --perplexity-text docs/results/real_model_text.txt \\
        --json docs/results/openvino_route_cpu.json --markdown docs/results/openvino_route_cpu.md

Each process measures: `--prefill-tokens` (512) prompt tokens at batch 1, time to first token (one `generate` token);
then decode of `--new-tokens` tokens after a `--decode-prompt-tokens` (128) prompt at batch 1 and 8; then its resident
memory and peak (`benchmarks.engines.worker.memory`, in the JSON).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.engines.worker import memory
from benchmarks.provenance import command_line, machine
from benchmarks.results.pages import TABLE_MAKERS, write

SYSTEMS = {
    "ONNX Runtime": {"engine": "onnxruntime"},
    "OpenVINO route": {"engine": "openvino"},
    "OpenVINO route, prompts only": {"engine": "openvino", "prompts_only": True},
    # The same export in the GroupQueryAttention form (`--gqa-build`), what --quantize writes by default: ONNX
    # Runtime's fastest decode, which the route (portable graphs only) gives up.
    "ONNX Runtime, GQA form": {"engine": "onnxruntime", "gqa_form": True},
}


def worker(args: argparse.Namespace) -> None:
    """One system on one export, in this process: prints one JSON line."""
    import torch

    from vaswani.evaluation.perplexity import model_perplexity
    from vaswani.evaluation.speed import bench_folder
    from vaswani.runtime.loading import load_folder

    torch.set_num_threads(1)  # as `vaswani bench` sets it for an ONNX folder (vaswani.runtime.loading.set_command_threads)
    system = SYSTEMS[args.system]
    loaded = load_folder(args.worker, "cpu", args.threads, "text-generation", system["engine"])
    if system.get("prompts_only"):
        loaded.model.decoder_runtime.decodes_in_openvino = lambda batch: False  # generate keeps to the route at every batch
    perplexity = None
    if args.perplexity_text:  # deterministic: once per system and export (round 1)
        text = args.perplexity_text.read_text()
        scored = model_perplexity(loaded.model, loaded.tokenizer, text, loaded.task, loaded.form, 512, 256, 2048)
        perplexity = scored.perplexity
    prefill = bench_folder(loaded, (1,), args.prefill_tokens, 2, 1, threads=args.threads, bandwidth_megabytes=256)
    decode = bench_folder(
        loaded, (1, 8), args.decode_prompt_tokens, args.new_tokens, 1, threads=args.threads, bandwidth_megabytes=256
    )
    print(
        json.dumps(
            {
                "provider": loaded.model.provider,
                "ttft_s": prefill.rows[0].time_to_first_token_s,
                "decode_tokens_per_s": {str(row.batch_size): row.decode_tokens_per_s for row in decode.rows},
                "perplexity": perplexity,
                **memory(),
            }
        )
    )


def run_system(build: str, system: str, args: argparse.Namespace, first_round: bool) -> dict:
    command = [sys.executable, "-m", __spec__.name, "--worker", build, "--system", system, "--threads", str(args.threads)]
    command += ["--prefill-tokens", str(args.prefill_tokens), "--new-tokens", str(args.new_tokens)]
    command += ["--decode-prompt-tokens", str(args.decode_prompt_tokens)]
    if args.perplexity_text and first_round:
        command += ["--perplexity-text", str(args.perplexity_text)]
    result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ), timeout=1800)
    if result.returncode:
        raise RuntimeError(f"{system} on {build} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="append", default=[], metavar="NAME=FOLDER", help="a portable export")
    parser.add_argument(
        "--gqa-build", action="append", default=[], metavar="NAME=FOLDER", help="NAME's GroupQueryAttention form"
    )
    parser.add_argument(
        "--model", default="SmolLM2-135M-Instruct", help="what the builds were exported from, as the page names it"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=33, help="tokens per decode run (the first is prefill's)")
    parser.add_argument(
        "--perplexity-text", type=Path, help="also score this text once per system (its first 2048 tokens)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    builds = dict(entry.split("=", 1) for entry in args.build)
    if not builds:
        parser.error("pass at least one --build NAME=FOLDER")
    gqa_builds = dict(entry.split("=", 1) for entry in args.gqa_build)
    runs = {
        name: {system: [] for system, how in SYSTEMS.items() if name in gqa_builds or not how.get("gqa_form")}
        for name in builds
    }
    for round_index in range(args.rounds):
        for name in builds:
            shift = round_index % len(runs[name])  # rotate the systems' order within each export
            systems = list(runs[name])[shift:] + list(runs[name])[:shift]
            for system in systems:
                folder = gqa_builds[name] if SYSTEMS[system].get("gqa_form") else builds[name]
                run = run_system(folder, system, args, round_index == 0)
                runs[name][system].append(run)
                print(f"round {round_index + 1}: {name} {system}: {json.dumps(run)}", flush=True)
    results = {
        "title": "The OpenVINO route against ONNX Runtime (CPU)",
        "command": command_line(),
        "machine": machine(args.threads, packages=("torch", "transformers", "onnxruntime", "openvino")),
        "notes": [
            f"Portable exports of {args.model}; each system in a process of its own, {args.rounds} rounds in "
            f"rotated order. Time to first token: a {args.prefill_tokens}-token prompt at batch 1. Decode: "
            f"{args.new_tokens - 1} tokens after a {args.decode_prompt_tokens}-token prompt, batch 1 and 8. Figures "
            "are medians over rounds, ratios (x ORT, speed-up) medians of per-round ratios to ONNX Runtime, each with "
            "its range over rounds in brackets: a difference inside the range is noise, not a lead. Weights / "
            "compute: the export's weights and the precision its arithmetic ran in (the provider each process "
            "reported; OpenVINO's bf16 is not ONNX Runtime's fp32, so an fp32 export's ratios compare bf16 with "
            "fp32 compute). Memory: "
            "the process's resident set at the end (torch, both runtimes and the benchmark's buffers included), "
            "anonymous (allocated) + file-mapped (the weight file OpenVINO maps; page cache, shared and "
            "reclaimable)."
            + (
                f" Perplexity (once per system): the first 2048 tokens of {args.perplexity_text}, windows of 512 "
                "tokens 256 apart; every window is a prompt step, so both OpenVINO routes score it in "
                "OpenVINO."
                if args.perplexity_text
                else ""
            )
        ],
        # The page's tables are computed from these raw rounds when it is rendered (results.openvino_route_tables).
        "tables_from": "openvino_route",
        "raw": {"settings": settings(args, builds, gqa_builds), "runs": runs},
    }
    page = write(results, args.json, args.markdown) if args.json else None
    print(page or json.dumps(TABLE_MAKERS["openvino_route"](results["raw"], results["machine"]), indent=1))


def settings(args: argparse.Namespace, builds: dict[str, str], gqa_builds: dict[str, str]) -> dict:
    """The run's settings as the JSON keeps them: numbers as numbers, paths as text, the builds by name."""
    kept = {
        key: value
        for key, value in vars(args).items()
        if key not in ("build", "gqa_build", "json", "markdown", "worker", "system")
    }
    kept = {key: str(value) if isinstance(value, Path) else value for key, value in kept.items()}
    return {**kept, "builds": builds, "gqa_builds": gqa_builds}


if __name__ == "__main__":
    main()
