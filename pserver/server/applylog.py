"""The apply log of one shard: every update it applied, in order, as JSON lines.

    python -m dtlab.pserver serve --config run.json --shard 0 --num-shards 2 \\
        --checkpoint-dir runs/ckpt --apply-log 'runs/apply.s{shard}.jsonl'

Per shard, an asynchronous run is the sequence of its updates (Dean et al.
2012, Downpour SGD; Ho et al. 2013 for SSP's bound):

    p_{v+1} = opt(p_v, mean_{i in C_v} g_i, lr_v)      g_i: the gradient of worker w_i's
                                                       batch of step s_i, computed on the
                                                       parameters it read (version r_i on
                                                       every shard)

where the contributors C_v (one push under ASP and SSP, a round under BSP)
and lr_v (the schedule, divided by the staleness v - r_i under
--staleness-lr divide) are decided by the store inside its lock
(pserver.server.store). The log writes exactly that, from inside the same
lock, in apply order; pserver.replay re-executes it in one process:

    {"type": "apply-log", "format": 1, "shard": 0, "num_shards": 2, "offset": 0,
     "size": 35, "model_size": 71, "layout_crc": ..., "version": 0, "optimizer_steps": 0,
     "consistency": "asp", "staleness_bound": 0, "staleness_lr": "none",
     "optim": {...}, "run_config": {...}, "server": {...}}
    {"shard": 0, "version": 1, "lr": 0.1, "contributors": [{"worker": 0, "step": 0,
     "read": 0}], "adler32": 1821347063}

`version` is the version the update produced; `read` the version of this
shard the contributor's gradient was computed on; `ranges` ([[lo, hi], ...],
relative to the shard) appears where the update covered only those ranges
(Mixture-of-Experts pushes, pserver.common.ranges; a BSP round: their union);
`adler32` is the Adler-32 of the shard's parameter bytes after the update,
so that a replay names the first update it does not reproduce. The header's
`run_config` is what Register compares workers against
(pserver.common.runconfig), `server` and `optim` the daemon's own flags.

Lines are buffered and written out when the daemon shuts down; one killed
before, or a write that fails (the update stands, the log stops), leaves a
log that ends early, which the replay names. Without --apply-log the store
holds no log and pays nothing; with it, each update adds one pass over the
shard's bytes for the digest.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from dtlab.models.config import ConfigError
from dtlab.pserver.common import runconfig
from dtlab.pserver.common.kernels import adler32
from dtlab.pserver.common.ranges import Ranges

log = logging.getLogger(__name__)

FORMAT = 1
HEADER = "apply-log"


def path_of(pattern: str, shard: int) -> str:
    """The log of shard `shard`: {shard} in `pattern` becomes its index."""
    return pattern.replace("{shard}", str(shard))


def digest(params: np.ndarray) -> int:
    """Adler-32 of the parameters' bytes (a contiguous array)."""
    return adler32(params)


class ApplyLog:
    """Writes the log of one shard's store; `applied` is called with the store's lock held."""

    def __init__(self, path: str, store, record: dict):
        self.path = path
        lay = store.layout
        header = {"type": HEADER, "format": FORMAT, "shard": lay.shard,
                  "num_shards": lay.num_shards, "offset": lay.offset, "size": lay.length,
                  "model_size": lay.model_size, "layout_crc": lay.layout_crc,
                  "version": store.version, "optimizer_steps": store.optimizer.steps,
                  "consistency": store.policy.mode, "staleness_bound": store.policy.staleness,
                  "staleness_lr": store.staleness_lr, "optim": record["optim"],
                  "run_config": runconfig.of_record(record), "server": record["server"]}
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "w")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise ConfigError(f"--apply-log {path}: {e.strerror}") from None
        self.shard = lay.shard
        self._f.write(json.dumps(header) + "\n")

    def applied(self, version: int, lr: float, contributions: list[tuple[int, int, int]],
                ranges: Ranges | None, params: np.ndarray) -> None:
        """Update `version` is applied: `contributions` (worker, step, version read) in the
        order the store added them, `params` the shard's parameters after it."""
        if self._f.closed:
            return
        line = {"shard": self.shard, "version": version, "lr": float(lr),
                "contributors": [{"worker": w, "step": s, "read": r}
                                 for w, s, r in contributions]}
        if ranges is not None:
            line["ranges"] = [list(r) for r in ranges]
        line["adler32"] = digest(params)
        try:
            self._f.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as e:  # the update stands; the log ends here, which a replay names
            log.error("--apply-log %s: %s; no more updates are logged", self.path, e)
            self.close()

    def close(self) -> None:
        try:
            self._f.close()
        except OSError as e:
            log.error("--apply-log %s: %s", self.path, e)


class ApplyLogError(ValueError):
    """A damaged or mismatched apply log; the message names the file and line."""


@dataclass(frozen=True)
class Contributor:
    worker: int
    step: int
    read: int  # the version of this shard its gradient was computed on


@dataclass(frozen=True)
class Update:
    version: int  # the version it produced
    lr: float
    contributors: tuple[Contributor, ...]
    ranges: Ranges | None
    adler32: int
    line: int  # in its file, counting from 1


def read(path: str) -> tuple[dict, list[Update]]:
    """(header, updates) of the log at `path`; ApplyLogError naming the file and line of
    the first fault: a truncated or non-JSON line, a missing field, another shard's line, a
    version out of sequence, a gradient read at a version the shard had not reached."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise ApplyLogError(f"{path}: {e.strerror}") from None
    if not lines:
        raise ApplyLogError(f"{path}: empty: not an apply log (no header line)")
    header = _json(path, 1, lines[0])
    if header.get("type") != HEADER or header.get("format") != FORMAT:
        raise ApplyLogError(f"{path} line 1: not an apply log header (type {HEADER!r}, "
                            f"format {FORMAT} expected)")
    try:
        shard, version = int(header["shard"]), int(header["version"])
    except (KeyError, TypeError, ValueError) as e:
        raise ApplyLogError(f"{path} line 1: header without {e}") from None
    updates = []
    for n, text in enumerate(lines[1:], start=2):
        value = _json(path, n, text)
        if value.get("shard") != shard:
            raise ApplyLogError(f"{path} line {n}: an update of shard {value.get('shard')}, "
                                f"the header's is {shard}")
        u = _update(path, n, value)
        if u.version != version + 1:
            raise ApplyLogError(f"{path} line {n}: version {u.version}, expected {version + 1} "
                                "(a line missing, repeated or out of order)")
        late = [c for c in u.contributors if c.read > version]
        if late:
            raise ApplyLogError(f"{path} line {n}: worker {late[0].worker} step {late[0].step} "
                                f"read version {late[0].read}, but update {u.version} applied "
                                f"at version {version}")
        updates.append(u)
        version = u.version
    return header, updates


def _json(path: str, n: int, text: str) -> dict:
    if not text.endswith("\n"):
        raise ApplyLogError(f"{path} line {n}: truncated (no end of line: the daemon stopped "
                            "before closing its log?)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApplyLogError(f"{path} line {n}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ApplyLogError(f"{path} line {n}: not a JSON object")
    return value


def _update(path: str, n: int, value: dict) -> Update:
    try:
        contributors = tuple(Contributor(int(c["worker"]), int(c["step"]), int(c["read"]))
                             for c in value["contributors"])
        ranges = value.get("ranges")
        update = Update(int(value["version"]), float(value["lr"]), contributors,
                        None if ranges is None else [(int(lo), int(hi)) for lo, hi in ranges],
                        int(value["adler32"]), n)
    except (KeyError, TypeError, ValueError) as e:
        raise ApplyLogError(f"{path} line {n}: not an update ({type(e).__name__}: {e})") from None
    if not contributors:
        raise ApplyLogError(f"{path} line {n}: update {update.version} has no contributors")
    return update
