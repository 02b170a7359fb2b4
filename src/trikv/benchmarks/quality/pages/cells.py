"""Reading a run's result tables and writing their figures: the helpers every section of the results page shares.

A run's task tables map method -> budget -> cell (full attention's one cell sits under "full"): `table_cell` picks
one, `budget_grid` lays a figure out as a method x budget grid, and `format_value`, `format_interval`,
`format_difference` and `render` write figures and tables as the page prints them.
"""

from __future__ import annotations

import math


def protected_mask(record: dict, budget):
    """([texts] bool tensor: the prompts the cache protected at `budget`, [texts] long tensor: the prompt lengths)
    of a fidelity run (one rule for every method), or None where it records no prompt lengths."""
    import torch

    from ....selection import prompt_fits

    prompts = ((record["results"].get("fidelity") or {}).get("meta") or {}).get("prompt_lengths")
    config = record.get("config", {})
    if not prompts or not str(budget).isdigit():
        return None
    lengths = torch.tensor(prompts)
    fits = prompt_fits(lengths, int(budget), config.get("min_decode_room", 32))
    return fits & bool(config.get("protect_prompt", True)), lengths


def format_value(value, digits: int = 3) -> str:
    """A figure as the tables print it: – where missing or NaN, fewer decimals from 100 up."""
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.{digits}f}"
    return str(value)


def render(headers: list[str], rows: list[list], markdown: bool) -> str:
    """A table as Markdown, or as aligned plain text for the terminal."""
    cells = [[str(h) for h in headers]] + [[format_value(c) if not isinstance(c, str) else c for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_budgets(record: dict) -> list[str]:
    """The run's budgets, as its tables key them."""
    return [str(b) for b in record["config"]["budgets"]]


def run_methods(record: dict) -> list[str]:
    """The run's methods, in the order it ran them."""
    return list(record["config"]["methods"])


def table_cell(table: dict, method: str, budget: str):
    """A method's cell at a budget (full attention's one cell at any budget), or None."""
    values = table.get(method, {})
    return values.get("full") if method == "full" else values.get(budget)


def budget_grid(record, table, getter, methods=None) -> tuple[list[str], list[list]]:
    """(headers, rows) of `getter(cell)` with a row per method and a column per budget."""
    budgets = run_budgets(record)
    rows = []
    for method in methods or run_methods(record):
        row = [method]
        for budget in budgets:
            cell = table_cell(table, method, budget)
            row.append(getter(cell) if cell is not None else None)
        rows.append(row)
    return ["method \\ budget"] + budgets, rows


# the recall row of the selection that keeps, at each of triattention's rounds, the keys the later queries attend
ORACLE_LABEL = "future-attention"
ORACLE_NOTE = (f"`{ORACLE_LABEL}`: at each of triattention's rounds, keeps the B held keys that all later queries attend "
               "most (in-sample, triattention's schedule; not an upper bound at every horizon)")


def format_interval(value, interval, digits: int) -> str:
    """`value [low, high]`, or the value alone where no interval was computed."""
    if value is None:
        return "–"
    if not interval or any(v is None or (isinstance(v, float) and math.isnan(v)) for v in interval):
        return format_value(value, digits)
    return f"{format_value(value, digits)} [{format_value(interval[0], digits)}, {format_value(interval[1], digits)}]"


def format_difference(comparison: dict | None, digits: int, scale: float = 1.0) -> str:
    """`+d [+low, +high]` of a paired difference, or – ."""
    if not comparison:
        return "–"
    low, high = comparison["ci"]
    if math.isnan(low):
        return f"{scale * comparison['difference']:+.{digits}f}"
    return f"{scale * comparison['difference']:+.{digits}f} [{scale * low:+.{digits}f}, {scale * high:+.{digits}f}]"


def recall_horizon_labels(record: dict) -> list[str]:
    """The run's horizon labels that its recall table holds figures for, shortest first."""
    from ..fidelity import horizon_labels

    labels = horizon_labels(tuple(record["config"]["horizons"]))
    table = record["results"]["recall"]["methods"]
    present = set()
    for values in table.values():
        for cell in values.values():
            if cell:
                present |= set(cell.get("by_horizon", {}))
    return [label for label in labels if label in present]
