"""Table makers of the quality pages: quantized builds' perplexity on tuning and held-out texts
(`benchmarks.int4_domains`), the per-matrix and end-to-end validation bounds (`benchmarks.matmul_bounds`,
`benchmarks.quantized_validation_bounds`) and the string-reversal study (examples/train_string_reversal.py)."""

import math
import statistics

from benchmarks.results.cells import table

TUNING, HELD_OUT = "tuning", "held-out"  # the two sets of texts a run's raw values name
SET_HEADINGS = {
    TUNING: "Tuning texts (the int4 8-bit budget default, 0.3, was chosen on these five)",
    HELD_OUT: "Held-out texts (no default was tuned on these)",
}


def change(value: float, base: float) -> str:
    return f"{value / base - 1:+.1%}"


def pooled_perplexity(runs: dict[str, dict], texts: list[str]) -> float:
    """The perplexity of `texts` taken together: exp of the token-weighted mean NLL."""
    tokens = sum(runs[text]["tokens"] for text in texts)
    return math.exp(sum(runs[text]["mean_nll"] * runs[text]["tokens"] for text in texts) / tokens)


def domain_tables(raw: dict, described: dict | None = None) -> list[dict]:
    """The page's tables, from the raw values alone: per set of texts (tuning, held out), each text's tokens and each
    build's perplexity with its change against the reference (the first build); then per build its weight bytes and,
    per set, the change of the pooled perplexity and the range of the per-text changes; then the speed table where
    the run timed the builds."""
    runs, builds = raw["runs"], list(raw["builds"])
    reference, others = builds[0], builds[1:]
    made = []
    for chosen in (TUNING, HELD_OUT):
        rows = []
        for text in (name for name, about in raw["texts"].items() if about["set"] == chosen):
            base = runs[reference][text]["perplexity"]
            cells = [text, str(runs[reference][text]["tokens"]), f"{base:.2f}"]
            cells += [
                f"{runs[name][text]['perplexity']:.2f} ({change(runs[name][text]['perplexity'], base)})"
                for name in others
            ]
            rows.append(cells)
        made.append(table(SET_HEADINGS[chosen], ["text", "tokens", *builds], rows))
    rows = []
    for name in others:
        cells = [name, f"{raw['builds'][name]['weight_bytes'] / 1e6:.1f}"]
        for chosen in (TUNING, HELD_OUT):
            texts = [text for text, about in raw["texts"].items() if about["set"] == chosen]
            changes = [runs[name][text]["perplexity"] / runs[reference][text]["perplexity"] - 1 for text in texts]
            pooled = change(pooled_perplexity(runs[name], texts), pooled_perplexity(runs[reference], texts))
            cells += [pooled, f"{min(changes):+.1%} to {max(changes):+.1%}"]
        rows.append(cells)
    columns = ["build", "weights read per step, MB", "tuning: pooled", "tuning: per text", "held-out: pooled"]
    columns.append("held-out: per text")
    summary = table(f"Change against {reference} by set (pooled: all the set's tokens together)", columns, rows)
    summary["text"] = [
        f"Reference {reference}: {raw['builds'][reference]['weight_bytes'] / 1e6:.1f} MB of weights read per decode "
        "step (the graph's initializers less the embedding table it looks rows up in)."
    ]
    made.append(summary)
    if raw.get("bench"):
        made.append(speed_table(raw["bench"], others[0] if others else reference, raw["threads"]))
    return made


def speed_table(timings: dict[str, list[dict]], baseline: str, threads: int) -> dict:
    """Weight bytes, batch-1 and batch-8 decode and first-token time (medians over rounds), and the median per-round
    ratio of batch-1 decode speed to `baseline`'s."""
    rows = []
    for name, runs in timings.items():

        def median(index, key, runs=runs):
            return statistics.median(run["rows"][index][key] for run in runs)

        ratios = [
            run["rows"][0]["decode_tokens_per_s"] / base["rows"][0]["decode_tokens_per_s"]
            for run, base in zip(runs, timings[baseline])
        ]
        rows.append([
            name, f"{runs[0]['weight_bytes'] / 1e6:.1f}", f"{median(0, 'decode_tokens_per_s'):.1f}",
            f"{statistics.median(ratios):.2f}", f"{median(1, 'decode_tokens_per_s'):.1f}",
            f"{median(0, 'time_to_first_token_s') * 1e3:.0f}",
        ])  # fmt: skip
    heading = (
        f"Speed (`vaswani bench`, {threads} threads, 128-token prompts, 64 new tokens; medians of {len(runs)} rounds, "
        f"each build in its own process; ratio: batch-1 decode against {baseline})"
    )
    columns = ["build", "weights MB", "batch 1 tokens/s", "ratio", "batch 8 tokens/s", "first token ms"]
    return table(heading, columns, rows)


def matmul_bounds_tables(raw: dict, described: dict) -> list[dict]:
    """benchmarks/matmul_bounds.py: per model and format, the worst honest quantized matrix of each width and the
    mildest broken one, each a relative RMS error fed the float graph's activations; then the logits' error end to
    end beside the float model's response to simulated rounding (each scheme's `rounding_bits`, `vaswani/quantization/schemes.py`)."""
    rows, end_to_end = [], []
    for model, formats in raw.items():
        for quantize, measured in formats.items():
            honest = measured["honest"]
            worst = {
                bits: max(row["relative_rms"] for row in honest if row["bits"] == bits)
                for bits in sorted({row["bits"] for row in honest})
            }
            mildest = min(measured["broken"], key=lambda row: row["relative_rms"])
            rows.append([
                model, quantize, str(len(honest)),
                ", ".join(f"{bits}-bit {value:.4f}" for bits, value in worst.items()),
                f"{mildest['relative_rms']:.3f} ({mildest['how']}, {mildest['position']})",
            ])  # fmt: skip
            response = measured["response_logits_relative_rms"]
            end_to_end.append([
                model, quantize, f"{measured['logits_relative_rms']:.4f}", f"{response:.4f}",
                f"{measured['logits_relative_rms'] / response:.2f}" if response else "–",
                "yes" if measured["passed"] else "no",
            ])  # fmt: skip
    columns = ["model", "format", "matrices", "worst honest matrix", "mildest broken matrix"]
    made = [table("Each quantized matrix, fed the float graph's activations (relative RMS error)", columns, rows)]
    columns = ["model", "format", "logits relative RMS", "simulated rounding's", "ratio", "export validated"]
    made.append(
        table("End to end: the logits against the float model's response to simulated rounding", columns, end_to_end)
    )
    return made


def string_reversal_tables(raw: dict, described: dict) -> list[dict]:
    """examples/train_string_reversal.py: per evaluated string length, the teacher-forced token accuracy and the
    greedy exact match measured on fresh strings, beside the accuracy the textbook reports for that length."""
    args, textbook, rows = raw["args"], raw.get("textbook", {}), []
    for row in raw["per_length"]:
        length = row["length"]
        note = "" if args["min_length"] <= length <= args["max_length"] else " (longer than any training string)"
        reported = textbook.get(str(length))
        rows.append([
            f"{length}{note}", f"{100 * row['token_accuracy']:.2f}%", "" if reported is None else f"{reported}%",
            f"{100 * row['exact_match']:.2f}%",
        ])  # fmt: skip
    columns = ["length", "teacher-forced token accuracy", "textbook", "greedy exact match"]
    return [table("Accuracy by string length", columns, rows)]


def quantized_validation_tables(raw: list[dict], described: dict) -> list[dict]:
    """benchmarks/quantized_validation_bounds.py: per export (model, quantization, honest or corrupted graph), the
    logits' largest relative RMS error, lowest cosine and lowest top-1 agreement over the validation cases, then the
    states' (caches, encoder outputs) largest relative RMS with the output it belongs to, and lowest cosine."""

    def worst(rows: list[dict]) -> tuple[str, str, str]:
        if not rows:
            return "", "", ""
        largest = max(rows, key=lambda row: row["relative_rms"])
        top1 = [row["top1"] for row in rows if row["top1"] is not None]
        return (
            f"{largest['relative_rms']:.4f} ({largest['output'].split('/')[-1]})",
            f"{min(row['cosine'] for row in rows):.5f}",
            f"{min(top1):.3f}" if top1 else "",
        )

    rows = []
    for entry in raw:
        logits = [row for row in entry["rows"] if row["output"].endswith("/logits")]
        states = [row for row in entry["rows"] if not row["output"].endswith("/logits")]
        (logits_rms, logits_cosine, top1), (states_rms, states_cosine, _) = worst(logits), worst(states)
        rows.append([entry["model"], entry["quantization"], entry["graph"], logits_rms.split(" ")[0], logits_cosine,
                     top1, states_rms, states_cosine])  # fmt: skip
    columns = ["model", "quantization", "graph", "logits rel. RMS", "logits cosine", "top-1"]
    columns += ["states rel. RMS (worst)", "states cosine"]
    return [table("Honest and corrupted exports", columns, rows)]
