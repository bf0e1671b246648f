"""`vaswani serve` under concurrent streaming clients against offline `generate` on the same exported folder.

For each folder, in rounds, each system in a process of its own (both stay loaded; one idles while the other runs):
- offline: `OrtModelForCausalLM.generate` on the chat prompt at batch 1 and at batch 8 (the prompt repeated),
  `--new-tokens` greedy tokens (end-of-sequence cannot stop them early), after a warm-up; tokens/s include prefill;
- served: `vaswani serve FOLDER --threads T` in a subprocess, then 1, 4, 8, 16 (`--clients`) concurrent streaming
  clients (asyncio + httpx in this process), each asking for `--new-tokens` tokens of the same chat prompt
  (`ignore_eos`), all sent at once. Throughput: all tokens over the time from the first request sent to the last
  token received. Time to first token: request sent to first content chunk. Inter-token latency: the gaps between a
  stream's content chunks (one chunk per token, except where a token ends inside a character).
In each round offline batch 1 runs right before 1 client and offline batch 8 right before 8 clients.

Targets (issue 19): 8 clients reach 0.9x the offline batch-8 throughput; one client is within 10% of offline
batch-1 speed; nothing is starved: inter-token latency p95 under 3x p50. Ratios are taken within a round, then the
median over rounds is reported, since the shared machine's load drifts within minutes.

    python -m benchmarks.benchmark_serve --folders /tmp/smol/onnx-int8 /tmp/smol/onnx-fp32 --rounds 5 \\
        --markdown docs/results/benchmark_serve_cpu.md
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import command_line

QUESTION = "What are three good habits for writing clear, maintainable Python code? Answer briefly."
ROOT = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# ------------------------------------------------------------------------------------------- offline reference


def offline_worker(folder: str, threads: int, new_tokens: int) -> None:
    """A process of its own that loads the folder once, then for each batch size read from stdin runs `generate` and
    prints the tokens/s as a JSON line (it idles between requests, so the server can run in between)."""
    import torch
    from transformers import AutoTokenizer

    from vaswani.runtime import OrtModelForCausalLM, default_session_options

    torch.set_num_threads(threads)
    model = OrtModelForCausalLM.from_pretrained(folder, session_options=default_session_options(threads))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": QUESTION}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])

    def generate(batch: int, tokens: int) -> float:
        ids = torch.tensor([prompt] * batch)
        start = time.perf_counter()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
        )
        return batch * tokens / (time.perf_counter() - start)

    for batch in (1, 8):
        generate(batch, 8)  # warm-up
    print(json.dumps({"ready": True, "prompt_tokens": len(prompt)}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"tokens/s": generate(int(line), new_tokens)}), flush=True)


class Offline:
    """The offline worker process; `run(batch)` returns its tokens/s."""

    def __init__(self, folder: str, args):
        command = [sys.executable, "-m", __spec__.name, "--offline-worker", folder, "--threads", str(args.threads)]
        command += ["--new-tokens", str(args.new_tokens)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the offline worker exited")
        return json.loads(line)

    def run(self, batch: int) -> float:
        self.process.stdin.write(f"{batch}\n")
        self.process.stdin.flush()
        return self._read()["tokens/s"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


# ------------------------------------------------------------------------------------------------ served


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(folder: str, args) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vaswani.cli.main",
        "serve",
        folder,
        "--port",
        str(port),
        "--threads",
        str(args.threads),
    ]
    command += ["--max-batch", str(max(args.clients)), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    # Warnings only: the access log (a line per request at info) would fill the stderr pipe, read only on failure,
    # and stall the server.
    command += ["--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("the server did not start in 120 s")


async def one_stream(http, model: str, new_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    arrivals, tokens = [], 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens}


async def concurrent_streams(url: str, model: str, clients: int, new_tokens: int) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        return await asyncio.gather(*(one_stream(http, model, new_tokens) for _ in range(clients)))


def summarize(streams: list[dict]) -> dict:
    """Throughput of one run of concurrent streams, and its latencies (kept whole, pooled over rounds later)."""
    start = min(stream["sent"] for stream in streams)
    end = max(stream["arrivals"][-1] for stream in streams)
    return {
        "throughput": sum(stream["tokens"] for stream in streams) / (end - start),
        "ttft": [stream["arrivals"][0] - stream["sent"] for stream in streams],
        "gaps": [b - a for stream in streams for a, b in zip(stream["arrivals"], stream["arrivals"][1:])],
    }


def measure_folder(folder: str, args) -> list[dict]:
    """Rounds of: offline batch 1, served 1 client, offline batch 8, served 8 clients, then the other client
    counts; each served figure sits next to the offline one it is compared with."""
    import httpx

    model = Path(folder).resolve().name
    server, url = start_server(folder, args)
    offline = Offline(folder, args)
    rounds = []
    try:
        asyncio.run(concurrent_streams(url, model, 2, 8))  # warm-up
        for index in range(args.rounds):
            entry = {"offline": {}, "served": {}}
            for clients in args.clients:
                reference = 8 if clients >= 8 else 1
                if reference not in entry["offline"]:
                    entry["offline"][reference] = offline.run(reference)
                entry["served"][clients] = summarize(
                    asyncio.run(concurrent_streams(url, model, clients, args.new_tokens))
                )
            rounds.append(entry)
            served = {c: round(r["throughput"], 1) for c, r in entry["served"].items()}
            print(f"{model} round {index + 1}: offline {entry['offline']} served {served}", flush=True)
        rounds[-1]["engine seconds"] = httpx.get(url + "/health").json()["seconds"]
    finally:
        offline.close()
        server.terminate()
        server.wait(timeout=30)
    return rounds


# ------------------------------------------------------------------------------------------------ report


def report(results: dict[str, list[dict]], args) -> str:
    rounds = len(next(iter(results.values())))
    lines = [
        "# `vaswani serve`: continuous batching against offline `generate` (CPU)",
        "",
        f"Produced by `{command_line()}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"SmolLM2-135M-Instruct exported with `vaswani export`, {args.threads} intra-op threads, the chat prompt of "
        f"the engine benchmark, {args.new_tokens} greedy tokens per answer (end-of-sequence ignored). Offline: "
        "`OrtModelForCausalLM.generate` at batch 1 and batch 8 (the prompt repeated), in a process of its own "
        "(tokens/s include the prefill). Served: `vaswani serve` in its own process; N streaming clients (asyncio + "
        "httpx in the benchmark's process, on the same cores) send at once; throughput is all tokens over first "
        "request sent to last token received. TTFT: request sent to first content chunk; ITL: gaps between a "
        "stream's content chunks. "
        f"{rounds} rounds; in each, offline batch 1 runs right before 1 client and offline batch 8 right before 8 "
        "clients. Throughputs are medians over rounds, ratios are per round then median, latency percentiles pool "
        "every stream of every round.",
        "",
        "**The machine is shared**: 2 cores, with other agents' jobs (tests, benchmarks, a vLLM build) running at the "
        "same time, so absolute figures are depressed and drift within minutes; the ratios compare runs seconds apart.",
        "",
    ]
    for folder, per_round in results.items():
        offline = {
            batch: statistics.median(r["offline"][batch] for r in per_round) for batch in per_round[0]["offline"]
        }
        lines += [
            f"## {Path(folder).name}",
            "",
            "Offline `generate`: "
            + ", ".join(f"batch {batch} **{value:.1f}** tok/s" for batch, value in offline.items())
            + " (medians).",
            "",
            "| clients | throughput tok/s | x offline (same round) | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | "
            "ITL p95 ms | ITL p95/p50 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for clients in args.clients:
            reference = 8 if clients >= 8 else 1
            throughput = statistics.median(r["served"][clients]["throughput"] for r in per_round)
            ratio = statistics.median(r["served"][clients]["throughput"] / r["offline"][reference] for r in per_round)
            ttft = [t for r in per_round for t in r["served"][clients]["ttft"]]
            gaps = [g for r in per_round for g in r["served"][clients]["gaps"]]
            p50, p95 = percentile(gaps, 50), percentile(gaps, 95)
            lines.append(
                f"| {clients} | {throughput:.1f} | {ratio:.2f} x b{reference} | {1000 * percentile(ttft, 50):.0f} | "
                f"{1000 * percentile(ttft, 95):.0f} | {1000 * p50:.1f} | {1000 * p95:.1f} | {p95 / p50:.2f} |"
            )
        seconds = per_round[-1]["engine seconds"]
        graph = seconds["prefill"] + seconds["decode"]
        lines += [
            "",
            f"Scheduler time over the whole run (from the server's /health): graph calls {graph:.1f} s (prefill "
            f"{seconds['prefill']:.1f}, decode {seconds['decode']:.1f}); batching work around them: joining prefilled "
            f"rows {1000 * seconds['join']:.0f} ms, dropping rows {1000 * seconds['leave']:.0f} ms, choosing tokens "
            f"{1000 * seconds['sampling']:.0f} ms ({100 * (seconds['join'] + seconds['leave']) / graph:.2f}% of the "
            "graph time for joins and leaves).",
            "",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folders", nargs="+", default=["/tmp/smol/onnx-int8", "/tmp/smol/onnx-fp32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="vaswani serve's token budget")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--json", type=Path, help="raw results and tables as JSON; the page is rendered from it")
    parser.add_argument("--offline-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline_worker:
        offline_worker(args.offline_worker, args.threads, args.new_tokens)
        return
    results = {}
    for folder in args.folders:
        results[folder] = measure_folder(folder, args)
        text = report(results, args)
        if args.markdown:
            Path(args.markdown).write_text(text)
    print(text)
    if args.json:  # the page: rendered from the JSON (benchmarks/results/)
        from benchmarks.results.pages import publish_report

        publish_report(text, args.json, args.markdown, json.loads(json.dumps(results, default=str)), args.threads)


if __name__ == "__main__":
    main()
