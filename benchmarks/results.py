"""Published results: each `docs/results/NAME.md` is rendered from `NAME.json` beside it, which its script wrote.

A script builds one results dictionary: what it measured (`raw`, in its own form), the tables made from it (`tables`:
heading, columns and rows of formatted cells), the command that made it, and the machine it ran on (`machine()`).
`write` saves the JSON, reads it back and renders the page from what it read, so the page never says more than
the JSON holds. The page may go on after the rendered part (explanations); it holds no table there.

    from results import machine, table, write
    write(
        {"title": "Speed", "command": "python benchmarks/x.py", "machine": machine(threads=2),
         "tables": [table("decode", ["system", "tok/s"], [["a", "12.3"]])], "raw": measurements},
        Path("docs/results/x.json"),
        Path("docs/results/x.md"),
    )

Render a page again from its JSON (the test suite does, and compares):

    python benchmarks/results.py docs/results/x.json --output docs/results/x.md
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

# Ends the rendered part of a page; what follows is written by hand and holds no table.
RENDERED_END = "<!-- The page above this line is rendered from the JSON; edit that and render again. -->"
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
PACKAGES = ("torch", "transformers", "onnxruntime", "onnx")


def cpu_description() -> dict:
    """The CPU's model name (as `lscpu` shows it, from /proc/cpuinfo) and which of the flags that decide the
    kernels (AVX2, AVX-512, VNNI, BF16, AMX) it has."""
    model, flags = platform.processor() or "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {"model": model, "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def machine(threads: int | None, shared: bool = True, packages: tuple[str, ...] = PACKAGES) -> dict:
    """Where and when a run happened: CPU, cores this process may use, the threads the run used, whether other jobs
    shared the machine, the UTC date and the installed versions of `packages`."""
    versions = {"python": platform.python_version()}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return {
        "cpu": cpu_description(),
        "cores": len(os.sched_getaffinity(0)),
        "threads": threads,
        "shared": shared,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": versions,
    }


def table(heading: str, columns: list[str], rows: list[list]) -> dict:
    """One table of a page: every cell is already formatted (the raw figures live in the results' `raw`)."""
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"table {heading!r}: every row needs {len(columns)} cells ({columns})")
    return {"heading": heading, "columns": columns, "rows": [[str(cell) for cell in row] for row in rows]}


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


def render(results: dict, json_name: str) -> str:
    """The page's rendered part, from a results dictionary as read back from `json_name`."""
    parts = [
        f"# {results['title']}",
        f"Made by `{results['command']}` (raw results: [{json_name}]({json_name}); render again with "
        f"`python benchmarks/results.py docs/results/{json_name}`).",
        f"Machine: {describe_machine(results['machine'])}",
        *results.get("notes", []),
        *(render_table(rendered) for rendered in results["tables"]),
        *results.get("after", []),
        RENDERED_END,
    ]
    return "\n\n".join(parts) + "\n"


def command_line() -> str:
    """This process's command as a reader would type it from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    root = Path(__file__).resolve().parents[1]
    shown = script.relative_to(root) if script.is_relative_to(root) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


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
    page rendered from that JSON in `markdown_path` (the page every docs/results/*.md is)."""
    return write(from_markdown(report, raw, threads), json_path, markdown_path)


def rendered_part(page_text: str) -> str:
    """A page's text up to and including the rendered part's end marker ("" when it has none)."""
    head, marker, _ = page_text.partition(RENDERED_END)
    return head + marker + "\n" if marker else ""


def write(results: dict, json_path: Path, markdown_path: Path | None = None) -> str:
    """Save `results` as JSON, then render the page from the saved file (kept after the rendered part: whatever
    the existing page says below it) and write it to `markdown_path`. Returns the page."""
    json_path = Path(json_path)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    page = render(json.loads(json_path.read_text()), json_path.name)
    if markdown_path is not None:
        markdown_path = Path(markdown_path)
        kept = markdown_path.read_text().partition(RENDERED_END)[2] if markdown_path.is_file() else ""
        markdown_path.write_text(page + kept.removeprefix("\n"))
    return page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="a results JSON file (docs/results/NAME.json)")
    parser.add_argument("--output", type=Path, help="the page to (re)write; default: print the rendered part")
    args = parser.parse_args()
    results = json.loads(args.json.read_text())
    if args.output:
        kept = args.output.read_text().partition(RENDERED_END)[2] if args.output.is_file() else ""
        args.output.write_text(render(results, args.json.name) + kept.removeprefix("\n"))
    else:
        print(render(results, args.json.name), end="")


if __name__ == "__main__":
    main()
