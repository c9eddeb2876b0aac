"""Known results as presets: `dtlab-compare --preset NAME` runs a reproduction with its
expected outcome stated, and the report says whether this run bore it out.

    dtlab-compare --preset bsp-equals-sync
    dtlab-compare --preset asp-tuned               # the default model, tuned, 3 seeds
    dtlab-compare --preset staleness-lr --steps 300
    dtlab-compare --preset diloco                  # sync-ring vs DiLoCo H = 10, 50
    dtlab-compare --preset backup-workers          # BSP, BSP + 1 backup, ASP; delays
    dtlab-compare --preset error-feedback          # top-1% and sign, with and without EF
    dtlab-compare --preset streaming-diloco        # DiLoCo H = 30 vs 3 fragments, int4
    dtlab-compare --preset onebit-adam             # Adam vs 1-bit Adam
    dtlab-compare --preset heterogeneous           # workers 1x, 1x, 2x, 4x slow
    dtlab-compare --preset heterogeneous-drawn     # 8 workers, speeds drawn (lognormal)
    dtlab-compare --preset speed-aware-h           # sync DiLoCo vs async fixed H, DyLU

Each preset is a set of flags put before the ones given (a flag given wins; a --tune
given replaces the preset's grid) and a check of the expectation on the summary. What a
check says is a measurement, not a verdict on the paper: where it does not hold, the
report says what was measured instead, and why it may differ (model, scale, optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtlab.lab.compare.study import held_time_to_target
from dtlab.models.config import ConfigError
from dtlab.models.run.metrics import read_metrics


@dataclass(frozen=True)
class Reproduction:
    flags: tuple[str, ...]
    expected: str
    check: Callable[[dict, Path], tuple[bool, str]]  # (summary, OUT) -> (held, measured)


def _method(summary: dict, name: str) -> dict:
    return next(m for m in summary["methods"] if m["name"] == name)


def _bsp_equals_sync(summary: dict, out: Path) -> tuple[bool, str]:
    def losses(name: str) -> list[float]:
        files = sorted(out.glob(f"{name}.jsonl")) or sorted(out.glob(f"{name}.w*.jsonl"))
        per = [[r["loss"] for r in read_metrics(str(f))[1]] for f in files]
        return [sum(x) / len(x) for x in zip(*per, strict=True)]
    sync, bsp = losses("sync-ring"), losses("async-bsp")
    differ = [i + 1 for i, (a, b) in enumerate(zip(sync, bsp, strict=True)) if a != b]
    if not differ:
        return True, f"equal at all {len(sync)} steps"
    return False, f"{len(differ)} of {len(sync)} steps differ, the first at step {differ[0]}"


def _asp_tuned(summary: dict, out: Path) -> tuple[bool, str]:
    sync, asp = _method(summary, "sync-ring"), _method(summary, "async-asp")
    a, s = asp["samples_to_target"], sync["samples_to_target"]
    if s is None:
        return False, "sync-ring reached no target: nothing to compare with"
    if a is None:
        return False, (f"async-asp reached the target with none of its seeds (best lr "
                       f"{asp['best'].get('lr', '-')})")
    ratio = a["mean"] / s["mean"]
    return ratio <= 1.5, (f"async-asp at lr {asp['best'].get('lr')} needed {ratio:.2f}x the "
                          f"samples of sync-ring at lr {sync['best'].get('lr')} "
                          f"({a['mean']:,.0f} against {s['mean']:,.0f}; "
                          f"{asp['reached']}/{len(asp['seeds'])} seeds reached it)")


def _staleness_lr(summary: dict, out: Path) -> tuple[bool, str]:
    plain, div = _method(summary, "async-asp"), _method(summary, "async-asp-div")

    def at_largest(m: dict) -> tuple[float, float]:
        top = max(m["tuning"], key=lambda t: t["point"]["lr"])
        return top["point"]["lr"], top["final_eval_loss"]
    lr, p = at_largest(plain)
    _, d = at_largest(div)
    if p is None or d is None:
        return False, f"a run at lr {lr:g} failed"
    return d <= p, (f"at the grid's largest lr {lr:g}: final held-out loss {d:.4f} with lr / "
                    f"staleness against {p:.4f} without")


def _async_momentum(summary: dict, out: Path) -> tuple[bool, str]:
    sync, asp = _method(summary, "sync-ring"), _method(summary, "async-asp")
    ms, ma = sync["best"]["momentum"], asp["best"]["momentum"]
    return ma <= ms, f"best momentum: async-asp {ma:g}, sync-ring {ms:g}"


def _final(summary: dict, name: str) -> list[dict]:
    """The stats of `name`'s final runs: a study's evaluation seeds, or the one run of a
    comparison without one; ValueError naming it when one failed or none ran."""
    runs = [r for r in summary["runs"] if r["name"] == name and r.get("phase", "seed") == "seed"]
    if not runs or any(r["status"] != "ok" for r in runs):
        raise ValueError(f"{name} did not finish")
    return [r["stats"] for r in runs]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _held_loss(summary: dict, name: str) -> float:
    """The mean over its final runs of a method's last held-out loss."""
    return _mean([s["final_eval_loss"] for s in _final(summary, name)])


def _diloco(summary: dict, out: Path) -> tuple[bool, str]:
    base, h10, h50 = (_held_loss(summary, n) for n in ("sync-ring", "sync-diloco10",
                                                          "sync-diloco50"))
    rounds = [_mean([s["traffic"]["rounds_per_step"] for s in _final(summary, n)])
              for n in ("sync-ring", "sync-diloco50")]
    fewer, off = rounds[0] / rounds[1], (h50 - base) / base
    held = abs(off) <= 0.05 and fewer >= 45
    return held, (f"final held-out loss at equal samples: H = 1 (sync-ring) {base:.4f}, "
                  f"H = 10 {h10:.4f}, H = 50 {h50:.4f} ({100 * off:+.1f}% against H = 1; "
                  f"within 5% needed) with {fewer:.0f}x fewer communication rounds")


def _backup_workers(summary: dict, out: Path) -> tuple[bool, str]:
    def to_target(name: str) -> tuple[float | None, float | None]:
        """Mean held-out time and samples to the target over the runs that reached it."""
        stats = [s for s in _final(summary, name) if s["eval_steps_to_target"] is not None]
        if not stats:
            return None, None
        return (_mean([held_time_to_target(s) for s in stats]),
                _mean([s["eval_steps_to_target"] for s in stats]) * summary["global_batch"])
    (tb, sb), (tk, sk), (ta, sa) = (to_target(n) for n in ("async-bsp", "async-bsp-backup1",
                                                            "async-asp"))
    words = ", ".join(f"{n} {'-' if t is None else f'{t:.2f} s, {s:,.0f} samples'}"
                      for n, t, s in (("BSP", tb, sb), ("BSP + 1 backup", tk, sk),
                                      ("ASP", ta, sa)))
    if tk is None or tb is None:
        return False, f"to the held-out target: {words} (-: not reached)"
    return tk < tb, f"to the held-out target: {words}"


def _error_feedback(summary: dict, out: Path) -> tuple[bool, str]:
    dense = [s["final_eval_loss"] for s in _final(summary, "sync-ring")]
    noise = max(max(dense) - min(dense), 0.02 * _mean(dense))
    base, held, parts = _mean(dense), True, []
    for c in ("topk1", "sign"):
        ef, noef = _held_loss(summary, f"sync-{c}") - base, \
            _held_loss(summary, f"sync-{c}-noef") - base
        held = held and abs(ef) <= noise < noef
        parts.append(f"{c}: {ef:+.4f} with error feedback, {noef:+.4f} without")
    return held, (f"final held-out loss against dense ({base:.4f}): " + "; ".join(parts)
                  + f" (noise: {noise:.4f}, the dense seeds' range or 2% of its loss)")


def _traffic(summary: dict, name: str, field: str) -> float:
    """The mean over its final runs of a traffic figure (bytes, rounds, ...) of a method."""
    return _mean([s["traffic"][field] for s in _final(summary, name)])


def _streaming_diloco(summary: dict, out: Path) -> tuple[bool, str]:
    sync, diloco = _held_loss(summary, "sync-ring"), _held_loss(summary, STREAM[0])
    stream = _held_loss(summary, STREAM[1])
    per_sync = [_traffic(summary, n, "bytes") / _traffic(summary, n, "rounds") for n in STREAM]
    total = [_traffic(summary, n, "bytes") for n in ("sync-ring", *STREAM)]
    off, peak = (stream - diloco) / diloco, per_sync[0] / per_sync[1]
    return abs(off) <= 0.05 and peak >= 10, (
        f"final held-out loss: sync-ring {sync:.4f}, DiLoCo {diloco:.4f}, Streaming DiLoCo "
        f"{stream:.4f} ({100 * off:+.1f}% against DiLoCo; within 5% needed); bytes a "
        f"synchronisation {per_sync[0]:,.0f} against {per_sync[1]:,.0f} ({peak:.1f}x less "
        f"at the peak; 10x needed); bytes in all: sync-ring {total[0]:,.0f}, DiLoCo "
        f"{total[1]:,.0f}, Streaming {total[2]:,.0f}")


def _onebit_adam(summary: dict, out: Path) -> tuple[bool, str]:
    dense = [s["final_eval_loss"] for s in _final(summary, "sync-ring")]
    noise = max(max(dense) - min(dense), 0.02 * _mean(dense))
    base, onebit = _mean(dense), _held_loss(summary, ONEBIT)
    zero_one = _held_loss(summary, ZERO_ONE)
    less = _traffic(summary, "sync-ring", "bytes") / _traffic(summary, ONEBIT, "bytes")
    bytes_01, rounds_01 = (_traffic(summary, ZERO_ONE, f) / _traffic(summary, ONEBIT, f)
                           for f in ("bytes", "rounds"))
    held = abs(onebit - base) <= noise and less >= 3
    held = held and abs(zero_one - base) <= noise and bytes_01 < 1 and rounds_01 < 1
    return held, (
        f"final held-out loss: Adam {base:.4f}, 1-bit Adam {onebit:.4f} ({onebit - base:+.4f}; "
        f"noise {noise:.4f}: the Adam seeds' range or 2% of its loss), with {less:.1f}x fewer "
        f"bytes on the wire (3x needed); 0/1 Adam {zero_one:.4f} ({zero_one - base:+.4f}) "
        f"with {100 * (1 - bytes_01):.0f}% fewer bytes and {100 * (1 - rounds_01):.0f}% fewer "
        "rounds than 1-bit Adam (fewer of both needed)")


def _heterogeneous(summary: dict, out: Path) -> tuple[bool, str]:
    """Held when a method that does not wait for the slowest worker every step reaches the
    held-out target first: before sync-ring and before async-bsp, which both wait (BSP is
    sync's arithmetic on the servers' transport, so a lead of BSP over sync is the
    transport's, not tolerance of stragglers). Each method's time is also set against the
    waiting method of its own topology."""
    times = {}
    for name in dict.fromkeys(r["name"] for r in summary["runs"]):
        final = _final(summary, name)
        stats = [s for s in final if s["eval_steps_to_target"] is not None]
        if stats:
            t = [held_time_to_target(s) for s in stats]
            times[name] = (_mean(t), min(t), max(t), len(stats), len(final))
    if not times:
        return False, "no method reached the held-out target"
    order = sorted(times, key=lambda n: times[n][0])

    def against(name: str) -> str:
        wait = WAITING[0] if name.startswith("sync-") else WAITING[1]
        if name in WAITING or wait not in times:
            return ""
        return f", {times[name][0] / times[wait][0]:.2f}x {wait}'s"
    words = "; ".join(f"{n} {t[0]:.2f} s [{t[1]:.2f}-{t[2]:.2f}] ({t[3]}/{t[4]} seeds)"
                      f"{against(n)}" for n, t in ((n, times[n]) for n in order))
    waiting = [n for n in order if n in WAITING]
    free = [n for n in order if n not in WAITING]
    by = "" if not waiting or not free else (
        f"; the first that does not wait for the slowest, {free[0]}, in "
        f"{times[free[0]][0] / times[waiting[0]][0]:.2f}x the time of the first that does, "
        f"{waiting[0]}")
    unreached = [n for n in dict.fromkeys(r["name"] for r in summary["runs"]) if n not in times]
    none = f"; not reached by {', '.join(unreached)}" if unreached else ""
    return order[0] not in WAITING, f"time to the held-out target: {words}{by}{none}"


def _speed_aware_h(summary: dict, out: Path) -> tuple[bool, str]:
    """Liu et al. 2024's claim, against their baseline, synchronous local SGD (here DiLoCo
    H = 10 on the ring, every round waiting for the slowest): async DiLoCo with DyLU
    "matches the performance of synchronous Local-SGD in terms of perplexity per update
    step, and significantly surpasses it in terms of wall clock time". Per update: its
    final held-out loss at equal inner steps at most sync DiLoCo's plus the noise (sync
    DiLoCo's seeds' range or 2% of its loss); in time: it first comes within that noise of
    sync DiLoCo's final loss sooner than sync DiLoCo does (means over the seeds; a seed
    that never does counts as its whole run). Sync SGD every step and fixed H beside."""
    base, dylu = SYNC_LOCAL, DYLU[1]
    ref = [s["final_eval_loss"] for s in _final(summary, base)]
    noise = max(max(ref) - min(ref), 0.02 * _mean(ref))
    level = _mean(ref) + noise
    names = ("sync-ring", base, *DYLU)
    loss = {n: _held_loss(summary, n) for n in names}
    to_level = {n: _mean([_time_to(s, level) for s in _final(summary, n)]) for n in names}
    off = loss[dylu] - loss[base]
    held = off <= noise and to_level[dylu] < to_level[base]
    words = "; ".join(f"{n} {loss[n]:.4f}, {to_level[n]:.1f} s" for n in names)
    return held, (f"final held-out loss at equal inner steps and seconds until the held-out "
                  f"loss is within sync DiLoCo's noise of its final ({level:.4f}): {words}; "
                  f"speed-aware H {off:+.4f} against sync DiLoCo (noise {noise:.4f}: its "
                  f"seeds' range or 2% of its loss; at most that needed) in "
                  f"{to_level[dylu] / to_level[base]:.2f}x its time (below 1 needed)")


def _time_to(stats: dict, level: float) -> float:
    """Training seconds until a run's held-out loss is first at or below `level` (its whole
    run's where it never is)."""
    curve = stats["held_out"]
    return next((t for t, x in zip(curve["time_s"], curve["loss"], strict=True)
                 if x <= level), stats["time_s"])


STREAM = ("sync-diloco30", "sync-stream30x3-t1-int4")
DYLU = ("async-diloco10", "async-diloco10-dylu")  # fixed H, speed-aware H
SYNC_LOCAL = "sync-diloco10"  # Liu et al. 2024's baseline: synchronous local SGD
# every method tuned over lr; those with an outer optimizer over its lr and momentum too
# (at momentum 0.9 and lr 0.7 async DiLoCo with DyLU diverged where 0.5 trained: stop 43)
OUTER_GRID = ("--tune", "lr=0.005,0.01,0.02", "--tune", "outer_lr=0.35,0.7",
              "--tune", "outer_momentum=0.5,0.9")
WAITING = ("sync-ring", "async-bsp")  # each step waits for the slowest: sync's, the servers'
ONEBIT = "sync-onebitadam100"
ZERO_ONE = "sync-zerooneadam100"
PRESETS = {
    "bsp-equals-sync": Reproduction(
        ("--runs", "sync-ring,async-bsp", "--clip", "0", "--tune", "none", "--seeds", "1"),
        "BSP over W workers is synchronous SGD on the global batch: async-bsp's training "
        "losses equal sync-ring's at every step, to the last bit (clip 0: each worker would "
        "clip its own gradient)", _bsp_equals_sync),
    "asp-tuned": Reproduction(
        ("--runs", "sync-ring,async-asp"),
        "tuned on its own, ASP reaches the held-out target in at most 1.5x the samples sync "
        "needs (W workers make W times the updates of 1/W the batch: a smaller lr suits "
        "them; at sync's lr ASP may not reach it at all)", _asp_tuned),
    "staleness-lr": Reproduction(
        ("--runs", "async-asp,async-asp-div"),
        "Zhang et al. 2016 (staleness-aware async SGD): dividing the lr by the staleness "
        "tolerates larger rates; at the grid's largest lr ASP with lr / staleness ends no "
        "higher than plain ASP", _staleness_lr),
    "async-momentum": Reproduction(
        ("--runs", "sync-ring,async-asp", "--optimizer", "sgd", "--lr", "0.1",
         "--tune", "momentum=0,0.5,0.9"),
        "Mitliagkas et al. 2016 (asynchrony begets momentum): asynchrony acts as extra "
        "momentum, so with SGD + momentum async is best at a momentum no higher than "
        "sync's", _async_momentum),
    "diloco": Reproduction(
        ("--runs", "sync-ring,sync-diloco10,sync-diloco50", "--ranks", "4",
         "--eval-every", "50"),
        "Douillard et al. 2023 (DiLoCo: inner AdamW, outer Nesterov lr 0.7, momentum 0.9): "
        "with 4 workers, H = 50 inner steps a round ends within 5% of H = 1's (every step "
        "synchronised: sync-ring) final held-out loss at equal samples, with 50x fewer "
        "communication rounds (the runs need some 20 rounds or more: the outer momentum "
        "builds over rounds)", _diloco),
    "backup-workers": Reproduction(
        ("--runs", "async-bsp,async-bsp-backup1,async-asp", "--ranks", "4",
         "--delay-ms", "20"),
        "Chen et al. 2016 (revisiting distributed synchronous SGD): with exponential "
        "per-step delays (--delay-ms), BSP over 4 workers plus 1 backup (each round "
        "closed by the first 4 gradients of 5) reaches the held-out target in less time "
        "than plain BSP over 4, which waits for the slowest every round; ASP beside them",
        _backup_workers),
    "error-feedback": Reproduction(
        ("--runs", "sync-ring,sync-topk1,sync-topk1-noef,sync-sign,sync-sign-noef",
         "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.2"),
        "Karimireddy et al. 2019 (error feedback fixes SignSGD and other compressors): "
        "with SGD + momentum, top-1% and scaled sign without error feedback end with a "
        "gap to dense's final held-out loss larger than the noise; with error feedback "
        "within the noise of dense (noise: the dense seeds' range, at least 2% of its "
        "loss)", _error_feedback),
}


PRESETS.update({
    "streaming-diloco": Reproduction(
        ("--runs", f"sync-ring,{STREAM[0]},{STREAM[1]}", "--ranks", "4", "--eval-every", "30"),
        "Douillard et al. 2025 (Streaming DiLoCo): 3 fragments, one synchronised every 10 "
        "of DiLoCo's 30 inner steps, each exchange overlapping 1 step, outer gradients in 4 "
        "bits, end within 5% of DiLoCo's final held-out loss while a synchronisation moves "
        "at least 10x fewer bytes (the paper: about two orders of magnitude less peak "
        "bandwidth, with more fragments and larger models)", _streaming_diloco),
    "onebit-adam": Reproduction(
        ("--runs", f"sync-ring,{ONEBIT},{ZERO_ONE}"),
        "Tang et al. 2021 (1-bit Adam): after 100 warm-up steps of Adam, the momentum sent as "
        "signs with error feedback ends within the noise of Adam's final held-out loss after "
        "the same steps, with at least 3x fewer bytes on the wire (the paper: up to 5x less "
        "communication); Lu et al. 2022 (0/1 Adam, the variance frozen after step 100, local "
        "steps after it) within the same noise with fewer bytes and rounds than 1-bit Adam "
        "(the paper: up to 87% less data and 54% fewer rounds)", _onebit_adam),
    "heterogeneous": Reproduction(
        ("--runs", "sync-ring,async-bsp,async-bsp-backup1,async-ssp2,async-asp,"
                   "async-diloco10,async-diloco10-dylu,async-stream10x2", "--ranks", "4",
         "--straggler", "2:2,3:4", *OUTER_GRID),
        "workers of different speeds (1x, 1x, 2x, 4x: --straggler 2:2,3:4): sync and BSP wait "
        "for the slowest every step, so a method that does not (backup workers, SSP, ASP, "
        "async local SGD with fixed or speed-aware H, Streaming DiLoCo) reaches the held-out "
        "target first in time; the report names the winner and by how much, each against "
        "the waiting method of its own topology", _heterogeneous),
    "heterogeneous-drawn": Reproduction(
        ("--runs", "sync-ring,async-bsp,async-bsp-backup1,async-ssp2,async-asp,"
                   "async-diloco10,async-diloco10-dylu,async-stream10x2", "--ranks", "8",
         "--straggler", "lognormal:0.5", *OUTER_GRID),
        "8 workers whose speeds are drawn (--straggler lognormal:0.5: each slowed by exp(|z|), "
        "z ~ N(0, 0.25), median 1.4x, seeded by rank): as in heterogeneous, a method that "
        "does not wait for the slowest every step reaches the held-out target first; the "
        "report names the winner and by how much", _heterogeneous),
    "speed-aware-h": Reproduction(
        ("--runs", f"sync-ring,{SYNC_LOCAL},{DYLU[0]},{DYLU[1]}", "--ranks", "4",
         "--straggler", "2:2,3:4", *OUTER_GRID),
        "Liu et al. 2024 (asynchronous local SGD with Delayed Nesterov and dynamic local "
        "updates, DyLU): with workers 1x, 1x, 2x, 4x slow, async DiLoCo whose worker i takes "
        "H_i = round(10 t_fast / t_i) inner steps a round matches synchronous DiLoCo H = 10 "
        "(every round waiting for the slowest) in final held-out loss at equal inner steps, "
        "within its noise, in less wall time; sync SGD and async DiLoCo with fixed H = 10 "
        "beside them; every method tuned over lr, the DiLoCo ones over the outer lr and "
        "momentum too",
        _speed_aware_h),
})


def expand(argv: list[str]) -> tuple[list[str], Reproduction | None, str]:
    """argv with a --preset NAME replaced by its flags (the given ones after them, and a
    given --tune replacing the preset's); the preset and its name."""
    if "--preset" not in argv:
        return argv, None, ""
    i = argv.index("--preset")
    if i + 1 >= len(argv):
        raise ConfigError(f"--preset needs a name: one of {', '.join(PRESETS)}")
    name, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r}: no such preset (one of {', '.join(PRESETS)})")
    flags = list(PRESETS[name].flags)
    if "--tune" in rest:
        while "--tune" in flags:
            k = flags.index("--tune")
            del flags[k:k + 2]
    return flags + rest, PRESETS[name], name


def lines(name: str, preset: Reproduction, held: bool, measured: str) -> list[str]:
    """The report's section on the reproduction."""
    return [f"## Reproduction: {name}", "", f"Expected: {preset.expected}.", "",
            f"Measured: {measured}: **{'held' if held else 'not held'}**.", ""]
