"""Every published results page says which command made it, and its tables come from raw results kept beside it:
each docs/results/*.md names a script of this repository that exists, every JSON file it names exists and parses,
and a page with a table has its JSON beside it (NAME.json), from which benchmarks.results renders the page's
rendered part exactly (title, command, machine, tables); below that part no table is written by hand. The tables'
figures are computed from the JSON's raw values (per-round seconds, tokens/s, bytes) when the page is rendered, not
kept as formatted text, except on the pages listed in TEXT_TABLE_PAGES, which say so. Every number the README quotes
beside a link to a results page is found in that page."""

import csv
import importlib.util
import json
import re
import statistics
from pathlib import Path

import pytest

from benchmarks.results.cells import spread
from benchmarks.results.pages import RENDERED_END, TABLE_MAKERS, TEXT_END, render, rendered_part

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))

TABLE_ROW = re.compile(r"^\|.*\|[ \t]*$", flags=re.M)
# Pages whose raw results are the CSV files their study writes (one row per seed, model and length), beside the page:
# each of the page's tables must be one the study computes from them.
CSV_SOURCED = {"extrapolation.md": "examples/extrapolation_study.py"}
# Pages whose JSON keeps its tables as the run's formatted text, because their script still writes formatted cells
# (results.table / from_markdown): each page says so where it names its command and ends with results.TEXT_END. None
# is quoted by the README (see test_the_pages_the_readme_quotes_compute_their_tables). Convert a page by giving its
# script a table maker in benchmarks/results/ and writing `tables_from` and raw values instead of `tables`.
TEXT_TABLE_PAGES = {
}
# README-quoted pages whose scripts another change is converting; each leaves this list when its page computes its
# tables (the int4 domains page is being measured again with held-out texts; the 1B bound page with a bandwidth
# probe on the decode's own threads).
PENDING_CONVERSION = {
}


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_a_results_page_names_an_existing_script_and_json_that_parses(page: Path) -> None:
    text = page.read_text()
    scripts = set(re.findall(r"(?:scripts|benchmarks|examples)/[\w/]+\.(?:py|sh)", text))
    modules = set(re.findall(r"python -m (benchmarks(?:\.\w+)+)", text))
    assert scripts or modules, f"{page.name} names no script that produced it"
    missing = [script for script in scripts if not (ROOT / script).is_file()]
    missing += [module for module in modules if importlib.util.find_spec(module) is None]
    assert not missing, f"{page.name} names scripts that do not exist: {missing}"
    absent = missing_results_files(page)
    assert not absent, f"{page.name} names results files that do not exist: {absent}"
    for name in set(re.findall(r"[\w./-]+\.json", text)):
        path = page.parent / Path(name).name
        if path.is_file():
            json.loads(path.read_text())


# How a page without figures introduces the command that would measure them and write its JSON, which is not there.
MEASURE_AGAIN = "it writes the raw results as JSON beside this page, where none is kept yet"


def missing_results_files(page: Path) -> list[str]:
    """The JSON files `page` names that do not exist beside it. The one exception: a page that holds no figures
    (no table) may name its own JSON (NAME.json for NAME.md) as the `--json` output of the command that would
    measure it again, where it says that no such file is kept yet (MEASURE_AGAIN); anywhere else, or on a page with
    a table, a name without a file is a broken reference."""
    text = page.read_text()
    own_output = f"--json docs/results/{page.stem}.json"
    without_table = not TABLE_ROW.search(text) and RENDERED_END not in text and TEXT_END not in text
    without_table = without_table and MEASURE_AGAIN in text
    absent = []
    for match in re.finditer(r"[\w./-]+\.json", text):
        name = match.group(0)
        if (page.parent / Path(name).name).is_file():
            continue
        is_own_output = text[max(0, match.start() - 7) : match.end()].startswith("--json ") and name == (
            f"docs/results/{page.stem}.json"
        )
        if not (is_own_output and without_table and own_output in text):
            absent.append(name)
    return absent


def test_the_named_file_check_finds_a_json_that_is_not_there(tmp_path) -> None:
    """The check above on pages made to fail it: a figures page naming a missing JSON, and a figureless page naming
    another page's missing JSON; a figureless page's own `--json` output passes."""
    (tmp_path / "speed.md").write_text("# Speed\n\nRaw results: [speed.json](speed.json).\n\n| a |\n|---|\n| 1 |\n")
    assert missing_results_files(tmp_path / "speed.md") == ["speed.json", "speed.json"]
    (tmp_path / "later.md").write_text("To measure: `python x.py --json docs/results/other.json`.\n")
    assert missing_results_files(tmp_path / "later.md") == ["docs/results/other.json"]
    (tmp_path / "later.md").write_text("To measure: `python x.py --json docs/results/later.json`.\n")
    assert missing_results_files(tmp_path / "later.md") == ["docs/results/later.json"]  # not said to be missing
    (tmp_path / "later.md").write_text(f"To measure ({MEASURE_AGAIN}): `python x.py --json docs/results/later.json`.\n")
    assert missing_results_files(tmp_path / "later.md") == []


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
        f"--json docs/results/{results_file.name} (benchmarks.results renders the page from it)"
    )
    results = json.loads(results_file.read_text())
    rendered = rendered_part(text)
    assert rendered, f"{page.name} has a table outside a part rendered from {results_file.name} (no end marker)"
    assert rendered == render(results, results_file.name), (
        f"{page.name} is not what {results_file.name} renders: python -m benchmarks.results "
        f"docs/results/{results_file.name} --output docs/results/{page.name}"
    )
    after = text[len(rendered) :]
    assert not TABLE_ROW.search(after), f"{page.name} has a hand-written table below its rendered part"


RESULTS_FILES = {page.name: page.with_suffix(".json") for page in PAGES if page.with_suffix(".json").is_file()}


@pytest.mark.parametrize("page", sorted(RESULTS_FILES), ids=sorted(RESULTS_FILES))
def test_a_results_pages_tables_are_computed_from_raw_values(page: str) -> None:
    """A page's JSON holds raw values and names the table maker that computes its tables from them (`tables_from`),
    not tables of formatted cells; the pages listed in TEXT_TABLE_PAGES (their scripts not yet converted) say on
    the page that their tables are the run's text, not computed from raw values."""
    results = json.loads(RESULTS_FILES[page].read_text())
    text = (ROOT / "docs" / "results" / page).read_text()
    if page in TEXT_TABLE_PAGES or page in PENDING_CONVERSION:
        if "tables_from" in results:  # converted: it leaves the list
            pytest.fail(f"{page} computes its tables now: take it off TEXT_TABLE_PAGES / PENDING_CONVERSION")
        assert TEXT_END in text and "not computed from raw values" in text
        return
    assert "tables" not in results, (
        f"{RESULTS_FILES[page].name} keeps tables of formatted cells: its script must write raw values and "
        f"`tables_from` (a table maker of benchmarks/results/), or the page goes on TEXT_TABLE_PAGES"
    )
    assert results.get("tables_from") in TABLE_MAKERS, f"{page}: no table maker computes its tables"
    assert RENDERED_END in text and TEXT_END not in text


def readme_quoted_pages() -> set[str]:
    """The results pages that README sentences quoting numbers cite."""
    readme = (ROOT / "README.md").read_text()
    return {name for sentence, cited in cited_sentences(readme) if quoted_numbers(sentence) for name in cited}


def test_the_pages_the_readme_quotes_compute_their_tables() -> None:
    """The README quotes figures only from pages whose tables are computed from raw values (or whose conversion is
    under way, PENDING_CONVERSION)."""
    quoted = readme_quoted_pages()
    assert {"benchmark_engines_360m_cpu.md", "openvino_route_1b_cpu.md"} <= quoted  # the check sees the citations
    text_pages = quoted & set(TEXT_TABLE_PAGES)
    assert not text_pages, f"README.md quotes pages whose tables are only text: {sorted(text_pages)}"


def results_of(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / name).read_text())


def leading_figure(cell: str) -> float:
    """A cell's median: the number it starts with ("17.7 (15.7-19.6)" -> 17.7; "2669 ms (...)" -> 2669)."""
    return float(re.match(r"[\d.]+", cell).group(0))


def cell_range(cell: str) -> tuple[float, float]:
    low, high = re.search(r"\(([\d.]+)-([\d.]+)\)", cell).groups()
    return float(low), float(high)


@pytest.mark.parametrize("name", sorted(n for n, f in RESULTS_FILES.items() if n.startswith("openvino_route")))
def test_the_openvino_route_tables_are_the_medians_and_ranges_of_the_raw_rounds(name: str) -> None:
    """Each time to first token and decode rate on an OpenVINO route page is the median of its rounds with their
    smallest and largest beside it, computed here from the raw rounds; each ratio is the median of the per-round
    ratios to ONNX Runtime; each row names the precision its process computed in."""
    results = results_of(RESULTS_FILES[name].name)
    tables = TABLE_MAKERS["openvino_route"](results["raw"], results["machine"])
    for made, (build, systems) in zip(tables, results["raw"]["runs"].items(), strict=True):
        column = {heading: index for index, heading in enumerate(made["columns"]) if heading != "x ORT"}
        base = systems["ONNX Runtime"]
        for row, (system, rounds) in zip(made["rows"], systems.items(), strict=True):
            milliseconds = [run["ttft_s"] * 1e3 for run in rounds]
            assert leading_figure(row[column["time to first token"]]) == round(statistics.median(milliseconds))
            assert cell_range(row[column["time to first token"]]) == (
                round(min(milliseconds)),
                round(max(milliseconds)),
            )
            rates = [run["decode_tokens_per_s"]["8"] for run in rounds]
            cell = row[column["decode tok/s, batch 8"]]
            assert leading_figure(cell) == round(statistics.median(rates), 1)
            assert cell_range(cell) == (round(min(rates), 1), round(max(rates), 1))
            ratios = [r["decode_tokens_per_s"]["8"] / b["decode_tokens_per_s"]["8"] for r, b in zip(rounds, base)]
            assert leading_figure(row[column["decode tok/s, batch 8"] + 1]) == round(statistics.median(ratios), 2)
            compute = row[column["weights / compute"]]
            assert compute.startswith(f"{build} / ")
            assert ("bf16" in compute) == ("bf16" in rounds[0]["provider"]), (system, compute)


@pytest.mark.parametrize("name", sorted(n for n, f in RESULTS_FILES.items() if n.startswith("benchmark_engines")))
def test_the_engine_tables_are_the_medians_and_ranges_of_the_raw_rounds(name: str) -> None:
    """Each decode rate on an engine page is count / seconds of each round, their median with the range beside it;
    x transformers the median of same-round ratios; time to first token the median of the rounds' prefill seconds;
    an OpenVINO GenAI row's compute precision is the one the engine reported."""
    results = results_of(RESULTS_FILES[name].name)
    raw = results["raw"]
    tables = TABLE_MAKERS["engines"](raw, results["machine"])
    reference = raw["results"]["transformers fp32"]
    for made, batch in zip(tables, raw["settings"]["batches"]):
        for row, (system, runs) in zip(made["rows"], raw["results"].items(), strict=True):
            assert row[0] == system
            rates = [run["decode"][str(batch)]["count"] / run["decode"][str(batch)]["seconds"] for run in runs]
            assert leading_figure(row[3]) == round(statistics.median(rates), 1)
            assert cell_range(row[3]) == (round(min(rates), 1), round(max(rates), 1))
            references = [
                run["decode"][str(batch)]["count"] / run["decode"][str(batch)]["seconds"] for run in reference
            ]
            ratios = [rate / base for rate, base in zip(rates, references)]
            assert leading_figure(row[4]) == round(statistics.median(ratios), 2)
            info = runs[0].get("info") or {}
            if info.get("INFERENCE_PRECISION_HINT"):
                precision = {"bf16": "bf16", "f32": "fp32"}[info["INFERENCE_PRECISION_HINT"]]
                group = int(info.get("DYNAMIC_QUANTIZATION_GROUP_SIZE") or 0)
                quantized = row[1] not in ("fp32", "bf16")
                # The activations of compressed weights' products are quantized in groups where the engine said so.
                assert row[2].startswith(precision) and (f"int8 activations in groups of {group}" in row[2]) == (
                    bool(group) and quantized
                ), (system, row[2], info)
                steps = info.get("steps INFERENCE_PRECISION_HINT", info["INFERENCE_PRECISION_HINT"])
                if steps != info["INFERENCE_PRECISION_HINT"]:  # decode steps compiled apart: the row names both
                    steps = {"bf16": "bf16", "f32": "fp32"}[steps]
                    decode_part = row[2].split("; ")[1]
                    assert decode_part.startswith(steps) and decode_part.endswith("for decode steps (OpenVINO's calls)")
    prefill = tables[-1]
    for row, runs in zip(prefill["rows"], raw["results"].values(), strict=True):
        assert leading_figure(row[1]) == round(statistics.median(run["prefill"]["seconds"] * 1e3 for run in runs))


def test_a_table_maker_follows_its_raw_values() -> None:
    """The figures move with the raw values they are computed from: every round of every system taking twice the
    seconds halves every decode rate and leaves every ratio to transformers where it was."""
    results = results_of("benchmark_engines_360m_cpu.json")
    before = TABLE_MAKERS["engines"](results["raw"], results["machine"])
    for runs in results["raw"]["results"].values():
        for run in runs:
            for entry in run["decode"].values():
                entry["seconds"] *= 2
    after = TABLE_MAKERS["engines"](results["raw"], results["machine"])
    for old, new in zip(before[0]["rows"], after[0]["rows"], strict=True):
        assert leading_figure(new[3]) == pytest.approx(leading_figure(old[3]) / 2, abs=0.051)
        assert new[4] == old[4]


def test_the_export_memory_tables_are_the_runs_against_the_weights() -> None:
    """The exporter page's peak against the weights is each run's kernel peak over the float32 weights' bytes, and
    its result column says when an export failed."""
    results = results_of("exporter_1b.json")
    raw = results["raw"]
    exports = TABLE_MAKERS["export_memory"](raw, results["machine"])[0]
    runs = [(label, precision, run) for label, by in raw["runs"].items() for precision, run in by.items()]
    for row, (label, precision, run) in zip(exports["rows"], runs, strict=True):
        assert row[:2] == [label, precision]
        assert row[5] == f"{run['peak_rss_bytes'] / raw['weights_bytes']:.2f}x"
        assert (row[7] == "written, validated") == ("outcome" not in run)


@pytest.mark.parametrize("name", ["decode_profile_1b_cpu.json", "prompt_profile_360m_cpu.json"])
def test_the_profile_tables_are_the_medians_of_the_raw_rounds(name: str) -> None:
    """Each part of a profiled step is the median over rounds of that part, the step their sum, with the rounds'
    own sums' range beside it."""
    results = results_of(name)
    made = TABLE_MAKERS["profile_decode"](results["raw"], results["machine"])[0]
    parts = made["columns"][2:7]
    for row, (export, rounds) in zip(made["rows"], results["raw"]["rounds"].items(), strict=True):
        medians = [statistics.median(summary[part] for summary in rounds) for part in parts]
        assert row[0] == export and [float(cell) for cell in row[2:7]] == [round(median) for median in medians]
        assert leading_figure(row[1]) == round(sum(medians))
        totals = [sum(summary[part] for part in parts) for summary in rounds]
        assert cell_range(row[1]) == (round(min(totals)), round(max(totals)))


def test_the_side_by_side_and_reversal_tables_are_computed_from_their_raw_values() -> None:
    """benchmark_cpu: milliseconds, ratio and tokens/s from each task's median seconds; string_reversal: percentages
    of the measured accuracies per length."""
    results = results_of("benchmark_cpu.json")
    for made, rows in zip(TABLE_MAKERS["side_by_side"](results["raw"], {}), results["raw"].values(), strict=True):
        timed = [cells for cells in made["rows"] if cells[0].endswith("(ms)")]
        for cells, row in zip(timed, rows, strict=True):
            assert float(cells[1]) == round(row["reference_seconds"] * 1000, 1)
            assert float(cells[3]) == round(row["vaswani_seconds"] / row["reference_seconds"], 3)
    results = results_of("string_reversal.json")
    (made,) = TABLE_MAKERS["string_reversal"](results["raw"], {})
    for cells, row in zip(made["rows"], results["raw"]["per_length"], strict=True):
        assert float(cells[1].rstrip("%")) == round(100 * row["token_accuracy"], 2)
        assert float(cells[3].rstrip("%")) == round(100 * row["exact_match"], 2)


def test_the_build_time_table_is_the_medians_and_ranges_of_the_rounds() -> None:
    """Each way's seconds are the median of its rounds with their range; "saved" is computed round by round."""
    results = results_of("build_time.json")
    seconds = TABLE_MAKERS["build_time"](results["raw"], results["machine"])[0]
    for row, (precision, ways) in zip(seconds["rows"], results["raw"]["runs"].items(), strict=True):
        two, one = ways["two commands"]["total"], ways["one process"]["total"]
        saved = [a - b for a, b in zip(two, one)]
        assert row[0] == precision and leading_figure(row[1]) == round(statistics.median(two), 1)
        assert cell_range(row[5]) == (round(min(saved), 1), round(max(saved), 1))


def test_the_serving_table_is_the_medians_of_the_rounds_summaries() -> None:
    """Each server's output throughput at each rate is the median of its rounds' summaries, with their range."""
    results = results_of("benchmark_serve_mixed_cpu.json")
    (made,) = TABLE_MAKERS["serve_mixed"](results["raw"], results["machine"])
    for row in made["rows"]:
        runs = [run["summary"] for run in results["raw"]["runs"] if [run["rate"], run["engine"]] == row[:2]]
        rates = [run["output_throughput"] for run in runs]
        assert leading_figure(row[2]) == round(statistics.median(rates), 1)
        assert cell_range(row[2]) == (round(min(rates), 1), round(max(rates), 1))
        assert row[9] == str(sum(run["failed"] for run in runs))


def test_the_quantized_validation_table_is_the_worst_of_each_exports_outputs() -> None:
    """Each export's logits column is the largest relative RMS error over its logits outputs, its states column the
    largest over the other outputs, named."""
    results = results_of("quantized_validation.json")
    (made,) = TABLE_MAKERS["quantized_validation"](results["raw"], results["machine"])
    for row, entry in zip(made["rows"], results["raw"], strict=True):
        logits = [out["relative_rms"] for out in entry["rows"] if out["output"].endswith("/logits")]
        states = [out for out in entry["rows"] if not out["output"].endswith("/logits")]
        assert float(row[3]) == round(max(logits), 4)
        if states:
            largest = max(states, key=lambda out: out["relative_rms"])
            assert row[6] == f"{round(largest['relative_rms'], 4):.4f} ({largest['output'].split('/')[-1]})"


def test_spread_shows_the_median_and_the_range_over_rounds() -> None:
    assert spread([9.0, 12.0, 10.0]) == "10.0 (9.0-12.0)"
    assert spread([2.655, 2.681], 2, "x") == "2.67x (2.65-2.68)"  # the median of two rounds is their mean
    assert spread([5.0]) == "5.0"  # one round: no range to show
    assert spread([None, float("nan")]) == "–"


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


def test_rendering_computes_every_figure_from_the_raw_values(tmp_path, monkeypatch):
    """The renderer's own check (so the comparison above cannot pass on an empty rendering): the figures its table
    maker computes from the raw rounds, the command, the CPU and the versions reach the page, which says its tables
    are computed from the raw results; a page's hand-written tail survives a new rendering."""
    from benchmarks.provenance import machine
    from benchmarks.results.cells import table
    from benchmarks.results.pages import write

    def speed_tables(raw: dict, described: dict) -> list[dict]:
        rows = [[name, spread([tokens / seconds for seconds in rounds])] for name, (tokens, rounds) in raw.items()]
        return [table("speed", ["system", "tok/s"], rows)]

    monkeypatch.setitem(TABLE_MAKERS, "speed", speed_tables)
    results = {
        "title": "A check",
        "command": "python -m benchmarks.check --quick",
        "machine": machine(threads=2),
        "notes": ["A note."],
        "tables_from": "speed",
        "raw": {"a": [100, [8.0, 10.0, 4.0]], "b": [29, [4.0]]},
    }
    (tmp_path / "check.md").write_text("old\n" + RENDERED_END + "\n\n## Reading it\n\nKept.\n")
    page = write(results, tmp_path / "check.json", tmp_path / "check.md")
    for text in (
        "| a | 12.5 (10.0-25.0) |",
        "| b | 7.2 |",
        "`python -m benchmarks.check --quick`",
        "A note.",
        "[check.json](check.json), from which every table figure is computed",
    ):
        assert text in page
    assert results["machine"]["cpu"]["model"] in page and results["machine"]["versions"]["python"] in page
    written = (tmp_path / "check.md").read_text()
    assert written.startswith(page) and written.endswith("## Reading it\n\nKept.\n") and "old" not in written
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        table("bad", ["system", "tok/s"], [["a"]])


def test_a_page_whose_json_keeps_formatted_tables_says_so(tmp_path):
    """Tables handed over as formatted cells are the run's text: the page says they are not computed from raw
    values, ends with TEXT_END, and never claims to be rendered from raw results."""
    from benchmarks.provenance import machine
    from benchmarks.results.cells import table
    from benchmarks.results.pages import write

    results = {
        "title": "Old",
        "command": "python -m benchmarks.old",
        "machine": machine(threads=1),
        "tables": [table("speed", ["system", "tok/s"], [["a", "12.5"]])],
        "raw": {},
    }
    page = write(results, tmp_path / "old.json", tmp_path / "old.md")
    assert "| a | 12.5 |" in page and "not computed from raw values" in page and page.endswith(TEXT_END + "\n")
    assert RENDERED_END not in page and "from which every table figure is computed" not in page
    assert rendered_part(page + "\nA tail.\n") == page


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
    from benchmarks.results.pages import publish_report

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


# A number as the README writes it: "17.7", "1,024", "0.60-0.65x" (both ends), "+5.9%", "-0.3%"; not a part of a
# name ("Llama-3.2-1B", "SmolLM2", "int8", "fp32") nor a size written with its unit letter ("1B", "360M").
QUOTED_NUMBER = re.compile(
    r"(?<![\w.])(?<![A-Za-z0-9]-)(\d+(?:,\d{3})*(?:\.\d+)?)(?:[-–](\d+(?:,\d{3})*(?:\.\d+)?))?(?=[x%×]?(?!\w))"
)
CITED_RESULTS = re.compile(r"\]\((?:[\w./-]*/)?results/([\w.-]+\.(?:md|json|log))\)")  # a page, its JSON, a run's log
# Numbers of README sentences that cite results but are not figures of those results, each with why. Matched as
# the phrase around the number, so that a figure elsewhere in the same sentence is still checked.
NOT_FIGURES = {
    "16 concurrent chats": "the GPU check's workload (tests/test_cuda.py), a setting, not a measurement",
}


def quoted_numbers(text: str) -> list[str]:
    """The numbers a passage quotes (inline code, link targets and NOT_FIGURES phrases left out), as written."""
    text = re.sub(r"`[^`\n]*`|\]\([^)]*\)", "]", text)  # a generated text's stray backtick spoils one line only
    for phrase in NOT_FIGURES:
        text = text.replace(phrase, " ")
    return [number.replace(",", "") for match in QUOTED_NUMBER.finditer(text) for number in match.groups() if number]


def cited_sentences(text: str) -> list[tuple[str, set[str]]]:
    """Each sentence of `text`'s paragraphs and bullets with the results pages it cites: those it links, or else
    those the latest earlier sentence of the same paragraph or bullet linked."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    sentences = []
    for block in re.split(r"\n\s*\n|\n(?=\s*- )", text):
        cited: set[str] = set()
        for sentence in re.split(r"(?<=[.:])\s+(?=[A-Z(\[*`])", block):
            cited = set(CITED_RESULTS.findall(sentence)) or cited
            if cited:
                sentences.append((sentence, cited))
    return sentences


def numbers_missing_from_cited_pages(text: str, results_dir: Path) -> list[str]:
    """Each number of a sentence citing results pages that none of those pages holds."""
    missing = []
    for sentence, cited in cited_sentences(text):
        held = set()
        for name in cited:
            if (results_dir / name).is_file():
                held |= set(quoted_numbers((results_dir / name).read_text()))
        absent = [number for number in quoted_numbers(sentence) if number not in held]
        if absent:
            missing.append(f"{sorted(cited)}: {absent} in {' '.join(sentence.split())[:160]!r}")
    return missing


def test_every_number_the_readme_quotes_is_in_the_results_page_it_cites() -> None:
    """A figure in the README is copied from the page it links, not rounded, derived or remembered: every number of
    a sentence that cites a results page (or follows one that does in the same bullet) is found in that page."""
    readme = (ROOT / "README.md").read_text()
    missing = numbers_missing_from_cited_pages(readme, ROOT / "docs" / "results")
    assert not missing, "README.md quotes numbers its cited pages do not hold:\n" + "\n".join(missing)
    unused = [phrase for phrase in NOT_FIGURES if phrase not in readme]
    assert not unused, f"NOT_FIGURES lists phrases the README no longer has: {unused}"


def test_the_readme_number_check_finds_a_number_the_page_lacks(tmp_path) -> None:
    """The check above on text made to fail it: a rounded figure, a derived ratio, and a range's far end."""
    (tmp_path / "speed.md").write_text("| a | 107.9% | 17.7 (15.7-19.6) |\n")
    cited = "- **Speed** ([page](docs/results/speed.md)): a decodes at 108% of the bound"
    assert numbers_missing_from_cited_pages(cited, tmp_path)
    assert numbers_missing_from_cited_pages(cited + ". It leads by 1.04x.", tmp_path)
    assert numbers_missing_from_cited_pages("Rates ([p](results/speed.md)): 15.7-19.9 tok/s.", tmp_path)
    assert not numbers_missing_from_cited_pages(
        "A Llama-3.2-1B-shaped model ([p](results/speed.md)) at 107.9%: 17.7 (15.7-19.6) tok/s on SmolLM2.", tmp_path
    )


def test_the_scripts_hand_their_raw_rounds_to_the_table_makers(tmp_path) -> None:
    """What the converted scripts write: the engine benchmark's raw values (settings, weight precisions and texts
    beside the rounds), the OpenVINO route's settings (numbers as numbers, builds by name), the exporter's and the
    profiler's results; each renders through its maker into a page that says its figures are computed."""
    import argparse

    from benchmarks import benchmark_engines, export_memory, openvino_route

    engines = results_of("benchmark_engines_cpu.json")["raw"]
    args = argparse.Namespace(**engines["settings"])

    class Tokenizer:
        def decode(self, tokens: list[int], skip_special_tokens: bool) -> str:
            return f"{len(tokens)} tokens|\nend"

    raw = benchmark_engines.engine_raw(
        engines["results"], engines["builds"], engines["bandwidths"], engines["fp32_bytes"], args, Tokenizer()
    )
    assert raw["settings"] == engines["settings"] and raw["precisions"] == engines["precisions"]
    assert set(raw["texts"].values()) == {"32 tokens/ end"}
    assert TABLE_MAKERS["engines"](raw, results_of("benchmark_engines_cpu.json")["machine"])[0]["rows"]

    route = openvino_route.settings(
        argparse.Namespace(build=["fp32=/f"], gqa_build=[], rounds=2, json=tmp_path / "x.json", markdown=None,
                           worker=None, system=None, perplexity_text=Path("text.txt")),
        {"fp32": "/f"}, {},
    )  # fmt: skip
    assert route == {"rounds": 2, "perplexity_text": "text.txt", "builds": {"fp32": "/f"}, "gqa_builds": {}}

    exporter = results_of("exporter_1b.json")
    page = export_memory.publish(exporter["raw"], tmp_path / "exporter_1b.json", tmp_path / "exporter_1b.md")
    assert "from which every table figure is computed" in page
    assert json.loads((tmp_path / "exporter_1b.json").read_text())["tables_from"] == "export_memory"
