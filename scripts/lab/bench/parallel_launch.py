"""One mpiexec launch of dtlab.lab.bench.parallel: one (size, tp, pp) grid (dp 1), every
schedule and micro-batch count in turn, `steps` timed steps each after `warmup` untimed.

A step is what the sync trainer runs: compute_grads over the m micro-batches, the global
gradient clip, the optimizer step. Its time is the slowest rank's; the row keeps the median
over the timed steps. Rank 0 writes the rows (JSON) to `out`.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from dtlab.collective.grid import ProcessGrid
from dtlab.lab.bench import parallel_formulas as formulas
from dtlab.lab.bench.parallel_formulas import SIZES
from dtlab.models.memory import context_bytes
from dtlab.models.partition import module_parts
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.session import PipelineSpec, build_session, parse
from dtlab.models.run.threads import share_cores
from dtlab.models.schedule import SCHEDULES, bubble_formula, make, simulate


class CountingComm:
    """The real communicator, adding up the payload of every all-reduce and all-gather
    it is handed (the MPI communication still happens)."""

    def __init__(self, comm):
        self._comm, self.rank, self.size = comm, comm.rank, comm.size
        self.allreduce_bytes = self.allgather_bytes = 0

    def allreduce(self, x, **kw):
        self.allreduce_bytes += x.nbytes
        return self._comm.allreduce(x, **kw)

    def allgather(self, x, out=None, counts=None):
        out = self._comm.allgather(x, out=out, counts=counts)
        self.allgather_bytes += out.nbytes
        return out

    def take(self) -> tuple[int, int]:
        """(all-reduce, all-gather) bytes since the last take."""
        out = self.allreduce_bytes, self.allgather_bytes
        self.allreduce_bytes = self.allgather_bytes = 0
        return out

    def __getattr__(self, name):
        return getattr(self._comm, name)


class PassClock:
    """Seconds spent in forward (+ loss), backward (B, or BW) and deferred W passes."""

    def __init__(self, model, params):
        self.s = dict.fromkeys("FBW", 0.0)
        model.body.forward = self._timed(model.body.forward, "F")
        model.loss = self._timed(model.loss, "F")
        model.body.backward = self._timed(model.body.backward, "B")
        params.run_weight_grads = self._timed(params.run_weight_grads, "W")

    def _timed(self, fn, kind: str):
        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.s[kind] += time.perf_counter() - t
        return timed


def micro_batches(vocab: int, b: int, T: int, m: int, seed: int = 0) -> list:
    """m (inputs, targets) pairs of uniform tokens, (b, T) each, contiguous."""
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(m, b, T + 1))  # (m, b, T+1)
    return [(np.ascontiguousarray(x[:, :-1]), np.ascontiguousarray(x[:, 1:])) for x in tokens]


def run(size: str, tp: int, pp: int, ms: list[int], steps: int, warmup: int, out: str) -> None:
    keep_freed_memory()
    share_cores()
    grid = ProcessGrid(dp=1, pp=pp, tp=tp)
    grid.select_device()
    flags, b = SIZES[size]
    setup = parse([*flags, "--batch-size", str(b), "--n-tokens", "4096"], prog="bench_parallel")
    counter = CountingComm(grid.tp_comm) if tp > 1 else None
    pipeline = PipelineSpec(grid.pp_comm) if pp > 1 else None
    session = build_session(setup, tp=counter, pipeline=pipeline)
    model, P, c = session.model, session.params, setup.model
    bounds = model.bounds if pp > 1 else [0, len(model.body.modules)]
    groups = module_parts(setup.model_name, c, b, bounds[-1])[bounds[grid.pp_rank]:
                                                              bounds[grid.pp_rank + 1]]
    est = formulas.stage_estimate(groups, c, b, tp, setup.optim.optimizer)
    states = [v for k, v in session.optimizer.state_dict().items() if k != "steps"]
    mine = {"pp_rank": grid.pp_rank, "tp_rank": grid.tp_rank, "param_bytes": P.nbytes,
            "state_bytes": P.nbytes + P.grad.nbytes + sum(v.nbytes for v in states),
            "state_bytes_estimate": est["state_bytes"]}
    if pp == 1:  # one micro-batch's context at a time: measure it directly
        _, ctx = model.forward(P, micro_batches(c.vocab, b, c.seq_len, 1)[0])
        mine["context_bytes"] = context_bytes(ctx)
        del ctx
    clock = PassClock(model, P)
    mpi = grid.world.mpi
    rows = []
    for schedule in (list(SCHEDULES) if pp > 1 else ["-"]):
        if pp > 1:
            session.replica.schedule = schedule
        for m in ms:
            batches = micro_batches(c.vocab, b, c.seq_len, m)
            timed = []
            for k in range(warmup + steps):
                clock.s = dict.fromkeys("FBW", 0.0)
                if counter:
                    counter.take()
                grid.world.barrier()
                t0 = time.perf_counter()
                session.replica.compute_grads(batches)
                tp_sent = counter.take() if counter else (0, 0)
                model.clip_grad_norm(P, setup.optim.clip)
                session.optimizer.step(P.data, P.grad)
                step_s = time.perf_counter() - t0
                if k >= warmup:
                    timed.append({"step_s": step_s, "tp_sent": tp_sent, "pass_s": dict(clock.s),
                                  **session.replica.timing})
            every = mpi.gather({**mine, "timed": timed}, root=0)
            if grid.rank == 0:
                rows.append(row(size, setup, b, tp, pp, schedule, m, bounds, every))
    if grid.rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    grid.free()


def row(size, setup, b, tp, pp, schedule, m, bounds, every) -> dict:
    """One table row from every rank's figures (`every`, in world rank order)."""
    c = setup.model
    n = len(every[0]["timed"])
    step_s = [max(r["timed"][k]["step_s"] for r in every) for k in range(n)]
    last = [r["timed"][-1] for r in every]
    p2p = sum(t.get("pipe_bytes_sent", 0) for t in last)
    tp_sent = formulas.tp_bytes(sum(t["tp_sent"][0] for t in last),
                                sum(t["tp_sent"][1] for t in last), tp)
    ar, ag = formulas.tp_payload(c, b, tp)
    p2p_formula = formulas.p2p_bytes(c, b, m, pp, tp) if pp > 1 else 0
    tp_formula = tp * m * formulas.tp_bytes(ar, ag, tp)
    out = {"size": size, "tp": tp, "pp": pp, "world": tp * pp, "microbatches": m,
           "schedule": schedule, "batch": b, "d_model": c.d_model, "seq_len": c.seq_len,
           "n_layers": c.n_layers, "stage_bounds": bounds,
           "step_ms": 1e3 * statistics.median(step_s), "step_ms_steps": [1e3 * s for s in step_s],
           "comm_bytes": round(p2p + tp_sent),
           "comm_bytes_formula": round(p2p_formula + tp_formula),
           "comm_bytes_p2p": p2p, "comm_bytes_p2p_formula": p2p_formula,
           "comm_bytes_tp": round(tp_sent), "comm_bytes_tp_formula": round(tp_formula),
           "bubble": 0.0, "bubble_formula": 0.0, "bubble_expected": 0.0, "overhead": 0.0}
    ops = make(schedule, pp, m) if pp > 1 else [[]]
    if pp > 1:
        for key, measured in (("bubble", "bubble"), ("overhead", "pipe_overhead")):
            out[key] = statistics.median(
                statistics.mean(r["timed"][k][measured] for r in every) for k in range(n))
        out["bubble_formula"] = bubble_formula(schedule, pp, m)
        times = [{kind: statistics.mean(t["pass_s"][kind] / m for r in every
                                        if r["pp_rank"] == s for t in r["timed"])
                  for kind in "FBW"} for s in range(pp)]
        out["pass_ms"] = [{k: 1e3 * v for k, v in t.items()} for t in times]
        out["bubble_expected"] = simulate(ops, stage_times=times).bubble
    acts, act_est = [], []
    for r in every:
        s = r["pp_rank"]
        groups = module_parts(setup.model_name, c, b, bounds[-1])[bounds[s]:bounds[s + 1]]
        est = formulas.stage_estimate(groups, c, b, tp, setup.optim.optimizer)
        if pp > 1:
            acts.append(r["timed"][-1]["pipe_peak_activation_bytes"])
            act_est.append(formulas.peak_held(ops[s], est["context_bytes"], est["queue_bytes"]))
        else:
            acts.append(r["context_bytes"])
            act_est.append(est["context_bytes"])
    mem = [r["state_bytes"] / r["state_bytes_estimate"] for r in every]
    act = [a / e for a, e in zip(acts, act_est, strict=True)]
    top = max(range(len(every)), key=lambda i: every[i]["state_bytes"])
    big = max(range(len(every)), key=lambda i: acts[i])
    out.update(param_bytes_per_rank=every[top]["param_bytes"],
               state_bytes_per_rank=every[top]["state_bytes"],
               state_bytes_estimate=round(every[top]["state_bytes_estimate"]),
               memory_ratio=max(mem, key=lambda x: abs(x - 1)),
               state_bytes_ranks=[r["state_bytes"] for r in every],
               activation_bytes_per_rank=acts[big], activation_bytes_estimate=round(act_est[big]),
               activation_ratio=max(act, key=lambda x: abs(x - 1)),
               activation_bytes_ranks=acts)
    return out
