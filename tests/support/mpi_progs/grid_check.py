"""Process grids of this world size: coordinates, communicators, flat names.

    mpiexec -n 8 python -m mpi4py tests/support/mpi_progs/grid_check.py

For every grid shape whose product is the world size, each rank checks its
coordinates against rank = ((dp * pp + pp_i) * ep + ep_i) * tp + tp_i, that
each dimension's communicator holds exactly the ranks that differ only in
that coordinate (gathered through the communicator itself), the pipeline
neighbours (a message passed down the pipeline), and a tp all-reduce; then
that bad shapes raise GridError with a clear message. Rank 0 prints
"PASS grid <number of grids>".
"""

from __future__ import annotations

import itertools

import numpy as np

from dtlab.collective import GridError, ProcessGrid, world

SHAPES = [
    {"dp": 2, "pp": 2, "tp": 2},
    {"pp": 2, "tp": 2, "ep": 2},
    {"dp": None, "tp": 4},
    {"dp": None, "ep": 2, "tp": 2},
    {"dp": None},
    {"tp": 8},
    {"pp": 4, "tp": 2},
    {"dp": 2, "pp": 2},
    {"dp": 1, "pp": 1, "tp": 1, "ep": 1},
]

comm = world(timeout=60)
N, R = comm.size, comm.rank


def members(g: ProcessGrid, varying: tuple[str, ...]) -> list[int]:
    """World ranks that share every coordinate of g except those in `varying`."""
    sizes = {"dp": g.dp_size, "pp": g.pp_size, "ep": g.ep_size, "tp": g.tp_size}
    ranges = [range(sizes[d]) if d in varying else [g.coords[d]] for d in ("dp", "pp", "ep", "tp")]
    return sorted(g.rank_of(*c) for c in itertools.product(*ranges))


def check_grid(shape: dict) -> None:
    g = ProcessGrid(comm=comm, **shape)
    sizes = (g.dp_size, g.pp_size, g.ep_size, g.tp_size)
    assert np.prod(sizes) == N, (shape, sizes)
    expect = ((g.dp_rank * g.pp_size + g.pp_rank) * g.ep_size + g.ep_rank) * g.tp_size + g.tp_rank
    assert expect == R == g.rank_of(g.dp_rank, g.pp_rank, g.ep_rank, g.tp_rank), (shape, g)
    assert g.tp_rank == R % g.tp_size, "tp must vary fastest"
    dims = {
        ("dp",): g.dp_comm, ("pp",): g.pp_comm, ("ep",): g.ep_comm, ("tp",): g.tp_comm,
        ("dp", "ep"): g.dp_ep_comm,
    }
    for varying, sub in dims.items():
        want = members(g, varying)
        got = sub.allgather(np.array([R], dtype=np.int64)).tolist()
        assert got == want, f"{shape} rank {R}: {varying} comm holds {got}, want {want}"
        if len(varying) == 1:
            coord = getattr(g, f"{varying[0]}_rank")
            assert sub.rank == coord and sub.size == len(want), (shape, varying, sub)
    assert g.pp_is_first_stage == (g.pp_rank == 0)
    assert g.pp_is_last_stage == (g.pp_rank == g.pp_size - 1)
    assert g.pp_next == (None if g.pp_is_last_stage else g.pp_rank + 1)
    assert g.pp_prev == (None if g.pp_is_first_stage else g.pp_rank - 1)
    token = np.array([-1.0])
    if g.pp_prev is not None:
        g.pp_comm.recv(token, g.pp_prev)
        assert token[0] == g.pp_rank - 1, (shape, token)
    if g.pp_next is not None:
        g.pp_comm.send(np.array([float(g.pp_rank)]), g.pp_next)
    total = g.tp_comm.allreduce(np.array([float(R)]))
    assert total[0] == sum(members(g, ("tp",))), (shape, total)
    assert (g.local_rank, g.local_size) == (R, N), "one node: local rank is the world rank"
    g.free()


def check_errors() -> None:
    bad = [
        ({"dp": 3, "tp": 2}, f"grid dp=3 x pp=1 x ep=1 x tp=2 = 6 ranks, but the world has {N}"),
        ({"tp": 3 if N % 3 else 5}, "does not divide the world's"),
        ({"tp": 0}, "tp=0 must be a positive integer"),
    ]
    for shape, text in bad:
        try:
            ProcessGrid(comm=comm, **shape)
        except GridError as e:
            assert text in str(e), (shape, str(e))
        else:
            raise AssertionError(f"no GridError for {shape} on {N} ranks")


if __name__ == "__main__":
    fitting = [s for s in SHAPES if N % int(np.prod([v or 1 for v in s.values()])) == 0
               and (None in s.values() or int(np.prod(list(s.values()))) == N)]
    for shape in fitting:
        check_grid(shape)
    check_errors()
    assert ProcessGrid(comm=comm).select_device("cpu") is np
    if R == 0:
        print(f"PASS grid {len(fitting)}")
