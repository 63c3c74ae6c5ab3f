"""Bases, alpha schedules, distance sets and interpolation plans (method.md §1–3)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fibattn.schedules import (Base, LearnedAlphas, as_base, attended_distances, coprime_slots, coprime_stride,
                               fib_base, interpolation_plan, layer_alphas, pow2_base)

FIB15 = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987]
WIN12 = list(range(13))


# ----------------------------------------------------------------------------- bases
def test_fib_base_is_the_fibonacci_numbers_from_1_2():
    assert fib_base(15) == FIB15
    assert fib_base(1) == [1]
    assert fib_base(2) == [1, 2]


def test_pow2_base():
    assert pow2_base(0) == []
    assert pow2_base(1) == [1]
    assert pow2_base(4095) == [2 ** i for i in range(12)]


def test_as_base_accepts_names_lists_and_tensors():
    assert as_base("fib") == Base("fib", k=15)
    assert as_base("fib:20").resolve(10) == fib_base(20)
    assert as_base("pow2").resolve(100) == [1, 2, 4, 8, 16, 32, 64]
    assert as_base([3, 7]).resolve(5) == [3, 7]
    assert as_base(torch.tensor([2, 9])).resolve(5) == [2, 9]


# ----------------------------------------------------------------------------- schedules
def test_coprime_slots_for_16_layers():
    assert coprime_stride(16) == 7
    assert coprime_slots(16) == [0, 7, 14, 5, 12, 3, 10, 1, 8, 15, 6, 13, 4, 11, 2, 9]


def test_linear_runs_from_a_min_to_a_max():
    alphas = layer_alphas("linear", 16)
    assert alphas[0] == 0.5 and alphas[-1] == 1.5
    assert all(math.isclose(a, 0.5 + i / 15) for i, a in enumerate(alphas))
    assert layer_alphas("linear", 1) == [0.5]


def test_coprime_is_linear_permuted_by_the_slots():
    lin = layer_alphas("linear", 16)
    assert layer_alphas("coprime", 16) == [lin[s] for s in coprime_slots(16)]
    assert sorted(layer_alphas("coprime", 16)) == lin


def test_fixed_custom_and_learned_start():
    assert layer_alphas("fixed", 3) == [1.0, 1.0, 1.0]
    assert layer_alphas("fixed", 2, value=1.25) == [1.25, 1.25]
    assert layer_alphas("custom", 2, values=[0.7, 1.2]) == [0.7, 1.2]
    assert layer_alphas("learned", 2) == [1.0, 1.0]


# ----------------------------------------------------------------------------- distance sets
def test_fib_w12_alpha1():
    assert attended_distances(12, 1.0, "fib", 1024) == WIN12 + [13, 21, 34, 55, 89, 144, 233, 377, 610, 987]


def test_fib_w12_alpha_half():
    # 0.5*b = ... 17, 27.5, 44.5, 72, 116.5, 188.5, 305, 493.5; round half to even
    expected = WIN12 + [17, 28, 44, 72, 116, 188, 305, 494]
    assert attended_distances(12, 0.5, "fib", 1024) == expected


def test_fib_w12_alpha_one_and_a_half():
    # 1.5*b = 19.5, 31.5, 51, 82.5, 133.5, 216, 349.5, 565.5, 915, (1480.5 > cap)
    expected = WIN12 + [20, 32, 51, 82, 134, 216, 350, 566, 915]
    assert attended_distances(12, 1.5, "fib", 1024) == expected
    assert attended_distances(12, 1.5, "fib", 4096)[-1] == 1480


def test_pow2_at_4096_with_and_without_reach():
    assert attended_distances(12, 1.0, "pow2", 4096) == WIN12 + [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert attended_distances(12, 1.0, "pow2", 4096, reach=1024) == WIN12 + [16, 32, 64, 128, 256, 512]


def test_short_sequences_clip_the_window():
    assert attended_distances(12, 1.0, "fib", 5) == [0, 1, 2, 3, 4]
    assert attended_distances(0, 1.0, "fib", 1) == [0]


def test_interpolation_plan_by_hand():
    plan = interpolation_plan(12, 1.3, "fib", 1024)
    # 1.3*b: 16.9, 27.3, 44.2, 71.5, 115.7, 187.2, 302.9, 490.1, 793, (1283.1 > cap)
    assert plan.window == tuple(WIN12)
    assert [lo for lo, _ in plan.rungs] == [16, 27, 44, 71, 115, 187, 302, 490, 793]
    assert [b for _, b in plan.rungs] == FIB15[5:14]
    assert plan.span == 795        # entry 793 + 1 is read too


def test_interpolation_plan_drops_repeated_lo():
    # alpha=0.4, base [33, 34]: 13.2 and 13.6 both floor to 13 (rounding to 13 and 14 > W=12)
    plan = interpolation_plan(12, 0.4, [33, 34], 100)
    assert plan.rungs == ((13, 33),)


# ----------------------------------------------------------------------------- learned
def test_learned_theta_zero_is_alpha_one():
    la = LearnedAlphas(16)
    assert torch.allclose(la(), torch.ones(16))
    assert la.alpha(3).item() == pytest.approx(1.0)


def test_learned_init_round_trips():
    start = layer_alphas("linear", 16)
    la = LearnedAlphas(16, init=start)
    torch.testing.assert_close(la().double(), torch.tensor(start, dtype=torch.float64), atol=2e-6, rtol=0)


def test_learned_stays_inside_its_bounds():
    la = LearnedAlphas(4, a_min=0.25, a_max=2.0)
    with torch.no_grad():
        la.theta.copy_(torch.tensor([-1e3, -3.0, 3.0, 1e3]))
    a = la()
    assert a.min().item() >= 0.25 and a.max().item() <= 2.0
    assert a[0].item() == pytest.approx(0.25) and a[-1].item() == pytest.approx(2.0)


def test_learned_gradient_reaches_theta():
    """d alpha / d theta = (a_max - a_min) * sigmoid(theta) * (1 - sigmoid(theta)), per layer."""
    la = LearnedAlphas(4, a_min=0.25, a_max=2.0)
    thetas = [-2.0, -0.3, 0.0, 1.7]
    with torch.no_grad():
        la.theta.copy_(torch.tensor(thetas))
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])
    (la() * weights).sum().backward()
    sig = [1 / (1 + math.exp(-t)) for t in thetas]
    want = torch.tensor([w * 1.75 * s * (1 - s) for w, s in zip(weights.tolist(), sig)])
    torch.testing.assert_close(la.theta.grad, want)
    # alpha(layer) is the same function of theta[layer], with the same derivative
    for i, s in enumerate(sig):
        la.zero_grad()
        a = la.alpha(i)
        assert a.item() == pytest.approx(0.25 + 1.75 * s)
        a.backward()
        grad = la.theta.grad
        torch.testing.assert_close(grad[i], torch.tensor(1.75 * s * (1 - s)))
        assert torch.count_nonzero(grad).item() == 1


# ----------------------------------------------------------------------------- bad input
BAD = [
    (lambda: attended_distances(-1, 1.0, "fib", 16), "window"),
    (lambda: interpolation_plan(-2, 1.0, "fib", 16), "window"),
    (lambda: fib_base(0), "k"),
    (lambda: Base("fib", k=0), "k"),
    (lambda: as_base("fib:0"), "k"),
    (lambda: attended_distances(4, 0.0, "fib", 16), "alpha"),
    (lambda: attended_distances(4, -1.0, "fib", 16), "alpha"),
    (lambda: interpolation_plan(4, float("nan"), "fib", 16), "alpha"),
    (lambda: layer_alphas("fixed", 4, value=2.0), "a_min, a_max"),
    (lambda: layer_alphas("custom", 2, values=[1.0, 0.2]), "a_min, a_max"),
    (lambda: LearnedAlphas(2, init=[1.0, 3.0]), "a_min, a_max"),
    (lambda: layer_alphas("linear", 4, a_min=2.0, a_max=1.0), "a_min"),
    (lambda: LearnedAlphas(2, a_min=2.0, a_max=1.0), "a_min"),
    (lambda: layer_alphas("linear", 0), "n_layers"),
    (lambda: LearnedAlphas(0), "n_layers"),
    (lambda: coprime_slots(0), "n_layers"),
    (lambda: layer_alphas("custom", 3, values=[1.0, 1.0]), "values"),
    (lambda: layer_alphas("nope", 3), "schedule"),
    (lambda: as_base([1, 0]), "base"),
    (lambda: as_base([1, -3]), "base"),
    (lambda: as_base([1, 2.5]), "base"),
    (lambda: as_base([]), "base"),
    (lambda: as_base("fibonacci"), "base"),
    (lambda: Base("odd"), "base kind"),
    (lambda: attended_distances(4, 1.0, "fib", 0), "seq_len"),
    (lambda: interpolation_plan(4, 1.0, "fib", -5), "seq_len"),
    (lambda: attended_distances(4, 1.0, "fib", 16, reach=0), "reach"),
]


@pytest.mark.parametrize("call,name", BAD, ids=[f"{i}-{n}" for i, (_, n) in enumerate(BAD)])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# ----------------------------------------------------------------------------- properties
bases = st.one_of(
    st.integers(1, 20).map(lambda k: f"fib:{k}"),
    st.just("pow2"),
    st.lists(st.integers(1, 3000), min_size=1, max_size=12),
)
alphas = st.floats(0.05, 4.0, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(window=st.integers(0, 40), alpha=alphas, base=bases, seq_len=st.integers(1, 5000),
       reach=st.none() | st.integers(1, 5000))
def test_distance_set_properties(window, alpha, base, seq_len, reach):
    d = attended_distances(window, alpha, base, seq_len, reach=reach)
    cap = seq_len - 1 if reach is None else min(seq_len, reach) - 1
    assert d == sorted(set(d))
    assert set(range(min(window, cap) + 1)) <= set(d)
    assert d[-1] <= cap
    values = as_base(base).resolve(seq_len, reach)
    extra = set(d) - set(range(window + 1))
    assert extra == {round(alpha * b) for b in values if window < round(alpha * b) <= cap}


@settings(max_examples=150, deadline=None)
@given(window=st.integers(0, 40), alpha=alphas, base=bases, seq_len=st.integers(1, 5000),
       reach=st.none() | st.integers(1, 5000))
def test_interpolation_plan_properties(window, alpha, base, seq_len, reach):
    plan = interpolation_plan(window, alpha, base, seq_len, reach=reach)
    cap = seq_len - 1 if reach is None else min(seq_len, reach) - 1
    assert plan.window == tuple(range(min(window, cap) + 1))
    los = [lo for lo, _ in plan.rungs]
    assert len(los) == len(set(los))
    for lo, b in plan.rungs:
        t = alpha * b
        assert lo == math.floor(t) and window < lo <= cap and round(t) > window
        assert 0 <= t - lo < 1
    used_b = {b for _, b in plan.rungs}
    for b in as_base(base).resolve(seq_len, reach):     # every dropped rung had a reason
        lo = math.floor(alpha * b)
        if b not in used_b:
            assert round(alpha * b) <= window or lo > cap or lo <= window or lo in los
    e = plan.entries
    assert e == sorted(set(e)) and plan.span == e[-1] + 1
    assert set(plan.window) | set(los) | {lo + 1 for lo in los} == set(e)


@settings(max_examples=60, deadline=None)
@given(window=st.integers(0, 30), alpha=st.sampled_from([1.0, 2.0, 3.0]), base=bases,
       seq_len=st.integers(1, 3000))
def test_integer_alpha_plan_matches_the_distance_set(window, alpha, base, seq_len):
    plan = interpolation_plan(window, alpha, base, seq_len)
    assert sorted(set(plan.window) | {lo for lo, _ in plan.rungs}) == attended_distances(window, alpha, base, seq_len)
