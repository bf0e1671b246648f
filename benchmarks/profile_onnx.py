"""Where an exported decoder's generation time goes, per ONNX operator type, from ONNX Runtime's own profiler.

    python -m benchmarks.profile_onnx exported-folder                 # 64 greedy tokens after a 42-token prompt
    python -m benchmarks.profile_onnx exported-folder --new-tokens 16 --threads 2 --top 15
    python -m benchmarks.profile_onnx seq2seq-folder --prompt 32      # an encoder-decoder: its decoder graph's steps

Prints, for the decode steps only (the prompt's prefill, or an encoder-decoder's first decoder step, is
the first run and is left out), each operator type's
share of the time spent inside graph nodes, its microseconds per step, and how much of each step is spent outside
the nodes (session.run overhead, feeds and fetches, the Python loop).
"""

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import torch

from vaswani.runtime import OrtModelForCausalLM, OrtModelForSeq2SeqLM, default_session_options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a `vaswani export` folder of a decoder")
    parser.add_argument("--prompt", type=int, default=42, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="operator types to list")
    args = parser.parse_args()

    options = default_session_options(args.threads)
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    seq2seq = json.loads((args.folder / "manifest.json").read_text())["task"] == "text2text-generation"
    model_class = OrtModelForSeq2SeqLM if seq2seq else OrtModelForCausalLM
    model = model_class.from_pretrained(args.folder, session_options=options)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    model.generate(prompt, **kwargs)
    wall = time.perf_counter() - start
    trace = json.loads(Path(model.graphs[model.decoding_graph].session.end_profiling()).read_text())

    runs = [event for event in trace if event.get("name") == "model_run"]
    decode_runs = runs[1:]  # the first run is the prompt's prefill
    first_decode = decode_runs[0]["ts"]
    per_op: dict[str, float] = collections.defaultdict(float)
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first_decode:
            per_op[event["args"]["op_name"]] += event["dur"]
    steps = len(decode_runs)
    in_nodes = sum(per_op.values())
    in_runs = sum(event["dur"] for event in decode_runs)
    print(
        f"{args.folder}: {args.new_tokens} tokens in {wall:.2f} s ({args.new_tokens / wall:.1f} tok/s, prefill "
        f"included); decode step: {in_runs / steps / 1e3:.2f} ms inside session.run, of which "
        f"{in_nodes / steps / 1e3:.2f} ms in nodes"
    )
    print(f"{'operator':<28}{'share':>8}{'us/step':>10}")
    for op, micros in sorted(per_op.items(), key=lambda item: -item[1])[: args.top]:
        print(f"{op:<28}{micros / in_nodes:>8.1%}{micros / steps:>10.0f}")


if __name__ == "__main__":
    main()
