"""Quantized exports' perplexity beside float32 on texts of several domains: one text flatters a quantizer (its
8-bit budget and calibration may happen to suit it), so each build is scored on technical prose, legal prose,
dialogue, source code and stories, and the spread is reported.

    python benchmarks/int4_domains.py --build fp32=/tmp/smol/onnx-fp32 --build int8=/tmp/smol/onnx-int8 \\
        --build int4=/tmp/smol/onnx-int4 --json docs/results/int4_domains.json --markdown docs/results/int4_domains.md

The first `--build` is the reference. Texts (all ship with the repository or are made from it, nothing downloads):
technical = docs/results/real_model_text.txt, legal and dialogue = benchmarks/texts/, code = the package's own
`vaswani/perplexity.py` and `vaswani/loading.py`, stories = a story corpus generated with another seed than the
bundled one (`examples/make_corpus.py --seed 7`; the int4 calibration reads the bundled stories, so this domain is
the nearest to it). Perplexity is `vaswani.perplexity`'s: strided windows of `--context` tokens, `--stride` apart.

`--speed-rounds N` also times each build with `vaswani bench` (batch 1 and 8, 128-token prompts, 64 new tokens), each
run in a process of its own, the builds in a rotated order for N rounds; a build's figure is its median over rounds
and its speed ratio to the first quantized build is the median of the per-round ratios (what a default's choice
trades: bytes and speed against perplexity).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import from_markdown, write  # noqa: E402

from vaswani.perplexity import folder_perplexity  # noqa: E402

CHARACTERS = 5000  # per text: about 1,000-1,500 tokens, as the published single-text figure used


def domain_texts() -> dict[str, str]:
    """The five texts, each cut to `CHARACTERS` at a line end."""
    with tempfile.TemporaryDirectory() as folder:
        stories = Path(folder) / "stories.txt"
        command = [sys.executable, str(ROOT / "examples" / "make_corpus.py"), "--kilobytes", "8", "--seed", "7"]
        subprocess.run([*command, "--output", str(stories)], check=True, capture_output=True)
        story_text = stories.read_text()
    code = "\n\n".join((ROOT / "vaswani" / name).read_text() for name in ("perplexity.py", "loading.py"))
    texts = {
        "technical": (ROOT / "docs" / "results" / "real_model_text.txt").read_text(),
        "legal": (ROOT / "benchmarks" / "texts" / "legal.txt").read_text(),
        "dialogue": (ROOT / "benchmarks" / "texts" / "dialogue.txt").read_text(),
        "code": code,
        "stories": story_text,
    }
    return {
        name: text[: text.rfind("\n", 0, CHARACTERS) if len(text) > CHARACTERS else None]
        for name, text in texts.items()
    }


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


def bench_rounds(builds: dict[str, str], rounds: int, threads: int) -> dict[str, list[dict]]:
    """`vaswani bench` of every build, each in its own process, in a rotated order per round: its JSON per round."""
    results: dict[str, list[dict]] = {name: [] for name in builds}
    names = list(builds)
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(rounds):
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                output = Path(scratch) / "bench.json"
                command = [sys.executable, "-m", "vaswani.cli", "bench", builds[name], "--batch-sizes", "1", "8"]
                command += ["--new-tokens", "64", "--rounds", "1", "--threads", str(threads), "--json", str(output)]
                subprocess.run(command, check=True, capture_output=True)
                results[name].append(json.loads(output.read_text()))
                row = results[name][-1]["rows"][0]
                print(
                    f"round {round_index + 1} {name}: {row['decode_tokens_per_s']:.1f} tokens/s at batch 1", flush=True
                )
    return results


def speed_table(timings: dict[str, list[dict]], baseline: str) -> list[str]:
    """Rows of the speed table: weight bytes, batch-1 and batch-8 decode and first-token time, medians over rounds,
    and the median per-round ratio of batch-1 decode speed to `baseline`'s."""
    rows = []
    for name, runs in timings.items():

        def median(index, key, runs=runs):
            return statistics.median(run["rows"][index][key] for run in runs)

        ratios = [
            run["rows"][0]["decode_tokens_per_s"] / base["rows"][0]["decode_tokens_per_s"]
            for run, base in zip(runs, timings[baseline])
        ]
        cells = [
            name,
            f"{runs[0]['weight_bytes'] / 1e6:.1f}",
            f"{median(0, 'decode_tokens_per_s'):.1f}",
            f"{statistics.median(ratios):.2f}",
            f"{median(1, 'decode_tokens_per_s'):.1f}",
            f"{median(0, 'time_to_first_token_s') * 1e3:.0f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="append", required=True, metavar="NAME=FOLDER", help="first: the reference")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speed-rounds", type=int, default=0, help="also time each build with vaswani bench")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    builds = dict(build.split("=", 1) for build in args.build)
    texts = domain_texts()
    raw = {
        "builds": {name: {"folder": folder, "build": describe_build(folder)} for name, folder in builds.items()},
        "context": args.context,
        "stride": args.stride,
        "perplexity": {},
        "tokens": {},
    }
    for name, folder in builds.items():  # each build loaded once per text (ONNX Runtime sessions are cheap to open)
        for domain, text in texts.items():
            result = folder_perplexity(folder, text, context=args.context, stride=args.stride, threads=args.threads)
            raw["perplexity"].setdefault(name, {})[domain] = result.perplexity
            raw["tokens"][domain] = result.tokens
            print(f"{name} {domain}: {result.describe()}", flush=True)
    reference, *others = builds
    if args.speed_rounds:
        raw["bench"] = bench_rounds(builds, args.speed_rounds, args.threads)
    raw["model"] = "SmolLM2-135M-Instruct, exported by vaswani export (the builds' manifests say how)"
    rows = []
    for domain in texts:
        base = raw["perplexity"][reference][domain]
        cells = [domain, str(raw["tokens"][domain]), f"{base:.2f}"]
        cells += [
            f"{raw['perplexity'][name][domain]:.2f} ({raw['perplexity'][name][domain] / base - 1:+.1%})"
            for name in others
        ]
        rows.append("| " + " | ".join(cells) + " |")
    spreads = []
    for name in others:
        changes = [raw["perplexity"][name][domain] / raw["perplexity"][reference][domain] - 1 for domain in texts]
        spreads.append(f"{name}: {min(changes):+.1%} to {max(changes):+.1%}")
    report = "\n".join(
        [
            "# Quantized builds' perplexity on five domains",
            "",
            f"Builds: {'; '.join(f'{name} = `{folder}` ({describe_build(folder)})' for name, folder in builds.items())}. "
            "Windows of "
            f"{args.context} tokens, {args.stride} apart. Change against {reference}, per domain; spread: "
            f"{'; '.join(spreads)}.",
            "",
            "**Perplexity by domain**",
            "",
            "| domain | tokens | " + " | ".join(builds) + " |",
            "|---|---:|" + "---:|" * len(builds),
            *rows,
        ]
    )
    if args.speed_rounds:
        baseline = others[0] if others else reference
        report += "\n".join(
            [
                "",
                "",
                f"**Speed** (`vaswani bench`, {args.threads} threads, 128-token prompts, 64 new tokens; medians of "
                f"{args.speed_rounds} rounds, each build in its own process; ratio: batch-1 decode against {baseline})",
                "",
                "| build | weights MB | batch 1 tokens/s | ratio | batch 8 tokens/s | first token ms |",
                "|---|---:|---:|---:|---:|---:|",
                *speed_table(raw["bench"], baseline),
            ]
        )
    print(write(from_markdown(report, raw, threads=args.threads), args.json, args.markdown))


if __name__ == "__main__":
    main()
