"""Pipeline schedules checked on their instruction lists alone (models/schedule.py)."""

import pytest

from dtlab.models.schedule import (
    SCHEDULES,
    Op,
    bubble_formula,
    chunks,
    dualpipe_v,
    gpipe,
    in_flight,
    interleaved,
    make,
    one_f_one_b,
    simulate,
    validate,
    virtual_stage,
    zb_h1,
    zb_v,
)

SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, p, 2 * p, 3 * p + 1)]
GROUPED = [(p, m) for p in (1, 2, 3, 4) for m in (p, 2 * p, 3 * p)]  # m a multiple of p


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p,m", SIZES)
def test_every_pass_once_in_order(name, p, m):
    if name == "interleaved" and m % p:
        pytest.skip("interleaved 1F1B needs m a multiple of p (test_interleaved_sizes_and_chunks)")
    if name == "dualpipev" and m < 2 * p:
        pytest.skip("DualPipeV needs m >= 2p (test_v_schedules_sizes_and_formula_range)")
    ops = make(name, p, m)
    assert len(ops) == p
    validate(ops, m)  # each F, B, W once; B after F, W after B; same order on every stage


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("p,m", GROUPED)
def test_interleaved_every_chunk_once_in_order(p, m, v):
    ops = interleaved(p, m, v)
    validate(ops, m)
    assert {op.chunk for stage in ops for op in stage} == set(range(v))
    # warm-up (p - r - 1) + (v - 1) p forwards, then one more before each backward
    assert [in_flight(s) for s in ops] == [min(p - r + (v - 1) * p, m * v) for r in range(p)]


@pytest.mark.parametrize("p,m", SIZES)
def test_interleaved_with_one_chunk_is_1f1b(p, m):
    assert interleaved(p, m, 1) == one_f_one_b(p, m)


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("p,m", GROUPED)
@pytest.mark.parametrize("times", [(1, 1, 1), (1, 2, 0), (1.0, 1.5, 0.5)])
def test_interleaved_bubble_is_1f1b_over_v(p, m, v, times):
    """Each rank idles (p - 1)(F + B + W) of one chunk's passes: (p - 1) / (v m) of its
    work, 1/v of 1F1B's idle time (Narayanan et al. 2021)."""
    timeline = simulate(interleaved(p, m, v), *times)
    assert timeline.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert timeline.bubble == pytest.approx(
        bubble_formula("interleaved", p, m, *times, v=v), abs=1e-12)
    base = simulate(one_f_one_b(p, m), *(v * t for t in times))  # the same model in p stages
    assert all(i == pytest.approx(b / v) for i, b in zip(timeline.idle, base.idle, strict=True))


def test_interleaved_sizes_and_chunks():
    with pytest.raises(ValueError, match="m=6 is not a multiple of p=4"):
        interleaved(4, 6, 2)
    assert chunks("interleaved") == 2 and chunks("interleaved", 3) == 3
    assert chunks("1f1b") == chunks("zb-h1", 1) == 1
    with pytest.raises(ValueError, match="1f1b runs 1 model chunk"):
        make("1f1b", 2, 4, v=2)
    with pytest.raises(ValueError, match="at least 1 virtual stage"):
        chunks("interleaved", 0)
    assert make("interleaved", 2, 4) == interleaved(2, 4, 2)


def test_interleaved_shape():
    """p = 2, v = 2, m = 2: rank r holds stages r and 2 + r; rank 0 warms up with 3
    forwards, rank 1 with 2; backwards run the chunks in reverse."""
    F, BW = (lambda i, c: Op("F", i, c)), (lambda i, c: Op("BW", i, c))
    assert interleaved(2, 2, 2) == [
        [F(0, 0), F(1, 0), F(0, 1), F(1, 1), BW(0, 1), BW(1, 1), BW(0, 0), BW(1, 0)],
        [F(0, 0), F(1, 0), F(0, 1), BW(0, 1), F(1, 1), BW(1, 1), BW(0, 0), BW(1, 0)],
    ]


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


V_SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 3 * p, 5 * p)]


@pytest.mark.parametrize("p,m", V_SIZES)
def test_v_schedules_place_two_chunks_in_a_v(p, m):
    for ops in (zb_v(p, m), dualpipe_v(p, m)):
        assert ops.layout == "v"
        validate(ops, m)  # each chunk's F, B, W once and in order; ranks agree on order
        assert sorted(virtual_stage("v", p, r, c) for r in range(p) for c in (0, 1)) == \
            list(range(2 * p))
    # ZB-V holds 1F1B's peak (2p half-stage contexts = p stages), DualPipeV one more
    assert max(in_flight(s) for s in zb_v(p, m)) == 2 * p
    assert max(in_flight(s, until="W") for s in zb_v(p, m)) == 2 * p
    assert max(in_flight(s) for s in dualpipe_v(p, m)) == 2 * p + 1


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m < 2 * p - 1])
def test_zb_v_with_few_micro_batches_stays_valid(p, m):
    validate(zb_v(p, m), m)
    simulate(zb_v(p, m))  # no deadlock


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
@pytest.mark.parametrize("p,m", V_SIZES)
def test_v_schedules_bubble_at_equal_pass_times(name, p, m):
    """With t_F = t_B = t_W = t every rank idles 2(p - 1) t in ZB-V (ZB-H1's idle in
    half-stage passes) and (p - 1) t in DualPipeV (DeepSeek's (PP/2 - 1)(F&B + B - 3W)
    with PP = 2p, B = 2t, W = t, F&B = 2t)."""
    for t in (1.0, 0.5):
        line = simulate(make(name, p, m), t, t, t)
        per_rank = (2 if name == "zb-v" else 1) * (p - 1) * t
        assert line.idle == pytest.approx([per_rank] * p, abs=1e-12)
        assert line.bubble == pytest.approx(bubble_formula(name, p, m, t, t, t), abs=1e-12)
    zb = simulate(zb_h1(p, m), 2, 2, 2)  # the same model in p stages of two chunks each
    assert simulate(zb_v(p, m)).idle == pytest.approx(zb.idle)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8)])
@pytest.mark.parametrize("times", [(1, 2, 0), (1.0, 1.5, 0.5), (2, 1, 1), (1, 2, 1)])
def test_dualpipe_v_within_its_published_bound(p, m, times):
    """DeepSeek's (p - 1)(F&B + B - 3W) with the pair run back to back (F&B = F + B + W,
    B a full backward B + W) bounds the replay's idle at unequal pass times."""
    t_f, t_b, t_w = times
    bound = (p - 1) * ((t_f + t_b + t_w) + (t_b + t_w) - 3 * t_w)
    assert max(simulate(dualpipe_v(p, m), *times).idle) <= bound + 1e-12


def test_v_schedules_sizes_and_formula_range():
    with pytest.raises(ValueError, match="DualPipeV needs at least 2p = 8 micro-batches"):
        dualpipe_v(4, 7)
    with pytest.raises(ValueError, match="zb-v runs 2 model chunk"):
        make("zb-v", 2, 4, v=3)
    with pytest.raises(ValueError, match="given for t_F = t_B = t_W"):
        bubble_formula("dualpipev", 2, 4, 1, 2, 0)


def test_v_schedules_equal_pytorchs():
    """The lists equal those torch.distributed.pipelining builds for ScheduleZBVZeroBubble
    and ScheduleDualPipeV (its overlapped pairs as F, then the full backward)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules",
                                    reason="PyTorch not installed")
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W",
             "FULL_BACKWARD": "BW"}

    def theirs(cls, p, m):
        if not hasattr(cls, "_calculate_single_rank_operations"):
            pytest.skip(f"this PyTorch's {cls.__name__} builds its lists otherwise")
        out = []
        for r in range(p):
            owner = type("Sizes", (), {"pp_group_size": p, "_n_microbatches": m,
                                       "num_stages": 2 * p, "_num_stages": 2 * p})()
            ops = []
            for action in cls._calculate_single_rank_operations(owner, r):
                for a in (action.sub_actions or [action]) if action else []:
                    ops.append(Op(kinds[a.computation_type.name], a.microbatch_index,
                                  0 if a.stage_index == r else 1))
            out.append(ops)
        return out

    for p, m in [(2, 4), (2, 5), (3, 6), (3, 10), (4, 8), (4, 9)]:
        assert zb_v(p, m) == theirs(schedules.ScheduleZBVZeroBubble, p, m)
        assert dualpipe_v(p, m) == theirs(schedules.ScheduleDualPipeV, p, m)
