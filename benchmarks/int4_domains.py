"""Quantized exports' perplexity beside float32 on texts of several domains, in two labelled sets: one text flatters a
quantizer (its 8-bit budget and calibration may happen to suit it), so each build is scored on many texts, and the
texts that chose a default are reported apart from texts that no default was tuned on.

    python -m benchmarks.int4_domains --build fp32=/tmp/smol/onnx-fp32 --build int8=/tmp/smol/onnx-int8 \\
        --build int4=/tmp/smol/onnx-int4 --json docs/results/int4_domains.json --markdown docs/results/int4_domains.md

The first `--build` is the reference. `--gguf NAME=FILE` adds llama.cpp builds of the same model (GGUFs that
llama.cpp's converter and quantizer made, as benchmarks/benchmark_engines.py makes them), scored on the same token ids
(the reference's tokenizer) and windows by llama.cpp in its own venv (benchmarks/engines/gguf_tools.py, flash attention
on, its CPU default), so that a layout is judged beside llama.cpp's on every text; `--openvino-genai NAME=FOLDER` adds
OpenVINO GenAI's builds (optimum-intel's export, scored by OpenVINO in its venv at its default compute precision).
`--openvino-build NAME=FOLDER` scores a portable export with `--engine openvino`: every window is a prompt, so
OpenVINO computes it (in bfloat16 where the CPU has it) as it computes a served batch. Texts (all ship with the
repository or are made from it, nothing downloads):

- Tuning texts: the five that chose the int4 export's 8-bit budget default (0.3) and compared its layouts: technical
  = docs/results/real_model_text.txt, legal and dialogue = benchmarks/texts/, code = the package's own
  `vaswani/evaluation/perplexity.py` and `vaswani/runtime/loading.py`, stories = a story corpus generated with another seed than the
  bundled one (`examples/make_corpus.py --seed 7`; the int4 calibration reads the bundled stories, so this domain is
  the nearest to it).
- Held-out texts: every file in benchmarks/texts/held_out/ (news, recipes, verse, an encyclopedia article, letters;
  its README says where each comes from). No default was chosen on them; a choice made on them would make them tuning
  texts, and they would have to be replaced by new held-out ones.

Each text is cut to `CHARACTERS` at a line end. Perplexity is `vaswani.evaluation.perplexity`'s: strided windows of `--context`
tokens, `--stride` apart. The JSON keeps the raw values (each build's perplexity, mean NLL and token count per text,
and its weight bytes); the tables are computed from them when the page is rendered
(`benchmarks.results.quality.domain_tables`).

`--speed-rounds N` also times each build with `vaswani bench` (batch 1 and 8, 128-token prompts, 64 new tokens), each
run in a process of its own, the builds in a rotated order for N rounds; a build's figure is its median over rounds
and its speed ratio to the first quantized build is the median of the per-round ratios (what a default's choice
trades: bytes and speed against perplexity).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.provenance import command_line, machine
from benchmarks.results.pages import write
from benchmarks.results.quality import HELD_OUT, TUNING

ROOT = Path(__file__).resolve().parents[1]

CHARACTERS = 5000  # per text: about 1,000-1,500 tokens, as the published single-text figure used
HELD_OUT_FOLDER = ROOT / "benchmarks" / "texts" / "held_out"


def cut(text: str) -> str:
    """`text` cut to `CHARACTERS` at a line end."""
    return text[: text.rfind("\n", 0, CHARACTERS)] if len(text) > CHARACTERS else text


def tuning_texts() -> dict[str, str]:
    """The five texts the int4 defaults were tuned on."""
    with tempfile.TemporaryDirectory() as folder:
        stories = Path(folder) / "stories.txt"
        command = [sys.executable, str(ROOT / "examples" / "make_corpus.py"), "--kilobytes", "8", "--seed", "7"]
        subprocess.run([*command, "--output", str(stories)], check=True, capture_output=True)
        story_text = stories.read_text()
    return {
        "technical": (ROOT / "docs" / "results" / "real_model_text.txt").read_text(),
        "legal": (ROOT / "benchmarks" / "texts" / "legal.txt").read_text(),
        "dialogue": (ROOT / "benchmarks" / "texts" / "dialogue.txt").read_text(),
        "code": "\n\n".join(
            (ROOT / "vaswani" / name).read_text() for name in ("evaluation/perplexity.py", "runtime/loading.py")
        ),
        "stories": story_text,
    }


def held_out_texts() -> dict[str, str]:
    """The held-out texts, one per file of benchmarks/texts/held_out/, named by the file."""
    return {path.stem: path.read_text() for path in sorted(HELD_OUT_FOLDER.glob("*.txt"))}


def describe_build(folder: str) -> str:
    """What an export is, from its manifest: layers, dtype and quantization (bits, method, 8-bit budget, block)."""
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    options = manifest.get("quantization_options") or {}
    what = f"{manifest['num_layers']} layers, {manifest['dtype']}"
    if options:
        what += (
            f", {options['name']} (method {options['method']}, block {options['block_size']}, "
            f"{'symmetric' if options['symmetric'] else 'asymmetric'}, 8-bit budget {options['eight_bit_budget']})"
        )
    return what


def decoder_weight_bytes(folder: str) -> int:
    """Bytes of weights a decode step of the export reads (`vaswani bench`'s figure: the graph's initializers less the
    embedding table it only looks rows up in)."""
    from vaswani.evaluation.speed import graph_weight_bytes

    return graph_weight_bytes(Path(folder) / "model.onnx")


def gguf_build(path: str) -> dict:
    """A llama.cpp build's entry: its file, what it is (the GGUF's type, from its name) and the bytes a decode step
    reads, the whole file (SmolLM2 ties its head to the embedding, so the table a step looks rows up in is also the
    head it reads in full; the file's metadata, the vocabulary, is under 2% of it)."""
    return {"folder": path, "build": f"llama.cpp GGUF {Path(path).stem}", "weight_bytes": Path(path).stat().st_size}


def named_folders(values: list[str]) -> dict[str, str]:
    """`NAME=PATH` arguments as name -> path (`engine_perplexity.named_paths`, which refuses a value without `=`)."""
    from benchmarks.engine_perplexity import named_paths

    return {name: str(path) for name, path in named_paths(values).items()}


def openvino_genai_build(folder: str) -> dict:
    """An OpenVINO GenAI build's entry (optimum-intel's export, as benchmarks/benchmark_engines.py makes it): its
    folder and the bytes of its weights file, which hold the tied head once (a decode step reads it in full)."""
    size = (Path(folder) / "openvino_model.bin").stat().st_size
    return {
        "folder": folder,
        "build": "OpenVINO GenAI (optimum-intel export), its default compute",
        "weight_bytes": size,
    }


# How each other engine scores windows in its own venv (benchmarks/engines/): its helper and request, at the engine's
# CPU defaults (llama.cpp's flash attention on; OpenVINO's own compute precision).
ENGINE_SCORERS = {
    "llamacpp": ("gguf_tools.py", {"flash_attn": True}),
    "openvino": ("openvino_tools.py", {"options": {}}),
}


def score_engine_builds(
    engine: str, builds: dict[str, str], texts: dict[str, str], tokenizer_folder: str, args
) -> dict[str, dict]:
    """Each of another engine's builds' perplexity, mean NLL and tokens on every text, scored by that engine (its
    venv under --engines) on the reference's token ids and windows."""
    from transformers import AutoTokenizer

    from benchmarks.engine_perplexity import engine_scores
    from vaswani.evaluation.perplexity import text_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    python = args.engines / engine / "bin" / "python"
    helper, settings = ENGINE_SCORERS[engine]
    runs: dict[str, dict] = {}
    for name, path in builds.items():
        request = {"threads": args.threads, **settings}
        scores = engine_scores(python, helper, Path(path), request, args.context, args.stride)
        for text_name, text in texts.items():
            result = scores(text_ids(tokenizer, text))
            runs.setdefault(name, {})[text_name] = {key: result[key] for key in ("perplexity", "mean_nll", "tokens")}
            print(f"{name} {text_name}: perplexity {result['perplexity']:.3f}", flush=True)
    return runs


def bench_rounds(builds: dict[str, str], rounds: int, threads: int, engines: dict[str, str]) -> dict[str, list[dict]]:
    """`vaswani bench` of every build (under its engine), each in its own process, in a rotated order per round: its
    JSON per round."""
    results: dict[str, list[dict]] = {name: [] for name in builds}
    names = list(builds)
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(rounds):
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                output = Path(scratch) / "bench.json"
                command = [sys.executable, "-m", "vaswani.cli.main", "bench", builds[name], "--batch-sizes", "1", "8"]
                command += ["--new-tokens", "64", "--rounds", "1", "--threads", str(threads), "--json", str(output)]
                command += ["--engine", engines[name]]
                subprocess.run(command, check=True, capture_output=True)
                results[name].append(json.loads(output.read_text()))
                row = results[name][-1]["rows"][0]
                print(
                    f"round {round_index + 1} {name}: {row['decode_tokens_per_s']:.1f} tokens/s at batch 1", flush=True
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="append", required=True, metavar="NAME=FOLDER", help="first: the reference")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE", help="llama.cpp builds")
    parser.add_argument(
        "--openvino-build", action="append", default=[], metavar="NAME=FOLDER",
        help="a portable export scored with --engine openvino (prompts, so every window, run by OpenVINO)",
    )  # fmt: skip
    parser.add_argument(
        "--openvino-genai", action="append", default=[], metavar="NAME=FOLDER",
        help="OpenVINO GenAI builds (optimum-intel exports), scored by OpenVINO at its default compute precision",
    )  # fmt: skip
    parser.add_argument("--engines", type=Path, default=Path.home() / ".cache" / "vaswani-bench-engines")
    parser.add_argument("--speed-rounds", type=int, default=0, help="also time each build with vaswani bench")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    from vaswani.evaluation.perplexity import folder_perplexity

    builds, openvino_builds = named_folders(args.build), named_folders(args.openvino_build)
    engines = {name: "onnxruntime" for name in builds} | {name: "openvino" for name in openvino_builds}
    builds |= openvino_builds
    sets = {TUNING: tuning_texts(), HELD_OUT: held_out_texts()}
    texts = {name: cut(text) for chosen in sets.values() for name, text in chosen.items()}
    raw = {
        "model": "SmolLM2-135M-Instruct, exported by vaswani export (the builds' manifests say how)",
        "texts": {name: {"set": chosen, "characters": len(texts[name])} for chosen in sets for name in sets[chosen]},
        "builds": {
            name: {
                "folder": folder,
                "engine": engines[name],
                "weight_bytes": decoder_weight_bytes(folder),
                "build": describe_build(folder) + (", run by --engine openvino" if engines[name] == "openvino" else ""),
            }  # fmt: skip
            for name, folder in builds.items()
        },
        "context": args.context,
        "stride": args.stride,
        "threads": args.threads,
        "runs": {},
    }
    for name, folder in builds.items():  # each build loaded once per text (ONNX Runtime sessions are cheap to open)
        for text_name, text in texts.items():
            result = folder_perplexity(
                folder, text, context=args.context, stride=args.stride, threads=args.threads, engine=engines[name]
            )
            raw["runs"].setdefault(name, {})[text_name] = {
                "perplexity": result.perplexity, "mean_nll": result.mean_nll, "tokens": result.tokens,
            }  # fmt: skip
            print(f"{name} {text_name}: {result.describe()}", flush=True)
    for engine, given, entry in (
        ("llamacpp", args.gguf, gguf_build),
        ("openvino", args.openvino_genai, openvino_genai_build),
    ):
        others = named_folders(given)
        if not others:
            continue
        raw["builds"].update({name: entry(path) for name, path in others.items()})
        raw["runs"].update(score_engine_builds(engine, others, texts, next(iter(builds.values())), args))
    if args.speed_rounds:
        raw["bench"] = bench_rounds(builds, args.speed_rounds, args.threads, engines)
    print(publish(raw, command_line(), machine(args.threads), args.json, args.markdown))


def publish(raw: dict, command: str, described: dict, json_path: Path, markdown_path: Path | None) -> str:
    """Write the results JSON (the raw values; `benchmarks.results.quality.domain_tables` computes the tables from
    them when the page is rendered) and render the page from it. Returns the page."""
    builds = raw["builds"]
    notes = [
        "Builds: "
        + "; ".join(f"{name} = `{build['folder']}` ({build['build']})" for name, build in builds.items())
        + f". Windows of {raw['context']} tokens, {raw['stride']} apart; each text cut to {CHARACTERS} characters at "
        "a line end. The tuning texts chose the int4 export's 8-bit budget default (0.3) and compared its layouts; "
        "the held-out texts (benchmarks/texts/held_out/, whose README says what each is) were never used to choose "
        "anything. Every table figure is computed from the JSON's raw perplexities, token counts and weight bytes "
        "(`domain_tables` in benchmarks/results/quality.py, run when the page is rendered)."
    ]
    results = {
        "title": "Quantized builds' perplexity on tuning and held-out texts",
        "command": command,
        "machine": described,
        "notes": notes,
        "tables_from": "int4_domains",
        "raw": raw,
    }
    return write(results, json_path, markdown_path)


if __name__ == "__main__":
    main()
