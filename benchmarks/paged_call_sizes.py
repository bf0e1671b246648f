"""How long one call of `--engine openvino`'s paged graph takes by the number of tokens it feeds: what the server's
token budget is filled against (`Scheduler._fused_step` feeds exactly what the budget leaves).

Each round runs in a process of its own: the export is loaded as `vaswani serve --engine openvino` loads it
(`OrtModelForCausalLM.from_pretrained(folder, engine="openvino")`, its paged step model), and each token count is fed
as one new sequence's prompt, `--repeats` times after one unmeasured call; the figure is the median of those calls.

    python -m benchmarks.paged_call_sizes --folder /tmp/smol/onnx-int8-attention-portable --rounds 3 \\
        --json docs/results/paged_call_sizes_amx.json --markdown docs/results/paged_call_sizes_amx.md

`--graph stateful` times `generate`'s prompt call instead (`OpenVinoDecoder.start`, one row), as loaded (on AMX at
bf16 it pads a prompt to a multiple of 128 tokens) or, with `--unpadded`, at exactly each count.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import PACKAGES, command_line, machine
from benchmarks.results.pages import write

COUNTS = [16, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 240, 250, 254, 255, 256, 257, 320, 384, 512]


def worker(args: argparse.Namespace) -> None:
    """One round in this process: prints one JSON line, {tokens: median milliseconds of a call}."""
    import numpy as np
    import torch

    from vaswani.runtime import OrtModelForCausalLM
    from vaswani.runtime.session import default_session_options

    model = OrtModelForCausalLM.from_pretrained(
        args.folder,
        session_options=default_session_options(args.threads),
        engine="openvino",
        openvino_precision=args.openvino_precision,
    )
    generator = np.random.default_rng(0)
    if args.graph == "stateful":
        decoder = model.decoder_runtime.openvino
        decoder.pads_prompts &= not args.unpadded
        description = f"generate's prompt call, {decoder.provider}, {'' if decoder.pads_prompts else 'not '}padded"
        vocab = model.config.vocab_size

        def call(tokens):
            decoder.start(torch.from_numpy(tokens[None]), None)

    else:
        step = model.decoder_runtime.step_model()
        description, vocab = step.description, step.vocab_size

        def call(tokens):
            row = step.new_row()
            step.infer([row], [tokens])
            row.release()

    milliseconds = {}
    for count in args.counts:
        times = []
        for repeat in range(args.repeats + 1):
            tokens = generator.integers(0, vocab, count)
            start = time.perf_counter()
            call(tokens)
            if repeat:  # the first call of a new size is not measured
                times.append((time.perf_counter() - start) * 1000)
        milliseconds[count] = statistics.median(times)
    print(json.dumps({"description": description, "milliseconds": milliseconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, required=True, help="a portable export (`--attention portable`)")
    parser.add_argument("--openvino-precision", default="auto", choices=["auto", "f32", "bf16"])
    parser.add_argument("--counts", type=int, nargs="+", default=COUNTS, help="tokens per call")
    parser.add_argument("--graph", choices=["paged", "stateful"], default="paged", help="the server's or generate's")
    parser.add_argument("--unpadded", action="store_true", help="stateful: no padding to the AMX multiple")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="measured calls per size and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()[0]  # another job's load would slow the calls: the page says so
    runs = []
    for round_index in range(args.rounds):
        command = [sys.executable, "-m", "benchmarks.paged_call_sizes", "--worker", *sys.argv[1:]]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        measured = json.loads(output.strip().splitlines()[-1])
        runs.append({"round": round_index, **measured})
        print(f"round {round_index}: " + ", ".join(f"{k}: {v:.1f} ms" for k, v in measured["milliseconds"].items()))
    results = {
        "title": f"One call of the {args.graph} graph by the tokens it feeds (`--engine openvino`)",
        "command": command_line(),
        "machine": machine(threads=args.threads, shared=load_before >= 0.5, packages=(*PACKAGES, "openvino")),
        "tables_from": "paged_call_sizes",
        "raw": {
            "folder": str(args.folder),
            "openvino_precision": args.openvino_precision,
            "graph": args.graph,
            "runs": runs,
        },
    }
    if args.json:
        write(results, args.json, args.markdown)


if __name__ == "__main__":
    main()
