import json
import re

import pytest

from fibattn.study import grid as G
from fibattn.study import report as Rp
from fibattn.study.headline import check_table, headline_check
from fibattn.study import published as S
from fibattn.cli import main as cli_main
from fibattn.study.pages import Image, Table, Text, to_html
from fibattn.storage.results import ResultsDB


def rr(name, variant, window, ppl, seed=42, T=1024):
    return Rp.RunResult(name, variant, window, seed, T, ppl=dict(ppl))


def at(fw, wp, T=1024, lengths=(1, 2, 4), growth=1.0):
    out = {}
    for k in lengths:
        g = growth ** (k.bit_length() - 1)
        out[("fineweb_edu", k * T)] = fw * g
        out[("wikipedia", k * T)] = wp * g
    return out


def synthetic():
    return [
        rr("dense", "dense", None, at(33.0, 27.0, growth=1.8)),
        rr("fib_fixed_w6", "fixed", 6, at(44.0, 40.0)),
        rr("fib_stagger_w6", "linear", 6, at(43.0, 38.5)),
        rr("fib_stagger_w12", "linear", 12, {("fineweb_edu", 1024): 40.0, ("fineweb_edu", 2048): 44.0,
                                             ("fineweb_edu", 4096): 38.0, ("wikipedia", 1024): 36.0}),
        rr("fib_hdc_w12", "coprime", 12, at(42.1, 37.7)),
        rr("logsparse_stagger_w12", "pow2+linear", 12, at(42.7, 38.5)),
        rr("logsparse_w8", "pow2+fixed", 8, at(44.8, 40.9)),
        rr("fib_stagger_w12_s43", "linear", 12, at(41.0, 37.0), seed=43),
        rr("fib_stagger_w12_s44", "linear", 12, at(42.0, 38.0), seed=44),
    ]


def test_main_table_places_cells():
    t = Rp.main_table(synthetic(), ["fineweb_edu", "wikipedia"])
    assert t.header == ["W", "fixed", "learned", "linear (stagger)", "coprime (HDC)", "pow2 linear",
                        "window (rungs off)", "window (matched cost)"]
    assert [row[0] for row in t.rows] == ["6", "12"]
    assert t.rows[0][1] == "44.00 / 40.00" and t.rows[0][3] == "43.00 / 38.50" and t.rows[0][2] == "—"
    assert t.rows[1][3] == "40.00 / 36.00"              # seed 42 run, not the replicates
    assert t.rows[1][4] == "42.10 / 37.70" and t.rows[1][5] == "42.70 / 38.50"
    assert (0, 3) in t.bold and (1, 3) in t.bold        # lowest FW in each row
    assert "dense: 33.00 / 27.00" in t.note and "pow2 fixed, W=8: 44.80 / 40.90" in t.note
    assert "1024" in t.title and "FW / WP" in t.title


def test_extrapolation_table_percent_change():
    t = Rp.extrapolation_table(Rp.primary(synthetic()), ["fineweb_edu", "wikipedia"])
    assert t.header[:4] == ["model", "FW 1024 (1×)", "FW 2048 (2×)", "FW 4096 (4×)"]
    row = next(r for r in t.rows if r[0] == "fib_stagger_w12")
    assert row[1:4] == ["40.00", "44.00 (+10.0 %)", "38.00 (-5.0 %)"] and row[5:7] == ["—", "—"]
    dense = next(r for r in t.rows if r[0] == "dense")
    assert dense[3] == "106.92 (+224.0 %)"
    assert Rp.pct_change(33.37, 100.36) == pytest.approx(200.75, abs=0.01) and Rp.pct_change(None, 1) is None


def test_study_comparison_shows_the_study_numbers():
    t = Rp.study_table(synthetic())
    row = next(r for r in t.rows if r[0] == "fib_stagger_w12")
    assert row[1] == "40.00 / 42.02 / -4.8 %"
    assert row[4] == "38.00 / 41.45 / -8.3 %" and row[5] == "-5.0 % / -1.4 %"
    rep = next(r for r in t.rows if r[0] == "fib_stagger_w12_s43")
    assert rep[1] == "41.00 / 41.96 / -2.3 %" and rep[3] == "— / 5.32 / —"
    assert Rp.study_table([rr("dense", "dense", None, at(3, 3, T=128), T=128)]) is None     # other length
    assert S.study_ppl("fib_hdc_w10", "wikipedia", 4096) == 38.67 and S.study_ppl("dense", "tinystories", 1024) is None
    assert S.study_ppl("fib_learned_w12_s44", "fineweb_edu", 1024) is None


def test_seed_table():
    t = Rp.seed_table(synthetic(), ["fineweb_edu", "wikipedia"])
    assert t.header == ["model", "seed 42", "seed 43", "seed 44", "FW mean ± sd"]
    assert t.rows == [["fib linear (stagger), W=12", "40.00 / 36.00", "41.00 / 37.00", "42.00 / 38.00", "41.00 ± 1.00"]]


def test_headline_check_pass_fail():
    res = [rr("dense", "dense", None, {("d", 128): 10.0, ("d", 512): 16.0}, T=128),
           rr("a", "linear", 8, {("d", 128): 10.0, ("d", 512): 10.4}, T=128),
           rr("b", "fixed", 8, {("d", 128): 10.0, ("d", 512): 10.6}, T=128),
           rr("c", "coprime", 8, {("d", 128): 10.0, ("d", 512): 9.51}, T=128),
           rr("e", "learned", 8, {("d", 128): 10.0}, T=128)]
    checks = headline_check(res, "d", 4)
    assert [c.passed for c in checks] == [True, True, False, True, False]
    assert checks[0].change == pytest.approx(60.0) and checks[0].study == "+200.7 %"
    res[0].ppl[("d", 512)] = 14.0
    assert not headline_check(res, "d", 4)[0].passed
    t = check_table(checks, "d", 4)
    assert [r[5] for r in t.rows] == ["PASS", "PASS", "FAIL", "PASS", "FAIL"]


def test_html_is_self_contained(tmp_path):
    from fibattn.plots import Panel, Series, save_panels
    png = save_panels(tmp_path / "a.png", [Panel("t", "x", "y", [Series("s", [1, 2], [3, 4])])])
    page = to_html("T <x>", [Text("a & b"), Table("tab", ["h"], [["1"]]), Image(png, "cap")])
    assert "src='data:image/png;base64," in page and "&lt;x&gt;" in page and "a &amp; b" in page
    assert not re.search(r"(src|href)\s*=\s*['\"](?!data:)", page) and "<link" not in page


def test_inline_markdown_in_html():
    from fibattn.study.pages import inline_html
    assert inline_html("run `a<b` is **best** & done") == "run <code>a&lt;b</code> is <strong>best</strong> &amp; done"
    table = Table("t", ["h"], [["1"]], note="Bold: lowest")
    assert "Bold" in table.html()


def _fake_results(root, grid, lengths, base=10.0):
    """Record synthetic evaluations for every run of ``grid`` (and an eval.json for two of them)."""
    with ResultsDB(root / "results.sqlite") as db:
        for i, run in enumerate(grid.runs):
            cfg = grid.config(run, root)
            db.start_run(run.name, config={}, out_dir=str(root / run.name))
            db.finish_run(run.name)
            for k, n in enumerate(lengths):
                grow = 2.0 if run.name == "dense" else 1.0 + 0.01 * i
                db.log_eval(run.name, "shakespeare", n, cfg.eval.reach, ppl=(base + i) * grow ** k)
    for name in ("dense", "fib_learned"):
        (root / name).mkdir(parents=True, exist_ok=True)
        doc = {"results": [{"dataset": "shakespeare", "length": n, "mode": "study",
                            "buckets": [{"start": 0, "end": n // 2, "loss": 2.0}, {"start": n // 2, "end": n,
                                                                                    "loss": 1.5}]}
                           for n in lengths]}
        if name == "fib_learned":
            doc["alphas"] = {"end": [1.0, 1.01, 0.99, 1.02], "largest_move_line": "largest move from start: layer 3"}
        (root / name / "eval.json").write_text(json.dumps(doc))


def test_report_end_to_end_from_database(tmp_path, capsys):
    root = tmp_path / "demo"
    grid = G.demo_grid()
    model = grid.config(grid.runs[0], root).model
    T, W = model.seq_len, model.window
    _fake_results(root, grid, [T, 4 * T])
    assert cli_main(["report", "demo", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "Perplexity at the training length" in out and "report.html" in out
    md = (root / "report" / "report.md").read_text()
    assert "| dense | 10.00 | 20.00 (+100.0 %) |" in md and f"| {W} | **11.00** | 12.00 | 13.00 | 14.00 | 18.00 | 15.00 | 16.00 |" in md
    assert "| fib coprime (HDC) | 14.00 | 14.56 | +4.0 % | within ±5 % | PASS | +1.2 … +4.2 % |" in md
    assert f"{len(grid.runs)} of {len(grid.runs)} runs evaluated." in md
    assert "fib_learned: largest move from start: layer 3" in md and "PASS" in md and "Ours vs the study" not in md
    for png in ("ppl_vs_length.png", "per_position_loss.png", "alphas.png", "distances.png"):
        assert (root / "report" / png).is_file() and f"]({png})" in md
    page = (root / "report" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and not re.search(r"(src|href)\s*=\s*['\"](?!data:)", page)
    assert "`" not in page and "<code>demo</code>" in page and "**" not in page     # Markdown rendered
    steps = grid.config(grid.runs[0], root).train.steps
    assert "## Settings" in md and f"`train.steps` {steps}" in md and "What sets the runs apart" in md
    assert "| dense | dense | — |" in md                               # sparse-only settings blank for dense


def test_paper_report_compares_with_study(tmp_path):
    root = tmp_path / "paper"
    grid = G.build_grid("paper", only="dense,fib_stagger_w12")
    with ResultsDB(root / "results.sqlite") as db:
        for name, fw in (("dense", 30.0), ("fib_stagger_w12", 42.0)):
            for n in (1024, 2048, 4096):
                db.log_eval(name, "fineweb_edu", n, "study", ppl=fw * (n / 1024 if name == "dense" else 1))
                db.log_eval(name, "wikipedia", n, "study", ppl=fw - 4)
    files = Rp.build_report(grid, root, tmp_path / "out", plot=False)
    md = files.markdown.read_text()
    assert "| fib_stagger_w12 | 42.00 / 42.02 / -0.0 % | 38.00 / 37.59 / +1.1 % |" in md
    assert "| 12 | — | — | 42.00 / 38.00 | — | — |" in md
    assert [c.passed for c in files.checks] == [True, True] and files.factor == 4
    with pytest.raises(ValueError, match="--datasets: no results for 'maths'"):
        Rp.build_report(grid, root, tmp_path / "out", datasets=["maths"], plot=False)
