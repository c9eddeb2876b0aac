"""The sync trainer's methods between sync and async: their flags, what they refuse, and
the reducer (and optimizer) each gives the trainer.

    mpiexec -n 4 python -m dtlab.collective.train --model mlp --local-steps 10 \
        [--outer-optimizer sgd|nesterov --outer-lr L --outer-momentum M]
    mpiexec -n 4 python -m dtlab.collective.train --model mlp --compress topk:0.01 \
        [--no-error-feedback]

--local-steps H (collective/reducers/local_sgd.py: local SGD, DiLoCo) and --compress
(collective/reducers/compress.py: top-k, random-k, sign, PowerSGD with error feedback)
replace the bucketed gradient all-reduce on a plain data-parallel grid, one at a time;
the flags they cannot honour are refused by name (ConfigError: exit 2, one line).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from dtlab.collective.algorithms.quantized_ring import QuantizedConfig, QuantizedReducer
from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.compress import CompressReducer, describe
from dtlab.collective.reducers.local_sgd import LocalConfig, local_session, outer_config
from dtlab.collective.reducers.onebit_adam import OneBitConfig, onebit_session
from dtlab.collective.reducers.streaming import LocalOptimizer, StreamingConfig
from dtlab.models.compress import CompressConfig
from dtlab.models.config import ConfigError, add_flags, from_namespace
from dtlab.models.outer import OuterConfig
from dtlab.models.quantize import BLOCK


@dataclass(frozen=True)
class Methods:
    local: LocalConfig
    outer: OuterConfig  # the one local SGD runs (outer SGD lr 1 unless given)
    compress: CompressConfig
    streaming: StreamingConfig  # Streaming DiLoCo's fragments, overlap, precision
    onebit: OneBitConfig
    quantized: QuantizedConfig

    @property
    def enabled(self) -> bool:
        return bool(self.given())

    def given(self) -> list[str]:
        """'--local-steps 10', '--compress topk:0.01', '--onebit-adam 100': those asked for."""
        return [f"--{flag} {value}" for flag, value in (
            ("local-steps", self.local.local_steps), ("compress", self.compress.compress),
            ("onebit-adam", self.onebit.onebit_adam),
            ("quantize-grads", self.quantized.quantize_grads)) if value]

    def name(self) -> str:
        """The method's flag and value, for the refusals."""
        return self.given()[0]


def add_method_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, LocalConfig, "local SGD / DiLoCo (collective/reducers/local_sgd.py)")
    add_flags(parser, OuterConfig, "the outer optimizer of --local-steps (models/outer.py)")
    add_flags(parser, StreamingConfig, "Streaming DiLoCo, with --local-steps "
                                       "(collective/reducers/streaming.py)")
    add_flags(parser, CompressConfig, "gradient compression (collective/reducers/compress.py)")
    add_flags(parser, OneBitConfig, "1-bit Adam (collective/reducers/onebit_adam.py)")
    add_flags(parser, QuantizedConfig, "the quantized ring all-reduce "
                                       "(collective/algorithms/quantized_ring.py)")


def method_configs(setup) -> Methods:
    """The methods the flags ask for; a ConfigError naming a flag they cannot go with."""
    ns = setup.extra
    local = from_namespace(LocalConfig, ns)
    methods = Methods(local, outer_config(local, from_namespace(OuterConfig, ns)),
                      from_namespace(CompressConfig, ns), from_namespace(StreamingConfig, ns),
                      from_namespace(OneBitConfig, ns), from_namespace(QuantizedConfig, ns))
    if methods.streaming.enabled:
        methods.streaming.check(local.local_steps)
    if len(methods.given()) > 1:
        raise ConfigError(f"{' with '.join(methods.given())}: one of them at a time")
    if methods.onebit.onebit_adam and setup.optim.optimizer not in ("adam", "adamw"):
        raise ConfigError(f"--onebit-adam {methods.onebit.onebit_adam} with --optimizer "
                          f"{setup.optim.optimizer}: 1-bit Adam compresses Adam's momentum "
                          "(give --optimizer adam or adamw)")
    if not methods.enabled:
        return methods
    for dest in ("zero", "tp", "pp", "ep", "moe_experts", "precision", "wire", "allreduce",
                 "bucket_mb", "checkpoint_dir"):
        if dest in setup.defaults and setup.given(dest):
            value = next(getattr(p, dest) for p in (setup.model, setup.run, setup.extra)
                         if hasattr(p, dest))
            raise ConfigError(f"{methods.name()} with --{dest.replace('_', '-')} {value}: not "
                              "supported (plain data parallelism of a whole float32 replica; "
                              "the exchange runs our ring; no checkpoints, each rank's state "
                              "differs)")
    H, run = local.local_steps, setup.run
    if H and run.eval_every % H:
        raise ConfigError(f"--eval-every {run.eval_every} must be a multiple of --local-steps "
                          f"{H}: the held-out loss is of the averaged parameters, which exist "
                          "once per outer round")
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
        q = methods.quantized.quantize_grads
        reducer = QuantizedReducer(comm, session.replica.compute_params.grad, int(q[3:]))
        fields = {"quantize_grads": q}
        words = (f"gradients averaged through the quantized ring ({q}, a float32 scale per "
                 f"{BLOCK} values, re-quantized at every hop: {reducer.nbytes:,} bytes a "
                 "message set)")
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
