"""The nccl-tests style tables simulate.py prints: predictions by N, fits, validation."""

from __future__ import annotations


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}" if seconds < 1 \
        else f"{seconds * 1e3:,.1f}"


def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:,.2f}"


def predictions(rows: list[dict], steps_to_target: int | None) -> str:
    head = (f"#{'N':>6}{'nodes':>7}{'compute':>10}{'ring':>10}{'algo':>16}{'step':>10}"
            f"{'eff':>6}{'naive':>11}{'step':>10}{'ps':>10}{'step':>10}{'ring TTT':>12}"
            f"{'naive TTT':>12}{'ps TTT':>12}")
    out = [head, f"#{'':>6}{'':>7}{'(ms)':>10}{'(ms)':>10}{'':>16}{'(ms)':>10}{'':>6}"
                 f"{'(ms)':>11}{'(ms)':>10}{'(ms)':>10}{'(ms)':>10}{'(s)':>12}{'(s)':>12}"
                 f"{'(s)':>12}"]
    for r in rows:
        ring, naive, ps = r["ring"], r["naive"], r["ps"]
        ttt = [None if steps_to_target is None else k["step_s"] * steps_to_target
               for k in (ring, naive, ps)]
        out.append(f" {r['n']:>6}{r['nodes']:>7}{fmt_ms(r['compute_s']):>10}"
                   f"{fmt_ms(ring['comm_s']):>10}{ring['algo']:>16}{fmt_ms(ring['step_s']):>10}"
                   f"{r['efficiency']:>6.2f}{fmt_ms(naive['comm_s']):>11}"
                   f"{fmt_ms(naive['step_s']):>10}{fmt_ms(ps['comm_s']):>10}"
                   f"{fmt_ms(ps['step_s']):>10}{fmt_s(ttt[0]):>12}{fmt_s(ttt[1]):>12}"
                   f"{fmt_s(ttt[2]):>12}")
    out.append("# legend: N ranks (sync) = workers (async); nodes = ceil(N / gpus per node); "
               "compute = forward + backward + update of one rank's batch; ring = exposed "
               "all-reduce of our ring family (algo: the one collective/choose.py picks, "
               "2-level/X: intra-node ring + X across nodes); step = compute + exposed "
               "communication; eff = compute / ring step (weak scaling: N = 1 is compute "
               "alone); naive = reduce to rank 0 + broadcast; ps = pull + push with the "
               "parameter-server shards; "
               "TTT = step x steps to target (-: no --steps-to-target)")
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
    out.append(f"#{'compute':>14}{'threads':>8}{'t0(ms)':>11}{'GFLOP/s':>9}{'rows':>6}"
               f"{'med err':>9}{'max err':>9}")
    for f in cal["compute"]:
        out.append(f" {f['model']:>14}{f['threads']:>8}{f['overhead_s'] * 1e3:>11.3f}"
                   f"{f['flops_per_s'] / 1e9:>9.2f}{f['rows']:>6}"
                   f"{100 * f['median_rel_err']:>8.1f}%{100 * f['max_rel_err']:>8.1f}%")
    for optimizer, g in cal["apply_s_per_byte"].items():
        out.append(f"# server apply, {optimizer}: {1 / g / 1e9:.3f} GB/s of gradient")
    out.append("# legend: all-reduce fits t = a alpha + (b + c) n beta (formulas.terms, gamma = "
               "beta); ps fits t = alpha + n beta per round with 1 worker, 1 shard; compute fits "
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
