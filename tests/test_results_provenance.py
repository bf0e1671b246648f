"""Every published results page says which command made it: each docs/results/*.md names a script of this
repository that exists, and every JSON file it names beside it parses. (Pages that predate the rule and kept no JSON
say so; new pages write their raw results as JSON next to the table.)"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_a_results_page_names_an_existing_script_and_json_that_parses(page: Path) -> None:
    text = page.read_text()
    scripts = set(re.findall(r"(?:scripts|benchmarks|examples)/[\w/]+\.(?:py|sh)", text))
    assert scripts, f"{page.name} names no script that produced it"
    missing = [script for script in scripts if not (ROOT / script).is_file()]
    assert not missing, f"{page.name} names scripts that do not exist: {missing}"
    for name in set(re.findall(r"[\w./-]+\.json", text)):
        path = page.parent / Path(name).name
        if path.is_file():
            json.loads(path.read_text())


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
