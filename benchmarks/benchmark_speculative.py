"""Speculative decoding in the server at batch 1: plain decoding against prompt-lookup speculation on a multi-turn
chat workload (each conversation's second turn asks about, edits or repeats what the first turn holds), through the
server's own scheduler and the export's step model (no HTTP in the measurement). Greedy answers must be identical
(checked); the table gives output tokens per second over each turn (prefill included) and the acceptance rate.

    python -m benchmarks.benchmark_speculative /tmp/smol/onnx-int8 --threads 2 --rounds 2
    python -m benchmarks.benchmark_speculative /tmp/smol/onnx-int8 --config '{"num_speculative_tokens": 3}'
    python -m benchmarks.benchmark_speculative /tmp/smol/onnx-int8-attention-portable --engine openvino \
        --openvino-int8-activations off --json docs/results/x.json --markdown docs/results/x.md
    python -m benchmarks.benchmark_speculative /tmp/smol/onnx-int8-attention-portable --engine openvino \
        --openvino-precision f32 --openvino-int8-activations off

Prints a Markdown table (with --output, also writes it to that file; with --json, a results page's JSON, and with
--markdown the page rendered from it). `--engine openvino` serves through OpenVINO's paged batch, whose int8
activations (`--openvino-int8-activations`, as `vaswani serve` takes it) and compute precision (`--openvino-precision`:
bf16 kernels round a call of several tokens otherwise than a one-token step) decide whether a verification call
computes what a one-token step does.
"""

import argparse
import json
import threading
import time
from pathlib import Path

from benchmarks.provenance import command_line, machine
from benchmarks.results.pages import write
from vaswani.runtime.loading import set_command_threads
from vaswani.serving import SamplingParams, load_service
from vaswani.serving.scheduler import Scheduler
from vaswani.serving.speculation import SpeculativeConfig, Speculator

CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    average = mean(values)
    return sum((value - average) ** 2 for value in values) / len(values)
"""

# (first user turn, second user turn): the second refers back to the conversation, as chats about a text do.
CONVERSATIONS = [
    (
        f"Here is my Python code:\n\n{CODE}\nExplain briefly what it does.",
        "Rewrite the whole code with the function mean renamed to average_of, and show it in full.",
    ),
    (
        "Write a short email to my team saying the meeting moves from Monday 10:00 to Tuesday 14:00 in room B.",
        "Repeat the email, changing only the room to room C.",
    ),
    (
        "List the planets of the solar system in order from the Sun, one per line, each with one fact.",
        "Repeat the same list in reverse order, keeping each planet's fact.",
    ),
]


def answer(scheduler: Scheduler, prompt: list[int], max_tokens: int, ends: frozenset[int]) -> tuple[list[int], float]:
    """The greedy answer to `prompt` through `scheduler` (started), and the seconds from submission to its end."""
    tokens, done = [], threading.Event()

    def emit(event):
        if event.token is not None:
            tokens.append(event.token)
        if event.finish_reason is not None:
            done.set()

    start = time.perf_counter()
    scheduler.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=ends), emit)
    done.wait(300)
    return tokens, time.perf_counter() - start


def run_conversations(service, speculator: Speculator | None, max_tokens: int) -> tuple[list[list[int]], float]:
    """Every conversation's two turns (the first turn's answer in the second's history); the answers and the seconds
    the second turns took together with the first (output throughput over the whole chat)."""
    scheduler = Scheduler(service.scheduler.model, max_batch=1, speculator=speculator).start()
    answers, seconds = [], 0.0
    try:
        for first, second in CONVERSATIONS:
            messages = [{"role": "user", "content": first}]
            reply, took = answer(scheduler, service.chat_prompt(messages), max_tokens, service.eos_token_ids)
            answers.append(reply)
            seconds += took
            messages += [
                {"role": "assistant", "content": service.tokenizer.decode(reply, skip_special_tokens=True)},
                {"role": "user", "content": second},
            ]
            reply, took = answer(scheduler, service.chat_prompt(messages), max_tokens, service.eos_token_ids)
            answers.append(reply)
            seconds += took
    finally:
        scheduler.stop()
    return answers, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    parser.add_argument("--engine", choices=("onnxruntime", "openvino"), default="onnxruntime")
    parser.add_argument("--openvino-int8-activations", choices=("on", "off"), default="on")
    parser.add_argument("--openvino-precision", choices=("auto", "f32", "bf16"), default="auto")
    parser.add_argument("--output", help="also write the table to this Markdown file")
    parser.add_argument("--json", type=Path, help="also write a results page's JSON here")
    parser.add_argument("--markdown", type=Path, help="with --json: the page rendered from it")
    args = parser.parse_args()
    options = {}
    if args.engine != "onnxruntime":
        options = {"engine": args.engine, "openvino_precision": args.openvino_precision}
    if args.openvino_int8_activations == "off":
        options["openvino_int8_activations"] = False
    service = load_service(args.folder, threads=args.threads, **options)
    set_command_threads("small-ops", args.threads)  # as `vaswani serve` sets torch's pool for an export
    config = SpeculativeConfig.parse(args.config)
    rows = []
    for round_index in range(args.rounds):
        plain, plain_seconds = run_conversations(service, None, args.max_tokens)
        speculator = Speculator(config)
        speculative, speculative_seconds = run_conversations(service, speculator, args.max_tokens)
        # Identical in exact arithmetic; a quantized kernel may round a several-token call differently from a
        # one-token call (ONNX Runtime's int8 GroupQueryAttention form does, and OpenVINO's int8 activations unless
        # --openvino-int8-activations off), which can flip a near tie.
        identical = sum(a == b for a, b in zip(plain, speculative))
        tokens = sum(len(reply) for reply in plain)
        stats = speculator.stats()
        speculative_rate = sum(len(reply) for reply in speculative) / speculative_seconds
        rows.append((round_index, tokens, tokens / plain_seconds, speculative_rate, stats, identical))
        print(
            f"round {round_index}: {tokens} tokens, plain {tokens / plain_seconds:.1f} tok/s, speculative "
            f"{speculative_rate:.1f} tok/s (x{speculative_rate * plain_seconds / tokens:.2f}), acceptance "
            f"{stats['acceptance_rate']}, {stats['draft_tokens']} proposed, {stats['accepted_tokens']} kept, "
            f"{identical}/{len(plain)} answers identical",
            flush=True,
        )
    lines = [
        "# Speculative decoding in the server: batch 1, multi-turn chat",
        "",
        f"`{args.folder}`, {service.scheduler.model.description}, {args.threads} intra-op threads"
        + (f", OpenVINO's int8 activations {args.openvino_int8_activations}" if args.engine == "openvino" else "")
        + f", greedy, at most {args.max_tokens} tokens per turn, "
        f"{len(CONVERSATIONS)} two-turn conversations; speculative config `{json.dumps(config.__dict__)}`. "
        "Output tokens per second over every turn (prefill included); identical: "
        "speculative answers equal to plain ones (they are in exact arithmetic; a quantized kernel may round a "
        "several-token call differently from a one-token call and flip a near tie).",
        "",
        "| round | tokens | plain tok/s | speculative tok/s | speed-up | acceptance rate | proposed | kept | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for round_index, tokens, plain_rate, speculative_rate, stats, identical in rows:
        lines.append(
            f"| {round_index} | {tokens} | {plain_rate:.1f} | {speculative_rate:.1f} | "
            f"{speculative_rate / plain_rate:.2f}x | {stats['acceptance_rate']} | {stats['draft_tokens']} | "
            f"{stats['accepted_tokens']} | {identical}/{2 * len(CONVERSATIONS)} |"
        )
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    if args.json:
        rounds = [
            {"round": index, "tokens": tokens, "plain_tok_s": plain, "speculative_tok_s": speculative, **stats,
             "identical_answers": identical}  # fmt: skip
            for index, tokens, plain, speculative, stats, identical in rows
        ]
        results = {
            "title": lines[0].removeprefix("# "),
            "command": command_line(),
            "machine": machine(args.threads),
            "notes": [lines[2]],
            "tables_from": "speculative",
            "raw": {"rounds": rounds, "answers": 2 * len(CONVERSATIONS), "config": config.__dict__},
        }
        write(results, args.json, args.markdown)


if __name__ == "__main__":
    main()
