"""Streaming DiLoCo on the sync topology (dtlab-sync --local-steps H --fragments F
--overlap-steps tau --mix alpha --outer-precision; collective/reducers/streaming.py) against the
cases it reduces to, and its schedule and quantizer as data.

- F = 1, tau = 0, fp32 (the flags given) is DiLoCo bit for bit (the same run without them).
- F = 3 and F = 2 with tau = 1 and alpha = 0.5 equal a single process running the two
  replicas one after another from the definition (tests/support/mpi_progs/
  method_cases.py, stream_twin), bit for bit: at dp 2 the ring's sum is a + b.
- int8 and 4-bit outer gradients: the replicas still agree (dtlab-sync checks their
  checksums at the end), each sync sends the quantized payload's all-gather bytes, and
  the run ends near the fp32 one (the quantizer itself: tests/models/test_quantize.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_local_sgd import DILOCO, MLP, rel, run_cases

from dtlab.collective.train import parse_args
from dtlab.models import quantize
from dtlab.models.config import ConfigError
from dtlab.models.outer import round_ends
from dtlab.models.run.metrics import read_metrics
from dtlab.models.streaming import fragment_ranges, syncing

pytestmark = pytest.mark.usefixtures("mpiexec")


def test_the_schedule_at_one_fragment_is_diloco_and_each_fragment_syncs_every_h():
    for total in (10, 12):
        assert [bool(syncing(t, 4, 1, total)) for t in range(total)] == \
            [round_ends(t, 4, total) for t in range(total)]
    H, F, total = 12, 3, 40
    when = {f: [t for t in range(total) if f in syncing(t, H, F, total)] for f in range(F)}
    for f, steps in when.items():
        assert steps[-1] == total - 1  # the last step syncs everything
        assert all(b - a == H for a, b in zip(steps[:-2], steps[1:-1], strict=True))
        assert (steps[0] + 1) == (f + 1) * H // F
    every = [len(syncing(t, H, F, total)) for t in range(total - 1)]
    assert max(every) == 1 and sum(every) == (total - 1) // (H // F)


def test_fragments_are_whole_tensors_covering_the_buffer():
    tensors = [(0, 40), (40, 44), (44, 84), (84, 88), (88, 100)]
    assert fragment_ranges(tensors, 1) == [(0, 100)]
    two = fragment_ranges(tensors, 2)
    assert two == [(0, 84), (84, 100)] or two == [(0, 44), (44, 100)]
    five = fragment_ranges(tensors, 5)
    assert five == tensors
    with pytest.raises(ValueError, match="between 1 and the number of tensors"):
        fragment_ranges(tensors, 6)


def test_streaming_flags_are_refused_where_they_mean_nothing():
    base = [*MLP, *DILOCO, "--steps", "10"]
    for extra, why in ((["--fragments", "2"], "has no effect without --local-steps"),
                       (["--local-steps", "6", "--fragments", "4"], "must divide"),
                       (["--local-steps", "6", "--fragments", "2", "--overlap-steps", "3"],
                        "must be below"),
                       (["--local-steps", "4", "--mix", "1"], "--mix must be in")):
        with pytest.raises(ConfigError, match=why):
            parse_args([*base, *extra])


def test_streaming_diloco_reduces_to_diloco_and_equals_its_one_process_twin(tmp_path):
    run = [*MLP, *DILOCO, "--steps", "14", "--local-steps", "6"]
    stream3 = [*run, "--fragments", "3"]
    overlap = [*run, "--fragments", "2", "--overlap-steps", "1", "--mix", "0.5"]
    metrics = {p: tmp_path / f"{p}.jsonl" for p in ("fp32", "int8", "int4")}
    got = run_cases(tmp_path, 2, [
        {"name": "diloco", "argv": run},
        {"name": "explicit", "argv": [*run, "--fragments", "1", "--overlap-steps", "0",
                                      "--outer-precision", "fp32"]},
        {"name": "stream3", "argv": stream3},
        {"name": "stream3_twin", "argv": stream3, "stream_twin": 2},
        {"name": "overlap", "argv": [*overlap, "--metrics", str(metrics["fp32"])]},
        {"name": "overlap_twin", "argv": overlap, "stream_twin": 2},
        *({"name": p, "argv": [*overlap, "--outer-precision", p, "--metrics",
                               str(metrics[p])]} for p in ("int8", "int4"))])
    assert np.array_equal(got["explicit"], got["diloco"])
    assert np.array_equal(got["stream3"], got["stream3_twin"])
    assert np.array_equal(got["overlap"], got["overlap_twin"])
    assert rel(got["stream3"], got["diloco"]) > 1e-4  # another training
    assert rel(got["int8"], got["overlap"]) < rel(got["int4"], got["overlap"]) < 0.05
    header, records = read_metrics(str(metrics["int4"]))
    lo_hi = header["streaming"]["fragment_ranges"]
    for r in records:
        synced = syncing(r["step"] - 1, 6, 2, 14)
        assert r["comm_rounds"] == len(synced)
        # dp 2: a rank sends its own payload once in the ring's all-gather
        assert r["sent_bytes"] == sum(quantize.payload_bytes(hi - lo, 4)
                                      for lo, hi in (lo_hi[f] for f in synced))
