"""The sweep's power-law fits (compare/sweep.py) on data whose exponent is known: the
fit must find it, so a broken fit fails here rather than passing as "no fit"."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtlab.lab.compare import sweep


def test_the_fit_recovers_a_known_exponent_and_its_error():
    x = np.geomspace(1e3, 1e6, 6)
    fit = sweep.power_law(x, 3.0 * x ** -0.34)
    assert fit["exponent"] == pytest.approx(0.34, rel=1e-9)
    assert fit["coefficient"] == pytest.approx(3.0, rel=1e-9)
    assert fit["exponent_se"] == pytest.approx(0.0, abs=1e-9) and fit["points"] == 6
    noisy = sweep.power_law(x, 3.0 * x ** -0.34 * np.exp([0.05, -0.05] * 3))
    assert noisy["exponent"] == pytest.approx(0.34, abs=0.03) and noisy["exponent_se"] > 0


def test_analyse_fits_loss_against_parameters_from_metrics_files(tmp_path):
    """Three widths whose final losses sit 2 P^-0.5 above the floor: the loss-vs-parameters
    fit gives 0.5 (every loss above the floor, so the fit exists: it is asserted, not
    skipped)."""
    floor, sizes, metrics = 1.0, [], []
    for width, params in ((8, 100), (16, 400), (32, 1600)):
        gap = 2.0 * params ** -0.5
        path = tmp_path / f"w{width}.jsonl"
        lines = [{"type": "header"}] + [{"step": k + 1, "loss": floor + gap} for k in range(20)]
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        sizes.append({"width": width, "params": params, "steps": 20, "flops_per_step": params})
        metrics.append(path)
    out = sweep.analyse(sizes, metrics, floor)
    fit = out["loss_vs_params"]
    assert fit is not None
    assert fit["exponent"] == pytest.approx(0.5, rel=1e-9)
    assert fit["coefficient"] == pytest.approx(2.0, rel=1e-9)
    assert out["loss_vs_compute"] is not None
