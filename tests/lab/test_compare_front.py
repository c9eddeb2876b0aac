"""The bytes-versus-quality front (compare/front.py): the methods no other beats on both
final held-out loss and bytes per step, and its plot."""

from __future__ import annotations

from dtlab.lab.compare.front import Point, front, lines, plot, points_of


def test_the_front_keeps_exactly_the_undominated_methods():
    pts = [Point("sync-ring", 1.22, 2.5e6), Point("sync-diloco50", 1.24, 5e4),
           Point("sync-topk1-noef", 2.10, 5e4), Point("sync-auto", 1.22, 2.5e6),
           Point("async-asp", 1.30, 3e6)]
    on = front(pts)
    assert [p.name for p in on] == ["sync-diloco50", "sync-ring", "sync-auto"]  # equal ones stay
    assert "sync-diloco50 (1.2400 at 0.05 MB/step)" in " ".join(lines(pts))


def test_points_come_from_a_study_summary_and_plot(tmp_path):
    methods = [{"name": "a", "final_eval_loss": {"mean": 1.0}, "bytes_per_step": {"mean": 10}},
               {"name": "b", "final_eval_loss": {"mean": 0.9}, "bytes_per_step": {"mean": 99}},
               {"name": "c", "final_eval_loss": None, "bytes_per_step": {"mean": 5}},
               {"name": "d", "final_eval_loss": {"mean": 0.9}, "bytes_per_step": {"mean": 0}}]
    pts = points_of(methods)
    assert [p.name for p in pts] == ["a", "b"]
    assert plot(pts, tmp_path, "t") and (tmp_path / "front.png").stat().st_size > 1000
