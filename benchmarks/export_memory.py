"""Peak resident memory and wall time of `vaswani export`, stage by stage, against the size of the model's weights.

    python -m benchmarks.reference_shapes --shape llama-3.2-1b --output /tmp/big/llama-1b
    python -m benchmarks.export_memory --model /tmp/big/llama-1b --work /tmp/big/exports --label after \\
        --json docs/results/exporter_1b.json --markdown docs/results/exporter_1b.md
    python -m benchmarks.export_memory --render --json docs/results/exporter_1b.json --markdown docs/results/exporter_1b.md

Each precision (fp32, int8, int4 with its default 8-bit budget) is one `vaswani export --model` in a process of its
own, one after the other (never two at once: a 1B export needs gigabytes). While it runs, this script reads the
process's resident set (/proc/PID/status) every 50 ms and timestamps each progress line the command prints; a stage
runs from one progress line to the next, and its peak is the largest resident set sampled in it. The whole
process's peak is the kernel's own (`ru_maxrss` of the finished child), which no sampling can miss.

The weights' bytes are the float32 size of the parameters (a tied embedding counted once): the model as PyTorch
holds it, and the size of the fp32 export's weights.
"""

import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.provenance import command_line, machine
from benchmarks.results.pages import render, write

PRECISIONS = {"fp32": [], "int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"]}
SAMPLE_SECONDS = 0.05
STAGE_SUFFIX = re.compile(r"  \[[\d.]+ s, peak RSS [\d.]+ GB\]$")  # what `vaswani export` adds to each progress line


class ExportFailed(RuntimeError):
    """An export that ran every stage but exited non-zero (validation refused it): its measurements and why."""

    def __init__(self, result: dict, outcome: str) -> None:
        super().__init__(outcome)
        self.result, self.outcome = result, outcome


def weight_bytes(folder: Path) -> int:
    """float32 bytes of the parameters in a folder's safetensors files (read from their headers, nothing loaded)."""
    count = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        count += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return 4 * count


def resident_bytes(pid: int) -> int | None:
    """The process's resident set now (VmRSS), or None once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def measure_export(model: Path, output: Path, options: list[str]) -> dict:
    """Run `vaswani export --model MODEL --output OUTPUT OPTIONS` in a process of its own: its wall time, kernel peak
    RSS, and per progress line (stage) the seconds it lasted and the peak RSS sampled in it."""
    arguments = ["export", "--model", str(model), "--output", str(output), "--overwrite", *options]
    command = [sys.executable, "-m", "vaswani", *arguments]
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss = resident_bytes(process.pid)
            if rss is not None:
                samples.append((time.perf_counter() - start, rss))
            done.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines = []
    for line in process.stdout:
        lines.append((time.perf_counter() - start, line.rstrip()))
        print(f"{lines[-1][0]:7.1f} s  {lines[-1][1]}", flush=True)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    result = {
        "command": "vaswani " + " ".join(arguments),
        "seconds": seconds,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,  # less disturbed than wall time by other jobs' load
        "stages": stages(lines, samples, seconds),
        "log_tail": [line for _, line in lines[-60:]],
    }
    if process.returncode:
        errors = [line for _, line in lines if line.startswith("error:")]
        raise ExportFailed(result, f"exit {process.returncode}: {errors[-1] if errors else lines[-1][1]}")
    result["output_bytes"] = sum(path.stat().st_size for path in output.iterdir())
    return result


def stages(lines: list[tuple[float, str]], samples: list[tuple[float, int]], end: float) -> list[dict]:
    """One stage per progress line (the first, "start", from the process's start: Python and its imports), until the
    next: its start, seconds and the largest RSS sampled in it (None when too short to sample). Lines that are no
    stage (progress bars, the validation table, blank ones) belong to the stage before them."""
    marks = [(0.0, "start (Python, imports)")]
    for at, line in lines:
        if line.strip() and not line.startswith(("|", "Loading weights:", "Validation against", "[transformers]")):
            marks.append((at, STAGE_SUFFIX.sub("", line)))
    found = []
    for index, (begin, line) in enumerate(marks):
        finish = marks[index + 1][0] if index + 1 < len(marks) else end
        inside = [rss for at, rss in samples if begin <= at < finish]
        found.append(
            {"line": line, "start": begin, "seconds": finish - begin, "peak_rss_bytes": max(inside, default=None)}
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a transformers model folder")
    parser.add_argument("--render", action="store_true", help="publish --json's runs again, measuring nothing")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vaswani-export-memory"), help="exports go here")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--label", default="this commit", help="what code ran (several labels share one JSON)")
    parser.add_argument("--json", type=Path, help="raw results: runs under other labels in it are kept")
    parser.add_argument("--markdown", type=Path, help="the results page")
    args = parser.parse_args()
    raw, kept = {"runs": {}}, {}
    if args.json and args.json.is_file():
        kept = json.loads(args.json.read_text())
        raw = kept["raw"]
    if args.render:  # the JSON's runs, command and machine as they are, the tables computed again
        if not args.json:
            parser.error("--render needs --json")
        print(write({**kept, "tables_from": "export_memory", "raw": raw}, args.json, args.markdown))
        return
    if args.model is None:
        parser.error("--model is required (or --render with --json)")
    raw["weights_bytes"] = weight_bytes(args.model)
    raw["model_description"] = args.model.name
    config = args.model / "config.json"
    if config.is_file():
        shape = json.loads(config.read_text())
        raw["model_description"] = (
            f"{args.model.name}: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
            f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, FFN {shape['intermediate_size']}, "
            f"vocabulary {shape['vocab_size']}"
        )
    runs = raw["runs"].setdefault(args.label, {})
    for precision in args.precisions:
        try:
            runs[precision] = measure_export(args.model, args.work / precision, PRECISIONS[precision])
        except ExportFailed as failure:
            runs[precision] = {**failure.result, "outcome": failure.outcome}
        if args.json:
            publish(raw, args.json, args.markdown)
    print(render(results(raw), args.json.name if args.json else "results.json"))


def results(raw: dict) -> dict:
    """The page's results: its tables are computed from `raw` when it is rendered (results.export_memory_tables)."""
    title = "vaswani export at 1B: memory and time by stage"
    return {"title": title, "command": command_line(), "machine": machine(threads=None), "after": [],
            "tables_from": "export_memory", "raw": raw}  # fmt: skip


def publish(raw: dict, json_path: Path, markdown_path: Path | None) -> str:
    return write(results(raw), json_path, markdown_path)


if __name__ == "__main__":
    main()
