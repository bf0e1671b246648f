"""Table makers of the speed and cost pages: the side-by-side benchmark against transformers, the GPU and
reference-CPU decode bounds, the exporter's time and memory, the build times and mixed serving."""

import json
import statistics

from benchmarks.results.cells import paired_ratios, spread, table
from benchmarks.results.serve_workloads import memory_tables


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
    return [table("Results", columns, rows), *memory_tables(raw)]


def speculative_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/benchmark_speculative.py's page: each round's plain and speculative output tok/s, their ratio, the
    proposals kept and how many greedy answers equal plain decoding's; then the medians with their ranges."""
    rounds, answers = raw["rounds"], raw["answers"]
    rows = [
        [
            entry["round"],
            entry["tokens"],
            f"{entry['plain_tok_s']:.1f}",
            f"{entry['speculative_tok_s']:.1f}",
            f"{entry['speculative_tok_s'] / entry['plain_tok_s']:.2f}x",
            f"{entry['accepted_tokens'] / entry['draft_tokens']:.2f}" if entry["draft_tokens"] else "–",
            entry["draft_tokens"],
            entry["accepted_tokens"],
            f"{entry['identical_answers']}/{answers}",
        ]  # fmt: skip
        for entry in rounds
    ]
    columns = ["round", "tokens", "plain tok/s", "speculative tok/s", "speed-up", "acceptance rate", "proposed"]
    columns += ["kept", "identical"]
    summary = [
        spread([entry["plain_tok_s"] for entry in rounds]),
        spread([entry["speculative_tok_s"] for entry in rounds]),
        spread([entry["speculative_tok_s"] / entry["plain_tok_s"] for entry in rounds], 2, "x"),
    ]
    return [
        table("Each round", columns, rows),
        table("Over the rounds (median, range)", ["plain tok/s", "speculative tok/s", "speed-up"], [summary]),
    ]


def paged_call_sizes_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/paged_call_sizes.py's page: a call's milliseconds by the tokens it feeds, the median of the rounds
    with their range, and per token."""
    runs = raw["runs"]
    counts = sorted({int(count) for run in runs for count in run["milliseconds"]})
    rows = []
    for count in counts:
        values = [run["milliseconds"][str(count)] for run in runs if str(count) in run["milliseconds"]]
        rows.append([count, spread(values), f"{statistics.median(values) / count:.3f}"])
    heading = f"One call feeding one prompt's tokens; {runs[0]['description']}" if runs else "One call"
    return [table(heading, ["tokens", "ms: median (range)", "ms per token"], rows)]


def one_row_steps_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/one_row_steps.py's page: milliseconds of a one-row decode step per export and route (median of the
    rounds with their range), and ONNX Runtime's step over OpenVINO's per round (above 1: OpenVINO's is faster)."""
    rows = []
    for name in raw["exports"]:
        steps = {
            route: {
                run["round"]: run["step_ms"] for run in raw["runs"] if run["export"] == name and run["route"] == route
            }
            for route in ("onnxruntime", "openvino")
        }
        ratios = [
            steps["onnxruntime"][r] / steps["openvino"][r] for r in steps["openvino"] if r in steps["onnxruntime"]
        ]
        megabytes = f"{raw['weight_bytes'][name] / 1e6:.0f}"
        times = [spread(list(steps[route].values())) for route in ("onnxruntime", "openvino")]
        rows.append([name, megabytes, *times, spread(ratios, digits=2)])
    columns = [
        "export",
        "graph files, MB",
        "ONNX Runtime, ms a step",
        "OpenVINO f32, ms a step",
        "ONNX Runtime / OpenVINO",
    ]
    return [table(f"One-row decode steps, {raw['new_tokens']} tokens after the prompt", columns, rows)]
