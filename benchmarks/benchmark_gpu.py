"""The GPU path end to end on a SmolLM2-135M-shaped model: fp16 export for CUDA, greedy parity with PyTorch, and decode
speed beside transformers' own model, each system timed by `vaswani bench` in a process of its own, alternating.

    python -m benchmarks.benchmark_gpu --work /tmp/gpu-bench --json docs/results/benchmark_gpu.json \
        --markdown docs/results/benchmark_gpu.md
    python -m benchmarks.benchmark_gpu --render docs/results/benchmark_gpu.json --markdown docs/results/benchmark_gpu.md

The model is transformers' `LlamaForCausalLM` with SmolLM2-135M-Instruct's configuration and seeded random weights
drawn at each tensor's mean and standard deviation in the trained checkpoint (`reference_shapes.py`, which
`--shape` may also point at SmolLM2-360M's or Llama-3.2-1B's shape): decode speed does not depend on the values, and
the scales keep activations where a trained model has them. Quality is not measured here. The prompts are token ids
of a small ChatML tokenizer built from the bundled stories.

Systems (fp16 weights, greedy, `vaswani bench --batch-sizes 1 8`):
- `vaswani-ort-cuda`: the `vaswani export --dtype fp16 --device cuda` folder on ONNX Runtime's CUDA provider, inputs,
  outputs and the KV cache bound to device memory (IO binding);
- `transformers-static`: `LlamaForCausalLM` generating with a static cache, which `generate` compiles on CUDA;
- `transformers-dynamic`: the same model with the default dynamic cache (no compilation).
The bound is the device memory bandwidth `vaswani bench` measures (`memory_bandwidth`) over the bytes of weights a
decode step reads, each row's from the same round as its decode rate.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.reference_shapes import SHAPES, write_reference_folder

HERE = Path(__file__).resolve().parent

SYSTEMS = {
    "vaswani-ort-cuda": "onnx-fp16",
    "transformers-static": "llama-fp16-static",
    "transformers-dynamic": "llama-fp16",
}
PARITY_TOKENS = 64
CHAT_QUESTIONS = [
    "Hi",
    "Tell me a story about a cat.",
    "Why is the sky blue?",
    "What did the dog say to the bird when they met in the garden?",
    "Count to ten.",
    "Once upon a time there was a little girl. What happened next?",
    "Hello!",
    "a b c",
]


def make_llama_folders(work: Path, shape: str) -> None:
    """`work/llama-fp16` (a transformers LlamaForCausalLM folder, fp16, random weights at trained scales, with a chat
    tokenizer: `reference_shapes.py`) and `work/llama-fp16-static` (the same weights; its generation config asks for
    a static cache)."""
    import torch

    folder = work / "llama-fp16"
    if (folder / "config.json").is_file():
        return
    write_reference_folder(shape, folder, torch.float16)
    static = work / "llama-fp16-static"
    shutil.copytree(folder, static, dirs_exist_ok=True)
    generation = json.loads((static / "generation_config.json").read_text())
    generation["cache_implementation"] = "static"
    (static / "generation_config.json").write_text(json.dumps(generation, indent=2))


def export(work: Path, device: str) -> dict:
    """`vaswani export --dtype fp16 --device cuda` of the Llama folder: wall time and the manifest's validation."""
    output = work / "onnx-fp16"
    command = ["vaswani", "export", "--model", str(work / "llama-fp16"), "--output", str(output)]
    command += ["--dtype", "fp16", "--device", device, "--overwrite"]
    start = time.perf_counter()
    log = run([sys.executable, "-m", "vaswani", *command[1:]])
    seconds = time.perf_counter() - start
    manifest = json.loads((output / "manifest.json").read_text())
    return {"command": " ".join(command), "seconds": seconds, "validation": manifest.get("validation"), "log": log}


def run(command: list[str]) -> str:
    """Run `command`, echo and return its output; raise with the output's end if it fails."""
    completed = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = completed.stdout + completed.stderr
    print(output[-4000:], flush=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({completed.returncode}):\n{output[-4000:]}")
    return output


def agreeing_steps(first, second) -> list[int]:
    """Per row, how many leading generated tokens two greedy runs (token tensors) share."""
    same = (first == second).int().cumprod(dim=1)
    return same.sum(dim=1).tolist()


def parity_child(work: Path, device: str) -> None:
    """Greedy tokens of the fp16 export on ONNX Runtime against transformers' fp16 model, on chat-templated prompts, one
    at a time and as one left-padded batch; both also against transformers' float32 model, the oracle of what fp16
    rounding alone changes (random weights leave near-ties that either half-precision run may break either way).
    Prints JSON."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from vaswani.runtime import OrtModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(work / "llama-fp16")
    tokenizer.padding_side = "left"
    half = LlamaForCausalLM.from_pretrained(work / "llama-fp16", dtype=torch.float16).to(device).eval()
    exact = LlamaForCausalLM.from_pretrained(work / "llama-fp16", dtype=torch.float32).to(device).eval()
    ort = OrtModelForCausalLM.from_pretrained(work / "onnx-fp16", provider=device)
    settings = dict(max_new_tokens=PARITY_TOKENS, min_new_tokens=PARITY_TOKENS, do_sample=False, pad_token_id=0)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        for question in CHAT_QUESTIONS
    ]
    report = {"new_tokens": PARITY_TOKENS, "rows": []}
    for batch in [[prompt] for prompt in prompts] + [prompts]:
        inputs = tokenizer(batch, return_tensors="pt", padding=True).to(device)
        start = inputs["input_ids"].shape[1]
        with torch.inference_mode():
            tokens = {
                "pytorch_fp16": half.generate(**inputs, **settings)[:, start:],
                "pytorch_fp32": exact.generate(**inputs, **settings)[:, start:],
                "vaswani_ort_fp16": ort.generate(**inputs, **settings)[:, start:].to(device),
            }
            margins = exact(**inputs).logits[:, -1].float().topk(2).values  # the first step's top-2 gap, float32
        ort_half = agreeing_steps(tokens["vaswani_ort_fp16"], tokens["pytorch_fp16"])
        ort_exact = agreeing_steps(tokens["vaswani_ort_fp16"], tokens["pytorch_fp32"])
        half_exact = agreeing_steps(tokens["pytorch_fp16"], tokens["pytorch_fp32"])
        for row in range(len(batch)):
            report["rows"].append(
                {
                    "batch": len(batch),
                    "ort_fp16_vs_pytorch_fp16": ort_half[row],
                    "ort_fp16_vs_pytorch_fp32": ort_exact[row],
                    "pytorch_fp16_vs_pytorch_fp32": half_exact[row],
                    "first_step_top2_gap_fp32": float(margins[row, 0] - margins[row, 1]),
                }
            )
    print("PARITY " + json.dumps(report))


def machine(device: str) -> dict:
    """The GPU, its driver, the CPU and the versions this run used."""
    import torch
    import transformers

    info = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "no GPU (a CPU check run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }
    try:
        import onnxruntime

        info["onnxruntime"] = f"{onnxruntime.__version__} ({', '.join(onnxruntime.get_available_providers())})"
    except ImportError:
        pass
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
        info["driver, memory"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    info["commit"] = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return info


def measure(
    work: Path,
    device: str,
    rounds: int,
    batch_sizes: list[int],
    prompt_tokens: int,
    new_tokens: int,
    systems: dict,
    measured: Callable[[dict], None],
) -> dict:
    """`vaswani bench` of each system, in a process of its own, the systems alternating in each of `rounds`;
    `measured` gets the results so far after each run (a run cut short keeps them)."""
    results, failures = {name: [] for name in systems}, {}
    for round_index in range(rounds):
        for name, folder in systems.items():
            output = work / f"bench-{name}-{round_index}.json"
            command = [sys.executable, "-m", "vaswani", "bench", str(work / folder), "--device", device]
            command += ["--batch-sizes", *map(str, batch_sizes), "--prompt-tokens", str(prompt_tokens)]
            command += ["--new-tokens", str(new_tokens), "--rounds", "3", "--json", str(output)]
            try:
                run(command)
            except RuntimeError as error:  # one system failing leaves the others' figures standing
                failures.setdefault(name, str(error)[-2000:])
                continue
            results[name].append(json.loads(output.read_text()))
            measured({"results": results, "failures": failures})
    return {"results": results, "failures": failures}


def summarize(runs: dict) -> list[dict]:
    """One row per system and batch size: the best round's decode rate, its time to first token, and the bound that
    same round measured, of which its fraction is (the machine is a lent one, so the best round is the least
    disturbed; each round probes the bandwidth again)."""
    rows = []
    for name, results in runs.items():
        if not results:
            continue
        for index, first in enumerate(results[0]["rows"]):
            best = max(results, key=lambda result: result["rows"][index]["decode_tokens_per_s"])
            row = best["rows"][index]
            rows.append(
                {
                    "system": name,
                    "batch_size": first["batch_size"],
                    "time_to_first_token_ms": row["time_to_first_token_s"] * 1e3,
                    "decode_tokens_per_s": row["decode_tokens_per_s"],
                    "bound_fraction": row["bound_fraction"],
                    "weight_bytes": best["weight_bytes"],
                    "bound_tokens_per_s": best["bound_tokens_per_s"],
                    # Threads that read the bandwidth probe (None: a GPU's, or a run from before it was recorded).
                    "bandwidth_threads": best.get("bandwidth_threads"),
                    "decode_threads": best["machine"].get("threads"),
                    "rounds": [result["rows"][index]["decode_tokens_per_s"] for result in results],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vaswani-gpu-bench"), help="folders are written here")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=2, help="process rounds per system (2)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--markdown", type=Path, help="write the results page here")
    parser.add_argument(
        "--render", type=Path, metavar="JSON", help="publish again from this JSON's raw report (with --json)"
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a quick check of this script")
    parser.add_argument("--child", choices=["parity"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "parity":
        parity_child(args.work, args.device)
        return
    if args.render:
        report = json.loads(args.render.read_text())["raw"]
    else:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("benchmark_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False).")
        args.work.mkdir(parents=True, exist_ok=True)
        report = {
            "machine": machine(args.device),
            "shape": args.shape,
            "json_name": args.json.name if args.json else "-",
        }
        report["settings"] = {
            "rounds": args.rounds,
            "batch_sizes": args.batch_sizes,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
        }
        report["failures"] = {}

        def save() -> None:  # after every stage: a run cut short keeps what it measured
            if args.json:
                args.json.write_text(json.dumps(report, indent=2) + "\n")

        make_llama_folders(args.work, args.shape)
        systems = dict(SYSTEMS)
        try:
            report["export"] = export(args.work, args.device)
            report["export"]["log"] = report["export"]["log"][-2000:]
            save()
            child = ["--child", "parity", "--work", str(args.work), "--device", args.device]
            output = run([sys.executable, "-m", __spec__.name, *child])
            report["parity"] = json.loads(output.split("PARITY ", 1)[1].splitlines()[0])
        except RuntimeError as error:  # without an export, transformers' rows are still measured
            report["failures"]["vaswani-ort-cuda"] = str(error)[-2000:]
            if not (args.work / "onnx-fp16" / "manifest.json").is_file():
                systems.pop("vaswani-ort-cuda")
        save()

        def measured(runs: dict) -> None:
            report["runs"] = runs["results"]
            report["failures"].update(runs["failures"])
            report["rows"] = summarize(runs["results"])
            save()

        measure(
            args.work,
            args.device,
            args.rounds,
            args.batch_sizes,
            args.prompt_tokens,
            args.new_tokens,
            systems,
            measured,
        )
    if args.json:
        print(publish(report, args.json, args.markdown))


def publish(report: dict, json_path: Path, markdown_path: Path | None) -> str:
    """The page through `benchmarks.results`: the raw report, the GPU it ran on, and the tables computed from them."""
    from benchmarks.results.pages import write

    info = report["machine"]
    results = {
        "title": "GPU: fp16 export on ONNX Runtime's CUDA provider beside transformers",
        "command": f"python -m benchmarks.benchmark_gpu --json {json_path.name} --markdown {json_path.stem}.md",
        "machine": {
            "gpu": f"one {info['gpu']} ({info.get('driver, memory', '')}), commit {info['commit']}",
            "date": info["date"],
            "versions": {name: info[name] for name in ("torch", "cuda", "transformers", "onnxruntime") if name in info},
        },
        "tables_from": "gpu_decode",  # results.gpu_decode_tables: every figure from the raw rounds
        "raw": report,
    }
    return write(results, json_path, markdown_path)


if __name__ == "__main__":
    main()
