"""Train several dtlab-sync configurations in one launch, and 0/1 Adam's one-process twin.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/zero_one_cases.py CASES.json OUT.npz

CASES.json is a list of {"name": ..., "argv": [...]} run by `dtlab.collective.train`'s
train() on these ranks, and of {"name": ..., "argv": [...], "twin": W}: 0/1 Adam
(--zero-one-adam with --optimizer adamw) run by world rank 0 alone as W replicas one
after another (their own sessions: models.data.ShardedLoader rank r of W), written from
collective/reducers/zero_one_adam.py's docstring, without its classes; the steps' kinds
come from its `zero_one_schedule` (tests/collective/test_zero_one_adam.py checks that
against a list written out by hand):

    variance  the replicas' mean gradient (summed in rank order, / W), clipped; AdamW's
              decay, m and v updated, theta -= c_t m / (sqrt(v) + eps_t) on every replica
              (AdamW's own step while every step so far updated v)
    local     each replica its own: clip, decay, m_r, theta_r -= c_t m_r / (sqrt(v) + eps_t)
    sync      as local but no step; each replica's (|p|_1 / n) sign(p) with p the round's
              c-weighted mean momentum plus its error; their mean the shared m; every
              replica <- theta_0 - lam m / (sqrt(v) + eps_t)

c_t = lr sqrt(1 - b2^k) / (1 - b1^t), eps_t = eps sqrt(1 - b2^k), k the variance's
updates so far, lam the round's sum of c_t; the weighted mean kept as the product keeps it
(a += (c / lam)(m - a)), so that the comparison is bit for bit.

World rank 0 saves every case's final parameters under its name in OUT.npz.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
from mpi4py import MPI

from dtlab.collective.reducers.zero_one_adam import LOCAL, SYNC, VARIANCE, zero_one_schedule
from dtlab.collective.train import parse_args, train
from dtlab.models import backend
from dtlab.models.run.session import build_session


def sync(argv: list[str]) -> np.ndarray:
    session, _, _ = train(parse_args(argv))
    return backend.to_host(session.params.data)


def twin(argv: list[str], world: int) -> np.ndarray:
    setup = parse_args(argv)
    run, clip = setup.run, setup.optim.clip
    kinds = zero_one_schedule(setup.extra.methods.zero_one, run.steps, run.eval_every)
    replicas = [build_session(setup, rank=r, world=world) for r in range(world)]
    opt = replicas[0].optimizer  # AdamW: its hyperparameters and decay mask
    b1, b2 = opt.beta1, opt.beta2
    mask = 1.0 if opt.decay_mask is None else opt.decay_mask
    thetas = [s.params.data for s in replicas]
    moms = [opt.m] + [np.zeros_like(opt.m) for _ in replicas[1:]]  # (n,) each replica's m
    means = [np.zeros_like(opt.m) for _ in replicas]  # (n,) the round's mean momentum
    errors = [np.zeros_like(opt.m) for _ in replicas]
    v, start = opt.v, thetas[0].copy()
    k, weight, taken = 0, 0.0, 0

    def decay(theta: np.ndarray, lr: float) -> None:
        theta -= theta * opt.weight_decay * mask * lr

    for t, kind in enumerate(kinds, 1):
        for s in replicas:
            s.replica.compute_grads(s.loader.next())
        lr = replicas[0].schedule(t - 1)
        if kind == VARIANCE:
            g = replicas[0].params.grad  # (n,) <- the mean gradient
            for s in replicas[1:]:
                g += s.params.grad
            g /= world
            replicas[0].model.clip_grad_norm(replicas[0].params, clip)
            k += 1
            if k == t:  # v updated at every step so far: AdamW's own step
                opt.step(thetas[0], g, lr)
            else:
                decay(thetas[0], lr)
                moms[0][...] = moms[0] * b1 + g * (1 - b1)
                v[...] = v * b2 + g * g * (1 - b2)
                c = lr * math.sqrt(1 - b2**k) / (1 - b1**t)
                thetas[0] -= moms[0] / (np.sqrt(v) + opt.eps * math.sqrt(1 - b2**k)) * c
            for theta, m in zip(thetas[1:], moms[1:], strict=True):
                theta[...], m[...] = thetas[0], moms[0]
            continue
        first, taken = taken == 0, taken + 1
        alone = first and kind == SYNC
        if first and kind == LOCAL:
            start[...] = thetas[0]
        if not alone:
            decay(start, lr)
        c, eps_t = lr * math.sqrt(1 - b2**k) / (1 - b1**t), opt.eps * math.sqrt(1 - b2**k)
        weight += c
        for s, theta, m, a in zip(replicas, thetas, moms, means, strict=True):
            s.model.clip_grad_norm(s.params, clip)
            decay(theta, lr)
            m[...] = m * b1 + s.params.grad * (1 - b1)
            a[...] = m if first else a + (m - a) * (c / weight)
            if kind == LOCAL:
                theta -= m / (np.sqrt(v) + eps_t) * c
        if kind == SYNC:
            shared = np.zeros_like(v)  # (n,)
            for a, e in zip(means, errors, strict=True):
                p = a + e
                scale = p.dtype.type(float(np.abs(p).sum(dtype=np.float64)) / p.size)
                sent = np.where(p >= 0, scale, -scale)
                e[...] = p - sent
                shared += sent
            shared /= world
            base = thetas[0] if alone else start
            base -= shared / (np.sqrt(v) + eps_t) * weight
            for theta, m in zip(thetas, moms, strict=True):
                theta[...], m[...] = base, shared
            weight, taken = 0.0, 0
    return thetas[0].copy()


cases_path, out = sys.argv[1], sys.argv[2]
with open(cases_path) as f:
    cases = json.load(f)
rank = MPI.COMM_WORLD.rank
results = {}
for case in cases:
    if "twin" not in case:
        results[case["name"]] = sync(case["argv"])
    elif rank == 0:
        results[case["name"]] = twin(case["argv"], case["twin"])
if rank == 0:
    np.savez(out, **results)
