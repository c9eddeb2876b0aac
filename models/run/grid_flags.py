"""The process grid's flags as a config dataclass, `GridConfig`: --dp/--tp/--pp/--ep, the
pipeline's schedule and split (--pp-schedule, --virtual-stages, --stages) and the experts'
exchange (--moe-alltoall, --moe-chunks), with the rules between them and the model's
flags (models/flag_rules.py). dtlab-sync takes all of them (collective/train.py); a
program launching model-parallel groups can take its share (`add_flags(..., only=...)`),
so each flag and its default are declared once.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.models.config import ConfigError, choice, described
from dtlab.models.flag_rules import Conflicts, Flag, NoEffectWithout, Requires, rules
from dtlab.models.schedule import SCHEDULES
from dtlab.models.transformer import TransformerConfig


@rules(
    NoEffectWithout("stages", "pp"),
    NoEffectWithout("virtual_stages", "pp"),
    NoEffectWithout("moe_alltoall", "ep"),
    NoEffectWithout("moe_chunks", "ep"),
    Requires("ep", Flag("moe_experts", TransformerConfig,
                        words="a model with experts (--model transformer --moe-experts N)")),
    Conflicts(Flag("moe_groups", TransformerConfig), "ep", why="each rank's tokens are one group"),
)
@dataclass
class GridConfig:
    dp: int | None = described(None, "data-parallel replicas (default: the ranks --pp and "
                                     "--tp leave)", kind=int)
    tp: int = described(1, "tensor-parallel ranks per replica (Megatron-LM split; must divide "
                           "--n-heads, --d-ff and --vocab, or --d-hidden and --n-classes)")
    pp: int = described(1, "pipeline stages per replica (at most the model's layers: "
                           "embedding, blocks, final norm, head); a step's micro-batches are "
                           "--grad-accum")
    ep: int = described(1, "expert-parallel ranks: the MoE layers' experts split over them "
                           "(must divide --moe-experts); they read their own data")
    moe_alltoall: str = choice("ours", "ours", "mpi",
                               help="the expert-parallel all-to-all(v): ours (every pairwise "
                                    "exchange posted at once) or MPI's Alltoallv")
    moe_chunks: int = described(1, "split each MoE layer's routed tokens into this many "
                                   "chunks, one chunk's all-to-all overlapping another's "
                                   "expert compute")
    pp_schedule: str = choice("1f1b", *sorted(SCHEDULES),
                              help="pipeline schedule: GPipe, 1F1B (PipeDream-Flush), "
                                   "interleaved 1F1B, zero-bubble ZB-H1, or ZB-V / DualPipeV "
                                   "(2 chunks a rank in a V)")
    virtual_stages: int | None = described(None, "model chunks per pipeline rank for "
                                                 "--pp-schedule interleaved (default 2): the "
                                                 "model is cut into pp x this many stages",
                                           kind=int)
    stages: str = described("", "modules per stage, e.g. 3,2 (empty: balanced by the cost "
                                "model's FLOPs)")

    def validate(self) -> None:
        if self.ep < 1:
            raise ConfigError(f"--ep must be a positive integer (got {self.ep})")
        if self.moe_chunks < 1:
            raise ConfigError(f"--moe-chunks must be at least 1 (got {self.moe_chunks})")

