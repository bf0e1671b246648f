"""Where a quantized export's one-row decode steps run faster under `--engine openvino` with f32 steps: in ONNX
Runtime's `MatMulNBits` kernels or in OpenVINO's f32 graph (int8 activations), by the export's size. This is what
`OpenVinoRuntime.decodes_in_openvino` decides for a single row (`ONE_ROW_OPENVINO_BYTES`).

Each (export, route) runs in a process of its own, the routes alternating within each round: the export is loaded
with `engine="openvino"` (where the CPU has bf16 and int8 dot products, its decode steps compile at f32), then
`generate` times a prompt with 2 and with 2 + `--new-tokens` greedy tokens, the faster of 3 tries each; a step is
their difference over `--new-tokens`.

    python -m benchmarks.one_row_steps 'int8 135M=/tmp/smol/onnx-int8-attention-portable' \\
        'int8 1B=/tmp/big/int8-b128-portable' --rounds 3 --json docs/results/one_row_steps_amx.json \\
        --markdown docs/results/one_row_steps_amx.md
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import PACKAGES, command_line, machine
from benchmarks.results.pages import write

ROUTES = ("onnxruntime", "openvino")


def worker(args: argparse.Namespace) -> None:
    """One (export, route) in this process: prints one JSON line with its milliseconds per step."""
    import torch

    from vaswani.runtime import OrtModelForCausalLM
    from vaswani.runtime.session import default_session_options

    torch.set_num_threads(args.threads)
    model = OrtModelForCausalLM.from_pretrained(
        args.folder, session_options=default_session_options(args.threads), engine="openvino"
    )
    runtime = model.decoder_runtime
    if args.route == "onnxruntime":  # one-row steps in ONNX Runtime, batches as the runtime routes them
        runtime.decodes_in_openvino = lambda batch: batch > 1
    else:
        runtime.decodes_in_openvino = lambda batch: True
    generator = torch.Generator().manual_seed(0)

    def seconds(new_tokens: int) -> float:
        prompt = torch.randint(3, 1000, (1, args.prompt), generator=generator)
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start

    seconds(4)  # warm-up
    short = min(seconds(2) for _ in range(3))
    long = min(seconds(2 + args.new_tokens) for _ in range(3))
    print(json.dumps({"provider": model.provider, "step_ms": (long - short) / args.new_tokens * 1000}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="*", metavar="NAME=FOLDER", help="quantized portable exports")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=57, help="prompt tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--route", choices=ROUTES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    exports = dict(pair.split("=", 1) for pair in args.exports)
    load_before = os.getloadavg()[0]  # another job's load would slow the steps: the page says so
    runs = []
    for round_index in range(args.rounds):
        for name, folder in exports.items():
            routes = ROUTES if round_index % 2 == 0 else ROUTES[::-1]
            for route in routes:
                command = [sys.executable, "-m", "benchmarks.one_row_steps", "--worker", "--folder", folder]
                command += ["--route", route, "--threads", str(args.threads), "--new-tokens", str(args.new_tokens)]
                command += ["--prompt", str(args.prompt)]
                output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                measured = json.loads(output.strip().splitlines()[-1])
                runs.append({"round": round_index, "export": name, "route": route, **measured})
                print(f"round {round_index} {name} {route}: {measured['step_ms']:.2f} ms a step", flush=True)
    weights = {
        name: sum(f.stat().st_size for f in Path(folder).glob("model.onnx*")) for name, folder in exports.items()
    }
    results = {
        "title": "One-row decode steps of quantized exports: ONNX Runtime against OpenVINO's f32 steps",
        "command": command_line(),
        "machine": machine(threads=args.threads, shared=load_before >= 0.5, packages=(*PACKAGES, "openvino")),
        "tables_from": "one_row_steps",
        "raw": {"exports": exports, "weight_bytes": weights, "new_tokens": args.new_tokens, "runs": runs},
    }
    if args.json:
        write(results, args.json, args.markdown)


if __name__ == "__main__":
    main()
