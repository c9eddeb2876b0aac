"""Parameter-server push and pull throughput next to plain gRPC streams of the same tensor.

    dtlab-bench pserver --json bench-pserver.json
    dtlab-bench pserver --tiny --json /tmp/bench.json    # a few seconds (the suite)
    dtlab-bench pserver --mode rounds --json rounds.json  # pull + push rounds

For every payload (float32, 1 MB to 64 MB), shard count S, optimizer and
worker count W, S shard daemons run as separate processes (the real
pserver.server.daemon.Daemon over a flat store of n elements, ASP) and W worker
processes (the real pserver.worker.client.PSClient) repeat, in lock-step rounds:

    push       every worker pushes its gradient to all shards in parallel;
               the reply comes after the server applied it (optimizer included)
    pull       worker 0 pushes (untimed) so the version moves, then every
               worker pulls all shards in full, in parallel
    ceiling    a plain gRPC stream of the same tensor: the sender makes each
               ~1 MiB message from the array as gRPC asks for it (one
               `tobytes()`, no framing, no checksum), to a trivial sink (client
               streaming) or from a trivial source (server streaming) on the
               same gRPC servers, with the same channel options: what moving
               this tensor over gRPC costs before the parameter server adds
               its own work (checksums, checks, the optimizer)
    transport  the same messages made beforehand and streamed as they are:
               gRPC's own limit, which no sender of fresh data reaches
               (making each message in-stream costs the core that keeps the
               stream going)

The three alternate round by round, so machine noise hits all alike.
A round's time is from the first worker's start to the last one's end
(CLOCK_MONOTONIC is shared by all processes); the table shows the median.
GB/s = W * bytes / time (GB = 1e9 B). The shards' own clocks (pserver
Stats, mean over shards) split a push: recv(ms), its stream from header to
checked trailer, of which check(ms) went to the per-chunk Adler-32 and
finiteness checks, and apply(ms), the optimizer's step (per update).

`--mode rounds` measures what one worker with one SGD shard does in a loop:
a pull and a push (a round), at 64 KB, 1 MB and 64 MB (`--round-sizes-kb`),
by every data path in turn, round by round, in the same launch:

    calls      a Pull call and a Push call per round (the path before sessions)
    session    both on the worker's long-lived Session stream, over gRPC
    fused      the session, each push carrying the next round's pull
               (PSClient.push_pull, as dtlab-worker runs): a round is one
               push_pull, one message each way for a tensor that fits one
    shm        fused, with the tensor bytes in shared memory
    generated  the session over gRPC with every message made and read by the
               generated protobuf classes instead of pserver.common.codec's hand codec,
               against a server doing the same

and prints each path's median round, pull and push times (a fused round has
no separate pull and push), rounds/s and its speed-up over `calls`, over a
base (shm over fused: what shared memory buys; session over generated: the
hand codec's gain, also for pull and push alone). `wrong` counts paths whose
final pull differs from the exact expected parameters (lr 1, gradients of
2^-12: every sum is exact in float32). `--launches N` runs the whole
measurement N times in fresh processes and prints the median of each column
over the launches (`--quiet`: that table alone).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from dtlab.lab.bench import harness
from dtlab.lab.bench.shards import CEILING, GRAD, MODEL, Servers, plain, prebuilt
from dtlab.models.config import (
    ConfigError,
    add_flags,
    build,
    choice,
    described,
    from_namespace,
    positive_list,
)
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.cli import run_cli
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.worker.client import PSClient

MB = 1 << 20


@dataclass
class BenchConfig:
    json: str = described("", "write the JSON {meta, rows} here")
    tiny: bool = described(False, "tiny sizes and few rounds: a smoke run (the test suite's)")
    mode: str = choice("sweep", "sweep", "rounds",
                       help="sweep: push/pull against plain gRPC; rounds: pull+push by data path")
    round_sizes_kb: str = described("64,1024,65536", "rounds mode: tensor sizes in KiB")
    sizes_mb: str = described("1,4,16,64", "sweep mode: tensor sizes in MiB")
    workers: str = described("1,2,4", "sweep mode: worker counts")
    shards: str = described("1,2", "sweep mode: shard counts")
    optimizers: str = described("sgd,adam", "sweep mode: server optimizers (sgd, adam, adamw)")
    rounds: int = described(0, "timed rounds per row (0: by size, 20 at 1 MB down to 11 at 64 MB)")
    warmup: int = described(1, "untimed rounds first")
    quiet: bool = described(False, "with --launches: print only the table of medians")

    def validate(self):
        for name in ("sizes_mb", "workers", "shards", "round_sizes_kb"):
            positive_list(self, name)
        unknown = set(self.optimizers.split(",")) - {"sgd", "adam", "adamw"}
        if unknown:
            raise ConfigError(f"--optimizers: unknown {', '.join(sorted(unknown))} "
                              "(sgd, adam, adamw)")


# -- worker processes -----------------------------------------------------------------------


class BenchWorker:
    """One worker's client, gradient and ceiling calls; driven over a pipe."""

    def __init__(self, wid: int, addresses: list[str], elements: int):
        self.wid = wid
        self.client = PSClient(build(ClientConfig, {"servers": ",".join(addresses)}))
        self.params = np.zeros(elements, np.float32)
        self.grad = np.full(elements, 1e-3, np.float32)
        self.step = self.client.connect(wid, MODEL, elements)
        self.client.pull(self.params)
        self.pool = ThreadPoolExecutor(len(addresses))
        self.plain = []  # per shard: channel, its slice of the gradient, prebuilt messages
        for s in self.client.shards:
            channel = grpc.insecure_channel(s.address, options=wire.transport_options(4 * MB))
            lo, n = s.info.meta.offset, s.info.meta.shape[0]
            part = self.grad[lo : lo + n]
            self.plain.append((channel, part, prebuilt(part)))

    def _each(self, fn) -> None:
        list(self.pool.map(fn, self.plain))

    def _sink(self, channel, messages) -> None:
        channel.stream_unary(f"/{CEILING}/Sink")(messages, timeout=120)

    def _drain(self, channel, method: str) -> None:
        for _ in channel.unary_stream(f"/{CEILING}/{method}")(b"", timeout=120):
            pass

    def push(self) -> None:
        self.client.push(self.grad, self.step)
        self.step += 1

    def pull(self) -> None:
        self.client.versions = [None] * len(self.client.shards)  # a full transfer each time
        self.client.pull(self.params)

    def ceiling_push(self) -> None:
        self._each(lambda p: self._sink(p[0], plain(p[1])))

    def transport_push(self) -> None:
        self._each(lambda p: self._sink(p[0], iter(p[2])))

    def ceiling_pull(self) -> None:
        self._each(lambda p: self._drain(p[0], "Source"))

    def transport_pull(self) -> None:
        self._each(lambda p: self._drain(p[0], "Prebuilt"))

    def stats(self) -> list[tuple[float, ...]]:
        """Per shard: the server's own time counters (s) and what they count."""
        return [(s.receive_seconds, s.check_seconds, s.pushes, s.apply_seconds, s.updates)
                for s in self.client.stats()]

    def close(self) -> None:
        for channel, *_ in self.plain:
            channel.close()
        self.client.close()
        self.pool.shutdown()


def worker_main(wid: int, conn, barriers: dict[int, mp.Barrier]) -> None:
    keep_freed_memory()  # as pserver's worker does
    worker = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "connect":
            if worker is not None:
                worker.close()
            worker = BenchWorker(wid, *args)
            conn.send("ok")
        elif cmd == "round":
            op, width = args
            barrier = barriers[width]
            barrier.wait()
            if op == "pull":  # move the version, so every pull is of fresh parameters
                if wid == 0:
                    worker.push()
                barrier.wait()
            t0 = time.perf_counter()
            getattr(worker, op)()
            conn.send((t0, time.perf_counter()))
        elif cmd == "stats":
            conn.send(worker.stats())
        elif cmd == "close":
            if worker is not None:
                worker.close()
            conn.send("bye")
            return


class Workers:
    """Worker processes, kept for the whole sweep; a barrier for each round width."""

    def __init__(self, widths: list[int]):
        ctx = mp.get_context("spawn")
        self.barriers = {w: ctx.Barrier(w) for w in widths}
        self.conns, self.procs = [], []
        for wid in range(max(widths)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(wid, child, self.barriers), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def ask(self, n: int, *msg, timeout: float = 300):
        for c in self.conns[:n]:
            c.send(msg)
        out = []
        for c in self.conns[:n]:
            if not c.poll(timeout):
                raise TimeoutError(f"bench worker gave no answer to {msg[0]} in {timeout} s")
            out.append(c.recv())
        return out

    def round(self, op: str, width: int) -> float:
        spans = self.ask(width, "round", op, width)
        return max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)

    def close(self) -> None:
        self.ask(len(self.conns), "close")
        for p in self.procs:
            p.join(timeout=30)


# -- the sweep ------------------------------------------------------------------------------


def rounds_for(nbytes: int, cfg: BenchConfig) -> int:
    """Rounds per measurement: medians of fewer than ~11 moved by 10 points between launches."""
    return cfg.rounds or max(11, min(20, (64 * MB) // max(1, nbytes) * 5 // 4))


def sequence(op: str) -> tuple[str, str, str]:
    """The round kinds measured together: the operation, its ceiling, its transport."""
    return op, f"ceiling_{op}", f"transport_{op}"


def warm_up(workers: Workers, op: str, width: int, warmup: int) -> None:
    """Untimed rounds: first-touch page faults, connection windows, snapshot caches."""
    for _ in range(warmup):
        for kind in sequence(op):
            workers.round(kind, width)


def measure(workers: Workers, op: str, width: int, rounds: int) -> list[float]:
    """Median round times of `op`, its ceiling and its transport, interleaved by round."""
    times = {kind: [] for kind in sequence(op)}
    for _ in range(rounds):
        for kind in reversed(sequence(op)):
            times[kind].append(workers.round(kind, width))
    return [statistics.median(times[kind]) for kind in sequence(op)]


SERVER_TIMES = ("receive_ms", "check_ms", "apply_ms")


def server_times(before: list[tuple], after: list[tuple]) -> dict:
    """Per push, the mean over shards of the servers' own clocks: receiving the stream
    (header to checked trailer), of which checking chunks, and the optimizer's apply."""
    per_shard = []
    for (r0, c0, p0, a0, u0), (r1, c1, p1, a1, u1) in zip(before, after, strict=True):
        pushes, updates = max(1, p1 - p0), max(1, u1 - u0)
        per_shard.append(((r1 - r0) / pushes, (c1 - c0) / pushes, (a1 - a0) / updates))
    return {name: 1e3 * statistics.mean(s[i] for s in per_shard)
            for i, name in enumerate(SERVER_TIMES)}


def row(op, nbytes, width, shards, optimizer, times, server: dict | None, rounds) -> dict:
    gbps, ceiling, transport = (width * nbytes / t / 1e9 for t in times)
    return {"op": op, "bytes": nbytes, "workers": width, "shards": shards,
            "optimizer": optimizer, "time_ms": times[0] * 1e3, "gbps": gbps,
            "ceiling_gbps": ceiling, "ratio": gbps / ceiling, "transport_gbps": transport,
            "transport_ratio": gbps / transport,
            **{name: server[name] if server else None for name in SERVER_TIMES},
            "updates_per_s": width / times[0], "rounds": rounds}


def ms_or_dash(key: str, spec: str = ".2f"):
    """A row's `key` as a cell: None (not measured on this path) prints "-"."""
    return lambda r: None if r[key] is None else format(r[key], spec)


SWEEP_TABLE = harness.Table(
    "W workers, S shards, opt the servers' optimizer; time = median of the rounds; GB/s = "
    "bytes / time; ceil = a plain gRPC stream of the same tensor in the same run (chunks made "
    "by tobytes); xport = the same stream of prebuilt messages (gRPC's own limit); %ceil, "
    "%xport = GB/s over them; recv, check, apply = the shards' own clocks for a push; upd/s "
    "= pushes applied per second",
    [harness.Column("op", 4, lambda r: r["op"]),
     harness.Column("size", 10, lambda r: r["bytes"]),
     harness.Column("W", 2, lambda r: r["workers"]),
     harness.Column("S", 2, lambda r: r["shards"]),
     harness.Column("opt", 5, lambda r: r["optimizer"]),
     harness.Column("time(ms)", 9, lambda r: r["time_ms"], ".2f"),
     harness.Column("GB/s", 7, lambda r: r["gbps"], ".3f"),
     harness.Column("ceil GB/s", 9, lambda r: r["ceiling_gbps"], ".3f"),
     harness.Column("%ceil", 6, lambda r: f"{100 * r['ratio']:.0f}%"),
     harness.Column("xport GB/s", 10, lambda r: r["transport_gbps"], ".3f"),
     harness.Column("%xport", 7, lambda r: f"{100 * r['transport_ratio']:.0f}%"),
     *(harness.Column(title, width, ms_or_dash(key)) for title, width, key in
       zip(("recv(ms)", "check(ms)", "apply(ms)"), (8, 9, 9), SERVER_TIMES, strict=True)),
     harness.Column("upd/s", 8, lambda r: r["updates_per_s"], ".1f")])


def sweep(cfg: BenchConfig) -> list[dict]:
    sizes = [int(s * MB) for s in positive_list(cfg, "sizes_mb")]
    widths, shard_counts = positive_list(cfg, "workers"), positive_list(cfg, "shards")
    optimizers = [o.strip() for o in cfg.optimizers.split(",") if o.strip()]
    workers = Workers(widths)
    rows = []
    print(SWEEP_TABLE.head(), flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-pserver-") as tmp:
            for nbytes in sizes:
                for shards in shard_counts:
                    for optimizer in optimizers:
                        servers = Servers(nbytes // 4, shards, optimizer, Path(tmp))
                        try:
                            workers.ask(len(workers.conns), "connect", servers.addresses,
                                        nbytes // 4)
                            for width in widths:
                                rows += run_one(workers, cfg, nbytes, width, shards, optimizer)
                        finally:
                            servers.stop()
    finally:
        workers.close()
    return rows


def run_one(workers: Workers, cfg: BenchConfig, nbytes: int, width: int, shards: int,
            optimizer: str) -> list[dict]:
    rounds = rounds_for(nbytes, cfg)
    warm_up(workers, "push", width, cfg.warmup)
    before = workers.ask(1, "stats")[0]
    times = measure(workers, "push", width, rounds)
    after = workers.ask(1, "stats")[0]
    out = [row("push", nbytes, width, shards, optimizer, times, server_times(before, after),
               rounds)]
    print(SWEEP_TABLE.line(out[-1]), flush=True)
    if optimizer == _first_optimizer(cfg):  # a pull does not involve the optimizer
        warm_up(workers, "pull", width, cfg.warmup)
        times = measure(workers, "pull", width, rounds)
        out.append(row("pull", nbytes, width, shards, optimizer, times, None, rounds))
        print(SWEEP_TABLE.line(out[-1]), flush=True)
    return out


def _first_optimizer(cfg: BenchConfig) -> str:
    return cfg.optimizers.split(",")[0].strip()


# -- rounds: one worker's pull + push by data path --------------------------------------------


PATHS = {  # name: (server codec, PSClient keyword arguments, push_pull rounds)
    "calls": ("hand", {"transport": "calls", "shm": False}, False),
    "session": ("hand", {"transport": "session", "shm": False}, False),
    "fused": ("hand", {"transport": "session", "shm": False}, True),
    "shm": ("hand", {"transport": "session", "shm": True}, True),
    "generated": ("generated", {"transport": "session", "shm": False,
                                "codec": wire.CODECS["generated"]}, False),
    "fp16": ("hand", {"transport": "session", "shm": False, "wire_dtype": "fp16"}, True),
    "bf16": ("hand", {"transport": "session", "shm": False, "wire_dtype": "bf16"}, True),
}
HALF = ("fp16", "bf16")  # the --wire paths, each with a shard of its own
# the path each one's "x base" is over
BASE = {"shm": "fused", "session": "generated", "fp16": "fused", "bf16": "fused"}
# A half wire's paths each have a shard of their own and push 0.1 rounded to their dtype:
# exact in float32 for every k * g here, and rarely a half value, so a pull rounds.
HALF_GRAD = 0.1


class RoundClient:
    """One path's client: a pull then a push per round, each timed; or (fused) one
    push_pull per round, after a first pull."""

    def __init__(self, path: str, address: str, elements: int):
        self.path, self.fused = path, PATHS[path][2]
        self.client = PSClient(build(ClientConfig, {"servers": address}), **PATHS[path][1])
        self.step = self.client.connect(0, MODEL, elements)
        self.params = np.zeros(elements, np.float32)
        wire_dtype = self.client.wire
        self.g = GRAD if wire_dtype is None else float(np.float32(HALF_GRAD).astype(wire_dtype))
        self.grad = np.full(elements, self.g, np.float32)
        if self.fused:
            self.client.pull(self.params)

    def round(self) -> tuple[float, float]:
        """(pull, push) seconds; a fused round's time is all under push."""
        t0 = time.perf_counter()
        if self.fused:
            self.client.push_pull(self.grad, self.step, self.params)
            self.step += 1
            return 0.0, time.perf_counter() - t0
        self.client.pull(self.params)
        t1 = time.perf_counter()
        self.client.push(self.grad, self.step)
        self.step += 1
        return t1 - t0, time.perf_counter() - t1

    def check(self) -> tuple[int, float]:
        """(wrong, error): wrong is 1 if the parameters pulled now are not exactly
        -pushes * g (a half wire: that value rounded once to its dtype), or if the shm
        path did not use shared memory (or another path did); error is the pulled values'
        largest relative difference from -pushes * g (0 but for a half wire)."""
        self.client.pull(self.params)
        pushes = self.client.stats()[0].pushes
        uses_shm = self.client.shards[0].shared_memory
        exact = np.float32(-pushes * self.g)
        sent = exact if self.client.wire is None else exact.astype(self.client.wire)
        wrong = not np.array_equal(self.params, np.float32(sent) + 0 * self.params)
        return (int(wrong or uses_shm != (self.path == "shm")),
                float(np.abs(self.params - exact).max() / abs(exact)))

    def wire_bytes(self) -> int:
        """Tensor bytes pushed and pulled so far (values as they travel)."""
        return self.client.pushed_bytes + self.client.pulled_bytes

    def close(self) -> None:
        self.client.close()


def round_count(nbytes: int, cfg: BenchConfig) -> int:
    return cfg.rounds or max(11, min(200, (256 * MB) // max(1, nbytes) // 4))


def rounds_mode(cfg: BenchConfig) -> list[dict]:
    keep_freed_memory()  # this process runs the workers' clients: as pserver's worker does
    rows = []
    print(ROUNDS_TABLE.head(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-pserver-") as tmp:
        for kb in positive_list(cfg, "round_sizes_kb"):
            nbytes = int(kb * 1024)
            rows += rounds_at(nbytes, cfg, Path(tmp))
    return rows


def rounds_at(nbytes: int, cfg: BenchConfig, tmp: Path) -> list[dict]:
    elements = nbytes // 4
    servers = {key: Servers(elements, 1, "sgd", tmp, codec="hand" if key in HALF else key,
                            lr=1.0, name=key) for key in ("hand", "generated", *HALF)}
    clients = {}
    try:
        for path, (codec, *_) in PATHS.items():
            key = path if path in HALF else codec
            clients[path] = RoundClient(path, servers[key].addresses[0], elements)
        times = {path: [] for path in PATHS}
        for _ in range(cfg.warmup):
            for c in clients.values():
                c.round()
        moved = {path: c.wire_bytes() for path, c in clients.items()}
        for _ in range(round_count(nbytes, cfg)):
            for path, c in clients.items():
                times[path].append(c.round())
        moved = {path: (c.wire_bytes() - moved[path]) / len(times[path])
                 for path, c in clients.items()}
        checks = {path: c.check() for path, c in clients.items()}
        wrong = sum(w for w, _ in checks.values())
    finally:
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop()
    medians = {path: [statistics.median(t[i] for t in ts) for i in range(2)] +
               [statistics.median(a + b for a, b in ts)] for path, ts in times.items()}
    out = []
    for path, (pull, push, rnd) in medians.items():
        base, split = BASE.get(path), not PATHS[path][2]
        out.append({"mode": "rounds", "bytes": nbytes, "path": path, "round_ms": 1e3 * rnd,
                    "pull_ms": 1e3 * pull if split else None,
                    "push_ms": 1e3 * push if split else None, "rounds_per_s": 1 / rnd,
                    "x_calls": medians["calls"][2] / rnd,
                    "x_base": None if base is None else medians[base][2] / rnd,
                    **_codec(medians, path == "session"),
                    "wire_bytes_per_round": moved[path], "error": checks[path][1],
                    "rounds": len(times[path]), "wrong": wrong})
        print(ROUNDS_TABLE.line(out[-1]), flush=True)
    return out


CODEC_KEYS = ("codec_pull", "codec_push", "codec_round")


def _codec(medians: dict, session: bool) -> dict:
    """The session row's hand codec speed-up over the generated classes, time(generated) /
    time(hand), for pull, push and round (None on the other paths' rows)."""
    return {key: medians["generated"][i] / medians["session"][i] if session else None
            for i, key in enumerate(CODEC_KEYS)}


ROUNDS_TABLE = harness.Table(
    "size: tensor bytes; path: see --help; round/pull/push: median ms (fused and shm: one "
    "push_pull per round); rounds/s = 1/round; x calls: rounds/s over the calls path of the "
    "same run; x base: shm over fused, session over generated (the hand codec's gain; pull "
    "and push ratios in cdc pull/push), fp16 and bf16 over fused (--wire: what half the "
    "bytes buy); MB/rnd: tensor bytes a round moved, pushed and pulled (1e6 B); error: the "
    "final pull's largest relative difference from the exact float32 parameters (a half "
    "wire's rounding); wrong: paths with wrong final parameters",
    [harness.Column("size", 8, lambda r: r["bytes"]),
     harness.Column("path", 9, lambda r: r["path"]),
     harness.Column("round", 9, lambda r: r["round_ms"], ".3f"),
     harness.Column("pull", 8, ms_or_dash("pull_ms", ".3f")),
     harness.Column("push", 8, ms_or_dash("push_ms", ".3f")),
     harness.Column("rounds/s", 9, lambda r: r["rounds_per_s"], ".1f"),
     harness.Column("x calls", 7, lambda r: r["x_calls"], ".2f"),
     harness.Column("x base", 6, ms_or_dash("x_base")),
     harness.Column("cdc pull", 8, ms_or_dash(CODEC_KEYS[0])),
     harness.Column("cdc push", 8, ms_or_dash(CODEC_KEYS[1])),
     harness.Column("MB/rnd", 8, lambda r: r["wire_bytes_per_round"] / 1e6, ".3f"),
     harness.Column("error", 8, lambda r: r["error"], ".1e"),
     harness.Column("wrong", 5, lambda r: r["wrong"])])


def launches(cfg: BenchConfig, k: int, argv: list[str]) -> list[dict]:
    """The rounds measurement run `k` times, each in a fresh process; rows of the median
    of every number over the launches (`wrong`: the most of any launch)."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-pserver-") as tmp:
        for i in range(k):
            out = Path(tmp) / f"launch-{i}.json"
            subprocess.run([sys.executable, "-m", "dtlab.lab.bench.pserver", *argv,
                            "--launches", "1", "--no-quiet", "--json", str(out)], check=True,
                           stdout=subprocess.DEVNULL if cfg.quiet else None)
            runs.append(harness.read(out)[1])
    print(f"# median of {k} launches")
    print(ROUNDS_TABLE.head(), flush=True)
    rows = []
    for same in zip(*runs, strict=True):
        row = {**same[0], "launches": k, "wrong": max(r["wrong"] for r in same)}
        for key in ("round_ms", "pull_ms", "push_ms", "rounds_per_s", "x_calls", "x_base",
                    *CODEC_KEYS):
            if row[key] is not None:
                row[key] = statistics.median(r[key] for r in same)
        rows.append(row)
        print(ROUNDS_TABLE.line(row), flush=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(parser, BenchConfig, "benchmark")
    harness.launch_flags(parser, "rounds mode: run it this many times in fresh processes "
                         "and report the median over them", default_launches=1)
    ns = parser.parse_args(argv)
    if ns.launches < 1:
        parser.error(f"--launches {ns.launches}: must be at least 1")
    cfg = from_namespace(BenchConfig, ns)
    if cfg.tiny:
        cfg.sizes_mb, cfg.workers, cfg.shards, cfg.rounds = "0.25", "1,2", "2", cfg.rounds or 2
        cfg.round_sizes_kb = "64,256"
    if ns.launches > 1 and cfg.mode == "rounds":
        rows = launches(cfg, ns.launches, [a for a in argv if a not in ("--quiet",)])
    else:
        rows = sweep(cfg) if cfg.mode == "sweep" else rounds_mode(cfg)
    if cfg.json:
        harness.write(cfg.json, "pserver", rows, grpcio=grpc.__version__, **asdict(cfg),
                      launches=ns.launches)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
