"""Table maker of the serving benchmark run on several workloads (benchmarks/benchmark_serve_mixed.py --workloads):
one table per workload (independent prompts, a shared system prompt, multi-turn chats), a row per request rate and
engine with the flags it ran with and the precision it computed in, each figure the median over rounds with the
range over rounds beside it; then, for every engine run with and without its prefix cache (`X` beside `X+noprefix`),
how many times lower its median time to first token is with the cache, round by round; and the memory each server's
process held after each round.

A run of the raw values (`raw["runs"]`) is labelled with its workload (absent: independent, as the single-workload
page's runs are), its engine and its rate; `raw["meta"]["engines"]` holds each engine's flags and precision."""

import json

from benchmarks.results.cells import paired_ratios, spread, table
from benchmarks.results.engines import MEMORY_KEYS

FIGURES = [  # (column, summary keys, digits)
    ("output tok/s", ("output_throughput",), 1),
    ("req/s", ("request_throughput",), 2),
    ("TTFT p50 ms", ("ttft_ms", "p50"), 0),
    ("TTFT p95 ms", ("ttft_ms", "p95"), 0),
    ("ITL p50 ms", ("itl_ms", "p50"), 1),
    ("ITL p95 ms", ("itl_ms", "p95"), 1),
    ("TPOT p50 ms", ("tpot_ms", "p50"), 1),
]


def figure(summary: dict, keys: tuple[str, ...]) -> float | None:
    value = summary
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) else None


def runs_of(raw: dict, workload: str, engine: str, rate: str) -> list[dict]:
    """The runs of one cell, in round order."""
    found = [
        run
        for run in raw["runs"]
        if run.get("workload", "independent") == workload and run["engine"] == engine and run["rate"] == rate
    ]
    return sorted(found, key=lambda run: run["round"])


def serve_workload_tables(raw: dict, described: dict) -> list[dict]:
    arguments, engines = raw["meta"]["args"], raw["meta"].get("engines", {})
    rates = [str(rate) for rate in json.loads(str(arguments["rates"]).replace("inf", "Infinity"))]  # "2.0", "inf"
    made = []
    for workload in arguments.get("workloads", ["independent"]):
        later_turns = workload == "multi-turn"
        rows = []
        for rate in rates:
            for engine in arguments["engines"]:
                runs = runs_of(raw, workload, engine, rate)
                if not runs:
                    continue
                described_engine = engines.get(engine, {})
                flags = f"`{described_engine['flags']}`" if described_engine.get("flags") else "-"
                row = [rate, engine, flags, described_engine.get("precision", "?")]
                row += [spread([figure(run["summary"], keys) for run in runs], digits) for _, keys, digits in FIGURES]
                if later_turns:
                    row.append(spread([figure(run.get("later_turns", {}), ("ttft_ms", "p50")) for run in runs], 0))
                row.append(str(sum(run["summary"]["failed"] for run in runs)))
                rows.append(row)
        columns = ["rate (req/s)", "server", "extra flags", "precision", *(name for name, _, _ in FIGURES)]
        columns += ["TTFT p50 ms, turns 2+"] * later_turns + ["failed"]
        made.append(table(f"Workload: {workload} (median over rounds, range in brackets)", columns, rows))
    made += memory_tables(raw)
    cached = prefix_cache_rows(raw, rates)
    if cached:
        columns = ["workload", "rate (req/s)", "server", "TTFT p50 without / with the prefix cache"]
        heading = "Prefix cache: time to first token without it over with it, round by round"
        made.append(table(heading, columns, cached))
    return made


def prefix_cache_rows(raw: dict, rates: list[str]) -> list[list[str]]:
    """For each engine X run beside X+noprefix: the ratio of their median TTFTs, paired by round."""
    arguments, rows = raw["meta"]["args"], []
    engines = arguments["engines"]
    pairs = [(engine, engine + "+noprefix") for engine in engines if engine + "+noprefix" in engines]
    for workload in arguments.get("workloads", ["independent"]):
        for rate in rates:
            for engine, without in pairs:
                with_cache, no_cache = runs_of(raw, workload, engine, rate), runs_of(raw, workload, without, rate)
                if not with_cache or not no_cache:
                    continue
                ratios = paired_ratios(
                    [figure(run["summary"], ("ttft_ms", "p50")) for run in no_cache],
                    [figure(run["summary"], ("ttft_ms", "p50")) for run in with_cache],
                )
                rows.append([workload, rate, engine, spread(ratios, 2, "x")])
    return rows


def memory_tables(raw: dict) -> list[dict]:
    """The servers' memory table (`memory_rows`), where the runs recorded it: [] or [table]."""
    held = memory_rows(raw)
    if not held:
        return []
    columns = ["server", "peak resident", "anonymous", "file-mapped"]
    heading = "Server memory (the server's process after each round's last run, MB: median (range) over rounds)"
    return [table(heading, columns, held)]


def memory_rows(raw: dict) -> list[list[str]]:
    """Per engine, the memory its server process held after the last run of each round (peak resident so far, and
    anonymous and file-mapped resident then): anonymous is the process's own, file-mapped its mapped files (page
    cache, shared and reclaimable)."""
    rows = []
    for engine in raw["meta"]["args"]["engines"]:
        last = {}
        for run in raw["runs"]:
            if run["engine"] == engine and run.get("memory"):
                last[run["round"]] = run["memory"]  # runs are kept in the order they ran
        if last:
            rounds = [last[index] for index in sorted(last)]
            rows.append([engine, *(spread([held[key] / 1e6 for held in rounds], 0) for key in MEMORY_KEYS)])
    return rows
