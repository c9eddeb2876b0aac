"""What every benchmark shares, after nccl-tests' common.cu: each benchmark file defines
its operation and its baseline, the harness the rest.

    flags         --tiny and --json PATH on every benchmark (`common_flags`), --launches K
                  and --ranks LIST where a benchmark launches itself several times or over
                  several world sizes (`launch_flags`, the one parser of both: a test checks
                  that no benchmark declares them by hand)
    environment   one record of where and how it ran: host, CPU model and cores, Python,
                  NumPy, BLAS, the MPI library where MPI is used, the command line, the date
    JSON          {"meta": environment + the run's settings, "rows": [flat dict, ...]} for
                  every benchmark: `write` checks the rows flat (values are numbers, strings,
                  booleans, None or lists of those), `read` is the one reader (the
                  calibration's too); a benchmark with several tables tags each row's "table"
    table         nccl-tests' layout: a "# legend:" line, a "#" header of right-aligned
                  column titles, one line per row (`Table`)
    closing line  nccl-tests' "# Out of bounds values : N OK|FAILED" over the rows' #wrong
    timing        functions timed in turn (`alternate_times`), so that a slow spell of a
                  shared machine falls on all of them
    all-reduce    the exact-sum check and the iteration count of the all-reduce benchmarks
    trainers      what a trainer does first (`start`) and one step of its compute
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_info

from dtlab.models import backend
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.threads import share_cores

SCALARS = (str, int, float, bool, type(None))


# -- flags ------------------------------------------------------------------------------------


def common_flags(p: argparse.ArgumentParser, tiny: str, json_help: str = "write the JSON "
                 "{meta, rows} here") -> None:
    """--tiny (`tiny` says what it runs) and --json PATH."""
    p.add_argument("--tiny", action="store_true", help=tiny)
    p.add_argument("--json", metavar="PATH", default="", help=json_help)


def parse_bytes(text: str) -> int:
    """'4K' -> 4096, '64M' -> 67108864, '123' -> 123."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_list(text: str, what: str, choices=None) -> list[str]:
    """A comma-separated list, every item among `choices` when given."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if choices is not None and x not in choices]
    if not items or bad:
        raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list of "
                                         f"{choices or 'values'}, not {text!r}")
    return items


def parse_ranks(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: world sizes, each a positive integer."""
    items = parse_list(text, "--ranks")
    if not all(x.isdigit() and int(x) >= 1 for x in items):
        raise argparse.ArgumentTypeError(f"--ranks must be positive integers, not {text!r}")
    return [int(x) for x in items]


# set on the actions `launch_flags` adds, so that a test can tell them from hand-rolled ones
FROM_HARNESS = "dtlab_harness"


def launch_flags(p: argparse.ArgumentParser, launches: str | None,
                 ranks: str | None = None, default_launches: int = 0) -> None:
    """--launches K (the median over K launches; `default_launches` when not given, 0: one
    run in this process) where `launches` says what it does, and with `ranks` its default,
    --ranks LIST (world sizes, `parse_ranks`). Both actions marked FROM_HARNESS."""
    actions = []
    if launches is not None:
        actions.append(p.add_argument("--launches", type=int, default=default_launches,
                                      help=f"{launches} (default {default_launches})"))
    if ranks is not None:
        actions.append(p.add_argument("--ranks", default=parse_ranks(ranks), type=parse_ranks,
                                      help=f"world sizes, comma-separated (default: {ranks})"))
    for action in actions:
        setattr(action, FROM_HARNESS, True)


# -- the environment record -------------------------------------------------------------------


def cpu_name() -> str:
    """The processor's model name (Linux /proc/cpuinfo), else platform's word for it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_record() -> dict:
    """The BLAS NumPy runs (threadpoolctl) and the OpenBLAS variables that would change
    which kernels it picks and how long its idle threads spin: recorded, never set here
    (models/__init__.py sets the spin's default before NumPy loads)."""
    libs = [{key: lib.get(key) for key in ("internal_api", "version", "architecture",
                                          "num_threads", "threading_layer", "filepath")}
            for lib in threadpool_info() if lib.get("user_api") == "blas"]
    env = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                      "OPENBLAS_VERBOSE", "OPENBLAS_THREAD_TIMEOUT")
           if k in os.environ}
    return {"libraries": libs, "environment": env}


def describe_blas(blas: dict) -> str:
    numpy_libs = [lib for lib in blas["libraries"] if "numpy" in (lib["filepath"] or "")]
    words = ", ".join(f"{lib['internal_api']} {lib['version']} {lib['architecture']} kernels"
                      for lib in numpy_libs or blas["libraries"][:1]) or "none found"
    env = " ".join(f"{k}={v}" for k, v in blas["environment"].items())
    return f"NumPy's BLAS: {words}" + (f" (set in the environment: {env})" if env else "")


def mpi_library() -> str:
    """The MPI library's version line. A process that has not started MPI reads it without
    starting it (MPI_Get_library_version may be called before MPI_Init), and then cannot
    start it: a launcher's process, whose ranks are other processes."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()


def environment(bench: str, mpi: bool = False) -> dict:
    """Where and how the benchmark `bench` ran; `mpi`: it uses MPI (its library recorded)."""
    record = {
        "bench": bench, "command": shlex.join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpu": cpu_name(), "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)), "machine": platform.machine(),
        "python": platform.python_version(), "numpy": np.__version__, "blas": blas_record(),
        "load_average": os.getloadavg(),
    }
    if mpi:
        record["mpi"] = mpi_library()
    return record


# -- the one JSON shape -----------------------------------------------------------------------


def _flat(value) -> bool:
    return isinstance(value, SCALARS) or (isinstance(value, list | tuple)
                                          and all(isinstance(v, SCALARS) for v in value))


def flatten(prefix: str, mapping: dict) -> dict:
    """{"prefix.key": value} of a dict of scalars, for a flat row."""
    return {f"{prefix}.{k}": v for k, v in mapping.items()}


def nested(row: dict, prefix: str) -> dict:
    """The dict that `flatten(prefix, ...)` spread into `row`."""
    start = f"{prefix}."
    return {k[len(start):]: v for k, v in row.items() if k.startswith(start)}


def check_rows(rows: list[dict]) -> None:
    """Every row a flat dict: a ValueError naming the first key that is not."""
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"row {i} is a {type(row).__name__}, not a dict")
        bad = next((k for k, v in row.items() if not _flat(v)), None)
        if bad is not None:
            raise ValueError(f"row {i}: {bad!r} is not flat (a number, string, boolean, None "
                             "or a list of those)")


def save(path: str | os.PathLike, meta: dict, rows: list[dict]) -> None:
    """{"meta": meta, "rows": rows} at `path`, the rows checked flat first."""
    check_rows(rows)
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def write(path: str | os.PathLike, bench: str, rows: list[dict], mpi: bool = False,
          **settings) -> None:
    """The benchmark's JSON at `path`: meta = the environment record, then `settings`."""
    save(path, {**environment(bench, mpi), **settings}, rows)


def read(path: str | os.PathLike) -> tuple[dict, list[dict]]:
    """(meta, rows) of a benchmark's JSON; a ValueError saying why a file is not one."""
    data = json.loads(Path(path).read_text())
    if not (isinstance(data, dict) and isinstance(data.get("meta"), dict)
            and isinstance(data.get("rows"), list)):
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"not a benchmark's JSON {{meta, rows}} (found {keys}; files from "
                         "before the one shape: run the benchmark again)")
    return data["meta"], data["rows"]


def tables(rows: list[dict], table: str) -> list[dict]:
    """The rows of one of a benchmark's tables (rows tagged "table": `table`)."""
    return [r for r in rows if r.get("table") == table]


@dataclass(frozen=True)
class Column:
    """One column: its title, width, the value a row shows in it and that value's format
    (None prints "-"), aligned right (`align` ">") or left ("<")."""

    title: str
    width: int
    value: Callable[[dict], object]
    spec: str = ""
    align: str = ">"


class Table:
    """nccl-tests' table: `legend` (what the columns mean), the titles, one line a row."""

    def __init__(self, legend: str, columns: list[Column]):
        self.legend, self.columns = legend, columns

    def head(self) -> str:
        titles = " ".join(f"{c.title:{c.align}{c.width}}" for c in self.columns)
        return f"# legend: {self.legend}\n# {titles}"

    def line(self, row: dict) -> str:
        cells = []
        for c in self.columns:
            value = c.value(row)
            cells.append(f"{'-' if value is None else format(value, c.spec):{c.align}{c.width}}")
        return "  " + " ".join(cells)


def closing(rows: list[dict]) -> int:
    """Print nccl-tests' closing line over the rows' #wrong; the exit status (1: wrong)."""
    wrong = sum(r.get("wrong", 0) for r in rows)
    print(f"# Out of bounds values : {wrong} {'OK' if not wrong else 'FAILED'}")
    return 1 if wrong else 0


# -- timing -----------------------------------------------------------------------------------


# how long the untimed calls before a settled timed call last at least: PyTorch's OpenMP
# worker spins about 11 ms after its last parallel region (torch 2.13 on the 2-vCPU AMD
# EPYC: its run time while the caller slept, /proc/<tid>/schedstat), and a call of the other
# library in that time competes with it for a core (a 3.4 ms dtlab Linear ran 9-11 ms)
SETTLE_S = 0.03


def alternate_times(fns, reps: int, warmup: int, settle: bool = False) -> list[list[float]]:
    """Seconds of each of `fns` over `reps` rounds after `warmup`, the functions taking
    turns within a round, so that a slow spell of the machine falls on all of them. With
    `settle` each timed call follows untimed ones of the same function for at least
    SETTLE_S: the threads of the library that ran before (OpenBLAS's, PyTorch's OpenMP
    pool) have stopped spinning and its own are awake, as in a process that runs only one
    of them."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    backend.synchronize()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times, strict=True):
            if settle:
                began = time.perf_counter()
                while True:
                    fn()
                    backend.synchronize()
                    if time.perf_counter() - began >= SETTLE_S:
                        break
            t0 = time.perf_counter()
            fn()
            backend.synchronize()
            out.append(time.perf_counter() - t0)
    return times


def slowest(comm, fn, calls: int = 1) -> float:
    """Mean seconds per call of `fn()` over `calls` calls on the slowest rank of `comm` (a
    Communicator), the ranks started together."""
    from mpi4py import MPI

    comm.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return comm.mpi.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


# -- all-reduce: how often to call it, and its exact-sum check --------------------------------

MOVED_PER_SIZE = 64 << 20
# Communicator.ours_for's names, as the tables print them
VIA = {"doubling": "rd", "halving": "hd", "ring": "ring", "shm-one-shot": "shm1",
       "shm-two-shot": "shm2"}


def iterations(nbytes: int, tiny: bool) -> int:
    """Calls per timing of an all-reduce of `nbytes`: about 64 MB moved, 3 to 1000."""
    return 5 if tiny else max(3, min(1000, MOVED_PER_SIZE // nbytes))


def count_wrong(comm, algo: str, buf: np.ndarray) -> int:
    """Elements of one all-reduce by `algo` (Communicator.allreduce's: "ours", "naive"; or
    "mpi": MPI_Allreduce) unlike the exact sum, over all ranks: inputs x_r[i] = (r + 1)
    (1 + i mod 3), whose sum is exact in float."""
    from mpi4py import MPI

    n, idx = comm.size, np.arange(buf.size)
    buf[:] = (comm.rank + 1) * (1 + idx % 3)
    if algo == "mpi":
        comm.mpi.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        comm.allreduce(buf, algo=algo)
    expected = (n * (n + 1) // 2) * (1 + idx % 3)
    return comm.mpi.allreduce(int(np.count_nonzero(buf != expected)), op=MPI.SUM)


# -- trainers ---------------------------------------------------------------------------------


def start(prog: str):
    """What every trainer does first (freed memory kept, the cores shared) and the device's
    name: (threads, device), or None after printing why there is no device."""
    keep_freed_memory()
    threads = share_cores()
    try:
        return threads, backend.device_name()
    except backend.DeviceError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None


def trainer_step(session, role: str):
    """One step of a trainer's own compute, as `role` times it in compute_s: the batch,
    forward and backward, the gradient norm, and for a sync "rank" the optimizer (a
    "worker"'s servers run it: pserver/worker/loop.py)."""
    s = session

    def step() -> None:
        s.replica.compute_grads(s.loader.next())
        apply, _ = s.replica.finish_grads()
        if apply:
            s.model.clip_grad_norm(s.params, s.setup.optim.clip)
            if role == "rank":
                s.optimizer.step(s.params.data, s.params.grad, s.schedule(0))
    return step
