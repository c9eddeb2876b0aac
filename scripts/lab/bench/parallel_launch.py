"""One mpiexec launch of dtlab.lab.bench.parallel: one (size, tp, pp) grid (dp 1), every
schedule and micro-batch count in turn, `steps` timed steps each after `warmup` untimed.

A step is what the sync trainer runs: compute_grads over the m micro-batches, the global
gradient clip, the optimizer step. Its time is the slowest rank's; the row keeps the median
over the timed steps. Rank 0 writes the rows (JSON) to `out`.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from dtlab.collective.grid import ProcessGrid
from dtlab.lab.bench import harness
from dtlab.lab.bench import parallel_formulas as formulas
from dtlab.lab.bench.parallel_formulas import SIZES
from dtlab.lab.simulate import pipeline as sim_pipeline
from dtlab.models.memory import context_bytes
from dtlab.models.partition import module_parts
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.session import PipelineSpec, build_session, parse
from dtlab.models.run.threads import share_cores
from dtlab.models.schedule import (
    SCHEDULES,
    bubble_formula,
    layout,
    make,
    simulate,
    virtual_stage,
)


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


def micro_batches(vocab: int, b: int, T: int, m: int, seed: int = 0) -> list:
    """m (inputs, targets) pairs of uniform tokens, (b, T) each, contiguous."""
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(m, b, T + 1))  # (m, b, T+1)
    return [(np.ascontiguousarray(x[:, :-1]), np.ascontiguousarray(x[:, 1:])) for x in tokens]


def rank_stages(bounds: list[int], pp: int, rank: int, schedule: str) -> list[int]:
    """The stages (in chunk order) that `rank` holds under `schedule`."""
    v = (len(bounds) - 1) // pp
    return [virtual_stage(layout(schedule), pp, rank, c) for c in range(v)]


def stage_groups(setup, b: int, bounds: list[int], stages: list[int]) -> list[list]:
    """Per stage of `stages`, its body modules' Parts."""
    groups = module_parts(setup.model_name, setup.model, b, bounds[-1])
    return [groups[bounds[g]:bounds[g + 1]] for g in stages]


def cases(pp: int, ms: list[int]) -> list[tuple[str, list[int]]]:
    """(schedule, its micro-batch counts): every schedule with p > 1 at the m it can
    take (interleaved 1F1B: multiples of p; DualPipeV: m >= 2p), none without."""
    if pp == 1:
        return [("-", ms)]
    fits = {"interleaved": lambda m: m % pp == 0, "dualpipev": lambda m: m >= 2 * pp}
    return [(s, [m for m in ms if fits.get(s, lambda m: True)(m)]) for s in SCHEDULES]


def run(size: str, tp: int, pp: int, ms: list[int], steps: int, warmup: int, out: str) -> None:
    keep_freed_memory()
    share_cores()
    grid = ProcessGrid(dp=1, pp=pp, tp=tp)
    grid.select_device()
    flags, b = SIZES[size]
    setup = parse([*flags, "--batch-size", str(b), "--n-tokens", "4096"], prog="bench_parallel")
    counter = CountingComm(grid.tp_comm) if tp > 1 else None
    mpi = grid.world.mpi
    rows = []
    for schedule, counts in cases(pp, ms):
        pipeline = PipelineSpec(grid.pp_comm, schedule) if pp > 1 else None
        session = build_session(setup, tp=counter, pipeline=pipeline)
        model, P, c = session.model, session.params, setup.model
        bounds = model.bounds if pp > 1 else [0, len(model.body.modules)]
        mine = {"pp_rank": grid.pp_rank, "tp_rank": grid.tp_rank,
                **rank_memory(session, setup, b, tp, bounds, pp, schedule, grid.pp_rank)}
        if pp > 1:
            mine["p2p_s"] = ping_pong(grid.pp_comm, activation_bytes(c, b), P.dtype)
        for m in counts:
            batches = micro_batches(c.vocab, b, c.seq_len, m)
            timed = []
            for k in range(warmup + steps):
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
                    timed.append({"step_s": step_s, "tp_sent": tp_sent,
                                  "pipe_pass_s": getattr(session.replica, "pass_times", []),
                                  **session.replica.timing})
            every = mpi.gather({**mine, "timed": timed}, root=0)
            if grid.rank == 0:
                rows.append(row(size, setup, b, tp, pp, schedule, m, bounds, every))
    if grid.rank == 0:
        harness.write(out, "parallel_launch", rows, mpi=True, size=size, tp=tp, pp=pp)
    grid.free()


def rank_memory(session, setup, b: int, tp: int, bounds: list[int], pp: int, schedule: str,
                rank: int) -> dict:
    """This rank's parameter and state bytes, measured and estimated; without a pipeline
    one micro-batch's context, measured directly."""
    P, c = session.params, setup.model
    groups = [g for chunk in stage_groups(setup, b, bounds, rank_stages(bounds, pp, rank,
                                                                         schedule))
              for g in chunk]
    est = formulas.stage_estimate(groups, c, b, tp, setup.optim.optimizer)
    states = [v for k, v in session.optimizer.state_dict().items() if k != "steps"]
    out = {"param_bytes": P.nbytes,
           "state_bytes": P.nbytes + P.grad.nbytes + sum(v.nbytes for v in states),
           "state_bytes_estimate": est["state_bytes"]}
    if pp == 1:  # one micro-batch's context at a time: measure it directly
        _, ctx = session.model.forward(P, micro_batches(c.vocab, b, c.seq_len, 1)[0])
        out["context_bytes"] = context_bytes(ctx)
    return out


def activation_bytes(c, b: int) -> int:
    return b * c.seq_len * c.d_model * 4


def ping_pong(pp, nbytes: int, dtype, rounds: int = 20) -> float:
    """Seconds of one activation's (or gradient's) transfer between neighbouring ranks as
    the executor makes it (an isend and its wait, a blocking receive): half a round trip
    between ranks 0 and 1, median of `rounds`; the other ranks wait."""
    data = np.zeros(nbytes // np.dtype(dtype).itemsize, dtype=dtype)
    spent = []
    for _ in range(rounds):
        pp.barrier()
        t = time.perf_counter()
        if pp.rank in (0, 1):
            peer = 1 - pp.rank
            for turn in (0, 1):
                if pp.rank == turn:
                    pp.isend(data, peer, 0).wait()
                else:
                    pp.recv(data, peer, 0)
        spent.append((time.perf_counter() - t) / 2)
    return statistics.median(spent)


def row(size, setup, b, tp, pp, schedule, m, bounds, every) -> dict:
    """One table row from every rank's figures (`every`, in world rank order)."""
    c = setup.model
    n = len(every[0]["timed"])
    v = (len(bounds) - 1) // pp
    shape = layout(schedule) if pp > 1 else "loop"
    step_s = [max(r["timed"][k]["step_s"] for r in every) for k in range(n)]
    last = [r["timed"][-1] for r in every]
    p2p = sum(t.get("pipe_bytes_sent", 0) for t in last)
    tp_sent = formulas.tp_bytes(sum(t["tp_sent"][0] for t in last),
                                sum(t["tp_sent"][1] for t in last), tp)
    ar, ag = formulas.tp_payload(c, b, tp)
    p2p_formula = formulas.p2p_bytes(c, b, m, pp, tp, formulas.crossings(shape, pp, v)) \
        if pp > 1 else 0
    tp_formula = tp * m * formulas.tp_bytes(ar, ag, tp)
    out = {"size": size, "tp": tp, "pp": pp, "world": tp * pp, "microbatches": m,
           "schedule": schedule, "chunks": v, "batch": b, "d_model": c.d_model,
           "seq_len": c.seq_len, "n_layers": c.n_layers, "stage_bounds": bounds,
           "step_ms": 1e3 * statistics.median(step_s), "step_ms_steps": [1e3 * s for s in step_s],
           "comm_bytes": round(p2p + tp_sent),
           "comm_bytes_formula": round(p2p_formula + tp_formula),
           "comm_bytes_p2p": p2p, "comm_bytes_p2p_formula": p2p_formula,
           "comm_bytes_tp": round(tp_sent), "comm_bytes_tp_formula": round(tp_formula),
           "bubble": 0.0, "bubble_formula": 0.0, "bubble_expected": 0.0,
           "bubble_p2p": 0.0, "overhead": 0.0}
    ops = make(schedule, pp, m) if pp > 1 else [[]]
    if pp > 1:
        out.update(pipeline_figures(every, schedule, pp, m, v, ops))
    acts, act_est = [], []
    for r in every:
        stages = rank_stages(bounds, pp, r["pp_rank"], schedule) if pp > 1 else [0]
        est = [formulas.stage_estimate(g, c, b, tp, setup.optim.optimizer)
               for g in stage_groups(setup, b, bounds, stages)]
        if pp > 1:
            acts.append(r["timed"][-1]["pipe_peak_activation_bytes"])
            act_est.append(formulas.peak_held(ops[r["pp_rank"]], [e["context_bytes"] for e in est],
                                              [e["queue_bytes"] for e in est]))
        else:
            acts.append(r["context_bytes"])
            act_est.append(est[0]["context_bytes"])
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


def pipeline_figures(every: list[dict], schedule: str, pp: int, m: int, v: int,
                     ops) -> dict:
    """The bubble measured, by formula and replayed (with each stage's measured pass
    times: free communication, then each receive at its ping-pong time), and the
    per-micro-batch costs beside them: the executor's time per op and per message."""
    n = len(every[0]["timed"])
    shape = layout(schedule)

    def median_of_means(key: str) -> float:
        return statistics.median(statistics.mean(r["timed"][k][key] for r in every)
                                 for k in range(n))

    times = [{}] * (v * pp)  # per stage: mean seconds of one micro-batch's passes
    for r in every:
        for c, g in enumerate(virtual_stage(shape, pp, r["pp_rank"], c) for c in range(v)):
            times[g] = {kind: statistics.mean(t["pipe_pass_s"][c][kind] / m
                                              for t in r["timed"]) for kind in "FBW"}
    link = every[0]["p2p_s"]  # ranks 0 and 1 measured it
    paid = sim_pipeline.pipeline_step(ops, times, sim_pipeline.P2P(link, link, 0), shape)
    makespan = median_of_means("pipe_makespan_s")
    ops_per_rank = len(ops[0])
    messages = [t["pipe_messages"] for r in every for t in r["timed"]]
    sends = [t["pipe_send_s"] for r in every for t in r["timed"]]
    return {"bubble": median_of_means("bubble"), "overhead": median_of_means("pipe_overhead"),
            "bubble_formula": bubble_formula(schedule, pp, m, v=v),
            "bubble_expected": simulate(ops, stage_times=times, layout=shape).bubble,
            "bubble_p2p": paid.bubble,
            # per virtual stage: one micro-batch's forward, backward, weight-gradient pass
            **{f"pass_ms_{kind}": [1e3 * t.get(kind, 0.0) for t in times] for kind in "FBW"},
            "p2p_us": 1e6 * link,
            "send_us": 1e6 * sum(sends) / max(1, sum(messages)),
            "overhead_us_per_op": 1e6 * median_of_means("pipe_overhead") * makespan
            / ops_per_rank}
