"""Pipeline schedules checked on their instruction lists alone (models/schedule.py)."""

import pytest

from dtlab.models.schedule import (
    SCHEDULES,
    Op,
    bubble_formula,
    gpipe,
    in_flight,
    make,
    one_f_one_b,
    simulate,
    validate,
    zb_h1,
)

SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, p, 2 * p, 3 * p + 1)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p,m", SIZES)
def test_every_pass_once_in_order(name, p, m):
    ops = make(name, p, m)
    assert len(ops) == p
    validate(ops, m)  # each F, B, W once; B after F, W after B; same order on every stage


@pytest.mark.parametrize("p,m", SIZES)
def test_in_flight_bounds(p, m):
    assert [in_flight(s) for s in gpipe(p, m)] == [m] * p
    assert [in_flight(s) for s in one_f_one_b(p, m)] == [min(p - s, m) for s in range(p)]
    zb = zb_h1(p, m)
    assert [in_flight(s) for s in zb] == [min(p - s, m) for s in range(p)]
    assert max(in_flight(s, until="W") for s in zb) <= min(p, m)  # 1F1B's peak memory


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("times", [(1, 1, 1), (1, 2, 0), (1.0, 1.5, 0.5)])
def test_bubble_matches_formula(name, p, m, times):
    timeline = simulate(make(name, p, m), *times)
    assert timeline.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert timeline.bubble == pytest.approx(bubble_formula(name, p, m, *times), abs=1e-12)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m >= p])
def test_zero_bubble_h1_idles_a_third_of_1f1b(p, m):
    zb, base = simulate(zb_h1(p, m)), simulate(one_f_one_b(p, m))
    assert zb.bubble == pytest.approx(bubble_formula("zb-h1", p, m), abs=1e-12)
    assert all(z == pytest.approx(b / 3) for z, b in zip(zb.idle, base.idle, strict=True))


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if p > 1])
def test_zero_bubble_never_worse(p, m):
    assert simulate(zb_h1(p, m)).makespan <= simulate(one_f_one_b(p, m)).makespan


def test_1f1b_shape():
    assert one_f_one_b(2, 3) == [
        [Op("F", 0), Op("F", 1), Op("BW", 0), Op("F", 2), Op("BW", 1), Op("BW", 2)],
        [Op("F", 0), Op("BW", 0), Op("F", 1), Op("BW", 1), Op("F", 2), Op("BW", 2)],
    ]


@pytest.mark.parametrize("broken,message", [
    ([[Op("B", 0), Op("F", 0), Op("W", 0)]], "B0 before F0"),
    ([[Op("F", 0), Op("W", 0), Op("B", 0)]], "W0 before B0"),
    ([[Op("F", 0), Op("BW", 0), Op("W", 0)]], "W passes [0, 0]"),
    ([[Op("F", 0), Op("F", 1), Op("BW", 0), Op("BW", 1)],
      [Op("F", 0), Op("F", 1), Op("BW", 1), Op("BW", 0)]], "order differs"),
])
def test_validate_names_the_broken_rule(broken, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(broken, len(broken[0]) // 2 if len(broken) > 1 else 1)


def test_deadlock_is_named():
    crossed = [[Op("F", 0), Op("BW", 0), Op("F", 1), Op("BW", 1)],
               [Op("F", 1), Op("F", 0), Op("BW", 0), Op("BW", 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(crossed)


def test_bad_sizes_and_names():
    with pytest.raises(ValueError, match="m >= 1"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        make("pipedream", 2, 2)


def test_stage_times_replay_unequal_stages():
    """A slow last stage sets the pace: with per-stage times the replay's makespan is the
    slow stage's work plus its wait for the first forward."""
    times = [{"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 2.0, "B": 2.0, "W": 2.0}]
    timeline = simulate(one_f_one_b(2, 4), stage_times=times)
    assert timeline.busy == [12.0, 24.0]
    assert timeline.makespan == 1.0 + 24.0 + 2.0  # F0 arrives at 1; stage 0's last B waits
    uniform = simulate(one_f_one_b(2, 4), stage_times=[times[0]] * 2)
    assert uniform.bubble == pytest.approx(bubble_formula("1f1b", 2, 4))
