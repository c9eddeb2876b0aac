"""From a run's metrics files to the numbers the comparison reports.

Hadjis et al. (2016), "Omnivore: An Optimizer for Multi-device Deep Learning
on CPUs and GPUs", split the time a run takes to reach a loss into two
factors that its topology trades against each other:

    hardware efficiency     HE = seconds per step (training time / steps)
    statistical efficiency  SE = steps until the loss first reaches the target
    time to target          HE x SE

Step k of a run is the k-th step of every rank (sync) or worker (async). Its
loss is the mean of their step-k losses (what the sync trainer logs; a BSP
run logs the same numbers), its time the slowest one's `elapsed_s` at step k
less the time its held-out evaluations took (`eval_s`: measurement, not
training; each process's clock starts when its training loop does), its
samples seen k x global batch. One step's loss is one mini-batch's, so the target counts
as reached at the first step whose trailing mean over `window` steps (the
steps / 20, at least 1) is at or below it. The final loss is the mean of the
last 10% of the steps, as the trainers' own summaries take it.

With --eval-every every process also logs a held-out loss (the same
examples for every run) at the same steps; the held-out curve is its mean
over processes at each of those steps, and the held-out target is reached at
the first of them whose held-out loss is at or below the target: a measure
free of the mini-batch noise and of the topology's sampling.

Except where the workers do not move in step (ASP, SSP, async local SGD): there
a worker's evaluation reads the servers' parameters as they are at that moment,
and workers of different speeds reach step k at different times, so their step-k
losses describe different models (a 1x worker's last evaluation is of the model
when it stopped, long before a 4x worker's last push). Each evaluation is then a
point of the job's one model in time: its time is the evaluating worker's
training time, its step the job's progress then (the mean over the workers of
the steps each had finished, halves rounded up; points of one step averaged), its final
held-out loss the last in time, and its time to the target that point's time
(`eval_time_to_target_s`), not seconds a step x steps.

What a run moves (`traffic`), from its own records, every byte on the wire counted once
over all processes: sync, N x what rank 0 sent (`sent_bytes`: the bytes of a rank's data
that reach the others, by each bucket's algorithm, collective/reducers/data_parallel.py
sent_bytes; runs over MPI's own or the naive all-reduce record none); async, every
worker's tensor bytes pushed and pulled. Communication rounds: sync, the collectives a
step ran (`comm_rounds`: local SGD 1 a round, PowerSGD 2 a step; a plain step's
bucketed all-reduce counts as 1, its buckets overlapping one backward); async, the steps
that pushed (a local SGD worker's round ends; every step otherwise). Per step: their means
over the steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The additive parts of a step, in ms: sync step_s = compute_s + wait_s + the loss
# average; async step_s = pull_s + compute_s + push_s.
SPLIT = ("compute", "comm", "pull", "other")


@dataclass
class Curve:
    loss: np.ndarray  # [K] mean over ranks/workers of step k's training loss
    smooth: np.ndarray  # [K] trailing mean of `loss` over `window` steps
    elapsed_s: np.ndarray  # [K] seconds of training (evaluations left out), slowest process
    samples: np.ndarray  # [K] samples seen after step k, all processes
    eval_steps: np.ndarray  # [E] steps (1-based) with a held-out loss
    eval_loss: np.ndarray  # [E] mean over processes of the held-out loss there
    eval_time_s: np.ndarray | None = None  # [E] training seconds of each evaluation
    bytes: np.ndarray | None = None  # [K] bytes on the wire after step k, all processes
    rounds: np.ndarray | None = None  # [K] communication rounds after step k


def window_for(steps: int) -> int:
    return max(1, steps // 20)


def curve(records: list[list[dict]], global_batch: int, window: int,
          in_time: bool = False) -> Curve:
    """records: one list of step records per rank (sync: rank 0's only) or worker;
    `in_time`: workers that do not move in step (the module docstring)."""
    k = min(len(r) for r in records)
    loss = np.array([[r[i]["loss"] for i in range(k)] for r in records]).mean(axis=0)  # [K]
    # seconds of training: each process's clock less the held-out evaluations it made
    # (measurement, not training; `eval_s` in the records that have one)
    elapsed = np.array([[r[i]["elapsed_s"] for i in range(k)] for r in records])  # [P, K]
    evals = np.cumsum([[r[i].get("eval_s", 0.0) for i in range(k)] for r in records], axis=1)
    elapsed = (elapsed - evals).max(axis=0)  # [K]
    sums = np.concatenate([[0.0], np.cumsum(loss)])  # [K+1]
    ends = np.arange(1, k + 1)
    starts = np.maximum(0, ends - window)
    smooth = (sums[ends] - sums[starts]) / (ends - starts)  # [K]
    if in_time:
        steps, held, when = evaluations_in_time(records, k)
    else:
        steps = sorted(set.intersection(*({r[i]["step"] for i in range(k)
                                           if "eval_loss" in r[i]} for r in records)))
        held = [np.mean([next(x["eval_loss"] for x in r if x["step"] == s) for r in records])
                for s in steps]
        when = elapsed[np.array(steps, dtype=int) - 1] if steps else np.zeros(0)
    return Curve(loss, smooth, elapsed, ends * global_batch, np.array(steps, dtype=int),
                 np.array(held), np.asarray(when, dtype=float))


def evaluations_in_time(records: list[list[dict]], k: int) -> tuple[list, list, list]:
    """Every worker's held-out evaluations as points of the job's one model (the module
    docstring): (steps [E], losses [E], training seconds [E]), in time order."""
    clocks = []  # per worker: [K] training seconds after each of its steps
    for r in records:
        elapsed = np.array([x["elapsed_s"] for x in r[:k]])
        clocks.append(elapsed - np.cumsum([x.get("eval_s", 0.0) for x in r[:k]]))
    points = []  # (seconds, job progress, loss)
    for w, r in enumerate(records):
        for i in range(k):
            if "eval_loss" in r[i]:
                t = clocks[w][i]  # the evaluating worker's own count below is i + 1
                done = [int(np.searchsorted(c, t, side="right")) for c in clocks]
                step = max(1, int(np.floor(np.mean(done) + 0.5)))  # halves up
                points.append((t, step, r[i]["eval_loss"]))
    points.sort()  # progress never falls as time goes on: steps come in order
    steps, held, when, count = [], [], [], []
    for t, step, loss in points:
        if steps and step == steps[-1]:  # one step of the job: its evaluations averaged
            count[-1] += 1
            held[-1] += (loss - held[-1]) / count[-1]
            when[-1] = t
        else:
            steps.append(step)
            held.append(loss)
            when.append(t)
            count.append(1)
    return steps, held, when


def measure(topology: str, records: list[list[dict]], global_batch: int, workers: int,
            consistency: str, floor: float | None, target: float) -> tuple[Curve, dict]:
    """The curve of one finished run and its numbers (see the module docstring)."""
    steps = min(len(r) for r in records)
    in_time = topology == "async" and consistency != "bsp" and len(records) > 1
    c = curve(records, global_batch, window_for(steps), in_time)
    time_s = float(c.elapsed_s[-1])
    tail = c.loss[-max(1, steps // 10):]
    final = float(tail.mean())
    reached = np.flatnonzero(c.smooth <= target)
    to_target = int(reached[0]) + 1 if reached.size else None
    per_step = time_s / steps
    # every async push is one update of every shard, except under BSP: one per round
    updates = steps * (workers if topology != "sync" and consistency != "bsp" else 1)
    held_reached = np.flatnonzero(c.eval_loss <= target)
    c.bytes, c.rounds = traffic(topology, records, workers)
    return c, {
        "final_eval_loss": float(c.eval_loss[-1]) if c.eval_loss.size else None,
        "eval_steps_to_target": (int(c.eval_steps[held_reached[0]]) if held_reached.size
                                 else None),
        "eval_time_to_target_s": (float(c.eval_time_s[held_reached[0]])
                                  if in_time and held_reached.size else None),
        "held_out": {"steps": c.eval_steps.tolist(), "loss": c.eval_loss.tolist(),
                     "time_s": c.eval_time_s.tolist()},  # the curve, for checks after the run
        "steps": steps,
        "time_s": time_s,
        "s_per_step": per_step,
        "steps_to_target": to_target,
        "time_to_target_s": per_step * to_target if to_target else None,
        "measured_time_to_target_s": float(c.elapsed_s[to_target - 1]) if to_target else None,
        "samples_to_target": int(c.samples[to_target - 1]) if to_target else None,
        "final_loss": final,
        "gap": None if floor is None else final - floor,
        "samples_per_s": steps * global_batch / time_s,
        "updates_per_s": updates / time_s,
        "split_ms": split_ms(topology, records),
        "allreduce_ms": (mean_ms(records, "comm_s") if topology == "sync" else None),
        # sync: a PipeDream pipeline's records carry each stage's (models/pipedream.py)
        "staleness": (staleness(records) if topology != "sync" or "staleness" in records[0][0]
                      else None),
        "pipeline": pipeline(records[0]),
        "traffic": None if c.bytes is None else {
            "bytes": float(c.bytes[-1]), "rounds": float(c.rounds[-1]),
            "bytes_per_step": float(c.bytes[-1]) / steps,
            "rounds_per_step": float(c.rounds[-1]) / steps,
            "bytes_to_target": (float(c.bytes[int(c.eval_steps[held_reached[0]]) - 1])
                                if held_reached.size else None)},
    }


def pipeline(records: list[dict]) -> dict | None:
    """A pipeline's bubble per step as measured by its first rank's records (the idle share
    of the stage's step, models/pipeline.py) and as its schedule's unit-time replay gives it
    (`bubble_replay`: PipeDream's runs, models/pipedream.py); None for a run without one."""
    measured = [r["bubble"] for r in records if "bubble" in r]
    if not measured:
        return None
    replay = [r["bubble_replay"] for r in records if "bubble_replay" in r]
    return {"bubble": float(np.mean(measured)),
            "bubble_replay": float(np.mean(replay)) if replay else None}


def traffic(topology: str, records: list[list[dict]],
            workers: int) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """Cumulative bytes on the wire and communication rounds after each step [K] (see the
    module docstring); (None, None) where the records do not say."""
    k = min(len(r) for r in records)
    if topology == "sync":
        mine = records[0][:k]
        if not all("sent_bytes" in r for r in mine):
            return None, None
        moved = np.array([workers * r["sent_bytes"] for r in mine], dtype=float)  # [K]
        rounds = np.array([r.get("comm_rounds", 1) for r in mine], dtype=float)  # [K]
    elif topology == "async":
        if not all("push_bytes" in r[i] for r in records for i in range(k)):
            return None, None
        moved = np.array([[r[i]["push_bytes"] + r[i]["pull_bytes"] for i in range(k)]
                          for r in records], dtype=float).sum(axis=0)  # [K]
        rounds = np.array([[r[i]["push_bytes"] > 0 for i in range(k)]
                           for r in records], dtype=float).mean(axis=0)  # [K]
    else:
        return None, None
    return np.cumsum(moved), np.cumsum(rounds)


def rounds(pushes: list[dict]) -> list[dict]:
    """A simulated run's push records (dtlab-train --simulate-workers: one per push, "round"
    1-based) as one record per round, the step of the async run it stands for: the mean
    loss of its pushes, the time and held-out loss at its last push, the summed step and
    compute times."""
    out: list[dict] = []
    for push in pushes:
        if not out or out[-1]["step"] != push["round"]:
            out.append({"step": push["round"], "losses": [], "step_s": 0.0, "compute_s": 0.0,
                        "staleness": []})
        r = out[-1]
        r["losses"].append(push["loss"])
        r["staleness"].append(push["staleness"])
        r["step_s"] += push["step_s"]
        r["compute_s"] += push["compute_s"]
        r["elapsed_s"] = push["elapsed_s"]
        for key in ("eval_loss", "eval_s"):
            if key in push:
                r[key] = push[key]
    for r in out:
        r["loss"] = float(np.mean(r.pop("losses")))
    return out


def mean_ms(records: list[list[dict]], key: str) -> float:
    return 1e3 * float(np.mean([r[key] for rs in records for r in rs]))


def mean_ms_or_0(records: list[list[dict]], key: str) -> float:
    """mean_ms of a field only some runs record (0 where absent)."""
    return 1e3 * float(np.mean([r.get(key, 0.0) for rs in records for r in rs]))


def split_ms(topology: str, records: list[list[dict]]) -> dict:
    """Mean ms per step of compute, comm (sync: the wait on the all-reduce after backward,
    what overlap did not hide; async: the push, with the next step's pull riding on it and
    the time the servers hold that pull under SSP/BSP), pull (async: a pull made on its own,
    the first step's) and the rest of the step."""
    step, compute = mean_ms(records, "step_s"), mean_ms(records, "compute_s")
    if topology == "sync":
        # local SGD's outer all-reduce runs in the optimizer's time, compression's coding
        # in the wait: each moved to where it belongs
        outer, coding = mean_ms_or_0(records, "outer_s"), mean_ms_or_0(records, "compress_s")
        comm, pull = mean_ms(records, "wait_s") - coding + outer, 0.0
        compute += coding - outer
    elif topology == "simulated":  # one process, no communication
        comm = pull = 0.0
    else:
        comm, pull = mean_ms(records, "push_s"), mean_ms(records, "pull_s")
    return {"compute": compute, "comm": comm, "pull": pull,
            "other": max(0.0, step - compute - comm - pull)}


def staleness(records: list[list[dict]]) -> dict:
    """Over every push of every worker to every shard: versions applied since it read."""
    values = np.array([s for rs in records for r in rs for s in r.get("staleness", [])])
    return {"mean": float(values.mean()),
            "p50": float(np.percentile(values, 50, method="inverted_cdf")),
            "p95": float(np.percentile(values, 95, method="inverted_cdf")),
            "max": int(values.max()), "pushes": int(values.size)}


def what_ran(topology: str, headers: list[dict], records: list[list[dict]]) -> dict:
    """What a run actually did, from its own metrics (not from its name): sync, the
    all-reduce each gradient bucket ran (its header's allreduce_buckets, as the
    communicator chose it); async, how each shard's tensors travelled (every path a
    worker recorded: at its first step and whenever it changed); both, the precision
    of compute and of the wire."""
    header = headers[0]
    run = header["config"]["run"]
    ran = {"precision": run.get("precision", "fp32"), "dtype": run.get("dtype"),
           "wire": header.get("wire", "fp32")}
    if topology == "sync":
        ran["allreduce"] = header.get("allreduce")
        ran["buckets"] = header.get("allreduce_buckets", [])
        ran["zero"] = header.get("zero", 0)
        ran["local_steps"] = header.get("local_steps", 0)  # collective/reducers/local_sgd.py
        ran["fragments"] = header.get("fragments", 0)  # Streaming DiLoCo
        ran["outer"] = header.get("outer")
        ran["compress"] = header.get("compress", "")  # collective/reducers/compress.py
        ran["error_feedback"] = header.get("error_feedback")
        z = header.get("zero_bytes")
        ran["memory"] = {"per_rank_bytes": z["total_bytes"] if z else
                         sum(header.get(k, 0) for k in ("param_bytes", "grad_bytes",
                                                        "optimizer_bytes",
                                                        "weight_version_bytes"))}
        ran["stage_weight_version_bytes"] = header.get("stage_weight_version_bytes")
    elif topology == "simulated":
        ran["simulated"] = {k: header.get(k) for k in ("simulate_workers", "staleness",
                                                       "staleness_lr", "schedule_steps")}
    else:
        seen: list = []
        for rs in records:
            for r in rs:
                if "paths" in r and r["paths"] not in seen:
                    seen.append(r["paths"])
        ran["paths"] = seen
        ran["local_steps"] = header.get("local_steps", 0)
        ran["dylu"] = header.get("dylu", False)  # speed-aware H (pserver/worker/dylu.py)
        ran["fragments"] = header.get("fragments", 0)  # Streaming DiLoCo (.../streaming.py)
        ran["outer"] = header.get("outer")  # the servers' (RegisterReply.outer_config)
        ran["compress"] = header.get("compress", "")
        ran["error_feedback"] = header.get("error_feedback")
        ran["memory"] = async_memory(header)
    return ran


# optimizer state bytes per float32 parameter (models/optim.py): Adam's two moments,
# SGD's momentum buffer when it has one
STATE_BYTES = {"adam": 8, "adamw": 8}


def async_memory(header: dict) -> dict:
    """What a worker and a shard hold, from the run's config (the formula, not a measure):
    a worker its parameters and gradients, a shard its slice of the parameters with their
    optimizer state."""
    optim, n = header["config"]["optim"], header["n_params"]
    state = STATE_BYTES.get(optim["optimizer"], 4 if optim.get("momentum") else 0)
    shards = max(1, len(header.get("servers", [])) or 1)
    return {"per_worker_bytes": 8 * n, "per_shard_bytes": (4 + state) * n / shards}


def ran_words(ran: dict) -> str:
    """what_ran in a few words, for a table cell."""
    if "simulated" in ran:
        s = ran["simulated"]
        return (f"{s['simulate_workers']} workers in one process, {s['staleness']} stale; "
                f"{ran['precision']}")
    if ran.get("zero"):
        return f"ZeRO stage {ran['zero']}; {ran['precision']}, {ran['wire']} wire"
    if ran.get("local_steps"):
        o = ran.get("outer") or {}
        name = o.get("outer_optimizer", "unrecorded")
        period = f" period {o['outer_period']}" if name == "delayed-nesterov" else ""
        how = "ring all-reduce of the change" if "buckets" in ran else "the change pushed"
        kind = (f"Streaming DiLoCo, {ran['fragments']} fragments" if ran.get("fragments")
                else "local SGD")
        steps = (f"speed-aware H (DyLU), H = {ran['local_steps']} for the fastest"
                 if ran.get("dylu") else f"{ran['local_steps']} steps a round")
        return (f"{kind}, {steps}, outer {name} lr "
                f"{o.get('outer_lr', float('nan')):g}{period}, momentum "
                f"{o.get('outer_momentum', float('nan')):g}; {ran['precision']}, {how}")
    if ran.get("compress"):
        ef = "error feedback" if ran["error_feedback"] else "no error feedback"
        if "buckets" not in ran:  # async: compressed pushes
            return f"{ran['compress']} ({ef}) pushes; {ran['precision']}"
        names = " + ".join(b["algorithm"] for b in ran["buckets"])
        return f"{ran['compress']} ({ef}) by {names}; {ran['precision']}"
    if "buckets" in ran:
        names = [b["algorithm"] for b in ran["buckets"]]
        how = ", ".join(f"{n} x{names.count(n)}" if names.count(n) > 1 else n
                        for n in dict.fromkeys(names)) or "-"
    else:
        how = " then ".join(" / ".join(dict.fromkeys(p)) for p in ran["paths"]) or "-"
    return f"{how}; {ran['precision']}, {ran['wire']} wire"


def memory_words(ran: dict) -> str:
    """MB a process holds: a sync rank's, or an async worker's and shard's."""
    m = ran.get("memory") or {}
    if "per_rank_bytes" in m:
        return f"{m['per_rank_bytes'] / 1e6:.3g}"
    if "per_worker_bytes" in m:
        return f"{m['per_worker_bytes'] / 1e6:.3g} / {m['per_shard_bytes'] / 1e6:.3g}"
    return "-"
