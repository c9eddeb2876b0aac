"""The replication term on worker replies (--replicas 2; protos/dtlab_ps.proto, Terms): a
real primary and backup daemon process. Every Register, Push, Pull and Session answer
carries the primary's term; after a kill -9 the worker fails over and hears the new
primary's higher term; a reply of a term below the highest the worker has seen is refused
(UNAVAILABLE, failed over, nothing of it used)."""

from __future__ import annotations

import os
import signal

import grpc
import numpy as np
import pytest
from support.faults import status
from support.pserver_util import TINY_MLP_FLAGS, DaemonProcess, connect, initial_params
from support.waiting import wait_for

SGD_FLAGS = ["--optimizer", "sgd", "--lr", "1", "--warmup", "0", "--schedule", "constant"]


def replicated(tmp_path) -> tuple[DaemonProcess, DaemonProcess]:
    """A primary and its backup for the tiny MLP, the backup caught up."""
    flags = [*TINY_MLP_FLAGS, *SGD_FLAGS, "--grace-s", "2", "--replicas", "2",
             "--replica-timeout-s", "1"]
    primary = DaemonProcess(tmp_path, flags)
    backup = DaemonProcess(tmp_path, [*flags, "--replica-of", primary.address])

    def joined() -> bool:
        return status(backup.address).role == "backup" and \
            status(primary.address).backup == backup.address

    wait_for("the backup joins", joined)
    return primary, backup


@pytest.mark.parametrize("transport", ["session", "calls"])
def test_replies_carry_the_primarys_term_and_it_grows_at_a_failover(tmp_path, transport):
    params = initial_params()
    primary, backup = replicated(tmp_path)
    try:
        c = connect(f"{primary.address}|{backup.address}", 0, params, transport=transport,
                    shm=False, retries=4)
        shard = c.shards[0]
        try:
            assert shard.info.term == 1 and shard.terms.highest == 1  # RegisterReply's
            flat = np.empty(params.size, np.float32)
            c.pull(flat)
            replies, _ = c.push_pull(np.ones(params.size, np.float32), 0, flat)
            assert [r.term for r in replies] == [1]
            os.kill(primary.proc.pid, signal.SIGKILL)
            primary.proc.wait(timeout=30)
            wait_for("the backup takes over", lambda: status(backup.address).role == "primary")
            assert status(backup.address).term == 2
            replies, _ = c.push_pull(np.ones(params.size, np.float32), 1, flat)
            assert [r.term for r in replies] == [2] and shard.terms.highest == 2
            assert shard.address == backup.address and shard.failovers >= 1
            np.testing.assert_array_equal(flat, params.data - 1 - 1)  # each push once
        finally:
            c.close()
    finally:
        primary.close()
        backup.close()


def test_a_reply_of_a_lower_term_is_refused_and_nothing_of_it_is_used(tmp_path, caplog):
    """The worker has heard term 3 from this shard (a newer primary, as after two
    takeovers); the daemon answering in term 1 is then a replaced primary: its pull is
    refused before its values land, the call goes to the other replica (a backup, which
    refuses workers) and back, each refusal named, and fails."""
    params = initial_params()
    primary, backup = replicated(tmp_path)
    try:
        c = connect(f"{primary.address}|{backup.address}", 0, params, shm=False, retries=1,
                    backoff_s=0.01)
        shard = c.shards[0]
        try:
            flat = np.zeros(params.size, np.float32)
            c.pull(flat)
            c.push(np.ones(params.size, np.float32), 0)
            shard.terms.highest = 3
            out = np.full(params.size, 7.0, np.float32)
            with pytest.raises(grpc.RpcError) as e:
                c.pull(out)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            refused = [r.getMessage() for r in caplog.records
                       if "reply of replication term 1, below the term 3" in r.getMessage()]
            assert len(refused) == 2 and all(primary.address in m for m in refused)
            assert (out == 7).all()  # the values of the refused pull were never used
            assert shard.failovers >= 2 and shard.terms.highest == 3
            shard.terms.highest = 1  # as it was: the primary's replies count again
            c.pull(out)
            np.testing.assert_array_equal(out, params.data - 1)
        finally:
            c.close()
    finally:
        primary.close()
        backup.close()
