"""The at-scale verdict's tables (text and Markdown) and its plot: time to target against
N per method, log axes (simulate/verdict.py)."""

from __future__ import annotations

from pathlib import Path

from dtlab.lab.simulate.verdict_time import Cell


def number(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    if x >= 1e4 or x < 1e-2:
        return f"{x:.2e}{unit}"
    return f"{x:.3g}{unit}"


def mark(c: Cell) -> str:
    return "" if c.steps.source.startswith("simulated") else "~"


def steps_table(points: dict[str, dict[int, int | None]], batch: int) -> list[str]:
    """Per-worker steps to target as simulated (rows N, a column per method)."""
    labels = list(points)
    sizes = sorted({n for p in points.values() for n in p})
    w = max(10, *(len(x) + 2 for x in labels))
    lines = [f"{'N':>6}" + "".join(f"{x:>{w}}" for x in labels)]
    for n in sizes:
        row = [points[x].get(n, "") for x in labels]
        lines.append(f"{n:>6}" + "".join(
            f"{'-' if v is None else v:>{w}}" for v in row))
    lines.append(f"(per-worker steps of {batch} samples; -: not within the budget)")
    return lines


def time_table(table: dict[str, list[Cell]]) -> list[str]:
    """Seconds to target (rows N, a column per method); ~: steps fitted beyond the
    largest N simulated; the fastest method of each row named at its end."""
    labels = list(table)
    w = max(11, *(len(x) + 2 for x in labels))
    lines = [f"{'N':>6}" + "".join(f"{x:>{w}}" for x in labels) + "  fastest"]
    for i, n in enumerate(c.n for c in table[labels[0]]):
        row = [table[x][i] for x in labels]
        timed = [(c.time_s, x) for c, x in zip(row, labels, strict=True)
                 if c.time_s is not None]
        best = min(timed)[1] if timed else "-"
        lines.append(f"{n:>6}" + "".join(
            f"{mark(c) + number(c.time_s):>{w}}" for c in row) + f"  {best}")
    if any(mark(c) for row in table.values() for c in row):
        lines.append("(~: extrapolated, its steps fitted beyond the simulated N; -: the "
                     "target not reached)")
    return lines


def markdown(lines: list[str]) -> list[str]:
    """A fixed-width table as a Markdown code block."""
    return ["```", *lines, "```"]


def plot(table: dict[str, list[Cell]], title: str, path: Path) -> Path | None:
    """Time to target against N per method, both axes logarithmic; the fitted part of a
    line dashed. None without matplotlib (the `plot` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not any(c.time_s is not None for row in table.values() for c in row):
        return None  # nothing reached the target: no plot
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for label, row in table.items():
        xs = [c.n for c in row if c.time_s is not None]
        ys = [c.time_s for c in row if c.time_s is not None]
        if not xs:
            continue
        fitted = [mark(c) == "~" for c in row if c.time_s is not None]
        (line,) = ax.plot([x for x, f in zip(xs, fitted, strict=True) if not f] or xs[:1],
                          [y for y, f in zip(ys, fitted, strict=True) if not f] or ys[:1],
                          marker="o", label=label)
        tail = [i for i, f in enumerate(fitted) if f]
        if tail:
            start = max(0, tail[0] - 1)
            ax.plot(xs[start:], ys[start:], linestyle="--", color=line.get_color())
    missed = [label for label, row in table.items() if all(c.time_s is None for c in row)]
    notes = ["target not reached: " + ", ".join(missed)] if missed else []
    fitted_from = [c.n for row in table.values() for c in row if mark(c) == "~"]
    if fitted_from:
        notes.append(f"dashed: extrapolated (steps fitted a + c/N) from N = "
                     f"{min(fitted_from)}, not simulated")
    if notes:
        ax.text(0.01, 0.01, "\n".join(notes), fontsize=8, transform=ax.transAxes)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("predicted time to held-out target (s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
