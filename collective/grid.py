"""The process grid: world ranks arranged as dp x pp x ep x tp.

    grid = ProcessGrid(dp=2, pp=2, tp=2)          # 8 ranks
    grid.select_device()                           # GPU local_rank % n_gpus, or NumPy
    grid.tp_comm.allreduce(y)                      # Megatron's g operator
    if not grid.pp_is_last_stage:
        grid.pp_comm.send(h, grid.pp_next)

Rank order, fastest-varying first: tp, ep, pp, dp:

    world rank = ((dp_rank * pp + pp_rank) * ep + ep_rank) * tp + tp_rank

    8 ranks, dp=2 pp=2 tp=2:   rank  0 1 2 3 4 5 6 7
                               tp    0 1 0 1 0 1 0 1
                               pp    0 0 1 1 0 0 1 1
                               dp    0 0 0 0 1 1 1 1

tp varies fastest, as in Megatron-LM (Shoeybi et al. 2019), because a
tensor-parallel group all-reduces activations in every layer, forward and
backward: consecutive ranks share a node (`mpiexec -ppn`, `srun` fill nodes
in rank order), so that traffic stays on the fastest links. ep comes next
(an all-to-all per MoE layer), then pp (one activation send per
micro-batch), and dp varies slowest: its gradient all-reduce happens once
per step, in buckets overlapped with backward, and tolerates the slowest
links. (Megatron-Core's default order puts pp outermost instead, "tp-cp-ep-
dp-pp"; with dp outermost here a pipeline stays inside a node group, which
suits small pipelines on nodes of 4-8 GPUs.)

Every sub-communicator is built once, by `MPI_Comm_split` with key = the
coordinate, so a rank's rank in `tp_comm` is its `tp_rank`; `pp_next` and
`pp_prev` are ranks in `pp_comm` (None at the ends). Expert-parallel ranks
hold different experts but the same dense parameters and see different
data, so dense gradients are averaged over `dp_ep_comm` (the ranks sharing
pp and tp coordinates), expert gradients over `dp_comm`.

The node-local rank comes from `MPI_Comm_split_type(COMM_TYPE_SHARED)`, and
`select_device()` hands it to `models.backend.select`.
"""

from __future__ import annotations

from mpi4py import MPI

from dtlab.collective.comm import Communicator, world
from dtlab.models import backend

DIMS = ("dp", "pp", "ep", "tp")  # slowest to fastest


class GridError(ValueError):
    """The requested grid does not fit the world."""


class ProcessGrid:
    """Coordinates and one communicator per dimension for this rank.

    dp: data-parallel size, None to take whatever the other sizes leave.
    comm: the world to arrange (default: `world(**settings)`, which installs
        the abort handler); settings go to every sub-communicator.
    """

    def __init__(
        self,
        dp: int | None = None,
        pp: int = 1,
        tp: int = 1,
        ep: int = 1,
        *,
        comm: Communicator | None = None,
        **settings,
    ):
        self.world = comm if comm is not None else world(**settings)
        n = self.world.size
        for name, value in (("pp", pp), ("tp", tp), ("ep", ep), ("dp", dp)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise GridError(f"grid size {name}={value!r} must be a positive integer")
        inner = pp * ep * tp
        if dp is None:
            if n % inner:
                raise GridError(
                    f"pp={pp} x ep={ep} x tp={tp} = {inner} does not divide the "
                    f"world's {n} ranks, so dp cannot be inferred"
                )
            dp = n // inner
        if dp * inner != n:
            raise GridError(
                f"grid dp={dp} x pp={pp} x ep={ep} x tp={tp} = {dp * inner} ranks, "
                f"but the world has {n} ranks"
            )
        self.rank, self.size = self.world.rank, n
        self.dp_size, self.pp_size, self.ep_size, self.tp_size = dp, pp, ep, tp
        sizes = {"dp": dp, "pp": pp, "ep": ep, "tp": tp}
        strides, stride = {}, 1
        for d in reversed(DIMS):
            strides[d] = stride
            stride *= sizes[d]
        coords = {d: (self.rank // strides[d]) % sizes[d] for d in DIMS}
        self.coords = coords
        self.dp_rank, self.pp_rank = coords["dp"], coords["pp"]
        self.ep_rank, self.tp_rank = coords["ep"], coords["tp"]

        def split(dims: tuple[str, ...], name: str) -> Communicator:
            # color: the world rank of this group's member with 0 in `dims`
            color = self.rank - sum(coords[d] * strides[d] for d in dims)
            key = sum(coords[d] * strides[d] for d in dims)
            return self.world.split(color, key, name=name)

        self.dp_comm = split(("dp",), "dp")
        self.pp_comm = split(("pp",), "pp")
        self.ep_comm = split(("ep",), "ep")
        self.tp_comm = split(("tp",), "tp")
        self.dp_ep_comm = self.dp_comm if ep == 1 else split(("dp", "ep"), "dp_ep")

        self.pp_is_first_stage = self.pp_rank == 0
        self.pp_is_last_stage = self.pp_rank == pp - 1
        self.pp_next = None if self.pp_is_last_stage else self.pp_rank + 1
        self.pp_prev = None if self.pp_is_first_stage else self.pp_rank - 1

        node = self.world.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()

    def free(self) -> None:
        """Release the sub-communicators (collective)."""
        for sub in {id(c): c for c in (self.dp_comm, self.pp_comm, self.ep_comm, self.tp_comm,
                                       self.dp_ep_comm)}.values():
            sub.free()

    def rank_of(self, dp: int = 0, pp: int = 0, ep: int = 0, tp: int = 0) -> int:
        """The world rank at these coordinates."""
        return ((dp * self.pp_size + pp) * self.ep_size + ep) * self.tp_size + tp

    def select_device(self, device: str | None = None):
        """Pick this rank's array module (and GPU: local_rank % n_gpus)."""
        return backend.select(device, local_rank=self.local_rank)

    def __repr__(self) -> str:
        return (
            f"ProcessGrid(rank {self.rank}/{self.size}: dp {self.dp_rank}/{self.dp_size}, "
            f"pp {self.pp_rank}/{self.pp_size}, ep {self.ep_rank}/{self.ep_size}, "
            f"tp {self.tp_rank}/{self.tp_size}; local {self.local_rank}/{self.local_size})"
        )
