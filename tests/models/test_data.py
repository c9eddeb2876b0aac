"""The data layer: exact loss floors against Monte-Carlo estimates, sources
against their model configs, and the sharded loader's data-parallel contract."""

import argparse
import dataclasses
import json
import math
import sys

import numpy as np
import pytest

from dtlab.models.config import ConfigError, add_flags, build, flag, from_namespace
from dtlab.models.data import (
    ArrayDataset,
    DataConfig,
    Dataset,
    MarkovSource,
    ShardedLoader,
    TeacherDataset,
    make_dataset,
    teacher_floor,
)
from dtlab.models.data.markov import entropy
from dtlab.models.mlp import MLPConfig
from dtlab.models.transformer import TransformerConfig


def within(estimate: float, exact: float, std_error: float, z: float = 5.0) -> bool:
    return abs(estimate - exact) <= z * std_error


# ---------------------------------------------------------------- teacher


@pytest.mark.parametrize("eps, C", [(0.1, 4), (0.3, 8), (0.05, 2)])
def test_teacher_floor_is_the_bayes_loss(eps, C):
    ds = TeacherDataset(32768, 8, C, eps, seed=3)
    p = ds.posterior(ds.x)  # (n, C)
    # exactly: the entropy of p(y | x) is the same H for every x
    np.testing.assert_allclose(entropy(p), ds.floor, rtol=1e-12)
    # Monte Carlo: the Bayes predictor's mean loss on the drawn labels
    nll = -np.log(p[np.arange(ds.n), ds.y])  # (n,)
    assert within(nll.mean(), ds.floor, nll.std() / math.sqrt(ds.n))
    assert ds.floor == teacher_floor(eps, C)


def test_teacher_floor_formula_by_hand():
    # eps = 0.1, C = 4: -(0.9 ln 0.9) - 0.1 ln(0.1 / 3)
    assert teacher_floor(0.1, 4) == pytest.approx(0.0948245 + 0.3401197, abs=1e-6)
    assert teacher_floor(0.0, 10) == 0.0
    assert teacher_floor(0.75, 4) == pytest.approx(math.log(4))  # labels independent of x


def test_teacher_label_noise_rate_and_uniform_flips():
    eps, C, n = 0.2, 5, 65536
    ds = TeacherDataset(n, 6, C, eps, seed=7)
    flipped = ds.y != ds.clean
    assert within(flipped.mean(), eps, math.sqrt(eps * (1 - eps) / n))
    shift = (ds.y[flipped] - ds.clean[flipped]) % C  # 1..C-1, each with prob 1 / (C - 1)
    counts = np.bincount(shift, minlength=C)
    assert counts[0] == 0
    m, q = flipped.sum(), 1 / (C - 1)
    assert all(within(c / m, q, math.sqrt(q * (1 - q) / m)) for c in counts[1:])
    np.testing.assert_array_equal(ds.clean, np.argmax(ds.x.astype(np.float64) @ ds.W, axis=1))


def test_teacher_without_noise_is_clean():
    ds = TeacherDataset(1000, 4, 3, 0.0, seed=0)
    np.testing.assert_array_equal(ds.y, ds.clean)
    assert ds.floor == 0.0
    assert np.all(ds.posterior(ds.x)[np.arange(ds.n), ds.y] == 1.0)


def test_teacher_is_fixed_by_the_data_seed():
    a, b, c = (TeacherDataset(512, 4, 3, 0.1, seed=s) for s in (5, 5, 6))
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)
    assert a.x.dtype == np.float32 and a.y.dtype == np.int64
    assert np.bincount(a.clean, minlength=3).min() > 512 / 3 / 2  # no class starved


# ---------------------------------------------------------------- markov


@pytest.fixture(scope="module")
def chain():
    return MarkovSource(vocab=16, order=2, support=4, seed=1234)


@pytest.fixture(scope="module")
def stream(chain):
    return chain.sample(1 << 20)


def test_markov_stationary_distribution_is_stationary(chain):
    pi = chain.pi
    assert pi.shape == (16**2,) and np.all(pi > 0)
    assert abs(pi.sum() - 1) < 1e-14
    assert np.abs(chain.step(pi) - pi).sum() < 1e-12
    np.testing.assert_allclose(chain.P.sum(axis=1), 1.0, rtol=1e-14)
    # sparse: `support` tokens carry all but the mixed-in uniform mass
    top = np.sort(chain.P, axis=1)[:, -4:].sum(axis=1)
    assert np.all(top >= 0.99)


def test_nearly_periodic_chain_converges():
    # seed 372: P is close to the 2-cycle 0 <-> 1, with an eigenvalue -0.98
    src = MarkovSource(vocab=3, order=1, support=2, seed=372)
    assert np.linalg.eigvals(src.P).real.min() < -0.95
    assert np.abs(src.step(src.pi) - src.pi).sum() < 1e-13


def test_markov_transition_matrix_by_hand():
    # step() is pi P for the V^k x V^k context matrix, built here directly
    src = MarkovSource(vocab=3, order=2, support=2, seed=0)
    V, n = 3, 9
    dense = np.zeros((n, n))
    for c in range(n):
        for x in range(V):
            dense[c, (c * V + x) % n] += src.P[c, x]
    np.testing.assert_allclose(src.pi @ dense, src.pi, atol=1e-15)
    w, v = np.linalg.eig(dense.T)
    ref = np.real(v[:, np.argmin(abs(w - 1))])
    np.testing.assert_allclose(src.pi, ref / ref.sum(), atol=1e-13)


def test_markov_entropy_rate_matches_counts(chain, stream):
    """Plug-in conditional entropy of the 1M-token stream, Miller-Madow corrected
    (+ (cells - contexts) / 2N), within 0.01 nats of the exact h."""
    V, N = 16, len(stream) - 2
    ctx = stream[:-2] * V + stream[1:-1]  # (N,)
    counts = np.bincount(ctx * V + stream[2:], minlength=V**3).reshape(V**2, V)
    n_c = counts.sum(axis=1)
    plug_in = (entropy(counts / n_c[:, None]) * n_c).sum() / N
    miller_madow = plug_in + ((counts > 0).sum() - (n_c > 0).sum()) / (2 * N)
    assert abs(miller_madow - chain.entropy_rate) < 0.01
    # the stream's context frequencies are pi (stationary from the first token)
    assert np.abs(n_c / N - chain.pi).sum() < 0.05
    # the floor is interesting: far below a unigram model
    assert chain.entropy_rate < 0.5 * math.log(V)


def test_markov_stream_starts_stationary():
    """Over many sources the first token is distributed as pi: E[1(s_0 = j) - pi(j)] = 0."""
    dev = []
    for seed in range(200):
        src = MarkovSource(vocab=2, order=1, support=2, seed=seed)
        dev.append((src.sample(1)[0] == np.arange(2)) - src.pi)  # (V,)
    dev = np.array(dev)  # (seeds, V)
    assert np.all(abs(dev.mean(axis=0)) <= 5 * dev.std(axis=0) / math.sqrt(len(dev)))


def test_markov_short_context_floor(chain):
    h, f1 = chain.entropy_rate, chain.conditional_entropy(1)
    assert f1 > h + 0.5  # one token says little about an order-2 source
    assert chain.conditional_entropy(2) == chain.conditional_entropy(7) == h
    assert chain.floor(1) == pytest.approx(f1)
    assert chain.floor(32) == pytest.approx((f1 + 31 * h) / 32)
    first = chain.pi.reshape(16, 16).sum(axis=1)  # (V,) marginal of one token
    assert f1 == pytest.approx(entropy(chain.pi) - entropy(first))
    # order 3: each extra token of context helps until the order is reached
    src = MarkovSource(vocab=6, order=3, support=3, seed=1)
    f = [src.conditional_entropy(m) for m in (1, 2, 3)]
    assert f[0] > f[1] > f[2] == src.entropy_rate
    first_order = MarkovSource(vocab=6, order=1, support=3, seed=1)
    assert first_order.floor(8) == pytest.approx(first_order.entropy_rate)


def test_markov_window_floor_is_the_bayes_loss():
    """The mean loss of the true conditionals over every window of the dataset is
    the reported floor, position 0 (one token of context) included."""
    T = 8
    cfg = DataConfig(data="markov", n_tokens=200_001)
    ds, _ = make_dataset(cfg, "transformer", TransformerConfig(vocab=16, seq_len=T))
    src = MarkovSource(16, 2, 4, cfg.data_seed)
    np.testing.assert_array_equal(ds.stream, src.sample(cfg.n_tokens))
    x, y = ds.batch(np.arange(ds.n))  # (n, T) each
    pair = src.pi.reshape(16, 16)
    p0 = pair[x[:, 0], y[:, 0]] / pair.sum(axis=1)[x[:, 0]]  # p(x_1 | x_0)
    pt = src.P[x[:, :-1] * 16 + x[:, 1:], y[:, 1:]]  # p(x_{t+1} | x_{t-1}, x_t), (n, T-1)
    nll = -np.log(np.concatenate([p0[:, None], pt], axis=1))  # (n, T)
    assert ds.floor == pytest.approx(src.floor(T))
    assert within(nll.mean(), ds.floor, nll.mean(axis=1).std() / math.sqrt(ds.n))


# ---------------------------------------------------------------- make_dataset


def test_auto_picks_the_source_by_model():
    mlp = MLPConfig(d_in=5, n_classes=3)
    ds, cfg = make_dataset(DataConfig(n_samples=100), "mlp", mlp)
    assert ds.describe()["source"] == "teacher" and cfg == mlp
    x, y = ds.batch(np.array([0, 7, 99]))
    assert x.shape == (3, 5) and x.dtype == np.float32 and y.dtype == np.int64
    tf = TransformerConfig(vocab=8, seq_len=5)
    ds, cfg = make_dataset(DataConfig(n_tokens=1001), "transformer", tf)
    assert ds.describe()["source"] == "markov" and cfg == tf and ds.n == 200
    x, y = ds.batch(np.array([0, 199]))
    assert x.shape == y.shape == (2, 5) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[0], ds.stream[:5])
    np.testing.assert_array_equal(y[1], ds.stream[996:1001])


def test_digits_fix_the_mlp_shape():
    pytest.importorskip("sklearn")
    ds, cfg = make_dataset(DataConfig(data="digits"), "mlp", MLPConfig(d_hidden=17))
    assert (cfg.d_in, cfg.n_classes, cfg.d_hidden) == (64, 10, 17)
    assert ds.n == 1797 and ds.floor is None
    x, y = ds.batch(np.arange(ds.n))
    assert x.dtype == np.float32 and x.shape == (1797, 64)
    assert x.min() == 0.0 and x.max() == 1.0
    assert set(np.unique(y)) == set(range(10))


def test_text_is_byte_windows(tmp_path):
    path = tmp_path / "corpus.txt"
    data = "naïve tokens ✓ ".encode() * 20
    path.write_bytes(data)
    ds, cfg = make_dataset(DataConfig(data="text", path=str(path)), "transformer",
                           TransformerConfig(vocab=16, seq_len=10))
    assert cfg.vocab == 256 and cfg.seq_len == 10 and ds.floor is None
    assert ds.n == (len(data) - 1) // 10
    x, y = ds.batch(np.array([3]))
    assert bytes(x[0].astype(np.uint8)) == data[30:40]
    assert bytes(y[0].astype(np.uint8)) == data[31:41]
    exact = tmp_path / "exact.txt"
    exact.write_bytes(b"0123456789A")  # seq_len + 1 bytes: exactly one window
    ds, _ = make_dataset(DataConfig(data="text", path=str(exact)), "transformer",
                         TransformerConfig(seq_len=10))
    assert ds.n == 1


def test_every_source_is_a_described_dataset(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)))
    cases = [(DataConfig(n_samples=64), "mlp", MLPConfig()),
             (DataConfig(data="markov", n_tokens=4096), "transformer", TransformerConfig()),
             (DataConfig(data="text", path=str(path)), "transformer", TransformerConfig())]
    for cfg, name, model_cfg in cases:
        ds, _ = make_dataset(cfg, name, model_cfg)
        assert isinstance(ds, Dataset)
        info = json.loads(json.dumps(ds.describe()))
        assert info["n"] == ds.n and info["floor"] == ds.floor
    markov = make_dataset(cases[1][0], "transformer", TransformerConfig())[0].describe()
    assert markov["floor"] < markov["uniform_loss"] - 1 and markov["entropy_rate"] > 0


def test_batch_rejects_out_of_range_indices():
    ds = TeacherDataset(10, 2, 2, 0.1, seed=0)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        ds.batch(np.array([0, 10]))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("values, flag", [
    ({"label_noise": 1.0}, "--label-noise"),
    ({"label_noise": -0.1}, "--label-noise"),
    ({"n_samples": 0}, "--n-samples"),
    ({"markov_order": 0}, "--markov-order"),
    ({"markov_support": 0}, "--markov-support"),
    ({"n_tokens": 1}, "--n-tokens"),
    ({"data_seed": -1}, "--data-seed"),
    ({"data": "imagenet"}, "--data"),
    ({"data": "text"}, "--path"),
    ({"data": "markov", "path": "x.txt"}, "--path"),
    ({"markov_order": 1.5}, "--markov-order"),
])
def test_bad_flag_values_name_the_flag(values, flag):
    with pytest.raises(ConfigError, match=flag):
        build(DataConfig, values)


def test_every_field_is_a_flag():
    parser = argparse.ArgumentParser()
    add_flags(parser, DataConfig)
    ns = parser.parse_args(["--data", "markov", "--markov-order", "3", "--label-noise", "0.2",
                            "--n-tokens", "4096", "--data-seed", "9"])
    cfg = from_namespace(DataConfig, ns)
    assert (cfg.data, cfg.markov_order, cfg.label_noise, cfg.n_tokens, cfg.data_seed) == (
        "markov", 3, 0.2, 4096, 9)
    assert cfg.n_samples == DataConfig.n_samples
    assert all(flag(f.name) in parser.format_help() for f in dataclasses.fields(DataConfig))


@pytest.mark.parametrize("data, model", [("digits", "transformer"), ("teacher", "transformer"),
                                         ("markov", "mlp"), ("text", "mlp")])
def test_source_that_does_not_fit_the_model(tmp_path, data, model):
    path = tmp_path / "t.txt"
    path.write_bytes(b"x" * 100)
    cfg = DataConfig(data=data, path=str(path) if data == "text" else "")
    model_cfg = MLPConfig() if model == "mlp" else TransformerConfig()
    with pytest.raises(ConfigError, match=f"--data {data}.*--model {model}"):
        make_dataset(cfg, model, model_cfg)


def test_unusable_path_names_it(tmp_path):
    tf = TransformerConfig(seq_len=10)
    with pytest.raises(ConfigError, match="--path .*missing.txt.*cannot read"):
        make_dataset(DataConfig(data="text", path=str(tmp_path / "missing.txt")), "transformer",
                     tf)
    with pytest.raises(ConfigError, match="--path .*cannot read"):
        make_dataset(DataConfig(data="text", path=str(tmp_path)), "transformer", tf)
    short = tmp_path / "short.txt"
    short.write_bytes(b"0123456789")  # seq_len bytes: no target for the last token
    with pytest.raises(ConfigError, match="--path .*10 bytes.*--seq-len 10"):
        make_dataset(DataConfig(data="text", path=str(short)), "transformer", tf)


def test_markov_that_cannot_be_built_names_the_flag():
    tf = TransformerConfig(vocab=4, seq_len=16)
    with pytest.raises(ConfigError, match="--markov-support 5 exceeds --vocab 4"):
        make_dataset(DataConfig(markov_support=5), "transformer", tf)
    with pytest.raises(ConfigError, match="--markov-order 10"):
        make_dataset(DataConfig(markov_order=10), "transformer", tf)
    with pytest.raises(ConfigError, match="--n-tokens 16 .*--seq-len 16"):
        make_dataset(DataConfig(n_tokens=16), "transformer", tf)


def test_teacher_needs_two_classes():
    with pytest.raises(ConfigError, match="--n-classes"):
        make_dataset(DataConfig(), "mlp", MLPConfig(n_classes=1))


def test_digits_without_sklearn_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"--data digits .*pip install dtlab\[data\]"):
        make_dataset(DataConfig(data="digits"), "mlp", MLPConfig())


# ---------------------------------------------------------------- loader


def indexed(n: int) -> ArrayDataset:
    """x[i] = i, so a batch shows which examples it holds."""
    return ArrayDataset("index", np.arange(n, dtype=np.float32)[:, None], np.arange(n), n, None)


def examples(micro_batches) -> np.ndarray:
    return np.concatenate([y for _, y in micro_batches])


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_n_ranks_see_what_one_process_sees(N, k):
    B, n = 5, 1000  # n % (N k B) != 0 for N = 3: a tail is dropped each epoch
    ds = indexed(n)
    single = ShardedLoader(ds, N * k * B, seed=11)
    ranks = [ShardedLoader(ds, B, rank=r, world=N, seed=11, micro_batches=k) for r in range(N)]
    for _ in range(3 * n // (N * k * B) + 2):  # across several epoch boundaries
        parts = [r.next() for r in ranks]
        assert all(len(p) == k and all(len(y) == B for _, y in p) for p in parts)
        np.testing.assert_array_equal(np.concatenate([examples(p) for p in parts]),
                                      examples(single.next()))
        assert {r.epoch for r in ranks} == {single.epoch}
    # one process with micro-batches of N B sees the same window too
    acc = ShardedLoader(ds, N * B, seed=11, micro_batches=k)
    fresh = ShardedLoader(ds, N * k * B, seed=11)
    for _ in range(5):
        mbs = acc.next()
        assert len(mbs) == k
        np.testing.assert_array_equal(examples(mbs), examples(fresh.next()))


def test_epochs_follow_the_stated_permutation():
    n, B, seed = 10, 3, 4
    loader = ShardedLoader(indexed(n), B, seed=seed)
    assert loader.steps_per_epoch == 3
    seen = [examples(loader.next()) for _ in range(7)]
    for e in range(3):
        perm = np.random.default_rng([seed, e]).permutation(n)
        for s in range(3 if e < 2 else 1):
            np.testing.assert_array_equal(seen[3 * e + s], perm[s * B:(s + 1) * B])
    assert loader.state_dict() == {"epoch": 2, "position": 3}
    assert len(np.unique(np.concatenate(seen[:3]))) == 9  # no repeats within an epoch


def test_loader_is_deterministic():
    ds = indexed(100)

    def run(seed, rank):
        loader = ShardedLoader(ds, 4, rank=rank, world=2, seed=seed)
        return np.concatenate([examples(loader.next()) for _ in range(30)])  # 2.4 epochs

    np.testing.assert_array_equal(run(0, 1), run(0, 1))
    assert not np.array_equal(run(0, 1), run(1, 1))
    for a, b in zip(run(0, 0).reshape(-1, 4), run(0, 1).reshape(-1, 4), strict=True):
        assert not set(a) & set(b)  # ranks never share an example within a step


def test_resume_is_bit_identical():
    ds, _ = make_dataset(DataConfig(n_tokens=2001), "transformer",
                         TransformerConfig(vocab=8, seq_len=7))  # n = 285
    kw = {"batch_size": 6, "rank": 1, "world": 3, "seed": 5, "micro_batches": 2}
    straight = ShardedLoader(ds, **kw)
    for _ in range(10):  # W = 36: 7 steps fill epoch 0 (252 of 285), then 3 into epoch 1
        straight.next()
    state = json.loads(json.dumps(straight.state_dict()))
    assert state == {"epoch": 1, "position": 3 * 36}
    rest = [straight.next() for _ in range(12)]  # 4 more in epoch 1, 7 in epoch 2, 1 in 3
    resumed = ShardedLoader(ds, **kw)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    for want, got in zip(rest, [resumed.next() for _ in range(12)], strict=True):
        for (wx, wy), (gx, gy) in zip(want, got, strict=True):
            assert wx.tobytes() == gx.tobytes() and wy.tobytes() == gy.tobytes()
    assert resumed.state_dict() == straight.state_dict() == {"epoch": 3, "position": 36}


def test_bad_loader_state_is_refused():
    loader = ShardedLoader(indexed(10), 2)
    for bad in ({"epoch": 0}, {"epoch": -1, "position": 0}, {"epoch": 0, "position": 11},
                {"epoch": 0.5, "position": 0}):
        with pytest.raises(ValueError, match="loader state"):
            loader.load_state_dict(bad)
    assert loader.state_dict() == {"epoch": 0, "position": 0}


def test_loader_errors_name_the_flag():
    ds = indexed(100)
    with pytest.raises(ConfigError, match=r"--batch-size 13 x --grad-accum 2 x 4 rank.* = 104"):
        ShardedLoader(ds, 13, rank=0, world=4, micro_batches=2)
    ShardedLoader(ds, 25, rank=3, world=4)  # W = n exactly is fine
    with pytest.raises(ConfigError, match="--batch-size"):
        ShardedLoader(ds, 0)
    with pytest.raises(ConfigError, match="--grad-accum"):
        ShardedLoader(ds, 4, micro_batches=0)
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        ShardedLoader(ds, 4, rank=2, world=2)
