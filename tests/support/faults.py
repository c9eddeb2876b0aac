"""Randomized faults on replicated shards, and the checks after them.

Two replicated shards (`dtlab-pserver serve --replicas 2`, pserver.server.replication),
W worker threads pushing two-hot integer gradients (float64, SGD lr 1: push (w, k)
subtracts exactly 1 from one element of each shard, its own, so the final parameters
tell which (worker, step) was applied and how often), and faults at seeded random
moments, one at a time per shard (the two shards' faults overlap), each once its shard
is whole again (a primary and a backup that holds its snapshot):

- kill -9 of the primary or of the backup (restarted on its port as the backup of the
  survivor);
- SIGSTOP / SIGCONT of the primary or of the backup, for 0.3-3 s;
- the issue's double pause of the backup: 2.5 s, SIGCONT, and as soon as it says it
  heard nothing from its primary, 1.5 s more;
- a cut of the backup's link to its primary, and a cut of both replicas' links to
  each other: every daemon's outgoing gRPC connections go through a Link of its own, an
  HTTP CONNECT proxy (gRPC's `grpc_proxy`), which then forwards nothing for 0.5-3 s
  (silence, as a cut cable): "cut" silences the backup's (its stream to the primary and
  its questions), "cut-both" the primary's too (its questions to the backup), while the
  workers reach both replicas directly. (A connection's own check that something listens,
  pserver.server.replication.peer.refused, is a plain TCP connect that no Link carries:
  over a cut it finds the port open, and "silent" stays silent, as over a real cut.)

A killed daemon is restarted on its port (a supervisor's job); a daemon dropped by its
primary or replaced by its backup rejoins by itself, as the backup of the other (one
that exits instead is restarted the same way and counted: "restarted by hand"). After
each run: every acknowledged push applied exactly once, nothing applied that was not
sent, and (RoleWatch) no moment when both replicas of a shard answered ReplicaStatus
role=primary. Per fault kind it also measures availability: the longest gap between
two acknowledgements (of any worker) that overlaps the fault, from its start until the
shard is whole again (a gap over several faults counts for the first), and the time
the shard spent unreplicated (from the fault until whole again).

    python tests/support/faults.py --runs 10 --seed 0
    python tests/support/faults.py --each 2 --shards 1 --fault-s 5 --rpc-timeout-s 120 \
        --pace-s 0.05

print one line per run, the totals and the table per fault kind (the second: every kind
twice on one shard, so that no other shard's fault shares a gap, pauses and cuts of 5 s,
workers with dtlab-worker's default deadline, paced so that their steps outlast the
faults); tests/pserver/test_pserver_chaos.py
runs a bounded version in the suite.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import logging
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

if __package__ in (None, ""):  # run as a script: `support` is a package of tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.server.replication.journal import REPLICATION
from support.pserver_util import DaemonProcess, connect, initial_params

MODEL = {"d_in": 128, "d_hidden": 64, "n_layers": 1, "n_classes": 3}
MODEL_FLAGS = ["--model", "mlp", "--d-in", "128", "--d-hidden", "64", "--n-layers", "1",
               "--n-classes", "3"]
SGD_FLAGS = ["--optimizer", "sgd", "--lr", "1", "--warmup", "0", "--schedule", "constant",
             "--dtype", "float64"]
REPLICA_TIMEOUT_S = 1.0
KINDS = ("kill-primary", "kill-backup", "pause-primary", "pause-backup", "pause-backup-twice",
         "cut", "cut-both")


def status(address: str, timeout: float = 10.0) -> pb.ReplicaStatusReply:
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(f"/{REPLICATION}/ReplicaStatus",
                              request_serializer=pb.ReplicaStatusRequest.SerializeToString,
                              response_deserializer=pb.ReplicaStatusReply.FromString)
        return call(pb.ReplicaStatusRequest(), timeout=timeout)


def role(address: str, timeout: float = 0.5) -> str | None:
    """The replica's role, or None if it gives no answer in `timeout` s."""
    try:
        return status(address, timeout).role
    except grpc.RpcError:
        return None


class _Forwarder:
    """127.0.0.1:PORT forwarding TCP connections. While cut it forwards nothing (what
    arrives waits, so the senders' TCP stalls, as over a cut cable) and opens no new
    connection, and delivers it all once the cut heals."""

    def __init__(self):
        self._open = threading.Event()
        self._open.set()
        self._sockets: list[socket.socket] = []
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listen.getsockname()[1]}"
        threading.Thread(target=self._accept, name="forwarder", daemon=True).start()

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def _far(self, near: socket.socket) -> socket.socket | None:
        """The connection to the far end of `near` (None: closed, and `near` with it)."""
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listen.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._join, args=(near,), daemon=True).start()

    def _join(self, near: socket.socket) -> None:
        self._sockets.append(near)
        try:
            far = self._far(near)
        except (OSError, ValueError):  # ValueError: a request that is no CONNECT line
            far = None
        if far is None:
            near.close()
            return
        self._sockets.append(far)
        for src, dst in ((near, far), (far, near)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                self._open.wait()
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._open.set()
        self._listen.close()
        for s in self._sockets:
            s.close()


class Proxy(_Forwarder):
    """A forwarder to `target`: a backup's --replica-of (through it a dead primary looks
    silent, not gone: its port stays open)."""

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        super().__init__()

    def _far(self, near: socket.socket) -> socket.socket:
        self._open.wait()
        far = socket.create_connection(self.target, timeout=5)
        far.settimeout(None)
        return far


class Link(_Forwarder):
    """One daemon's outgoing link: an HTTP CONNECT proxy its gRPC channels reach every
    target through (gRPC's grpc_proxy; `env` is what the daemon is started with). A target
    that refuses the connection is answered 502, which gRPC takes as UNAVAILABLE."""

    def env(self) -> dict[str, str]:
        # no_grpc_proxy overrides no_proxy (which often names 127.0.0.1)
        return {"grpc_proxy": f"http://{self.address}", "no_grpc_proxy": ""}

    def _far(self, near: socket.socket) -> socket.socket | None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = near.recv(4096)
            if not data or len(head) > 1 << 16:
                return None
            head += data
        head, _, early = head.partition(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        host, _, port = target.rpartition(":")
        if method != "CONNECT" or not port.isdigit():
            near.sendall(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            return None
        self._open.wait()
        try:
            far = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
        except OSError:
            near.sendall(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            return None
        far.settimeout(None)
        near.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if early:
            far.sendall(early)
        return far


class RoleWatch:
    """Asks the replicas at `addresses` (a shard's two) for their role in turn, each
    question sent once the previous answer came, for as long as it runs. `episodes`
    counts the moments with two primaries: a replica answering "primary" between two
    "primary" answers of the other (answers in that order were given in that order, so
    the other was primary before and after this one was)."""

    def __init__(self, addresses: list[str], period: float = 0.02):
        self.addresses, self.period = addresses, period
        self.episodes = 0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="role-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        known: list[tuple[int, str]] = []  # (replica, role) of the answers given, in order
        inside = False
        i = 0
        while not self._stop.is_set():
            answer = role(self.addresses[i])
            if answer is not None:
                self.answers += 1
                known = [*known[-2:], (i, answer)]
                both = len(known) == 3 and all(r == "primary" for _, r in known) and \
                    known[0][0] == known[2][0] != known[1][0]
                if both and not inside:
                    self.episodes += 1
                inside = both or (inside and answer == "primary")
            i = (i + 1) % len(self.addresses)
            self._stop.wait(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.episodes


def daemon_args(shard: int, shards: int, *extra: str) -> list[str]:
    return [*MODEL_FLAGS, *SGD_FLAGS, "--grace-s", "0.5", "--replicas", "2",
            "--replica-timeout-s", str(REPLICA_TIMEOUT_S), "--shard", str(shard),
            "--num-shards", str(shards), *extra]


class Slot:
    """One address of a shard: the daemon serving there now (restarted on that port)."""

    def __init__(self, tmp: Path, shard: int, shards: int):
        self.tmp, self.shard, self.shards = tmp, shard, shards
        self.daemon: DaemonProcess | None = None
        self.proxy: Proxy | None = None
        self.link = Link()  # the outgoing link of every daemon started here
        self.port = 0
        self.started = 0.0
        self.killed = False  # its daemon was killed by the harness (not exited by itself)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, primary: str = "", proxy: bool = False) -> None:
        """A daemon here, its gRPC channels through this slot's Link: the primary (primary
        ""), or the backup of `primary`, which it reaches directly or (proxy) through a new
        Proxy. (Through a proxy a dead primary looks silent, not gone: its backup takes
        over once the lease has run out.)"""
        self.close()
        extra = ["--port", str(self.port)] if self.port else []
        if primary and not proxy:
            extra += ["--replica-of", primary]
        elif primary:
            self.proxy = Proxy(primary)
            extra += ["--replica-of", self.proxy.address]
        self.daemon = DaemonProcess(self.tmp, daemon_args(self.shard, self.shards, *extra),
                                    env=self.link.env(), wait=False)
        self.started, self.killed = time.monotonic(), False
        if not self.port:
            self.daemon.wait_ready()
            self.port = self.daemon.port

    def exited(self) -> bool:
        return self.daemon is None or self.daemon.proc.poll() is not None

    def signal(self, sig: int) -> None:
        os.kill(self.daemon.proc.pid, sig)

    def close(self) -> None:
        """The daemon and its proxy, if any (the link stays, for the next daemon here)."""
        if self.daemon is not None:
            if self.daemon.proc.poll() is None:
                os.kill(self.daemon.proc.pid, signal.SIGCONT)
            self.daemon.close()
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None


class Pair:
    """One shard's two slots, its faults, and what makes it whole after each."""

    def __init__(self, tmp: Path, shard: int, shards: int, rng: random.Random,
                 fault_s: tuple[float, float] | None = None):
        self.rng, self.shard = rng, shard  # the faults, their moments and lengths
        self.fault_s = fault_s  # (low, high) of pauses and cuts; None: the kinds' own
        self._proxies = random.Random(rng.random())  # which backups go through a proxy
        self.slots = [Slot(tmp, shard, shards), Slot(tmp, shard, shards)]
        self.faults: collections.Counter[str] = collections.Counter()
        self.records: list[Fault] = []
        self.restarted = 0  # daemons that exited by themselves, restarted by the harness
        self.slots[0].start()
        self.slots[1].start(primary=self.slots[0].address, proxy=self._proxies.random() < 0.5)
        self.slots[1].daemon.wait_ready()
        self.slots[1].port = self.slots[1].daemon.port
        self.heal()

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.slots]

    def whole(self) -> tuple[int, int] | None:
        """(primary, backup) slots when the shard has both, else None."""
        for p, b in ((0, 1), (1, 0)):
            try:
                sp, sb = status(self.slots[p].address, 1), status(self.slots[b].address, 1)
            except grpc.RpcError:
                continue
            if sp.role == "primary" and sb.role == "backup" and \
                    sp.backup == self.slots[b].address:
                return p, b
        return None

    def heal(self, timeout: float = 60.0) -> tuple[int, int]:
        """Until whole: a slot whose daemon has exited is started again as the backup of
        the other, once that one answers as the primary."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.whole()
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard {self.shard} not whole within {timeout} s: roles "
                                   f"{[role(a) for a in self.addresses]}")
            for i, slot in enumerate(self.slots):
                other = self.slots[1 - i]
                if slot.exited() and not other.exited() and \
                        time.monotonic() - slot.started > 0.3 and \
                        role(other.address) == "primary":
                    self.restarted += not slot.killed
                    slot.start(primary=other.address, proxy=self._proxies.random() < 0.5)
            time.sleep(0.05)

    def inject(self, kind: str) -> None:
        """One fault of `kind`, then until the shard is whole again."""
        p, b = self.heal()
        victim = self.slots[p if kind.endswith("primary") else b]
        rng = self.rng
        low, high = self.fault_s or (0.3, 3.0)
        record = Fault(kind, self.shard, time.monotonic())
        if kind.startswith("kill"):
            victim.killed = True
            victim.signal(signal.SIGKILL)
            victim.daemon.proc.wait(timeout=30)
        elif kind == "pause-backup-twice":
            victim.signal(signal.SIGSTOP)
            time.sleep(2.5)
            victim.signal(signal.SIGCONT)
            log, deadline = victim.daemon, time.monotonic() + 1.0
            while "no word from the primary" not in log.output() and \
                    time.monotonic() < deadline:
                time.sleep(0.005)
            victim.signal(signal.SIGSTOP)
            time.sleep(1.5)
            victim.signal(signal.SIGCONT)
        elif kind.startswith("pause"):
            victim.signal(signal.SIGSTOP)
            time.sleep(rng.uniform(low, high))
            victim.signal(signal.SIGCONT)
        else:  # cut: the backup's link; cut-both: the primary's too
            links = [victim.link] + ([self.slots[p].link] if kind == "cut-both" else [])
            for link in links:
                link.cut()
            time.sleep(rng.uniform(*(self.fault_s or (0.5, 3.0))))
            for link in links:
                link.heal()
        self.faults[kind] += 1
        self.heal()
        record.whole = time.monotonic()
        self.records.append(record)

    def close(self) -> None:
        for s in self.slots:
            s.close()
            s.link.close()


class Pushers:
    """W worker threads, each its own PSClient: push_pull of two-hot gradients, step
    after step, until stopped; what was sent and what acknowledged."""

    def __init__(self, servers: str, workers: int, params, shm: bool, pace_s: float = 0.01,
                 rpc_timeout_s: float = 3.0):
        self.W, self.pace_s = workers, pace_s
        self.sent: set[tuple[int, int]] = set()
        self.acked: set[tuple[int, int]] = set()
        self.times: list[float] = []  # when each acknowledgement came (monotonic), in order
        self.stopped = 0.0  # when the pushers were stopped
        self.finished = 0  # workers that pushed all their steps (kmax) before being stopped
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.clients = [connect(servers, worker=w, params=params, shm=shm and w == 0,
                                rpc_timeout_s=rpc_timeout_s, retries=40)
                        for w in range(workers)]
        metas = [s.info.meta for s in self.clients[0].shards]
        self.offsets = [m.offset for m in metas]
        self.kmax = min(m.shape[0] for m in metas) // workers  # steps per worker at most
        self.size = params.size
        self._threads = [threading.Thread(target=self._work, args=(w,), daemon=True)
                         for w in range(workers)]
        for t in self._threads:
            t.start()

    def element(self, w: int, k: int) -> int:
        """The element of each shard that push (w, k) moves, from the shard's offset."""
        return w * self.kmax + k

    def _work(self, w: int) -> None:
        client = self.clients[w]
        buf = np.empty(self.size, np.float64)
        try:
            client.pull(buf)
            for k in range(self.kmax):
                if self._stop.is_set():
                    return
                grad = np.zeros(self.size, np.float64)
                for offset in self.offsets:
                    grad[offset + self.element(w, k)] = 1
                with self._lock:
                    self.sent.add((w, k))
                client.push_pull(grad, k, buf)
                with self._lock:
                    self.acked.add((w, k))
                    self.times.append(time.monotonic())
                time.sleep(self.pace_s)
            with self._lock:
                self.finished += 1
        except Exception as e:  # recorded: the run reports it
            self.errors.append(f"worker {w}: {e}")

    def stop(self) -> None:
        self._stop.set()
        self.stopped = time.monotonic()
        for t in self._threads:
            t.join(timeout=300)
        for c in self.clients:
            c.close()


@dataclass
class Fault:
    """One fault injected: its kind, shard, when it began and when the shard was whole
    again; `gap`: the longest time between two acknowledgements overlapping it
    (attribute_gaps)."""
    kind: str
    shard: int
    start: float
    whole: float = 0.0
    gap: float = 0.0

    @property
    def unreplicated(self) -> float:
        return self.whole - self.start


def attribute_gaps(times: list[float], records: list[Fault], stopped: float | None) -> None:
    """Each fault's `gap`: the longest time between consecutive acknowledgements (`times`,
    sorted; the last runs to `stopped`, None: the pushes had all been made) among those
    that overlap it, a gap that overlaps several faults counted for the first of them
    (the one it began in, or that was under way: a stall that outlasts its fault is
    that fault's)."""
    ordered = sorted(records, key=lambda r: r.start)
    for r in ordered:
        r.gap = 0.0
    for a, b in itertools.pairwise([*times, *([] if stopped is None else [stopped])]):
        first = next((r for r in ordered if r.start < b and r.whole > a), None)
        if first is not None:
            first.gap = max(first.gap, b - a)


@dataclass
class Outcome:
    faults: collections.Counter = field(default_factory=collections.Counter)
    acked: int = 0
    lost: int = 0  # acknowledged, not applied on some shard
    duplicated: int = 0  # applied more than once on some shard
    stray: int = 0  # elements changed that no sent push moves (or not by a whole number)
    split_brain: int = 0
    new_terms: int = 0  # takeovers and primaries gone on alone, over the shards
    restarted: int = 0  # daemons that exited by themselves (a person would restart them)
    unmeasured: int = 0  # faults after the workers had pushed all their steps
    records: list[Fault] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        return (f"faults {sum(self.faults.values())} ({faults}) | new terms {self.new_terms} | "
                f"acknowledged {self.acked} | "
                f"lost {self.lost} | duplicated {self.duplicated} | applied unsent "
                f"{self.stray} | split-brain episodes {self.split_brain} | restarted by hand "
                f"{self.restarted}"
                + (f" | {self.unmeasured} faults after the workers' last step: no gap "
                   "measured (use --pace-s)" if self.unmeasured else "")
                + (f" | errors: {'; '.join(self.errors)}" if self.errors else ""))

    def table(self) -> list[str]:
        """Per fault kind: the longest gap between acknowledgements and the time the shard
        spent unreplicated (the largest, and the mean)."""
        rows = []
        for kind in KINDS:
            mine = [r for r in self.records if r.kind == kind]
            if not mine:
                continue
            gaps = ", ".join(f"{r.gap:.2f}" for r in mine)
            rows.append(f"{kind:>18}: {len(mine)} | longest ack gap "
                        f"{max(r.gap for r in mine):6.2f} s (each: {gaps}) | unreplicated max "
                        f"{max(r.unreplicated for r in mine):6.2f} s, mean "
                        f"{sum(r.unreplicated for r in mine) / len(mine):6.2f} s")
        return rows


def applied(pushers: Pushers, got: np.ndarray, init: np.ndarray, out: Outcome) -> None:
    """Lost, duplicated and stray pushes from the final parameters."""
    counts = np.rint(init - got).astype(np.int64)  # how often each element was moved
    odd = ((counts == 0) & (got != init)) | ((counts == 1) & (got != init - 1.0)) | \
        (counts < 0)  # a change that is no whole number of pushes
    ours = np.zeros(init.size, bool)
    for w, k in pushers.sent:
        for offset in pushers.offsets:
            ours[offset + pushers.element(w, k)] = True
    out.stray = int(np.count_nonzero(((counts != 0) & ~ours) | odd))
    for w, k in pushers.sent:
        times = [counts[offset + pushers.element(w, k)] for offset in pushers.offsets]
        out.duplicated += int(max(times) > 1)
        out.lost += int((w, k) in pushers.acked and min(times) == 0)


def run(tmp: Path, seed: int, faults: int | None = None, workers: int = 3,
        shards: int = 2, each: int = 0, fault_s: tuple[float, float] | None = None,
        rpc_timeout_s: float = 3.0, pace_s: float = 0.01) -> Outcome:
    """One run: `faults` faults (5-10 when None) of kinds drawn at random over `shards`
    replicated shards while `workers` push, or (`each`) every kind `each` times in a
    seeded order; `fault_s`: the range of pauses and cuts; its outcome."""
    rng = random.Random(seed)
    order = [k for k in KINDS for _ in range(each)]
    rng.shuffle(order)
    faults = len(order) if each else rng.randint(5, 10) if faults is None else faults
    params = initial_params("mlp", MODEL, dtype="float64")
    init = params.data.copy()
    out, pairs, watches, pushers = Outcome(), [], [], None
    try:
        pairs = [Pair(tmp, s, shards, random.Random(seed * 1009 + s), fault_s)
                 for s in range(shards)]
        watches = [RoleWatch(p.addresses) for p in pairs]
        servers = ",".join("|".join(p.addresses) for p in pairs)
        pushers = Pushers(servers, workers, params, shm=rng.random() < 0.5, pace_s=pace_s,
                          rpc_timeout_s=rpc_timeout_s)
        per_shard = [faults // shards + (s < faults % shards) for s in range(shards)]
        kinds = [order[s::shards] for s in range(shards)] if each else [None] * shards

        def strike(pair: Pair, n: int, given: list[str] | None) -> None:
            try:
                for i in range(n):
                    time.sleep(pair.rng.uniform(0.2, 1.0))
                    pair.inject(given[i] if given else pair.rng.choice(KINDS))
            except Exception as e:  # recorded: the run reports it
                out.errors.append(f"shard {pair.shard}: {e}")

        threads = [threading.Thread(target=strike, args=(p, n, given)) for p, n, given in
                   zip(pairs, per_shard, kinds, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.3)  # pushes after the last fault too
        pushers.stop()
        out.errors += pushers.errors
        for p in pairs:
            out.faults += p.faults
            primary, _ = p.heal()
            out.new_terms += status(p.slots[primary].address).term - 1
            out.restarted += p.restarted
            out.records += p.records
        done = pushers.finished == workers  # all steps pushed: no stall after the last
        attribute_gaps(pushers.times, out.records, None if done else pushers.stopped)
        if done:
            out.unmeasured = sum(r.start > pushers.times[-1] for r in out.records)
        out.acked = len(pushers.acked)
        reader = connect(servers, worker=workers, params=params, shm=False)
        try:
            got = np.empty(init.size, np.float64)
            reader.pull(got)
        finally:
            reader.close()
        applied(pushers, got, init, out)
    finally:
        out.split_brain = sum(w.stop() for w in watches)
        if pushers is not None and not pushers._stop.is_set():
            pushers.stop()
        for p in pairs:
            p.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="runs, each with its own seed")
    ap.add_argument("--seed", type=int, default=0, help="the first run's seed")
    ap.add_argument("--workers", type=int, default=3, help="worker threads per run")
    ap.add_argument("--faults", type=int, default=None,
                    help="faults per run (default: 5-10, drawn from the seed)")
    ap.add_argument("--each", type=int, default=0,
                    help="instead: every fault kind this many times per run, in a seeded order")
    ap.add_argument("--shards", type=int, default=2, help="replicated shards")
    ap.add_argument("--fault-s", type=float, nargs="+", default=None, metavar="S",
                    help="pauses and cuts last S s (or LOW HIGH: drawn between; default "
                         "0.3-3 s pauses, 0.5-3 s cuts)")
    ap.add_argument("--rpc-timeout-s", type=float, default=3.0,
                    help="the workers' call deadline (dtlab-worker's default: 120)")
    ap.add_argument("--pace-s", type=float, default=0.01,
                    help="each worker's pause between pushes (longer: its steps, one element "
                         "of the shard each, last longer)")
    args = ap.parse_args(argv)
    fault_s = None if args.fault_s is None else (args.fault_s[0], args.fault_s[-1])
    logging.getLogger("dtlab").setLevel(logging.ERROR)  # the failovers' warnings
    total = Outcome()
    with tempfile.TemporaryDirectory(prefix="dtlab-faults-") as tmp:
        for i in range(args.runs):
            seed = args.seed + i
            folder = Path(tmp) / f"run{i}"
            folder.mkdir()
            out = run(folder, seed, args.faults, args.workers, args.shards, args.each, fault_s,
                      args.rpc_timeout_s, args.pace_s)
            print(f"run {i} (seed {seed}): {out.line()}", flush=True)
            total.faults += out.faults
            for name in ("acked", "lost", "duplicated", "stray", "split_brain", "new_terms",
                         "restarted", "unmeasured"):
                setattr(total, name, getattr(total, name) + getattr(out, name))
            total.errors += out.errors
            total.records += out.records
    print(f"totals: runs {args.runs} | {total.line()}", flush=True)
    print(f"per fault kind (replica timeout {REPLICA_TIMEOUT_S:g} s, worker deadline "
          f"{args.rpc_timeout_s:g} s):", flush=True)
    for row in total.table():
        print(row, flush=True)
    bad = total.lost or total.duplicated or total.stray or total.split_brain or total.errors
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
