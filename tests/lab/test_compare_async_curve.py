"""An asynchronous run's held-out curve when its workers do not move in step
(compare/analysis.py `evaluations_in_time`): each evaluation a point of the job's one model
in time, so a fast worker's early last evaluation is not averaged into the final loss."""

import pytest

from dtlab.lab.compare import analysis


def worker(step_s: float, evals: dict[int, float], steps: int = 8) -> list[dict]:
    """A worker's step records: `step_s` seconds a step, held-out losses at `evals`."""
    out = []
    for k in range(1, steps + 1):
        record = {"step": k, "loss": 2.0, "elapsed_s": k * step_s, "step_s": step_s,
                  "compute_s": step_s, "pull_s": 0.0, "push_s": 0.0, "push_bytes": 8,
                  "pull_bytes": 8, "staleness": [0], "version": [k]}
        if k in evals:
            record["eval_loss"] = evals[k]
        out.append(record)
    return out


def test_a_slow_workers_last_evaluation_is_the_final_model():
    fast = worker(1.0, {4: 1.9, 8: 1.7})  # done at 8 s
    slow = worker(4.0, {4: 1.2, 8: 1.0})  # done at 32 s, alone from 8 s on
    c, stats = analysis.measure("async", [fast, slow], 4, 2, "asp", None, 1.5)
    # job progress at each evaluation: the mean of the steps each worker had finished
    assert c.eval_steps.tolist() == [3, 5, 6, 8]  # (4 + 2) / 2, (8 + 2) / 2, (8 + 4) / 2, 8
    assert c.eval_loss.tolist() == [1.9, 1.7, 1.2, 1.0]
    assert c.eval_time_s.tolist() == [4.0, 8.0, 16.0, 32.0]
    assert stats["final_eval_loss"] == 1.0  # not (1.7 + 1.0) / 2: the model at the end
    assert stats["eval_steps_to_target"] == 6
    assert stats["eval_time_to_target_s"] == 16.0
    assert stats["held_out"]["time_s"] == [4.0, 8.0, 16.0, 32.0]


def test_workers_in_step_average_their_evaluations_of_one_step():
    a, b = worker(1.0, {4: 1.6, 8: 1.2}), worker(1.0, {4: 1.4, 8: 1.0})
    c, stats = analysis.measure("async", [a, b], 4, 2, "asp", None, 1.3)
    assert c.eval_steps.tolist() == [4, 8]
    assert c.eval_loss.tolist() == pytest.approx([1.5, 1.1])
    assert stats["final_eval_loss"] == pytest.approx(1.1)
    # BSP and sync keep the mean over processes at each step and HE x steps
    c, stats = analysis.measure("async", [a, b], 4, 2, "bsp", None, 1.3)
    assert c.eval_loss.tolist() == pytest.approx([1.5, 1.1])
    assert stats["eval_time_to_target_s"] is None and stats["eval_steps_to_target"] == 8
