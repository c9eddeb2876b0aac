"""A calibration (calibration_fit.py's JSON) as the model's links: the measured host's all-reduce
constants by algorithm, its all-to-all and its parameter server's pull and push."""

from __future__ import annotations

from dtlab.lab.simulate.formulas import Network, RoundCPU, ServerLink
from dtlab.lab.simulate.links import Link
from dtlab.models.config import ConfigError

# the parameter-server data path a worker takes to shards on its own host (pserver/common/config.py)
LOCAL_PATH = "shm"
APPLY_NAME = {"adamw": "adam", "sgd-momentum": "sgd"}


def fitted(name: str, f: dict) -> Link:
    # the fits take gamma = beta (calibration_fit.py): the add is one more pass over memory
    return Link(name, f["alpha_s"], f["beta_s_per_byte"], f["beta_s_per_byte"])


def host_network(cal: dict, ranks: int) -> Network:
    """Up to `ranks` ranks, all on the calibrated host."""
    per_algo = {name: fitted(f"local {name}", f) for name, f in cal["allreduce"].items()}
    if not per_algo:
        raise ConfigError("the calibration has no all-reduce fit: add a bench allreduce JSON")
    base = per_algo.get("ring") or per_algo.get("halving") or next(iter(per_algo.values()))
    return Network(base, base, ranks, per_algo)


def host_p2p(cal: dict) -> Link:
    """A point-to-point message on this host: the ring all-reduce's fit (every ring step is
    one send and receive of n / N bytes; bench allreduce --ours ring measures it at
    every size), else halving-doubling's (its steps too are sends and receives)."""
    for name in ("ring", "halving"):
        if name in cal["allreduce"]:
            return fitted(f"local p2p ({name} fit)", cal["allreduce"][name])
    raise ConfigError("the calibration has no ring or halving all-reduce fit for the point to "
                      "point alpha-beta: add a bench allreduce --ours ring JSON")


def host_alltoall(cal: dict, which: str = "ours") -> Link:
    """The all-to-all(v) as bench moe measured it on this host (`which`: ours or mpi,
    dtlab-sync's --moe-alltoall)."""
    fit = cal.get("alltoall", {}).get(which)
    if fit is None:
        raise ConfigError(f"the calibration has no {which} all-to-all fit: add a "
                          "bench moe --only-ep --json JSON to --calibrate")
    return Link(f"local alltoall {which}", fit["alpha_s"], fit["beta_s_per_byte"])


def host_server(cal: dict, optimizer: str, path: str = LOCAL_PATH) -> ServerLink:
    """Pull and push as a training loop meets them: bench fanout's cold rounds over S
    shards (each half of the round, and the cost of each shard beyond the first) where the
    calibration has them for `path`, else bench_pserver's hot rounds on one shard; the
    shard's SGD apply is in the push, plus the apply time `optimizer` adds over SGD (its
    sweep rows), when measured."""
    fits = cal["pserver"].get(path)
    cold = cal.get("fanout", {}).get(path)
    if fits is None and cold is None:
        raise ConfigError(f"the calibration has no parameter-server fit for path {path!r}: add "
                          "a bench fanout or bench pserver --mode rounds JSON")
    apply = cal.get("apply_s_per_byte", {})
    name = APPLY_NAME.get(optimizer, optimizer)
    extra = max(0.0, apply[name] - apply["sgd"]) if name in apply and "sgd" in apply else 0.0
    if cold is not None:
        half = {"alpha_s": cold["alpha_s"] / 2, "beta_s_per_byte": cold["beta_s_per_byte"] / 2}
        cpu = RoundCPU(**{k: cold["cpu"][k] for k in ("alpha_s", "per_shard_s",
                                                      "beta_s_per_byte")}) \
            if "cpu" in cold else None
        return ServerLink(fitted(f"ps {path} cold pull", half),
                          fitted(f"ps {path} cold push", half), extra, cold["per_shard_s"], cpu)
    return ServerLink(fitted(f"ps {path} pull", fits["pull"]),
                      fitted(f"ps {path} push", fits["push"]), extra)


def preset_server(link: Link, cal: dict | None, optimizer: str) -> ServerLink:
    """Shards on hosts of their own behind `link`; the apply time of `optimizer` from the
    calibration when it has one (the servers' CPUs), else 0."""
    apply = (cal or {}).get("apply_s_per_byte", {})
    return ServerLink(link, link, apply.get(APPLY_NAME.get(optimizer, optimizer), 0.0))
