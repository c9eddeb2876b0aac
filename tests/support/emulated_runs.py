"""One validation across 2 emulated hosts at 1 and 0.1 Gbit/s, shared by two tests (the
`emulated_validation` fixture of tests/conftest.py, run once a session).

dtlab-simulate --validate --hosts 2 --link-gbit 1,0.1 runs dtlab-compare once per rate
(sync-ring and async-bsp, each comparison building its own emulated cluster and removing
it at its end, after a failure too), then predicts each run with its link. The
predictions are checked by tests/lab/test_simulate.py; the comparisons themselves (the
links shaped, the bytes across them, nothing left behind) by tests/lab/test_compare.py.
Each check reads the same runs it read when it launched its own: two tests, one pair of
comparisons (about 15 s of a 2-core machine) instead of two.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support.synthetic_bench import synthetic_bench

ROOT = Path(__file__).resolve().parents[2]
# 1.07 M parameters: a gradient of 4.3 MB, 0.36 s on a 0.1 Gbit/s link, well above the
# step's own compute, so the link sets the pace
MODEL = ["--model", "mlp", "--d-in", "16", "--d-hidden", "1024", "--n-layers", "2",
         "--n-classes", "4", "--batch-size", "8"]
GRAD_BYTES = 4 * (16 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 4 + 4)  # float32
STEPS = 10
RATES = (1.0, 0.1)  # Gbit/s
RUNS = ("sync-ring", "async-bsp")


def simulate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtlab.lab.simulate", *args], cwd=ROOT,
                          text=True, capture_output=True, timeout=timeout)


@dataclass
class Validation:
    calibrated: subprocess.CompletedProcess  # dtlab-simulate --calibrate
    done: subprocess.CompletedProcess  # dtlab-simulate --validate
    calibration: Path
    out: Path  # the comparisons, one folder per rate
    report: Path  # the validation's JSON

    def comparison(self, gbit: float) -> Path:
        """The dtlab-compare folder of the runs at `gbit` Gbit/s (validate.py's naming)."""
        return self.out / "launch0" / f"n2-g{gbit:g}"


def validate(tmp: Path) -> Validation:
    """Calibrate from synthetic benchmarks, then validate across the emulated hosts."""
    cal = tmp / "cal.json"
    calibrated = simulate("--calibrate", "--bench", *synthetic_bench(tmp), "--calibration",
                          str(cal))
    out, report = tmp / "val", tmp / "val.json"
    done = simulate("--validate", *MODEL, "--calibration", str(cal), "--hosts", "2",
                    "--link-gbit", ",".join(f"{g:g}" for g in RATES), "--ranks", "2",
                    "--val-runs", ",".join(RUNS), "--val-steps", str(STEPS), "--launches", "1",
                    "--out", str(out), "--json", str(report), timeout=240)
    return Validation(calibrated, done, cal, out, report)
