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
