"""The bytes-versus-quality front: which methods no other beats on both final held-out
loss and bytes on the wire per step.

A method is on the front (Pareto-optimal) when no other method has a final held-out
loss and a byte count per step both at most its own, one of them strictly lower. The
report lists the front and plots every method's final held-out loss against its MB per
step on a log axis, the front joined by a line (front.png).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    name: str
    loss: float  # mean final held-out loss over the method's seeds
    bytes_per_step: float  # every process's bytes on the wire a step, mean over seeds


def front(points: list[Point]) -> list[Point]:
    """The points no other dominates, by bytes per step (ties: by loss)."""
    def dominated(p: Point) -> bool:
        return any(q.loss <= p.loss and q.bytes_per_step <= p.bytes_per_step
                   and (q.loss < p.loss or q.bytes_per_step < p.bytes_per_step)
                   for q in points)
    return sorted((p for p in points if not dominated(p)),
                  key=lambda p: (p.bytes_per_step, p.loss))


def points_of(methods: list[dict]) -> list[Point]:
    """A study summary's methods that recorded both figures (a run moving no bytes, one
    process, has no place on a log axis)."""
    out = []
    for m in methods:
        loss, moved = m.get("final_eval_loss"), m.get("bytes_per_step")
        if loss is None or moved is None or not moved["mean"] > 0:
            continue
        out.append(Point(m["name"], loss["mean"], moved["mean"]))
    return out


def lines(points: list[Point]) -> list[str]:
    """The report's paragraph on the front."""
    if len(points) < 2:
        return []
    on = front(points)
    words = ", ".join(f"{p.name} ({p.loss:.4f} at {p.bytes_per_step / 1e6:.3g} MB/step)"
                      for p in on)
    return ["## Bytes against quality", "",
            f"On the front (no other method has both a lower final held-out loss and fewer "
            f"bytes a step): {words}. Plot: front.png.", ""]


def plot(points: list[Point], out: Path, title: str) -> bool:
    """front.png; False where matplotlib is missing or there is nothing to plot."""
    if len(points) < 2:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    on = front(points)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in points:
        mark = "o" if p in on else "x"
        ax.scatter(p.bytes_per_step / 1e6, p.loss, marker=mark)
        ax.annotate(p.name, (p.bytes_per_step / 1e6, p.loss), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.plot([p.bytes_per_step / 1e6 for p in on], [p.loss for p in on], "k--", linewidth=0.8,
            label="front")
    ax.set_xscale("log")
    ax.set_xlabel("MB on the wire per step, every process (log)")
    ax.set_ylabel("final held-out loss (mean over seeds)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "front.png", dpi=110)
    plt.close(fig)
    return True
