"""Table makers of the engine comparisons: `benchmarks.benchmark_engines` (vaswani against onnxruntime-genai,
llama.cpp, OpenVINO GenAI, ...), `benchmarks.openvino_route` (vaswani's own OpenVINO route) and
`benchmarks.profile_decode` (where a decode step's time goes)."""

import statistics

from benchmarks.results.cells import paired_ratios, spread, table

# What ggml's CPU kernels multiply a GGUF type's weights by: activations rounded to the type's `vec_dot_type`
# (ggml-cpu.c's type traits), int8 with a scale per block of 32 (Q8_0, Q8_1) or 256 (Q8_K); the repacked x86
# kernels of Q4_0 take the same Q8_0 blocks.
GGML_ACTIVATIONS = {
    "Q8_0": "int8 activations in blocks of 32 (ggml's Q8_0)",
    "Q4_0": "int8 activations in blocks of 32 (ggml's Q8_0)",
    "Q4_1": "int8 activations in blocks of 32 (ggml's Q8_1)",
    "Q4_K_M": "int8 activations in blocks of 256 (ggml's Q8_K)",
}


def computes_bfloat16(described: dict) -> bool:
    """Whether the machine's CPU has bfloat16 arithmetic (AVX512_BF16 or AMX), where OpenVINO's CPU plugin computes
    in bf16 unless told otherwise (its INFERENCE_PRECISION_HINT default)."""
    flags = described["cpu"]["flags"]
    return bool(flags.get("avx512_bf16") or flags.get("amx_tile"))


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
            f"{first_difference(tokens, reference_tokens)}/{len(tokens)}", one_line(raw["texts"][name]),
        ])  # fmt: skip
    if memory := memory_table(results, builds):
        made.append(memory)
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


def memory_table(results: dict, builds: dict) -> dict | None:
    """Each system's process memory once its workloads ran (`worker.memory`; medians with the range over rounds, in
    MB), beside its weight files; None for runs that did not record it."""
    rows = []
    for name, runs in results.items():
        measured = [run["memory"] for run in runs if run and run.get("memory")]
        if not measured:
            continue
        figures = [spread([entry[key] / 1e6 for entry in measured], 0) for key in MEMORY_KEYS]
        files = builds.get(name, {}).get("bytes")
        rows.append([name, *figures, "–" if not files else f"{files / 1e6:.0f}"])
    if not rows:
        return None
    made = table(
        "Memory (each system's process after its runs, MB: median (range))",
        ["system", "peak resident", "anonymous at the end", "file-mapped at the end", "weight files"],
        rows,
    )
    made["text"] = [
        "Anonymous memory is the process's own (weights copied or laid out for its kernels, caches); file-mapped "
        "memory is files it maps, such as weights read in place: page cache, shared with other processes and "
        "reclaimable. Peak resident counts both, at their highest."
    ]
    return made


MEMORY_KEYS = ("peak_rss_bytes", "anon_bytes", "file_bytes")


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


def openvino_compute(info: dict, weights: str) -> str:
    """The compute an OpenVINO compiled model's read-back properties name: its precision and, for compressed weights,
    the group size in which the CPU plugin quantizes their products' activations to int8 (0 turns it off). That
    rounding changes an fp32-hinted int8 model's logits (relative RMS 0.03 on SmolLM2-135M), so it is part of the
    compute a row names."""
    precision = info["INFERENCE_PRECISION_HINT"].replace("f32", "fp32")
    group = int(info.get("DYNAMIC_QUANTIZATION_GROUP_SIZE") or 0)
    if group and weights not in ("fp32", "bf16"):
        precision += f", int8 activations in groups of {group}"
    return precision


def engine_compute(name: str, runs: list[dict | None], weights: str, described: dict) -> str:
    """The precision a system's arithmetic ran in: what an engine reported it chose (OpenVINO's
    INFERENCE_PRECISION_HINT), the OpenVINO route's automatic precision on this CPU, the unquantized precision, or
    vaswani's quantized kernels (MatMulNBits, int8 activations at the exporter's default accuracy level 4)."""
    info = next((run["info"] for run in runs if run and run.get("info")), {})
    if "INFERENCE_PRECISION_HINT" in info:
        precision = openvino_compute(info, weights)
        steps = {name.removeprefix("steps "): value for name, value in info.items() if name.startswith("steps ")}
        if steps and openvino_compute(steps, weights) != precision:  # decode steps compiled apart, computing otherwise
            return f"{precision} for prompts; {openvino_compute(steps, weights)} for decode steps (OpenVINO's calls)"
        return precision + (" in OpenVINO's steps" if "--engine openvino" in name else "")
    if "--engine openvino" in name:
        return f"{'bf16' if computes_bfloat16(described) else 'fp32'} in OpenVINO's steps"
    if weights in ("fp32", "bf16"):
        return weights
    if name.startswith("vaswani ORT"):
        return "int8 activations (accuracy level 4)"
    if name.startswith("llama.cpp "):
        return GGML_ACTIVATIONS.get(name.removeprefix("llama.cpp "), "not recorded")
    return "not recorded"


def one_line(text: str) -> str:
    """A decoded text as one table cell: its line breaks (random weights decode "\r" too) as spaces."""
    return text.replace("\r", " ").replace("\n", " ")


def first_difference(tokens: list[int], reference: list[int]) -> int:
    """How many tokens two greedy outputs share before they first differ."""
    for index, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return index
    return min(len(tokens), len(reference))


PROFILE_PARTS = ("weight products", "attention", "other nodes", "run overhead", "loop")


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
    batch = settings.get("batch", 1)  # pages made before --batch profiled batch 1
    made["text"] = [
        f"The prompt step of {settings['prompt']} tokens at batch 1 (time to first token), {settings['threads']} "
        f"threads; ONNX Runtime's profiler, each export in its own process, {rounds} alternating rounds; "
        "microseconds, median over rounds."
        if prompt_step
        else f"Decode steps at batch {batch} after a {settings['prompt']}-token prompt"
        f"{' (each row its own)' if batch > 1 else ''}, {settings['new_tokens']} greedy "
        f"tokens, {settings['threads']} threads; ONNX Runtime's profiler, each export in its own process, {rounds} "
        f"alternating rounds; microseconds per step, median over steps (the first {settings['skip']} left out), then "
        "over rounds."
    ]
    if settings.get("openvino"):  # pages made before --openvino profiled ONNX Runtime only
        made["text"].append(
            f"Run through `--engine openvino` and profiled by OpenVINO's performance counters: "
            f"{', '.join(settings['openvino'])}. There the weight products are the CPU plugin's FullyConnected nodes, "
            "attention its ScaledDotProductAttention and RoPE nodes, run overhead the call's time outside its nodes "
            "(Python's feeds and the logits' copy included), and the read rate counts every weight product's bytes "
            "once per step."
        )
    return [made]
