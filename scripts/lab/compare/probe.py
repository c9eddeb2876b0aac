"""The links between a comparison's hosts, measured at its start (one rank per host):

    mpiexec -hosts a,b -n 2 python -m dtlab.lab.compare.probe OUT/links.json

MPI: MPI_Allreduce of 8 bytes (its median time is the latency, alpha) and of
4 MiB (the ring's bus bandwidth 2 (N - 1) / N x bytes / time, the beta the
simulator's alpha-beta link takes: Hockney 1994; Thakur et al. 2005). gRPC: rank
0 serves a generic bytes method on the address its hosts reach
(pserver.common.rendezvous.bind_address), every other rank calls it: the median
round trip of an 8-byte call, and the rate of 4 MiB requests (answered by 8 bytes),
as a worker's push meets a shard. Rank 0 writes one JSON file.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent import futures

import grpc
import numpy as np
from mpi4py import MPI

from dtlab.pserver.common.rendezvous import bind_address

SMALL, LARGE = 8, 4 << 20  # bytes
REPEATS_SMALL, REPEATS_LARGE = 50, 5
METHOD = "/dtlab.probe.v1.Probe/Sink"


def timed(fn, repeats: int) -> float:
    """The median seconds of `fn()` over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def allreduce(comm) -> dict:
    n = comm.size
    small, large = np.zeros(SMALL // 8), np.zeros(LARGE // 8)  # float64: (1,), (524288,)

    def run(buf):
        comm.Barrier()
        comm.Allreduce(MPI.IN_PLACE, buf)

    alpha, t_large = timed(lambda: run(small), REPEATS_SMALL), timed(lambda: run(large),
                                                                     REPEATS_LARGE)
    bus = 2 * (n - 1) / n * LARGE / t_large if n > 1 else float("inf")
    return {"ranks": n, "small_bytes": SMALL, "small_s": alpha, "large_bytes": LARGE,
            "large_s": t_large, "bus_gbit": bus * 8 / 1e9}


def grpc_probe(comm, hosts: list[str]) -> list[dict]:
    """Rank 0 serves; every other rank measures its link to it, one after the other."""
    server, address = None, None
    if comm.rank == 0:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[
            ("grpc.max_receive_message_length", 2 * LARGE)])
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"k" * SMALL)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "dtlab.probe.v1.Probe", {"Sink": handler})])
        host = bind_address(None, "", sorted({h for h in hosts if h != hosts[0]}))
        address = f"{host}:{server.add_insecure_port(f'{host}:0')}"
        server.start()
    address = comm.bcast(address)
    rows = []
    for peer in range(1, comm.size):
        if comm.rank == peer:
            rows.append(grpc_link(address, hosts[peer], hosts[0]))
        comm.Barrier()
    gathered = comm.gather(rows)
    if server is not None:
        server.stop(0)
    return [r for part in gathered or [] for r in part]


def grpc_link(address: str, here: str, there: str) -> dict:
    """This host's link to the probe's server at `address` (on host `there`)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD)
        small, large = b"x" * SMALL, b"x" * LARGE
        rtt = timed(lambda: call(small, timeout=30), REPEATS_SMALL)
        t = timed(lambda: call(large, timeout=60), REPEATS_LARGE)
    return {"from": here, "to": there, "address": address, "rtt_s": rtt, "large_bytes": LARGE,
            "large_s": t, "gbit": LARGE * 8 / t / 1e9}


def describe(links: dict) -> str:
    """The probe's result in words, for the report's header."""
    m = links["mpi"]
    text = (f"MPI all-reduce over {m['ranks']} hosts: 8 B in {m['small_s'] * 1e6:.0f} us, "
            f"4 MiB in {m['large_s'] * 1e3:.1f} ms ({m['bus_gbit']:.2f} Gbit/s bus)")
    for r in links["grpc"]:
        text += (f"; gRPC {r['from']} -> {r['to']}: {r['rtt_s'] * 1e6:.0f} us round trip, "
                 f"{r['gbit']:.2f} Gbit/s")
    return text


def main(path: str) -> None:
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(MPI.Get_processor_name())
    if len(set(hosts)) != len(hosts):
        raise SystemExit(f"probe: two ranks on one host ({hosts}): one rank per host")
    links = {"hosts": hosts, "mpi": allreduce(comm), "grpc": grpc_probe(comm, hosts)}
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump(links, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
