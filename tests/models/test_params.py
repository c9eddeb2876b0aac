"""Flat parameter buffers: layout, seeded initialisation, views."""

import numpy as np
import pytest

from dtlab.models.params import FlatParams, ParamSpec, initial_value

SPECS = [ParamSpec("a.W", (3, 4)), ParamSpec("a.b", (4,), init="zeros", decay=False),
         ParamSpec("n.g", (4,), init="ones", decay=False)]


def test_views_share_the_flat_buffers():
    P = FlatParams(SPECS, seed=1)
    assert P.size == 12 + 4 + 4 and P.data.dtype == np.float32
    assert P.offsets == {"a.W": (0, 12), "a.b": (12, 16), "n.g": (16, 20)}
    P["a.W"][1, 2] = 7.0
    assert P.data[1 * 4 + 2] == 7.0
    P.grads["n.g"] += 2.0
    np.testing.assert_array_equal(P.grad[16:], 2.0)
    P.zero_grad()
    assert not P.grad.any()
    np.testing.assert_array_equal(P["a.b"], 0)
    np.testing.assert_array_equal(P["n.g"], 1)
    np.testing.assert_array_equal(P.decay_mask(), [1] * 12 + [0] * 8)


def test_init_depends_on_name_and_seed_not_on_layout():
    alone = FlatParams([SPECS[0]], seed=3)
    other_order = FlatParams([SPECS[2], SPECS[0]], seed=3)
    np.testing.assert_array_equal(alone["a.W"], other_order["a.W"])
    assert not np.array_equal(alone["a.W"], FlatParams([SPECS[0]], seed=4)["a.W"])
    assert alone.checksum() == FlatParams([SPECS[0]], seed=3).checksum()


def test_shard_initialises_to_the_slice_of_its_dense_tensor():
    dense = initial_value(ParamSpec("w", (4, 6)), seed=0)
    shard = ParamSpec("w", (4, 3), full_shape=(4, 6), index=(slice(None), slice(3, 6)))
    np.testing.assert_array_equal(initial_value(shard, seed=0), dense[:, 3:])
    bad = ParamSpec("w", (4, 2), full_shape=(4, 6), index=(slice(None), slice(3, 6)))
    with pytest.raises(ValueError, match="index gives shape"):
        initial_value(bad, seed=0)


def test_duplicate_names_and_bad_loads_are_errors():
    with pytest.raises(ValueError, match="duplicate parameter names"):
        FlatParams([SPECS[0], SPECS[0]])
    P = FlatParams(SPECS)
    with pytest.raises(ValueError, match="flat array of 20"):
        P.load(np.zeros(19))
    P.load(np.arange(20.0))
    np.testing.assert_array_equal(P["n.g"], [16, 17, 18, 19])


def test_weight_gradients_written_then_added_equal_the_plain_sums():
    """add_weight_grad writes a gradient still zero since zero_grad and adds later ones
    (further micro-batches, the deferred W pass, a shallow copy sharing the buffer):
    bit for bit the sums of `+= x.T @ dy`."""
    import copy

    P = FlatParams([ParamSpec("l.W", (5, 3)), ParamSpec("l.b", (3,))], seed=0)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((7, 5)).astype(np.float32) for _ in range(3)]
    dys = [rng.standard_normal((7, 3)).astype(np.float32) for _ in range(3)]
    want = np.zeros((5, 3), np.float32)
    for x, dy in zip(xs, dys, strict=True):
        want += x.T @ dy

    def add_all():
        for x, dy in zip(xs, dys, strict=True):
            P.add_weight_grad("l.W", x, dy)

    for deferred in (False, True, False):
        P.grad[...] = 1.0  # a previous step's gradient
        P.zero_grad()
        if deferred:
            with P.deferring() as queue:
                add_all()
            P.run_weight_grads(queue)
        else:
            add_all()
        np.testing.assert_array_equal(P.grads["l.W"], want)
    other = copy.copy(P)  # PipeDream's second weights: the gradients shared
    P.zero_grad()
    P.add_weight_grad("l.W", xs[0], dys[0])
    other.add_weight_grad("l.W", xs[1], dys[1])
    P.add_weight_grad("l.W", xs[2], dys[2])
    np.testing.assert_array_equal(P.grads["l.W"], want)
