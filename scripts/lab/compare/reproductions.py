"""Known results as presets: `dtlab-compare --preset NAME` runs a reproduction with its
expected outcome stated, and the report says whether this run bore it out.

    dtlab-compare --preset bsp-equals-sync
    dtlab-compare --preset asp-tuned               # the default model, tuned, 3 seeds
    dtlab-compare --preset staleness-lr --steps 300

Each preset is a set of flags put before the ones given (a flag given wins; a --tune
given replaces the preset's grid) and a check of the expectation on the summary. What a
check says is a measurement, not a verdict on the paper: where it does not hold, the
report says what was measured instead, and why it may differ (model, scale, optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
}


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
