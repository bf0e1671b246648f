"""`vaswani serve` under concurrent streaming clients against offline `generate` on the same exported folder.

For each folder, each round runs, each in a process of its own and in alternating order:
- offline: `OrtModelForCausalLM.generate` on the chat prompt at batch 1 and at batch 8 (the prompt repeated),
  `--new-tokens` greedy tokens (end-of-sequence cannot stop them early), after a warm-up; tokens/s include prefill;
- served: `vaswani serve FOLDER --threads T` in a subprocess, then 1, 4, 8, 16 (`--clients`) concurrent streaming
  clients (asyncio + httpx in this process), each asking for `--new-tokens` tokens of the same chat prompt
  (`ignore_eos`), all sent at once. Throughput: all tokens over the time from the first request sent to the last
  token received. Time to first token: request sent to first content chunk. Inter-token latency: the gaps between a
  stream's content chunks (one chunk per token, except where a token ends inside a character).

Targets (issue 19): 8 clients reach 0.9x the offline batch-8 throughput; one client is within 10% of offline
batch-1 speed; nothing is starved: inter-token latency p95 under 3x p50. Ratios are taken within a round, then the
median over rounds is reported, since the shared machine's load drifts between rounds.

    python scripts/benchmark_serve.py --folders /tmp/smol/onnx-int8 /tmp/smol/onnx-fp32 --rounds 3 \\
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

QUESTION = "What are three good habits for writing clear, maintainable Python code? Answer briefly."
ROOT = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# ------------------------------------------------------------------------------------------- offline reference


def offline_worker(folder: str, threads: int, new_tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from vaswani.conversion import OrtModelForCausalLM
    from vaswani.conversion.onnx import default_session_options

    torch.set_num_threads(threads)
    model = OrtModelForCausalLM.from_pretrained(folder, session_options=default_session_options(threads))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": QUESTION}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    results = {"prompt_tokens": len(prompt)}
    for batch in (1, 8):
        ids = torch.tensor([prompt] * batch)
        settings = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **settings)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **settings)
            times.append(time.perf_counter() - start)
        results[f"batch {batch}"] = batch * new_tokens / statistics.median(times)
    return results


def run_offline(folder: str, args) -> dict:
    command = [sys.executable, __file__, "--offline-worker", folder, "--threads", str(args.threads)]
    command += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    output = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ served


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(folder: str, args) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "vaswani.cli", "serve", folder, "--port", str(port), "--threads", str(args.threads)]
    command += ["--max-batch", str(max(args.clients)), "--prefill-chunk", str(args.prefill_chunk)]
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


async def sweep(url: str, model: str, args) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=max(args.clients) + 4)
    results = {}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await one_stream(http, model, 8)  # warm-up
        for clients in args.clients:
            runs = []
            for _ in range(args.repeats):
                runs.append(await asyncio.gather(*(one_stream(http, model, args.new_tokens) for _ in range(clients))))
            results[clients] = summarize(runs)
    return results


def summarize(runs: list[list[dict]]) -> dict:
    throughputs, ttfts, gaps = [], [], []
    for streams in runs:
        start = min(stream["sent"] for stream in streams)
        end = max(stream["arrivals"][-1] for stream in streams)
        throughputs.append(sum(stream["tokens"] for stream in streams) / (end - start))
        for stream in streams:
            ttfts.append(stream["arrivals"][0] - stream["sent"])
            gaps += [b - a for a, b in zip(stream["arrivals"], stream["arrivals"][1:])]
    return {
        "throughput": statistics.median(throughputs),
        "ttft p50": percentile(ttfts, 50),
        "ttft p95": percentile(ttfts, 95),
        "itl p50": percentile(gaps, 50),
        "itl p95": percentile(gaps, 95),
    }


def run_served(folder: str, args) -> dict:
    server, url = start_server(folder, args)
    try:
        return asyncio.run(sweep(url, Path(folder).resolve().name, args))
    finally:
        server.terminate()
        server.wait(timeout=30)


# ------------------------------------------------------------------------------------------------ report


def report(folders: list[str], rounds: list[dict], args) -> str:
    lines = [
        "# `vaswani serve`: continuous batching against offline `generate` (CPU)",
        "",
        f"Produced by `python scripts/benchmark_serve.py {' '.join(sys.argv[1:])}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"SmolLM2-135M-Instruct exported with `vaswani export`, {args.threads} intra-op threads, the chat prompt of "
        f"the engine benchmark, {args.new_tokens} greedy tokens per answer (end-of-sequence ignored). Offline: "
        "`OrtModelForCausalLM.generate`, batch 1 and batch 8 (tokens/s include the prefill). Served: `vaswani serve` "
        "in its own process, N streaming clients (asyncio + httpx, in the benchmark's process on the same cores) "
        f"sending at once; throughput is all tokens over first request to last token. {len(rounds)} rounds, "
        "alternating which system runs first; figures are medians over rounds, ratios are per round then median.",
        "",
        "**The machine is shared**: 2 cores, with other agents' jobs running, so absolute figures are depressed "
        "and noisy; compare the ratios, which are measured side by side in each round.",
        "",
    ]
    for folder in folders:
        name = Path(folder).name
        per_round = [entry[folder] for entry in rounds]
        offline1 = statistics.median(r["offline"]["batch 1"] for r in per_round)
        offline8 = statistics.median(r["offline"]["batch 8"] for r in per_round)
        lines += [
            f"## {name}",
            "",
            f"Offline `generate`: batch 1 **{offline1:.1f}** tok/s, batch 8 **{offline8:.1f}** tok/s.",
            "",
            "| clients | throughput tok/s | x offline b1 | x offline b8 | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | "
            "ITL p95 ms | ITL p95/p50 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for clients in args.clients:
            cells = [r["served"][clients] for r in per_round]

            def med(key, cells=cells):
                return statistics.median(cell[key] for cell in cells)

            ratio1 = statistics.median(r["served"][clients]["throughput"] / r["offline"]["batch 1"] for r in per_round)
            ratio8 = statistics.median(r["served"][clients]["throughput"] / r["offline"]["batch 8"] for r in per_round)
            spread = statistics.median(cell["itl p95"] / cell["itl p50"] for cell in cells)
            lines.append(
                f"| {clients} | {med('throughput'):.1f} | {ratio1:.2f} | {ratio8:.2f} | {1000 * med('ttft p50'):.0f} | "
                f"{1000 * med('ttft p95'):.0f} | {1000 * med('itl p50'):.1f} | {1000 * med('itl p95'):.1f} | "
                f"{spread:.2f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folders", nargs="+", default=["/tmp/smol/onnx-int8", "/tmp/smol/onnx-fp32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per figure within a round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill-chunk", type=int, default=32)
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--offline-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline_worker:
        print(json.dumps(offline_worker(args.offline_worker, args.threads, args.new_tokens, args.repeats)))
        return
    rounds = []
    for index in range(args.rounds):
        entry = {}
        for folder in args.folders:
            order = ("offline", "served") if index % 2 == 0 else ("served", "offline")
            entry[folder] = {}
            for system in order:
                entry[folder][system] = run_offline(folder, args) if system == "offline" else run_served(folder, args)
                print(f"round {index + 1} {Path(folder).name} {system}: {entry[folder][system]}", flush=True)
        rounds.append(entry)
        text = report(args.folders, rounds, args)
        if args.markdown:
            Path(args.markdown).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
