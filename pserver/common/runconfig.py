"""What every process of one run must agree on beyond the parameter layout: the run config.

A worker sends its run config when it registers (RegisterRequest.run_config,
JSON) and the server compares it with its own, field by field:

    {"model_name": "mlp",
     "model": {...},                    the model config, with the fields the data implies
     "data":  {...},                    the data config (the server never loads the data)
     "run":   {"seed": 0, "dtype": "float32",   initial weights and data order
               "steps": 600}}                   the run's length in worker steps

A difference is refused with a message naming every differing field, so two
workers never train on different data or sources, and a worker never on a
model the servers do not hold. A section the server's record lacks (a bare
store, as the benchmark builds) is not compared; neither is an empty request.

Run length. The servers own the lr schedule: warm-up, then cosine decay over
`schedule_steps` updates, which is one update per worker step under BSP and
one per push of each of --num-workers workers otherwise. So the servers'
horizon in worker steps is

    H = schedule_steps / (1 under BSP, else max(1, num_workers))

(the run config's --steps when the servers took it from --config), and a
worker that runs S != H steps follows another lr schedule than a synchronous
run of S steps. The servers state H as run.steps where their lr depends on it
(a cosine schedule longer than its warm-up: `horizon`), and a worker states S;
run.steps is compared only where both do (a worker of a constant schedule,
such as local SGD's outer optimizer, or a client that does not say its
length, is not checked).
"""

from __future__ import annotations

import dataclasses
import json

SECTIONS = ("model", "data", "run")
RUN_FIELDS = ("seed", "dtype")


def run_config(model_name: str, model_cfg, data_cfg, seed: int, dtype: str,
               steps: int | None = None) -> dict:
    """The run config as a worker sends it and a server keeps it; `steps`: the worker's
    run length (None: not stated, not checked)."""
    run = {"seed": seed, "dtype": dtype, **({} if steps is None else {"steps": steps})}
    return {"model_name": model_name, "model": dataclasses.asdict(model_cfg),
            "data": dataclasses.asdict(data_cfg), "run": run}


def horizon(record: dict) -> int | float | None:
    """The worker steps the servers' lr schedule spans (module docstring: H), None where
    their lr does not depend on the run's length (a constant schedule, or none longer
    than its warm-up). A whole number where the updates divide evenly among the steps."""
    server, optim = record.get("server", {}), record.get("optim", {})
    updates = server.get("schedule_steps", 0)
    if optim.get("schedule", "constant") == "constant" or updates <= optim.get("warmup", 0):
        return None
    per_step = 1 if server.get("consistency") == "bsp" else max(1, server.get("num_workers", 0))
    return updates // per_step if updates % per_step == 0 else updates / per_step


def of_record(record: dict) -> dict:
    """The run config in a daemon's config record (pserver.server.daemon.config_record)."""
    server = record.get("server", {})
    out = {k: record[k] for k in ("model_name", "model", "data") if k in record}
    if all(k in server for k in RUN_FIELDS):
        out["run"] = {k: server[k] for k in RUN_FIELDS}
        steps = horizon(record)
        if steps is not None:
            out["run"]["steps"] = steps
    return out


def differences(server: dict, worker: dict) -> list[str]:
    """'section.field: worker X, server Y' for every field the two configs disagree on."""
    if "model_name" in server and worker.get("model_name") != server["model_name"]:
        return [f"model_name: worker {worker.get('model_name')!r}, "
                f"server {server['model_name']!r}"]
    out = []
    for section in SECTIONS:
        if section not in server:
            continue
        want, got = server[section], worker.get(section, {})
        for name in sorted(set(want) | set(got)):
            if (section, name) == ("run", "steps"):
                if "steps" in want and "steps" in got and want["steps"] != got["steps"]:
                    out.append(f"run.steps: worker {got['steps']!r}, server {want['steps']!r} "
                               "(the servers' lr schedule spans that many steps of each "
                               "worker: run as many, or start the servers with the worker's "
                               "--steps)")
            elif want.get(name) != got.get(name):
                out.append(f"{section}.{name}: worker {got.get(name)!r}, "
                           f"server {want.get(name)!r}")
    return out


def parse(text: str) -> dict:
    """RegisterRequest.run_config; ValueError if it is not a JSON object."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value
