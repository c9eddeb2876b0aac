"""Train several dtlab-sync configurations in one launch, and local SGD's one-process twin.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/method_cases.py CASES.json OUT.npz

CASES.json is a list of {"name": ..., "argv": [...]} run by `dtlab.collective.train`'s
train() on these ranks (plain data parallelism, --local-steps, --compress), and of
{"name": ..., "argv": [...], "twin": W}: local SGD run by world rank 0 alone as W
replicas one after another (their own sessions: models.data.ShardedLoader rank r of W,
own optimizer), written out from the definition, without collective/reducers/local_sgd.py:

    every step: each replica r takes its inner step on its own batch
    a round's end (every H steps and the last): Delta = ((theta - theta_0) + (theta -
    theta_1) + ...) / W, summed in rank order (at W = 2 the ring's sum, a + b = b + a),
    theta <- the outer optimizer's step with Delta; every replica <- theta

{"name": ..., "argv": [...], "stream_twin": W}: Streaming DiLoCo (--fragments F,
--overlap-steps tau, --mix alpha, fp32) the same way, from models/streaming.py's
definition: after each step the pending fragments due merge, then the fragments the
schedule names take their mean outer gradient (in rank order, then / W); the outer step
and the merge come tau steps later (at once at the last step, where the merge copies).

{"name": ..., "argv": [...], "onebit_twin": W}: 1-bit Adam (--onebit-adam K) the same
way, from collective/reducers/onebit_adam.py's docstring: K warm-up steps of the optimizer on the
replicas' mean gradient (summed in rank order, / W), then each replica's momentum
b1 m + (1 - b1) g_r plus its error, sent as (|p|_1 / n) sign(p), their mean the shared m,
the step lr_t m / (sqrt(v) + eps_t) with v frozen at step K.

World rank 0 saves every case's final parameters (rank 0's: after the last round every
rank holds the same) under its name in OUT.npz.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

from dtlab.collective.train import parse_args, train
from dtlab.models import backend
from dtlab.models.outer import make_outer, round_ends
from dtlab.models.run.session import build_session
from dtlab.models.streaming import fragment_ranges, syncing


def sync(argv: list[str]) -> np.ndarray:
    session, _, _ = train(parse_args(argv))
    return backend.to_host(session.params.data)


def twin(argv: list[str], world: int) -> np.ndarray:
    setup = parse_args(argv)
    methods, run = setup.extra.methods, setup.run
    replicas = [build_session(setup, rank=r, world=world) for r in range(world)]
    theta = replicas[0].params.data.copy()  # (n,) the global parameters
    outer = make_outer(methods.outer, theta)
    for step in range(run.steps):
        for s in replicas:
            s.replica.compute_grads(s.loader.next())
            s.model.clip_grad_norm(s.params, setup.optim.clip)
            s.optimizer.step(s.params.data, s.params.grad, s.schedule(step))
        if round_ends(step, methods.local.local_steps, run.steps):
            total = theta - replicas[0].params.data  # (n,)
            for s in replicas[1:]:
                total += theta - s.params.data
            outer.step(theta, total / world)
            for s in replicas:
                s.params.data[...] = theta
    return theta


def stream_twin(argv: list[str], world: int) -> np.ndarray:
    setup = parse_args(argv)
    methods, run = setup.extra.methods, setup.run
    H, st = methods.local.local_steps, methods.streaming
    replicas = [build_session(setup, rank=r, world=world) for r in range(world)]
    params = replicas[0].params
    theta = params.data.copy()  # (n,) the global parameters
    ranges = fragment_ranges([params.offsets[s.name] for s in params.specs], st.fragments)
    outers = [make_outer(methods.outer, theta[lo:hi]) for lo, hi in ranges]

    def merge(f: int, mean: np.ndarray, last: bool) -> None:
        lo, hi = ranges[f]
        outers[f].step(theta[lo:hi], mean)
        for s in replicas:
            if last or not st.mix:
                s.params.data[lo:hi] = theta[lo:hi]
            else:
                s.params.data[lo:hi] *= st.mix
                s.params.data[lo:hi] += (1 - st.mix) * theta[lo:hi]

    pending: dict[int, tuple[int, np.ndarray]] = {}  # fragment -> (merge step, its mean)
    for step in range(run.steps):
        for s in replicas:
            s.replica.compute_grads(s.loader.next())
            s.model.clip_grad_norm(s.params, setup.optim.clip)
            s.optimizer.step(s.params.data, s.params.grad, s.schedule(step))
        last = step + 1 == run.steps
        for f, (at, mean) in list(pending.items()):
            if at == step or last:
                merge(f, mean, last)
                del pending[f]
        for f in syncing(step, H, st.fragments, run.steps):
            lo, hi = ranges[f]
            total = theta[lo:hi] - replicas[0].params.data[lo:hi]  # (n_f,)
            for s in replicas[1:]:
                total += theta[lo:hi] - s.params.data[lo:hi]
            if st.overlap_steps and not last:
                pending[f] = (step + st.overlap_steps, total / world)
            else:
                merge(f, total / world, last)
    return theta


def onebit_twin(argv: list[str], world: int) -> np.ndarray:
    setup = parse_args(argv)
    K, run = setup.extra.methods.onebit.onebit_adam, setup.run
    replicas = [build_session(setup, rank=r, world=world) for r in range(world)]
    lead = replicas[0]  # its optimizer and parameters stand for every replica's
    opt, theta = lead.optimizer, lead.params.data
    errors = [np.zeros_like(theta) for _ in replicas]
    for step in range(run.steps):
        for s in replicas:
            s.replica.compute_grads(s.loader.next())
        lr = lead.schedule(step)
        if step < K:
            mean = replicas[0].params.grad.copy()  # (n,)
            for s in replicas[1:]:
                mean += s.params.grad
            mean /= world
            lead.params.grad[...] = mean
            lead.model.clip_grad_norm(lead.params, setup.optim.clip)
            opt.step(theta, lead.params.grad, lr)
        else:
            b1, b2 = opt.beta1, opt.beta2
            opt.steps += 1
            if opt.weight_decay:  # AdamW: decoupled
                decay = opt._decay(theta)
                decay *= lr
                theta -= decay
            shared = np.zeros_like(theta)  # (n,)
            for s, e in zip(replicas, errors, strict=True):
                s.model.clip_grad_norm(s.params, setup.optim.clip)
                p = opt.m * b1 + s.params.grad * (1 - b1) + e  # (n,) m_r + e_r
                scale = p.dtype.type(float(np.abs(p).sum(dtype=np.float64)) / p.size)
                sent = np.where(p >= 0, scale, -scale)
                e[...] = p - sent
                shared += sent
            opt.m[...] = shared / world
            lr_t = lr * np.sqrt(1 - b2**K) / (1 - b1**opt.steps)
            eps_t = opt.eps * np.sqrt(1 - b2**K)
            theta -= opt.m / (np.sqrt(opt.v) + eps_t) * lr_t
        for s in replicas[1:]:
            s.params.data[...] = theta
    return theta


cases_path, out = sys.argv[1], sys.argv[2]
with open(cases_path) as f:
    cases = json.load(f)
rank = MPI.COMM_WORLD.rank
results = {}
for case in cases:
    twins = {"twin": twin, "stream_twin": stream_twin, "onebit_twin": onebit_twin}
    kind = next((k for k in twins if k in case), None)
    if kind is None:
        results[case["name"]] = sync(case["argv"])
    elif rank == 0:
        results[case["name"]] = twins[kind](case["argv"], case[kind])
if rank == 0:
    np.savez(out, **results)
