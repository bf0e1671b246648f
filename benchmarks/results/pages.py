"""A results page from its JSON: `write` saves a run's results dictionary and renders `docs/results/NAME.md` from
what it saved; `render` is the rendering alone, and `TABLE_MAKERS` names each table maker a JSON's `tables_from` may
name. The package's docstring (benchmarks/results/__init__.py) says what a results dictionary holds.

    from benchmarks.provenance import command_line, machine
    from benchmarks.results.pages import write
    write(
        {"title": "Speed", "command": command_line(), "machine": machine(threads=2),
         "tables_from": "openvino_route", "raw": {"settings": ..., "runs": ...}},
        Path("docs/results/x.json"),
        Path("docs/results/x.md"),
    )
"""

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from benchmarks.provenance import CPU_FLAGS, command_line, machine
from benchmarks.results import engines, quality, serve_workloads, speed, structured
from benchmarks.results.cells import table

# Ends the rendered part of a page; what follows is written by hand and holds no table.
RENDERED_END = "<!-- The page above this line is rendered from the JSON; edit that and render again. -->"
# Ends the rendered part of a page whose JSON keeps its tables as formatted text (no raw values behind the cells).
TEXT_END = (
    "<!-- The page above this line is the run's text kept in the JSON: its tables are not computed from raw values. -->"
)

# Each computes a page's tables from the raw values its script saved (and the machine they ran on), when the page is
# rendered: `TABLE_MAKERS[results["tables_from"]](results["raw"], results["machine"])`. A maker imports only the
# cells (benchmarks/results/cells.py), never the script that measured: a page renders without its script's imports.
TableMaker = Callable[[dict, dict], list[dict]]
TABLE_MAKERS: dict[str, TableMaker] = {
    "openvino_route": engines.openvino_route_tables,
    "engines": engines.engine_tables,
    "profile_decode": engines.profile_tables,
    "export_memory": speed.export_memory_tables,
    "gpu_decode": speed.gpu_decode_tables,
    "reference_cpu": speed.reference_cpu_tables,
    "side_by_side": speed.side_by_side_tables,
    "build_time": speed.build_time_tables,
    "serve_mixed": speed.serve_mixed_tables,
    "speculative": speed.speculative_tables,
    "paged_call_sizes": speed.paged_call_sizes_tables,
    "one_row_steps": speed.one_row_steps_tables,
    "serve_workloads": serve_workloads.serve_workload_tables,
    "int4_domains": quality.domain_tables,
    "matmul_bounds": quality.matmul_bounds_tables,
    "quantized_validation": quality.quantized_validation_tables,
    "string_reversal": quality.string_reversal_tables,
    "structured_outputs": structured.structured_outputs_tables,
}


def describe_machine(described: dict | None) -> str:
    if described is None:
        return "not recorded (the run predates the record)."
    if "gpu" in described:  # a GPU run: the accelerator, not the host's CPU, decides the figures
        versions = ", ".join(f"{name} {version}" for name, version in described["versions"].items())
        return f"{described['gpu']}; {described['date']}; {versions}."
    cpu = described["cpu"]
    flags = ", ".join(flag for flag, present in cpu["flags"].items() if present) or "none of " + ", ".join(CPU_FLAGS)
    count = described.get("threads")
    threads = f", {count} thread{'s' if count != 1 else ''}" if count else ""
    shared = " shared with other jobs (figures depressed and noisy; read the ratios)" if described["shared"] else ""
    versions = ", ".join(f"{name} {version}" for name, version in described["versions"].items())
    return f"{cpu['model']} ({flags}), {described['cores']} cores{shared}{threads}; {described['date']}; {versions}."


def render_table(rendered: dict) -> str:
    lines = [*(f"{text}\n" for text in rendered.get("text", [])), f"**{rendered['heading']}**", ""]
    lines.append("| " + " | ".join(rendered["columns"]) + " |")
    lines.append("|" + "---|" * len(rendered["columns"]))
    lines += ["| " + " | ".join(row) + " |" for row in rendered["rows"]]
    return "\n".join(lines)


def computes_its_tables(results: dict) -> bool:
    """Whether a results dictionary's tables are computed from its raw values (`tables_from`) rather than kept as
    formatted text (`tables`)."""
    return "tables_from" in results


def results_tables(results: dict) -> list[dict]:
    """The page's tables: computed from `raw` by the maker its script named, or the text the JSON keeps."""
    if computes_its_tables(results):
        return TABLE_MAKERS[results["tables_from"]](results["raw"], results["machine"])
    return results["tables"]


def made_by(results: dict) -> str:
    """The commands that made the page, each in a code span of its own (a page of several scripts lists each)."""
    return " and ".join(f"`{command}`" for command in results.get("commands", [results["command"]]))


def render(results: dict, json_name: str) -> str:
    """The page's rendered part, from a results dictionary as read back from `json_name`."""
    again = f"render again with `python -m benchmarks.results docs/results/{json_name}`"
    if computes_its_tables(results):
        source = f"raw results: [{json_name}]({json_name}), from which every table figure is computed; {again}"
    else:
        source = (
            f"its report: [{json_name}]({json_name}), which keeps these tables as the run's formatted text, not "
            f"computed from raw values; {again}"
        )
    parts = [
        f"# {results['title']}",
        f"Made by {made_by(results)} ({source}).",
        f"Machine: {describe_machine(results['machine'])}",
        *results.get("notes", []),
        *(render_table(rendered) for rendered in results_tables(results)),
        *results.get("after", []),
        RENDERED_END if computes_its_tables(results) else TEXT_END,
    ]
    return "\n\n".join(parts) + "\n"


def from_markdown(report: str, raw, threads: int | None, shared: bool = True) -> dict:
    """A results dictionary from a script's Markdown report, for scripts that print one: its first `# ` heading is
    the title, its tables (each with the bold or `#` heading just above it, and the paragraphs before that since the
    previous table) the tables, the paragraphs after the last table `after`; `raw` is what the script measured."""
    blocks = [block.strip("\n") for block in report.strip().split("\n\n") if block.strip()]
    title, tables, pending = "Results", [], []
    for block in blocks:
        lines = block.splitlines()
        if lines[0].startswith("# ") and title == "Results" and not tables and not pending:
            title = lines[0][2:].strip()
            block = "\n".join(lines[1:]).strip()
            if not block:
                continue
            lines = block.splitlines()
        rows = [line for line in lines if line.startswith("|")]
        if len(rows) >= 2 and len(rows) == len(lines) and set(rows[1].replace("|", "").strip()) <= set("-: "):
            heading = (
                pending.pop() if pending and (pending[-1].startswith(("**", "#")) and "\n" not in pending[-1]) else ""
            )
            cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]
            tables.append(table(heading.strip("*# ") or "Results", cells[0], cells[2:]))
            tables[-1]["text"], pending = pending, []
        else:
            pending.append(block)
    if not tables:
        raise ValueError("the report has no table to publish")
    return {"title": title, "command": command_line(), "machine": machine(threads, shared), "tables": tables,
            "after": pending, "raw": raw}  # fmt: skip


def publish_report(report: str, json_path: Path, markdown_path: Path | None, raw, threads: int | None) -> str:
    """`write` for a script that makes a Markdown report: its results and tables as JSON in `json_path`, and the
    page rendered from that JSON in `markdown_path`. The tables are the report's text, and the page says so
    (`TEXT_END`): a script whose figures should be computed from raw values names a table maker instead."""
    return write(from_markdown(report, raw, threads), json_path, markdown_path)


def rendered_part(page_text: str) -> str:
    """A page's text up to and including the rendered part's end marker ("" when it has none)."""
    for end in (RENDERED_END, TEXT_END):
        head, marker, _ = page_text.partition(end)
        if marker:
            return head + marker + "\n"
    return ""


def hand_written_part(page_text: str) -> str:
    """What a page says after its rendered part (kept when the page is rendered again)."""
    return page_text[len(rendered_part(page_text)) :] if rendered_part(page_text) else ""


def write(results: dict, json_path: Path, markdown_path: Path | None = None) -> str:
    """Save `results` as JSON, then render the page from the saved file (kept after the rendered part: whatever
    the existing page says below it) and write it to `markdown_path`. Returns the page."""
    json_path = Path(json_path)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    page = render(json.loads(json_path.read_text()), json_path.name)
    if markdown_path is not None:
        markdown_path = Path(markdown_path)
        kept = hand_written_part(markdown_path.read_text()) if markdown_path.is_file() else ""
        markdown_path.write_text(page + kept)
    return page


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.results NAME.json [--output PAGE]`: print the page's rendered part, or rewrite PAGE's
    rendered part and keep what it says after it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="a results JSON file (docs/results/NAME.json)")
    parser.add_argument("--output", type=Path, help="the page to (re)write; default: print the rendered part")
    args = parser.parse_args(argv)
    results = json.loads(args.json.read_text())
    if args.output:
        kept = hand_written_part(args.output.read_text()) if args.output.is_file() else ""
        args.output.write_text(render(results, args.json.name) + kept)
    else:
        print(render(results, args.json.name), end="")
