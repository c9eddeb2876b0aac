"""The sync trainer's methods between sync and async: their flags, what they refuse, and
the reducer (and optimizer) each gives the trainer.

    mpiexec -n 4 python -m dtlab.collective.train --model mlp --local-steps 10 \
        [--outer-optimizer sgd|nesterov --outer-lr L --outer-momentum M]
    mpiexec -n 4 python -m dtlab.collective.train --model mlp --compress topk:0.01 \
        [--no-error-feedback]

--local-steps H (collective/reducers/local_sgd.py: local SGD, DiLoCo) and --compress
(collective/reducers/compress.py: top-k, random-k, sign, PowerSGD with error feedback)
replace the bucketed gradient all-reduce on a plain data-parallel grid, one at a time;
the flags they cannot honour are refused by name (ConfigError: exit 2, one line): the
rules declared on `Methods` below and on each method's config (models/flag_rules.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtlab.collective.algorithms.quantized_ring import QuantizedConfig, QuantizedReducer
from dtlab.collective.comm import Communicator
from dtlab.collective.flags import SyncConfig
from dtlab.collective.reducers.compress import CompressReducer, describe
from dtlab.collective.reducers.local_sgd import LocalConfig, local_session, outer_config
from dtlab.collective.reducers.onebit_adam import OneBitConfig, onebit_session
from dtlab.collective.reducers.streaming import LocalOptimizer, StreamingConfig
from dtlab.collective.reducers.zero_one_adam import ZeroOneConfig, zero_one_session
from dtlab.models.compress import CompressConfig
from dtlab.models.flag_rules import Conflicts, Flag, OneAtATime, given, rules
from dtlab.models.outer import OuterConfig
from dtlab.models.quantize import BLOCK
from dtlab.models.run.grid_flags import GridConfig
from dtlab.models.run.session import RunConfig
from dtlab.models.transformer import TransformerConfig

# The method configs, each (class, --help title): dtlab-sync's flags of the methods.
METHOD_CONFIGS = (
    (LocalConfig, "local SGD / DiLoCo (collective/reducers/local_sgd.py)"),
    (OuterConfig, "the outer optimizer of --local-steps (models/outer.py)"),
    (StreamingConfig, "Streaming DiLoCo, with --local-steps (collective/reducers/streaming.py)"),
    (CompressConfig, "gradient compression (collective/reducers/compress.py)"),
    (OneBitConfig, "1-bit Adam (collective/reducers/onebit_adam.py)"),
    (QuantizedConfig, "the quantized ring all-reduce (collective/algorithms/quantized_ring.py)"),
    (ZeroOneConfig, "0/1 Adam (collective/reducers/zero_one_adam.py)"),
)
METHODS = (Flag("local_steps", LocalConfig), Flag("compress", CompressConfig),
           Flag("onebit_adam", OneBitConfig), Flag("quantize_grads", QuantizedConfig),
           Flag("zero_one_adam", ZeroOneConfig))
# What a method cannot run with: each exchanges what a whole float32 replica holds over
# our ring, and each rank's state differs (no checkpoints).
PLAIN_REPLICA = (Flag("zero", SyncConfig), *(Flag(n, GridConfig) for n in ("tp", "pp", "ep")),
                 Flag("moe_experts", TransformerConfig), Flag("precision", RunConfig),
                 *(Flag(n, SyncConfig) for n in ("wire", "allreduce", "bucket_mb")),
                 Flag("checkpoint_dir", RunConfig))


@rules(
    OneAtATime(METHODS),
    Conflicts(METHODS, PLAIN_REPLICA,
              why="not supported (plain data parallelism of a whole float32 replica; the "
                  "exchange runs our ring; no checkpoints, each rank's state differs)"),
)
@dataclass(frozen=True)
class Methods:
    local: LocalConfig
    outer: OuterConfig  # the one local SGD runs (outer SGD lr 1 unless given)
    compress: CompressConfig
    streaming: StreamingConfig  # Streaming DiLoCo's fragments, overlap, precision
    onebit: OneBitConfig
    quantized: QuantizedConfig
    zero_one: ZeroOneConfig

    @property
    def enabled(self) -> bool:
        return bool(self.given())

    def given(self) -> list[str]:
        """'--local-steps 10', '--compress topk:0.01', '--onebit-adam 100': those asked for."""
        parts = {type(part): part for part in vars(self).values()}
        return given(METHODS, lambda f: getattr(parts[f.owner], f.name))


def method_configs(setup) -> Methods:
    """The methods a parsed setup asks for (parse kept their RULES and each config's): local
    SGD's outer optimizer (SGD lr 1 unless given), Streaming DiLoCo's fragments checked
    against --local-steps."""
    local = setup.config(LocalConfig)
    methods = Methods(local, outer_config(local, setup.config(OuterConfig)),
                      *(setup.config(cls) for cls in (CompressConfig, StreamingConfig,
                                                      OneBitConfig, QuantizedConfig,
                                                      ZeroOneConfig)))
    if methods.streaming.enabled:
        methods.streaming.check(local.local_steps)
    return methods


def method_parts(session, comm: Communicator, methods: Methods, seed: int, plain=None):
    """(session, reducer, header fields, words) of the method: the session's optimizer
    wrapped under --local-steps and --onebit-adam; `comm` the dp communicator; `plain()`
    makes plain data parallelism's reducer (1-bit Adam's warm-up runs it)."""
    if methods.local.local_steps:
        H, o, st = methods.local.local_steps, methods.outer, methods.streaming
        fields = {"local_steps": H, "outer": dataclasses.asdict(o)}
        words = (f"local SGD: {H} inner steps per round, outer {o.outer_optimizer} lr "
                 f"{o.outer_lr:g} momentum {o.outer_momentum:g}, ")
        session, reducer = local_session(session, comm, methods.local, o, st)
        if st.enabled:
            fields["streaming"] = {**dataclasses.asdict(st),
                                   "fragment_ranges": session.optimizer.ranges}
            words += (f"Streaming DiLoCo: {st.fragments} fragment(s), one synchronised every "
                      f"{H // st.fragments} steps, overlapping {st.overlap_steps} step(s), "
                      f"mix {st.mix:g}, outer gradients in {st.outer_precision}")
        else:
            words += "one ring all-reduce of the parameter change per round"
    elif methods.quantized.quantize_grads:
        q, ef = methods.quantized.quantize_grads, methods.quantized.quantize_error_feedback
        reducer = QuantizedReducer(comm, session.replica.compute_params.grad, int(q[3:]), ef)
        fields = {"quantize_grads": q, "quantize_error_feedback": ef}
        words = (f"gradients averaged through the quantized ring ({q}, a float32 scale per "
                 f"{BLOCK} values, re-quantized at every hop: {reducer.nbytes:,} bytes a "
                 f"message set), {'with' if ef else 'without'} error feedback")
        fields.update(allreduce="ring", allreduce_buckets=reducer.plan(), wire=q)
        return session, reducer, fields, words
    elif methods.onebit.onebit_adam:
        W = methods.onebit.onebit_adam
        session, reducer = onebit_session(session, comm, W, plain())
        fields = {"onebit_adam": W}
        words = (f"1-bit Adam: {W} warm-up steps of Adam on the all-reduced gradient, then "
                 f"the momentum as signs ({session.optimizer.nbytes:,} bytes a rank, "
                 "all-gathered) with error feedback, the variance frozen")
        fields.update(allreduce="ring", allreduce_buckets=reducer.plan(), wire="fp32")
        return session, reducer, fields, words
    elif methods.zero_one.zero_one_adam:
        z = methods.zero_one
        session, reducer = zero_one_session(session, comm, z, plain())
        fields = {"zero_one_adam": dataclasses.asdict(z)}
        words = (f"0/1 Adam: the variance updated with an all-reduced gradient on an interval "
                 f"doubling every {z.zero_one_variance_doubling} updates up to step "
                 f"{z.zero_one_adam}, then frozen; the momentum as signs "
                 f"({session.optimizer.nbytes:,} bytes a rank, all-gathered) with error "
                 f"feedback, after step {z.zero_one_adam} every 1 to "
                 f"{z.zero_one_local_max} local steps (doubling every "
                 f"{z.zero_one_local_doubling})")
    else:
        grad = session.replica.compute_params.grad
        reducer = CompressReducer(comm, grad, methods.compress, session.params, seed)
        fields = {"compress": methods.compress.compress,
                  "error_feedback": methods.compress.error_feedback}
        words = (f"{describe(methods.compress)}: "
                 + ", ".join(f"{p['algorithm']} of {p['bytes']:,} bytes" for p in reducer.plan())
                 + " per step")
    fields.update(allreduce="ring", allreduce_buckets=reducer.plan(), wire="fp32")
    return session, reducer, fields, words


def agreement(session, world: Communicator):
    """The trainer's stop agreement (models/run/stop.py: the ranks sum their caught
    signals): every step, or under --local-steps at round ends only, so that the ranks
    meet once a round and a signal stops all of them after the same round."""
    def every_step(counts):
        return world.allreduce(counts, algo="mpi")
    optimizer = session.optimizer
    return optimizer.at_round_ends(every_step) if isinstance(optimizer, LocalOptimizer) \
        else every_step
