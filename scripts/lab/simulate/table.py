"""The nccl-tests style tables simulate.py prints: predictions by N, fits, validation."""

from __future__ import annotations


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}" if seconds < 1 \
        else f"{seconds * 1e3:,.1f}"


def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:,.2f}"


def predictions(rows: list[dict], steps_to_target: int | None) -> str:
    """The prediction rows; with --zero (rows holding "dp_memory") also plain DP's memory
    per rank and each ZeRO stage's exposed communication, step and memory."""
    stages = sorted(int(k[len("zero"):]) for k in (rows[0] if rows else {})
                    if k.startswith("zero"))
    zero = bool(rows) and "dp_memory" in rows[0]
    labels = [k[len("method:"):] for k in (rows[0] if rows else {}) if k.startswith("method:")]
    unit, scale = ("GB", 1e9) if zero and rows[0]["dp_memory"]["total"] >= 1e9 else ("MB", 1e6)
    head = (f"#{'N':>6}{'nodes':>7}{'compute':>10}{'ring':>10}{'algo':>16}{'step':>10}"
            f"{'eff':>6}{'naive':>11}{'step':>10}{'ps':>10}{'step':>10}{'ring TTT':>12}"
            f"{'naive TTT':>12}{'ps TTT':>12}")
    units = (f"#{'':>6}{'':>7}{'(ms)':>10}{'(ms)':>10}{'':>16}{'(ms)':>10}{'':>6}"
             f"{'(ms)':>11}{'(ms)':>10}{'(ms)':>10}{'(ms)':>10}{'(s)':>12}{'(s)':>12}"
             f"{'(s)':>12}")
    if zero:
        head += f"{'dp mem':>10}" + "".join(f"{f'z{z} comm':>10}{f'z{z} step':>10}"
                                            f"{f'z{z} mem':>10}" for z in stages)
        units += f"{f'({unit})':>10}" + f"{'(ms)':>10}{'(ms)':>10}{f'({unit})':>10}" * len(stages)
    for label in labels:
        head += f"{label[:9] + ' comm':>15}{'step':>10}"
        units += f"{'(ms)':>15}{'(ms)':>10}"
    out = [head, units]
    for r in rows:
        ring, naive, ps = r["ring"], r["naive"], r["ps"]
        ttt = [None if steps_to_target is None else k["step_s"] * steps_to_target
               for k in (ring, naive, ps)]
        line = (f" {r['n']:>6}{r['nodes']:>7}{fmt_ms(r['compute_s']):>10}"
                f"{fmt_ms(ring['comm_s']):>10}{ring['algo']:>16}{fmt_ms(ring['step_s']):>10}"
                f"{r['efficiency']:>6.2f}{fmt_ms(naive['comm_s']):>11}"
                f"{fmt_ms(naive['step_s']):>10}{fmt_ms(ps['comm_s']):>10}"
                f"{fmt_ms(ps['step_s']):>10}{fmt_s(ttt[0]):>12}{fmt_s(ttt[1]):>12}"
                f"{fmt_s(ttt[2]):>12}")
        if zero:
            line += f"{r['dp_memory']['total'] / scale:>10.4g}"
            for z in stages:
                s = r[f"zero{z}"]
                line += (f"{fmt_ms(s['comm_s']):>10}{fmt_ms(s['step_s']):>10}"
                         f"{s['memory']['total'] / scale:>10.4g}")
        for label in labels:
            s = r[f"method:{label}"]
            line += f"{fmt_ms(s['comm_s']):>15}{fmt_ms(s['step_s']):>10}"
        out.append(line)
    out.append("# legend: N ranks (sync) = workers (async); nodes = ceil(N / gpus per node); "
               "compute = forward + backward + update of one rank's batch; ring = exposed "
               "all-reduce of our ring family (algo: the one collective/choose.py picks, "
               "2-level/X: intra-node ring + X across nodes); step = compute + exposed "
               "communication; eff = compute / ring step (weak scaling: N = 1 is compute "
               "alone); naive = reduce to rank 0 + broadcast; ps = pull + push with the "
               "parameter-server shards; "
               "TTT = step x steps to target (-: no --steps-to-target)")
    if zero:
        out.append("# ZeRO (simulate/zero.py): dp mem = plain data parallelism's bytes per "
                   "rank (weights, gradients, optimizer state); zS comm = stage S's exposed "
                   "reduce-scatter and all-gather(s) over a flat ring (stages 1, 2: 2(N-1)/N "
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
    head = f"#{'N':>6}{'dp':>6}{'nodes':>7}{'compute':>10}"
    unit = f"#{'':>6}{'':>6}{'':>7}{'(ms)':>10}"
    for _, label, _ in extra:
        head += f"{label:>9}"
        unit += f"{'' if label == 'bubble' else '(ms)':>9}"
    head += f"{'allreduce':>11}{'step':>10}{'eff':>6}{'TTT':>12}"
    unit += f"{'(ms)':>11}{'(ms)':>10}{'':>6}{'(s)':>12}"
    out = [head, unit]
    for r in rows:
        ttt = None if steps_to_target is None else r["step_s"] * steps_to_target
        line = f" {r['n']:>6}{r['dp']:>6}{r['nodes']:>7}{fmt_ms(r['compute_s']):>10}"
        for key, _, fmt in extra:
            line += f"{fmt(r[key]):>9}"
        out.append(line + f"{fmt_ms(r['allreduce_s']):>11}{fmt_ms(r['step_s']):>10}"
                          f"{r['efficiency']:>6.2f}{fmt_s(ttt):>12}")
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
