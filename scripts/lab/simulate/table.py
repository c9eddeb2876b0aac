"""The nccl-tests style tables dtlab-simulate prints: predictions by N, fits, validation."""

from __future__ import annotations


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}" if seconds < 1 \
        else f"{seconds * 1e3:,.1f}"


def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:,.2f}"


def render(columns: list[tuple[str, str, list[str]]]) -> list[str]:
    """Header, units and one line per row of right-aligned columns (head, unit, cells),
    each as wide as its widest cell plus two spaces, so large numbers never run
    together."""
    widths = [max(len(head), len(unit), *(len(c) for c in cells)) + 2
              for head, unit, cells in columns]
    n = len(columns[0][2]) if columns else 0
    head = "#" + "".join(f"{h:>{w}}" for (h, _, _), w in zip(columns, widths, strict=True))
    unit = "#" + "".join(f"{u:>{w}}" for (_, u, _), w in zip(columns, widths, strict=True))
    lines = [" " + "".join(f"{cells[i]:>{w}}" for (_, _, cells), w
                           in zip(columns, widths, strict=True)) for i in range(n)]
    return [head, unit, *lines]


def predictions(rows: list[dict], steps_to_target: int | None) -> str:
    """The prediction rows; the naive and parameter-server columns where the rows hold
    them; with --zero (rows holding "dp_memory") also plain DP's memory per rank and each
    ZeRO stage's exposed communication, step and memory."""
    r0 = rows[0] if rows else {}
    stages = sorted(int(k[len("zero"):]) for k in r0 if k.startswith("zero"))
    zero = "dp_memory" in r0
    labels = [k[len("method:"):] for k in r0 if k.startswith("method:")]
    kinds = [k for k in ("ring", "naive", "ps") if k in r0]
    unit, scale = ("GB", 1e9) if zero and r0["dp_memory"]["total"] >= 1e9 else ("MB", 1e6)

    def ttt(k: str) -> list[str]:
        return [fmt_s(None if steps_to_target is None else r[k]["step_s"] * steps_to_target)
                for r in rows]

    cols = [("N", "", [str(r["n"]) for r in rows]),
            ("nodes", "", [str(r["nodes"]) for r in rows]),
            ("compute", "(ms)", [fmt_ms(r["compute_s"]) for r in rows]),
            ("ring", "(ms)", [fmt_ms(r["ring"]["comm_s"]) for r in rows]),
            ("algo", "", [r["ring"]["algo"] for r in rows]),
            ("step", "(ms)", [fmt_ms(r["ring"]["step_s"]) for r in rows]),
            ("eff", "", [f"{r['efficiency']:.2f}" for r in rows])]
    for k in kinds[1:]:
        cols += [(k, "(ms)", [fmt_ms(r[k]["comm_s"]) for r in rows]),
                 ("step", "(ms)", [fmt_ms(r[k]["step_s"]) for r in rows])]
    cols += [(f"{k} TTT", "(s)", ttt(k)) for k in kinds]
    if zero:
        cols.append(("dp mem", f"({unit})", [f"{r['dp_memory']['total'] / scale:.4g}"
                                              for r in rows]))
        for z in stages:
            cols += [(f"z{z} comm", "(ms)", [fmt_ms(r[f"zero{z}"]["comm_s"]) for r in rows]),
                     (f"z{z} step", "(ms)", [fmt_ms(r[f"zero{z}"]["step_s"]) for r in rows]),
                     (f"z{z} mem", f"({unit})", [f"{r[f'zero{z}']['memory']['total'] / scale:.4g}"
                                                 for r in rows])]
    for label in labels:
        cols += [(f"{label[:9]} comm", "(ms)", [fmt_ms(r[f"method:{label}"]["comm_s"])
                                                 for r in rows]),
                 ("step", "(ms)", [fmt_ms(r[f"method:{label}"]["step_s"]) for r in rows])]
    out = render(cols)
    out.append("# legend: N ranks (sync) = workers (async); nodes = ceil(N / gpus per node); "
               "compute = forward + backward + update of one rank's batch; ring = exposed "
               "all-reduce of our ring family (algo: the one "
               "collective/algorithms/choose.py picks, 2-level/X: intra-node ring + X across "
               "nodes); step = compute + exposed communication; eff = compute / ring step "
               "(weak scaling: N = 1 is compute alone); "
               + ("naive = reduce to rank 0 + broadcast; ps = pull + push with the "
                  "parameter-server shards (with --link local or --shards); " if len(kinds) > 1
                  else "")
               + "TTT = step x steps to target (-: no --steps-to-target)")
    if zero:
        out.append("# ZeRO (simulate/zero.py): dp mem = plain data parallelism's bytes per "
                   "rank (weights, gradients, optimizer state); zS comm = stage S's exposed "
                   "reduce-scatter and all-gather(s) over a ring, two levels above a node "
                   "(stages 1, 2: 2(N-1)/N "
                   "Psi, stage 3: 3(N-1)/N Psi); zS step = compute + zS comm; zS mem = its "
                   "bytes per rank (models/cost.py zero_memory, the paper's per-parameter "
                   "bytes)")
    if labels:
        out.append("# methods (simulate/methods.py): localH / dilocoH comm = one H-th of the "
                   "outer gradient's all-reduce and of the H steps' straggler wait; a "
                   "compressor's comm = its payload's exchange (top-k, sign: an all-gather, "
                   "random-k, PowerSGD: all-reduces) plus its compute, none behind backward; "
                   "step = compute + comm")
    return "\n".join(out)


def fits(cal: dict) -> str:
    out = [f"#{'all-reduce':>14}{'ranks':>8}{'alpha(us)':>11}{'GB/s':>9}{'rows':>6}"
           f"{'med err':>9}{'max err':>9}"]
    for name, f in cal["allreduce"].items():
        bw = 1 / f["beta_s_per_byte"] / 1e9 if f["beta_s_per_byte"] else float("inf")
        out.append(f" {name:>14}{','.join(map(str, f['ranks'])):>8}{f['alpha_s'] * 1e6:>11.2f}"
                   f"{bw:>9.3f}{f['rows']:>6}{100 * f['median_rel_err']:>8.1f}%"
                   f"{100 * f['max_rel_err']:>8.1f}%")
    for path, ops in cal["pserver"].items():
        for op, f in ops.items():
            bw = 1 / f["beta_s_per_byte"] / 1e9 if f["beta_s_per_byte"] else float("inf")
            out.append(f" {'ps ' + path + ' ' + op:>14}{'1':>8}{f['alpha_s'] * 1e6:>11.2f}"
                       f"{bw:>9.3f}{f['rows']:>6}{100 * f['median_rel_err']:>8.1f}%"
                       f"{100 * f['max_rel_err']:>8.1f}%")
    for path, f in cal.get("fanout", {}).items():
        bw = 1 / f["beta_s_per_byte"] / 1e9 if f["beta_s_per_byte"] else float("inf")
        out.append(f" {'ps cold ' + path:>14}{'S':>8}{f['alpha_s'] * 1e6:>11.2f}{bw:>9.3f}"
                   f"{f['rows']:>6}{100 * f['median_rel_err']:>8.1f}%"
                   f"{100 * f['max_rel_err']:>8.1f}%   +{f['per_shard_s'] * 1e6:.1f} us a "
                   "shard beyond the first")
    for name, f in cal.get("alltoall", {}).items():
        bw = 1 / f["beta_s_per_byte"] / 1e9 if f["beta_s_per_byte"] else float("inf")
        out.append(f" {'alltoall ' + name:>14}{','.join(map(str, f['ranks'])):>8}"
                   f"{f['alpha_s'] * 1e6:>11.2f}{bw:>9.3f}{f['rows']:>6}"
                   f"{100 * f['median_rel_err']:>8.1f}%{100 * f['max_rel_err']:>8.1f}%")
    out.append(f"#{'compute':>14}{'threads':>8}{'t0(ms)':>11}{'GFLOP/s':>9}{'rows':>6}"
               f"{'med err':>9}{'max err':>9}")
    for f in cal["compute"]:
        out.append(f" {f['model']:>14}{f['threads']:>8}{f['overhead_s'] * 1e3:>11.3f}"
                   f"{f['flops_per_s'] / 1e9:>9.2f}{f['rows']:>6}"
                   f"{100 * f['median_rel_err']:>8.1f}%{100 * f['max_rel_err']:>8.1f}%")
    for optimizer, g in cal["apply_s_per_byte"].items():
        out.append(f"# server apply, {optimizer}: {1 / g / 1e9:.3f} GB/s of gradient")
    out.append("# legend: all-reduce fits t = a alpha + (b + c) n beta (formulas.terms, gamma = "
               "beta); alltoall fits t = (n-1) alpha + (n-1)/n B beta (B bytes per rank); ps fits "
               "t = alpha + n beta per round with 1 worker, 1 shard; ps cold fits a worker's "
               "round after a compute gap, t = alpha + (S-1) per_shard + n beta; compute fits "
               "t = t0 + FLOPs / rate; GB/s = 1 / beta; err = |fit - measured| / measured over "
               "the rows")
    return "\n".join(out)


def validation(rows: list[dict], cores: int) -> str:
    out = [f"#{'run':>12}{'N':>3}{'S':>3}{'link':>6}{'L':>3}{'threads':>8}{'share':>6}"
           f"{'pred':>9}{'meas':>9}"
           f"{'err':>8}{'ok':>4}{'pred cmp':>10}{'meas cmp':>10}{'pred comm':>10}"
           f"{'meas comm':>10}{'pred TTT':>9}{'meas TTT':>9}{'load':>6}",
           f"#{'':>12}{'':>3}{'':>3}{'Gbit':>6}{'':>3}{'':>8}{'':>6}{'(ms)':>9}{'(ms)':>9}{'':>8}{'':>4}"
           f"{'(ms)':>10}{'(ms)':>10}{'(ms)':>10}{'(ms)':>10}{'(s)':>9}{'(s)':>9}{'':>6}"]
    for r in rows:
        link = format(r["link_gbit"], "g") if r["link_gbit"] else "local"
        out.append(f" {r['run']:>12}{r['n']:>3}{r['shards'] or '-':>3}{link:>6}"
                   f"{r['launches']:>3}"
                   f"{r['threads']:>8}"
                   f"{r['share']:>6.2f}{fmt_ms(r['pred_step_s']):>9}{fmt_ms(r['meas_step_s']):>9}"
                   f"{100 * r['rel_err']:>+7.1f}%{'yes' if r['within'] else 'NO':>4}"
                   f"{fmt_ms(r['pred_compute_s']):>10}{fmt_ms(r['meas_compute_s']):>10}"
                   f"{fmt_ms(r['pred_comm_s']):>10}{fmt_ms(r['meas_comm_s']):>10}"
                   f"{fmt_s(r['pred_ttt_s']):>9}{fmt_s(r['meas_ttt_s']):>9}"
                   f"{'-' if r['max_load'] is None else format(r['max_load'], '.1f'):>6}")
    ok = sum(r["within"] for r in rows)
    out.append(f"# {ok} of {len(rows)} within the bound")
    out.append(f"# legend: pred/meas = predicted / measured median step time after warm-up "
               "(each a median over the launches, a launch's prediction from its own compute "
               "benchmark); err "
               f"= (pred - meas) / meas; ok = |err| within the bound; link = local (every process "
               "on this host, shared memory) or the emulated hosts' link rate; L = launches "
               "(meas: their median); threads = BLAS threads a process gets; share = ranks or "
               f"workers over the host's {cores} cores (> 1: "
               "they take turns on the cores, each computes at 1/share of a core); cmp = "
               "compute; comm = exposed communication (sync: the wait after backward; async: "
               "pull + push); TTT = step x measured steps to target (-: not reached); load = the "
               "host's highest 1-minute load average around the launches")
    return "\n".join(out)


def parallel_predictions(rows: list[dict], steps_to_target: int | None) -> str:
    """The dp x pp x ep x tp rows: a column for bubble, p2p, tp and a2a only where the
    layout uses that dimension."""
    r0 = rows[0] if rows else {}
    extra = [(key, label, fmt) for key, label, fmt, dim in (
        ("bubble", "bubble", lambda v: f"{v:.3f}", "pp"), ("p2p_s", "p2p", fmt_ms, "pp"),
        ("tp_s", "tp", fmt_ms, "tp"), ("a2a_s", "a2a", fmt_ms, "ep")) if r0.get(dim, 1) > 1]
    cols = [("N", "", [str(r["n"]) for r in rows]), ("dp", "", [str(r["dp"]) for r in rows]),
            ("nodes", "", [str(r["nodes"]) for r in rows]),
            ("compute", "(ms)", [fmt_ms(r["compute_s"]) for r in rows])]
    for key, label, fmt in extra:
        cols.append((label, "" if label == "bubble" else "(ms)", [fmt(r[key]) for r in rows]))
    cols += [("allreduce", "(ms)", [fmt_ms(r["allreduce_s"]) for r in rows]),
             ("step", "(ms)", [fmt_ms(r["step_s"]) for r in rows]),
             ("eff", "", [f"{r['efficiency']:.2f}" for r in rows]),
             ("TTT", "(s)", [fmt_s(None if steps_to_target is None
                                   else r["step_s"] * steps_to_target) for r in rows])]
    out = render(cols)
    out.append("# legend: N ranks = dp x pp x ep x tp (N not a multiple of pp ep tp left out); "
               "compute = the busiest stage's passes over a step's micro-batches (FLOPs / tp at "
               "the compute rate); bubble = predicted idle fraction of the schedule's replay "
               "(receives idle); p2p = the most time a stage receives; tp = the busiest "
               "stage's Megatron all-reduces; a2a = its MoE all-to-alls (4 per MoE layer and "
               "micro-batch); "
               "allreduce = exposed gradient all-reduce (dense over dp x ep, experts over dp; "
               "after the flush when pp > 1); step = pipeline makespan + allreduce + update "
               "(the optimizer, once a step); eff = "
               "compute / step; TTT = step x steps to target (-: no --steps-to-target)")
    return "\n".join(out)


def parallel_validation(rows: list[dict]) -> str:
    out = [f"#{'case':>10}{'sched':>7}{'m':>3}{'L':>3}{'pred':>9}{'meas':>9}{'err':>8}{'ok':>4}"
           f"{'pred':>8}{'meas':>8}{'p2p':>8}{'a2a':>8}{'allred':>8}{'load':>6}",
           f"#{'':>10}{'':>7}{'':>3}{'':>3}{'(ms)':>9}{'(ms)':>9}{'':>8}{'':>4}"
           f"{'bubble':>8}{'bubble':>8}{'(ms)':>8}{'(ms)':>8}{'(ms)':>8}{'':>6}"]
    for r in rows:
        def bub(v):
            return "-" if v is None else f"{v:.3f}"

        out.append(f" {r['case']:>10}{r['schedule']:>7}{r['microbatches']:>3}{r['launches']:>3}"
                   f"{fmt_ms(r['pred_step_s']):>9}{fmt_ms(r['meas_step_s']):>9}"
                   f"{100 * r['rel_err']:>+7.1f}%{'yes' if r['within'] else 'NO':>4}"
                   f"{bub(r['pred_bubble']):>8}{bub(r['meas_bubble']):>8}"
                   f"{fmt_ms(r['pred_p2p_s']):>8}{fmt_ms(r['pred_a2a_s']):>8}"
                   f"{fmt_ms(r['pred_allreduce_s']):>8}"
                   f"{'-' if r['max_load'] is None else format(r['max_load'], '.1f'):>6}")
    ok = sum(r["within"] for r in rows)
    out.append(f"# {ok} of {len(rows)} within the bound")
    out.append("# legend: pred/meas = predicted / measured step (medians over the L launches; "
               "pipelines: bench parallel's slowest rank, median over steps; MoE: dtlab-sync's "
               "rank 0 median step after warm-up); err = (pred - meas) / meas; ok = |err| "
               "within 25%; bubble = idle fraction (measured: blocked in receives or finished "
               "early); p2p, a2a, allred = the prediction's receives, all-to-alls and exposed "
               "gradient all-reduce; load = the host's highest 1-minute load average around "
               "the launches")
    return "\n".join(out)
