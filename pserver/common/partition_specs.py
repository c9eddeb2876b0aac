"""A model-parallel partition's parameter specs as they travel at Register
(RegisterRequest.partition.specs): deterministic JSON both ends build and read
(pserver.worker.group_worker sends them, pserver.server.partitions checks them)."""

from __future__ import annotations

import json

from dtlab.models.params import ParamSpec


def _slice(s: slice) -> list:
    return [s.start, s.stop, s.step]


def specs_json(specs: list[ParamSpec]) -> str:
    """A partition's specs as the JSON of PartitionLayout.specs (deterministic text)."""
    out = []
    for s in specs:
        out.append({"name": s.name, "shape": list(s.shape), "init": s.init, "std": s.std,
                    "decay": s.decay,
                    "full_shape": None if s.full_shape is None else list(s.full_shape),
                    "index": None if s.index is None else [_slice(i) for i in s.index],
                    "view": None if s.view is None else list(s.view), "split": s.split})
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise ValueError(f"{what} must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def specs_from_json(text: str) -> list[ParamSpec]:
    """PartitionLayout.specs back to ParamSpecs; ValueError naming what is malformed."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(items, list) or not items:
        raise ValueError("expected a non-empty list of parameter specs")
    specs = []
    for i, d in enumerate(items):
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            raise ValueError(f"spec {i}: expected an object with a name")
        name = d["name"]
        index = d.get("index")
        if index is not None:
            if not isinstance(index, list) or not all(
                    isinstance(t, list) and len(t) == 3
                    and all(v is None or isinstance(v, int) for v in t) for t in index):
                raise ValueError(f"{name}: index must be a list of [start, stop, step]")
            index = tuple(slice(*t) for t in index)
        full = d.get("full_shape")
        view = d.get("view")
        specs.append(ParamSpec(
            name=name, shape=_ints(d.get("shape"), f"{name}: shape"),
            init=str(d.get("init", "normal")), std=float(d.get("std", 0.02)),
            decay=bool(d.get("decay", True)),
            full_shape=None if full is None else _ints(full, f"{name}: full_shape"),
            index=index, view=None if view is None else _ints(view, f"{name}: view"),
            split=str(d.get("split", ""))))
    return specs
