"""What every process of one run must agree on beyond the parameter layout: the run config.

A worker sends its run config when it registers (RegisterRequest.run_config,
JSON) and the server compares it with its own, field by field:

    {"model_name": "mlp",
     "model": {...},                    the model config, with the fields the data implies
     "data":  {...},                    the data config (the server never loads the data)
     "run":   {"seed": 0, "dtype": "float32"}}   initial weights and data order

A difference is refused with a message naming every differing field, so two
workers never train on different data or sources, and a worker never on a
model the servers do not hold. A section the server's record lacks (a bare
store, as the benchmark builds) is not compared; neither is an empty request.
"""

from __future__ import annotations

import dataclasses
import json

SECTIONS = ("model", "data", "run")
RUN_FIELDS = ("seed", "dtype")


def run_config(model_name: str, model_cfg, data_cfg, seed: int, dtype: str) -> dict:
    """The run config as a worker sends it and a server keeps it."""
    return {"model_name": model_name, "model": dataclasses.asdict(model_cfg),
            "data": dataclasses.asdict(data_cfg), "run": {"seed": seed, "dtype": dtype}}


def of_record(record: dict) -> dict:
    """The run config in a daemon's config record (pserver.server.daemon.config_record)."""
    server = record.get("server", {})
    out = {k: record[k] for k in ("model_name", "model", "data") if k in record}
    if all(k in server for k in RUN_FIELDS):
        out["run"] = {k: server[k] for k in RUN_FIELDS}
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
            if want.get(name) != got.get(name):
                out.append(f"{section}.{name}: worker {got.get(name)!r}, "
                           f"server {want.get(name)!r}")
    return out


def parse(text: str) -> dict:
    """RegisterRequest.run_config; ValueError if it is not a JSON object."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value
