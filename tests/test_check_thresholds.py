"""The report's and the demo's pass/fail checks on both sides of each threshold, exactly at it, and at
a headline multiple other than the default 4 (so that a hard-coded 4 cannot pass for the factor)."""
import pytest

from fibattn.study import demo as D
from fibattn.study import headline as H
from fibattn.study import report as Rp
from fibattn.study.pages import pct_change
from fibattn.study.retrofit_report import GAP_GOAL_PCT, HOLD_GOAL_PCT, retrofit_checks, retrofits

T = 32


def _run(name, variant, short, long, factor=4, **kw):
    return Rp.RunResult(name, variant, None if variant == "dense" else 8, 42, T,
                        {("s", T): short, ("s", factor * T): long}, **kw)


# (short, long) perplexities whose change is exactly the goal, just inside it and just outside it
DENSE = [((8.0, 12.0), True), ((100.0, 150.1), True), ((100.0, 149.9), False), ((100.0, 100.0), False)]
SPARSE = [((100.0, 105.0), True), ((100.0, 95.0), True), ((100.0, 100.0), True), ((100.0, 105.1), False),
          ((100.0, 94.9), False), ((100.0, 80.0), False)]


@pytest.mark.parametrize("factor", [4, 2])
@pytest.mark.parametrize("ppl, ok", DENSE)
def test_dense_goal_on_both_sides(factor, ppl, ok):
    assert pct_change(8.0, 12.0) == H.DENSE_GOAL_PCT             # the exact case is exact in floats
    check = H.headline_check([_run("dense", "dense", *ppl, factor=factor)], "s", factor)[0]
    assert check.passed is ok and check.change == pytest.approx(pct_change(*ppl))


@pytest.mark.parametrize("factor", [4, 2])
@pytest.mark.parametrize("ppl, ok", SPARSE)
def test_sparse_tolerance_on_both_sides(factor, ppl, ok):
    # within ± tol: a sparse model that gets much *better* at the long length is outside it too
    assert pct_change(100.0, 105.0) == H.SPARSE_TOL_PCT
    check = H.headline_check([_run("fib", "linear", *ppl, factor=factor)], "s", factor)[0]
    assert check.passed is ok


def test_demo_verdict_needs_every_check():
    res = [_run("dense", "dense", 8.0, 12.0), _run("fib_a", "linear", 10.0, 10.0), _run("fib_b", "linear", 10.0, 20.0)]
    lines = D.headline_lines(H.headline_check(res, "s", 4), "s", 4, T)
    assert [ln.split()[0] for ln in lines[1:4]] == ["PASS", "PASS", "FAIL"]
    assert lines[-1] == "Headline: 2/3 PASS — see FAIL lines above"
    lines = D.headline_lines(H.headline_check(res[:2], "s", 4), "s", 4, T)
    assert lines[-1] == "Headline: 2/2 PASS — dense degrades and the sparse variants hold"


@pytest.mark.parametrize("mults, factor", [((1, 2), 2), ((1, 2, 3), 3), ((1, 2, 4, 8), 4), ((1,), None),
                                           ((1, 8), 8)])
def test_headline_factor(mults, factor):
    r = Rp.RunResult("x", "linear", 8, 42, T, {("s", m * T): 10.0 for m in mults} | {("s", T + 1): 10.0})
    assert H.headline_factor([r]) == factor


def _retrofit(short=103.0, long=103.0, dense_long=150.0, ft_steps=50, factor=4):
    def run(name, variant, steps, a, b, init=""):
        return Rp.RunResult(name, variant, None if variant == "dense" else 6, 42, T, steps=steps, init_from=init,
                            ppl={("s", T): a, ("s", factor * T): b})
    results = [run("dense", "dense", 500, 100.0, dense_long), run("fib", "linear", 500, 100.0, 100.0),
               run("ft", "linear", ft_steps, short, long, "dense")]
    return {n: ok for n, ok, _ in retrofit_checks(retrofits(results), "s", factor)}


@pytest.mark.parametrize("factor", [4, 2])
def test_retrofit_goals_on_both_sides(factor):
    assert pct_change(100.0, 103.0) == GAP_GOAL_PCT and pct_change(100.0, 105.0) == HOLD_GOAL_PCT
    at = f"ft at {factor}×"
    assert _retrofit(factor=factor) == {"dense source collapses": True, "ft at 1×": True, at: True}
    assert _retrofit(short=100.0, long=105.0, factor=factor) == {"dense source collapses": True, "ft at 1×": True,
                                                                 at: True}
    assert _retrofit(short=103.1, long=103.1, factor=factor)["ft at 1×"] is False
    assert _retrofit(short=100.0, long=105.1, factor=factor)[at] is False
    assert _retrofit(dense_long=149.9, factor=factor)["dense source collapses"] is False
    assert _retrofit(dense_long=150.0, factor=factor)["dense source collapses"] is True
    # the fine-tune share: exactly 10 % of the source's steps counts, more does not
    assert "ft at 1×" in _retrofit(ft_steps=50, factor=factor)
    assert "ft at 1×" not in _retrofit(ft_steps=51, factor=factor)
