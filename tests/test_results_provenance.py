"""Every published results page says which command made it, and its tables come from raw results kept beside it:
each docs/results/*.md names a script of this repository that exists, every JSON file it names exists and parses,
and a page with a table has its JSON beside it (NAME.json), from which benchmarks/results.py renders the page's
rendered part exactly (title, command, machine, tables); below that part no table is written by hand."""

import csv
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from results import RENDERED_END, render, rendered_part  # noqa: E402  (benchmarks/results.py)

TABLE_ROW = re.compile(r"^\|.*\|[ \t]*$", flags=re.M)
# Pages whose raw results are the CSV files their study writes (one row per seed, model and length), beside the page:
# each of the page's tables must be one the study computes from them.
CSV_SOURCED = {"extrapolation.md": "examples/extrapolation_study.py"}


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_a_results_page_names_an_existing_script_and_json_that_parses(page: Path) -> None:
    text = page.read_text()
    scripts = set(re.findall(r"(?:scripts|benchmarks|examples)/[\w/]+\.(?:py|sh)", text))
    assert scripts, f"{page.name} names no script that produced it"
    missing = [script for script in scripts if not (ROOT / script).is_file()]
    assert not missing, f"{page.name} names scripts that do not exist: {missing}"
    for name in set(re.findall(r"\]\(([\w.-]+\.json)\)", text)):
        assert (page.parent / name).is_file(), f"{page.name} links to {name}, which is not beside it in docs/results/"
    for name in set(re.findall(r"[\w./-]+\.json", text)):
        path = page.parent / Path(name).name
        if path.is_file():
            json.loads(path.read_text())


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_a_results_pages_tables_are_rendered_from_the_json_beside_it(page: Path) -> None:
    text = page.read_text()
    if not TABLE_ROW.search(text):
        assert RENDERED_END not in text, f"{page.name} has a rendered part but no table"
        return
    if page.name in CSV_SOURCED:
        computed = study_tables(page, ROOT / CSV_SOURCED[page.name])
        for block in table_blocks(text):
            assert block in computed, f"{page.name}: this table is not one its CSV files give:\n{block}"
        return
    results_file = page.with_suffix(".json")
    assert results_file.is_file(), (
        f"{page.name} has a table but no {results_file.name} beside it: run the script the page names with "
        f"--json docs/results/{results_file.name} (benchmarks/results.py renders the page from it)"
    )
    results = json.loads(results_file.read_text())
    rendered = rendered_part(text)
    assert rendered, f"{page.name} has a table outside a part rendered from {results_file.name} (no end marker)"
    assert rendered == render(results, results_file.name), (
        f"{page.name} is not what {results_file.name} renders: python benchmarks/results.py "
        f"docs/results/{results_file.name} --output docs/results/{page.name}"
    )
    after = text[len(rendered) :]
    assert not TABLE_ROW.search(after), f"{page.name} has a hand-written table below its rendered part"


def table_blocks(text: str) -> list[str]:
    """The page's tables: runs of consecutive lines that start and end with `|`."""
    blocks, current = [], []
    for line in [*text.splitlines(), ""]:
        if TABLE_ROW.fullmatch(line):
            current.append(line.rstrip())
        elif current:
            blocks.append("\n".join(current))
            current = []
    return blocks


def study_tables(page: Path, script: Path) -> set[str]:
    """Every table the length-extrapolation study makes (its `aggregate` and `markdown_table`) from the CSV files
    the page names."""
    spec = importlib.util.spec_from_file_location("extrapolation_study", script)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    tables = set()
    for name in re.findall(r"\(([\w.-]+\.csv)\)", page.read_text()):
        with (page.parent / name).open(newline="") as handle:
            rows = [
                {
                    **row,
                    "eval_length": int(row["eval_length"]),
                    "value": float(row["value"]) if row["value"] else None,
                }
                for row in csv.DictReader(handle)
            ]
        for task, evaluation, metric in {(row["task"], row["evaluation"], row["metric"]) for row in rows}:
            chosen = [
                row for row in rows if (row["task"], row["evaluation"], row["metric"]) == (task, evaluation, metric)
            ]
            lengths = sorted({row["eval_length"] for row in chosen})
            # The study's form: perplexities with the longest / shortest ratio, accuracies in percent.
            percent = metric != "perplexity"
            table = study.markdown_table(
                study.aggregate(rows, task, evaluation, metric), lengths, "encoding", percent, not percent
            )
            tables.add("\n".join(table))
    return tables


def test_rendering_puts_every_figure_of_the_json_in_the_page(tmp_path):
    """The renderer's own check (so the comparison above cannot pass on an empty rendering): every cell, the
    command, the CPU and the versions reach the page, and a page's hand-written tail survives a new rendering."""
    from results import machine, table, write

    results = {
        "title": "A check",
        "command": "python benchmarks/check.py --quick",
        "machine": machine(threads=2),
        "notes": ["A note."],
        "tables": [table("speed", ["system", "tok/s"], [["a", "12.5"], ["b", "7.25"]])],
        "raw": {"a": 12.5, "b": 7.25},
    }
    (tmp_path / "check.md").write_text("old\n" + RENDERED_END + "\n\n## Reading it\n\nKept.\n")
    page = write(results, tmp_path / "check.json", tmp_path / "check.md")
    for text in (
        "| a | 12.5 |",
        "| b | 7.25 |",
        "`python benchmarks/check.py --quick`",
        "A note.",
        "[check.json](check.json)",
    ):
        assert text in page
    assert results["machine"]["cpu"]["model"] in page and results["machine"]["versions"]["python"] in page
    written = (tmp_path / "check.md").read_text()
    assert written.startswith(page) and written.endswith("## Reading it\n\nKept.\n") and "old" not in written
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        table("bad", ["system", "tok/s"], [["a"]])


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(path.relative_to(ROOT)) for path in DOCUMENTS])
def test_every_relative_link_resolves(document: Path) -> None:
    """Each relative link (and image) of README.md and docs/ names a file or folder that exists, and an anchor
    (`page.md#section`) names a heading of that page."""
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{document.relative_to(ROOT)} links to what does not exist: {broken}"


def test_a_scripts_markdown_report_becomes_results_that_render_it_again(tmp_path):
    """`publish_report` (the scripts' --json): the report's tables, with the heading above each and the paragraphs
    between them, land in the JSON and come back in the page in the same order, cell for cell."""
    from results import publish_report

    report = "\n".join(
        [
            "# Build time",
            "",
            "Seconds, wall clock.",
            "",
            "**fp32**",
            "",
            "| way | seconds |",
            "|---|---|",
            "| one process | 14.3 |",
            "",
            "- a note between the tables",
            "",
            "## int8",
            "",
            "| way | seconds |",
            "|---|---|",
            "| one process | 20.2 |",
            "",
            "Load average 1.1.",
        ]
    )
    page = publish_report(report, tmp_path / "build.json", tmp_path / "build.md", {"fp32": [14.3]}, threads=2)
    results = json.loads((tmp_path / "build.json").read_text())
    assert results["title"] == "Build time" and results["raw"] == {"fp32": [14.3]}
    assert [(table["heading"], table["rows"]) for table in results["tables"]] == [
        ("fp32", [["one process", "14.3"]]),
        ("int8", [["one process", "20.2"]]),
    ]
    order = [
        "Seconds, wall clock.",
        "**fp32**",
        "| one process | 14.3 |",
        "- a note between",
        "**int8**",
        "| one process | 20.2 |",
        "Load average 1.1.",
    ]
    positions = [page.index(text) for text in order]
    assert positions == sorted(positions) and (tmp_path / "build.md").read_text() == page


# A measured figure: a number with the unit of a speed, a time, a share or a ratio ("49.3 tok/s", "12 s", "+4.3%",
# "1.05x"). Counts, sizes of a model's shape and settings ("128 tokens", "49.3M", "batch 8") carry no such unit.
MEASURED_FIGURE = re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)?\s?(?:tok(?:ens)?/s|ms\b|s\b|%|x\b|×|MB\b|GB\b)")
RESULTS_LINK = re.compile(r"\]\((?:[\w./-]*/)?results/([\w.-]+\.md)\)")


def figureless_pages() -> set[str]:
    """The results pages that hold no figures (no table): they name the command that measures them again."""
    return {page.name for page in PAGES if not TABLE_ROW.search(page.read_text())}


def figures_beside_figureless_links(text: str, figureless: set[str]) -> list[str]:
    """Each block of `text` (paragraph or table, code left out) that links a page of `figureless`, or is the table
    right after such a paragraph, with the measured figures it quotes: the page it would cite no longer holds them."""
    blocks = [block.strip() for block in re.split(r"\n\s*\n", re.sub(r"```.*?```", "", text, flags=re.S))]
    quoted, cites_figureless = [], False
    for block in blocks:
        is_table = bool(block) and all(TABLE_ROW.fullmatch(line.strip()) for line in block.splitlines())
        links = set(RESULTS_LINK.findall(block)) & figureless
        if links or (is_table and cites_figureless):
            figures = [match.group(0) for match in MEASURED_FIGURE.finditer(block)]
            if figures:
                quoted.append(f"{sorted(links) or 'table after it'}: {figures[:6]} in {block[:120]!r}")
        cites_figureless = bool(links) or (is_table and cites_figureless)
    return quoted


PROSE = [document for document in DOCUMENTS if document.parent.name != "results"]  # the pages that cite results


@pytest.mark.parametrize("document", PROSE, ids=[str(path.relative_to(ROOT)) for path in PROSE])
def test_docs_quote_no_figures_from_a_results_page_that_holds_none(document: Path) -> None:
    """A paragraph of README.md or docs/ that cites a results page holding no figures (removed, because no command's
    raw results stood behind them) quotes none either, nor does the table right after it: a figure is quoted from a
    page that holds it, or the paragraph says which command measures it."""
    quoted = figures_beside_figureless_links(document.read_text(), figureless_pages())
    assert not quoted, f"{document.relative_to(ROOT)} quotes figures its cited pages no longer hold: {quoted}"


def test_the_figure_check_finds_a_figure_quoted_from_a_figureless_page() -> None:
    """The check above on text made to fail it: a speed in the citing paragraph, and in the table after it."""
    page = "benchmark_engines_cpu.md"
    cited = f"int8 decodes at 130.6 tok/s ([results]({'results/' + page}))."
    assert figures_beside_figureless_links(cited, {page})
    table = f"Measured by the engine benchmark ([results](results/{page})).\n\n| a | b |\n|---|---|\n| int8 | 12 ms |\n"
    assert figures_beside_figureless_links(table, {page})
    assert not figures_beside_figureless_links(
        f"It measures tokens/s at batch 1 and 8 ([page](results/{page})).", {page}
    )
