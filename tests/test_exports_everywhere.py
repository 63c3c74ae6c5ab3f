"""Run folders and export folders are accepted alike by ``eval``, ``generate`` and
``fibattn.from_pretrained``; the wrong kind of folder names the command that makes the right one."""
import io
import json
from argparse import Namespace

import pytest
import torch

import fibattn
from fibattn.cli import main
from fibattn.cli import generate as G
from fibattn.storage.export import export_run
from fibattn.storage.pretrained import ExportError, load_pretrained
from fibattn.trainer.trainer import train
from run_helpers import micro_config


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("exports")
    cfg = micro_config(root / "run", tiny_data, steps=3, batch_tokens=64, micro_batch=2, results_db="off",
                       eval_tokens=64)
    train(cfg)
    export_run(root / "run", root / "exp")
    return root / "run", root / "exp", tiny_data


def eval_rows(path) -> dict:
    return {(r["dataset"], r["length"]): r["ppl"] for r in json.loads(path.read_text())["results"]}


def test_eval_of_an_export_equals_the_runs(run_and_export, tmp_path, capsys):
    run, exp, data = run_and_export
    common = ["--lengths", "32,128", "--tokens", "512", "--db", "off", "--no-plot"]
    assert main(["eval", str(run), "--json", str(tmp_path / "run.json"), *common]) == 0
    assert main(["eval", str(exp), "--data", str(data), "--json", str(tmp_path / "exp.json"), *common]) == 0
    assert eval_rows(tmp_path / "run.json") == eval_rows(tmp_path / "exp.json")
    # no flags: the export carries the run's eval settings (lengths, tokens), so the defaults agree too
    bare = ["--db", "off", "--no-plot"]
    assert main(["eval", str(run), "--json", str(tmp_path / "run2.json"), *bare]) == 0
    assert main(["eval", str(exp), "--data", str(data), "--json", str(tmp_path / "exp2.json"), *bare]) == 0
    assert eval_rows(tmp_path / "run2.json") == eval_rows(tmp_path / "exp2.json")
    capsys.readouterr()
    assert main(["eval", str(exp), *common]) == 2                     # an export records no data folder
    assert "--data" in capsys.readouterr().err


def test_generate_from_an_export_equals_the_runs(run_and_export):
    run, exp, _ = run_and_export
    outs = []
    for path in (run, exp):
        buf = io.StringIO()
        args = Namespace(run_dir=str(path), prompt="ROMEO:", max_new_tokens=12, temperature=0.8, top_k=0, top_p=1.0,
                         seed=3, step="latest", device="cpu", threads=0, overrides=["model.reach=train"])
        assert G.run(args, out=buf) == 0
        outs.append(buf.getvalue())
    assert outs[0] == outs[1] and len(outs[0]) > len("ROMEO:")


def test_from_pretrained_takes_runs_checkpoints_and_exports(run_and_export):
    run, exp, _ = run_and_export
    x = torch.randint(0, 256, (1, 20))
    models = [fibattn.from_pretrained(p) for p in (run, run / "checkpoints" / "step-3", exp)]
    logits = [m(x) for m in models]
    for out in logits[1:]:
        torch.testing.assert_close(out, logits[0])
    assert all(m.tokenizer is not None for m in models)
    with pytest.raises(ExportError, match="fibattn export"):
        load_pretrained(run)


def test_an_exports_bad_eval_settings_are_named(run_and_export, tmp_path, capsys):
    import shutil
    run, exp, data = run_and_export
    bad = tmp_path / "exp"
    shutil.copytree(exp, bad)
    meta = json.loads((bad / "config.json").read_text())
    for value in ({"lengths": "32"}, {"lengths": [0]}, ["x"]):
        meta["eval"] = value
        (bad / "config.json").write_text(json.dumps(meta))
        assert main(["eval", str(bad), "--data", str(data), "--db", "off", "--no-plot"]) == 2
        err = capsys.readouterr().err
        assert "eval" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
