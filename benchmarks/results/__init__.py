"""Published results: each `docs/results/NAME.md` is rendered from `NAME.json` beside it, which its script wrote.

A script builds one results dictionary: what it measured (`raw`: per-round seconds, tokens/s, bytes, in its own
form), the name of the table maker that computes the page's tables from those raw values (`tables_from`, one of
`pages.TABLE_MAKERS`), the command that made it and the machine it ran on (`benchmarks.provenance`). `pages.write`
saves the JSON, reads it back and renders the page from what it read: every figure in a table is computed from the
raw values when the page is rendered, so a table never says more than the measurements do. Where per-round values
exist a figure is their median with the range over rounds beside it (`cells.spread`). The page may go on after the
rendered part (explanations); it holds no table there.

- `cells.py`: the formatted cells every maker uses (`table`, `spread`, `paired_ratios`);
- `engines.py`, `speed.py`, `quality.py`, `structured.py`: the table makers, by kind of page; a maker receives the raw
  values and never imports the script that measured them;
- `pages.py`: `TABLE_MAKERS`, `render`, `write`, and `publish_report` for the older scripts that hand over tables of
  formatted cells (`tables`, from `from_markdown`). Such a page says so where it names its command, and ends with
  `TEXT_END` instead of `RENDERED_END`: its tables are the run's text, kept in the JSON, not figures computed from raw
  values.

Render a page again from its JSON (the test suite does, and compares):

    python -m benchmarks.results docs/results/x.json --output docs/results/x.md

Standard library only, like `benchmarks.provenance`: scripts that import it also run as workers in other engines'
virtual environments.
"""
