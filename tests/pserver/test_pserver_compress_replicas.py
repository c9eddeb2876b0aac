"""Compressed pushes on a replicated shard (--replicas 2): a compressed push is journaled to
the backup as the ranged (top-k) or dense (sign) push it becomes, so after a kill -9 of the
primary the backup holds every acknowledged one exactly once. Real primary and backup
daemon processes; float32 SGD lr 1, so the shard must equal its start minus the sum of
what models/compress.py's twin compressor says was sent."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from support.faults import status
from support.pserver_util import TINY_MLP_FLAGS, DaemonProcess, initial_params
from support.waiting import wait_for

from dtlab.models.compress import CompressConfig, Sign, TopK
from dtlab.models.config import build
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.worker.client import PSClient
from dtlab.pserver.worker.compressed_push import CompressedPush

SGD = ["--optimizer", "sgd", "--lr", "1", "--warmup", "0", "--schedule", "constant"]


@pytest.mark.parametrize("spec, twin", [("topk:0.25", lambda n: TopK(n, 0.25)),
                                        ("sign", lambda n: Sign(n))])
def test_compressed_pushes_survive_a_failover_exactly_once(tmp_path, spec, twin):
    params = initial_params()
    n = params.size
    flags = [*TINY_MLP_FLAGS, *SGD, "--grace-s", "2", "--replicas", "2",
             "--replica-timeout-s", "1"]
    primary = DaemonProcess(tmp_path, flags)
    backup = DaemonProcess(tmp_path, [*flags, "--replica-of", primary.address])
    try:
        wait_for("the backup joins", lambda: status(primary.address).backup == backup.address)
        pusher = CompressedPush(build(CompressConfig, {"compress": spec}), n, np.float32)
        c = PSClient(build(ClientConfig, {"servers": f"{primary.address}|{backup.address}",
                                          "connect_timeout_s": 20.0, "rpc_timeout_s": 20.0,
                                          "retries": 4}), transport="session", compress=pusher)
        c.connect(0, "mlp", n, wire.layout_crc(params.specs))
        mirror, expected = twin(n), params.data.copy()
        try:
            flat = np.empty(n, np.float32)
            c.pull(flat)
            np.testing.assert_array_equal(flat, expected)
            for step in range(6):
                if step == 3:  # three acknowledged on the primary, then it dies
                    os.kill(primary.proc.pid, signal.SIGKILL)
                    primary.proc.wait(timeout=30)
                    wait_for("the backup takes over",
                             lambda: status(backup.address).role == "primary")
                g = np.random.default_rng(step).standard_normal(n).astype(np.float32)
                expected -= mirror.decompress(mirror.compress(g))
                c.push_pull(g, step, flat)
                np.testing.assert_array_equal(c.compress.residual, mirror.residual)
            c.pull(flat)
            np.testing.assert_array_equal(flat, expected)  # every push applied once
            assert c.shards[0].address == backup.address
        finally:
            c.close()
    finally:
        primary.close()
        backup.close()
