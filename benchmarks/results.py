"""Published results: each `docs/results/NAME.md` is rendered from `NAME.json` beside it, which its script wrote.

A script builds one results dictionary: what it measured (`raw`: per-round seconds, tokens/s, bytes, in its own
form), the name of the table maker that computes the page's tables from those raw values (`tables_from`, one of
`TABLE_MAKERS`), the command that made it, and the machine it ran on (`machine()`). `write` saves the JSON, reads it
back and renders the page from what it read: every figure in a table is computed from the raw values when the page
is rendered, so a table never says more than the measurements do. Where per-round values exist a figure is their
median with the range over rounds beside it (`spread`). The page may go on after the rendered part (explanations);
it holds no table there.

    from results import machine, write
    write(
        {"title": "Speed", "command": "python benchmarks/openvino_route.py ...", "machine": machine(threads=2),
         "tables_from": "openvino_route", "raw": {"settings": ..., "runs": ...}},
        Path("docs/results/x.json"),
        Path("docs/results/x.md"),
    )

Older scripts still hand over tables of formatted cells (`tables`, made by `table` or `from_markdown`). Such a page
says so where it names its command, and ends with `TEXT_END` instead of `RENDERED_END`: its tables are the run's
text, kept in the JSON, not figures computed from raw values.

Render a page again from its JSON (the test suite does, and compares):

    python benchmarks/results.py docs/results/x.json --output docs/results/x.md
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

# Ends the rendered part of a page; what follows is written by hand and holds no table.
RENDERED_END = "<!-- The page above this line is rendered from the JSON; edit that and render again. -->"
# Ends the rendered part of a page whose JSON keeps its tables as formatted text (no raw values behind the cells).
TEXT_END = (
    "<!-- The page above this line is the run's text kept in the JSON: its tables are not computed from raw values. -->"
)
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
PACKAGES = ("torch", "transformers", "onnxruntime", "onnx")


def cpu_description() -> dict:
    """The CPU's model name (as `lscpu` shows it, from /proc/cpuinfo) and which of the flags that decide the
    kernels (AVX2, AVX-512, VNNI, BF16, AMX) it has."""
    model, flags = platform.processor() or "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {"model": model, "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def machine(threads: int | None, shared: bool = True, packages: tuple[str, ...] = PACKAGES) -> dict:
    """Where and when a run happened: CPU, cores this process may use, the threads the run used, whether other jobs
    shared the machine, the UTC date and the installed versions of `packages`."""
    versions = {"python": platform.python_version()}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return {
        "cpu": cpu_description(),
        "cores": len(os.sched_getaffinity(0)),
        "threads": threads,
        "shared": shared,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": versions,
    }


def table(heading: str, columns: list[str], rows: list[list]) -> dict:
    """One table of a page, its cells formatted. A table maker returns these, computed from raw values at render
    time; kept in a JSON file they are text (see `TEXT_END`)."""
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"table {heading!r}: every row needs {len(columns)} cells ({columns})")
    return {"heading": heading, "columns": columns, "rows": [[str(cell) for cell in row] for row in rows]}


def describe_machine(described: dict | None) -> str:
    if described is None:
        return "not recorded (the run predates the record)."
    if "gpu" in described:  # a GPU run: the accelerator, not the host's CPU, decides the figures
        versions = ", ".join(f"{name} {version}" for name, version in described["versions"].items())
        return f"{described['gpu']}; {described['date']}; {versions}."
    cpu = described["cpu"]
    flags = ", ".join(flag for flag, present in cpu["flags"].items() if present) or "none of " + ", ".join(CPU_FLAGS)
    count = described.get("threads")
    threads = f", {count} thread{'s' if count != 1 else ''}" if count else ""
    shared = " shared with other jobs (figures depressed and noisy; read the ratios)" if described["shared"] else ""
    versions = ", ".join(f"{name} {version}" for name, version in described["versions"].items())
    return f"{cpu['model']} ({flags}), {described['cores']} cores{shared}{threads}; {described['date']}; {versions}."


def render_table(rendered: dict) -> str:
    lines = [*(f"{text}\n" for text in rendered.get("text", [])), f"**{rendered['heading']}**", ""]
    lines.append("| " + " | ".join(rendered["columns"]) + " |")
    lines.append("|" + "---|" * len(rendered["columns"]))
    lines += ["| " + " | ".join(row) + " |" for row in rendered["rows"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ table makers
# Each computes a page's tables from the raw values its script saved (and the machine they ran on), when the page is
# rendered: `TABLE_MAKERS[results["tables_from"]](results["raw"], results["machine"])`.

TableMaker = Callable[[dict, dict], list[dict]]
TABLE_MAKERS: dict[str, TableMaker] = {}


def table_maker(name: str) -> Callable[[TableMaker], TableMaker]:
    """Register a table maker under the name a script writes as its results' `tables_from`."""

    def register(maker: TableMaker) -> TableMaker:
        TABLE_MAKERS[name] = maker
        return maker

    return register


def spread(values: list[float], digits: int = 1, suffix: str = "") -> str:
    """Per-round `values` as the page shows them: the median, and over two or more rounds the range beside it
    ("17.7 (16.3-19.6)"); a difference inside that range is noise, not a lead. "–" when no round measured it."""
    values = [value for value in values if value is not None and value == value]
    if not values:
        return "–"
    shown = f"{statistics.median(values):.{digits}f}{suffix}"
    if len(values) > 1:
        shown += f" ({min(values):.{digits}f}-{max(values):.{digits}f})"
    return shown


def paired_ratios(numerators: list[float | None], denominators: list[float | None]) -> list[float]:
    """Round-by-round ratios (runs of the same round side by side), leaving out rounds where either is missing."""
    return [top / bottom for top, bottom in zip(numerators, denominators) if top and bottom]


def computes_bfloat16(described: dict) -> bool:
    """Whether the machine's CPU has bfloat16 arithmetic (AVX512_BF16 or AMX), where OpenVINO's CPU plugin computes
    in bf16 unless told otherwise (its INFERENCE_PRECISION_HINT default)."""
    flags = described["cpu"]["flags"]
    return bool(flags.get("avx512_bf16") or flags.get("amx_tile"))


@table_maker("openvino_route")
def openvino_route_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/openvino_route.py: per export, each system's time to first token, decode tokens/s at batch 1 and
    8 (medians with the range over rounds), its ratios to ONNX Runtime (medians and ranges of per-round ratios),
    resident memory, perplexity; each row with the precision it computes in (the provider it reported)."""
    settings, made = raw["settings"], []
    for name, systems in raw["runs"].items():
        base, rows = systems["ONNX Runtime"], []
        for system, rounds in systems.items():
            provider = rounds[0]["provider"]
            cells = [system, provider, compute_precision(name, provider)]
            cells.append(spread([run["ttft_s"] * 1e3 for run in rounds], 0, " ms"))
            cells.append(spread(paired_ratios([b["ttft_s"] for b in base], [r["ttft_s"] for r in rounds]), 2, "x"))
            for batch in ("1", "8"):
                rates = [run["decode_tokens_per_s"][batch] for run in rounds]
                cells.append(spread(rates))
                cells.append(spread(paired_ratios(rates, [b["decode_tokens_per_s"][batch] for b in base]), 2, "x"))
            anonymous = statistics.median(run["anon_bytes"] for run in rounds) / 2**20
            mapped = statistics.median(run["file_bytes"] for run in rounds) / 2**20
            cells.append(f"{anonymous:.0f} + {mapped:.0f} MiB")
            if rounds[0].get("perplexity") is not None:
                cells.append(f"{rounds[0]['perplexity']:.3f}")
            rows.append(cells)
        columns = ["system", "runs prompts in", "weights / compute", "time to first token", "speed-up"]
        columns += ["decode tok/s, batch 1", "x ORT", "decode tok/s, batch 8", "x ORT"]
        columns.append("resident: anonymous + file-mapped")
        if base[0].get("perplexity") is not None:
            columns.append("perplexity")
        folders = settings["builds"][name] + (
            f"; GQA form {settings['gqa_builds'][name]}" if name in settings.get("gqa_builds", {}) else ""
        )
        made.append(table(f"{name} export ({folders})", columns, rows))
    return made


def compute_precision(weights: str, provider: str) -> str:
    """A row's weights and the precision its arithmetic runs in, from the provider its process reported: ONNX
    Runtime's CPU provider computes float32, and quantized MatMulNBits at the exporter's default accuracy level 4
    (int8 activations per block); "OpenVINO (bf16)" computes bfloat16 in the steps OpenVINO runs (which steps those
    are, the page's notes say)."""
    if provider.startswith("OpenVINO"):
        return f"{weights} / {provider.partition('(')[2].rstrip(')') or 'OpenVINO default'} in OpenVINO's steps"
    return f"{weights} / fp32" if weights == "fp32" else f"{weights} / int8 activations (accuracy level 4)"


@table_maker("engines")
def engine_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/benchmark_engines.py: decode tokens/s per batch size against the memory bound and transformers,
    time to first token, and agreement with transformers' greedy tokens, per system (medians with the range over
    rounds; ratios are per-round ratios, paired by round). `raw["results"][name][round]` is None where that round's
    process failed."""
    settings, results, builds = raw["settings"], raw["results"], raw["builds"]
    bandwidth = max(raw["bandwidths"])  # other jobs only lower a probe: the highest is closest to what the machine has
    fp32_bytes = raw["fp32_bytes"]
    reference = results["transformers fp32"]
    reference_tokens = next(run for run in reference if run)["decode"]["1"]["tokens"]

    def rates(runs: list[dict | None], batch: int) -> list[float | None]:
        entries = [run["decode"].get(str(batch), {}) if run else {} for run in runs]
        return [entry["count"] / entry["seconds"] if "seconds" in entry else None for entry in entries]

    made = []
    for batch in settings["batches"]:
        rows = []
        for name, runs in results.items():
            weights = raw["precisions"][name]
            measured = [rate for rate in rates(runs, batch) if rate]
            if not measured:
                rows.append([name, weights, engine_compute(name, runs, weights, described), "– (not run)", "", "", ""])
                continue
            per_token = {"fp32": fp32_bytes, "bf16": fp32_bytes // 2}.get(weights, builds[name]["bytes"])
            bound = batch * bandwidth / per_token
            median_rate = statistics.median(measured)
            seconds = builds[name]["seconds"]
            rows.append([
                name, weights, engine_compute(name, runs, weights, described), spread(measured),
                spread(paired_ratios(rates(runs, batch), rates(reference, batch)), 2),
                f"{median_rate / bound:.0%} of {bound:.0f}", "–" if seconds != seconds else f"{seconds:.0f}",
            ])  # fmt: skip
        columns = ["system", "weights", "compute", "tok/s: median (range)", "x transformers: median (range)"]
        columns += ["median's fraction of the bound", "build time (s)"]
        made.append(
            table(
                f"Decode, batch {batch} ({batch} x {settings['new_tokens']} tokens per run, "
                f"{'the encoder' if settings['seq2seq'] else 'prompt prefill'} included)",
                columns,
                rows,
            )
        )
    made[0]["text"] = [engine_workload(raw, settings)]
    if not settings["prefill_tokens"]:  # no time-to-first-token runs: agreement only
        rows = []
        for name, runs in results.items():
            tokens = next(run for run in runs if run)["decode"]["1"]["tokens"]
            rows.append([name, f"{first_difference(tokens, reference_tokens)}/{len(tokens)}", str(len(set(tokens)))])
        made.append(
            table(
                "Agreement (batch 1; greedy tokens equal to transformers fp32's before the first difference; how "
                "many distinct tokens the output has: a model with random weights tends to repeat one token)",
                ["system", "same tokens", "distinct tokens"],
                rows,
            )
        )
        return made

    def ttft(run: dict | None) -> float | None:
        return run["prefill"]["seconds"] if run and run.get("prefill") else None

    rows = []
    for name, runs in results.items():
        seconds = [ttft(run) for run in runs if ttft(run)]
        tokens = next(run for run in runs if run)["decode"]["1"]["tokens"]
        prompt_rate = f"{settings['prefill_tokens'] / statistics.median(seconds):.0f}" if seconds else "–"
        rows.append([
            name, spread([second * 1e3 for second in seconds], 0),
            spread(paired_ratios(list(map(ttft, reference)), list(map(ttft, runs))), 2), prompt_rate,
            f"{first_difference(tokens, reference_tokens)}/{len(tokens)}", raw["texts"][name],
        ])  # fmt: skip
    made.append(
        table(
            f"Prefill and quality (batch 1; time to first token for {settings['prefill_tokens']} prompt tokens; "
            f"greedy tokens equal to transformers fp32's before the first difference)",
            ["system", "TTFT (ms): median (range)", "x transformers: median (range)", "prompt tok/s", "same tokens",
             "text"],
            rows,
        )
    )  # fmt: skip
    return made


def engine_workload(raw: dict, settings: dict) -> str:
    """The paragraph above the engine tables: workload, rounds, the bandwidth each round measured and the bound."""
    bandwidths, fp32_bytes = raw["bandwidths"], raw["fp32_bytes"]
    if settings["seq2seq"]:
        workload = (
            f"source: the first {settings['prompt_length']} tokens of the package's story corpus, "
            f"{settings['new_tokens']} greedy tokens (end-of-sequence cannot stop them early), the encoder's run "
            "included"
        )
        bound_rule = (
            f"fp32 = 4 bytes x the parameters a decoder step reads (decoder layers less the cross-attention key and "
            f"value projections, which run once per sequence; the head shared with the embedding) = "
            f"{fp32_bytes / 1e6:.0f} MB; 8-bit = 1 byte x the same parameters (scales left out: a slightly high bound)"
        )
    else:
        workload = (
            f"prompt: the chat template around a fixed question ({settings['prompt_length']} tokens; each row's first "
            f"token one no earlier row began with, so that no engine's prefix cache holds it), "
            f"{settings['new_tokens']} greedy tokens; time to first token for a {settings['prefill_tokens']}-token "
            "prompt"
        )
        bound_rule = (
            f"fp32 = parameters x 4 = {fp32_bytes / 1e6:.0f} MB (the tied head read once); quantized = the size of "
            f"that system's weight files, less an embedding table stored apart from the head (a Gather reads one "
            f"row of it per token)"
        )
    return (
        f"CPU, {settings['threads']} threads; {workload}. Each system in a process of its own, {len(bandwidths)} "
        f"rounds in rotated order; tok/s is the median over rounds with the range over rounds beside it, x "
        f"transformers the median of per-round ratios (same round) with their range: a difference inside the ranges "
        f"is noise, not a lead. Weight-read bandwidth, measured each round: "
        f"{' / '.join(f'{b / 1e9:.1f}' for b in bandwidths)} GB/s (highest {max(bandwidths) / 1e9:.1f}). Bound = "
        f"batch x bandwidth / bytes read per token: {bound_rule}."
    )


def engine_compute(name: str, runs: list[dict | None], weights: str, described: dict) -> str:
    """The precision a system's arithmetic ran in: what an engine reported it chose (OpenVINO's
    INFERENCE_PRECISION_HINT), the OpenVINO route's automatic precision on this CPU, the unquantized precision, or
    vaswani's quantized kernels (MatMulNBits, int8 activations at the exporter's default accuracy level 4)."""
    info = next((run["info"] for run in runs if run and run.get("info")), {})
    if "INFERENCE_PRECISION_HINT" in info:
        return info["INFERENCE_PRECISION_HINT"].replace("f32", "fp32")
    if "--engine openvino" in name:
        return f"{'bf16' if computes_bfloat16(described) else 'fp32'} in OpenVINO's steps"
    if weights in ("fp32", "bf16"):
        return weights
    if name.startswith("vaswani ORT"):
        return "int8 activations (accuracy level 4)"
    return "not recorded"


def first_difference(tokens: list[int], reference: list[int]) -> int:
    """How many tokens two greedy outputs share before they first differ."""
    for index, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return index
    return min(len(tokens), len(reference))


@table_maker("export_memory")
def export_memory_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/export_memory.py: per run (a label for the code that ran) and precision, the whole `vaswani export`
    (wall and CPU seconds, the kernel's peak RSS against the float32 weights, the folder's bytes, its outcome), then
    each stage's start, seconds and sampled peak."""
    weights, gigabyte = raw["weights_bytes"], 1e9
    rows = []
    for label, runs in raw["runs"].items():
        for precision, run in runs.items():
            rows.append([
                label, precision, f"{run['seconds']:.0f} s",
                f"{run['cpu_seconds']:.0f} s" if "cpu_seconds" in run else "-",
                f"{run['peak_rss_bytes'] / gigabyte:.2f} GB", f"{run['peak_rss_bytes'] / weights:.2f}x",
                f"{run['output_bytes'] / gigabyte:.2f} GB" if "output_bytes" in run else "-",
                run.get("outcome", "written, validated"),
            ])  # fmt: skip
    columns = ["code", "precision", "wall time", "CPU time", "peak RSS", "peak / fp32 weights", "folder", "result"]
    exports = table("Exports", columns, rows)
    exports["text"] = [
        f"`{raw['model_description']}`: {weights / 4 / 1e9:.3f}B parameters, {weights / gigabyte:.2f} GB of float32 "
        "weights. Seeded random weights at a trained model's scales: time and memory do not depend on the values, "
        "quality is not measured here. Each export is one `vaswani export --model` process, run alone; its peak is "
        "the kernel's (`ru_maxrss`), each stage's the largest resident set sampled every 50 ms while it ran (file "
        "pages the process maps, such as the safetensors weights, count as they are read). Targets: peak RSS at "
        "most 1.5x the float32 weights, an fp32 export within 60 s on 2 cores.",
        *raw.get("notes", []),
    ]
    made = [exports]
    for label, runs in raw["runs"].items():
        for precision, run in runs.items():
            rows = []
            for stage in run["stages"]:
                peak = stage["peak_rss_bytes"]
                shown = [f"{peak / gigabyte:.2f} GB", f"{peak / weights:.2f}x"] if peak else ["-", "-"]
                text = stage["line"].replace("|", "/")[:110]
                rows.append([text, f"{stage['start']:.1f} s", f"{stage['seconds']:.1f}", *shown])
            columns = ["stage (the progress line that starts it)", "starts", "seconds", "peak RSS", "/ fp32 weights"]
            made.append(table(f"Stages: {precision}, {label}", columns, rows))
    return made


PROFILE_PARTS = ("weight products", "attention", "other nodes", "run overhead", "loop")


@table_maker("profile_decode")
def profile_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/profile_decode.py: per export, each part of a step in microseconds (the median over rounds of each
    round's median over steps), the step as their sum with the range of the rounds' own sums beside it, and for
    decode steps the rate the weight products read at."""
    settings, prompt_step = raw["settings"], raw["settings"]["prompt_step"]
    rows = []
    for name, rounds in raw["rounds"].items():
        medians = {part: statistics.median(summary[part] for summary in rounds) for part in PROFILE_PARTS}
        totals = [sum(summary[part] for part in PROFILE_PARTS) for summary in rounds]
        step = f"{sum(medians.values()):.0f}" + (f" ({min(totals):.0f}-{max(totals):.0f})" if len(totals) > 1 else "")
        cells = [name, step, *(f"{medians[part]:.0f}" for part in PROFILE_PARTS)]
        if not prompt_step:  # a prompt step computes far more per weight byte than it reads: its read rate says nothing
            cells.append(spread([summary["GB/s"] for summary in rounds], 1, " GB/s"))
        rows.append(cells)
    columns = ["export", "step (range of the rounds' sums)", *PROFILE_PARTS]
    if not prompt_step:
        columns.append("weight products read at")
    made = table("Results", columns, rows)
    rounds = len(next(iter(raw["rounds"].values())))
    made["text"] = [
        f"The prompt step of {settings['prompt']} tokens at batch 1 (time to first token), {settings['threads']} "
        f"threads; ONNX Runtime's profiler, each export in its own process, {rounds} alternating rounds; "
        "microseconds, median over rounds."
        if prompt_step
        else f"Decode steps at batch 1 after a {settings['prompt']}-token prompt, {settings['new_tokens']} greedy "
        f"tokens, {settings['threads']} threads; ONNX Runtime's profiler, each export in its own process, {rounds} "
        f"alternating rounds; microseconds per step, median over steps (the first {settings['skip']} left out), then "
        "over rounds."
    ]
    return [made]


@table_maker("gpu_decode")
def gpu_decode_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/benchmark_gpu.py: the export's validation, the greedy agreement per prompt, then per system and
    batch size the decode rate and time to first token (medians with the range over rounds), each round's fraction
    of the bound that same round measured, and the rate against transformers' static-cache model round by round."""
    text = [
        "SmolLM2-135M-Instruct's shape with seeded random weights at the trained tensors' scales (speed does not "
        "depend on the values; quality is not measured here)."
    ]
    exported = raw.get("export")
    if exported:
        validation = exported["validation"] or {}
        logits = [row for row in validation.get("rows", []) if row["output"] == "logits"]
        worst = max(logits, key=lambda row: row["max_abs_diff"] / row["allowed"]) if logits else {}
        text.append(
            f"**Export.** `{exported['command']}`: {exported['seconds']:.0f} s; validated on "
            f"{validation.get('provider')} against PyTorch ({validation.get('tolerance_kind')} tolerance): passed "
            f"{validation.get('passed')}; logits' largest difference {worst.get('max_abs_diff', float('nan')):.4g} "
            f"where {worst.get('allowed', float('nan')):.4g} is allowed ({worst.get('case', '-')})."
        )
    made = []
    parity = raw.get("parity")
    if parity:
        prompts = len(parity["rows"]) // 2 or 1
        text.append(
            f"Greedy agreement over {parity['new_tokens']} new tokens on chat-templated prompts: the leading tokens "
            f"each pair of runs shares, per prompt ({prompts} prompts alone, then the same {prompts} as one "
            "left-padded batch). transformers' float32 model is the oracle: fp16 rounding alone moves near-ties, and "
            "random weights have many."
        )
        rows = [
            [
                str(index % prompts + 1), str(row["batch"]), str(row["ort_fp16_vs_pytorch_fp16"]),
                str(row["ort_fp16_vs_pytorch_fp32"]), str(row["pytorch_fp16_vs_pytorch_fp32"]),
                f"{row['first_step_top2_gap_fp32']:.3f}",
            ]
            for index, row in enumerate(parity["rows"])
        ]  # fmt: skip
        columns = [
            "prompt", "batch", "vaswani ORT fp16 = PyTorch fp16", "vaswani ORT fp16 = PyTorch fp32",
            "PyTorch fp16 = PyTorch fp32", "first step's top-2 gap (fp32)",
        ]  # fmt: skip
        made.append(table("Greedy agreement", columns, rows))
        made[-1]["text"], text = text, []
    settings, rows = raw["settings"], []
    baseline = raw["runs"].get("transformers-static") or []
    for name, results in raw["runs"].items():
        if not results:
            continue
        for index, first in enumerate(results[0]["rows"]):
            rates = [result["rows"][index]["decode_tokens_per_s"] for result in results]
            reference = [result["rows"][index]["decode_tokens_per_s"] for result in baseline]
            rows.append([
                name, str(first["batch_size"]),
                spread([result["rows"][index]["time_to_first_token_s"] * 1e3 for result in results], 1, " ms"),
                spread(rates, 0), spread([result["rows"][index]["bound_fraction"] * 100 for result in results], 1, "%"),
                spread(paired_ratios(rates, reference), 2, "x") if reference else "-",
            ])  # fmt: skip
    if rows:
        columns = [
            "system",
            "batch",
            "time to first token",
            "decode tokens/s",
            "of the bound",
            "vs transformers static",
        ]
        made.append(table("Decode", columns, rows))
        made[-1]["text"] = text + [
            f"Decode speed, fp16, greedy, {settings['prompt_tokens']}-token prompts, {settings['new_tokens']} new "
            f"tokens; {settings['rounds']} round(s), medians with the range over rounds (each system in a process of "
            "its own, alternating). Each round's bound is the memory bandwidth `vaswani bench` measured in that round, "
            "over the weight bytes a step reads; systems with no round did not run."
        ]
        text = []
    first_run = raw.get("first_run")
    if first_run and made:
        made[-1].setdefault("text", []).append(
            f"An earlier run (commit {first_run['commit']}, {first_run['settings']['new_tokens']} new tokens): "
            f"{first_run['note']}: `{first_run['log']}`."
        )
    for name, error in raw.get("failures", {}).items():
        made.append(table(f"{name} failed", ["error (its last lines)"], [[error.strip()[-300:].replace("|", "/")]]))
    return made


@table_maker("reference_cpu")
def reference_cpu_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/benchmark_reference_cpu.py: per build and batch size, from each round's `vaswani bench` result, the
    decode rate and time to first token (medians with the range over rounds) and the batch-1 bound with each row's
    fraction of it (per sequence), but only from rounds whose bandwidth probe read on the decode's own threads (earlier runs probed
    on torch's one thread while ONNX Runtime decoded on two: their fractions are withdrawn)."""
    settings, rows = raw["settings"], []
    for name, results in raw["runs"].items():
        if not results:
            continue
        for index, first in enumerate(results[0]["rows"]):
            batch = first["batch_size"]
            rates = [result["rows"][index]["decode_tokens_per_s"] for result in results]
            first_token = [result["rows"][index]["time_to_first_token_s"] for result in results]
            probed = [
                result
                for result in results
                if result.get("bandwidth_threads") is not None
                and result["bandwidth_threads"] == result["machine"].get("threads")
            ]
            bound = fraction = "withdrawn"
            if probed:
                bound = spread([result["bound_tokens_per_s"] for result in probed], 2, " tokens/s")
                fraction = spread([result["rows"][index]["bound_fraction"] * 100 for result in probed], 1, "%")
            rows.append([
                name, str(batch), f"{results[0]['weight_bytes'] / 1e9:.2f} GB", spread(first_token, 2, " s"),
                spread(rates, 2), bound, fraction,
            ])  # fmt: skip
    builds = table("Builds", ["build", "what"], [[name, what] for name, what in raw["builds"].items()])
    builds["text"] = [
        "Builds of `benchmarks/reference_shapes.py` folders (Llama-3.2-1B's and SmolLM2-360M's shapes, seeded random "
        "weights at a trained model's scales: speed does not depend on the values; quality is not measured here), "
        f"timed with `vaswani bench`: {settings['prompt_tokens']}-token prompts, {settings['new_tokens']} new tokens, "
        f"greedy, {settings['rounds']} rounds (each build in a process of its own, alternating); medians with the "
        "range over rounds. The bound is the read bandwidth (a sum over 1 GiB on the decode's threads) over the weight "
        "bytes one step reads; a batch's fraction is per sequence.",
        *raw.get("notes", []),
    ]
    if any(row[-1] == "withdrawn" for row in rows):
        builds["text"].append(
            'Rows whose bound reads "withdrawn" come from rounds whose bandwidth probe read on torch\'s one thread '
            "while ONNX Runtime decoded on two, so their fractions were not of a bound for that decode (one showed "
            "108%); the script measures them again."
        )
    columns = [
        "build",
        "batch",
        "weight bytes",
        "time to first token",
        "decode tokens/s",
        "bound (batch 1)",
        "of the bound",
    ]
    made = [builds, table("Decode", columns, rows)]
    for name, error in raw.get("failures", {}).items():
        made.append(table(f"{name} failed", ["error (its last lines)"], [[error.strip()[-300:].replace("|", "/")]]))
    return made


@table_maker("int4_domains")
def int4_domain_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/int4_domains.py's own maker (`domain_tables`: perplexity per build on tuning and held-out texts),
    imported when a page needs it, since that script imports this module."""
    from int4_domains import domain_tables

    return domain_tables(raw, described)


@table_maker("matmul_bounds")
def matmul_bounds_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/matmul_bounds.py: per model and format, the worst honest quantized matrix of each width and the
    mildest broken one, each a relative RMS error fed the float graph's activations; then the logits' error end to
    end beside the float model's response to simulated rounding (`validation.ROUNDING_BITS`)."""
    rows, end_to_end = [], []
    for model, formats in raw.items():
        for quantize, measured in formats.items():
            honest = measured["honest"]
            worst = {
                bits: max(row["relative_rms"] for row in honest if row["bits"] == bits)
                for bits in sorted({row["bits"] for row in honest})
            }
            mildest = min(measured["broken"], key=lambda row: row["relative_rms"])
            rows.append([
                model, quantize, str(len(honest)),
                ", ".join(f"{bits}-bit {value:.4f}" for bits, value in worst.items()),
                f"{mildest['relative_rms']:.3f} ({mildest['how']}, {mildest['position']})",
            ])  # fmt: skip
            response = measured["response_logits_relative_rms"]
            end_to_end.append([
                model, quantize, f"{measured['logits_relative_rms']:.4f}", f"{response:.4f}",
                f"{measured['logits_relative_rms'] / response:.2f}" if response else "–",
                "yes" if measured["passed"] else "no",
            ])  # fmt: skip
    columns = ["model", "format", "matrices", "worst honest matrix", "mildest broken matrix"]
    made = [table("Each quantized matrix, fed the float graph's activations (relative RMS error)", columns, rows)]
    columns = ["model", "format", "logits relative RMS", "simulated rounding's", "ratio", "export validated"]
    made.append(
        table("End to end: the logits against the float model's response to simulated rounding", columns, end_to_end)
    )
    return made


@table_maker("side_by_side")
def side_by_side_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/benchmark.py: per family, each task's median seconds for transformers' model and vaswani's (the
    script keeps the medians of its alternating repeats, not the repeats), in milliseconds, their ratio, and tokens/s
    where the task generates."""
    made = []
    for title, rows in raw.items():
        cells = []
        for row in rows:
            reference, ours = row["reference_seconds"], row["vaswani_seconds"]
            cells.append(
                [f"{row['label']} (ms)", f"{reference * 1e3:.1f}", f"{ours * 1e3:.1f}", f"{ours / reference:.3f}"]
            )
            if row["tokens"]:
                tokens = row["tokens"]
                cells.append([f"{row['label']} (tokens/s)", f"{tokens / reference:.1f}", f"{tokens / ours:.1f}", ""])
        made.append(table(title, ["figure", "transformers", "vaswani", "vaswani / transformers"], cells))
    return made


@table_maker("string_reversal")
def string_reversal_tables(raw: dict, described: dict) -> list[dict]:
    """examples/train_string_reversal.py: per evaluated string length, the teacher-forced token accuracy and the
    greedy exact match measured on fresh strings, beside the accuracy the textbook reports for that length."""
    args, textbook, rows = raw["args"], raw.get("textbook", {}), []
    for row in raw["per_length"]:
        length = row["length"]
        note = "" if args["min_length"] <= length <= args["max_length"] else " (longer than any training string)"
        reported = textbook.get(str(length))
        rows.append([
            f"{length}{note}", f"{100 * row['token_accuracy']:.2f}%", "" if reported is None else f"{reported}%",
            f"{100 * row['exact_match']:.2f}%",
        ])  # fmt: skip
    columns = ["length", "teacher-forced token accuracy", "textbook", "greedy exact match"]
    return [table("Accuracy by string length", columns, rows)]


@table_maker("build_time")
def build_time_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/benchmark_build.py: per precision, the seconds of the two ways to build an export (two commands,
    convert then export, against one `vaswani export --model HF_DIR`) and of their parts, each the median with the
    range over rounds; what one process saves, round by round; whether both ways wrote the same graph every round;
    then the seconds each way's processes took to exit after their last line of output."""
    settings, rows = raw["settings"], []
    for precision, ways in raw["runs"].items():
        two, one = ways["two commands"], ways["one process"]
        saved = [a - b for a, b in zip(two["total"], one["total"])]
        identical = "yes" if all(raw["graphs_identical"][precision]) else "NO"
        rows.append([precision, *(spread(values) for values in (two["total"], two["convert"], two["export"])),
                     spread(one["total"]), spread(saved), identical])  # fmt: skip
    columns = ["precision", "two commands", "convert", "export", "one process", "saved", "graphs identical"]
    seconds = table("Seconds, wall clock: median (range over rounds)", columns, rows)
    start, end = settings["load_average"]
    seconds["text"] = [
        f"Every command in a fresh process, the two ways alternating, {settings['rounds']} round(s), on "
        f"{settings['hf']}. Load average {start:.1f} at the start and {end:.1f} at the end (1-minute): a shared "
        "machine inflates every figure.",
    ]
    exits = [[way, spread([value for ways in raw["runs"].values() for value in ways[way]["exit"]])]
             for way in ("two commands", "one process")]  # fmt: skip
    exit_table = table(
        "Seconds from each build's last line of output to its processes' exit", ["way", "seconds"], exits
    )
    return [seconds, exit_table]


@table_maker("serve_mixed")
def serve_mixed_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/benchmark_serve_mixed.py: per request rate and server, the medians over rounds of each round's
    summary (output throughput with its range over rounds, request throughput, time to first token, inter-token
    latency and time per output token percentiles), and the failed requests of every round together."""

    def median_of(summaries: list[dict], *keys: str) -> float:
        values = []
        for value in summaries:
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, (int, float)) and value == value:
                values.append(value)
        return statistics.median(values) if values else float("nan")

    arguments, rows = raw["meta"]["args"], []
    for rate in json.loads(str(arguments["rates"]).replace("inf", "Infinity")):
        for engine in arguments["engines"]:
            runs = [run["summary"] for run in raw["runs"] if run["engine"] == engine and run["rate"] == str(rate)]
            if not runs:
                continue
            rows.append([
                str(rate), engine, spread([run.get("output_throughput") for run in runs]),
                f"{median_of(runs, 'request_throughput'):.2f}", f"{median_of(runs, 'ttft_ms', 'p50'):.0f}",
                f"{median_of(runs, 'ttft_ms', 'p95'):.0f}", f"{median_of(runs, 'itl_ms', 'p50'):.1f}",
                f"{median_of(runs, 'itl_ms', 'p95'):.1f}", f"{median_of(runs, 'tpot_ms', 'p50'):.1f}",
                str(sum(run["failed"] for run in runs)),
            ])  # fmt: skip
    columns = ["rate (req/s)", "server", "output tok/s: median (range)", "req/s", "TTFT p50 ms", "TTFT p95 ms"]
    columns += ["ITL p50 ms", "ITL p95 ms", "TPOT p50 ms", "failed"]
    return [table("Results", columns, rows)]


@table_maker("quantized_validation")
def quantized_validation_tables(raw: list[dict], described: dict) -> list[dict]:
    """benchmarks/quantized_validation_bounds.py: per export (model, quantization, honest or corrupted graph), the
    logits' largest relative RMS error, lowest cosine and lowest top-1 agreement over the validation cases, then the
    states' (caches, encoder outputs) largest relative RMS with the output it belongs to, and lowest cosine."""

    def worst(rows: list[dict]) -> tuple[str, str, str]:
        if not rows:
            return "", "", ""
        largest = max(rows, key=lambda row: row["relative_rms"])
        top1 = [row["top1"] for row in rows if row["top1"] is not None]
        return (
            f"{largest['relative_rms']:.4f} ({largest['output'].split('/')[-1]})",
            f"{min(row['cosine'] for row in rows):.5f}",
            f"{min(top1):.3f}" if top1 else "",
        )

    rows = []
    for entry in raw:
        logits = [row for row in entry["rows"] if row["output"].endswith("/logits")]
        states = [row for row in entry["rows"] if not row["output"].endswith("/logits")]
        (logits_rms, logits_cosine, top1), (states_rms, states_cosine, _) = worst(logits), worst(states)
        rows.append([entry["model"], entry["quantization"], entry["graph"], logits_rms.split(" ")[0], logits_cosine,
                     top1, states_rms, states_cosine])  # fmt: skip
    columns = ["model", "quantization", "graph", "logits rel. RMS", "logits cosine", "top-1"]
    columns += ["states rel. RMS (worst)", "states cosine"]
    return [table("Honest and corrupted exports", columns, rows)]


def computes_its_tables(results: dict) -> bool:
    """Whether a results dictionary's tables are computed from its raw values (`tables_from`) rather than kept as
    formatted text (`tables`)."""
    return "tables_from" in results


def results_tables(results: dict) -> list[dict]:
    """The page's tables: computed from `raw` by the maker its script named, or the text the JSON keeps."""
    if computes_its_tables(results):
        return TABLE_MAKERS[results["tables_from"]](results["raw"], results["machine"])
    return results["tables"]


def render(results: dict, json_name: str) -> str:
    """The page's rendered part, from a results dictionary as read back from `json_name`."""
    again = f"render again with `python benchmarks/results.py docs/results/{json_name}`"
    if computes_its_tables(results):
        source = f"raw results: [{json_name}]({json_name}), from which every table figure is computed; {again}"
    else:
        source = (
            f"its report: [{json_name}]({json_name}), which keeps these tables as the run's formatted text, not "
            f"computed from raw values; {again}"
        )
    parts = [
        f"# {results['title']}",
        f"Made by `{results['command']}` ({source}).",
        f"Machine: {describe_machine(results['machine'])}",
        *results.get("notes", []),
        *(render_table(rendered) for rendered in results_tables(results)),
        *results.get("after", []),
        RENDERED_END if computes_its_tables(results) else TEXT_END,
    ]
    return "\n\n".join(parts) + "\n"


def command_line() -> str:
    """This process's command as a reader would type it from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    root = Path(__file__).resolve().parents[1]
    shown = script.relative_to(root) if script.is_relative_to(root) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def from_markdown(report: str, raw, threads: int | None, shared: bool = True) -> dict:
    """A results dictionary from a script's Markdown report, for scripts that print one: its first `# ` heading is
    the title, its tables (each with the bold or `#` heading just above it, and the paragraphs before that since the
    previous table) the tables, the paragraphs after the last table `after`; `raw` is what the script measured."""
    blocks = [block.strip("\n") for block in report.strip().split("\n\n") if block.strip()]
    title, tables, pending = "Results", [], []
    for block in blocks:
        lines = block.splitlines()
        if lines[0].startswith("# ") and title == "Results" and not tables and not pending:
            title = lines[0][2:].strip()
            block = "\n".join(lines[1:]).strip()
            if not block:
                continue
            lines = block.splitlines()
        rows = [line for line in lines if line.startswith("|")]
        if len(rows) >= 2 and len(rows) == len(lines) and set(rows[1].replace("|", "").strip()) <= set("-: "):
            heading = (
                pending.pop() if pending and (pending[-1].startswith(("**", "#")) and "\n" not in pending[-1]) else ""
            )
            cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]
            tables.append(table(heading.strip("*# ") or "Results", cells[0], cells[2:]))
            tables[-1]["text"], pending = pending, []
        else:
            pending.append(block)
    if not tables:
        raise ValueError("the report has no table to publish")
    return {"title": title, "command": command_line(), "machine": machine(threads, shared), "tables": tables,
            "after": pending, "raw": raw}  # fmt: skip


def publish_report(report: str, json_path: Path, markdown_path: Path | None, raw, threads: int | None) -> str:
    """`write` for a script that makes a Markdown report: its results and tables as JSON in `json_path`, and the
    page rendered from that JSON in `markdown_path`. The tables are the report's text, and the page says so
    (`TEXT_END`): a script whose figures should be computed from raw values names a table maker instead."""
    return write(from_markdown(report, raw, threads), json_path, markdown_path)


def rendered_part(page_text: str) -> str:
    """A page's text up to and including the rendered part's end marker ("" when it has none)."""
    for end in (RENDERED_END, TEXT_END):
        head, marker, _ = page_text.partition(end)
        if marker:
            return head + marker + "\n"
    return ""


def hand_written_part(page_text: str) -> str:
    """What a page says after its rendered part (kept when the page is rendered again)."""
    return page_text[len(rendered_part(page_text)) :] if rendered_part(page_text) else ""


def write(results: dict, json_path: Path, markdown_path: Path | None = None) -> str:
    """Save `results` as JSON, then render the page from the saved file (kept after the rendered part: whatever
    the existing page says below it) and write it to `markdown_path`. Returns the page."""
    json_path = Path(json_path)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    page = render(json.loads(json_path.read_text()), json_path.name)
    if markdown_path is not None:
        markdown_path = Path(markdown_path)
        kept = hand_written_part(markdown_path.read_text()) if markdown_path.is_file() else ""
        markdown_path.write_text(page + kept)
    return page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="a results JSON file (docs/results/NAME.json)")
    parser.add_argument("--output", type=Path, help="the page to (re)write; default: print the rendered part")
    args = parser.parse_args()
    results = json.loads(args.json.read_text())
    if args.output:
        kept = hand_written_part(args.output.read_text()) if args.output.is_file() else ""
        args.output.write_text(render(results, args.json.name) + kept)
    else:
        print(render(results, args.json.name), end="")


if __name__ == "__main__":
    main()
