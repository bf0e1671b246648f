"""The structured-outputs results page (docs/results/structured_outputs_cpu.md and its JSON), which two scripts
write a part of each: `libraries` (benchmarks/benchmark_grammar_libraries.py) and `serving`
(benchmarks/benchmark_serve_mixed.py --structured-share). `publish_part` keeps the other script's part of the JSON,
replaces its own, and renders the page (benchmarks/results/structured.py computes the tables from both).

    from benchmarks.structured_outputs_page import publish_part
    part = {"command": command_line(), "machine": machine(threads=1), "settings": ..., "results": ...}
    publish_part("libraries", part, Path("docs/results/structured_outputs_cpu.json"), Path("...cpu.md"))

Standard library only, like benchmarks.provenance.
"""

import json
from pathlib import Path

from benchmarks.results.pages import write

PARTS = ("libraries", "serving")
TITLE = "Structured outputs on CPU: xgrammar against llguidance, and `vaswani serve` with a JSON-schema mix"


def publish_part(name: str, part: dict, json_path: Path, markdown_path: Path | None) -> str:
    """Write `part` (with its own "command" and "machine") as the page's part `name`, keeping the other part found in
    `json_path`; the page's command is both commands, its machine the later part's (with both parts' package
    versions). Returns the rendered page."""
    if name not in PARTS:
        raise ValueError(f"the structured-outputs page has the parts {PARTS}, not {name!r}.")
    json_path = Path(json_path)
    raw: dict = {}
    if json_path.is_file():
        stored = json.loads(json_path.read_text())
        if stored.get("tables_from") == "structured_outputs":
            raw = stored["raw"]
    raw[name] = part
    present = [raw[key] for key in PARTS if key in raw]
    machine = {**part["machine"], "threads": None}  # each part states its own threads
    machine["versions"] = {key: value for each in present for key, value in each["machine"]["versions"].items()}
    notes = [
        f"{key.capitalize()} part: `{raw[key]['command']}`, {raw[key]['machine']['date']}, "
        f"{raw[key]['machine']['threads']} thread(s), 1-minute load average "
        f"{raw[key].get('load_before', float('nan')):.2f} before it started"
        + (" (machine shared with other jobs)." if raw[key]["machine"]["shared"] else " (machine otherwise idle).")
        for key in PARTS
        if key in raw
    ]
    results = {
        "title": TITLE,
        "command": "; ".join(each["command"] for each in present),
        "commands": [each["command"] for each in present],
        "machine": machine,
        "notes": notes,
        "tables_from": "structured_outputs",
        "raw": raw,
    }
    return write(results, json_path, markdown_path)
