"""The cells of a results table, as the table makers compute them from a run's raw values: a table of formatted
cells (`table`), per-round values as their median and range (`spread`), round-by-round ratios (`paired_ratios`)."""

import statistics


def table(heading: str, columns: list[str], rows: list[list]) -> dict:
    """One table of a page, its cells formatted. A table maker returns these, computed from raw values at render
    time; kept in a JSON file they are text (see `TEXT_END`)."""
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"table {heading!r}: every row needs {len(columns)} cells ({columns})")
    return {"heading": heading, "columns": columns, "rows": [[str(cell) for cell in row] for row in rows]}


def spread(values: list[float], digits: int = 1, suffix: str = "") -> str:
    """Per-round `values` as the page shows them: the median, and over two or more rounds the range beside it
    ("17.7 (16.3-19.6)"); a difference inside that range is noise, not a lead. "–" when no round measured it."""
    values = [value for value in values if value is not None and value == value]
    if not values:
        return "–"
    shown = f"{statistics.median(values):.{digits}f}{suffix}"
    if len(values) > 1:
        shown += f" ({min(values):.{digits}f}-{max(values):.{digits}f})"
    return shown


def paired_ratios(numerators: list[float | None], denominators: list[float | None]) -> list[float]:
    """Round-by-round ratios (runs of the same round side by side), leaving out rounds where either is missing."""
    return [top / bottom for top, bottom in zip(numerators, denominators) if top and bottom]
