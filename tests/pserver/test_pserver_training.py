"""Training through the parameter servers with real worker processes.

Asynchronous SGD reaches near the data's loss floor; BSP with W workers of
batch B lands on the parameters of single-process training with batch W*B
(the two topologies agree when consistency is equal); SSP keeps every read
within s clocks of the slowest worker.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from support.mpirun import mpirun
from support.pserver_util import ONE_BLAS_THREAD, ROOT, addresses, run_workers, serve

from dtlab.models.run import checkpoint
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

MLP = {"d_in": 4, "d_hidden": 64, "n_layers": 1, "n_classes": 3}
TRANSFORMER = {"vocab": 8, "seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64}


def flags(model: str, cfg: dict) -> list[str]:
    return ["--model", model] + [x for k, v in cfg.items() for x in (f"--{k.replace('_', '-')}",
                                                                        str(v))]


def final_loss(paths) -> tuple[float, float]:
    """(mean loss over the last 10% of every worker's steps, the data's floor)."""
    tails, floor = [], None
    for p in paths:
        header, records = read_metrics(str(p))
        floor = header["floor"]
        tails += [r["loss"] for r in records[-max(1, len(records) // 10):]]
    return float(np.mean(tails)), floor


@pytest.mark.parametrize("model, cfg, data, extra, steps, consistency, gap", [
    ("mlp", MLP, {}, ["--batch-size", "64"], 400, "ssp", 0.15),
    # ASP's push order is the scheduler's: at 150 steps the gap ranged 0.03-0.10 over 9
    # launches (one CI run at 0.1003), at 250 steps 0.00-0.03 over 8
    ("transformer", TRANSFORMER, {"markov_order": 1, "n_tokens": 20000}, ["--batch-size", "16"],
     250, "asp", 0.1),
])
def test_async_training_reaches_the_floor(tmp_path, model, cfg, data, extra, steps, consistency,
                                          gap):
    optim = {"optimizer": "adam", "lr": 1e-2, "warmup": 10, "schedule": "constant"}
    server = {"consistency": consistency, "num_workers": 2}
    if consistency == "ssp":
        server["staleness"] = 1
    with serve(shards=2, model=model, model_cfg=cfg, optim=optim, data=data, **server) as daemons:
        paths = run_workers(addresses(daemons), 2, [*flags(model, cfg), *flags("", data)[2:],
                                                    *extra, "--steps", str(steps), "--clip", "0"],
                            tmp_path)
        stats = [d.store.stats() for d in daemons]
    loss, floor = final_loss(paths)
    assert loss - floor < gap, (loss, floor)
    for st in stats:  # every gradient applied once, with its staleness recorded
        assert st.updates == st.staleness.total == 2 * steps
        assert all(w.staleness.total == steps for w in st.workers.values())
        if consistency == "ssp":
            assert st.max_clock_lead <= 1
    header, records = read_metrics(str(paths[0]))
    assert header["topology"] == "async" and header["world"] == 2
    assert len(records) == steps and len(records[0]["staleness"]) == 2


@pytest.mark.parametrize("optim, launch", [
    (["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"], "processes"),
    (["--optimizer", "adam", "--lr", "0.01"], "mpiexec"),  # ranks become worker ids
])
def test_bsp_matches_single_process_training(tmp_path, optim, launch):
    W, B, K = 2, 8, 12
    model = flags("mlp", MLP)
    common = [*model, *optim, "--clip", "0", "--warmup", "3", "--seed", "3"]
    ref = tmp_path / "ref"
    subprocess.run([sys.executable, "-m", "dtlab.models.run.train", *common, "--steps", str(K),
                    "--batch-size", str(W * B), "--checkpoint-dir", str(ref),
                    "--checkpoint-every", str(K)], cwd=ROOT, check=True, timeout=120,
                   capture_output=True, env=ONE_BLAS_THREAD)
    want = checkpoint.load(checkpoint.latest(str(ref)))[0]["params"]

    opt = dict(zip(optim[::2], optim[1::2], strict=True))
    ocfg = {"optimizer": opt["--optimizer"], "lr": float(opt["--lr"]), "warmup": 3,
            "momentum": float(opt.get("--momentum", 0.0))}
    with serve(shards=2, model_cfg=MLP, optim=ocfg, consistency="bsp", num_workers=W,
               schedule_steps=K, seed=3) as daemons:
        worker = [*model, "--clip", "0", "--seed", "3", "--steps", str(K), "--batch-size", str(B)]
        if launch == "mpiexec":
            r = mpirun(W, "-m", "dtlab.pserver.worker", "--servers", addresses(daemons), *worker,
                       "--metrics", str(tmp_path / "w{worker}.jsonl"), wrap=False, timeout=120)
            assert r.rc == 0, r
            assert all(len(read_metrics(str(tmp_path / f"w{w}.jsonl"))[1]) == K for w in range(W))
        else:
            run_workers(addresses(daemons), W, worker, tmp_path)
        got = np.concatenate([d.store.params for d in daemons])
        assert all(d.store.version == K for d in daemons)
        assert all(d.store.stats().staleness.max == 0 for d in daemons)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
