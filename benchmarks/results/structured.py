"""Table maker of the structured-outputs page (docs/results/structured_outputs_cpu.md), whose JSON holds two parts
written by two scripts: `libraries` (benchmarks/benchmark_grammar_libraries.py: xgrammar against llguidance on one
vocabulary) and `serving` (benchmarks/benchmark_serve_mixed.py --structured-share: one server with and without the
structured-output mix). Either part may be missing; each is rendered when present.

Every figure with rounds behind it is the median over rounds with their range (`cells.spread`); two figures whose
ranges overlap are called a tie, whatever their medians say.
"""

import statistics

from benchmarks.results.cells import paired_ratios, spread, table


def percentile(values: list[float], q: float) -> float:
    """numpy's default percentile (linear interpolation between the closest ranks)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def overlaps(first: list[float], second: list[float]) -> bool:
    """Whether the ranges over rounds of two figures overlap (a difference inside the spread: a tie)."""
    return bool(first and second) and min(first) <= max(second) and min(second) <= max(first)


def verdict(faster: str, slower: str, ours: list[float], theirs: list[float]) -> str:
    """Which of two timings (lower is better) wins, by how much, or a tie when their ranges overlap."""
    if overlaps(ours, theirs):
        return "tie (ranges overlap)"
    if statistics.median(ours) > statistics.median(theirs):
        faster, slower, ours, theirs = slower, faster, theirs, ours
    return f"{faster} {statistics.median(theirs) / statistics.median(ours):.1f}x faster"


def median_part(result: dict, part: str) -> float:
    """A library's median time of one part of a token's step over every constraint and round."""
    return statistics.median(value for entry in result["constraints"].values() for value in entry["parts_ms"][part])


def target_verdict(mixed: list[float], plain: list[float], ratios: list[float], target: float = 0.10) -> str:
    """The mix's throughput against the plain workload's: a tie where their ranges over rounds overlap, else how much
    slower (or faster) by the median round-by-round ratio, against the issue's target (within 10%)."""
    if overlaps(mixed, plain):
        return "tie (ranges overlap)"
    ratio = statistics.median(ratios)
    if ratio >= 1:
        return f"{100 * (ratio - 1):.0f}% faster"
    met = "within" if 1 - ratio <= target else "misses"
    return f"{100 * (1 - ratio):.0f}% slower, {met} the {100 * target:.0f}% target"


def library_tables(part: dict) -> list[dict]:
    results, settings = part["results"], part["settings"]
    measured = {name: result for name, result in results.items() if "skipped" not in result}
    setup = table(
        "Vocabulary setup (once per tokenizer)",
        ["library", "version", "setup ms"],
        [[name, result["version"], spread(result["vocabulary_ms"], 0)] for name, result in measured.items()],
    )
    setup["text"] = [
        f"SmolLM2-135M-Instruct's tokenizer ({settings['vocab_size']:,} tokens), {settings['rounds']} timed round(s) "
        f"after one untimed warm-up round, each library in a process of its own, 1 thread (torch "
        "`set_num_threads(1)`; xgrammar's compiler `max_threads=1`; llguidance's mask thread pool at its default, "
        "one mask at a time). Compact JSON for both (llguidance: vaswani's `Grammar` with "
        '`flexible_whitespace=False`; xgrammar `any_whitespace=False, separators=(",", ":")`); each answer is '
        '`json.dumps(example, separators=(",", ":"))` tokenized, then the end-of-sequence token.',
        "llguidance runs through vaswani.constraints as the server does: setup `grammar_vocabulary`, compile "
        "`compile_grammar(...).matcher()` (first: the cache emptied; repeat: the cache's compiled grammar, a deep "
        "copy of its pristine matcher), per token `GrammarMatcher.mask()` (fill), `mask_scores` (apply: -inf where "
        "not allowed, on a (1, vocab) float32 tensor), `accept` (advance). xgrammar: setup "
        "`TokenizerInfo.from_huggingface` + `GrammarCompiler(cache_enabled=True)`, compile `compile_json_schema` / "
        "`compile_regex` + `GrammarMatcher` (first: `clear_cache()` before), per token `fill_next_token_bitmask`, "
        "`apply_token_bitmask_inplace` (its CPU kernel), `accept_token`.",
    ]
    for name, result in results.items():
        if "skipped" in result:
            setup["text"].append(f"{name} not measured: {result['skipped']}")
    rows = []
    names = list(next(iter(measured.values()))["constraints"]) if measured else []
    for constraint in names:
        for library, result in measured.items():
            entry = result["constraints"][constraint]
            rounds = entry["per_token_ms"]
            parts = " / ".join(spread(entry["parts_ms"][part], 3) for part in ("fill", "apply", "advance"))
            rows.append([
                constraint, library, entry["tokens"], spread(entry["first_compile_ms"], 2),
                spread(entry["repeat_compile_ms"], 3), spread([percentile(r, 50) for r in rounds], 3),
                spread([percentile(r, 95) for r in rounds], 3), spread([max(r) for r in rounds], 3), parts,
            ])  # fmt: skip
    columns = ["constraint", "library", "answer tokens", "first compile ms", "repeat compile ms"]
    columns += ["per token p50 ms", "per token p95 ms", "per token max ms", "fill / apply / advance p50 ms"]
    costs = table("Compile and per-token cost", columns, rows)
    costs["text"] = [
        "Each cell: the median over rounds of that round's figure (a compile's milliseconds; the per-token "
        "percentile or maximum over the answer's tokens), with the range over rounds in parentheses. A per-token "
        "cost is fill + apply + advance of one token, timed together; the last column times the three apart."
    ]
    tables = [setup, costs]
    others = [name for name in measured if name != "llguidance"]
    if "llguidance" in measured and others:
        rows = []
        for constraint in names:
            mine = measured["llguidance"]["constraints"][constraint]
            ours_p50 = [percentile(r, 50) for r in mine["per_token_ms"]]
            for other in others:
                theirs = measured[other]["constraints"][constraint]
                their_p50 = [percentile(r, 50) for r in theirs["per_token_ms"]]
                rows.append([
                    constraint, other, spread(paired_ratios(their_p50, ours_p50), 2, "x"),
                    verdict("llguidance", other, ours_p50, their_p50),
                    spread(paired_ratios(theirs["first_compile_ms"], mine["first_compile_ms"]), 2, "x"),
                    verdict("llguidance", other, mine["first_compile_ms"], theirs["first_compile_ms"]),
                ])  # fmt: skip
        columns = ["constraint", "against llguidance", "per token p50: ratio to llguidance", "per token"]
        tables.append(table("Against llguidance", columns + ["first compile: ratio", "first compile"], rows))
        where = "; ".join(
            f"{name} {median_part(result, 'fill'):.3f} / {median_part(result, 'apply'):.3f} ms"
            for name, result in measured.items()
        )
        tables[-1]["text"] = [
            "Ratios are round by round, median and range; a verdict is a tie where the two ranges over rounds "
            f"overlap. Where a token's time goes, fill / apply (medians over every constraint and round): {where}."
        ]
    return tables


def serving_tables(part: dict) -> list[dict]:
    meta, runs = part["meta"], part["runs"]
    args = meta["args"]
    rows = []
    for rate in args["rates"].strip("[]").split(", "):
        for engine in args["engines"]:
            by_mix = {
                mix: sorted((r for r in runs if (r["engine"], r["rate"], r["mix"]) == (engine, rate, mix)),
                            key=lambda r: r["round"])
                for mix in ("plain", "structured")
            }  # fmt: skip
            plain = [r["summary"].get("output_throughput") for r in by_mix["plain"]]
            for mix, chosen in by_mix.items():
                if not chosen:
                    continue
                summaries = [r["summary"] for r in chosen]
                throughput = [s.get("output_throughput") for s in summaries]
                seconds = [r.get("server_seconds", {}) for r in chosen]
                grammar = [s.get("grammar", 0.0) for s in seconds]
                sampling = [s.get("sampling", 0.0) for s in seconds]
                per_token = [1e3 * g / s["output_tokens"] for g, s in zip(grammar, summaries) if s.get("output_tokens")]
                kinds = [r.get("kinds", {}).get("structured", {}) for r in chosen] if mix == "structured" else []
                ratio = paired_ratios(throughput, plain) if mix == "structured" else []
                within = target_verdict(throughput, plain, ratio) if ratio else "–"
                reasons: dict[str, int] = {}
                for kind in kinds:
                    for reason, count in kind.get("finish_reasons", {}).items():
                        reasons[reason] = reasons.get(reason, 0) + count
                rows.append([
                    rate, engine, f"{round(100 * args['structured_share'])}% JSON schema" if mix == "structured"
                    else "plain", spread(throughput), spread(ratio, 2, "x") if ratio else "–", within,
                    spread([s["itl_ms"]["p50"] for s in summaries if "itl_ms" in s]),
                    spread([s["itl_ms"]["p95"] for s in summaries if "itl_ms" in s]),
                    spread([k["itl_ms"]["p50"] for k in kinds if "itl_ms" in k]) if kinds else "–",
                    spread([s["ttft_ms"]["p50"] for s in summaries if "ttft_ms" in s], 0),
                    spread(grammar, 3), spread(per_token, 3), spread(sampling, 2),
                    spread([s.get("decode", 0.0) for s in seconds], 2),
                    ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items())) or "–",
                    str(sum(s.get("length_mismatches", 0) for s in summaries)), str(sum(s["failed"] for s in summaries)),
                ])  # fmt: skip
    columns = ["rate (req/s)", "server", "requests", "output tok/s", "mix / plain tok/s", "mix against plain"]
    columns += ["ITL p50 ms", "ITL p95 ms", "constrained ITL p50 ms", "TTFT p50 ms", "grammar wait s"]
    columns += ["grammar wait ms / token", "sampling s", "decode s", "constrained answers ended"]
    columns += ["length mismatches", "failed"]
    served = table("Served: the same requests with and without the structured-output mix", columns, rows)
    machine = meta["machine"]
    served["text"] = [
        f"`vaswani serve` ({', '.join(args['engines'])}: SmolLM2-135M-Instruct exported by `vaswani export`, "
        f"quantized as the name says), {args['threads']} threads, at most {args['max_batch']} sequences at once, on "
        f"{machine.get('cpu', '?')} ({machine['cores']} cores; load average (1 min) during the runs "
        f"{min(meta['load']):.1f}-{max(meta['load']):.1f}). {args['num_prompts']} requests per rate (seed "
        f"{args['seed']}), prompts of {args['input_len']} +- {100 * args['range_ratio']:.0f}% tokens and answers of "
        f"{args['output_len']} +- {100 * args['range_ratio']:.0f}% tokens, streamed and greedy to `/v1/completions` "
        "with `ignore_eos`; Poisson arrivals at each rate (`inf`: all at once). Each rate runs twice on the same "
        "server in each round: plain, and the same requests with a share of them (drawn with the seed) carrying "
        '`structured_outputs: {"json": schema}`, the schema an object with a summary and exactly as many keywords '
        "(1-16 characters) as the longest answer has tokens, so that every constrained answer is cut by its "
        f"`max_tokens` as a plain one is; the order of the two alternates between rounds. {args['rounds']} rounds.",
        "Output tok/s: generated tokens (the server's `usage`) / (first request sent to last token received). "
        "Mix / plain: round-by-round ratios, median and range; against plain: a tie where the two throughputs' "
        "ranges over rounds overlap, else the median ratio against the target (the mix within 10% of plain). "
        "Constrained ITL: the inter-token latency of the requests with a schema only. Grammar wait: the server's "
        "seconds waiting for the next masks after each decoding step (they are computed during the step; "
        "`GET /health` -> `seconds.grammar`, the difference over the run), also per generated token of the run; "
        "sampling: its seconds choosing tokens (masks applied there); decode: its seconds in the model's decoding "
        "steps (the masks are computed on a thread of their own meanwhile, on the same cores).",
    ]
    return [served]


def structured_outputs_tables(raw: dict, described: dict) -> list[dict]:
    """The library comparison (`raw["libraries"]`) and the served mix (`raw["serving"]`), whichever are present."""
    tables = []
    if "libraries" in raw:
        tables += library_tables(raw["libraries"])
    if "serving" in raw:
        tables += serving_tables(raw["serving"])
    return tables
