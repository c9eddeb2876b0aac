"""dtlab-simulate --methods: local SGD, DiLoCo and compressed gradients at scale, by hand
on a test link, their payloads against the compressors that send them, the gradient
layout against the model's real buffer, and the command's table and JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from dtlab.lab.simulate import methods
from dtlab.lab.simulate.formulas import Network
from dtlab.lab.simulate.links import Link
from dtlab.lab.simulate.step import Host
from dtlab.models.compress import CompressConfig, make_compressor, matrix_layout
from dtlab.models.config import ConfigError, build
from dtlab.models.params import FlatParams
from dtlab.models.transformer import TransformerConfig
from dtlab.models.zoo import build_model

A, B, G = 10e-6, 1e-9, 0.25e-9  # alpha, beta, gamma
LINK = Link("test", A, B, G)
NET = Network(LINK, LINK)
GRAD = methods.Gradient(1_000_000, 4, ((0, 500, 1000), (500_000, 1000, 400)))  # 100k vectors
FREE = methods.CompressCompute(defaultdict(float), defaultdict(float), "none")  # no compute


def test_local_sgd_pays_one_all_reduce_every_h_steps():
    """local:H at N = 4: the all-reduce of 4 MB our ring family runs there (halving-doubling,
    4 A + 1.5 n B + 0.75 n G = 6.79 ms), a quarter of it a step at H = 4; the straggler
    wait sqrt(H) / H of a step's."""
    ar = 4 * A + 1.5 * 4e6 * B + 0.75 * 4e6 * G
    for H in (1, 4, 50):
        s = methods.method_step(methods.Method("local", H), GRAD, 4, NET, 0.01, Host(0),
                                straggler_s=1e-3, cc=FREE)
        assert s.comm_s == pytest.approx((ar + 1e-3 * math.sqrt(H)) / H, rel=1e-12)
        assert s.parts["sent_bytes"] == pytest.approx(2 * 3 / 4 * 4e6 / H)
    one = methods.method_step(methods.Method("diloco", 1), GRAD, 4, NET, 0.01, Host(0), 0.0,
                              FREE)
    assert one.comm_s == pytest.approx(ar, rel=1e-12)  # H = 1: plain DP's all-reduce, unhidden


def test_compressed_exchanges_by_hand():
    """N = 4. top-1%: k = 10,000 values + int32 indices = 80 kB a rank, gathered: 3 A + 3 x
    80 kB B; sign: 125,004 B a rank, the same; random-1%: the ring all-reduce of 40 kB;
    PowerSGD rank 4: P = 500 x 4 + 1000 x 4 + 100,000 vector elements, Q = 1000 x 4 + 400 x 4,
    two all-reduces."""
    def ring(n):  # our ring family at N = 4 and these sizes: halving-doubling
        return 4 * A + 1.5 * n * B + 0.75 * n * G
    want = {"topk:0.01": 3 * A + 3 * 80_000 * B, "sign": 3 * A + 3 * 125_004 * B,
            "randk:0.01": ring(40_000), "powersgd:4": ring(106_000 * 4) + ring(5_600 * 4)}
    for text, seconds in want.items():
        (m,) = methods.parse(text)
        s = methods.method_step(m, GRAD, 4, NET, 0.01, Host(0), 0.0, FREE)
        assert s.comm_s == pytest.approx(seconds, rel=1e-12), text
        assert s.step_s == pytest.approx(0.01 + seconds)
    # compute: top-k and sign add every gathered payload, random-k and PowerSGD one
    cc = methods.CompressCompute({"topk0.01": 1e-3, "randk0.01": 1e-3}, {"topk0.01": 1e-4,
                                 "randk0.01": 1e-4}, "test")
    for text, adds in (("topk:0.01", 4), ("randk:0.01", 1)):
        (m,) = methods.parse(text)
        s = methods.method_step(m, GRAD, 4, NET, 0.01, Host(0), 0.0, cc)
        assert s.parts["compress_s"] == pytest.approx(1e-3 + adds * 1e-4)


@pytest.mark.parametrize("text", ["topk:0.01", "randk:0.05", "sign", "powersgd:2"])
def test_payload_bytes_are_the_compressors_own(text):
    """The simulator's bytes equal what models/compress.py's compressor makes of the real
    model's gradient (random-k: its values; the step number travels in no collective)."""
    cfg = TransformerConfig(vocab=16, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)
    params = FlatParams(build_model("transformer", cfg).specs())
    grad = methods.gradient_of("transformer", cfg, 4)
    assert grad.elements == params.size
    assert list(grad.matrices) == matrix_layout(params)
    (m,) = methods.parse(text)
    c = make_compressor(build(CompressConfig, {"compress": text}), params.size, np.float32,
                        np, matrix_layout(params))
    payload = c.compress(np.random.default_rng(1).standard_normal(params.size)
                         .astype(np.float32))
    sent = payload.values.nbytes if m.kind == "randk" else payload.nbytes
    assert methods.payload_bytes(m, grad) == sent


def test_measured_compute_times_the_real_compressors():
    grad = methods.Gradient(200_000, 4, ((0, 200, 500),))
    ms = methods.parse("topk:0.01,sign,powersgd:2,local:4")
    cc = methods.measured_compute(ms, grad, repeats=2)
    assert set(cc.encode_s) == {"topk0.01", "sign", "powersgd2"}  # local SGD compresses nothing
    assert all(t > 0 for t in [*cc.encode_s.values(), *cc.decode_s.values()])
    # a bigger top-k gradient takes longer to select
    big = methods.measured_compute(ms[:1], methods.Gradient(4_000_000, 4, ()), repeats=2)
    assert big.encode_s["topk0.01"] > cc.encode_s["topk0.01"]


@pytest.mark.parametrize("text, message", [
    ("local:0", "local:H needs H, a positive integer"),
    ("diloco:x", "diloco:H needs H"),
    ("topk:2", "--methods topk:2: --compress 'topk:2': topk:F takes a fraction"),
    ("zip:3", "--methods zip:3: not one of local, diloco"),
])
def test_bad_methods_are_named(text, message):
    with pytest.raises(ConfigError, match=message):
        methods.parse(text)


def test_the_command_prints_and_writes_every_method(tmp_path):
    out = tmp_path / "m.json"
    done = subprocess.run(
        [sys.executable, "-m", "dtlab.lab.simulate", "--link", "100gbit", "--intra-link",
         "nvlink", "--gpus-per-node", "8", "--tflops", "100", "--workers", "1,64",
         "--methods", "local:8,topk:0.01,sign", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "local8 comm" in done.stdout and "topk0.01 comm" in done.stdout
    data = json.loads(out.read_text())
    assert data["methods"] == ["local8", "topk0.01", "sign"]
    for row in data["rows"]:
        for label in data["methods"]:
            s = row[f"method:{label}"]
            assert s["step_s"] == pytest.approx(row["compute_s"] + s["comm_s"])
    r64 = data["rows"][1]
    assert r64["method:local8"]["comm_s"] < r64["ring"]["comm_s"]
    bad = subprocess.run([sys.executable, "-m", "dtlab.lab.simulate", "--methods", "local:8",
                          "--pp", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--methods local:8 predicts" in bad.stderr, bad.stderr
