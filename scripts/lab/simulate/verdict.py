"""dtlab-verdict: each method's time to the held-out target at 8..1024 workers on named
clusters, from steps measured with N workers simulated in one process and the cost
model's step, with the crossovers named.

    python -m dtlab.lab.simulate.verdict --config scripts/lab/configs/transformer.json \
        --methods sync,asp,asp-div,ssp4,local8,diloco8,topk1,sign,backup2 \
        --sizes 8,16,32,64,128,256,512,1024 --simulate-up-to 64 --jobs 2 \
        --clusters dgx-h100-ndr,h100-eth100 --step-models 'same;gpt2-small' --out runs/verdict
    python -m dtlab.lab.simulate.verdict --d-model 128 --n-layers 4 --d-ff 512 \
        --batch-size 8 --steps 400 --simulate-up-to 16 --step-models same \
        --statistics runs/verdict/statistics.json --out runs/verdict-d128  # a larger model
    python -m dtlab.lab.simulate.verdict --statistics runs/verdict/statistics.json \
        --cached-only ...                         # redraw from the stored simulations
    python -m dtlab.lab.simulate.verdict --compare runs/cmp ...   # into a comparison's report

Two halves (Hadjis et al. 2016, Omnivore: time to target = step x steps):

  statistical  for each method and each N up to --simulate-up-to, the per-worker steps to
               the held-out target (the data's floor + 0.1, or --target-loss) of N workers
               of --speeds simulated in one process on the config's model and data
               (simulate/statistical.py; the staleness N workers of those speeds produce
               from simulate/arrivals.py), the config's --steps the budget; beyond, fitted
               (simulate/verdict_time.py) and marked ~ (table) and dashed (plot); each
               simulation kept in --statistics (simulate/verdict_stats.py), --jobs at once
  hardware     each method's step at N on each --clusters preset (simulate/clusters.py)
               for each --step-models model: `same` (the config's) or gpt2-small (GPT-2
               124M's shape: 12 layers, width 768, 1024 tokens, vocabulary 50257; its
               steps to target are the config's model's: statistical efficiency carried
               over, not measured) or FIELD=VALUE,... changes to the config's model

Why its own command and not part of every dtlab-compare: the statistical half trains
N workers' worth of gradients per step for every method and N (minutes of CPU each),
and reuses nothing of a comparison's processes; `--compare DIR` puts its tables and
plots into a finished comparison's folder and report.md.

Writes OUT/verdict.json (every simulation, every cell), OUT/verdict.md and one plot per
(model, cluster): OUT/verdict-MODEL-CLUSTER.png; the simulations also in --statistics
(default OUT/statistics.json), read back by the next run with the same inputs (a
looser --target-loss too: simulate/verdict_stats.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from dtlab.lab.presets import config_path
from dtlab.lab.simulate import clusters, verdict_report
from dtlab.lab.simulate.arrivals import Speeds
from dtlab.lab.simulate.statistical import Method
from dtlab.lab.simulate.verdict_stats import Statistics, measure
from dtlab.lab.simulate.verdict_time import cells, crossover, crossover_words
from dtlab.models.config import ConfigError
from dtlab.models.cost import estimate
from dtlab.models.data.factory import make_dataset
from dtlab.models.run.cli import run_cli
from dtlab.models.run.session import parse

GPT2_SMALL = {"vocab": 50257, "seq_len": 1024, "d_model": 768, "n_heads": 12,
              "n_layers": 12, "d_ff": 3072}
DEFAULT_METHODS = "sync,asp,asp-div,ssp4,local8,diloco8,topk1,sign,backup2"
MARGIN = 0.1  # the comparison's target: floor + 0.1 nats


def int_list(text: str, flag: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"{flag} {text}: a comma list of positive integers") from None
    if not out or out[0] < 1:
        raise ConfigError(f"{flag} {text}: a comma list of positive integers")
    return out


def step_model(spec: str, model_cfg, model_name: str):
    """(name, config) of one --step-models entry (`same`: named as the simulated model)."""
    if spec == "same":
        return model_name, model_cfg
    if spec == "gpt2-small" and not all(hasattr(model_cfg, k) for k in GPT2_SMALL):
        raise ConfigError("--step-models gpt2-small: the simulated model is not a "
                          "transformer (give --step-models same)")
    changes = dict(GPT2_SMALL) if spec == "gpt2-small" else {}
    if not changes:
        for item in spec.split(","):
            key, _, value = item.partition("=")
            if not hasattr(model_cfg, key) or not value:
                raise ConfigError(f"--step-models {spec}: {item!r} is not FIELD=VALUE of "
                                  f"the model's config")
            changes[key] = type(getattr(model_cfg, key))(value)
    return spec, replace(model_cfg, **changes)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtlab-verdict", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="run config (default: the transformer preset); other run flags "
                        "(--steps, --batch-size, --lr ...) pass through")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--sizes", default="8,16,32,64,128,256,512,1024", help="N of the table")
    p.add_argument("--simulate-up-to", type=int, default=64,
                   help="simulate N up to this; fit the steps beyond")
    p.add_argument("--clusters", default="dgx-h100-ndr,h100-eth100",
                   help=f"cluster presets ({', '.join(clusters.NAMES)})")
    p.add_argument("--step-models", default="same;gpt2-small",
                   help="models whose step is predicted, ';' between them: same, "
                        "gpt2-small, FIELD=VALUE,... (changes to the config's model)")
    p.add_argument("--speeds", default="jitter:0.1",
                   help="workers' speeds: equal, jitter:SIGMA, slow:FRACTION:FACTOR")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"),
                   help="the clusters' compute and gradient wire")
    p.add_argument("--target-loss", type=float, default=None,
                   help=f"held-out target (default: the data's floor + {MARGIN})")
    p.add_argument("--statistics", default=None,
                   help="the simulations' store, read and added to (default "
                        "OUT/statistics.json)")
    p.add_argument("--cached-only", action="store_true",
                   help="train nothing: every simulation from --statistics")
    p.add_argument("--jobs", type=int, default=1,
                   help="simulations run at once, a process and one BLAS thread each")
    p.add_argument("--compare", default=None,
                   help="a dtlab-compare folder: its config and target; tables, plots and "
                        "a section of its report.md written there")
    p.add_argument("--out", default="runs/verdict")
    return p


def main(argv: list[str] | None = None) -> int:
    o, rest = parser().parse_known_args(argv)
    folder = Path(o.compare) if o.compare else None
    cfg_file = str(folder / "config.json") if folder else str(config_path(o.config or
                                                                          "transformer"))
    setup = parse(["--config", cfg_file, *rest], "dtlab-verdict")
    methods = [Method.parse(x) for x in o.methods.split(",") if x.strip()]
    sizes = int_list(o.sizes, "--sizes")
    speeds = Speeds.parse(o.speeds)
    names = [x for x in o.clusters.split(",") if x.strip()]
    for c in names:
        clusters.cluster(c, "--clusters")
    models = [step_model(x.strip(), setup.model, setup.model_name)
              for x in o.step_models.split(";") if x.strip()]
    summary = json.loads((folder / "summary.json").read_text()) if folder else {}
    floor = summary.get("floor")
    if floor is None:
        floor = make_dataset(setup.data, setup.model_name, setup.model)[0].floor
    target = o.target_loss or summary.get("target_loss") or (floor + MARGIN if floor else None)
    if target is None:
        raise ConfigError("the data has no known floor: give --target-loss")
    simulated = [n for n in sizes if n <= o.simulate_up_to]
    if not simulated:
        raise ConfigError(f"--simulate-up-to {o.simulate_up_to}: below every --sizes N")
    if o.jobs < 1:
        raise ConfigError(f"--jobs {o.jobs}: at least 1")
    eval_every = setup.run.eval_every or max(1, setup.run.steps // 30)
    out = folder or Path(o.out)
    store = Statistics.open(o.statistics or out / "statistics.json")
    if not o.cached_only:
        store.note_command(list(argv if argv is not None else sys.argv[1:]))
    stats = measure(setup, methods, simulated, target, eval_every, speeds, store, o.jobs,
                    sys.stderr, simulate=not o.cached_only)
    points = stats.points
    out.mkdir(parents=True, exist_ok=True)
    b = setup.run.batch_size
    n_params = estimate(setup.model_name, setup.model, b).params_total
    head = [f"# dtlab-verdict: {setup.model_name} {n_params:,} params, batch {b} a worker, "
            f"held-out target {target:.4f}, budget {setup.run.steps} steps, speeds: "
            f"{speeds.describe()}",
            f"# steps simulated at N = {', '.join(map(str, simulated))} (stored in "
            f"{store.path}); ~: extrapolated beyond N = {simulated[-1]}, steps fitted "
            "a + c / N on the simulated N, not measured (McCandlish et al. 2018)"]
    md = ["## At scale: each method's time to target (dtlab-verdict)", "", *head, "",
          "### Steps to target, simulated in one process", "",
          *verdict_report.markdown(verdict_report.steps_table(points, b))]
    print("\n".join(head + verdict_report.steps_table(points, b)))
    record = {"target": target, "speeds": asdict(speeds), "batch_size": b,
              "simulated": simulated, "sizes": sizes, "points": points,
              "runs": stats.runs, "tables": []}
    for model_name, model_cfg in models:
        for c in names:
            table = {m.label: cells(m, points.get(m.same_steps_as or m.label, {}), sizes,
                                    setup.model_name, model_cfg, c, b, speeds, o.precision,
                                    o.precision)
                     for m in methods}
            words = [crossover_words(x, "sync", crossover(table[x], table["sync"]), c,
                                     sizes[-1]) for x in table if x != "sync"] \
                if "sync" in table else []
            params = estimate(setup.model_name, model_cfg, b).params_total
            title = (f"{model_name} ({params:,} params), {b} a worker, {o.precision}, on "
                     f"{clusters.cluster(c).describe()}")
            lines = verdict_report.time_table(table)
            print(f"\n# time to target (s): {title}")
            print("\n".join(lines + [f"# {w}" for w in words]))
            png = verdict_report.plot(table, f"{model_name} ({params:,} params), {b} a worker, "
                                      f"{o.precision}, on {c}",
                                      out / f"verdict-{model_name}-{c}.png")
            md += ["", f"### Time to target (s): {title}", "",
                   *verdict_report.markdown(lines), "", *(f"- {w}" for w in words)]
            if png:
                md += ["", f"![time to target, {model_name} on {c}]({png.name})"]
            record["tables"].append({"model": model_name, "cluster": c, "params": params,
                                     "cells": {k: [x.as_dict() for x in v]
                                               for k, v in table.items()},
                                     "crossovers": words})
    (out / "verdict.json").write_text(json.dumps(record, indent=1))
    (out / "verdict.md").write_text("\n".join(md) + "\n")
    if folder:
        report = folder / "report.md"
        text = report.read_text() if report.exists() else ""
        text = text.split("\n## At scale:")[0].rstrip("\n")
        report.write_text(text + "\n\n" + "\n".join(md) + "\n")
    print(f"# wrote {out / 'verdict.json'}, {out / 'verdict.md'}")
    return 0


def cli() -> None:
    sys.exit(run_cli(main, "dtlab-verdict"))


if __name__ == "__main__":
    cli()
