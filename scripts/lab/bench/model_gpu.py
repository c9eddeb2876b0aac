"""Training step on the GPU: dtlab on CuPy against its PyTorch eager twin on the same GPU.

    python -m dtlab.lab.bench.model_gpu --json gpu-model.json   # on a CUDA GPU, ~1 min
    python -m dtlab.lab.bench.model_gpu --tiny                  # seconds

For the MLP and the transformer it times one training step (zero grads, forward,
backward, clip, AdamW; dtlab's as `dtlab-train` runs it, from a session) and the same
step of the PyTorch eager twin (scripts/lab/bench/model_torch.py: the same function and
parameter values, torch's kernels) moved to the same device, median of --reps after
--warmup, each step ended by a device synchronisation:

    fp32       TF32 off for both (CUPY_TF32=0; torch allow_tf32 False)
    fp32-tf32  TF32 on for both (CUPY_TF32=1; torch allow_tf32 True)
    fp16       dtlab --precision fp16 (half copy, float32 master, loss scaling) against
               torch.autocast(float16) with a GradScaler
    bf16       refused by dtlab on CuPy (CuPy has no bfloat16): torch's time alone

    torch/dtlab = median torch step / median dtlab step      (> 1: dtlab is faster)

CuPy reads CUPY_TF32 when it loads, so each TF32 setting runs in its own process
(this module with --one). Without a GPU (or CuPy, or PyTorch built with CUDA) it stops
with one line saying which is missing. The suite runs the --one path under the
CuPy-discipline check's strict namespace with PyTorch on the CPU (tests/lab/
test_bench_model_gpu.py); that checks the code, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

from dtlab.lab.bench import harness, model_torch
from dtlab.lab.bench.harness import alternate_times
from dtlab.models import backend
from dtlab.models.run.session import build_session, parse

SIZES = {
    "mlp": ["--model", "mlp", "--d-in", "1024", "--d-hidden", "4096", "--n-layers", "4",
            "--n-classes", "1024", "--batch-size", "512", "--n-samples", "4096"],
    "transformer": ["--model", "transformer", "--vocab", "4096", "--seq-len", "512",
                    "--d-model", "1024", "--n-heads", "16", "--n-layers", "4", "--d-ff", "4096",
                    "--batch-size", "8", "--n-tokens", "65536"],
}
TINY = {
    "mlp": ["--model", "mlp", "--d-in", "8", "--d-hidden", "16", "--n-layers", "2",
            "--n-classes", "4", "--batch-size", "8", "--n-samples", "256"],
    "transformer": ["--model", "transformer", "--vocab", "16", "--seq-len", "8",
                    "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--d-ff", "32",
                    "--batch-size", "2", "--n-tokens", "2048"],
}
SETTINGS = {"fp32": ("fp32", False), "fp32-tf32": ("fp32", True), "fp16": ("fp16", False),
            "bf16": ("bf16", False)}


class Missing(RuntimeError):
    """What this machine lacks for the benchmark."""


def torch_device():
    """PyTorch and the device its twin runs on: the GPU's, or the CPU under the
    CuPy-discipline check (the strict namespace is not a GPU)."""
    if not model_torch.available():
        raise Missing("PyTorch not installed")
    import torch

    if backend.device_name() == "CuPy-discipline check":
        return torch, torch.device("cpu")
    if not torch.cuda.is_available():
        raise Missing("PyTorch here is built without CUDA (or sees no GPU)")
    return torch, torch.device("cuda", torch.cuda.current_device())


def timed(step, reps: int, warmup: int) -> list[float]:
    """Seconds of `step()` over `reps` runs after `warmup`, the device synchronised
    around each (bench/model.py's timing)."""
    return alternate_times([step], reps, warmup)[0]


def dtlab_step(session):
    s = session

    def step():
        s.replica.compute_grads(s.loader.next())
        apply, _ = s.replica.finish_grads()
        if apply:
            s.model.clip_grad_norm(s.params, s.setup.optim.clip)
            s.optimizer.step(s.params.data, s.params.grad, s.setup.optim.lr)
    return step


def torch_step(session, precision: str, torch, device, sync):
    """The twin's step on `device`: parameters copied from the session's initial values."""
    host = session.model.init_params(session.setup.run.seed, xp=np)
    twin = model_torch.Twin(session.model, host, session.setup.optim, threads=1)
    twin.T = {n: torch.nn.Parameter(p.detach().to(device)) for n, p in twin.T.items()}
    o = session.setup.optim
    twin.opt = torch.optim.AdamW(list(twin.T.values()), lr=o.lr, betas=(o.beta1, o.beta2),
                                 eps=o.eps, weight_decay=o.weight_decay)
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    batch = [torch.from_numpy(a.astype(np.float32) if a.dtype.kind == "f" else a).to(device)
             for a in session.loader.next()[0]]  # (inputs, targets) of one micro-batch

    def step():
        twin.opt.zero_grad()
        with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
            loss = twin.loss(*batch)
        scaler.scale(loss).backward()
        scaler.unscale_(twin.opt)
        if o.clip > 0:
            torch.nn.utils.clip_grad_norm_(list(twin.T.values()), o.clip)
        scaler.step(twin.opt)
        scaler.update()
        sync()
    return step


def one(setting: str, tiny: bool, reps: int, warmup: int) -> list[dict]:
    """Both models at one setting, in this process (CUPY_TF32 already set by the caller)."""
    precision, tf32 = SETTINGS[setting]
    backend.select("gpu")
    torch, device = torch_device()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for name, argv in (TINY if tiny else SIZES).items():
        setup = parse([*argv, "--precision", "fp32" if precision == "bf16" else precision,
                       "--warmup", "0", "--steps", "1"], prog="dtlab-bench model_gpu")
        session = build_session(setup)
        row = {"model": name, "setting": setting, "device": backend.device_name()}
        t_times = timed(torch_step(session, precision, torch, device, sync), reps, warmup)
        row["torch_ms"] = statistics.median(t_times) * 1e3
        if precision == "bf16":
            row["dtlab_ms"] = None  # refused: CuPy has no bfloat16
        else:
            row["dtlab_ms"] = statistics.median(timed(dtlab_step(session), reps, warmup)) * 1e3
            row["torch_over_dtlab"] = row["torch_ms"] / row["dtlab_ms"]
        rows.append(row)
    return rows


TABLE = harness.Table(
    "torch/dtlab = median torch step / median dtlab step (> 1: dtlab is faster); dtlab ms "
    "\"refused\": the setting is not one dtlab runs",
    [harness.Column("model", 12, lambda r: r["model"]),
     harness.Column("setting", 10, lambda r: r["setting"]),
     harness.Column("dtlab ms", 9,
                    lambda r: "refused" if r["dtlab_ms"] is None else f"{r['dtlab_ms']:.3f}"),
     harness.Column("torch ms", 9, lambda r: r["torch_ms"], ".3f"),
     harness.Column("torch/dtlab", 11, lambda r: r["torch_over_dtlab"]
                    if r["dtlab_ms"] is not None else None, ".2f")])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dtlab-bench model_gpu", description=__doc__.split("\n")[0])
    harness.common_flags(p, "tiny sizes, 2 reps: a smoke run")
    p.add_argument("--reps", type=int, default=None, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)  # one process's setting
    args = p.parse_args(argv)
    reps = args.reps or (2 if args.tiny else 10)
    try:
        if args.one:
            json.dump(one(args.one, args.tiny, reps, args.warmup), sys.stdout)
            return 0
        backend.select("gpu")
        torch_device()
    except (backend.DeviceError, Missing) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    rows = []
    for setting, (_, tf32) in SETTINGS.items():
        r = subprocess.run([sys.executable, "-m", "dtlab.lab.bench.model_gpu", "--one", setting,
                            "--reps", str(reps), "--warmup", str(args.warmup),
                            *(["--tiny"] if args.tiny else [])], capture_output=True,
                           text=True, env={**os.environ, "CUPY_TF32": str(int(tf32))})
        if r.returncode != 0:
            print(f"{p.prog}: {setting} failed:\n{r.stderr}", file=sys.stderr)
            return 1
        rows += json.loads(r.stdout)
    print(TABLE.head())
    for r in rows:
        print(TABLE.line(r))
    if args.json:
        import torch

        harness.write(args.json, "model_gpu", rows, device=rows[0]["device"],
                      torch=torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
