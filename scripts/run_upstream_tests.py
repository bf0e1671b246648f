"""Run transformers' own common model tests (`ModelTesterMixin`, `GenerationTesterMixin`, `ConfigTester`) against
every vaswani family and position type, and write the pass/fail/skip table.

The tests are transformers', unmodified: they live in the `tests/` folder of transformers' repository (the PyPI
sdist ships `tests/test_modeling_common.py` and `tests/test_configuration_common.py`, but not
`tests/generation/test_utils.py`, `tests/exporters/` or `utils/test_module/`, which the first one imports). Give a
checkout of the repository, ideally at the tag of the installed version:

    git clone --depth 1 --branch v5.24.0 https://github.com/huggingface/transformers /tmp/transformers
    pip install parameterized
    python scripts/run_upstream_tests.py --transformers /tmp/transformers --output docs/results/upstream_common_tests.md

The runner copies that `tests/` folder (and `utils/test_module/`) into a scratch folder, adds
`scripts/upstream_tests/test_modeling_vaswani.py` as `tests/models/vaswani/`, runs pytest there with a JUnit report,
and writes a Markdown table: per test class, the passed / failed / skipped counts, every failure with its message
and every skip reason with its count. The exit status is 1 when any test failed.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.metadata as metadata
import platform
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_MODULE = HERE / "upstream_tests" / "test_modeling_vaswani.py"
REQUIRED = ("tests/test_modeling_common.py", "tests/test_configuration_common.py", "tests/generation/test_utils.py")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers", type=Path, required=True, help="a checkout of transformers' repository")
    parser.add_argument("--output", type=Path, default=Path("docs/results/upstream_common_tests.md"))
    parser.add_argument("--json", type=Path, help="raw results and tables as JSON; the page is rendered from it")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for the whole run")
    parser.add_argument("--provenance", default="", help="where the tests came from, written under the title")
    return parser.parse_args(argv)


def assemble(source: Path, scratch: Path) -> Path:
    """Copy transformers' tests and our module into `scratch`; return the test file's path."""
    missing = [name for name in REQUIRED if not (source / name).is_file()]
    if missing:
        raise SystemExit(
            f"{source} lacks {', '.join(missing)}: pass a checkout of transformers' repository "
            f"(git clone https://github.com/huggingface/transformers), not the installed package."
        )
    ignore = shutil.ignore_patterns("models", "fixtures", "__pycache__")  # 400+ model folders we do not run
    shutil.copytree(source / "tests", scratch / "tests", ignore=ignore)
    if (source / "utils" / "test_module").is_dir():
        shutil.copytree(source / "utils" / "test_module", scratch / "utils" / "test_module")
    target = scratch / "tests" / "models" / "vaswani"
    target.mkdir(parents=True)
    for folder in (scratch / "tests" / "models", target):
        (folder / "__init__.py").touch()
    shutil.copy(TEST_MODULE, target / TEST_MODULE.name)
    return target / TEST_MODULE.name


def run_pytest(scratch: Path, test_file: Path, keyword: str | None, timeout: int) -> tuple[Path, int]:
    """pytest on the assembled module: its JUnit report and its exit status (the report is read even when tests
    failed, status 1; any other non-zero status means pytest itself did not run the tests through)."""
    report = scratch / "report.xml"
    command = [sys.executable, "-m", "pytest", str(test_file.relative_to(scratch)), "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", "-o", "junit_family=xunit2", "-rN", "--tb=line"]
    if keyword:
        command += ["-k", keyword]
    print("running:", " ".join(command), flush=True)
    return report, subprocess.run(command, cwd=scratch, timeout=timeout).returncode


def summarize(report: Path) -> tuple[dict, dict, list]:
    """Per class: Counter of outcomes; skip reasons with counts; failures as (class, test, message)."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    skip_reasons: collections.Counter = collections.Counter()
    failures = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        owner = case.get("classname", "").rsplit(".", 1)[-1]
        test = case.get("name", "")
        outcome = "passed"
        for child in case:
            if child.tag == "skipped":
                outcome = "skipped"
                reason = (child.get("message") or "").replace("\n", " ").strip()
                skip_reasons[reason[:160]] += 1
            elif child.tag in ("failure", "error"):
                outcome = "failed"
                failures.append((owner, test, (child.get("message") or "").replace("\n", " ")[:240]))
        counts[owner][outcome] += 1
    return counts, skip_reasons, failures


def markdown(counts: dict, skip_reasons: collections.Counter, failures: list, source: Path, provenance: str) -> str:
    total = sum(counts.values(), collections.Counter())
    lines = [
        "# transformers' common model tests on the vaswani families",
        "",
        f"Run by `scripts/run_upstream_tests.py` on {datetime.date.today().isoformat()}: transformers "
        f"{metadata.version('transformers')}, torch {metadata.version('torch')}, Python {platform.python_version()}, "
        f"{platform.machine()} CPU, no GPU. Tests from `{source}`.",
        *(["", provenance] if provenance else []),
        "",
        f"**{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped.**",
        "",
        "| test class | passed | failed | skipped |",
        "|---|---|---|---|",
    ]
    for owner in sorted(counts):
        row = counts[owner]
        lines.append(f"| `{owner}` | {row['passed']} | {row['failed']} | {row['skipped']} |")
    lines += ["", "## Failures", ""]
    lines += [f"- `{owner}::{test}`: {message}" for owner, test, message in failures] or ["None."]
    lines += ["", "## Skips, by transformers' own reason", "", "| reason | tests |", "|---|---|"]
    for reason, count in skip_reasons.most_common():
        lines.append(f"| {reason.replace('|', '/') or '(no reason given)'} | {count} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vaswani-upstream-") as scratch_name:
        scratch = Path(scratch_name)
        test_file = assemble(args.transformers.resolve(), scratch)
        report, status = run_pytest(scratch, test_file, args.keyword, args.timeout)
        if status not in (0, 1) or not report.is_file():
            raise SystemExit(f"pytest exited with status {status} and did not run the tests (see the output above)")
        counts, skip_reasons, failures = summarize(report)
    ran = sum(row["passed"] + row["failed"] for row in counts.values())
    if not ran:
        raise SystemExit("no test ran (all were deselected or skipped): there is no result to write")
    text = markdown(counts, skip_reasons, failures, args.transformers, args.provenance)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    if args.json:  # the page: rendered from the JSON (benchmarks/results/)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a script run as a file: the benchmarks package
        from benchmarks.results.pages import publish_report

        raw = {"counts": counts, "skip_reasons": dict(skip_reasons), "failures": failures}
        publish_report(text, args.json, args.output, raw, None)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
