"""Replicated shards (--replicas 2, chain replication) with real daemons and real kill -9.

Every fault test trains with integer one-hot gradients and SGD lr 1: push (w, k) adds
exactly 1 (ASP; 1/W under BSP, the round's mean) to its own element, so the final
parameters tell, element by element, which (worker, step) was applied and how often.
Each prints one line: what was injected, how long recovery took, what was lost.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.faults import Proxy, RoleWatch, status
from support.pserver_util import (
    ONE_BLAS_THREAD,
    ROOT,
    DaemonProcess,
    connect,
    initial_params,
    pause,
    run_workers,
    serve,
)
from support.waiting import wait_for

from dtlab.models.config import ConfigError, build
from dtlab.models.run import checkpoint
from dtlab.models.run.metrics import read_metrics
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.config import ClientConfig, ServerConfig
from dtlab.pserver.server.replication import journal as replication
from dtlab.pserver.server.replication.journal import JOIN, REPLICATION

MODEL = {"d_in": 16, "d_hidden": 16, "n_layers": 1, "n_classes": 3}
MODEL_FLAGS = ["--model", "mlp", "--d-in", "16", "--d-hidden", "16", "--n-layers", "1",
               "--n-classes", "3"]
SGD_FLAGS = ["--optimizer", "sgd", "--lr", "1", "--warmup", "0", "--schedule", "constant"]
INIT = initial_params("mlp", MODEL)
N = INIT.size


def serve_args(*extra: str, run: tuple[str, ...] = (*MODEL_FLAGS, *SGD_FLAGS)) -> list[str]:
    """A replicated daemon's flags: `run` (model and optimizer), then `extra`."""
    return [*run, "--grace-s", "2", "--replicas", "2", "--replica-timeout-s", "1", *extra]


def caught_up(backup: str, primary: str) -> bool:
    """`backup` follows `primary` and has applied every change the primary made."""
    try:
        b, p = status(backup), status(primary)
    except grpc.RpcError:
        return False
    return b.role == "backup" and p.backup == backup and b.seq == p.seq


class Chain:
    """`shards` replicated shards: a primary and a backup daemon process each."""

    def __init__(self, tmp, shards: int, flags: list[str],
                 run: tuple[str, ...] = (*MODEL_FLAGS, *SGD_FLAGS)):
        self.tmp, self.flags, self.shards, self.run = tmp, flags, shards, run
        self.daemons: list[DaemonProcess] = []
        common = ["--num-shards", str(shards), *flags]
        primaries = [self._start(["--shard", str(i), *common]) for i in range(shards)]
        for p in primaries:
            p.wait_ready()
        backups = [self._start(["--shard", str(i), *common, "--replica-of", p.address])
                   for i, p in enumerate(primaries)]
        for b in backups:
            b.wait_ready()
        self.pairs = [[p, b] for p, b in zip(primaries, backups, strict=True)]
        for p, b in self.pairs:
            wait_for("the backup joins", lambda p=p, b=b: caught_up(b.address, p.address))
        self.servers = ",".join(f"{p.address}|{b.address}" for p, b in self.pairs)

    def _start(self, args: list[str]) -> DaemonProcess:
        d = DaemonProcess(self.tmp, serve_args(*args, run=self.run), wait=False)
        self.daemons.append(d)
        return d

    def rejoin(self, shard: int, dead: DaemonProcess, survivor: DaemonProcess) -> DaemonProcess:
        """`dead` restarted on its port as the backup of `survivor`."""
        d = self._start(["--shard", str(shard), "--num-shards", str(self.shards), *self.flags,
                         "--port", str(dead.port), "--replica-of", survivor.address])
        d.wait_ready()
        return d

    def close(self) -> None:
        for d in self.daemons:
            if d.proc.poll() is None:  # one a test left paused ends too
                os.kill(d.proc.pid, signal.SIGCONT)
            d.close()


class Training:
    """W worker threads, each its own PSClient: K steps of push_pull with one-hot integer
    gradients; every acknowledged push recorded as (worker, step, when). Before each step
    in `pauses` a worker waits for that step's event (set by the test once it injected
    its fault), so that every fault falls mid-training however the threads are scheduled."""

    def __init__(self, servers: str, workers: int, steps: int, pauses: list[int], **client):
        self.W, self.K = workers, steps
        self.pauses = {k: threading.Event() for k in pauses}
        self.acked: list[tuple[int, int, float]] = []
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.clients = [connect(servers, worker=w, params=INIT, **client)
                        for w in range(workers)]
        self.threads = [threading.Thread(target=self._work, args=(w,)) for w in range(workers)]

    def index(self, w: int, k: int) -> int:
        return (w * self.K + k) * 2 % N  # both shards get elements

    def _work(self, w: int) -> None:
        try:
            client, buf = self.clients[w], np.empty(N, np.float32)
            client.pull(buf)
            for k in range(self.K):
                if k in self.pauses:
                    assert self.pauses[k].wait(60), "the test never resumed the workers"
                grad = np.zeros(N, np.float32)
                grad[self.index(w, k)] = 1
                replies, _ = client.push_pull(grad, k, buf)
                with self.lock:
                    self.acked.append((w, k, time.monotonic()))
                assert len(replies) == len(client.shards)
                time.sleep(0.01)
        except BaseException as e:
            self.errors.append(e)
            self.resume()

    def resume(self, k: int | None = None) -> None:
        """Let the workers past the pause at step k (None: past every pause)."""
        for step, event in self.pauses.items():
            if k is None or step == k:
                event.set()

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def count(self) -> int:
        with self.lock:
            return len(self.acked)

    def wait_acked(self, n: int) -> None:
        wait_for(f"{n} acknowledged pushes", lambda: self.count() >= n or self.errors, 60)
        assert not self.errors, self.errors

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), "a worker never finished"
        assert not self.errors, self.errors

    def back(self, since: float) -> bool:
        """Every worker has had a push acknowledged after `since` (or finished before)."""
        with self.lock:
            return all(any(w2 == w and (t > since or k == self.K - 1)
                           for w2, k, t in self.acked) for w in range(self.W))

    def recovery(self, since: float) -> tuple[float, float]:
        """Seconds from `since` to the first acknowledged push after it, and to the
        moment every worker had one acknowledged again."""
        with self.lock:
            after = [(t, w) for w, _, t in self.acked if t > since]
        first = min(t for t, _ in after) - since
        every = max(min((t for t, w2 in after if w2 == w), default=since)
                    for w in range(self.W)) - since
        return first, every

    def close(self) -> None:
        for c in self.clients:
            c.close()


def kill(d: DaemonProcess) -> None:
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait(timeout=30)


def fault_line(what: str, mode: str, t: Training, before: int, since: float) -> str:
    first, every = t.recovery(since)
    return (f"fault: {what} under {mode.upper()} ({t.W} workers) after {before} acknowledged "
            f"pushes | recovery: {first:.3f} s to the next acknowledged push, {every:.3f} s "
            f"until every worker was acknowledged again")


def check_nothing_lost(t: Training, servers: str, mode: str) -> str:
    """Acknowledged == applied, each (worker, step) once: element by element, and by
    the shards' own counts; the line that says so."""
    assert sorted((w, k) for w, k, _ in t.acked) == [(w, k) for w in range(t.W)
                                                   for k in range(t.K)]
    counts = np.zeros(N, np.int64)
    for w, k, _ in t.acked:
        counts[t.index(w, k)] += 1
    scale = 1.0 if mode == "asp" else 1.0 / t.W
    want = INIT.data - (counts * scale).astype(np.float32)
    reader = connect(servers, worker=t.W, params=INIT, shm=False)
    try:
        got = np.empty(N, np.float32)
        reader.pull(got)
        np.testing.assert_array_equal(got, want)  # each push applied once, none lost
        for st in reader.stats():
            for w in range(t.W):
                assert st.workers[w].next_step == t.K
                assert st.workers[w].staleness.total == t.K  # gradients applied, from w
    finally:
        reader.close()
    return (f"lost: 0 of {len(t.acked)} acknowledged pushes ({len(t.acked)} applied, each "
            "(worker, step) once, final parameters = the exact sum)")


@pytest.mark.parametrize("mode, shards, workers, shm, victim, how", [
    ("asp", 2, 3, True, "primary", "kill -9"), ("bsp", 1, 2, False, "primary", "kill -9"),
    ("asp", 1, 2, False, "backup", "kill -9"), ("bsp", 1, 2, True, "primary", "SIGTERM")])
def test_kill_mid_training_loses_nothing(tmp_path, mode, shards, workers, shm, victim, how):
    """kill -9 (or SIGTERM) shard 0's primary (the backup takes over, workers fail over) or
    its backup (the primary goes on alone) mid-training; the stopped daemon restarts as the
    backup of the survivor, catches up while pushes go on, and then the survivor is killed
    too: training finishes, every acknowledged push applied once."""
    K = 40
    chain = Chain(tmp_path, shards, ["--consistency", mode, "--num-workers", str(workers)])
    t = None
    try:
        first, rejoin, second = K // 2, 3 * K // 4, K - 4
        t = Training(chain.servers, workers, K, pauses=[first, rejoin, second], shm=shm)
        t.start()
        primary, backup = chain.pairs[0]
        dead, survivor = (primary, backup) if victim == "primary" else (backup, primary)
        t.wait_acked(workers * K // 5)
        before, since = t.count(), time.monotonic()
        if how == "SIGTERM":
            assert dead.terminate() == 0  # a primary that stops sends no held reply
        else:
            kill(dead)
        t.resume(first)
        wait_for("the survivor serves alone", lambda: status(survivor.address).role
                 == "primary" and status(survivor.address).backup == "")
        wait_for("every worker acknowledged again", lambda: t.back(since) or t.errors, 60)
        lines = [fault_line(f"{how} of shard 0's {victim} (pid {dead.proc.pid})", mode, t,
                            before, since)]
        rejoined = chain.rejoin(0, dead, survivor)
        wait_for("the restarted daemon catches up",
                 lambda: caught_up(rejoined.address, survivor.address))
        t.resume(rejoin)
        t.wait_acked(t.count() + workers * 2)
        before, since = t.count(), time.monotonic()
        kill(survivor)
        t.resume(second)
        wait_for("every worker acknowledged again", lambda: t.back(since) or t.errors, 60)
        t.join()
        assert status(rejoined.address).role == "primary"
        assert all(s.shared_memory == shm for c in t.clients for s in c.shards)
        lines.append(fault_line(f"kill -9 of the primary (pid {survivor.proc.pid}) after the "
                                f"first {victim} rejoined as its backup", mode, t, before,
                                since))
        lost = check_nothing_lost(t, chain.servers, mode)
        for line in lines:
            print(f"{line} | {lost}", flush=True)
    finally:
        if t is not None:
            t.resume()
            t.close()
        chain.close()


def test_backup_refuses_workers_and_a_primary_waits_for_its_backup(tmp_path):
    """Until its backup joined a primary is NOT_SERVING and refuses workers; a backup
    always does (UNAVAILABLE, naming its primary)."""
    chain_flags = serve_args("--shard", "0")
    with DaemonProcess(tmp_path, chain_flags) as primary:
        assert health(primary.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        code, details = register_raw(primary.address)
        assert code == grpc.StatusCode.UNAVAILABLE and "waits for its backup" in details
        with DaemonProcess(tmp_path, [*chain_flags, "--replica-of", primary.address]) as backup:
            wait_for("the backup joins", lambda: caught_up(backup.address, primary.address))
            time.sleep(1.5)  # idle past --replica-timeout-s 1: heartbeats keep the link
            assert caught_up(backup.address, primary.address) and backup.proc.poll() is None
            assert health(primary.address) == health_pb2.HealthCheckResponse.SERVING
            assert health(backup.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            code, details = register_raw(backup.address)
            assert code == grpc.StatusCode.UNAVAILABLE
            assert f"backup (of {primary.address})" in details
            code, details = register_raw(primary.address, partition=pb.PartitionLayout(
                id=0, count=2))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "no partitions" in details
            # a third daemon is refused: the primary has its backup, the backup is none
            for target in (primary.address, backup.address):
                third = DaemonProcess(tmp_path, [*chain_flags, "--replica-of", target],
                                      wait=False)
                try:
                    assert third.proc.wait(timeout=60) == 1
                    assert ("already has a backup" in third.output()
                            or "is not a primary" in third.output()), third.output()
                finally:
                    third.close()


def register_raw(address: str, **fields) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as ch:
        register = ch.unary_unary(f"/{wire.SERVICE}/Register")
        try:
            register(pb.RegisterRequest(model="mlp", **fields).SerializeToString(), timeout=10)
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=wire.SERVICE), timeout=10).status


def test_a_backup_with_other_flags_is_refused_naming_them(tmp_path):
    with DaemonProcess(tmp_path, serve_args()) as primary:
        backup = DaemonProcess(tmp_path, [*serve_args("--replica-of", primary.address),
                                          "--lr", "0.5"], wait=False)
        try:
            assert backup.proc.wait(timeout=60) == 1
            assert "config differs from the primary's in optim" in backup.output()
        finally:
            backup.close()


@pytest.mark.parametrize("fields, message", [
    ({"replicas": 3}, "--replicas 3"),
    ({"replica_of": "127.0.0.1:5"}, "give --replicas 2 too"),
    ({"replicas": 2, "replica_of": "nohostport"}, "is not host:port"),
    ({"replicas": 2, "replica_timeout_s": 0}, "replica-timeout-s"),
    ({"replicas": 2, "bind": "0.0.0.0", "token_env": "T"}, "a wildcard names no host"),
])
def test_bad_replica_flags_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        build(ServerConfig, fields)


def test_servers_syntax_checks_every_replica():
    with pytest.raises(ConfigError, match="'nohostport' is not host:port"):
        build(ClientConfig, {"servers": "127.0.0.1:1|nohostport"})
    assert build(ClientConfig, {"servers": "a:1|b:2,c:3"}).addresses() == ["a:1|b:2", "c:3"]


def test_state_survives_packing():
    """The snapshot a backup starts from: every array bit for bit, an open BSP round."""
    rng = np.random.default_rng(0)
    state = {"version": 7, "params": rng.standard_normal(5).astype(np.float32),
             "optimizer": {"steps": 7, "m": rng.standard_normal(5).astype(np.float32)},
             "workers": {0: {"clock": 3, "next_step": 4, "active": True}},
             "staleness": {"shard": {}, "workers": {}},
             "round": {"total": np.arange(5, dtype=np.float32), "contributors": {0: (3, 6)}},
             "registrations": {0: 2**64 - 1}}
    back = replication.unpack(replication.pack(state))
    np.testing.assert_array_equal(back["params"], state["params"])
    np.testing.assert_array_equal(back["optimizer"]["m"], state["optimizer"]["m"])
    np.testing.assert_array_equal(back["round"]["total"], state["round"]["total"])
    assert back["round"]["contributors"] == {0: (3, 6)} and back["version"] == 7
    assert back["workers"] == state["workers"] and back["optimizer"]["steps"] == 7
    assert back["registrations"] == {0: 2**64 - 1}


def test_a_push_waits_for_the_backup_and_a_paused_backup_is_dropped_at_the_leases_end(
        tmp_path):
    """SIGSTOP the backup for 2.5 s (--replica-timeout-s 1): a push is not acknowledged
    while the backup lacks it, nor within the lease; once the backup has been silent for
    the lease while the primary ran, the primary goes on alone in the next term (the
    backup takes over only when a worker asks it, and no worker left the primary) and
    acknowledges the push, within the replica timeout + 1 s, the backup still paused.
    SIGCONT: the backup learns that it was dropped, says why in one line and rejoins by
    itself, from the primary's snapshot: the next push is held by both again."""
    chain = Chain(tmp_path, 1, [])
    client = None
    try:
        (primary, backup), = chain.pairs
        client = connect(chain.servers, params=INIT, shm=False)
        buf = np.empty(N, np.float32)
        client.pull(buf)
        client.push(np.ones(N, np.float32), 0)  # held by both before it is acknowledged:
        assert status(backup.address).version == status(primary.address).version == 1
        term = status(primary.address).term
        pause(backup.proc)  # stopped before the push below starts
        done: list[float] = []
        pusher = threading.Thread(target=lambda: done.append(
            (client.push(np.ones(N, np.float32), 1), time.monotonic())[1]))
        since = time.monotonic()
        pusher.start()
        pusher.join(timeout=2.5)
        assert done, "not acknowledged within 2.5 s of the backup's pause"
        held = done[0] - since
        assert 0.5 <= held <= 2.0, held  # past the lease, within the replica timeout + 1 s
        after = status(primary.address)
        assert (after.role, after.term) == ("primary", term + 1)  # alone in the next term
        os.kill(backup.proc.pid, signal.SIGCONT)
        since = time.monotonic()
        wait_for("the dropped backup rejoins", lambda: caught_up(backup.address,
                                                                 primary.address), 30)
        rejoined = time.monotonic() - since
        assert backup.proc.poll() is None
        why, = (line for line in backup.output().splitlines()
                if "dropped as the backup of" in line and "rejoining" in line)
        # dropped by its own question once it runs (the primary answers in its new term),
        # or by the primary's, queued while it was paused: either says why
        assert "CANCELLED" not in why and (f"its primary (term {term}) lost it" in why or
                                           f"answers as primary (term {term + 1})" in why), why
        client.push(np.ones(N, np.float32), 2)  # held by both before it is acknowledged
        assert status(backup.address).version == status(primary.address).version == 3
        client.pull(buf)
        np.testing.assert_array_equal(buf, INIT.data - 1 - 1 - 1)
        print(f"fault: SIGSTOP of the backup for 2.5 s | recovery: the push was held {held:.3f} "
              "s, past the lease; then acknowledged by the primary alone (term "
              f"{term + 1}), the backup paused; the backup rejoined {rejoined:.3f} s after it ran "
              f"and said why: {why[why.index('dropped as'):]!r} | lost: nothing (3 of 3 "
              "acknowledged pushes applied, the third on both replicas)", flush=True)
    finally:
        if client is not None:
            client.close()
        chain.close()


def test_a_backup_whose_primary_went_on_without_it_never_takes_over_for_a_worker_past_it(
        tmp_path, caplog):
    """A double fault: SIGSTOP the backup (the primary goes on alone in the next term, and
    the worker's next reply carries it), kill -9 the primary, SIGCONT the backup. Paused since
    it last heard from its primary, the backup does not take the gone port for leave to
    take over (that primary went on alone meanwhile: a push it acknowledged is not here);
    the worker's calls, carrying the higher term, are refused with the reason, and the
    backup stays a backup holding its state: the shard stops, nothing is served stale."""
    chain = Chain(tmp_path, 1, [])
    client = None
    try:
        (primary, backup), = chain.pairs
        client = connect(chain.servers, params=INIT, shm=False, rpc_timeout_s=2.0)
        client.pull(np.empty(N, np.float32))
        client.push(np.ones(N, np.float32), 0)  # held by both
        term = status(primary.address).term
        pause(backup.proc)  # stopped, or push 1 may still reach it
        client.push(np.ones(N, np.float32), 1)  # acknowledged by the primary alone, and
        client.pull(np.empty(N, np.float32))  # a reply of its new term (the push's was
        assert status(primary.address).term == term + 1  # made in the old one)
        primary.proc.kill()
        primary.proc.wait(timeout=10)
        os.kill(backup.proc.pid, signal.SIGCONT)
        wait_for("the backup waits for a worker",
                 lambda: "is gone, and this backup was paused" in backup.output(), 10)
        with pytest.raises(grpc.RpcError):
            client.push(np.ones(N, np.float32), 2)
        refused = [r.getMessage() for r in caplog.records
                   if f"the worker saw term {term + 1} of this shard" in r.getMessage()]
        assert refused, [r.getMessage() for r in caplog.records]
        after = status(backup.address)
        assert (after.role, after.term, after.version) == ("backup", term, 1)
        print(f"double fault: SIGSTOP of the backup, kill -9 of the primary that went on "
              f"alone (term {term + 1}), SIGCONT | the backup (term {term}, version 1) "
              f"refused to take over: {refused[0][refused[0].index('the worker saw'):]!r}",
              flush=True)
    finally:
        if client is not None:
            client.close()
        chain.close()


def test_a_worker_that_connects_while_the_primary_is_paused_makes_the_backup_take_over(
        tmp_path):
    """SIGSTOP the primary with no worker about: its backup hears nothing, gets no answer
    and waits for a worker to ask it (health UNKNOWN). A worker that connects now finds no
    replica serving and the primary silent, takes the orphan, and its Register makes it
    take over: the worker trains on it while the old primary is still paused."""
    chain = Chain(tmp_path, 1, [])
    client = None
    try:
        (primary, backup), = chain.pairs
        os.kill(primary.proc.pid, signal.SIGSTOP)
        with grpc.insecure_channel(backup.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            wait_for("the backup waits for a worker", lambda: health.Check(
                health_pb2.HealthCheckRequest(), timeout=1).status ==
                health_pb2.HealthCheckResponse.UNKNOWN, 10)
        client = connect(chain.servers, params=INIT, shm=False, rpc_timeout_s=2.0)
        assert status(backup.address).role == "primary"
        buf = np.empty(N, np.float32)
        client.pull(buf)
        client.push(np.ones(N, np.float32), 0)
        assert status(backup.address).version == 1 and primary.proc.poll() is None
    finally:
        if client is not None:
            client.close()
        chain.close()


def test_a_replaced_primary_acknowledges_nothing():
    """A primary whose backup (a Replicate stream of this test's, which takes the whole
    snapshot) breaks off, and answers, asked, that it took over (its address is another
    daemon that is a primary): the primary is replaced and acknowledges nothing from then
    on, neither a reply held before nor a push its store takes after (one a session it
    admitted before would hand it)."""
    with serve(replicas=2, replica_timeout_s=1.0) as (other,), \
            serve(replicas=2, replica_timeout_s=1.0) as (old,):
        lay = old.store.layout
        up: queue.SimpleQueue = queue.SimpleQueue()
        up.put(wire.wrap(JOIN, pb.ReplicaJoin(
            shard=lay.shard, num_shards=lay.num_shards, model=lay.model,
            model_size=lay.model_size, layout_crc32=lay.layout_crc,
            address=f"127.0.0.1:{other.port}",
            config=json.dumps(replication.same_run(old.config_record)))))
        with grpc.insecure_channel(f"127.0.0.1:{old.port}") as ch:
            call = ch.stream_stream(f"/{REPLICATION}/Replicate")(iter(up.get, None))
            size, got = pb.ReplicaDown.FromString(next(call)).state.nbytes, 0
            while got < size:
                got += len(pb.ReplicaDown.FromString(next(call)).state_part.data)
            old.store.register(0, lay.model, lay.model_size, lay.layout_crc, 7)  # held
            call.cancel()
            up.put(None)
            wait_for("the primary learns it was replaced",
                     lambda: old.replication.role == "replaced", 10)
        assert old.rejoin == f"127.0.0.1:{other.port}" and old.stopping.is_set()  # its backup
        assert not old.failure
        assert not old.replication.journal.wait_all()  # the registration's reply
        old.store.push(0, 0, 0, np.ones(lay.length, np.float32))
        assert old.store.version == 1  # applied here, and never acknowledged:
        assert not old.replication.journal.wait_all()
        assert status(f"127.0.0.1:{old.port}").role == "replaced"


def test_a_primary_paused_past_the_deadline_is_replaced_and_its_workers_fail_over(tmp_path):
    """SIGSTOP the primary while 2 workers push with --rpc-timeout-s 1: the backup takes
    over, and the workers' calls stuck on the paused primary end at their deadline and
    go to it (the paused primary's health check gives no answer), all while the primary
    is still paused. SIGCONT: it learns from the backup that it was replaced before it
    answers anything, and rejoins it as its backup. Every acknowledged push applied
    once."""
    W, K = 2, 30
    chain = Chain(tmp_path, 1, [])
    t = None
    try:
        primary, backup = chain.pairs[0]
        t = Training(chain.servers, W, K, pauses=[K // 2], shm=False, rpc_timeout_s=1.0)
        t.start()
        t.wait_acked(W * K // 5)
        before, since = t.count(), time.monotonic()
        os.kill(primary.proc.pid, signal.SIGSTOP)
        t.resume(K // 2)
        wait_for("the backup takes over", lambda: status(backup.address).role == "primary")
        wait_for("every worker acknowledged again", lambda: t.back(since) or t.errors, 60)
        assert not t.errors, t.errors
        assert primary.proc.poll() is None  # still paused: the workers failed over on a deadline
        line = fault_line("SIGSTOP of the primary past the workers' 1 s deadline", "asp", t,
                          before, since)
        os.kill(primary.proc.pid, signal.SIGCONT)
        wait_for("the old primary rejoins as the backup",
                 lambda: caught_up(primary.address, backup.address), 30)
        assert primary.proc.poll() is None
        assert "replaced as primary: its backup" in primary.output()
        t.join()
        print(f"{line} | {check_nothing_lost(t, chain.servers, 'asp')}", flush=True)
    finally:
        if t is not None:
            t.resume()
            t.close()
        chain.close()


def settle(t: Training, watch: RoleWatch, pair: list[DaemonProcess], servers: str,
           what: str) -> None:
    """After a fault on `pair`: one daemon rejoins the other as its backup (dropped, or
    replaced), the other serves as primary, training finishes; never two primaries at
    once, every acknowledged push applied once."""
    wait_for("one of the two rejoins the other", lambda: any(
        "rejoining it as its backup" in d.output() for d in pair))
    moved, = (d for d in pair if "rejoining it as its backup" in d.output())
    survivor, = (d for d in pair if d is not moved)
    wait_for("the shard is two replicas again",
             lambda: caught_up(moved.address, survivor.address))
    assert all(d.proc.poll() is None for d in pair)
    t.join()
    episodes = watch.stop()
    assert watch.answers > 10 and episodes == 0, (watch.answers, episodes)
    kept = "backup" if survivor is pair[1] else "primary"
    print(f"fault: {what} | the {kept} serves (term {status(survivor.address).term}), the "
          f"other rejoined it as its backup; {watch.answers} role answers, never two "
          f"primaries | {check_nothing_lost(t, servers, 'asp')}", flush=True)


def test_a_backup_paused_twice_never_makes_two_primaries(tmp_path):
    """The issue's reproduction: SIGSTOP the backup for 2.5 s while workers push (its
    primary loses its lease and asks it, answering no worker); SIGCONT, and as soon as
    the backup says it heard nothing from its primary, SIGSTOP it for 1.5 s more, so that
    its own question to the primary times out; SIGCONT. Either the backup takes over or
    the primary goes on alone, never both."""
    chain = Chain(tmp_path, 1, [])
    t = watch = None
    try:
        pair = chain.pairs[0]
        primary, backup = pair
        watch = RoleWatch([primary.address, backup.address])
        t = Training(chain.servers, 2, 40, pauses=[20], shm=False, rpc_timeout_s=3.0)
        t.start()
        t.wait_acked(8)
        os.kill(backup.proc.pid, signal.SIGSTOP)
        t.resume(20)
        time.sleep(2.5)
        os.kill(backup.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 1.0
        while "no word from the primary" not in backup.output() and \
                time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(backup.proc.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(backup.proc.pid, signal.SIGCONT)
        settle(t, watch, pair, chain.servers, "SIGSTOP of the backup 2.5 s, SIGCONT, SIGSTOP "
               "1.5 s at its \"no word from the primary\"")
    finally:
        if watch is not None:
            watch.stop()
        if t is not None:
            t.resume()
            t.close()
        chain.close()


def test_a_cut_between_the_replicas_never_makes_two_primaries(tmp_path):
    """The backup reaches its primary through a proxy, which forwards nothing for 3 s
    while the workers still reach both (and the primary still reaches the backup's own
    port): the backup hears nothing and asks in vain, the primary loses its lease and
    asks the backup; one of them goes on as the primary, never both."""
    primary = DaemonProcess(tmp_path, serve_args("--shard", "0"))
    proxy = Proxy(primary.address)
    backup = DaemonProcess(tmp_path, serve_args("--shard", "0", "--replica-of", proxy.address))
    t = watch = None
    try:
        wait_for("the backup joins", lambda: caught_up(backup.address, primary.address))
        servers = f"{primary.address}|{backup.address}"
        watch = RoleWatch([primary.address, backup.address])
        t = Training(servers, 2, 40, pauses=[20], shm=False, rpc_timeout_s=3.0)
        t.start()
        t.wait_acked(8)
        proxy.cut()
        t.resume(20)
        time.sleep(3.0)
        proxy.heal()
        settle(t, watch, [primary, backup], servers, "the backup's link to its primary cut "
               "for 3 s (workers reach both)")
    finally:
        if watch is not None:
            watch.stop()
        if t is not None:
            t.resume()
            t.close()
        proxy.close()
        primary.close()
        backup.close()


def test_real_workers_finish_bsp_training_through_a_kill(tmp_path):
    """Real dtlab-worker processes train an MLP under BSP while shard 0's primary is
    killed: both finish every step, and the parameters equal single-process training's
    (BSP's mean of the workers' gradients is the gradient of their joint batch)."""
    W, B, K = 2, 8, 60
    model = ["--model", "mlp", "--d-in", "4", "--d-hidden", "64", "--n-layers", "1",
             "--n-classes", "3"]
    optim = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--warmup", "3"]
    ref = tmp_path / "ref"
    single = subprocess.Popen(
        [sys.executable, "-m", "dtlab.models.run.train", *model, *optim, "--clip", "0",
         "--seed", "3", "--steps", str(K), "--batch-size", str(W * B), "--checkpoint-dir",
         str(ref), "--checkpoint-every", str(K)], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env=ONE_BLAS_THREAD)
    chain = Chain(tmp_path, 2, ["--consistency", "bsp", "--num-workers", str(W),
                                "--schedule-steps", str(K), "--seed", "3"],
                  run=(*model, *optim))
    try:
        outcome: list = []
        workers = threading.Thread(target=lambda: outcome.append(run_workers(
            chain.servers, W, [*model, "--clip", "0", "--seed", "3", "--steps", str(K),
                               "--batch-size", str(B)], tmp_path)))
        workers.start()
        primary, backup = chain.pairs[0]
        wait_for("a third of the training", lambda: status(primary.address).version >= K // 3,
                 60)
        at = status(primary.address).version
        kill(primary)
        workers.join(timeout=120)
        assert outcome, "the workers did not finish"
        assert at < K and status(backup.address).role == "primary"
        assert all(len(read_metrics(str(p))[1]) == K for p in outcome[0])
        reader = connect(chain.servers, worker=W, params=initial_params("mlp", {
            "d_in": 4, "d_hidden": 64, "n_layers": 1, "n_classes": 3}, seed=3), shm=False)
        try:
            got = np.empty(reader.shards[0].info.model_size, np.float32)
            reader.pull(got)
            assert [st.version for st in reader.stats()] == [K, K]
        finally:
            reader.close()
    finally:
        chain.close()
    _, err = single.communicate(timeout=120)
    assert single.returncode == 0, err
    want = checkpoint.load(checkpoint.latest(str(ref)))[0]["params"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    print(f"fault: kill -9 of shard 0's primary at version {at} of {K} under BSP (2 "
          "dtlab-worker processes) | both workers finished all steps | lost: nothing "
          "(parameters = single-process training's, atol 1e-5)", flush=True)


@pytest.mark.parametrize("shm", [False, True], ids=["grpc", "shm"])
def test_ranged_pushes_reach_the_backup_which_holds_them_after_a_kill(tmp_path, shm):
    """MoE workers' ranged pushes (pserver.common.ranges) are journaled with their ranges: after
    kill -9 of the primary the backup holds exactly INIT minus the pushed ranges' values
    (SGD, lr 1), the elements outside every range untouched."""
    chain = Chain(tmp_path, 1, [])
    try:
        client = connect(chain.servers, worker=0, params=INIT, shm=shm)
        try:
            buf, want = np.empty(N, np.float32), INIT.data.copy()
            client.pull(buf)
            for k, ranges in enumerate([((0, 5), (9, 12)), ((3, 4),), ((N - 2, N),)]):
                grad = np.arange(1, N + 1, dtype=np.float32)  # integers: exact in float32
                client.push_pull(grad, k, buf, ranges=list(ranges))
                for lo, hi in ranges:
                    want[lo:hi] -= grad[lo:hi]
            np.testing.assert_array_equal(buf, want)
            primary, backup = chain.pairs[0]
            wait_for("the backup applied every push", lambda: caught_up(backup.address,
                                                                        primary.address))
            kill(primary)
            client.pull(buf)  # fails over to the backup, which took over
            reader = connect(chain.servers, worker=1, params=INIT, shm=False)
            try:  # a new client knows no version: the backup sends all its values
                got = np.empty(N, np.float32)
                reader.pull(got)
                np.testing.assert_array_equal(got, want)
            finally:
                reader.close()
            assert status(backup.address).role == "primary"
        finally:
            client.close()
    finally:
        chain.close()
