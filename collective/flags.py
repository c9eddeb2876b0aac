"""dtlab-sync's data-parallel exchange as a config dataclass, `SyncConfig` (--allreduce,
--wire, --bucket-mb, --overlap, --zero ...), declaring the rules its flags keep
(models/flag_rules.py); the process grid's flags are models/run/grid_flags.py's
`GridConfig`. collective/train.py parses both (models/run/session.py,
`parse(configs=...)`); their values are also attributes of the setup's `extra`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.collective.algorithms.choose import OURS
from dtlab.collective.reducers.bucket_defaults import DEFAULT_BUCKET_BYTES
from dtlab.collective.reducers.buckets import WIRE_DTYPES
from dtlab.collective.transport.failure import DEFAULT_TIMEOUT_S
from dtlab.collective.zero.sharding import STAGES
from dtlab.models.config import choice, described, positive
from dtlab.models.flag_rules import Conflicts, Flag, NoEffectWith, NoEffectWithout, at, rules
from dtlab.models.run.grid_flags import GridConfig
from dtlab.models.transformer import TransformerConfig

# --allreduce: "ring" forces our ring at every size, "auto" lets
# collective/algorithms/choose.py pick
ALLREDUCE = ("ring", "auto", *(a for a in OURS if a != "ring"), "naive", "mpi")


ZERO_REDUCES = ("each unit's gradient is reduce-scattered by our ring (in the compute dtype, "
                "or --wire's)")


@rules(
    NoEffectWithout("zero_reshard_after_forward", at("zero", 3)),
    Conflicts("zero", Flag("ep", GridConfig),
              why="ZeRO shards over the dp ranks of each (pp, tp) shard, not over "
                  "expert-parallel groups (their experts' and dense gradients reduce over "
                  "different communicators)"),
    Conflicts(at("zero", 3), Flag("pp", GridConfig),
              why="stage 3 gathers a unit's parameters around each forward and backward, "
                  "which a pipeline schedule interleaves over micro-batches (ZB-H1 defers "
                  "weight gradients past them); --zero 1 or 2 shard a pipeline stage"),
    Conflicts("zero", Flag("moe_bias_rate", TransformerConfig),
              why="the router's selection-bias steps change parameters outside the "
                  "optimizer, on every rank's whole copy, which ZeRO holds in slices"),
    NoEffectWith("allreduce", "zero", why=ZERO_REDUCES),
    NoEffectWith("bucket_mb", "zero", why=ZERO_REDUCES),
)
@dataclass
class SyncConfig:
    allreduce: str = choice("ring", *ALLREDUCE,
                            help="gradient all-reduce: ring (ours, the ring at every size), "
                                 "auto (ours, chosen by size and node: "
                                 "collective/algorithms/choose.py), a named one of ours "
                                 "(doubling, halving, shm-one-shot, shm-two-shot), naive "
                                 "(reduce + broadcast) or mpi (MPI's own Allreduce); the "
                                 "metrics header's allreduce_buckets says what each bucket ran")
    wire: str = choice("fp32", *sorted(WIRE_DTYPES),
                       help="dtype the gradient all-reduce moves (--zero: each unit's "
                            "reduce-scatter): fp16 and bf16 halve the bytes (each bucket "
                            "cast, averaged as floats, cast back)")
    bucket_mb: float = described(DEFAULT_BUCKET_BYTES / 1e6,
                                 "gradient bucket size in MB (1e6 bytes)")
    overlap: bool = described(True, "start a bucket's all-reduce as soon as backward has "
                                    "produced it")
    zero: int = choice(0, 0, *STAGES,
                       help="ZeRO sharded data parallelism (collective/zero/sharding.py): 1 "
                            "shards the optimizer state over the dp ranks, 2 also the "
                            "gradients, 3 also the parameters (0: every rank holds everything)")
    zero_reshard_after_forward: bool | None = described(
        None, "--zero 3: free each unit's gathered parameters after its forward and gather "
              "them again for backward (default; off keeps them, one all-gather per "
              "micro-batch fewer, more memory)", kind=bool)
    collective_timeout: float | None = described(
        None, "seconds before a stalled collective aborts the job (default: "
              f"DTLAB_COLLECTIVE_TIMEOUT or {DEFAULT_TIMEOUT_S:g}; 0 disables)", kind=float)
    explain_hang: str | None = described(
        None, "train nothing: read the flight-recorder dumps a stalled or aborted job wrote "
              "into DIR (DTLAB_FLIGHT_DIR) and name the first collective its ranks disagree "
              "on (collective/transport/flight.py)", kind=str, metavar="DIR")

    def validate(self) -> None:
        positive(self, "bucket_mb")
