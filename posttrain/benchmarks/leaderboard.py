"""The leaderboard: every benchmarked model (base models, checkpoints) × every benchmark, in one table.

Rows are models in lineage order: base models first, then checkpoints by their distance from the base
(SFT, then the DPO trained from it, then RL…), by recipe and step within one generation, each naming its
parent (the checkpoint it was trained from, or its base model). A cell is ``value ± s.e. (n)``; where the
parent was scored on the same benchmark, ``Δ parent`` is the *paired* difference over the samples
both scored (``posttrain.eval.stats.paired_difference``), flagged ``*`` beyond two standard errors.
The same rows go to parquet (long form, one row per model × benchmark), markdown and a PNG bar chart
with ±1 s.e. error bars.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from posttrain.eval.stats import paired_difference


@dataclass(frozen=True)
class ModelEntry:
    """A benchmarked model: a base model or a checkpoint, with what it came from."""

    key: str  # "base:<model>" or the checkpoint's partition key
    label: str  # what the table shows
    recipe: str  # "base" for base models
    step: int
    parent: str | None  # the parent's key (a checkpoint or "base:<model>"); None for a base model


@dataclass(frozen=True)
class Cell:
    benchmark: str
    metric: str
    value: float
    stderr: float
    n: int
    scores: Mapping[str, float]  # sample id -> score (mean over epochs), for paired comparisons
    log: str = ""


@dataclass(frozen=True)
class Row:
    model: str
    recipe: str
    step: int
    parent: str
    benchmark: str
    metric: str
    value: float
    stderr: float
    n: int
    delta_parent: float
    delta_parent_stderr: float
    delta_parent_n: int
    significant: bool
    log: str


def build_rows(models: Sequence[ModelEntry], cells: Mapping[tuple[str, str], Cell]) -> list[Row]:
    """Long-form rows in table order (base models, then recipes by step), with paired Δ vs parent."""
    rows = []
    for model in order_models(models):
        for (key, benchmark), cell in sorted(cells.items(), key=lambda item: item[0][1]):
            if key != model.key:
                continue
            parent_cell = cells.get((model.parent, benchmark)) if model.parent else None
            delta = _paired(cell, parent_cell)
            rows.append(
                Row(
                    model=model.label, recipe=model.recipe, step=model.step, parent=model.parent or "",
                    benchmark=benchmark, metric=cell.metric, value=cell.value, stderr=cell.stderr, n=cell.n,
                    delta_parent=delta.delta if delta else math.nan,
                    delta_parent_stderr=delta.stderr if delta else math.nan,
                    delta_parent_n=delta.n if delta else 0,
                    significant=bool(delta and delta.significant),
                    log=cell.log,
                )
            )
    return rows


def order_models(models: Sequence[ModelEntry]) -> list[ModelEntry]:
    by_key = {model.key: model for model in models}

    def generation(model: ModelEntry) -> int:
        hops, seen, parent = 0, {model.key}, model.parent
        while parent is not None and parent not in seen:
            hops, seen = hops + 1, seen | {parent}
            parent = by_key[parent].parent if parent in by_key else None
        return hops

    return sorted(models, key=lambda m: (generation(m), m.recipe, m.step, m.key))


def table(rows: Sequence[Row]) -> pa.Table:
    return pa.Table.from_pylist([asdict(row) for row in rows])


def markdown(rows: Sequence[Row]) -> str:
    """Models down, benchmarks across: ``value ± s.e. (n)`` and, under a parent, ``Δ`` with its s.e."""
    benchmarks = sorted({row.benchmark for row in rows})
    models: dict[str, dict[str, Row]] = {}
    parents: dict[str, str] = {}
    for row in rows:
        models.setdefault(row.model, {})[row.benchmark] = row
        parents[row.model] = row.parent
    lines = ["| model | parent | " + " | ".join(benchmarks) + " |", "|---|---|" + "---|" * len(benchmarks)]
    for model, by_benchmark in models.items():
        cells = [_cell_text(by_benchmark.get(benchmark)) for benchmark in benchmarks]
        lines.append(f"| {model} | {parents[model] or '—'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text(rows: Sequence[Row]) -> str:
    """The rows as a terminal table (what `make demo` prints): a line per model naming its parent, then one
    line per benchmark with value ± s.e., n and the paired Δ vs the parent."""
    width = max([len("benchmark"), *(len(row.benchmark) for row in rows)]) + 2
    lines = [f"{'model / benchmark':<{width}}  {'value ± s.e.':>14}  {'n':>5}  Δ vs parent ± s.e. (paired n)"]
    model = None
    for row in rows:
        if row.model != model:
            model = row.model
            lines.append(row.model + (f"  (parent {row.parent})" if row.parent else ""))
        stderr = "?" if math.isnan(row.stderr) else f"{row.stderr:.3f}"
        delta = ""
        if row.delta_parent_n:
            delta_se = "?" if math.isnan(row.delta_parent_stderr) else f"{row.delta_parent_stderr:.3f}"
            delta = f"{row.delta_parent:+.3f} ± {delta_se} ({row.delta_parent_n}){' *' if row.significant else ''}"
        lines.append(f"  {row.benchmark:<{width - 2}}  {row.value:>6.3f} ± {stderr:>5}  {row.n:>5}  {delta}".rstrip())
    return "\n".join(lines)


def rows_from_table(table: pa.Table) -> list[Row]:
    """The rows :func:`table` wrote, back (e.g. from the leaderboard's parquet file)."""
    return [Row(**record) for record in table.to_pylist()]


def chart(rows: Sequence[Row], path: Path) -> Path:
    """A grouped bar chart (benchmark groups, one bar per model) with ±1 s.e. error bars, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks = sorted({row.benchmark for row in rows})
    models = list(dict.fromkeys(row.model for row in rows))
    width = 0.8 / max(len(models), 1)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.6 * len(benchmarks) * max(1, len(models)) / 2), 4.0))
    for index, model in enumerate(models):
        values, errors, positions = [], [], []
        for position, benchmark in enumerate(benchmarks):
            row = next((r for r in rows if r.model == model and r.benchmark == benchmark), None)
            if row is None:
                continue
            positions.append(position + (index - (len(models) - 1) / 2) * width)
            values.append(row.value)
            errors.append(0.0 if math.isnan(row.stderr) else row.stderr)
        axes.bar(positions, values, width, yerr=errors, capsize=3, label=model)
    axes.set_xticks(range(len(benchmarks)), benchmarks)
    axes.set_ylabel("score (± 1 s.e.)")
    axes.set_ylim(0, 1.05)
    axes.legend(fontsize=7, loc="upper right")
    axes.set_title("Benchmarks by checkpoint")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, format="png")
    plt.close(figure)
    return path


def _paired(cell: Cell, parent: Cell | None):
    if parent is None or not set(cell.scores) & set(parent.scores):
        return None
    return paired_difference(cell.scores, parent.scores)


def _cell_text(row: Row | None) -> str:
    if row is None:
        return "—"
    stderr = "?" if math.isnan(row.stderr) else f"{row.stderr:.3f}"
    text = f"{row.value:.3f} ± {stderr} (n={row.n})"
    if row.delta_parent_n:
        delta_se = "?" if math.isnan(row.delta_parent_stderr) else f"{row.delta_parent_stderr:.3f}"
        text += f"<br>Δ {row.delta_parent:+.3f} ± {delta_se}{' *' if row.significant else ''}"
    return text
