"""dtlab-replay: an asynchronous run re-executed in one process from its shards' apply logs.

    python -m dtlab.pserver serve --config run.json --shard K --num-shards 2 ... \\
        --checkpoint-dir runs/ckpt --apply-log 'runs/apply.s{shard}.jsonl'
    python -m dtlab.pserver.worker --config run.json ... --metrics 'runs/w{worker}.jsonl'
    python -m dtlab.pserver.replay --config runs/w0.jsonl \\
        --apply-log 'runs/apply.s{shard}.jsonl' --checkpoint-dir runs/ckpt

The async counterpart of "BSP equals synchronous SGD": every shard's update

    p_{v+1} = opt(p_v, mean_{i in C_v} g_i, lr_v)

(pserver.server.applylog) is computed again here, in the order each shard
applied them, and the shards must end where the servers ended, bit for bit.
g_i is worker w_i's gradient of its batch of step s_i (the seeded sharded
loader a worker reads: rank w_i mod W of W, at step s_i, as a rejoining worker
skips to it, pserver.worker.loop.skip_to), computed on the parameters it read:
every shard's, each at the version that shard's log records for (w_i, s_i),
and clipped by --clip as the worker does. The mean is the store's own
(pserver.server.consistency.Round, in the order the round received the
pushes) and the step the store's own optimizer object, built as the daemon
builds it (pserver.server.daemon.build_store: the blocks of
pserver.server.cache_blocked), with the logged lr, which must also be the one the
schedule and --staleness-lr give. Versions still to be read are kept; the
others are dropped.

Each update's result is checked against the Adler-32 the server logged, and
at the end every shard's parameters against the servers' final checkpoint
(the newest in --checkpoint-dir, written at shutdown: its version must be
the log's last). Prints per shard the max |difference| from it; exit 0 when
every shard is equal and every update reproduced, 1 otherwise, naming the
first update (shard, version, log line, its contributors) that differs.

The run config is --config: a worker's metrics file (its header: model,
data, batch size, seed, dtype, --clip, and the number of workers the data
was split among) or the run's config file, with the model and data flags;
it must be the run config the servers recorded (pserver.common.runconfig).
A damaged or mismatched log (a missing shard, a shard count or layout that
disagrees, a truncated or changed line) is an error naming the file and the
line. Not replayed: --precision fp16/bf16 (a worker's loss scale is its own
state), --wire fp16/bf16 (rounded transfers), worker groups (--tp/--pp), a
resumed server, local SGD (--local-steps: a push is H steps' outer gradient).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from dataclasses import dataclass

import numpy as np

from dtlab.models import backend
from dtlab.models.config import ConfigError, add_flags, build, described, from_namespace
from dtlab.models.data import ShardedLoader
from dtlab.models.optim import OptimConfig
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.cli import command_name, run_cli
from dtlab.models.run.session import Session, build_session, parse
from dtlab.models.zoo import config_class
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import runconfig
from dtlab.pserver.common.config import ServerConfig
from dtlab.pserver.common.errors import FailedPrecondition
from dtlab.pserver.common.ranges import gather
from dtlab.pserver.server import checkpoint
from dtlab.pserver.server.applylog import ApplyLogError, Update, digest, path_of, read
from dtlab.pserver.server.consistency import Round
from dtlab.pserver.server.daemon import build_store
from dtlab.pserver.server.store import ShardStore
from dtlab.pserver.worker.loop import skip_to

RUN_FLAGS = ("batch_size", "grad_accum", "seed", "dtype")  # what a worker's gradient depends on


@dataclass
class ReplayConfig:
    apply_log: str = described("", "the shards' apply logs (python -m dtlab.pserver serve "
                                   "--apply-log); {shard} stands for the shard index")
    checkpoint_dir: str = described("", "the servers' --checkpoint-dir: each shard's newest "
                                        "checkpoint (written at shutdown) holds the final "
                                        "parameters the replay must reach")
    num_workers: int = described(0, "workers the data was split among (0: the --config "
                                    "metrics header's, else the servers' --num-workers, else 1)")

    def validate(self):
        for name in ("apply_log", "checkpoint_dir"):
            if not getattr(self, name):
                raise ConfigError(f"--{name.replace('_', '-')} is required")
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers must not be negative (got {self.num_workers})")


class ReplayError(ValueError):
    """The logs cannot be replayed as they are (the message names file, line and update)."""


@dataclass
class Shard:
    """One shard being replayed: its log, its store, the versions still to be read."""

    path: str
    header: dict
    updates: list[Update]
    store: ShardStore
    done: int = 0  # updates replayed
    kept: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # version -> params
    difference: str = ""  # the first update not reproduced, in words

    @property
    def version(self) -> int:
        return self.header["version"] + self.done

    @property
    def bounds(self) -> tuple[int, int]:
        return self.header["offset"], self.header["offset"] + self.header["size"]

    def where(self, u: Update) -> str:
        who = ", ".join(f"worker {c.worker} step {c.step} read {c.read}" for c in u.contributors)
        return f"shard {self.header['shard']} update {u.version} ({self.path} line {u.line}: {who})"


def read_logs(pattern: str) -> list[tuple[str, dict, list[Update]]]:
    """(path, header, updates) of every shard, shard 0's header giving their number;
    ApplyLogError where one is missing or disagrees with shard 0's."""
    first = path_of(pattern, 0)
    logs = [(first, *read(first))]
    base = logs[0][1]
    count = int(base["num_shards"])
    if count > 1 and "{shard}" not in pattern:
        raise ConfigError(f"--apply-log {pattern}: {first} is shard 0 of {count}; put {{shard}} "
                          "in the path for the others")
    for k in range(1, count):
        logs.append((path_of(pattern, k), *read(path_of(pattern, k))))
    at = 0
    for k, (path, header, _) in enumerate(logs):
        for name in ("num_shards", "model_size", "layout_crc", "consistency", "optim",
                     "run_config"):
            if header.get(name) != base.get(name):
                raise ApplyLogError(f"{path} line 1: {name} {header.get(name)!r}, but shard 0's "
                                    f"log ({first}) has {base.get(name)!r}: not the same run")
        if header["shard"] != k or header["offset"] != at:
            raise ApplyLogError(f"{path} line 1: shard {header['shard']} at element "
                                f"{header['offset']}, expected shard {k} at {at}")
        if header["version"] != 0:
            raise ApplyLogError(f"{path} line 1: the shard started at version "
                                f"{header['version']} (a resumed server); a replay needs the run "
                                "from its start")
        at += header["size"]
    if at != base["model_size"]:
        raise ApplyLogError(f"{logs[-1][0]} line 1: the shards end at element {at} of the "
                            f"model's {base['model_size']}")
    return logs


def metrics_header(path: str) -> dict:
    """The header of the async worker's metrics file `path` ({} for a run config file)."""
    with open(path) as f:
        first = f.readline()
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        return {}
    ok = isinstance(header, dict) and header.get("type") == "header"
    return header if ok and header.get("topology") == "async" else {}


class Replay:
    """The updates of every shard, each once the parameters its gradients read exist."""

    def __init__(self, session: Session, shards: list[Shard], world: int):
        self.s, self.shards, self.world = session, shards, world
        self.reads: dict[tuple[int, int], list[int | None]] = {}  # (worker, step) -> per shard
        lines: dict[tuple[int, int, int], int] = {}
        for k, shard in enumerate(shards):
            for u in shard.updates:
                for c in u.contributors:
                    seen = lines.setdefault((k, c.worker, c.step), u.line)
                    if seen != u.line:
                        raise ApplyLogError(f"{shard.path} line {u.line}: worker {c.worker} "
                                            f"step {c.step} again (line {seen}): a step is "
                                            "applied once")
                    self.reads.setdefault((c.worker, c.step), [None] * len(shards))[k] = c.read
        for (w, step), reads in self.reads.items():
            if None in reads:
                k = reads.index(None)
                raise ApplyLogError(f"{shards[k].path}: no update of worker {w} step {step}, "
                                    "which the other shards applied: a worker pushes every "
                                    "step to every shard")
        # readers[k][v]: gradients still to compute on version v of shard k
        self.readers = [Counter(reads[k] for reads in self.reads.values())
                        for k in range(len(shards))]
        self.grads: dict[tuple[int, int], tuple[np.ndarray, int]] = {}  # -> (grad, uses left)
        self.loaders: dict[int, ShardedLoader] = {}
        self.first = ""  # the first update not reproduced, in the order replayed
        self.host = np.empty(session.params.size, session.params.dtype)
        for k, shard in enumerate(shards):
            self._keep(k, shard)

    def run(self) -> None:
        """Every update of every shard; ReplayError where none can go on."""
        while any(sh.done < len(sh.updates) for sh in self.shards):
            moved = False
            for k, shard in enumerate(self.shards):
                while shard.done < len(shard.updates) and self._ready(shard.updates[shard.done]):
                    self._apply(k, shard, shard.updates[shard.done])
                    moved = True
            if not moved:
                raise ReplayError("no update can be replayed: " + "; ".join(self._blocked()))

    def _ready(self, u: Update) -> bool:
        return all(self._missing(c.worker, c.step) is None for c in u.contributors)

    def _missing(self, worker: int, step: int) -> tuple[int, int] | None:
        """(shard, version) the gradient of (worker, step) reads and the replay has not
        reached yet; None when it can be computed (or was)."""
        if (worker, step) in self.grads:
            return None
        for j, v in enumerate(self.reads[(worker, step)]):
            if v > self.shards[j].version:
                return j, v
        return None

    def _blocked(self) -> list[str]:
        out = []
        for shard in self.shards:
            if shard.done == len(shard.updates):
                continue
            u = shard.updates[shard.done]
            for c in u.contributors:
                missing = self._missing(c.worker, c.step)
                if missing is not None:
                    j, v = missing
                    out.append(f"{shard.where(u)} needs shard {j} at version {v} for worker "
                               f"{c.worker} step {c.step}, and shard {j} is at "
                               f"{self.shards[j].version}")
                    break
        return out

    def _keep(self, k: int, shard: Shard) -> None:
        """A copy of shard k's parameters now, if a gradient still reads this version."""
        if self.readers[k][shard.version]:
            shard.kept[shard.version] = shard.store.params.copy()

    def _gradient(self, worker: int, step: int) -> np.ndarray:
        """(worker, step)'s flat gradient on the host, as the worker pushed it; the first
        shard to use it computes it."""
        key = (worker, step)
        if key not in self.grads:
            s, reads = self.s, self.reads[key]
            for j, (shard, v) in enumerate(zip(self.shards, reads, strict=True)):
                lo, hi = shard.bounds
                self.host[lo:hi] = shard.kept[v]
                self.readers[j][v] -= 1
                if not self.readers[j][v]:
                    del shard.kept[v]
            s.params.load(self.host)
            s.replica.compute_grads(self._batch(worker, step))
            s.model.clip_grad_norm(s.params, s.setup.optim.clip)
            self.grads[key] = (backend.to_host(s.params.grad).copy(), len(self.shards))
        grad, uses = self.grads.pop(key)
        if uses > 1:
            self.grads[key] = (grad, uses - 1)
        return grad

    def _batch(self, worker: int, step: int) -> list:
        """The micro-batches worker `worker` reads at step `step` (pserver.worker.loop)."""
        if worker not in self.loaders:
            run = self.s.setup.run
            self.loaders[worker] = ShardedLoader(self.s.dataset, run.batch_size,
                                                 rank=worker % self.world, world=self.world,
                                                 seed=run.seed, micro_batches=run.grad_accum)
        loader = self.loaders[worker]
        skip_to(dataclasses.replace(self.s, loader=loader), step)
        return loader.next()

    def _apply(self, k: int, shard: Shard, u: Update) -> None:
        """Update u of shard k as its store made it (ShardStore.push, _apply_round, _apply)."""
        store, (lo, hi) = shard.store, shard.bounds
        grads = [self._gradient(c.worker, c.step)[lo:hi] for c in u.contributors]
        if shard.header["consistency"] == "bsp":
            rnd = Round(np.zeros_like(store.params))
            for c, g in zip(u.contributors, grads, strict=True):
                try:
                    rnd.add(c.worker, c.step, c.read, g)
                except FailedPrecondition as e:
                    raise ApplyLogError(f"{shard.path} line {u.line}: {e}") from None
            grad = rnd.mean()
        elif len(grads) == 1:
            grad = grads[0]
        else:
            raise ApplyLogError(f"{shard.path} line {u.line}: {len(grads)} contributors to one "
                                f"update under {shard.header['consistency']} (one each)")
        lr = store.schedule(store.optimizer.steps)
        if store.staleness_lr == "divide":
            lr /= max(1, *(u.version - 1 - c.read for c in u.contributors))
        if u.ranges is None:
            store.optimizer.step(store.params, grad, u.lr)
        else:
            store.optimizer.step_ranges(store.params, gather(grad, u.ranges), u.ranges, u.lr)
        shard.done += 1
        got = digest(store.params)
        if not shard.difference and lr != u.lr:
            shard.difference = (f"{shard.where(u)}: lr {u.lr!r} logged, the schedule "
                                f"{'and --staleness-lr ' if store.staleness_lr != 'none' else ''}"
                                f"give {lr!r}")
        elif not shard.difference and got != u.adler32:
            shard.difference = (f"{shard.where(u)}: the parameters after it differ from the "
                                f"server's (Adler-32 {got:#010x} replayed, {u.adler32:#010x} "
                                "logged)")
        self.first = self.first or shard.difference
        self._keep(k, shard)


def build_shards(logs: list[tuple[str, dict, list[Update]]]) -> list[Shard]:
    """Each shard's store as its daemon built it, from the config its log's header records."""
    shards = []
    for path, header, updates in logs:
        run = header["run_config"]
        name = run["model_name"]
        try:
            cfg = build(ServerConfig, dict(header["server"]))
            model_cfg = build(config_class(name), dict(run["model"]))
            optim = build(OptimConfig, dict(header["optim"]))
        except (ConfigError, KeyError, TypeError) as e:
            raise ApplyLogError(f"{path} line 1: a header this replay cannot rebuild the shard "
                                f"from ({e})") from None
        shards.append(Shard(path, header, updates, build_store(cfg, name, model_cfg, optim)))
    return shards


def check_run(session: Session, header: dict, given: dict, config: str) -> None:
    """ConfigError where --config (and flags) is not the run the logs record."""
    setup = session.setup
    mine = runconfig.run_config(setup.model_name, setup.model, setup.data, setup.run.seed,
                                setup.run.dtype)
    diffs = runconfig.differences(header["run_config"], mine)
    if diffs:
        raise ConfigError(f"--config {config or '(none)'} and the flags are not the run the "
                          "apply logs record (replay is the worker side): " + "; ".join(diffs))
    if wire.layout_crc(session.params.specs) != header["layout_crc"]:
        raise ConfigError("the model's parameter layout is not the one the apply logs record")
    if setup.run.precision != "fp32":
        raise ConfigError(f"--precision {setup.run.precision}: a worker's loss scale is its own "
                          "state, not in the logs; replay runs --precision fp32 runs")
    if given.get("wire", "fp32") != "fp32":
        raise ConfigError(f"the workers ran --wire {given['wire']} (rounded transfers); replay "
                          "runs --wire fp32 runs")
    outer = header["server"].get("outer_optimizer", "none")
    if given.get("local_steps") or outer != "none":
        raise ConfigError("the workers ran --local-steps "
                          f"{given.get('local_steps', '?')} (the servers' --outer-optimizer "
                          f"{outer}): a push is an outer gradient of H inner steps, not one "
                          "step's gradient; replay runs one-step pushes only")


def final_params(root: str, shard: Shard) -> tuple[str, np.ndarray]:
    """(path, parameters) of the shard's newest checkpoint, which must be of the log's end."""
    store = shard.store
    path = checkpoint.latest(root, store.layout)
    if path is None:
        raise ReplayError(f"--checkpoint-dir {root}: no checkpoint of shard "
                          f"{store.layout.shard} ({checkpoint.shard_dir(root, store.layout)})")
    state = checkpoint.load(path, store.layout, shard.header["optim"]["optimizer"])
    if state["version"] != shard.version:
        raise ReplayError(f"{path}: the checkpoint is of version {state['version']}, the apply "
                          f"log {shard.path} ends at version {shard.version}: not the same "
                          "moment of the run")
    return path, state["params"]


def main(argv: list[str]) -> int:
    prog = command_name("dtlab.pserver.replay")
    setup = parse(argv, prog=prog, description=__doc__.split("\n\n")[0],
                  add_extra=lambda p: add_flags(p, ReplayConfig, "replay"),
                  flags={"data": None, "run": RUN_FLAGS, "optim": ("clip",)},
                  why="a replay takes what a worker's gradient depends on; the rest comes from "
                      "the apply logs")
    cfg = from_namespace(ReplayConfig, setup.extra)
    given = metrics_header(setup.config_file) if setup.config_file else {}
    logs = read_logs(cfg.apply_log)
    header = logs[0][1]
    session = build_session(setup)
    check_run(session, header, given, setup.config_file)
    world = cfg.num_workers or given.get("world") or header["server"].get("num_workers") or 1
    shards = build_shards(logs)
    replay = Replay(session, shards, world)
    replay.run()
    same = True
    for shard in shards:
        path, final = final_params(cfg.checkpoint_dir, shard)
        diff = float(np.max(np.abs(final.astype(np.float64) - shard.store.params), initial=0.0))
        same = same and diff == 0.0 and not shard.difference
        print(f"shard {shard.header['shard']}: {len(shard.updates)} updates replayed; max "
              f"|difference| from {path}: {diff:.3g}"
              + (" (bit for bit)" if diff == 0.0 and not shard.difference else ""))
    if replay.first:
        print(f"first difference: {replay.first}")
    return 0 if same else 1


def cli(argv: list[str] | None = None) -> int:
    return run_cli(main, command_name("dtlab.pserver.replay"), argv=argv,
                   user_errors=(ApplyLogError, ReplayError, CheckpointError, OSError))


if __name__ == "__main__":
    sys.exit(cli())
